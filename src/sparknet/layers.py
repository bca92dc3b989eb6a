"""The NetParams layer DSL (Listing 2 of the SparkNet paper) and :class:`GraphModule`.

A network is a list of layers connected by named blobs, as in Caffe: each layer reads
its ``bottoms`` and writes its ``tops``; a top equal to one of the layer's bottoms is
computed in place (the blob is rewritten). Layers are read in order: every bottom must
have been produced by an earlier layer or by an input (:class:`RDDLayer`).

>>> net = NetParams(
...     RDDLayer("data", shape=[64, 1, 28, 28]),
...     RDDLayer("label", shape=[64], dtype="int64"),
...     ConvLayer("conv1", ["data"], kernel=(5, 5), num_filters=20),
...     PoolLayer("pool1", ["conv1"], pool="max", kernel=(2, 2), stride=(2, 2)),
...     LinearLayer("ip1", ["pool1"], num_outputs=10),
...     SoftmaxWithLoss("loss", ["ip1", "label"]),
... )
>>> net.infer_shapes()["pool1"]
(64, 20, 12, 12)
>>> module = net.build(seed=0)  # a torch.nn.Module

Shapes are inferred analytically (Caffe's rules, including pooling's rounding up), so a
bad graph fails when the :class:`NetParams` is made, with a :class:`~sparknet.errors.GraphError`
that names the layer at fault. The batch dimension of the input shapes is only a
declaration: a built :class:`GraphModule` accepts any batch size.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator, NoReturn, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._enums import parse_enum
from .errors import GraphError

__all__ = [
    "Shape", "Activation", "Pool", "EltwiseOp", "NormRegion", "LossNormalization", "ParallelMode", "FillerType",
    "VarianceNorm", "Filler", "Layer", "RDDLayer", "InputLayer", "ConvLayer", "PoolLayer", "LinearLayer",
    "ActivationLayer", "DropoutLayer", "BatchNormLayer", "ScaleLayer", "LRNLayer", "ConcatLayer", "EltwiseLayer",
    "SliceLayer", "SplitLayer", "SilenceLayer", "FlattenLayer", "ReshapeLayer", "SoftmaxLayer", "EmbeddingLayer",
    "RNNLayer", "LSTMLayer", "PositionEmbeddingLayer", "LayerNormLayer", "TransformerBlockLayer", "LossLayer",
    "SoftmaxWithLoss", "EuclideanLoss", "SigmoidCrossEntropyLoss",
    "ContrastiveLoss", "AccuracyLayer", "LAYER_TYPES", "NetParams", "GraphModule",
]

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]


# --------------------------------------------------------------------------- enums


class Activation(enum.StrEnum):
    """Element-wise activations of :class:`ActivationLayer`."""

    RELU = "relu"
    LEAKY_RELU = "leaky_relu"
    PRELU = "prelu"
    SIGMOID = "sigmoid"
    TANH = "tanh"
    ELU = "elu"
    GELU = "gelu"
    SOFTPLUS = "softplus"
    ABS = "abs"
    POWER = "power"
    SWISH = "swish"
    IDENTITY = "identity"


class Pool(enum.StrEnum):
    """Pooling methods (Caffe's ``MAX`` and ``AVE``)."""

    MAX = "max"
    AVE = "ave"


class EltwiseOp(enum.StrEnum):
    """Operations of :class:`EltwiseLayer`."""

    SUM = "sum"
    PROD = "prod"
    MAX = "max"


class NormRegion(enum.StrEnum):
    """Regions of :class:`LRNLayer`."""

    ACROSS_CHANNELS = "across_channels"
    WITHIN_CHANNEL = "within_channel"


class LossNormalization(enum.StrEnum):
    """Caffe's ``loss_param { normalization }``: what a summed loss is divided by."""

    FULL = "full"  # every element, ignored ones included
    VALID = "valid"  # the elements whose label is not ignored
    BATCH_SIZE = "batch_size"  # the outer (batch) count
    NONE = "none"  # no division


class ParallelMode(enum.StrEnum):
    """How a :class:`LinearLayer` weight is split for model parallelism."""

    COLUMN = "column"
    ROW = "row"


class FillerType(enum.StrEnum):
    """Caffe's weight fillers."""

    CONSTANT = "constant"
    GAUSSIAN = "gaussian"
    XAVIER = "xavier"
    MSRA = "msra"
    UNIFORM = "uniform"
    POSITIVE_UNITBALL = "positive_unitball"


class VarianceNorm(enum.StrEnum):
    """Which fan the xavier and msra fillers scale by."""

    FAN_IN = "fan_in"
    FAN_OUT = "fan_out"
    AVERAGE = "average"


_ALIASES: dict[type[enum.Enum], dict[str, str]] = {
    Activation: {"absval": "abs", "bnll": "softplus", "silu": "swish", "leakyrelu": "leaky_relu",
                 "none": "identity", "linear": "identity"},
    Pool: {"avg": "ave", "average": "ave", "mean": "ave"},
    NormRegion: {"across": "across_channels", "within": "within_channel"},
    LossNormalization: {"batch": "batch_size"},
}


def _parse_enum(cls: type[enum.StrEnum], value: Any, what: str, layer: str | None = None) -> Any:
    """:func:`~sparknet._enums.parse_enum` with this module's aliases, raising a :class:`GraphError`."""
    if isinstance(value, str) and not isinstance(value, cls):
        key = value.strip().lower()
        value = _ALIASES.get(cls, {}).get(key, key)
    try:
        return parse_enum(cls, value, what)
    except ValueError as exc:
        raise GraphError(f"layer {layer!r}: {exc}" if layer is not None else str(exc), layer=layer) from None


# --------------------------------------------------------------------------- fillers


@dataclass
class Filler:
    """A weight initialiser (Caffe's ``FillerParameter``).

    Parameters
    ----------
    type : FillerType or str
        ``constant``, ``gaussian``, ``xavier``, ``msra``, ``uniform`` or ``positive_unitball``.
    value : float
        The value of a ``constant`` filler.
    mean, std : float
        The normal distribution of a ``gaussian`` filler.
    min, max : float
        The interval of a ``uniform`` filler.
    variance_norm : VarianceNorm or str
        ``fan_in``, ``fan_out`` or ``average``: the fan that ``xavier`` (uniform with
        variance ``1/n``) and ``msra`` (normal with variance ``2/n``) scale by. As in Caffe,
        ``fan_in = numel / shape[0]`` and ``fan_out = numel / shape[1]``.
    """

    type: FillerType | str = FillerType.CONSTANT
    value: float = 0.0
    mean: float = 0.0
    std: float = 1.0
    min: float = 0.0
    max: float = 1.0
    variance_norm: VarianceNorm | str = VarianceNorm.FAN_IN

    def __post_init__(self) -> None:
        self.type = _parse_enum(FillerType, self.type, "filler type")
        self.variance_norm = _parse_enum(VarianceNorm, self.variance_norm, "variance_norm")
        if self.std < 0:
            raise ValueError(f"filler std must be >= 0, got {self.std}")
        if self.min > self.max:
            raise ValueError(f"filler min {self.min} is greater than max {self.max}")

    def _fan(self, tensor: Tensor) -> float:
        count = tensor.numel()
        fan_in = count / tensor.shape[0] if tensor.dim() >= 1 and tensor.shape[0] else 1.0
        fan_out = count / tensor.shape[1] if tensor.dim() > 1 and tensor.shape[1] else float(count)
        if self.variance_norm == VarianceNorm.FAN_OUT:
            return fan_out
        if self.variance_norm == VarianceNorm.AVERAGE:
            return (fan_in + fan_out) / 2.0
        return fan_in

    def fill_(self, tensor: Tensor) -> Tensor:
        """Fill ``tensor`` in place (with the global torch generator) and return it."""
        with torch.no_grad():
            kind = self.type
            if kind == FillerType.CONSTANT:
                tensor.fill_(self.value)
            elif kind == FillerType.GAUSSIAN:
                tensor.normal_(self.mean, self.std)
            elif kind == FillerType.UNIFORM:
                tensor.uniform_(self.min, self.max)
            elif kind == FillerType.XAVIER:  # uniform with variance 1/fan
                scale = math.sqrt(3.0 / max(self._fan(tensor), 1e-12))
                tensor.uniform_(-scale, scale)
            elif kind == FillerType.MSRA:  # normal with variance 2/fan
                tensor.normal_(0.0, math.sqrt(2.0 / max(self._fan(tensor), 1e-12)))
            else:  # positive_unitball: each output's weights are positive and sum to one
                tensor.uniform_(0.0, 1.0)
                rows = tensor.view(tensor.shape[0], -1) if tensor.dim() > 0 else tensor.view(1, 1)
                rows.div_(rows.sum(dim=1, keepdim=True))
        return tensor

    def to_dict(self) -> dict[str, Any]:
        """The filler as plain JSON-able values."""
        return _plain(self)


def _as_filler(value: Any, layer: str, what: str) -> Filler | None:
    """Accept a :class:`Filler`, a dict of its fields, a type name, or ``None``."""
    if value is None or isinstance(value, Filler):
        return value
    try:
        if isinstance(value, str):
            return Filler(type=value)
        if isinstance(value, dict):
            return Filler(**value)
    except (TypeError, ValueError) as exc:
        raise GraphError(f"layer {layer!r}: bad {what}: {exc}", layer=layer) from exc
    raise GraphError(f"layer {layer!r}: {what} must be a Filler, a dict or a type name, "
                     f"got {value!r}", layer=layer)


def _plain(value: Any) -> Any:
    """Convert a field value to plain JSON-able values (enums to strings, tuples to lists, a dataclass to a dict)."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# --------------------------------------------------------------------------- layer base


@dataclass
class Layer:
    """Base class of every layer: a name, the blobs it reads and the blobs it writes.

    Parameters
    ----------
    name : str
        The layer's name, unique in a net.
    bottoms : list of str
        The blobs the layer reads (a single string is taken as a one-element list).
    tops : list of str, optional
        The blobs the layer writes; ``[name]`` by default. A top equal to one of the
        layer's bottoms rewrites that blob in place.
    """

    name: str
    bottoms: list[str] = field(default_factory=list)
    tops: list[str] | None = field(default=None, kw_only=True)

    # Class-level facts (not dataclass fields: no annotations).
    _min_bottoms = 1
    _max_bottoms = 1  # None: no limit
    _num_tops = 1  # None: any number
    _label_positions = ()  # indices of the bottoms that are labels (losses, accuracy)
    is_loss = False

    def __post_init__(self) -> None:
        if type(self)._infer is Layer._infer:
            raise TypeError(f"{type(self).__name__} is a base class; use one of {sorted(LAYER_TYPES)}")
        if not isinstance(self.name, str) or not self.name:
            raise GraphError(f"a layer name must be a non-empty string, got {self.name!r}")
        self.bottoms = self._blob_names(self.bottoms, "bottoms")
        count = len(self.bottoms)
        if count < self._min_bottoms or (self._max_bottoms is not None and count > self._max_bottoms):
            expected = (str(self._min_bottoms) if self._min_bottoms == self._max_bottoms
                        else f"{self._min_bottoms} to {self._max_bottoms}" if self._max_bottoms
                        else f"at least {self._min_bottoms}")
            self._fail(f"takes {expected} bottom(s), got {count}: {self.bottoms}")
        self.tops = self._default_tops() if self.tops is None else self._blob_names(self.tops, "tops")
        if len(set(self.tops)) != len(self.tops):
            self._fail(f"duplicate tops {self.tops}")
        if self._num_tops is not None and len(self.tops) != self._num_tops:
            self._fail(f"has {self._num_tops} top(s), got {self.tops}")
        self._check()

    # -- helpers for subclasses
    def _fail(self, message: str) -> NoReturn:
        raise GraphError(f"{type(self).__name__} {self.name!r}: {message}", layer=self.name)

    def _blob_names(self, value: Any, what: str) -> list[str]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            self._fail(f"{what} must be a list of non-empty blob names, got {value!r}")
        return list(value)

    def _pair(self, value: Any, what: str, minimum: int) -> tuple[int, int]:
        if isinstance(value, int) and not isinstance(value, bool):
            value = (value, value)
        if (not isinstance(value, (list, tuple)) or len(value) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
            self._fail(f"{what} must be an int or a pair of ints, got {value!r}")
        if min(value) < minimum:
            self._fail(f"{what} must be >= {minimum}, got {tuple(value)}")
        return (int(value[0]), int(value[1]))

    def _positive_int(self, value: Any, what: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            self._fail(f"{what} must be a positive int, got {value!r}")
        return value

    def _fraction(self, value: float, what: str) -> None:
        """A probability of dropping: in [0, 1)."""
        if not 0.0 <= value < 1.0:
            self._fail(f"{what} must be in [0, 1), got {value}")

    def _axis(self, axis: int, ndim: int, what: str = "axis", minimum: int = 0) -> int:
        canon = axis + ndim if axis < 0 else axis
        if not minimum <= canon < ndim:
            self._fail(f"{what} {axis} is out of range for a {ndim}-d bottom")
        return canon

    def _expect_ndim(self, shape: Shape, ndim: int, what: str = "bottom") -> None:
        if len(shape) != ndim:
            self._fail(f"expects a {ndim}-d {what}, got shape {shape}")

    # -- overridden by subclasses
    def _default_tops(self) -> list[str]:
        return [self.name]

    def _check(self) -> None:
        """Validate the layer's own options (called from ``__post_init__``)."""

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        """Shapes of the tops from the shapes of the bottoms."""
        raise NotImplementedError

    def _build(self, shapes: list[Shape]) -> nn.Module:
        """The torch module computing the layer for bottoms of these shapes."""
        raise NotImplementedError

    # -- public
    @property
    def label_bottoms(self) -> list[str]:
        """The bottoms read as labels (targets) rather than as predictions."""
        return [self.bottoms[i] for i in self._label_positions if i < len(self.bottoms)]

    def to_dict(self) -> dict[str, Any]:
        """The layer as plain JSON-able values, with its class name under ``"type"``."""
        return {"type": type(self).__name__, **_plain(self)}


@dataclass(kw_only=True)
class _Learnable(Layer):
    """A layer with learnable blobs: Caffe's per-blob ``param { lr_mult decay_mult }`` and fillers.

    ``lr_mult[i]`` and ``decay_mult[i]`` apply to the layer's i-th learnable tensor
    (weight, then bias); tensors beyond the tuple get 1.0, as in Caffe. A filler left as
    ``None`` keeps PyTorch's default initialisation.
    """

    lr_mult: tuple[float, ...] = (1.0, 1.0)
    decay_mult: tuple[float, ...] = (1.0, 1.0)
    weight_filler: Filler | None = None
    bias_filler: Filler | None = None

    def _check(self) -> None:
        self.lr_mult = self._multipliers(self.lr_mult, "lr_mult")
        self.decay_mult = self._multipliers(self.decay_mult, "decay_mult")
        self.weight_filler = _as_filler(self.weight_filler, self.name, "weight_filler")
        self.bias_filler = _as_filler(self.bias_filler, self.name, "bias_filler")

    def _multipliers(self, value: Any, what: str) -> tuple[float, ...]:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = (value,)
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in value):
            self._fail(f"{what} must be a tuple of non-negative numbers, got {value!r}")
        return tuple(float(v) for v in value)

    def _apply_fillers(self, module: nn.Module) -> None:
        """Fill the module's parameters whose filler is set (``weight*`` and ``bias*`` names)."""
        for pname, param in module.named_parameters():
            filler = self.bias_filler if pname.rsplit(".", 1)[-1].startswith("bias") else self.weight_filler
            if filler is not None:
                filler.fill_(param)


# --------------------------------------------------------------------------- inputs


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
           "uint8": torch.uint8}


@dataclass(kw_only=True)
class RDDLayer(Layer):
    """An input blob fed from the data (an RDD partition, a DataFrame, an array).

    Parameters
    ----------
    name : str
        The blob name.
    shape : sequence of int
        The blob's shape, batch dimension first, e.g. ``[64, 1, 28, 28]``. A label of
        ``[64, 1]`` is accepted where a loss wants ``[64]``.
    dtype : str
        ``"float32"`` (features) or ``"int64"`` (class labels, token ids); also
        ``float64``, ``float16``, ``bfloat16``, ``int32``, ``uint8``.
    """

    shape: tuple[int, ...]
    dtype: str = "float32"

    _min_bottoms = 0
    _max_bottoms = 0

    def _check(self) -> None:
        shape = self.shape
        if (not isinstance(shape, (list, tuple)) or not shape
                or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
            self._fail(f"shape must be a non-empty list of positive ints, got {shape!r}")
        self.shape = tuple(int(d) for d in shape)
        if self.dtype not in _DTYPES:
            self._fail(f"unknown dtype {self.dtype!r}; expected one of {sorted(_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The declared dtype as a ``torch.dtype``."""
        return _DTYPES[self.dtype]

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        return [self.shape]


InputLayer = RDDLayer


# --------------------------------------------------------------------------- vision layers


@dataclass(kw_only=True)
class ConvLayer(_Learnable):
    """2-d convolution (Caffe's ``Convolution``); weight ``[num_filters, C/groups, kh, kw]``.

    Parameters
    ----------
    kernel, stride, pad, dilation : int or (int, int)
        Output size is ``floor((H + 2*pad - dilation*(kernel-1) - 1) / stride) + 1``.
    num_filters : int
        Output channels (Caffe's ``num_output``).
    groups : int
        Channel groups (Caffe's ``group``); must divide the input and output channels.
    bias : bool
        Whether to learn a bias (Caffe's ``bias_term``).
    """

    kernel: tuple[int, int] = (5, 5)
    num_filters: int = 20
    stride: tuple[int, int] = (1, 1)
    pad: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    bias: bool = True

    def _check(self) -> None:
        super()._check()
        self.kernel = self._pair(self.kernel, "kernel", 1)
        self.stride = self._pair(self.stride, "stride", 1)
        self.pad = self._pair(self.pad, "pad", 0)
        self.dilation = self._pair(self.dilation, "dilation", 1)
        self._positive_int(self.num_filters, "num_filters")
        self._positive_int(self.groups, "groups")
        if self.num_filters % self.groups:
            self._fail(f"num_filters {self.num_filters} is not divisible by groups {self.groups}")

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        shape = shapes[0]
        self._expect_ndim(shape, 4)
        n, c, h, w = shape
        if c % self.groups:
            self._fail(f"input channels {c} are not divisible by groups {self.groups}")
        out = []
        for size, k, s, p, d in zip((h, w), self.kernel, self.stride, self.pad, self.dilation):
            extent = d * (k - 1) + 1
            if size + 2 * p < extent:
                self._fail(f"kernel {self.kernel} (dilated extent {extent}) is larger than the "
                           f"padded input {h + 2 * self.pad[0]}x{w + 2 * self.pad[1]}")
            out.append((size + 2 * p - extent) // s + 1)
        return [(n, self.num_filters, out[0], out[1])]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return nn.Conv2d(shapes[0][1], self.num_filters, self.kernel, stride=self.stride,
                         padding=self.pad, dilation=self.dilation, groups=self.groups, bias=self.bias)


@dataclass(kw_only=True)
class PoolLayer(Layer):
    """2-d max or average pooling with Caffe's output size (rounded up).

    Parameters
    ----------
    pool : Pool or str
        ``"max"`` or ``"ave"``.
    kernel, stride, pad : int or (int, int)
        ``kernel`` is required unless ``global_pooling``. The output size is
        ``ceil((H + 2*pad - kernel) / stride) + 1``, less one where the last window would
        start in the padding, as in Caffe. Average pooling divides by the window clipped to
        the padded input (padding counts; the overhang past it does not), as in Caffe.
    global_pooling : bool
        Pool each channel's whole plane to 1x1.
    """

    pool: Pool | str = Pool.MAX
    kernel: tuple[int, int] | None = None
    stride: tuple[int, int] = (1, 1)
    pad: tuple[int, int] = (0, 0)
    global_pooling: bool = False

    def _check(self) -> None:
        self.pool = _parse_enum(Pool, self.pool, "pool method", self.name)
        self.stride = self._pair(self.stride, "stride", 1)
        self.pad = self._pair(self.pad, "pad", 0)
        if self.global_pooling:
            if self.kernel is not None:
                self.kernel = self._pair(self.kernel, "kernel", 1)
            if self.pad != (0, 0) or self.stride != (1, 1):
                self._fail("global_pooling takes no pad or stride")
            return
        if self.kernel is None:
            self._fail("kernel is required unless global_pooling=True")
        self.kernel = self._pair(self.kernel, "kernel", 1)
        for k, p in zip(self.kernel, self.pad):
            if p >= k:
                self._fail(f"pad {self.pad} must be smaller than kernel {self.kernel} (as in Caffe)")
            if 2 * p > k:
                self._fail(f"pad {self.pad} must be at most half the kernel {self.kernel} "
                           "(PyTorch's pooling limit)")

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        shape = shapes[0]
        self._expect_ndim(shape, 4)
        n, c, h, w = shape
        if self.global_pooling:
            return [(n, c, 1, 1)]
        assert self.kernel is not None
        out = []
        for size, k, s, p in zip((h, w), self.kernel, self.stride, self.pad):
            if size + 2 * p < k:
                self._fail(f"kernel {self.kernel} is larger than the padded input "
                           f"{h + 2 * self.pad[0]}x{w + 2 * self.pad[1]}")
            # Caffe's pooled size: rounded up, less one where the last window would start in the padding
            pooled = -(-(size + 2 * p - k) // s) + 1
            if p > 0 and (pooled - 1) * s >= size + p:
                pooled -= 1
            if (pooled - 1) * s >= size + p:
                self._fail(f"with stride {self.stride} > kernel {self.kernel} the last pooling "
                           f"window on a {h}x{w} input starts outside it (Caffe leaves it undefined)")
            out.append(pooled)
        return [(n, c, out[0], out[1])]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        if self.global_pooling:
            return _GlobalPool(self.pool == Pool.MAX)
        if self.pool == Pool.MAX:
            return nn.MaxPool2d(self.kernel, self.stride, self.pad, ceil_mode=True)
        return nn.AvgPool2d(self.kernel, self.stride, self.pad, ceil_mode=True, count_include_pad=True)


@dataclass(kw_only=True)
class LinearLayer(_Learnable):
    """Fully connected layer (Caffe's ``InnerProduct``); weight ``[num_outputs, K]``.

    The bottom is flattened from ``axis``: ``K = prod(shape[axis:])`` and the top is
    ``shape[:axis] + [num_outputs]``. ``axis=2`` on ``[B, T, H]`` applies the same weight
    at every time step (time-distributed) and gives ``[B, T, num_outputs]``.

    Parameters
    ----------
    num_outputs : int
        Output features (Caffe's ``num_output``).
    bias : bool
        Whether to learn a bias.
    axis : int
        First axis flattened into the features (negative counts from the end).
    num_inputs : int, optional
        The expected ``K``; a bottom of another size is a :class:`GraphError` (use it
        when the weight is fixed, e.g. loaded from a file).
    parallel : ParallelMode or str, optional
        ``"column"`` or ``"row"``: how model-parallel training splits the weight.
    transpose : bool
        Caffe's ``transpose``: the weight is kept as ``[K, num_outputs]`` and the top is
        ``x @ W`` (Caffe's blob layout for such a layer); not split for model parallelism.
    """

    num_outputs: int
    bias: bool = True
    axis: int = 1
    num_inputs: int | None = None
    parallel: ParallelMode | str | None = None
    transpose: bool = False

    def _check(self) -> None:
        super()._check()
        self._positive_int(self.num_outputs, "num_outputs")
        if self.num_inputs is not None:
            self._positive_int(self.num_inputs, "num_inputs")
        if self.parallel is not None:
            self.parallel = _parse_enum(ParallelMode, self.parallel, "parallel mode", self.name)
            if self.transpose:
                self._fail("a transposed weight (transpose=True) is not split for model parallelism")

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        shape = shapes[0]
        axis = self._axis(self.axis, len(shape), minimum=1)
        features = math.prod(shape[axis:])
        if self.num_inputs is not None and features != self.num_inputs:
            self._fail(f"bottom {shape} flattened from axis {axis} has {features} features, but "
                       f"the weight takes num_inputs={self.num_inputs}")
        return [tuple(shape[:axis]) + (self.num_outputs,)]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        shape = shapes[0]
        axis = self._axis(self.axis, len(shape), minimum=1)
        return _InnerProduct(math.prod(shape[axis:]), self.num_outputs, bias=self.bias,
                             flatten_from=axis if len(shape) > axis + 1 else None, transpose=self.transpose)


@dataclass(kw_only=True)
class ActivationLayer(Layer):
    """An element-wise activation (Caffe's ``ReLU``, ``Sigmoid``, ``TanH``, ``ELU``, ...).

    Parameters
    ----------
    activation : Activation or str
        relu, leaky_relu, prelu, sigmoid, tanh, elu, gelu, softplus (Caffe's BNLL), abs
        (AbsVal), power, swish, identity.
    negative_slope : float, optional
        Slope for x < 0 of relu (Caffe's ``negative_slope``, 0 by default) and leaky_relu
        (0.01 by default).
    alpha : float
        ELU's alpha.
    power, scale, shift : float
        Caffe's Power layer: ``(shift + scale * x) ** power``.
    channel_shared : bool
        PReLU: one slope for all channels instead of one per channel (Caffe's option).
    """

    activation: Activation | str = Activation.RELU
    negative_slope: float | None = None
    alpha: float = 1.0
    power: float = 1.0
    scale: float = 1.0
    shift: float = 0.0
    channel_shared: bool = False

    def _check(self) -> None:
        self.activation = _parse_enum(Activation, self.activation, "activation", self.name)

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        if self.activation == Activation.PRELU and len(shapes[0]) < 2:
            self._fail(f"prelu needs a channel axis, got shape {shapes[0]}")
        return [shapes[0]]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        act = self.activation
        if act in (Activation.RELU, Activation.LEAKY_RELU):
            default = 0.0 if act == Activation.RELU else 0.01
            slope = default if self.negative_slope is None else self.negative_slope
            return nn.ReLU() if slope == 0.0 else nn.LeakyReLU(slope)
        if act == Activation.PRELU:
            return nn.PReLU(1 if self.channel_shared else shapes[0][1], init=0.25)
        if act == Activation.ELU:
            return nn.ELU(self.alpha)
        if act == Activation.POWER:
            return _Power(self.power, self.scale, self.shift)
        simple: dict[Activation, type[nn.Module]] = {
            Activation.SIGMOID: nn.Sigmoid, Activation.TANH: nn.Tanh, Activation.GELU: nn.GELU,
            Activation.SOFTPLUS: nn.Softplus, Activation.ABS: _Abs, Activation.SWISH: nn.SiLU,
            Activation.IDENTITY: nn.Identity,
        }
        return simple[act]()


@dataclass(kw_only=True)
class DropoutLayer(Layer):
    """Dropout: zero each element with probability ``ratio`` while training, scale by ``1/(1-ratio)``."""

    ratio: float = 0.5

    def _check(self) -> None:
        self._fraction(self.ratio, "ratio")

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        return [shapes[0]]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return nn.Dropout(self.ratio)


@dataclass(kw_only=True)
class BatchNormLayer(_Learnable):
    """Batch normalisation over axis 1 of an ``[N, C, ...]`` bottom (Caffe's ``BatchNorm``).

    Caffe's BatchNorm has no affine part (a :class:`ScaleLayer` follows it); its running
    mean and variance are kept as buffers (``running_mean``, ``running_var``).

    With ``moving_average_fraction`` (λ) the statistics follow Caffe's rule exactly: the buffers
    hold decayed *sums* (``mean ← λ·mean + batch mean``, ``var ← λ·var + m/(m-1)·batch var``) and a
    third buffer ``scale_factor`` counts them (``s ← λ·s + 1``, all three starting at 0); at test
    time the statistics are the sums divided by ``s``, so they carry no weight of a starting 0 or 1
    (Caffe's three blobs, in its order).

    Parameters
    ----------
    eps : float
        Added to the variance.
    momentum : float, optional
        Weight of the new batch in the running averages (PyTorch's convention; Caffe's
        ``moving_average_fraction`` is ``1 - momentum``). ``None``: a cumulative average.
    use_global_stats : bool, optional
        ``None``: batch statistics in ``train()`` mode, running ones in ``eval()`` mode;
        ``True``: always the running ones; ``False``: always the batch ones.
    affine : bool
        Learn a per-channel scale and bias as well (PyTorch's BatchNorm).
    moving_average_fraction : float, optional
        Caffe's λ: keep the statistics by Caffe's rule (``momentum`` is then not used).
    """

    eps: float = 1e-5
    momentum: float | None = 0.1
    use_global_stats: bool | None = None
    affine: bool = False
    moving_average_fraction: float | None = None

    def _check(self) -> None:
        super()._check()
        if self.eps <= 0:
            self._fail(f"eps must be > 0, got {self.eps}")
        if self.momentum is not None and not 0.0 <= self.momentum <= 1.0:
            self._fail(f"momentum must be in [0, 1] or None, got {self.momentum}")
        if self.moving_average_fraction is not None and not 0.0 <= self.moving_average_fraction <= 1.0:
            self._fail(f"moving_average_fraction must be in [0, 1], got {self.moving_average_fraction}")

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        if len(shapes[0]) < 2:
            self._fail(f"expects an [N, C, ...] bottom, got shape {shapes[0]}")
        return [shapes[0]]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        if self.moving_average_fraction is not None:
            return _CaffeBatchNorm(shapes[0][1], self.eps, self.moving_average_fraction, self.use_global_stats,
                                   self.affine)
        return _BatchNorm(shapes[0][1], self.eps, self.momentum, self.use_global_stats, self.affine)


@dataclass(kw_only=True)
class ScaleLayer(_Learnable):
    """A learnable per-channel scale (and bias) along ``axis`` (Caffe's ``Scale``, one bottom).

    The scale starts at 1 and the bias at 0 unless fillers say otherwise.
    """

    bias_term: bool = False
    axis: int = 1

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        self._axis(self.axis, len(shapes[0]), minimum=1)
        return [shapes[0]]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        shape = shapes[0]
        axis = self._axis(self.axis, len(shape), minimum=1)
        return _Scale(shape[axis], len(shape) - axis - 1, self.bias_term)


@dataclass(kw_only=True)
class LRNLayer(Layer):
    """Local response normalisation with Caffe's semantics (``alpha`` is divided by the window size).

    across_channels: ``y = x / (k + alpha/n * sum_{n channels} x^2) ** beta``;
    within_channel: ``y = x / (1 + alpha/n * sum x^2) ** beta``, the sum over a ``local_size`` x
    ``local_size`` spatial window (``n = local_size**2``), zero-padded. Caffe's within-channel LRN
    has no ``k`` (its denominator adds 1), so ``k`` other than 1 is refused there.
    """

    local_size: int = 5
    alpha: float = 1e-4
    beta: float = 0.75
    k: float = 1.0
    norm_region: NormRegion | str = NormRegion.ACROSS_CHANNELS

    def _check(self) -> None:
        self._positive_int(self.local_size, "local_size")
        if self.local_size % 2 == 0:
            self._fail(f"local_size must be odd (as in Caffe), got {self.local_size}")
        self.norm_region = _parse_enum(NormRegion, self.norm_region, "norm_region", self.name)
        if self.norm_region == NormRegion.WITHIN_CHANNEL and self.k != 1.0:
            self._fail(f"k={self.k}: Caffe's within_channel LRN has no k (its denominator is "
                       "(1 + alpha/n * sum x^2) ** beta); leave k at 1")

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        self._expect_ndim(shapes[0], 4)
        return [shapes[0]]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return _LRN(self.local_size, self.alpha, self.beta, self.k,
                    self.norm_region == NormRegion.WITHIN_CHANNEL)


# --------------------------------------------------------------------------- blob plumbing


@dataclass(kw_only=True)
class ConcatLayer(Layer):
    """Concatenate the bottoms along ``axis``; all other dimensions must agree."""

    axis: int = 1
    _max_bottoms = None

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        first = shapes[0]
        axis = self._axis(self.axis, len(first))
        total = 0
        for name, shape in zip(self.bottoms, shapes):
            if len(shape) != len(first) or any(
                    a != b for i, (a, b) in enumerate(zip(shape, first)) if i != axis):
                self._fail(f"cannot concatenate {self.bottoms[0]!r} {first} and {name!r} {shape} "
                           f"along axis {axis}: the other dimensions differ")
            total += shape[axis]
        return [first[:axis] + (total,) + first[axis + 1:]]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return _Concat(self._axis(self.axis, len(shapes[0])))


@dataclass(kw_only=True)
class EltwiseLayer(Layer):
    """Element-wise ``sum`` (with optional ``coeffs``), ``prod`` or ``max`` of same-shaped bottoms."""

    operation: EltwiseOp | str = EltwiseOp.SUM
    coeffs: tuple[float, ...] | None = None
    _min_bottoms = 2
    _max_bottoms = None

    def _check(self) -> None:
        self.operation = _parse_enum(EltwiseOp, self.operation, "eltwise operation", self.name)
        if self.coeffs is not None:
            if self.operation != EltwiseOp.SUM:
                self._fail("coeffs apply to operation='sum' only")
            if len(self.coeffs) != len(self.bottoms):
                self._fail(f"{len(self.coeffs)} coeffs for {len(self.bottoms)} bottoms")
            self.coeffs = tuple(float(c) for c in self.coeffs)

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        for name, shape in zip(self.bottoms[1:], shapes[1:]):
            if shape != shapes[0]:
                self._fail(f"bottoms must have the same shape: {self.bottoms[0]!r} is {shapes[0]}, "
                           f"{name!r} is {shape}")
        return [shapes[0]]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return _Eltwise(str(self.operation), self.coeffs)


@dataclass(kw_only=True)
class SliceLayer(Layer):
    """Cut one bottom along ``axis`` into ``len(tops)`` pieces (``tops`` is required).

    ``slice_points`` are the cut indices (``len(tops) - 1`` of them, increasing); without
    them the axis is split evenly.
    """

    axis: int = 1
    slice_points: tuple[int, ...] = ()
    _num_tops = None

    def _default_tops(self) -> list[str]:
        self._fail("tops=[...] is required (one name per piece)")

    def _check(self) -> None:
        points = tuple(self.slice_points)
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in points):
            self._fail(f"slice_points must be ints, got {points}")
        if points and len(points) != len(self.tops) - 1:
            self._fail(f"{len(points)} slice_points for {len(self.tops)} tops "
                       f"(need {len(self.tops) - 1})")
        if any(b <= a for a, b in zip(points, points[1:])) or any(p <= 0 for p in points):
            self._fail(f"slice_points must be positive and increasing, got {points}")
        self.slice_points = points

    def _points(self, shape: Shape) -> tuple[int, ...]:
        axis = self._axis(self.axis, len(shape))
        size = shape[axis]
        if self.slice_points:
            if self.slice_points[-1] >= size:
                self._fail(f"slice point {self.slice_points[-1]} is outside axis {axis} of size {size}")
            return self.slice_points
        parts = len(self.tops)
        if size % parts:
            self._fail(f"axis {axis} of size {size} does not split evenly into {parts} tops")
        return tuple(size // parts * i for i in range(1, parts))

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        shape = shapes[0]
        axis = self._axis(self.axis, len(shape))
        bounds = (0,) + self._points(shape) + (shape[axis],)
        return [shape[:axis] + (hi - lo,) + shape[axis + 1:] for lo, hi in zip(bounds, bounds[1:])]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return _Slice(self._axis(self.axis, len(shapes[0])), list(self._points(shapes[0])))


@dataclass(kw_only=True)
class SplitLayer(Layer):
    """Copy one bottom to several tops (``tops`` is required)."""

    _num_tops = None

    def _default_tops(self) -> list[str]:
        self._fail("tops=[...] is required (the names of the copies)")

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        return [shapes[0]] * len(self.tops)

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return _Split(len(self.tops))


@dataclass(kw_only=True)
class SilenceLayer(Layer):
    """Consume bottoms and produce nothing (marks blobs as deliberately unused)."""

    _max_bottoms = None
    _num_tops = 0

    def _default_tops(self) -> list[str]:
        return []

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        return []

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return _Silence()


@dataclass(kw_only=True)
class FlattenLayer(Layer):
    """Flatten axes ``axis`` to ``end_axis`` (inclusive) into one."""

    axis: int = 1
    end_axis: int = -1

    def _axes(self, ndim: int) -> tuple[int, int]:
        start = self._axis(self.axis, ndim)
        end = self._axis(self.end_axis, ndim, "end_axis")
        if end < start:
            self._fail(f"end_axis {self.end_axis} comes before axis {self.axis}")
        return start, end

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        shape = shapes[0]
        start, end = self._axes(len(shape))
        return [shape[:start] + (math.prod(shape[start:end + 1]),) + shape[end + 1:]]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return nn.Flatten(*self._axes(len(shapes[0])))


@dataclass(kw_only=True)
class ReshapeLayer(Layer):
    """Reshape with Caffe's conventions: ``0`` copies the bottom's dimension, ``-1`` is inferred.

    ``shape`` covers every axis, batch included: ``[0, -1]`` keeps the batch and
    flattens the rest.
    """

    shape: tuple[int, ...] = (0, -1)

    def _check(self) -> None:
        dims = tuple(self.shape)
        if not dims or not all(isinstance(d, int) and d >= -1 for d in dims):
            self._fail(f"shape must be a list of ints >= -1, got {self.shape!r}")
        if dims.count(-1) > 1:
            self._fail(f"at most one -1 in shape, got {dims}")
        self.shape = dims

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        src = shapes[0]
        dims = []
        for i, d in enumerate(self.shape):
            if d == 0:
                if i >= len(src):
                    self._fail(f"shape {self.shape} copies axis {i}, but the bottom is {src}")
                d = src[i]
            dims.append(d)
        total, known = math.prod(src), math.prod([d for d in dims if d != -1])
        if -1 in dims:
            if known == 0 or total % known:
                self._fail(f"cannot reshape {src} ({total} elements) to {self.shape}")
            dims[dims.index(-1)] = total // known
        elif known != total:
            self._fail(f"cannot reshape {src} ({total} elements) to {self.shape} ({known})")
        return [tuple(dims)]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return _Reshape(self.shape)


@dataclass(kw_only=True)
class SoftmaxLayer(Layer):
    """Softmax along ``axis`` (probabilities; use :class:`SoftmaxWithLoss` for training)."""

    axis: int = 1

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        self._axis(self.axis, len(shapes[0]))
        return [shapes[0]]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return nn.Softmax(dim=self._axis(self.axis, len(shapes[0])))


@dataclass(kw_only=True)
class EmbeddingLayer(_Learnable):
    """Look up integer ids in a ``[num_embeddings, num_outputs]`` table (Caffe's ``Embed``).

    The top is the bottom's shape plus ``[num_outputs]``: ``[B, T]`` ids give ``[B, T, D]``.
    Caffe's ``input_dim`` is ``num_embeddings`` and its ``num_output`` is ``num_outputs``;
    unlike Caffe, the bias is off by default.
    """

    num_embeddings: int
    num_outputs: int
    bias: bool = False

    def _check(self) -> None:
        super()._check()
        self._positive_int(self.num_embeddings, "num_embeddings")
        self._positive_int(self.num_outputs, "num_outputs")

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        return [shapes[0] + (self.num_outputs,)]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return _Embed(self.num_embeddings, self.num_outputs, self.bias)


@dataclass(kw_only=True)
class _RecurrentLayer(_Learnable):
    """Shared fields of :class:`RNNLayer` and :class:`LSTMLayer` (batch-first ``[B, T, F]``)."""

    num_outputs: int
    num_layers: int = 1
    dropout: float = 0.0
    bias: bool = True

    def _check(self) -> None:
        super()._check()
        self._positive_int(self.num_outputs, "num_outputs")
        self._positive_int(self.num_layers, "num_layers")
        self._fraction(self.dropout, "dropout")
        if self.dropout and self.num_layers == 1:
            logger.warning("layer %r: dropout applies between stacked layers and has no effect "
                           "with num_layers=1", self.name)

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        self._expect_ndim(shapes[0], 3, "bottom [batch, time, features]")
        batch, steps, _ = shapes[0]
        return [(batch, steps, self.num_outputs)]

    def _kwargs(self, shapes: list[Shape]) -> dict[str, Any]:
        return dict(input_size=shapes[0][2], hidden_size=self.num_outputs, num_layers=self.num_layers,
                    bias=self.bias, batch_first=True,
                    dropout=self.dropout if self.num_layers > 1 else 0.0)


@dataclass(kw_only=True)
class RNNLayer(_RecurrentLayer):
    """An Elman RNN (``torch.nn.RNN``) on ``[B, T, F]``, giving the hidden states ``[B, T, num_outputs]``.

    ``nonlinearity`` is ``"tanh"`` or ``"relu"``.
    """

    nonlinearity: str = "tanh"

    def _check(self) -> None:
        super()._check()
        if self.nonlinearity not in ("tanh", "relu"):
            self._fail(f"nonlinearity must be 'tanh' or 'relu', got {self.nonlinearity!r}")

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return _RNN(nonlinearity=self.nonlinearity, **self._kwargs(shapes))


@dataclass(kw_only=True)
class LSTMLayer(_RecurrentLayer):
    """An LSTM (``torch.nn.LSTM``) on ``[B, T, F]``, giving the hidden states ``[B, T, num_outputs]``.

    Each sequence starts from zero state; ``dropout`` applies between stacked layers.
    """

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return _LSTM(**self._kwargs(shapes))


# --------------------------------------------------------------------------- transformers (GPT)


@dataclass(kw_only=True)
class PositionEmbeddingLayer(_Learnable):
    """Adds a learned vector for each position to ``[B, T, C]`` (GPT's position embedding), then dropout.

    Parameters
    ----------
    max_length : int
        Positions learned: a longer sequence is a :class:`GraphError`.
    dropout : float
        Dropout on the sum.
    """

    max_length: int
    dropout: float = 0.0

    def _check(self) -> None:
        super()._check()
        self._positive_int(self.max_length, "max_length")
        self._fraction(self.dropout, "dropout")

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        self._expect_ndim(shapes[0], 3, "bottom [batch, time, features]")
        if shapes[0][1] > self.max_length:
            self._fail(f"a sequence of {shapes[0][1]} positions is longer than max_length={self.max_length}")
        return [shapes[0]]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return _PositionEmbed(self.max_length, shapes[0][2], self.dropout)


@dataclass(kw_only=True)
class LayerNormLayer(_Learnable):
    """Layer normalisation over the last axis (``torch.nn.LayerNorm``), with a learned scale and shift."""

    eps: float = 1e-5
    bias: bool = True

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        return [shapes[0]]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return nn.LayerNorm(shapes[0][-1], eps=self.eps, bias=self.bias)


@dataclass(kw_only=True)
class TransformerBlockLayer(_Learnable):
    """One pre-norm transformer block on ``[B, T, C]``, as GPT-2's: ``x + attention(norm(x))``, then
    ``x + mlp(norm(x))``.

    Weights start as GPT-2's: normal with standard deviation 0.02, biases zero, and the two projections back into
    the residual stream scaled by ``1 / sqrt(2 * depth)``.

    Parameters
    ----------
    num_heads : int
        Attention heads; they divide ``C``.
    causal : bool
        Each position attends only to itself and the positions before it (a language model).
    dropout : float
        On the attention weights and on each branch before it joins the residual stream.
    mlp_ratio : int
        The hidden width of the MLP, in multiples of ``C``.
    depth : int
        Blocks in the net's stack (for the initial scale of the residual projections).
    bias : bool
        Biases in the linear maps and the norms.
    """

    num_heads: int
    causal: bool = True
    dropout: float = 0.0
    mlp_ratio: int = 4
    depth: int = 1
    bias: bool = True

    def _check(self) -> None:
        super()._check()
        self._positive_int(self.num_heads, "num_heads")
        self._positive_int(self.mlp_ratio, "mlp_ratio")
        self._positive_int(self.depth, "depth")
        self._fraction(self.dropout, "dropout")

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        self._expect_ndim(shapes[0], 3, "bottom [batch, time, features]")
        if shapes[0][2] % self.num_heads:
            self._fail(f"{self.num_heads} heads do not divide the width {shapes[0][2]}")
        return [shapes[0]]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return _Block(shapes[0][2], self.num_heads, causal=self.causal, dropout=self.dropout,
                      mlp_ratio=self.mlp_ratio, depth=self.depth, bias=self.bias)


# --------------------------------------------------------------------------- losses


@dataclass(kw_only=True)
class LossLayer(Layer):
    """Base of the loss layers: a scalar top, weighted by ``loss_weight`` in the total loss."""

    loss_weight: float = 1.0
    is_loss = True
    _min_bottoms = 2
    _max_bottoms = 2
    _label_positions = (1,)

    def _check(self) -> None:
        if self.loss_weight < 0:
            self._fail(f"loss_weight must be >= 0, got {self.loss_weight}")

    def _same_count(self, shapes: list[Shape]) -> list[Shape]:
        """The scalar top of a loss whose two bottoms hold as many elements."""
        if math.prod(shapes[0]) != math.prod(shapes[1]):
            self._fail(f"bottoms {self.bottoms[0]!r} {shapes[0]} and {self.bottoms[1]!r} "
                       f"{shapes[1]} have different element counts")
        return [()]


def _class_axis_check(layer: Layer, shapes: list[Shape], axis: int) -> tuple[int, int, int]:
    """Check predictions/labels for a softmax-style layer; return (axis, classes, label count)."""
    pred, label = shapes
    axis = layer._axis(axis, len(pred), minimum=1)
    outer, inner = math.prod(pred[:axis]), math.prod(pred[axis + 1:])
    if math.prod(label) != outer * inner:
        hint = ""
        if len(pred) == len(label) + 1 and pred[:-1] == label:
            hint = f"; labels {label} match axis={len(pred) - 1}"
        layer._fail(f"labels {label} do not match predictions {pred} with axis {axis}: expected "
                    f"{outer * inner} labels (shape[:axis] x shape[axis+1:]){hint}")
    return axis, pred[axis], outer * inner


@dataclass(kw_only=True)
class SoftmaxWithLoss(LossLayer):
    """Softmax cross-entropy between predictions ``[B, C, ...]`` and integer labels.

    Parameters
    ----------
    axis : int
        The class axis (Caffe's ``axis``): the labels have one entry per position of the
        other axes, e.g. ``[B, T, C]`` predictions with ``axis=2`` take ``[B, T]`` labels.
        ``[B]`` and ``[B, 1]`` labels both fit ``[B, C]``.
    ignore_label : int, optional
        Positions with this label count neither in the loss nor in its normalisation.
    normalization : LossNormalization or str
        ``valid`` (Caffe's default: mean over non-ignored labels), ``full``, ``batch_size``
        or ``none``.
    """

    axis: int = 1
    ignore_label: int | None = None
    normalization: LossNormalization | str = LossNormalization.VALID

    def _check(self) -> None:
        super()._check()
        self.normalization = _parse_enum(LossNormalization, self.normalization, "normalization",
                                         self.name)

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        _class_axis_check(self, shapes, self.axis)
        return [()]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        axis = self._axis(self.axis, len(shapes[0]), minimum=1)
        return _SoftmaxLoss(axis, len(shapes[0]), self.ignore_label, str(self.normalization))


@dataclass(kw_only=True)
class EuclideanLoss(LossLayer):
    """Caffe's Euclidean loss: ``sum((a - b)**2) / (2 * N)`` with ``N`` the batch size."""

    _infer = LossLayer._same_count

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return _EuclideanLoss()


@dataclass(kw_only=True)
class SigmoidCrossEntropyLoss(LossLayer):
    """Sigmoid cross-entropy of logits against targets in [0, 1], summed, over the batch size (Caffe)."""

    _infer = LossLayer._same_count

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return _SigmoidCrossEntropyLoss()


@dataclass(kw_only=True)
class ContrastiveLoss(LossLayer):
    """Caffe's contrastive loss of feature pairs ``a``, ``b`` and a similarity label ``y`` (1 = similar).

    ``loss = sum(y * d**2 + (1 - y) * max(margin - d, 0)**2) / (2N)`` with ``d = ||a - b||``;
    ``legacy_version`` uses ``max(margin - d**2, 0)`` for dissimilar pairs.
    """

    margin: float = 1.0
    legacy_version: bool = False
    _min_bottoms = 3
    _max_bottoms = 3
    _label_positions = (2,)

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        a, b, y = shapes
        if a != b or len(a) < 2:
            self._fail(f"features {self.bottoms[0]!r} {a} and {self.bottoms[1]!r} {b} must have "
                       "the same [N, C, ...] shape")
        if math.prod(y) != a[0]:
            self._fail(f"label {self.bottoms[2]!r} {y} must have one entry per pair ({a[0]})")
        return [()]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return _ContrastiveLoss(self.margin, self.legacy_version)


@dataclass(kw_only=True)
class AccuracyLayer(Layer):
    """Fraction of positions whose label is among the ``top_k`` highest predictions (not a loss)."""

    top_k: int = 1
    axis: int = 1
    ignore_label: int | None = None
    _min_bottoms = 2
    _max_bottoms = 2
    _label_positions = (1,)

    def _check(self) -> None:
        self._positive_int(self.top_k, "top_k")

    def _infer(self, shapes: list[Shape]) -> list[Shape]:
        _, classes, _ = _class_axis_check(self, shapes, self.axis)
        if self.top_k > classes:
            self._fail(f"top_k {self.top_k} exceeds the {classes} classes")
        return [()]

    def _build(self, shapes: list[Shape]) -> nn.Module:
        return _Accuracy(self._axis(self.axis, len(shapes[0]), minimum=1), self.top_k,
                         self.ignore_label)


LAYER_TYPES: dict[str, type[Layer]] = {
    cls.__name__: cls
    for cls in (RDDLayer, ConvLayer, PoolLayer, LinearLayer, ActivationLayer, DropoutLayer,
                BatchNormLayer, ScaleLayer, LRNLayer, ConcatLayer, EltwiseLayer, SliceLayer,
                SplitLayer, SilenceLayer, FlattenLayer, ReshapeLayer, SoftmaxLayer, EmbeddingLayer,
                RNNLayer, LSTMLayer, PositionEmbeddingLayer, LayerNormLayer, TransformerBlockLayer,
                SoftmaxWithLoss, EuclideanLoss, SigmoidCrossEntropyLoss,
                ContrastiveLoss, AccuracyLayer)
}
"""Layer class by name, as written in :meth:`NetParams.to_dict`."""


# --------------------------------------------------------------------------- torch modules


class _InnerProduct(nn.Linear):
    """``nn.Linear`` that first flattens the input from ``flatten_from`` (Caffe's InnerProduct).

    With ``transpose`` the weight is held as ``[in_features, out_features]``, Caffe's layout of a
    transposed InnerProduct blob.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, flatten_from: int | None,
                 transpose: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.flatten_from = flatten_from
        self.transpose = transpose
        if transpose:
            self.weight = nn.Parameter(self.weight.detach().t().contiguous())

    def forward(self, x: Tensor) -> Tensor:
        if self.flatten_from is not None:
            x = x.flatten(self.flatten_from)
        return F.linear(x, self.weight.t() if self.transpose else self.weight, self.bias)


class _Options(nn.Module):
    """A module without tensors: its constructor's arguments, named by ``_options``, become attributes."""

    _options: tuple[str, ...] = ()

    def __init__(self, *values: Any) -> None:
        super().__init__()
        for name, value in zip(self._options, values, strict=True):
            setattr(self, name, value)


class _GlobalPool(_Options):
    _options = ("is_max",)

    def forward(self, x: Tensor) -> Tensor:
        return x.amax(dim=(2, 3), keepdim=True) if self.is_max else x.mean(dim=(2, 3), keepdim=True)


class _Abs(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.abs()


class _Power(_Options):
    _options = ("power", "scale", "shift")

    def forward(self, x: Tensor) -> Tensor:
        y = x * self.scale + self.shift if (self.scale != 1.0 or self.shift != 0.0) else x
        return y if self.power == 1.0 else y.pow(self.power)


class _BatchNorm(nn.Module):
    """Batch norm over axis 1 of any ``[N, C, ...]`` input, with Caffe's ``use_global_stats``."""

    def __init__(self, channels: int, eps: float, momentum: float | None,
                 use_global_stats: bool | None, affine: bool):
        super().__init__()
        self.eps, self.momentum, self.use_global_stats = eps, momentum, use_global_stats
        self.weight = nn.Parameter(torch.ones(channels)) if affine else None
        self.bias = nn.Parameter(torch.zeros(channels)) if affine else None
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        batch_stats = self.training if self.use_global_stats is None else not self.use_global_stats
        if batch_stats and not self.training:  # batch statistics, running ones left alone
            return F.batch_norm(x, None, None, self.weight, self.bias, training=True, eps=self.eps)
        return self._normalize(x, batch_stats)

    def _normalize(self, x: Tensor, batch_stats: bool) -> Tensor:
        """Normalise in training mode (``batch_stats``: updating the running statistics) or with them."""
        momentum = self.momentum
        if batch_stats:
            self.num_batches_tracked.add_(1)
            if momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                            training=batch_stats, momentum=momentum or 0.0, eps=self.eps)


class _CaffeBatchNorm(_BatchNorm):
    """Batch norm whose statistics follow Caffe's rule: decayed sums and their scale factor."""

    def __init__(self, channels: int, eps: float, fraction: float, use_global_stats: bool | None, affine: bool):
        super().__init__(channels, eps, None, use_global_stats, affine)
        self.fraction = fraction
        del self.num_batches_tracked
        self.running_var.zero_()  # Caffe's blobs all start at 0
        self.register_buffer("scale_factor", torch.zeros(1))

    def _normalize(self, x: Tensor, batch_stats: bool) -> Tensor:
        if not batch_stats:
            s = float(self.scale_factor[0])
            inverse = 0.0 if s == 0 else 1.0 / s
            return F.batch_norm(x, self.running_mean * inverse, self.running_var * inverse, self.weight, self.bias,
                                training=False, eps=self.eps)
        # One pass over x: with momentum 1, F.batch_norm writes the batch mean and its m/(m-1)-corrected
        # variance (Caffe's bias correction) into the zeroed buffers, which are then added to the decayed sums.
        mean, var = torch.zeros_like(self.running_mean), torch.zeros_like(self.running_var)
        out = F.batch_norm(x, mean, var, self.weight, self.bias, training=True, momentum=1.0, eps=self.eps)
        with torch.no_grad():
            lam = self.fraction
            self.scale_factor.mul_(lam).add_(1.0)
            self.running_mean.mul_(lam).add_(mean)
            self.running_var.mul_(lam).add_(var)
        return out


class _Scale(nn.Module):
    def __init__(self, channels: int, trailing: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        self.view = (channels,) + (1,) * trailing

    def forward(self, x: Tensor) -> Tensor:
        y = x * self.weight.view(self.view)
        return y if self.bias is None else y + self.bias.view(self.view)


class _LRN(_Options):
    _options = ("size", "alpha", "beta", "k", "within")

    def forward(self, x: Tensor) -> Tensor:
        if not self.within:
            return F.local_response_norm(x, self.size, self.alpha, self.beta, self.k)
        avg = F.avg_pool2d(x * x, self.size, stride=1, padding=self.size // 2,
                           count_include_pad=True)
        return x / (avg * self.alpha + self.k).pow(self.beta)


class _Concat(_Options):
    _options = ("axis",)

    def forward(self, *xs: Tensor) -> Tensor:
        return torch.cat(xs, dim=self.axis)


class _Eltwise(_Options):
    _options = ("operation", "coeffs")

    def forward(self, *xs: Tensor) -> Tensor:
        out = xs[0] if self.coeffs is None else xs[0] * self.coeffs[0]
        for i, x in enumerate(xs[1:], start=1):
            if self.operation == "sum":
                out = out + (x if self.coeffs is None else x * self.coeffs[i])
            else:
                out = out * x if self.operation == "prod" else torch.maximum(out, x)
        return out


class _Slice(_Options):
    _options = ("axis", "points")

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return torch.tensor_split(x, self.points, dim=self.axis)


class _Split(_Options):
    _options = ("count",)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return (x,) * self.count


class _Silence(nn.Module):
    def forward(self, *xs: Tensor) -> tuple[()]:
        return ()


class _Reshape(_Options):
    _options = ("shape",)

    def forward(self, x: Tensor) -> Tensor:
        return x.reshape([x.shape[i] if d == 0 else d for i, d in enumerate(self.shape)])


class _Embed(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_embeddings, dim))  # nn.Embedding's N(0, 1)
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, ids: Tensor) -> Tensor:
        out = F.embedding(ids.long(), self.weight)
        return out if self.bias is None else out + self.bias


class _PositionEmbed(nn.Module):
    def __init__(self, max_length: int, dim: int, dropout: float):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(max_length, dim) * 0.02)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[1] > len(self.weight):
            raise ValueError(f"a sequence of {x.shape[1]} positions is longer than max_length={len(self.weight)}")
        return self.drop(x + self.weight[:x.shape[1]])


class _Attention(nn.Module):
    """Multi-head self-attention through ``scaled_dot_product_attention`` (flash attention where the GPU has it)."""

    def __init__(self, width: int, heads: int, causal: bool, dropout: float, bias: bool):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width, bias=bias)
        self.proj = nn.Linear(width, width, bias=bias)
        self.heads, self.causal, self.dropout = heads, causal, dropout
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=self.causal)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, *, causal: bool, dropout: float, mlp_ratio: int, depth: int,
                 bias: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(width, bias=bias)
        self.attention = _Attention(width, heads, causal, dropout, bias)
        self.norm2 = nn.LayerNorm(width, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_ratio * width, bias=bias), nn.GELU(),
                                 nn.Linear(mlp_ratio * width, width, bias=bias), nn.Dropout(dropout))
        for linear in (self.attention.qkv, self.attention.proj, self.mlp[0], self.mlp[2]):
            std = 0.02 / math.sqrt(2 * depth) if linear in (self.attention.proj, self.mlp[2]) else 0.02
            nn.init.normal_(linear.weight, std=std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _RNN(nn.RNN):
    """``nn.RNN`` returning only the output sequence (states start at zero)."""

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(x)[0]


class _LSTM(nn.LSTM):
    """``nn.LSTM`` returning only the output sequence (states start at zero)."""

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(x)[0]


class _RowLoss(nn.Module):
    """A loss module that also takes each row's sample weight (``weight``, ``[N]``): the loss is then that of a batch
    in which row ``i`` counts ``weight[i]`` times, so weights of 1 give the unweighted loss and a row of weight 0 adds
    nothing (what a ``weight_col`` of the Spark data path, or ``--weight-col``, asks of a layer-DSL net)."""

    def weighted(self, rows: Tensor, weight: Tensor, count: Tensor | float = 1.0) -> Tensor:
        """``sum_i w_i * rows_i`` over the weighted count of what the unweighted loss divides by: ``count`` of it for
        each unit of weight (a tensor: each row's own count)."""
        w = weight.reshape(-1).to(rows.dtype)
        return (rows.reshape(len(w), -1).sum(1) * w).sum() / (w * count).sum().clamp_min(1e-12)


class _SoftmaxLoss(_RowLoss):
    def __init__(self, axis: int, ndim: int, ignore_label: int | None, normalization: str):
        super().__init__()
        self.axis, self.normalization = axis, normalization
        self.ignore = -100 if ignore_label is None else ignore_label  # -100: cross_entropy's default
        self.last_axis = axis == ndim - 1  # classes last: [N, C] or [B, T, C]

    def forward(self, logits: Tensor, labels: Tensor, weight: Tensor | None = None) -> Tensor:
        labels = labels.long()
        if weight is None and self.normalization == "valid" and logits.dim() == 2 and labels.dim() == 1:
            return F.cross_entropy(logits, labels, ignore_index=self.ignore)  # the common case
        classes = logits.shape[self.axis]
        if self.last_axis:
            x, t = logits.reshape(-1, classes), labels.reshape(-1)
        else:
            outer = math.prod(logits.shape[:self.axis])
            x, t = logits.reshape(outer, classes, -1), labels.reshape(outer, -1)
        if weight is not None:  # each row's positions, summed, then weighed
            rows = F.cross_entropy(x, t, ignore_index=self.ignore, reduction="none").reshape(len(logits), -1)
            if self.normalization == "valid":
                return self.weighted(rows, weight, (t.reshape(len(logits), -1) != self.ignore).sum(1))
            if self.normalization == "none":
                return (rows.sum(1) * weight.to(rows.dtype)).sum()
            per_row = rows.shape[1] if self.normalization == "full" else math.prod(logits.shape[1:self.axis])
            return self.weighted(rows, weight, per_row)
        if self.normalization == "valid":
            return F.cross_entropy(x, t, ignore_index=self.ignore)
        total = F.cross_entropy(x, t, ignore_index=self.ignore, reduction="sum")
        if self.normalization == "full":
            return total / t.numel()
        if self.normalization == "batch_size":
            return total / math.prod(logits.shape[:self.axis])
        return total


class _EuclideanLoss(_RowLoss):
    def forward(self, a: Tensor, b: Tensor, weight: Tensor | None = None) -> Tensor:
        diff = a - b.reshape(a.shape).to(a.dtype)
        if weight is not None:
            return self.weighted(diff * diff, weight, 2.0)
        return (diff * diff).sum() / (2 * a.shape[0])


class _SigmoidCrossEntropyLoss(_RowLoss):
    def forward(self, logits: Tensor, targets: Tensor, weight: Tensor | None = None) -> Tensor:
        targets = targets.reshape(logits.shape).to(logits.dtype)
        if weight is not None:
            return self.weighted(F.binary_cross_entropy_with_logits(logits, targets, reduction="none"), weight)
        return F.binary_cross_entropy_with_logits(logits, targets, reduction="sum") / logits.shape[0]


class _ContrastiveLoss(_RowLoss):
    def __init__(self, margin: float, legacy: bool):
        super().__init__()
        self.margin, self.legacy = margin, legacy

    def forward(self, a: Tensor, b: Tensor, similar: Tensor, weight: Tensor | None = None) -> Tensor:
        dist_sq = (a - b).pow(2).flatten(1).sum(1)
        y = similar.reshape(-1).to(a.dtype)
        if self.legacy:
            dissimilar = (self.margin - dist_sq).clamp_min(0.0)
        else:
            dissimilar = (self.margin - dist_sq.clamp_min(1e-12).sqrt()).clamp_min(0.0).pow(2)
        pairs = y * dist_sq + (1 - y) * dissimilar
        if weight is not None:
            return self.weighted(pairs, weight, 2.0)
        return pairs.sum() / (2 * a.shape[0])


class _Accuracy(_Options):
    _options = ("axis", "top_k", "ignore_label")

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        with torch.no_grad():
            scores = logits.movedim(self.axis, -1).reshape(-1, logits.shape[self.axis])
            labels = labels.reshape(-1).long()
            if self.top_k == 1:
                hit = scores.argmax(dim=1) == labels
            else:
                hit = (scores.topk(self.top_k, dim=1).indices == labels[:, None]).any(dim=1)
            if self.ignore_label is not None:
                valid = labels != self.ignore_label
                return (hit & valid).sum().to(logits.dtype) / valid.sum().clamp_min(1)
            return hit.to(logits.dtype).mean()


# --------------------------------------------------------------------------- NetParams


class NetParams:
    """A network: an ordered list of layers connected by named blobs (Listing 2).

    The definition is checked when it is made: names are unique, every bottom comes from
    an earlier layer or an input, no blob has two producers (except in-place rewrites),
    and the shapes fit. Any fault raises :class:`~sparknet.errors.GraphError` naming the
    layer.

    Parameters
    ----------
    *layers : Layer
        The layers in order (a single list of layers is accepted too).
    name : str
        The net's name.
    """

    def __init__(self, *layers: Layer | Sequence[Layer], name: str = "net") -> None:
        if len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            layers = tuple(layers[0])
        for layer in layers:
            if not isinstance(layer, Layer):
                raise TypeError(f"NetParams takes Layer objects, got {type(layer).__name__}: {layer!r}")
        self.name = name
        self._layers: tuple[Layer, ...] = tuple(layers)  # type: ignore[arg-type]
        self._check_structure()
        self.infer_shapes()

    # -- validation
    def _check_structure(self) -> None:
        producers: dict[str, str] = {}  # blob -> first layer writing it
        seen: set[str] = set()
        for layer in self._layers:
            if layer.name in seen:
                raise GraphError(f"duplicate layer name {layer.name!r}", layer=layer.name)
            seen.add(layer.name)
            for top in layer.tops:
                if top in producers and top not in layer.bottoms:
                    raise GraphError(f"layer {layer.name!r} writes blob {top!r}, already produced by "
                                     f"layer {producers[top]!r}; only an in-place layer (top == "
                                     "bottom) may rewrite a blob", layer=layer.name)
                producers.setdefault(top, layer.name)
        available: set[str] = set()
        for index, layer in enumerate(self._layers):
            for bottom in layer.bottoms:
                if bottom in available:
                    continue
                later = next((other.name for other in self._layers[index + 1:]
                              if bottom in other.tops), None)
                if later is not None:
                    raise GraphError(
                        f"layer {layer.name!r} reads blob {bottom!r}, which is produced only later "
                        f"(by layer {later!r}): a cycle, or layers out of order; list every layer "
                        "after the layers it reads from", layer=layer.name)
                raise GraphError(f"layer {layer.name!r} reads unknown blob {bottom!r}; known blobs: "
                                 f"{sorted(available)}", layer=layer.name)
            available.update(layer.tops)
        if not self.inputs:
            raise GraphError("a net needs at least one RDDLayer (input)")

    def _trace(self) -> list[tuple[Layer, list[Shape], list[Shape]]]:
        """Each layer with the shapes of its bottoms and tops, in order."""
        shapes: dict[str, Shape] = {}
        trace = []
        for layer in self._layers:
            ins = [shapes[b] for b in layer.bottoms]
            outs = layer._infer(ins)
            for top, shape in zip(layer.tops, outs):
                shapes[top] = tuple(int(d) for d in shape)
            trace.append((layer, ins, list(outs)))
        return trace

    # -- public
    @property
    def layers(self) -> tuple[Layer, ...]:
        """The layers, in order."""
        return self._layers

    @property
    def inputs(self) -> list[RDDLayer]:
        """The input layers, in order."""
        return [layer for layer in self._layers if isinstance(layer, RDDLayer)]

    @property
    def sample_shape(self) -> tuple[int, ...] | None:
        """One sample's shape at the first input (its batch dimension dropped), or None without inputs."""
        inputs = self.inputs
        return tuple(int(d) for d in inputs[0].shape[1:]) if inputs else None

    def infer_shapes(self) -> dict[str, Shape]:
        """Blob name to shape (batch dimension first), computed with Caffe's rules.

        Returns
        -------
        dict of str to tuple of int
            Every blob, inputs included; loss and accuracy tops are scalars ``()``. An
            in-place blob has the shape of its last version.

        Raises
        ------
        GraphError
            When a layer does not fit its bottoms (names the layer).
        """
        shapes: dict[str, Shape] = {}
        for layer, _, outs in self._trace():
            shapes.update(zip(layer.tops, outs))
        return shapes

    def build(self, seed: int | None = None) -> GraphModule:
        """Make the torch module of this net.

        Parameters
        ----------
        seed : int, optional
            Seed for the initial weights; the global torch RNG is left untouched when given.
        """
        return GraphModule(self, seed=seed)

    def to_dict(self) -> dict[str, Any]:
        """The net as plain JSON-able values; :meth:`from_dict` reverses it."""
        return {"name": self.name, "layers": [layer.to_dict() for layer in self._layers]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NetParams:
        """Rebuild a net from :meth:`to_dict`'s output."""
        layers = []
        for entry in data["layers"]:
            entry = dict(entry)
            kind = entry.pop("type", None)
            if kind not in LAYER_TYPES:
                raise GraphError(f"unknown layer type {kind!r} for layer {entry.get('name')!r}; "
                                 f"known: {sorted(LAYER_TYPES)}", layer=entry.get("name"))
            layers.append(LAYER_TYPES[kind](**entry))
        return cls(*layers, name=data.get("name", "net"))

    def __iter__(self) -> Iterator[Layer]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, key: int | str) -> Layer:
        if isinstance(key, str):
            for layer in self._layers:
                if layer.name == key:
                    return layer
            raise KeyError(f"no layer named {key!r}")
        return self._layers[key]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NetParams):
            return NotImplemented
        return self.name == other.name and self._layers == other._layers

    def __repr__(self) -> str:
        body = "".join(f"\n    {layer!r}," for layer in self._layers)
        return f"NetParams({body}\n    name={self.name!r},\n)"


# --------------------------------------------------------------------------- GraphModule

_Step = tuple[nn.Module, tuple[str, ...], tuple[str, ...]]


def _plan(layers: Sequence[Layer], targets: set[str]) -> tuple[list[int], set[str]]:
    """Indices of the (non-input) layers needed for ``targets``, and the input blobs they read."""
    needed = set(targets)
    keep: list[int] = []
    for index in range(len(layers) - 1, -1, -1):
        layer = layers[index]
        if isinstance(layer, RDDLayer) or not any(top in needed for top in layer.tops):
            continue
        keep.append(index)
        needed.difference_update(t for t in layer.tops if t not in layer.bottoms)
        needed.update(layer.bottoms)
    return keep[::-1], needed


def _attribute_name(name: str) -> str:
    attr = re.sub(r"\W", "_", name)
    return f"_{attr}" if not attr or attr[0].isdigit() else attr


class GraphModule(nn.Module):
    """The ``torch.nn.Module`` of a :class:`NetParams`.

    Each layer's module is registered under the layer's name (made a valid attribute name
    where needed, see :meth:`layer_module`), so ``state_dict`` keys read ``conv1.weight``.
    The execution plans (which layers run, in which order) are fixed when the module is
    built; a forward pass is a loop over them.

    Attributes
    ----------
    net_params : NetParams
        The definition this module was built from.
    feature_input : str
        The input blob that :meth:`forward`'s ``x`` feeds.
    label_input : str or None
        The input blob that ``y`` feeds (read by the loss as labels).
    prediction_blob : str or None
        What :meth:`forward` returns: the first non-label bottom of the first loss or
        accuracy layer, or, in a net with neither, the last top produced.
    loss_blobs : dict of str to float
        Loss top to loss weight.
    input_names : list of str
        Every input blob.
    shapes : dict of str to tuple of int
        Blob shapes as declared (batch dimension first).
    """

    def __init__(self, net: NetParams, seed: int | None = None) -> None:
        super().__init__()
        trace = net._trace()
        self.net_params = net
        self.shapes = net.infer_shapes()
        self.input_names = [layer.name for layer in net.inputs]
        self._find_roles(net)
        self.module_names: dict[str, str] = {}
        # Every plain attribute exists before the layer modules are named, so that a layer
        # called e.g. "loss" or "shapes" is registered under a name that does not clash.
        self._layer_list: list[Layer] = list(net.layers)
        self._modules_by_index: list[nn.Module | None] = []
        self._pred_steps: list[_Step] = []
        self._loss_steps: list[_Step] = []
        self._pred_inputs: set[str] = set()
        self._loss_inputs: set[str] = set()
        self._loss_items: tuple[tuple[str, float], ...] = ()
        self._run_plans: dict[frozenset[str], list[_Step]] = {}
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            modules = self._build_modules(trace)
        self._modules_by_index = modules
        targets = {self.prediction_blob} if self.prediction_blob else set()
        pred, self._pred_inputs = _plan(net.layers, targets)
        loss, self._loss_inputs = _plan(net.layers, targets | set(self.loss_blobs))
        self._pred_steps = self._steps(pred)
        self._loss_steps = self._steps(loss)
        self._loss_items = tuple(self.loss_blobs.items())
        logger.debug("built %s: %d layers, %d parameters", net.name, len(net),
                     sum(p.numel() for p in self.parameters()))

    # -- construction
    def _find_roles(self, net: NetParams) -> None:
        inputs = self.input_names
        label_blobs = [b for layer in net for b in layer.label_bottoms]
        self.label_input: str | None = next((b for b in label_blobs if b in inputs), None)
        if self.label_input is None and len(inputs) >= 2 and label_blobs:
            self.label_input = inputs[1]
        features = [name for name in inputs if name != self.label_input]
        self.feature_input: str = features[0] if features else inputs[0]
        self.loss_blobs: dict[str, float] = {
            layer.tops[0]: float(layer.loss_weight)  # type: ignore[attr-defined]
            for layer in net if layer.is_loss}
        self.prediction_blob: str | None = None
        for layer in net:
            if layer.is_loss or isinstance(layer, AccuracyLayer):
                labels = set(layer._label_positions)
                self.prediction_blob = next(b for i, b in enumerate(layer.bottoms) if i not in labels)
                break
        else:
            for layer in reversed(net.layers):
                if layer.tops and not isinstance(layer, RDDLayer):
                    self.prediction_blob = layer.tops[-1]
                    break

    def _build_modules(self, trace: list[tuple[Layer, list[Shape], list[Shape]]]) -> list[nn.Module | None]:
        modules: list[nn.Module | None] = []
        for layer, ins, _ in trace:
            if isinstance(layer, RDDLayer):
                modules.append(None)
                continue
            module = layer._build(ins)
            if isinstance(layer, _Learnable):
                layer._apply_fillers(module)
            attr = _attribute_name(layer.name)
            while hasattr(self, attr) or attr in self._modules:
                attr += "_"
            self.add_module(attr, module)
            self.module_names[layer.name] = attr
            modules.append(module)
        return modules

    def _steps(self, indices: Sequence[int]) -> list[_Step]:
        steps = []
        for i in indices:
            module = self._modules_by_index[i]
            if module is not None:
                layer = self._layer_list[i]
                steps.append((module, tuple(layer.bottoms), tuple(layer.tops)))
        return steps

    @staticmethod
    def _execute(steps: list[_Step], blobs: dict[str, Tensor], weight: Tensor | None = None) -> dict[str, Tensor]:
        for module, bottoms, tops in steps:
            if weight is not None and isinstance(module, _RowLoss):  # rows' sample weights: the loss layers'
                out = module(*[blobs[b] for b in bottoms], weight=weight)
            elif len(bottoms) == 1:
                out = module(blobs[bottoms[0]])
            else:
                out = module(*[blobs[b] for b in bottoms])
            if len(tops) == 1:
                blobs[tops[0]] = out
            else:
                for top, value in zip(tops, out):
                    blobs[top] = value
        return blobs

    def _inputs(self, x: Tensor, y: Tensor | None, needed: set[str], what: str) -> dict[str, Tensor]:
        blobs = {self.feature_input: x}
        if y is not None and self.label_input is not None:
            blobs[self.label_input] = y
        missing = needed - blobs.keys()
        if missing:
            raise ValueError(f"{what} needs the inputs {sorted(missing)}; "
                             + ("pass y (labels)" if missing == {self.label_input}
                                else "use run() with every input"))
        return blobs

    # -- public
    def forward(self, x: Tensor, y: Tensor | None = None) -> Tensor:
        """Run the layers the prediction blob needs and return it.

        Parameters
        ----------
        x : Tensor
            The feature input (``feature_input``), any batch size.
        y : Tensor, optional
            The labels, only needed when the prediction depends on them.
        """
        if self.prediction_blob is None:
            raise ValueError(f"net {self.net_params.name!r} has no prediction blob")
        blobs = self._inputs(x, y, self._pred_inputs, "forward")
        return self._execute(self._pred_steps, blobs)[self.prediction_blob]

    def loss(self, x: Tensor, y: Tensor, weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The weighted sum of the loss tops and the prediction blob, from one pass.

        Parameters
        ----------
        x, y : Tensor
            The feature input and the labels.
        weight : Tensor, optional
            Each row's sample weight (``[N]``, numbers >= 0): every loss layer is then the loss of a batch in which
            row ``i`` counts ``weight[i]`` times (weights of 1: the unweighted loss).

        Returns
        -------
        (Tensor, Tensor)
            The scalar total loss (``sum(loss_weight * loss)``) and the prediction.
        """
        if not self._loss_items:
            raise ValueError(f"net {self.net_params.name!r} has no loss layer")
        blobs = self._execute(self._loss_steps, self._inputs(x, y, self._loss_inputs, "loss"), weight)
        total: Tensor | None = None
        for top, weight in self._loss_items:
            value = blobs[top] if weight == 1.0 else blobs[top] * weight
            total = value if total is None else total + value
        assert total is not None
        return total, blobs[self.prediction_blob] if self.prediction_blob else total

    def run(self, blobs: dict[str, Tensor]) -> dict[str, Tensor]:
        """Run every layer whose inputs are given and return every blob (inputs included).

        Parameters
        ----------
        blobs : dict of str to Tensor
            Input blob name to tensor; inputs left out skip the layers that need them.
        """
        unknown = set(blobs) - set(self.input_names)
        if unknown:
            raise ValueError(f"run() takes input blobs {self.input_names}, got unknown {sorted(unknown)}")
        key = frozenset(blobs)
        steps = self._run_plans.get(key)
        if steps is None:
            available, indices = set(key), []
            for i, layer in enumerate(self._layer_list):
                if not isinstance(layer, RDDLayer) and all(b in available for b in layer.bottoms):
                    indices.append(i)
                    available.update(layer.tops)
            steps = self._run_plans[key] = self._steps(indices)
        return self._execute(steps, dict(blobs))

    def layer_module(self, name: str) -> nn.Module:
        """The module computing layer ``name`` (registered as ``module_names[name]``)."""
        if name not in self.module_names:
            raise KeyError(f"no layer named {name!r} with a module")
        return self._modules[self.module_names[name]]  # type: ignore[return-value]

    def _layer_tensors(self) -> Iterator[tuple[Layer, list[Tensor], list[Tensor]]]:
        for layer, module in zip(self._layer_list, self._modules_by_index):
            if module is not None:
                params = list(module.parameters())
                buffers = [b for b in module.buffers() if b.is_floating_point()]
                if params or buffers:
                    yield layer, params, buffers

    def layer_weights(self) -> OrderedDict[str, list[Tensor]]:
        """Layer name to its learnable tensors (weight, then bias) and then its floating-point buffers.

        The tensors are the module's own (not copies); layers without tensors are left out.
        """
        return OrderedDict((layer.name, params + buffers)
                           for layer, params, buffers in self._layer_tensors())

    def param_groups(self) -> list[dict[str, Any]]:
        """Optimizer parameter groups, one per distinct ``(lr_mult, decay_mult)`` pair.

        Returns
        -------
        list of dict
            ``{"params": [...], "lr_mult": float, "decay_mult": float}``; the i-th tensor of a
            layer takes the layer's ``lr_mult[i]`` and ``decay_mult[i]`` (1.0 past the end).
        """
        groups: dict[tuple[float, float], list[Tensor]] = {}
        for layer, params, _ in self._layer_tensors():
            lr = getattr(layer, "lr_mult", ())
            decay = getattr(layer, "decay_mult", ())
            for i, param in enumerate(params):
                key = (lr[i] if i < len(lr) else 1.0, decay[i] if i < len(decay) else 1.0)
                groups.setdefault(key, []).append(param)
        return [{"params": params, "lr_mult": lr, "decay_mult": decay}
                for (lr, decay), params in groups.items()]
