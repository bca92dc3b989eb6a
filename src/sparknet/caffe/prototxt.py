"""Caffe net prototxt -> :class:`CaffeNet` (a sparknet :class:`~sparknet.layers.NetParams` plus its data).

>>> net = load_net_prototxt("mnist/lenet_train_test.prototxt", phase="TRAIN")   # doctest: +SKIP
>>> net.batch_size, net.data_binding.dataset, net.data_binding.split            # doctest: +SKIP
(64, 'mnist', 'train')
>>> module = net.build(seed=0)                                                   # doctest: +SKIP
>>> x = net.transform(mnist_batch)        # Caffe's transform_param on sparknet's [0, 1] pixels

Both the current ``layer {}`` syntax and the legacy V1 ``layers {}`` syntax (enum types
such as ``CONVOLUTION``, ``blobs_lr``, ``weight_decay``) are read, and so are the old
``input:``/``input_dim:``/``input_shape`` net fields. Layers are kept or dropped by
Caffe's ``include``/``exclude`` rules for the requested phase, level and stages.

Data layers
-----------
``Data``, ``ImageData``, ``HDF5Data`` and ``MemoryData`` layers become :class:`RDDLayer`
inputs (one for the data top, an ``int64`` one for the label top) with the batch size of
the layer. Their ``source`` is bound to a sparknet data set by a :class:`DataBinding`
(:data:`DEFAULT_SOURCES` binds the BVLC examples' sources), and ``transform_param`` becomes
a :class:`CaffeTransform` that first undoes the scale sparknet's loader applied: LeNet's
``scale: 0.00390625`` thus gives exactly Caffe's input values (``x * 255 / 256``).

Deviations from Caffe, by design
--------------------------------
- A weight without a ``weight_filler`` keeps PyTorch's default initialisation instead of
  Caffe's constant 0 (which only makes sense when weights are loaded afterwards).
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from itertools import chain, count, zip_longest
from pathlib import Path
from typing import Any

import numpy as np
import torch
from google.protobuf import text_format

from sparknet import layers as dsl
from sparknet.caffe import _schema
from sparknet.caffe.caffemodel import _ACTIVATION_TYPES, _DSL_TYPES, read_binaryproto, v1_type_name
from sparknet.errors import GraphError
from sparknet.layers import GraphModule, NetParams

logger = logging.getLogger(__name__)

__all__ = ["PrototxtError", "CaffeNet", "CaffeTransform", "DataBinding", "DataLayerSpec", "DEFAULT_SOURCES",
           "SUPPORTED_LAYER_TYPES", "load_net_prototxt", "parse_net_prototxt", "net_to_prototxt", "resolve_net_path"]


class PrototxtError(GraphError):
    """A Caffe file is wrong: a syntax error, an unsupported layer, a bad graph.

    The message starts with the file name (and ``line:column`` for syntax errors), so
    ``str(error)`` alone tells the user where to look.

    Attributes
    ----------
    layer : str or None
        The layer at fault, when the fault is one layer's.
    path : str or None
        The file (``"<text>"`` when the prototxt was given as a string).
    line, column : int or None
        Where a syntax error is, 1-based.
    """

    def __init__(self, message: str, layer: str | None = None, path: str | None = None, line: int | None = None,
                 column: int | None = None):
        super().__init__(message, layer=layer)
        self.path = path
        self.line = line
        self.column = column

    def __reduce__(self):
        return (type(self), (self.args[0], self.layer, self.path, self.line, self.column))


def read_text(path_or_text: str | os.PathLike) -> tuple[str, Path | None, str]:
    """Return ``(text, path or None, display name)`` for a file path or prototxt text.

    A ``str`` is taken as a path when such a file exists, as text when it contains a
    newline, ``{`` or ``:``; otherwise it is a missing file (``FileNotFoundError``). A file
    that is not UTF-8 text is a :class:`PrototxtError` naming the line of the first bad byte.
    """
    if isinstance(path_or_text, os.PathLike):
        path = Path(path_or_text)
        return _read_utf8(path), path, str(path)
    if not isinstance(path_or_text, str):
        raise TypeError(f"expected a path or prototxt text, got {type(path_or_text).__name__}")
    looks_like_text = any(c in path_or_text for c in "\n{:")
    if not looks_like_text or (len(path_or_text) < 4096 and os.path.isfile(path_or_text)):
        path = Path(path_or_text)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no such Caffe file: {path_or_text}")
        return _read_utf8(path), path, str(path)
    return path_or_text, None, "<text>"


def _read_utf8(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise PrototxtError(f"{path}:{line}: not a text file: byte {data[exc.start]:#04x} (at offset {exc.start}) "
                            "is not UTF-8; a prototxt is UTF-8 text", path=str(path), line=line) from None


def resolve_net_path(net: str, solver_path: Path | None) -> Path | None:
    """Find the file a solver's ``net:`` names.

    Tries, in order: an absolute path; ``net`` relative to the solver's folder and each of
    its parent folders; the same for the shorter tails of ``net`` (``examples/mnist/x`` ->
    ``mnist/x`` -> ``x``); finally the working directory (Caffe's own rule).
    Returns ``None`` when nothing exists, or when ``net`` cannot be a path here (a name
    longer than the system allows, a null character).
    """
    candidate = Path(net)
    if candidate.is_absolute():
        return candidate if os.path.isfile(candidate) else None
    folders: list[Path] = []
    if solver_path is not None:
        start = solver_path.resolve().parent
        folders = [start, *start.parents]
    parts = candidate.parts
    for i in range(len(parts)):
        tail = Path(*parts[i:])
        for folder in folders:
            if os.path.isfile(folder / tail):  # os.path's: False, not OSError, for a name too long
                return folder / tail
    if os.path.isfile(candidate):
        return candidate.resolve()
    return None


def parse_text(text: str, message: Any, name: str) -> Any:
    """Parse protobuf text ``text`` into ``message``; a syntax error names ``name`` and the line."""
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as exc:
        line = exc.GetLine() if hasattr(exc, "GetLine") else None
        column = exc.GetColumn() if hasattr(exc, "GetColumn") else None
        detail = str(exc)
        # ParseError's text starts with "line:column : "; keep only the explanation.
        if line is not None and detail.startswith(f"{line}:"):
            detail = detail.split(" : ", 1)[-1]
        where = f"{name}:{line}:{column}" if line is not None else name
        raise PrototxtError(f"{where}: syntax error: {detail}", path=name, line=line, column=column) from None
    return message


# --------------------------------------------------------------------------- data bindings


@dataclass(frozen=True)
class DataBinding:
    """Which sparknet data set a Caffe data layer's ``source`` stands for.

    Parameters
    ----------
    dataset : str or None
        A name :func:`sparknet.datasets.load_dataset` knows (``"mnist"``), a name the
        caller resolves itself (``"cifar10"``, ``"imagenet"``), or ``None`` when the
        caller feeds the data directly.
    split : str
        ``"train"``, ``"validation"`` or ``"test"``.
    sample_shape : tuple of int, optional
        One sample's shape before cropping (``(1, 28, 28)``); needed when the layer does
        not say it (``Data`` layers never do).
    native_scale : float
        The factor sparknet's loader already applied to raw pixel values: 1/255 when
        it yields [0, 1] floats (MNIST), 1.0 when it yields raw values.
    num_classes : int, optional
        Label count, for information.
    """

    dataset: str | None
    split: str = "train"
    sample_shape: tuple[int, ...] | None = None
    native_scale: float = 1.0
    num_classes: int | None = None

    @classmethod
    def parse(cls, value: DataBinding | str) -> DataBinding:
        """Accept a binding, or ``"name"`` / ``"name:split"`` for a known data set."""
        if isinstance(value, DataBinding):
            return value
        if not isinstance(value, str) or not value:
            raise ValueError(f"a data binding must be a DataBinding or 'dataset[:split]', got {value!r}")
        name, _, split = value.partition(":")
        known = _KNOWN_DATASETS.get(name.lower())
        if known is not None:
            return replace(known, split=split or known.split)
        return cls(name, split or "train")


_MNIST = DataBinding("mnist", "train", (1, 28, 28), 1 / 255, 10)
_CIFAR10 = DataBinding("cifar10", "train", (3, 32, 32), 1 / 255, 10)
_IMAGENET = DataBinding("imagenet", "train", (3, 256, 256), 1 / 255, 1000)
_KNOWN_DATASETS = {"mnist": _MNIST, "cifar10": _CIFAR10, "imagenet": _IMAGENET}

DEFAULT_SOURCES: dict[str, DataBinding] = {
    f"{prefix}_{name}_{db}": replace(binding, split=split)
    for prefix, binding, test, test_split in (("mnist", _MNIST, "test", "test"), ("cifar10", _CIFAR10, "test", "test"),
                                              ("ilsvrc12", _IMAGENET, "val", "validation"))
    for name, split in (("train", "train"), (test, test_split))
    for db in ("lmdb", "leveldb")
}
"""The BVLC examples' sources (``mnist_train_lmdb``, ...), keyed by their last path component."""


def _find_binding(
    source: str | None, layer: str, sources: Mapping[str, DataBinding | str]
) -> DataBinding | None:
    keys = []
    if source:
        keys += [source, source.rstrip("/").rsplit("/", 1)[-1]]
    keys.append(layer)
    for table in (sources, DEFAULT_SOURCES):
        for key in keys:
            if key in table:
                return DataBinding.parse(table[key])
    return None


# --------------------------------------------------------------------------- transform


@dataclass(frozen=True)
class CaffeTransform:
    """Caffe's ``transform_param`` as a function of a numpy batch ``[N, C, H, W]``.

    The batch is taken in the binding's native units (sparknet's MNIST: [0, 1]); the
    transform divides by ``native_scale`` to get Caffe's raw values, then, as Caffe's
    ``DataTransformer`` does, subtracts the mean (``mean_file`` image or per-channel
    ``mean_value``), crops to ``crop_size`` (random offsets in TRAIN, centred in TEST),
    mirrors at random when ``mirror``, and multiplies by ``scale``.
    """

    scale: float = 1.0
    mean_value: tuple[float, ...] = ()
    mean_file: str | None = None
    mean: np.ndarray | None = field(default=None, compare=False, repr=False)
    """The ``mean_file`` image ``[C, H, W]`` once read (``None`` when not found)."""
    mirror: bool = False
    crop_size: int = 0
    native_scale: float = 1.0
    train: bool = True
    """TRAIN phase: random crops; TEST: centred crops."""

    @property
    def is_identity(self) -> bool:
        """True when the transform leaves sparknet's batches unchanged."""
        return (math.isclose(self.scale / self.native_scale, 1.0, rel_tol=1e-6) and not self.mean_value
                and self.mean_file is None and not self.mirror and not self.crop_size)

    def output_shape(self, sample_shape: tuple[int, ...]) -> tuple[int, ...]:
        """One sample's shape after the transform."""
        if self.crop_size and len(sample_shape) >= 2:
            return tuple(sample_shape[:-2]) + (self.crop_size, self.crop_size)
        return tuple(sample_shape)

    def with_mean(self, mean: np.ndarray) -> CaffeTransform:
        """A copy that subtracts ``mean`` (``[C, H, W]`` or ``[1, C, H, W]``), e.g. a mean computed from the data."""
        array = np.asarray(mean, dtype=np.float32)
        if array.ndim == 4:
            array = array[0]
        return replace(self, mean=array, mean_file=self.mean_file or "<array>")

    def __call__(self, batch: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        """Transform a batch ``[N, C, H, W]`` (or ``[N, ...]`` without crop or mirror)."""
        x = np.asarray(batch, dtype=np.float32)
        if self.native_scale != 1.0:
            x = x / np.float32(self.native_scale)
        if self.mean_file is not None:
            if self.mean is None:
                raise ValueError(f"transform_param names mean_file {self.mean_file!r}, which was not found; put it "
                                 "next to the prototxt or call transform.with_mean(array)")
            x = x - self.mean[None]
        elif self.mean_value:
            mean = np.asarray(self.mean_value, dtype=np.float32)
            if mean.size > 1:
                if x.ndim < 2 or x.shape[1] != mean.size:
                    raise ValueError(f"{mean.size} mean_value entries for a batch of shape {x.shape}")
                mean = mean.reshape((1, -1) + (1,) * (x.ndim - 2))
            x = x - mean
        rng = rng if rng is not None else np.random.default_rng()
        if self.crop_size:
            x = self._crop(x, rng)
        if self.mirror:
            flip = rng.random(x.shape[0]) < 0.5
            x = x.copy()
            x[flip] = x[flip][..., ::-1]
        if self.scale != 1.0:
            x = x * np.float32(self.scale)
        return np.ascontiguousarray(x, dtype=np.float32)

    def _crop(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        size = self.crop_size
        height, width = x.shape[-2:]
        if size > height or size > width:
            raise ValueError(f"crop_size {size} is larger than the {height}x{width} images")
        if not self.train:
            top, left = (height - size) // 2, (width - size) // 2
            return x[..., top:top + size, left:left + size]
        out = np.empty(x.shape[:-2] + (size, size), dtype=x.dtype)
        tops = rng.integers(0, height - size + 1, x.shape[0])
        lefts = rng.integers(0, width - size + 1, x.shape[0])
        for i, (top, left) in enumerate(zip(tops, lefts)):
            out[i] = x[i, ..., top:top + size, left:left + size]
        return out


@dataclass(frozen=True)
class DataLayerSpec:
    """One Caffe data layer of a loaded net: where its batches come from and how they are transformed."""

    layer: str
    """The Caffe layer's name."""
    type: str
    """``Data``, ``ImageData``, ``HDF5Data`` or ``MemoryData``."""
    tops: tuple[str, ...]
    """The data blob, then the label blob when there is one."""
    source: str | None
    batch_size: int
    binding: DataBinding | None
    transform: CaffeTransform
    shape: tuple[int, ...]
    """The data blob's shape as the net sees it (batch first, after cropping)."""


# --------------------------------------------------------------------------- CaffeNet


@dataclass
class CaffeNet:
    """A Caffe net definition loaded for one phase: sparknet layers plus their data.

    Attributes
    ----------
    net_params : NetParams
        The layers, ready to :meth:`build`.
    name : str
        The net's ``name``.
    phase : str
        ``"TRAIN"`` or ``"TEST"``.
    stages, level
        The net state the layers were selected with.
    data_layers : list of DataLayerSpec
        The data layers (empty for deploy nets with ``Input`` layers).
    inputs : dict of str to tuple of int
        Every input blob and its declared shape.
    proto : NetParameter
        The selected layers in current (V2) syntax, without blobs; written into
        ``.caffemodel`` files by :func:`~sparknet.caffe.write_caffemodel`.
    layer_types : dict of str to str
        sparknet layer name -> Caffe type.
    source_path : pathlib.Path or None
        The prototxt, when read from a file.
    """

    net_params: NetParams
    name: str
    phase: str
    stages: tuple[str, ...] = ()
    level: int = 0
    data_layers: list[DataLayerSpec] = field(default_factory=list)
    inputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    proto: Any = None
    layer_types: dict[str, str] = field(default_factory=dict)
    source_path: Path | None = None
    _sparse_fillers: dict[str, tuple[float, float, int]] = field(default_factory=dict, repr=False)

    @property
    def transform(self) -> CaffeTransform | None:
        """The first data layer's transform (``None`` without data layers)."""
        return self.data_layers[0].transform if self.data_layers else None

    @property
    def batch_size(self) -> int | None:
        """The first data layer's batch size, or the first input's leading dimension."""
        if self.data_layers:
            return self.data_layers[0].batch_size
        first = next(iter(self.inputs.values()), None)
        return first[0] if first else None

    @property
    def data_binding(self) -> DataBinding | None:
        """The first data layer's binding."""
        return self.data_layers[0].binding if self.data_layers else None

    def build(self, seed: int | None = None) -> GraphModule:
        """Build the ``GraphModule``, applying Caffe's sparse Gaussian fillers the DSL lacks.

        Parameters
        ----------
        seed : int, optional
            Seed of the initial weights.
        """
        module = self.net_params.build(seed=seed)
        if self._sparse_fillers:
            generator = torch.Generator()
            generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()))
            weights = module.layer_weights()
            with torch.no_grad():
                for layer, (mean, std, sparse) in self._sparse_fillers.items():
                    # Caffe's Gaussian filler with sparse: each weight is kept with probability sparse / num_outputs
                    weight = weights[layer][0]
                    values = torch.empty(weight.shape).normal_(mean, std, generator=generator)
                    mask = torch.empty(weight.shape).bernoulli_(min(1.0, sparse / weight.shape[0]), generator=generator)
                    weight.copy_((values * mask).to(weight.dtype))
        return module


# --------------------------------------------------------------------------- net state


_PHASES = {"TRAIN": 0, "TEST": 1}


def _meets_rule(rule: Any, phase: int, level: int, stages: set[str]) -> bool:
    """Caffe's ``Net::StateMeetsRule``."""
    return not ((rule.HasField("phase") and rule.phase != phase)
                or (rule.HasField("min_level") and level < rule.min_level)
                or (rule.HasField("max_level") and level > rule.max_level)
                or any(stage not in stages for stage in rule.stage)
                or any(stage in stages for stage in rule.not_stage))


def _included(layer: Any, phase: int, level: int, stages: set[str], where: str) -> bool:
    if len(layer.include) and len(layer.exclude):
        raise PrototxtError(f"{where}: layer {layer.name!r} has both include and exclude rules; Caffe allows one kind",
                            layer=layer.name, path=where)
    if len(layer.include):
        return any(_meets_rule(r, phase, level, stages) for r in layer.include)
    return not any(_meets_rule(r, phase, level, stages) for r in layer.exclude)


# --------------------------------------------------------------------------- V1 upgrade


def _upgrade_v1(old: Any, where: str) -> Any:
    """A V1 ``layers {}`` entry as a current ``LayerParameter`` (Caffe's UpgradeV1LayerParameter)."""
    if old.HasField("layer"):
        name = old.layer.name or old.name
        raise PrototxtError(f"{where}: layer {name!r} uses the V0 format (layers {{ layer {{ ... }} }}); upgrade the "
                            "file with Caffe's upgrade_net_proto_text", layer=name, path=where)
    new = _schema.LayerParameter(name=old.name, type=v1_type_name(old.type))
    for name in ("bottom", "top", "include", "exclude", "loss_weight", "blobs"):
        getattr(new, name).extend(getattr(old, name))
    for name, lr_mult, decay_mult in zip_longest(old.param, old.blobs_lr, old.weight_decay):
        new.param.add(name=name or None, lr_mult=lr_mult, decay_mult=decay_mult)
    targets = _schema.LayerParameter.DESCRIPTOR.fields_by_name
    for descriptor, value in old.ListFields():
        if descriptor.name.endswith("_param") and descriptor.name in targets and descriptor.message_type:
            getattr(new, descriptor.name).CopyFrom(value)
    # V1 data layers carried their transform in the data parameters.
    for holder in (getattr(old, name) for name in ("data_param", "image_data_param", "window_data_param")
                   if old.HasField(name)):
        for key in ("scale", "mean_file", "crop_size", "mirror"):
            if holder.HasField(key) and not new.transform_param.HasField(key):
                setattr(new.transform_param, key, getattr(holder, key))
    return new


def _legacy_inputs(net: Any, where: str) -> list[Any]:
    """Input layers for the old ``input:`` + ``input_shape``/``input_dim`` net fields."""
    layers = []
    dims = list(net.input_dim)
    for i, name in enumerate(net.input):
        layer = _schema.LayerParameter(name=name, type="Input")
        layer.top.append(name)
        shape = layer.input_param.shape.add()
        if len(net.input_shape) > i:
            shape.CopyFrom(net.input_shape[i])
        elif len(dims) >= 4 * (i + 1):
            shape.dim.extend(dims[4 * i:4 * i + 4])
        else:
            raise PrototxtError(f"{where}: input {name!r} has no input_shape or 4 input_dim values", layer=name,
                                path=where)
        layers.append(layer)
    return layers


# --------------------------------------------------------------------------- layer conversion


def _f(value: float) -> float:
    """A float32 field as the shortest decimal that reads back to it (0.9, not 0.8999999761)."""
    return float(str(np.float32(value)))


def _enum_name(message: Any, field_name: str) -> str:
    descriptor = message.DESCRIPTOR.fields_by_name[field_name]
    return descriptor.enum_type.values_by_number[getattr(message, field_name)].name


class _Converter:
    """Turns selected Caffe layers into sparknet DSL layers, one at a time."""

    def __init__(self, where: str, folder: Path | None, phase: str, sources: Mapping[str, DataBinding | str]):
        self.where = where
        self.folder = folder
        self.phase = phase
        self.sources = sources
        self.out: list[Any] = []
        self.names: set[str] = set()
        self.layer_types: dict[str, str] = {}
        self.data_layers: list[DataLayerSpec] = []
        self.inputs: dict[str, tuple[int, ...]] = {}
        self.sparse: dict[str, tuple[float, float, int]] = {}
        self.param_names: dict[str, str] = {}

    # -- helpers
    def fail(self, layer: Any, message: str) -> PrototxtError:
        return PrototxtError(f"{self.where}: layer {layer.name!r} ({layer.type}): {message}", layer=layer.name,
                             path=self.where)

    def unique(self, name: str) -> str:
        taken = next(n for n in chain([name], (f"{name}_{i}" for i in count(1))) if n not in self.names)
        if taken != name:
            logger.info("%s: a second layer named %r is called %r in sparknet", self.where, name, taken)
        self.names.add(taken)
        return taken

    def filler(self, layer: Any, message: Any, has: bool, bias: bool = False) -> Any:
        if not has:
            return dsl.Filler("constant", value=0.0) if bias else None
        kind = message.type.lower()
        if kind not in ("constant", "gaussian", "xavier", "msra", "uniform", "positive_unitball"):
            raise self.fail(layer, f"filler type {message.type!r} is not supported")
        if kind == "gaussian" and message.sparse >= 0:
            if bias:
                raise self.fail(layer, "a sparse Gaussian bias filler is not supported")
            self.sparse[layer.name] = (_f(message.mean), _f(message.std), int(message.sparse))
        values = {name: _value(message, name) for name in ("value", "mean", "std", "min", "max", "variance_norm")}
        return dsl.Filler(kind, **values)

    def learnable(self, layer: Any, p: Any, weight: str = "weight_filler") -> dict[str, Any]:
        """The fillers and multipliers of a layer with a weight and an optional bias (``p.bias_term``)."""
        return {"weight_filler": self.filler(layer, getattr(p, weight), p.HasField(weight)),
                "bias_filler": self.filler(layer, p.bias_filler, p.HasField("bias_filler"), bias=True),
                **self.multipliers(layer, 2 if p.bias_term else 1)}

    def multipliers(self, layer: Any, blobs: int) -> dict[str, Any]:
        for spec in layer.param:
            if spec.name:
                if spec.name in self.param_names and self.param_names[spec.name] != layer.name:
                    raise self.fail(layer, f"shares parameter {spec.name!r} with layer "
                                           f"{self.param_names[spec.name]!r}; weight sharing is not supported")
                self.param_names[spec.name] = layer.name
        lr = tuple(_f(layer.param[i].lr_mult) if i < len(layer.param) else 1.0 for i in range(blobs))
        decay = tuple(_f(layer.param[i].decay_mult) if i < len(layer.param) else 1.0 for i in range(blobs))
        return {"lr_mult": lr, "decay_mult": decay}

    def pair(self, layer: Any, p: Any, single: str, prefix: str, default: int | None) -> tuple[int, int] | None:
        """Caffe's ``single`` (1 or 2 values) or ``prefix_h`` + ``prefix_w`` option as (h, w)."""
        h, w = f"{prefix}_h", f"{prefix}_w"
        if p.HasField(h) or p.HasField(w):
            if not (p.HasField(h) and p.HasField(w)):
                raise self.fail(layer, f"set both {h} and {w}, or {single}")
            return (int(getattr(p, h)), int(getattr(p, w)))
        values = getattr(p, single)
        if isinstance(values, int):  # an optional single value (Pooling's)
            values = [values] if p.HasField(single) else []
        values = [int(v) for v in values]
        if not values:
            return None if default is None else (default, default)
        if len(values) <= 2:  # one value for both, or height then width
            return (values[0], values[-1])
        raise self.fail(layer, f"{len(values)} {single} values: only 2-d spatial layers are supported")

    def loss_weight(self, layer: Any) -> float:
        return _f(layer.loss_weight[0]) if len(layer.loss_weight) else 1.0

    # -- conversion
    def add(self, layer: Any) -> None:
        kind = layer.type
        handler = _HANDLERS.get(kind)
        if handler is None:
            raise PrototxtError(f"{self.where}: layer {layer.name!r} has type {kind!r}, which sparknet does not "
                                f"support (supported: {', '.join(sorted(SUPPORTED_LAYER_TYPES))})", layer=layer.name,
                                path=self.where)
        if kind not in _LOSS_TYPES and any(w != 0 for w in layer.loss_weight):
            raise self.fail(layer, "a loss_weight on a layer that is not a loss is not supported")
        try:
            made = handler(self, layer)
        except GraphError:
            raise
        except ValueError as exc:  # a value the layer DSL refuses (a negative filler std, a zero stride)
            raise self.fail(layer, str(exc)) from None
        for item in made:
            self.out.append(item)
            self.layer_types[item.name] = "Input" if isinstance(item, dsl.RDDLayer) else kind

    def make(self, layer: Any, **options: Any) -> list[Any]:
        """The sparknet layer of ``layer``, from its :data:`_FIELDS`, a loss's weight and ``options`` (which win)."""
        if layer.type in _LOSS_TYPES:
            options["loss_weight"] = self.loss_weight(layer)
        param, names = _FIELDS.get(layer.type, (None, {}))
        fields = {ours: _value(getattr(layer, param), theirs.rstrip("?")) for ours, theirs in names.items()}
        return [_CLASSES[layer.type](name=self.unique(layer.name), bottoms=list(layer.bottom), tops=list(layer.top),
                                     **{**fields, **options})]

    def input_layers(self, layer: Any) -> list[Any]:
        shapes = list(layer.input_param.shape)
        if not shapes:
            raise self.fail(layer, "input_param has no shape")
        if len(shapes) not in (1, len(layer.top)):
            raise self.fail(layer, f"{len(shapes)} shapes for {len(layer.top)} tops")
        return [self.rdd(layer, top, tuple(int(d) for d in shapes[i if len(shapes) > 1 else 0].dim), "float32")
                for i, top in enumerate(layer.top)]

    def rdd(self, layer: Any, top: str, shape: tuple[int, ...], dtype: str) -> Any:
        if not shape or any(d <= 0 for d in shape):
            raise self.fail(layer, f"blob {top!r} has shape {list(shape)}; every dimension must be positive")
        self.inputs[top] = shape
        self.names.add(top)
        return dsl.RDDLayer(top, shape=shape, dtype=dtype)

    def data_layer(self, layer: Any) -> list[Any]:
        kind = layer.type
        if not 1 <= len(layer.top) <= 2:
            raise self.fail(layer, f"expected a data top and an optional label top, got {list(layer.top)}")
        p = getattr(layer, _DATA_PARAMS[kind])
        source: str | None = None if kind == "MemoryData" else p.source
        batch = int(p.batch_size)
        shape: tuple[int, ...] | None = None
        if kind == "ImageData" and p.new_height and p.new_width:
            shape = (3 if p.is_color else 1, int(p.new_height), int(p.new_width))
        elif kind == "MemoryData":
            shape = (int(p.channels), int(p.height), int(p.width))
        binding = _find_binding(source, layer.name, self.sources)
        if binding is not None and binding.sample_shape is not None and shape is None:
            shape = tuple(binding.sample_shape)
        if shape is None:
            raise self.fail(layer, f"cannot tell the shape of source {source!r}; bind it to a data set with sources="
                            f"{{{source or layer.name!r}: DataBinding(dataset, split, sample_shape=(C, H, W))}}")
        if batch <= 0:
            raise self.fail(layer, "batch_size is not set")
        transform = self.transform(layer, binding)
        net_shape = (batch,) + transform.output_shape(shape)
        made = [self.rdd(layer, layer.top[0], net_shape, "float32")]
        if len(layer.top) == 2:
            made.append(self.rdd(layer, layer.top[1], (batch,), "int64"))
        self.data_layers.append(DataLayerSpec(layer.name, kind, tuple(layer.top), source, batch, binding, transform,
                                              net_shape))
        return made

    def transform(self, layer: Any, binding: DataBinding | None) -> CaffeTransform:
        t = layer.transform_param
        mean = None
        mean_file = t.mean_file if t.HasField("mean_file") else None
        if mean_file:
            found = resolve_net_path(mean_file, self.folder / "x" if self.folder else None)
            if found is not None:
                mean = read_binaryproto(found)
                mean = mean[0] if mean.ndim == 4 else mean
            else:
                logger.warning("%s: layer %r: mean_file %r not found; call transform.with_mean() before use",
                               self.where, layer.name, mean_file)
        if mean_file and len(t.mean_value):
            raise self.fail(layer, "mean_file and mean_value cannot both be set")
        return CaffeTransform(scale=_f(t.scale), mean_value=tuple(_f(v) for v in t.mean_value), mean_file=mean_file,
                              mean=mean, mirror=bool(t.mirror), crop_size=int(t.crop_size),
                              native_scale=binding.native_scale if binding is not None else 1.0,
                              train=self.phase == "TRAIN")

    def convolution(self, layer: Any) -> list[Any]:
        p = layer.convolution_param
        if p.axis != 1:
            raise self.fail(layer, f"axis {p.axis}: only channel axis 1 is supported")
        kernel = self.pair(layer, p, "kernel_size", "kernel", None)
        if kernel is None:
            raise self.fail(layer, "kernel_size is not set")
        if not p.num_output:
            raise self.fail(layer, "num_output is not set")
        stride = self.pair(layer, p, "stride", "stride", 1)
        pad = self.pair(layer, p, "pad", "pad", 0)
        dilation = (int(p.dilation[0]),) * 2 if len(p.dilation) == 1 else tuple(int(d) for d in p.dilation) or (1, 1)
        if len(dilation) != 2:
            raise self.fail(layer, f"{len(dilation)} dilation values: only 2-d convolution is supported")
        return self.make(layer, kernel=kernel, stride=stride, pad=pad, dilation=dilation, **self.learnable(layer, p))

    def pooling(self, layer: Any) -> list[Any]:
        p = layer.pooling_param
        if p.pool == p.STOCHASTIC:
            raise self.fail(layer, "stochastic pooling is not supported")
        if p.round_mode != p.CEIL:
            raise self.fail(layer, "round_mode FLOOR is not supported (Caffe's default CEIL is)")
        kernel = self.pair(layer, p, "kernel_size", "kernel", None)
        if kernel is None and not p.global_pooling:
            raise self.fail(layer, "kernel_size is not set")
        if p.global_pooling:
            return self.make(layer)
        stride = (int(p.stride_h), int(p.stride_w)) if p.HasField("stride_h") else (int(p.stride), int(p.stride))
        pad = (int(p.pad_h), int(p.pad_w)) if p.HasField("pad_h") else (int(p.pad), int(p.pad))
        return self.make(layer, kernel=kernel, stride=stride, pad=pad)

    def inner_product(self, layer: Any) -> list[Any]:
        p = layer.inner_product_param
        if not p.num_output:
            raise self.fail(layer, "num_output is not set")
        return self.make(layer, **self.learnable(layer, p))

    def activation(self, layer: Any) -> list[Any]:
        kind = layer.type
        if kind == "ReLU":
            return self.make(layer, activation="relu", negative_slope=_f(layer.relu_param.negative_slope) or None)
        if kind == "Swish" and _f(layer.swish_param.beta) != 1.0:
            raise self.fail(layer, "swish beta other than 1 is not supported")
        p = layer.prelu_param
        if kind == "PReLU" and p.HasField("filler") and (p.filler.type, _f(p.filler.value)) != ("constant", 0.25):
            logger.warning("%s: layer %r: PReLU filler ignored; slopes start at 0.25", self.where, layer.name)
        return self.make(layer, activation=_ACTIVATIONS[kind])

    def lrn(self, layer: Any) -> list[Any]:
        region = _value(layer.lrn_param, "norm_region")
        k = _f(layer.lrn_param.k)
        if region == "within_channel" and k != 1.0:  # lrn_layer.cpp: the within-channel denominator adds 1, not k
            logger.warning("%s: layer %r: k=%s is ignored by a WITHIN_CHANNEL LRN (as in Caffe)", self.where,
                           layer.name, k)
            k = 1.0
        return self.make(layer, k=k)

    def batch_norm(self, layer: Any) -> list[Any]:
        return self.make(layer, **self.multipliers(layer, 3))

    def scale(self, layer: Any) -> list[Any]:
        p = layer.scale_param
        if len(layer.bottom) != 1:
            raise self.fail(layer, "a Scale layer with a second bottom (the scale as an input) is not supported")
        if p.num_axes != 1:
            raise self.fail(layer, f"num_axes {p.num_axes}: only 1 is supported")
        return self.make(layer, **self.learnable(layer, p, "filler"))

    def concat_or_slice(self, layer: Any) -> list[Any]:
        """Concat and Slice: the axis is the legacy ``concat_dim``/``slice_dim`` when only that is set."""
        p = layer.concat_param if layer.type == "Concat" else layer.slice_param
        legacy = "concat_dim" if layer.type == "Concat" else "slice_dim"
        axis = int(p.axis) if p.HasField("axis") or not p.HasField(legacy) else int(getattr(p, legacy))
        if layer.type == "Concat":
            return self.make(layer, axis=axis)
        return self.make(layer, axis=axis, slice_points=tuple(int(v) for v in p.slice_point))

    def eltwise(self, layer: Any) -> list[Any]:
        return self.make(layer, coeffs=tuple(_f(c) for c in layer.eltwise_param.coeff) or None)

    def reshape(self, layer: Any) -> list[Any]:
        p = layer.reshape_param
        dims = tuple(int(d) for d in p.shape.dim)
        if p.num_axes != -1 or p.axis < 0:
            raise self.fail(layer, "reshape_param with num_axes or a negative axis is not supported")
        return self.make(layer, shape=(0,) * int(p.axis) + dims)

    def softmax_loss(self, layer: Any) -> list[Any]:
        lp = layer.loss_param
        if lp.HasField("normalization"):
            normalization = _value(lp, "normalization")
        elif lp.HasField("normalize") and not lp.normalize:
            normalization = "batch_size"
        else:
            normalization = "valid"
        return self.make(layer, axis=layer.softmax_param.axis, ignore_label=_value(lp, "ignore_label"),
                         normalization=normalization)

    def embed(self, layer: Any) -> list[Any]:
        p = layer.embed_param
        if not p.num_output or not p.input_dim:
            raise self.fail(layer, "num_output and input_dim must be set")
        return self.make(layer, **self.learnable(layer, p))


def _value(message: Any, name: str) -> Any:
    """A field as sparknet takes it: a float32 as its shortest decimal, an enum as its lower-case name, and
    ``None`` for an unset field that caffe.proto gives no default."""
    descriptor = message.DESCRIPTOR.fields_by_name[name]
    if not descriptor.has_default_value and not message.HasField(name):
        return None
    if descriptor.enum_type is not None:
        return _enum_name(message, name).lower()
    value = getattr(message, name)
    return _f(value) if descriptor.cpp_type == descriptor.CPPTYPE_FLOAT else value


def _set(message: Any, name: str, value: Any) -> None:
    """The inverse of :func:`_value`: ``None`` leaves the field unset, and so does Caffe's default for ``name?``."""
    descriptor = message.DESCRIPTOR.fields_by_name[name.rstrip("?")]
    if value is not None and descriptor.enum_type is not None:
        value = descriptor.enum_type.values_by_name[str(value).upper()].number
    if value is not None and not (name.endswith("?") and value == descriptor.default_value):
        setattr(message, descriptor.name, value)


# Caffe type -> its parameter message and the fields read and written as they are: "ours=theirs" when the
# sparknet layer's argument has another name than the Caffe field, "theirs?" for one exported only when it is
# not Caffe's default.
_FIELDS: dict[str, tuple[str, dict[str, str]]] = {
    kind: (param, {ours.rstrip("?"): theirs or ours
                   for ours, _, theirs in (item.partition("=") for item in names.split())})
    for kind, (param, names) in {
        "Convolution": ("convolution_param", "num_filters=num_output groups=group? bias=bias_term?"),
        "Pooling": ("pooling_param", "pool global_pooling?"),
        "InnerProduct": ("inner_product_param", "num_outputs=num_output bias=bias_term? axis? transpose?"),
        "ELU": ("elu_param", "alpha"),
        "Power": ("power_param", "power scale shift"),
        "PReLU": ("prelu_param", "channel_shared"),
        "Dropout": ("dropout_param", "ratio=dropout_ratio"),
        "LRN": ("lrn_param", "local_size alpha beta k norm_region?"),
        "BatchNorm": ("batch_norm_param", "eps moving_average_fraction use_global_stats"),
        "Scale": ("scale_param", "bias_term axis"),
        "Concat": ("concat_param", "axis"),
        "Eltwise": ("eltwise_param", "operation"),
        "Slice": ("slice_param", "axis"),
        "Flatten": ("flatten_param", "axis end_axis"),
        "Softmax": ("softmax_param", "axis"),
        "ContrastiveLoss": ("contrastive_loss_param", "margin legacy_version"),
        "Accuracy": ("accuracy_param", "top_k axis ignore_label"),
        "Embed": ("embed_param", "num_outputs=num_output num_embeddings=input_dim bias=bias_term"),
    }.items()
}
_ACTIVATIONS = {caffe: ours for ours, caffe in _ACTIVATION_TYPES.items() if ours != "leaky_relu"}
_CLASSES = {caffe: getattr(dsl, ours) for ours, caffe in _DSL_TYPES.items()} | dict.fromkeys(
    _ACTIVATIONS, dsl.ActivationLayer)
_LOSS_TYPES = {"SoftmaxWithLoss", "EuclideanLoss", "SigmoidCrossEntropyLoss", "ContrastiveLoss"}
_DATA_PARAMS = {"Data": "data_param", "ImageData": "image_data_param", "HDF5Data": "hdf5_data_param",
                "MemoryData": "memory_data_param"}
_HANDLERS: dict[str, Callable[[_Converter, Any], list[Any]]] = {
    "Input": _Converter.input_layers,
    **dict.fromkeys(_DATA_PARAMS, _Converter.data_layer),
    **dict.fromkeys(_ACTIVATIONS, _Converter.activation),
    **dict.fromkeys(("Dropout", "Split", "Silence", "Flatten", "Softmax", "EuclideanLoss", "SigmoidCrossEntropyLoss",
                     "ContrastiveLoss", "Accuracy"), _Converter.make),
    **dict.fromkeys(("Concat", "Slice"), _Converter.concat_or_slice),
    "Convolution": _Converter.convolution,
    "Pooling": _Converter.pooling,
    "InnerProduct": _Converter.inner_product,
    "LRN": _Converter.lrn,
    "BatchNorm": _Converter.batch_norm,
    "Scale": _Converter.scale,
    "Eltwise": _Converter.eltwise,
    "Reshape": _Converter.reshape,
    "SoftmaxWithLoss": _Converter.softmax_loss,
    "Embed": _Converter.embed,
}

SUPPORTED_LAYER_TYPES: frozenset[str] = frozenset(_HANDLERS)
"""The Caffe layer types :func:`load_net_prototxt` turns into sparknet layers."""


# --------------------------------------------------------------------------- loading


def parse_net_prototxt(path_or_text: str | os.PathLike) -> Any:
    """Parse a net prototxt into Caffe's ``NetParameter`` message (no conversion)."""
    text, _, where = read_text(path_or_text)
    return parse_text(text, _schema.NetParameter(), where)


def load_net_prototxt(
    path_or_text: str | os.PathLike,
    phase: str = "TRAIN",
    sources: Mapping[str, DataBinding | str] | None = None,
    *,
    stages: tuple[str, ...] | list[str] = (),
    level: int = 0,
) -> CaffeNet:
    """Load a Caffe net prototxt as sparknet layers for one phase.

    Parameters
    ----------
    path_or_text : str or path
        The ``.prototxt`` file, or its text.
    phase : {"TRAIN", "TEST"}
        Which layers to keep, by the layers' ``include``/``exclude`` rules.
    sources : mapping, optional
        Data source (or its last path component, or the data layer's name) ->
        :class:`DataBinding` or ``"dataset[:split]"``; consulted before
        :data:`DEFAULT_SOURCES`.
    stages : sequence of str
        The net state's stages (the MNIST autoencoder's TEST nets use ``test-on-train``
        and ``test-on-test``; ``CaffeSolver.load_net`` passes the solver's).
    level : int
        The net state's level.

    Returns
    -------
    CaffeNet

    Raises
    ------
    PrototxtError
        A syntax error (file, line and column), an unsupported layer type (file, layer
        and type), a missing bottom or a shape that does not fit (file and layer, from
        the layer DSL's ``GraphError``).
    """
    text, path, where = read_text(path_or_text)
    phase_name = str(phase).upper()
    if phase_name not in _PHASES:
        raise ValueError(f"phase must be 'TRAIN' or 'TEST', got {phase!r}")
    net = parse_text(text, _schema.NetParameter(), where)
    if len(net.layer) and len(net.layers):
        raise PrototxtError(f"{where}: mixes 'layer' and legacy 'layers' entries; use one", path=where)
    all_layers = list(net.layer) if len(net.layer) else [_upgrade_v1(old, where) for old in net.layers]
    all_layers = _legacy_inputs(net, where) + all_layers

    state_stages = set(stages)
    selected = [layer for layer in all_layers if _included(layer, _PHASES[phase_name], level, state_stages, where)]
    if not selected:
        raise PrototxtError(f"{where}: no layer is included in phase {phase_name} with stages {sorted(state_stages)}",
                            path=where)

    converter = _Converter(where, path.parent if path is not None else None, phase_name, dict(sources or {}))
    try:
        available: set[str] = set()
        for layer in selected:
            for bottom in layer.bottom:
                if bottom not in available:
                    hint = _excluded_hint(layer.name, selected, all_layers, phase_name, stages)
                    raise PrototxtError(f"{where}: layer {layer.name!r} reads unknown blob {bottom!r}; known blobs: "
                                        f"{sorted(available)}{hint}", layer=layer.name, path=where)
            available.update(layer.top)
            converter.add(layer)
        _class_labels_as_int64(converter)
        net_params = NetParams(*converter.out, name=net.name or (path.stem if path else "net"))
    except PrototxtError as exc:
        raise _with_line(exc, text) from None
    except GraphError as exc:
        message = str(exc) + _excluded_hint(exc.layer, selected, all_layers, phase_name, stages)
        raise _with_line(PrototxtError(f"{where}: {message}", layer=exc.layer, path=where), text) from exc

    proto = _schema.NetParameter(name=net.name)
    for layer in selected:
        copy = proto.layer.add()
        copy.CopyFrom(layer)
        del copy.blobs[:]
    logger.debug("%s: %s phase, %d layers", where, phase_name, len(net_params))
    return CaffeNet(net_params=net_params, name=net.name, phase=phase_name, stages=tuple(stages), level=level,
                    data_layers=converter.data_layers, inputs=converter.inputs, proto=proto,
                    layer_types=converter.layer_types, source_path=path, _sparse_fillers=converter.sparse)


def _class_labels_as_int64(converter: _Converter) -> None:
    """Make Input blobs that are read as class labels (softmax loss, accuracy, contrastive) int64."""
    label_kinds = (dsl.SoftmaxWithLoss, dsl.AccuracyLayer, dsl.ContrastiveLoss)
    labels = {b for layer in converter.out if isinstance(layer, label_kinds) for b in layer.label_bottoms}
    features = {b for layer in converter.out if not isinstance(layer, label_kinds) for b in layer.bottoms}
    for i, layer in enumerate(converter.out):
        if isinstance(layer, dsl.RDDLayer) and layer.name in labels - features and layer.dtype == "float32":
            converter.out[i] = dsl.RDDLayer(layer.name, shape=layer.shape, dtype="int64")


def _excluded_hint(name: str | None, selected: list[Any], all_layers: list[Any], phase: str, stages: Any) -> str:
    """Say so when a missing bottom comes from a layer the phase, level or stages left out."""
    chosen = {id(layer) for layer in selected}
    produced = {top for layer in selected for top in layer.top}
    for bottom in (b for layer in selected if layer.name == name for b in layer.bottom if b not in produced):
        producers = [o for o in all_layers if id(o) not in chosen and bottom in o.top]
        if producers:
            rules = " or ".join("{" + text_format.MessageToString(r, as_one_line=True) + "}"
                                for o in producers for r in o.include)
            return (f" (blob {bottom!r} comes from layer {producers[0].name!r}, left out in phase {phase} "
                    f"with stages {sorted(stages)}" + (f"; it is included for {rules}" if rules else "") + ")")
    return ""


def _with_line(exc: PrototxtError, text: str) -> PrototxtError:
    """Add the layer's line to an error message, when the layer's ``name: "<name>"`` can be found in the text."""
    match = exc.layer and re.search(r"""(?<![\w])name\s*:\s*["']""" + re.escape(exc.layer) + r"""["']""", text)
    if not match or exc.path is None:
        return exc
    line = text.count("\n", 0, match.start()) + 1
    message = str(exc)
    prefix = f"{exc.path}: "
    if message.startswith(prefix):
        message = f"{exc.path}:{line}: " + message[len(prefix):]
    return PrototxtError(message, layer=exc.layer, path=exc.path, line=line)


# --------------------------------------------------------------------------- export


# Filler type -> the FillerParameter fields it reads ("name?": written only when not Caffe's default).
_FILLER_FIELDS = {"constant": "value", "gaussian": "mean std", "uniform": "min max", "xavier": "variance_norm?",
                  "msra": "variance_norm?"}


def _set_filler(message: Any, filler: Any) -> None:
    message.type = str(filler.type)
    for name in _FILLER_FIELDS.get(message.type, "").split():
        _set(message, name, getattr(filler, name.rstrip("?")))


def _set_learnable(msg: Any, p: Any, layer: Any, bias: bool, weight: str = "weight_filler") -> None:
    """A learnable layer's ``param`` multipliers (when not all 1) and its fillers, into ``msg`` and ``p``."""
    blobs = 2 if bias else 1
    lr, decay = tuple(layer.lr_mult), tuple(layer.decay_mult)
    if any(v != 1.0 for v in lr[:blobs] + decay[:blobs]):
        for i in range(blobs):
            msg.param.add(lr_mult=lr[i] if i < len(lr) else 1.0, decay_mult=decay[i] if i < len(decay) else 1.0)
    if layer.weight_filler is not None:
        _set_filler(getattr(p, weight), layer.weight_filler)
    if layer.bias_filler is not None:
        _set_filler(p.bias_filler, layer.bias_filler)


def _set_window(p: Any, layer: Any, repeated: bool) -> None:
    """Kernel, stride and pad: one value when height and width agree (none at the default), else ``_h``/``_w``."""
    for name, value, default in (("kernel", layer.kernel, None), ("stride", layer.stride, 1), ("pad", layer.pad, 0)):
        single = "kernel_size" if name == "kernel" else name
        if value[0] != value[1]:
            setattr(p, f"{name}_h", value[0])
            setattr(p, f"{name}_w", value[1])
        elif value[0] != default and repeated:
            getattr(p, single).append(value[0])
        elif value[0] != default:
            setattr(p, single, value[0])


def _export_layer(layer: Any) -> Any:
    """A sparknet layer as a Caffe ``LayerParameter``; a PrototxtError when Caffe has no equivalent."""
    msg = _schema.LayerParameter(name=layer.name)
    msg.bottom.extend(layer.bottoms)
    msg.top.extend(layer.tops)

    def unsupported(what: str) -> PrototxtError:
        return PrototxtError(f"layer {layer.name!r} ({type(layer).__name__}): {what} has no Caffe equivalent",
                             layer=layer.name)

    if isinstance(layer, dsl.ActivationLayer):
        act = str(layer.activation)
        if act not in _ACTIVATION_TYPES:
            raise unsupported(f"activation {act!r}")
        msg.type = _ACTIVATION_TYPES[act]
    else:
        msg.type = next((_DSL_TYPES[c.__name__] for c in type(layer).__mro__ if c.__name__ in _DSL_TYPES), "")
        if not msg.type:
            raise unsupported("this layer type")
    param, names = _FIELDS.get(msg.type, (None, {}))
    for ours, theirs in names.items():
        _set(getattr(msg, param), theirs, getattr(layer, ours))
    if isinstance(layer, dsl.RDDLayer):
        msg.input_param.shape.add().dim.extend(layer.shape)
    elif isinstance(layer, dsl.ConvLayer):
        _set_window(msg.convolution_param, layer, repeated=True)
        if layer.dilation != (1, 1):
            msg.convolution_param.dilation.extend(layer.dilation)
        _set_learnable(msg, msg.convolution_param, layer, layer.bias)
    elif isinstance(layer, dsl.PoolLayer) and not layer.global_pooling:
        _set_window(msg.pooling_param, layer, repeated=False)
    elif isinstance(layer, dsl.LinearLayer):
        _set_learnable(msg, msg.inner_product_param, layer, layer.bias)
    elif isinstance(layer, dsl.ActivationLayer) and msg.type == "ReLU":
        act = str(layer.activation)
        slope = layer.negative_slope if layer.negative_slope is not None else (0.0 if act == "relu" else 0.01)
        if slope:
            msg.relu_param.negative_slope = slope
    elif isinstance(layer, dsl.BatchNormLayer):
        if layer.affine:
            raise unsupported("affine batch norm (use BatchNorm + Scale)")
        if layer.moving_average_fraction is None and layer.momentum is None:
            raise unsupported("a cumulative-average batch norm (momentum=None)")
        if layer.moving_average_fraction is None:
            msg.batch_norm_param.moving_average_fraction = 1.0 - layer.momentum
    elif isinstance(layer, dsl.ScaleLayer):
        _set_learnable(msg, msg.scale_param, layer, layer.bias_term, "filler")
    elif isinstance(layer, dsl.EmbeddingLayer):
        _set_learnable(msg, msg.embed_param, layer, layer.bias)
    elif isinstance(layer, dsl.EltwiseLayer):
        msg.eltwise_param.coeff.extend(layer.coeffs or ())
    elif isinstance(layer, dsl.SliceLayer):
        msg.slice_param.slice_point.extend(layer.slice_points)
    elif isinstance(layer, dsl.ReshapeLayer):
        msg.reshape_param.shape.dim.extend(layer.shape)
    elif isinstance(layer, dsl.SoftmaxWithLoss):
        if layer.axis != 1:
            msg.softmax_param.axis = layer.axis
        _set(msg.loss_param, "ignore_label", layer.ignore_label)
        if str(layer.normalization) != "valid":
            _set(msg.loss_param, "normalization", layer.normalization)
    if getattr(layer, "is_loss", False) and layer.loss_weight != 1.0:
        msg.loss_weight.append(layer.loss_weight)
    return msg


def net_to_prototxt(net: Any) -> str:
    """A Caffe net prototxt for a sparknet net, for ``sparknet caffe export``.

    Parameters
    ----------
    net : CaffeNet, NetParams or GraphModule
        A ``CaffeNet`` gives back its selected Caffe layers (data layers included); a
        ``NetParams`` (or a ``GraphModule``'s) is translated layer by layer, inputs
        becoming ``Input`` layers.

    Returns
    -------
    str
        Text that :func:`load_net_prototxt` (and Caffe) read back.

    Raises
    ------
    PrototxtError
        Naming the layer, for a sparknet layer Caffe has no equivalent of (RNN, LSTM, GELU).
    """
    if isinstance(net, CaffeNet):
        return text_format.MessageToString(net.proto)
    params = getattr(net, "net_params", net)
    out = _schema.NetParameter(name=getattr(params, "name", "net"))
    for layer in params:
        out.layer.add().CopyFrom(_export_layer(layer))
    return text_format.MessageToString(out)
