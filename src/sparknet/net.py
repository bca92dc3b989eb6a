"""Net: the SparkNet API of Listing 1, in Python.

>>> net = Net(zoo.lenet(), SolverConfig(base_lr=0.01))
>>> net.set_training_data(mnist().train)
>>> net.set_validation_data(mnist().test)
>>> net.train(500)                       # doctest: +SKIP
>>> net.test()                           # doctest: +SKIP
0.981
>>> w = net.get_weights(); net.set_weights(w)

A ``Net`` wraps one model, its solver and its data. Data is turned into tensors once and
kept in memory; ``train`` cycles through it, reshuffling every epoch. The same class runs
on the driver (one process) and inside every Spark task.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from sparknet.config import Compute, Precision
from sparknet.layers import NetParams
from sparknet.optimizers import build_optimizer
from sparknet.solvers import SolverConfig, check_gradient_hook, lr_multiplier
from sparknet.labels import Task, bad_weights, infer_task, task_metrics, task_sums
from sparknet.weights import WeightCollection, local_box, local_view, module_layouts, whole_box, whole_weights

__all__ = ["Net", "Compute", "Precision", "TrainStats", "EvalResult", "FeatureDict", "resolve_device", "fixed_sample"]

EVAL_BATCH = 256
"""Rows scored at once by :meth:`Net.evaluate`: LeNet scores 10,000 MNIST digits 25-40% faster in batches of
256 than of 1,000, whose activations (46 MB for the first convolution) no longer fit the CPU's caches."""

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TrainStats:
    """What one call of :meth:`Net.train` did."""

    steps: int
    """Optimizer updates made."""
    samples: int
    """Training samples processed."""
    loss: float
    """Mean training loss over those steps (NaN when no step ran)."""
    last_loss: float
    """Loss of the last step."""
    wall_s: float
    """Seconds spent."""
    finite: bool = True
    """False when a loss or a weight became NaN or infinite."""


@dataclass(frozen=True)
class EvalResult:
    """Loss and the task's metrics on validation data."""

    loss: float
    accuracy: float
    """Fraction of labels predicted right (NaN for a regression net)."""
    samples: int
    metrics: dict = field(default_factory=dict)
    """The task's metrics by name: ``accuracy`` (and ``top5_accuracy`` past five classes; ``f1`` and
    ``weighted_precision`` for one class id a row, as Spark's evaluators weigh them, and ``macro_f1``) for classes;
    ``r2``, ``rmse`` and ``mae`` for numbers; ``accuracy``, ``f1`` and ``auc`` for label sets; none for a net without
    labels (its loss alone)."""
    sums: tuple = ()
    """The additive sums the metrics come from (:func:`sparknet.labels.task_sums`); none for a net without labels."""
    task: Task | None = field(default=None, repr=False, compare=False)
    """The task the metrics are of (what :meth:`joined` needs)."""
    weight: float | None = None
    """The rows' total sample weight, when each row was weighed (the loss and the metrics are then means over it,
    a row of weight w counting as w rows); ``None``: each row counted once."""

    @property
    def score(self) -> float:
        """The metric a target is set on: accuracy, or R² for a regression net."""
        return self.metrics.get("r2", self.accuracy)

    @property
    def counted(self) -> float:
        """What the loss is a mean over: the rows' total :attr:`weight`, else the rows."""
        return self.samples if self.weight is None else self.weight

    @classmethod
    def of(cls, task: Task, samples: int, loss_sum: float, sums=None, weight: float | None = None) -> EvalResult:
        """The result of ``samples`` rows whose losses add up to ``loss_sum``, with the task's additive ``sums``
        (:func:`sparknet.labels.task_sums`; none for a net without labels). ``weight``: the rows' total sample weight
        when the losses and the sums weighed each row. No rows (or no weight): NaN scores."""
        counted = samples if weight is None else weight
        loss = loss_sum / counted if counted else math.nan
        if task is Task.UNLABELLED or not samples or sums is None:
            return cls(loss=loss, accuracy=math.nan, samples=samples, task=task, weight=weight)
        metrics = task_metrics(task, sums)
        return cls(loss=loss, accuracy=metrics.get("accuracy", math.nan), samples=samples, metrics=metrics,
                   sums=tuple(sums), task=task, weight=weight)

    def joined(self, other: EvalResult) -> EvalResult:
        """The result over this one's rows and ``other``'s, which share none (a screen's and the rest's)."""
        if not other.samples:
            return self
        if not self.samples:
            return other
        task = self.task if self.task is not None else other.task
        if task is None:
            raise ValueError("results of no known task cannot be joined")
        sums = None if task is Task.UNLABELLED else [a + b for a, b in zip(self.sums, other.sums)]
        weight = None if self.weight is None and other.weight is None else self.counted + other.counted
        return EvalResult.of(task, self.samples + other.samples,
                             self.loss * self.counted + other.loss * other.counted, sums, weight)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"`` means CUDA when available, else the CPU."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device; use --device cpu or auto")
    return dev


class _ModuleAdapter:
    """Gives a plain ``torch.nn.Module`` and a loss the interface of a GraphModule."""

    def __init__(self, module: torch.nn.Module, loss: LossFn | None, task: Task = Task.CLASSIFICATION):
        self.module = module
        self.loss_fn = loss if loss is not None else torch.nn.CrossEntropyLoss()
        self.task = task
        self._per_row_fn = None  # the loss without its reduction, made once (sample weights)

    def loss(self, x, y, w=None):
        out = self.module(x)
        if w is not None:  # sample weights: the loss of each row, then their weighted mean
            if self._per_row_fn is None:
                self._per_row_fn = copy.copy(self.loss_fn)
                self._per_row_fn.reduction = "none"
            per = self._loss(self._per_row_fn, out, x, y)
            per = per.reshape(len(out), -1).mean(1) if per.dim() else per.expand(len(out))
            return (per * w).sum() / w.sum().clamp_min(1e-12), out
        return self._loss(self.loss_fn, out, x, y), out

    def _loss(self, loss_fn, out, x, y):
        if self.task is Task.UNLABELLED:  # the input is the target (an autoencoder)
            y = x.reshape(out.shape) if x.shape != out.shape and x.numel() == out.numel() else x
        if isinstance(loss_fn, torch.nn.CrossEntropyLoss) and out.dim() == 3 and y.dim() == 2:
            per = loss_fn(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            return per.reshape(len(out), -1) if per.dim() else per
        if self.task.float_labels and out.shape != y.shape and out.numel() == y.numel():
            y = y.reshape(out.shape)  # [n] labels for [n, 1] outputs: a loss would broadcast them to [n, n]
        return loss_fn(out, y)

    def predict(self, x):
        return self.module(x)

    def layer_weights(self) -> OrderedDict:
        out = OrderedDict((n, [p]) for n, p in self.module.named_parameters())
        for n, b in self.module.named_buffers():
            if b.is_floating_point():
                out[n] = [b]
        return out


class FeatureDict(torch.nn.Module):
    """A module called with a dict of named feature tensors, cut from each row's flat features.

    Spark hands a worker each row's feature columns concatenated into one flat float32 row (that is
    what travels, is staged and is streamed). This wraps the user's module so that its ``forward``
    receives ``{column: tensor}`` instead: a number column as a ``[n]`` tensor, an array or vector
    column as ``[n, d]``, or ``[n, *shape]`` where the user gave the column a shape. The columns
    are cut in ``layout`` order.

    It is not the module's parent: it shares the module's parameters, buffers and children, so its
    weights carry the module's own names (``fc.weight``, not ``module.fc.weight``) and one state dict
    loads into either. ``wrapped`` is the user's module.

    Parameters
    ----------
    module : torch.nn.Module
        Takes a dict of tensors.
    layout : sequence of (name, shape)
        Each column's name and the shape of one row of it (``()`` for a number).
    """

    def __init__(self, module: torch.nn.Module, layout):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"FeatureDict wraps a torch.nn.Module, got {type(module).__name__}")
        layout = tuple((str(name), tuple(int(d) for d in shape)) for name, shape in layout)
        names = [name for name, _ in layout]
        if not layout or len(set(names)) != len(names):
            raise ValueError(f"a dict of features needs distinct column names, got {names}")
        if any(d < 1 for _, shape in layout for d in shape):
            raise ValueError(f"feature shapes must hold positive sizes, got {dict(layout)}")
        self.layout = layout
        self.width = sum(math.prod(shape) for _, shape in layout)
        # Shared, not registered: the wrapper's named parameters and state dict are the module's own.
        for name in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            object.__setattr__(self, name, getattr(module, name))
        object.__setattr__(self, "wrapped", module)

    def forward(self, x: torch.Tensor):
        return self.wrapped(self.split(x))

    def split(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{column: tensor}`` of a batch of flat rows ``[n, width]`` (or ``[width]`` for one row)."""
        rows = x.reshape(1 if x.dim() == 1 else len(x), -1)
        if rows.shape[1] != self.width:
            raise ValueError(f"each row holds {rows.shape[1]} feature values, but the columns "
                             f"{[name for name, _ in self.layout]} hold {self.width}")
        out, at = {}, 0
        for name, shape in self.layout:
            size = math.prod(shape)
            out[name] = rows[:, at:at + size].reshape(len(rows), *shape)
            at += size
        return out

    def train(self, mode: bool = True):
        super().train(mode)
        self.wrapped.train(mode)  # the module's own flag: the wrapper does not hold it as a child
        return self

    def extra_repr(self) -> str:
        return f"wrapped={type(self.wrapped).__name__}, layout={dict(self.layout)}"


class _GraphAdapter:
    """The same interface over a sparknet ``GraphModule``."""

    def __init__(self, module):
        self.module = module

    def loss(self, x, y, w=None):
        return self.module.loss(x, y) if w is None else self.module.loss(x, y, w)

    def predict(self, x):
        return self.module(x)

    def layer_weights(self) -> OrderedDict:
        return self.module.layer_weights()


def _is_graph_module(obj) -> bool:
    return isinstance(obj, torch.nn.Module) and hasattr(obj, "loss") and hasattr(obj, "layer_weights")


def _as_tensor(a, *, name: str) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        t = a
    else:
        arr = np.asarray(a)
        if arr.dtype == object:
            raise ValueError(f"{name} holds Python objects, not numbers")
        arr = np.ascontiguousarray(arr)
        with warnings.catch_warnings():
            # Read-only arrays (memory-mapped data) are shared, not copied: Net never writes to its data.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(arr)
    if t.dtype == torch.float64:
        t = t.float()
    elif t.dtype in (torch.int32, torch.int16, torch.int8, torch.uint8):
        t = t.long()
    return t


def _floats(tensors: list[torch.Tensor]) -> list[float]:
    """Scalar tensors' values, read from their device at once."""
    return torch.stack(tensors).tolist() if len(tensors) > 1 else [tensors[0].item()]


def _collect(data, expected_label_ndim: int | None, batched: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn ``data`` (arrays pair, dataset with .x/.y, or iterable of samples/batches) into tensors."""
    if hasattr(data, "x") and hasattr(data, "y"):
        return _as_tensor(data.x, name="x"), _as_tensor(data.y, name="y")
    if isinstance(data, tuple) and len(data) == 2 and all(hasattr(a, "shape") for a in data) and batched is not False:
        x, y = _as_tensor(data[0], name="x"), _as_tensor(data[1], name="y")
    else:
        xs, ys = [], []
        for item in data:
            try:
                x, y = item
            except (TypeError, ValueError):
                raise ValueError("training and validation data must yield (x, y) pairs") from None
            xs.append(np.asarray(x) if not isinstance(x, torch.Tensor) else x)
            ys.append(np.asarray(y) if not isinstance(y, torch.Tensor) else y)
        if not xs:
            return torch.empty(0), torch.empty(0, dtype=torch.long)
        if batched is None:
            batched = getattr(ys[0], "ndim", 0) > (expected_label_ndim or 0)
        if batched:
            x = torch.cat([_as_tensor(a, name="x") for a in xs])
            y = torch.cat([_as_tensor(a, name="y") for a in ys])
        else:
            x = _as_tensor(np.stack([np.asarray(a) for a in xs]), name="x")
            y = _as_tensor(np.stack([np.asarray(a) for a in ys]), name="y")
    if len(x) != len(y):
        raise ValueError(f"features have {len(x)} rows but labels have {len(y)}")
    return x, y


def _row_weights(weights, rows: int) -> torch.Tensor:
    """Sample weights of ``rows`` rows as float64 on the CPU, checked: one number >= 0 a row."""
    w = _as_tensor(weights, name="weights").to("cpu", torch.float64).reshape(-1)
    bad = bad_weights(w.numpy())
    if len(w) != rows or bad:
        raise ValueError(f"weights: {len(w)} for {rows} rows, {bad} of them NaN, infinite or negative; give one "
                         "number >= 0 a row")
    return w


def shard_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules :meth:`Net.shard` gives FSDP2 as units, each gathering its weights whole while it computes: each
    layer of a layer-DSL net that has weights, any other module whole."""
    if hasattr(module, "layer_module") and hasattr(module, "module_names"):
        return [unit for unit in map(module.layer_module, module.module_names) if any(True for _ in unit.parameters())]
    return [module]


def _check_finite(x: torch.Tensor, what: str) -> None:
    """A clear error when floating-point features hold NaN or infinite values (they would train to NaN)."""
    if x.is_floating_point() and x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x.reshape(len(x), -1))).any(dim=1).sum())
        raise ValueError(f"{what}: {bad} rows hold NaN or infinite feature values; clean or impute them first")


@functools.lru_cache(maxsize=16)
def fixed_sample(n: int, k: int) -> np.ndarray:
    """``k`` of the indices ``0..n-1``, drawn at random once and the same on every call (sorted)."""
    if not 0 < k <= n:
        raise ValueError(f"a sample of {k} rows out of {n} is not possible")
    return np.sort(np.random.default_rng(0x5EED5).choice(n, size=k, replace=False))


class Net:
    """One network, its solver and its data: SparkNet's ``Net`` (Listing 1).

    Parameters
    ----------
    net : NetParams, GraphModule or torch.nn.Module
        A layer-DSL definition (built here), an already built ``GraphModule``, or any
        module whose ``forward(x)`` returns predictions.
    solver : SolverConfig, optional
        The update rule and learning-rate policy (default: SGD, lr 0.01, momentum 0.9).
    loss : callable, optional
        ``loss(prediction, y) -> scalar`` for a plain module (default: cross entropy).
        A NetParams net carries its own loss layers.
    batch_size : int, optional
        Training minibatch size; defaults to the batch dimension of the net's first input
        layer, else 64.
    device : str or torch.device
        ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or ``"auto"``.
    seed : int, optional
        Seeds the weight initialisation and the data shuffling.
    weighted : bool
        The training labels carry each row's sample weight as one more, last, value (what the Spark
        data path makes of a ``weight_col``): the loss is the weighted mean of the rows' losses.
        Validation data carries no weights.
    task : Task or str, optional
        ``"classification"``, ``"regression"``, ``"multilabel"`` or ``"unlabelled"`` (:mod:`sparknet.labels`);
        by default inferred from the loss: a regression loss (``MSELoss``, ``L1Loss``, ``HuberLoss``,
        ``SmoothL1Loss``, a ``EuclideanLoss`` layer) means regression, scored by R², RMSE and MAE;
        ``BCEWithLogitsLoss`` or ``MultiLabelSoftMarginLoss`` multi-label; anything else classification.
    compute : Compute, optional
        Mixed precision, compilation and memory order (default: float32, eager, the default order).
    """

    def __init__(self, net, solver: SolverConfig | None = None, *, loss: LossFn | None = None,
                 batch_size: int | None = None, device: str | torch.device = "cpu", seed: int | None = None,
                 task: Task | str | None = None, weighted: bool = False, compute: Compute | None = None):
        self.device = resolve_device(device)
        self.compute = compute or Compute()
        self.solver = solver or SolverConfig()
        self.seed = seed
        label_ndim = 0
        self._input_shape: tuple[int, ...] | None = None
        if isinstance(net, NetParams):
            default_batch = net.inputs[0].shape[0] if net.inputs else None
            self._input_shape = net.sample_shape
            label_ndim = _label_sample_ndim(net)
            # on the meta device: shapes only, never the whole weights (a sharded or split replica's rank)
            with torch.device("meta") if self.device.type == "meta" else contextlib.nullcontext():
                module = net.build(seed=seed)
            self.net_params = net
        else:
            self.net_params = None
            default_batch = None
            module = net
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"Net takes NetParams or a torch.nn.Module, got {type(net).__name__}")
        if _is_graph_module(module):
            if loss is not None:
                raise ValueError("a NetParams net carries its own loss layers; do not pass loss=")
            self._model = _GraphAdapter(module)
            if self.net_params is None:
                label_ndim = _label_sample_ndim(getattr(module, "net_params", None))
            self.task = infer_task(None, self.net_params or getattr(module, "net_params", None), task)
        else:
            self.task = infer_task(loss, None, task)
            self._model = _ModuleAdapter(module, loss, self.task)
        self.module = module.to(self.device)
        if self.compute.channels_last:
            self.module.to(memory_format=torch.channels_last)  # only 4-d tensors change their order
        self._forward_loss = torch.compile(self._model.loss) if self.compute.compile else self._model.loss
        self._label_ndim = label_ndim
        self.weighted = weighted
        self.batch_size = int(batch_size or default_batch or 64)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        self._solver_state = None  # (optimizer, scheduler), made when first asked for (see optimizer)
        self.iteration = 0
        self._live = self._local_weights()
        self.sharded = False
        """Whether :meth:`shard` or :meth:`split` cut the weights over several processes."""
        self._units: list = []  # the modules FSDP2 shards (shard)
        self.cuts: tuple = (None, 1)
        """How this net is cut over a worker's ranks (:meth:`cut_layouts`' arguments): split in M parts along each
        weight's dimension (``(M, dims)``, :meth:`split`; ``None``: not split), then sharded in parts
        (:meth:`shard`)."""
        # the whole model's gradient norm where torch's cannot take it (a split net's: tensor parallelism)
        self._clip_norm = getattr(module, "clip_grad_norm_", None)
        self._gen = torch.Generator().manual_seed(seed if seed is not None else torch.initial_seed() % (2**31))
        self._train: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stream = None  # a RowStream, or a split copy's SharedStream
        self._val: tuple[torch.Tensor, ...] | None = None  # (x, y), or (x, y, w) with each row's sample weight
        self._shuffle = True
        self._perm: torch.Tensor | None = None
        self._pos = 0
        self.epoch = 0

    # -- data ------------------------------------------------------------------------------
    def set_training_data(self, data, *, batch_size: int | None = None, shuffle: bool = True,
                          batched: bool | None = None) -> None:
        """Give the net its training data.

        Parameters
        ----------
        data : ArrayDataset, (x, y) arrays, iterable of (x, y), or a stream
            Samples or whole batches (told apart by the label's rank, or by ``batched``),
            turned into tensors once and kept in memory; or a :class:`~sparknet.rowfile.RowStream`,
            which hands out minibatches from disk through a bounded shuffle buffer (it shuffles
            itself; ``shuffle`` is its own), or a split copy's
            :class:`~sparknet.parallel.mesh.SharedStream` of such streams.
        batch_size : int, optional
            Overrides the net's minibatch size.
        shuffle : bool
            Reshuffle at the start of every epoch.
        """
        if hasattr(data, "next_batch"):  # a RowStream, or a split copy's SharedStream
            self._stream, self._train = data, None
        else:
            x, y = self._fit_input(*_collect(data, self._label_ndim, batched))
            if len(x) == 0:
                raise ValueError("training data is empty")
            self._stream, self._train = None, (x.to(self.device), y.to(self.device))
        if batch_size is not None:
            if batch_size < 1:
                raise ValueError(f"batch_size must be positive, got {batch_size}")
            self.batch_size = int(batch_size)
        self._shuffle = shuffle
        self._perm, self._pos, self.epoch = None, 0, 0

    def set_validation_data(self, data, *, batched: bool | None = None) -> None:
        """Give the net the data :meth:`test` and :meth:`evaluate` score. ``(x, y, w)`` arrays give each row's sample
        weight too (``[n]``, numbers >= 0), which every evaluation of them weighs each row by (:meth:`evaluate`)."""
        weights = None
        if isinstance(data, tuple) and len(data) == 3 and hasattr(data[0], "shape"):
            *data, weights = data
            data = tuple(data)
        x, y = self._fit_input(*_collect(data, self._label_ndim, batched))
        if len(x) == 0:
            raise ValueError("validation data is empty")
        _check_finite(x, "validation data")
        if weights is not None:
            weights = _row_weights(weights, len(x))
            if not weights.any():
                raise ValueError(f"validation data: all {len(x)} rows have a sample weight of 0, so no score "
                                 "could be measured on them")
        self._val = (x, y) if weights is None else (x, y, weights)

    @property
    def validation_weight(self) -> float | None:
        """The validation rows' total sample weight (``None``: they came with none, or there are none)."""
        return float(self._val[2].sum()) if self._val is not None and len(self._val) > 2 else None

    def _fit_input(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reshape flat feature rows to the net's input shape; a clear error when they cannot fit."""
        if self.task.float_labels and not y.is_floating_point():
            y = y.float()
        shape = self._input_shape
        if shape is None or len(x) == 0 or tuple(x.shape[1:]) == shape:
            return x, y
        per_sample = int(np.prod(x.shape[1:]))
        if per_sample != int(np.prod(shape)):
            raise ValueError(f"each sample has {per_sample} feature values {tuple(x.shape[1:])}, but the net's input "
                             f"layer takes shape {shape} ({int(np.prod(shape))} values)")
        return x.reshape(len(x), *shape), y

    def _split_weights(self, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training labels with the weight last -> (labels as the loss takes them, weights)."""
        y, w = yb[:, :-1], yb[:, -1]
        if y.shape[1] == 1 and self._label_ndim == 0:
            y = y[:, 0]
        return (y if self.task.float_labels else y.long()), w

    @property
    def num_training_samples(self) -> int:
        if self._stream is not None:
            return self._stream.rows
        return 0 if self._train is None else len(self._train[0])

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._stream is not None:
            xb, yb = self._stream.next_batch(self.batch_size)
            self.epoch = self._stream.epoch
            xb, yb = self._fit_input(torch.from_numpy(xb), torch.from_numpy(yb))
            if self.device.type == "cuda":  # pinned, so that the copy runs while the GPU still computes
                xb, yb = xb.pin_memory(), yb.pin_memory()
            return xb.to(self.device, non_blocking=True), yb.to(self.device, non_blocking=True)
        x, y = self._train
        n = len(x)
        b = min(self.batch_size, n)
        if self._perm is None or self._pos + b > n:
            if self._perm is not None:
                self.epoch += 1
            self._perm = torch.randperm(n, generator=self._gen) if self._shuffle else torch.arange(n)
            self._perm = self._perm.to(x.device)
            self._pos = 0
        idx = self._perm[self._pos:self._pos + b]
        self._pos += b
        return x.index_select(0, idx), y.index_select(0, idx)

    # -- training --------------------------------------------------------------------------
    def _layout(self, x: torch.Tensor) -> torch.Tensor:
        """An input batch in the memory order the net's weights are kept in (:attr:`Compute.channels_last`)."""
        return x.contiguous(memory_format=torch.channels_last) if self.compute.channels_last and x.dim() == 4 else x

    def _autocast(self):
        """The context a forward pass runs in (:attr:`Compute.precision`)."""
        if self.compute.precision is Precision.BF16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss(self, what: str, xb: torch.Tensor, yb: torch.Tensor, weight: torch.Tensor | None = None):
        """The model's loss (weighing each row by ``weight``, ``[n]``, when given) and prediction; torch's bare
        ``Target 7 is out of bounds`` as an error that says which labels and what to do."""
        try:
            with self._autocast():
                return self._forward_loss(self._layout(xb), yb, *(() if weight is None else (weight,)))
        except IndexError as exc:
            if self.task is not Task.CLASSIFICATION:  # labels that index nothing: the net's own error
                raise
            bounds = ""
            if yb.numel() and not yb.is_floating_point():
                bounds = f" (labels in this batch range over [{int(yb.min())}, {int(yb.max())}])"
            raise ValueError(f"{what}: the loss could not be computed: {exc}{bounds}; labels must be class ids 0..C-1 "
                             "for a net with C outputs") from exc

    def train(self, num_steps: int, max_seconds: float | None = None,
              after_backward: Callable[[Net], None] | None = None) -> TrainStats:
        """Run up to ``num_steps`` solver updates, or until ``max_seconds`` pass.

        With a time budget at least one update runs. ``after_backward`` is called after
        each update's gradients are computed and before the optimizer steps (a strategy
        may allreduce gradients there). A line-search solver (cg, lbfgs) evaluates the
        step's ``iter_size`` minibatches again at every trial of its search, and refuses
        ``after_backward``.
        """
        if self._train is None and self._stream is None:
            raise ValueError("no training data: call set_training_data() first")
        if num_steps < 0:
            raise ValueError(f"num_steps must be non-negative, got {num_steps}")
        if after_backward is not None:
            check_gradient_hook(self.solver, "an after_backward hook")
        module, opt, sched = self.module, self.optimizer, self.scheduler
        iter_size = self.solver.iter_size
        clip = self.solver.clip_gradients
        # a split net's own norm sums its parts over its ranks (torch's refuses split and whole gradients together)
        clip_norm = self._clip_norm or (lambda max_norm: torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm))

        def forward_backward(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
            """The minibatches' losses (read later: reading one waits for the device), their mean gradient in the
            weights' ``grad`` (a line search calls it again at every weight it tries)."""
            opt.zero_grad(set_to_none=True)
            losses = []
            for xb, yb in batches:
                loss, _ = self._loss("training data", xb, *(self._split_weights(yb) if self.weighted else (yb,)))
                (loss / iter_size if iter_size > 1 else loss).backward()
                losses.append(loss.detach())
            return losses

        def mean_loss(losses: list[float]) -> float:
            total = 0.0
            for loss in losses:
                total += loss
            return total / iter_size

        def closure(batches) -> float:
            return mean_loss([loss.item() for loss in forward_backward(batches)])

        module.train()
        t0 = time.perf_counter()
        deadline = None if max_seconds is None else t0 + max_seconds
        steps = samples = 0
        step_losses: list = []  # a step's loss, or its minibatches' losses on the device, read after the loop: a
        for _ in range(num_steps):  # read each step would keep the host from queueing the next step's work
            if deadline is not None and steps and time.perf_counter() >= deadline:
                break
            batches = [self._next_batch() for _ in range(iter_size)]
            samples += sum(len(xb) for xb, _ in batches)
            if self.solver.type.needs_closure:
                step_losses.append(float(opt.step(functools.partial(closure, batches))))  # the loss before the update
            else:
                step_losses.append(forward_backward(batches))
                if after_backward is not None:
                    after_backward(self)
                if clip > 0:  # Caffe clips the iter_size minibatches' summed gradient, before dividing it
                    clip_norm(clip / iter_size)
                opt.step()
            sched.step()
            self.iteration += 1
            steps += 1
            if deadline is not None and self.device.type == "cuda":  # the clock sees the device's time
                torch.cuda.synchronize(self.device)
        losses = [loss if isinstance(loss, float) else mean_loss(_floats(loss)) for loss in step_losses]
        loss_sum, last, finite = 0.0, math.nan, True
        for step_loss in losses:
            finite = finite and math.isfinite(step_loss)
            loss_sum += step_loss
            last = step_loss
        wall = time.perf_counter() - t0
        return TrainStats(steps=steps, samples=samples, loss=loss_sum / steps if steps else math.nan,
                          last_loss=last, wall_s=wall, finite=finite)

    step = train  # Listing 3 spells it net.step(50)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The solver's torch optimizer over the net's weights, made when first asked for: a net that only
        evaluates or holds weights (a fit's driver) never makes one, nor loads torch's compiler stack, which every
        torch optimizer imports as it is made (a second or more)."""
        return self._solver()[0]

    @property
    def scheduler(self):
        """The learning-rate schedule of :attr:`optimizer` (made with it)."""
        return self._solver()[1]

    def _solver(self):
        if self._solver_state is None:
            self._solver_state = build_optimizer(self.module, self.solver)
        return self._solver_state

    def set_iteration(self, iteration: int) -> None:
        """Move the solver's iteration counter (and so its learning rate) to ``iteration``."""
        self.iteration = int(iteration)
        self.scheduler.last_epoch = self.iteration
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * lr_multiplier(self.solver, self.iteration)

    @property
    def learning_rate(self) -> float:
        """The current learning rate of the first parameter group."""
        return float(self.optimizer.param_groups[0]["lr"])

    # -- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, data=None, num_steps: int | None = None, batch_size: int = EVAL_BATCH, *,
                 sample: int | None = None, rest_of: int | None = None, weights=None) -> EvalResult:
        """Mean loss and accuracy on the validation data (or on ``data``), ``batch_size`` rows at a time.

        ``sample``: score at most this many rows, a fixed random sample of them (the same rows on
        every call for data of the same length): a quick estimate of the whole set's accuracy.
        ``rest_of``: score the rows that a ``sample`` of that many leaves out (none when it takes every row); the
        sample's result :meth:`EvalResult.joined` with this one is the whole set's.
        ``weights``: each row's sample weight (``[n]``, numbers >= 0): the loss and the metrics weigh each row by it,
        as Spark's evaluators do with a ``weightCol`` (a row of weight w counts as w rows); by default, those the
        validation data was given with (:meth:`set_validation_data`).
        """
        if data is not None:
            x, y = self._fit_input(*_collect(data, self._label_ndim, None))
            w = None
        elif self._val is not None:
            x, y, w = (*self._val, None)[:3]
        else:
            raise ValueError("no validation data: call set_validation_data() first")
        if weights is not None:
            w = _row_weights(weights, len(x))
        if sample is not None and rest_of is not None:
            raise ValueError("score a sample or the rest of one, not both")
        rows = None
        if sample is not None and sample < len(x):
            rows = torch.tensor(fixed_sample(len(x), sample))
        elif rest_of:
            rest = np.ones(len(x), dtype=bool)
            rest[fixed_sample(len(x), rest_of) if rest_of < len(x) else slice(None)] = False
            rows = torch.from_numpy(np.flatnonzero(rest))
        if rows is not None:
            x, y, w = x[rows], y[rows], None if w is None else w[rows]
        was_training = self.module.training
        self.module.eval()
        n = len(x) if num_steps is None else min(len(x), num_steps * batch_size)
        loss_sum = 0.0
        sums: list[float] | None = None
        try:
            for start in range(0, n, batch_size):
                xb = x[start:start + batch_size].to(self.device)
                yb = y[start:start + batch_size].to(self.device)
                wb = None if w is None else w[start:start + batch_size].to(self.device)
                loss, pred = self._loss("validation data", xb, yb, None if wb is None else wb.to(torch.float32))
                loss_sum += loss.item() * (len(xb) if wb is None else float(wb.sum()))
                if self.task is not Task.UNLABELLED:
                    batch = task_sums(self.task, pred, yb, wb)
                    sums = batch if sums is None else [a + b for a, b in zip(sums, batch)]
        finally:
            self.module.train(was_training)
        return EvalResult.of(self.task, n, loss_sum, sums, None if w is None else float(w[:n].sum()))

    def test(self, num_steps: int | None = None) -> float:
        """The task's score on the validation data (accuracy, or R²): all of it, or ``num_steps`` batches of 1000."""
        return self.evaluate(num_steps=num_steps, batch_size=1000).score

    @torch.no_grad()
    def predict(self, x) -> torch.Tensor:
        """The net's prediction blob (logits) for a batch of features."""
        was_training = self.module.training
        self.module.eval()
        try:
            x = self._layout(_as_tensor(x, name="x").to(self.device))
            with self._autocast():
                out = self._model.predict(x)
            return out.float() if out.dtype == torch.bfloat16 else out
        finally:
            self.module.train(was_training)

    # -- weights ---------------------------------------------------------------------------
    def get_weights(self) -> WeightCollection:
        """A copy of the weights, keyed by layer name (or module parameter name)."""
        return self._live.clone().to("cpu")

    def set_weights(self, weights: WeightCollection) -> None:
        """Overwrite the weights in place (the solver's momentum is kept)."""
        self._drop_gathered()
        weights.copy_into(self._live)

    def _drop_gathered(self) -> None:
        """A sharded net (:meth:`shard`) lets go of the whole weights a forward without a backward left gathered, so
        that its next forward gathers the parts about to be written. FSDP2 keeps a root unit's weights gathered after
        its forward, for the backward: after an evaluation, the next training step would otherwise run on the
        evaluated weights, not the ones set since (a streamed exchange's own weights, put back after scoring the
        global ones)."""
        for unit in self._units:
            unit.reshard()

    @property
    def weights(self) -> WeightCollection:
        """The live tensors (no copy): what engines flatten and load in place."""
        return self._live

    def shard(self, mesh, device: str | torch.device | None = None) -> None:
        """Shard this net's weights and solver state over ``mesh``'s ranks (a 1-D mesh: a worker of several
        processes, ``--shard-replica``) with PyTorch's FSDP2, in place. Every rank must hold the same weights and call
        it together, before training. A net built on the meta device (``Net(..., device="meta")``: shapes, no values)
        is made on ``device`` after it is cut, each rank allocating its parts only, which hold no values until
        :meth:`set_flat` (a whole net's rows never exist on any rank).

        Every weight is cut along its first dimension, one part a rank (a DTensor); a unit gathers its weights for its
        own forward and backward and frees them after, and the gradients are averaged over the mesh as they are
        reduce-scattered, so the ranks train as one process with their batches together. A layer-DSL net is sharded
        layer by layer (each layer module is a unit: it is what its graph calls), any other module as one unit.
        Afterwards :meth:`get_flat` and :meth:`set_flat` read and write this rank's parts, the solver holds state for
        them only, and :meth:`full_weights` gathers the whole."""
        from torch.distributed.fsdp import fully_shard

        units = shard_units(self.module)
        for unit in units:
            fully_shard(unit, mesh=mesh)
        self._units = units
        self.cuts = (self.cuts[0], mesh.size())
        self._clip_norm = None  # every weight a DTensor now (a split one's on both meshes): torch's clipping
        self._made_cut(device)

    def split(self, mesh, plan=None, device: str | torch.device | None = None) -> None:
        """Split this net's layers over ``mesh``'s ranks with tensor parallelism (a 1-D mesh: a worker of several
        processes, ``--model-parallel``), in place: the layers ``plan`` names (else the layer DSL's ``parallel=``
        fields; :func:`~sparknet.parallel.tensor.resolve_plan`) hold a part of their weights on each rank, every
        other layer is whole on every rank, and the ranks run every step together on the same batch. The net must be
        a layer-DSL net built on the meta device (``Net(net_params, device="meta")``); it is made on ``device`` after
        it is cut, each rank allocating its parts only, which hold no values until :meth:`set_flat`.

        Afterwards :meth:`get_flat` and :meth:`set_flat` read and write this rank's parts (its shards of the split
        layers, the whole layers whole), the solver holds state for them only, gradient clipping takes the norm of
        the whole model, and :meth:`full_weights` gathers the whole."""
        from sparknet.parallel.tensor import split_dims, split_meta

        if self.device.type != "meta" or self.net_params is None:
            raise ValueError("Net.split cuts a layer-DSL net built on the meta device: Net(net_params, "
                             "device='meta')")
        self.cuts = ((mesh.size(), split_dims(self.module, mesh.size(), plan)), 1)
        split = split_meta(self.module, mesh, plan)  # the net's own module, its layers split in place
        self._clip_norm = split.clip_grad_norm_
        self._made_cut(device)

    def _made_cut(self, device) -> None:
        """A net just cut over several processes (:meth:`shard`, :meth:`split`): made on ``device`` where it was
        built on the meta device, and its solver and weights read again from its parts."""
        if self.device.type == "meta":
            self.device = resolve_device(device)
            self.module.to_empty(device=self.device)
            for buffer in self.module.buffers():
                if not buffer.is_floating_point():  # counters (a batch norm's batches seen): not in get_flat
                    buffer.zero_()
        self._solver_state = build_optimizer(self.module, self.solver)  # over this rank's parts
        self.set_iteration(self.iteration)
        self._live = self._local_weights()
        self.sharded = True

    def shard_layout(self) -> list[tuple]:
        """Each weight's part on this rank, in :meth:`get_flat` order, as :func:`~sparknet.weights.worker_layouts` says
        it: the box of the whole weight its local values hold (a DTensor's, as its placements cut it: FSDP2's rows, a
        split layer's part, both), a whole one (a buffer, a layer left whole, an unsharded net's weight) all of it.
        What joins the ranks' parts again (:func:`~sparknet.parallel.mesh.join_shards`)."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # private: DCP's own

        layout = []
        for t in (t for ts in self._model.layer_weights().values() for t in ts):
            if getattr(t, "device_mesh", None) is None:
                layout.append(whole_box(t.shape))
                continue
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            layout.append(local_box(tuple((o, o + n, size) for o, n, size in zip(offset, shape, t.shape))))
        return layout

    def cut_layouts(self, split: tuple[int, list] | None = None, shard: int = 1) -> list[list[tuple]]:
        """The :meth:`shard_layout` each rank of a worker will have once this whole net is split (``split``: M and
        each weight's dimension, :func:`~sparknet.parallel.tensor.split_dims`) and its parameters sharded ``shard``
        ways along their first dimension as ``torch.chunk`` cuts (FSDP2's rule), rank ``c * M + m`` holding part m of
        the split and part c of that; buffers are never sharded. What the driver cuts a sharded or split replica's
        starting weights with, so that no rank gets them whole; ``net.cut_layouts(*net.cuts)``: the worker's layouts
        of a net cut already."""
        return module_layouts(self._model, *(split if split is not None else (1, None)), shard)

    def _local_weights(self) -> WeightCollection:
        """The weights as this process holds them: views of its shards where a weight is sharded (tensor
        parallelism, a sharded replica), the weights themselves otherwise."""
        return WeightCollection((name, [local_view(t) for t in ts]) for name, ts in self._model.layer_weights().items())

    def full_weights(self) -> WeightCollection:
        """The whole weights as CPU copies; a sharded net's (:meth:`shard`) gathered from its ranks, every one of
        which must call it."""
        return whole_weights(self._model.layer_weights())

    def get_flat(self) -> torch.Tensor:
        """All weights as one float32 CPU buffer."""
        return self._live.to_flat(torch.float32).cpu()

    def set_flat(self, buffer: torch.Tensor) -> None:
        """Load weights from one flat buffer made by :meth:`get_flat`."""
        self._drop_gathered()
        self._live.load_flat_(buffer.to(self.device))

    # -- state for checkpoints --------------------------------------------------------------
    def solver_state(self, *, copy_tensors: bool = True) -> dict:
        """Optimizer, scheduler, iteration and data position (for checkpoints); a copy, unless
        ``copy_tensors=False`` (the optimizer's live tensors, for a caller that writes them out at once)."""
        optimizer = self.optimizer.state_dict()
        if self.sharded:  # this rank's parts of the solver state, as plain tensors
            optimizer = {**optimizer, "state": {k: {n: local_view(v).clone() if isinstance(v, torch.Tensor) else v
                                                    for n, v in st.items()} for k, st in optimizer["state"].items()}}
        return {
            "optimizer": copy.deepcopy(optimizer) if copy_tensors else optimizer,
            "iteration": self.iteration,
            "epoch": self.epoch,
            "pos": self._pos,
            "perm": None if self._perm is None else self._perm.cpu().clone(),
            "generator": self._gen.get_state(),
            **({"stream": self._stream.state()} if self._stream is not None else {}),
        }

    def load_solver_state(self, state: dict) -> None:
        """Restore what :meth:`solver_state` returned."""
        self.optimizer.load_state_dict(state["optimizer"])
        if self.sharded:  # plain tensors of this rank's parts: sharded as their weights are again
            from torch.distributed.tensor import DTensor

            for p, st in self.optimizer.state.items():
                for n, v in st.items():
                    if isinstance(p, DTensor) and type(v) is torch.Tensor and v.dim():
                        st[n] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                                   stride=p.stride())
        self.set_iteration(state["iteration"])
        self.epoch, self._pos = state["epoch"], state["pos"]
        self._perm = None if state["perm"] is None else state["perm"].to(self.device)
        # the data order's generator is the CPU's: its state read back onto a GPU (load_tree(path, "cuda")), or
        # as another integer type, is a CPU byte tensor again
        self._gen.set_state(torch.as_tensor(state["generator"]).to(device="cpu", dtype=torch.uint8))
        if self._stream is not None and "stream" in state:
            self._stream.load_state(state["stream"])

    def __repr__(self) -> str:
        return (f"Net({type(self.module).__name__}, solver={self.solver.type.value}, "
                f"batch_size={self.batch_size}, device={self.device}, params={self._live.numel:,})")


def _label_sample_ndim(net_params) -> int:
    """Rank of one label sample (0 for class labels, 1 for sequences), from the DSL inputs."""
    inputs = net_params.inputs if net_params is not None else []
    if len(inputs) < 2:
        return 0
    shape = list(inputs[1].shape)
    while len(shape) > 1 and shape[-1] == 1:
        shape.pop()
    return len(shape) - 1
