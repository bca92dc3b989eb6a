"""Training from Caffe files: a net prototxt and a solver prototxt run as Caffe would run them.

Run it with::

    sparknet train --solver lenet_solver.prototxt --workers 2

or from Python::

    >>> plan = resolve_caffe_run(solver="lenet_solver.prototxt")           # doctest: +SKIP
    >>> summary = train_caffe(plan, workers=2)                             # doctest: +SKIP

What the solver says, and what sparknet does with it
----------------------------------------------------
- ``max_iter`` solver updates (per worker when training on Spark), with the solver's update
  rule and learning-rate policy;
- every ``test_interval`` updates (and before the first one when ``test_initialization``),
  every TEST net (one per ``test_state``) runs on ``test_iter`` batches of its own data and
  every output blob it leaves unconsumed (``accuracy``, ``loss``...) is reported, as
  Caffe's ``Test net output #i`` lines are;
- every ``display`` updates, a log line with the mean training loss and learning rate;
- every ``snapshot`` updates (and at the end, when ``snapshot_after_train``), the weights as
  ``<prefix>_iter_<N>.caffemodel`` and as a sparknet model folder ``<prefix>_iter_<N>/``.

Data layers are bound to sparknet data sets (see :class:`~sparknet.caffe.DataBinding`); each
net's ``transform_param`` is applied once when its data is loaded. Random transforms (mirror,
random crops) are therefore drawn once per run, not once per epoch as Caffe draws them.
A net without a label blob (the MNIST autoencoder) trains on its features alone; it is fed
placeholder labels that no layer reads.

One worker trains in this process with :class:`~sparknet.net.Net`; ``workers > 1`` (or an
explicit Spark master or the barrier engine) trains through
:class:`~sparknet.spark.SparkTrainer` on a DataFrame of the transformed data.
"""

from __future__ import annotations

import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sparknet._app import seed_everything
from sparknet.model_io import save_model
from sparknet.caffe.caffemodel import load_caffemodel_into, write_caffemodel
from sparknet.caffe.prototxt import CaffeNet, DataBinding, load_net_prototxt
from sparknet.caffe.solver import CaffeSolver, NetStateSpec, load_solver_prototxt, resolve_net_path
from sparknet.config import Compute, DistributedConfig, Engine, WorkerConfig, check_at_least
from sparknet.datasets import ArrayDataset, load_dataset
from sparknet.layers import AccuracyLayer, NetParams, RDDLayer
from sparknet.loop import FitPlan, InProcessExchange, returned_summary, run_rounds
from sparknet.metrics import MetricsLogger
from sparknet.net import Net
from sparknet.solvers import SolverConfig, lr_multiplier
from sparknet.spark import SparkTrainer, get_session
from sparknet.strategies import Average
from sparknet.spark.data import frame_from_arrays
from sparknet.spark.session import is_local_master
from sparknet.spark.run import dataset_as_parquet
from sparknet.weights import WeightCollection

logger = logging.getLogger(__name__)

__all__ = ["CaffeRun", "CaffeTest", "CaffeEvaluator", "Snapshotter", "resolve_caffe_run", "parse_sources",
           "load_net_data", "train_caffe"]

_DATASET_SCALE = {"mnist": 1 / 255, "mnist-small": 1 / 255, "mnist_small": 1 / 255}
"""Data sets whose sparknet loader yields pixels scaled to [0, 1]."""


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class CaffeTest:
    """One TEST net of a run and how much of its data each test reads."""

    net: CaffeNet
    """The net, loaded for its test state."""
    iters: int | None
    """Batches per test (Caffe's ``test_iter``); ``None``: the whole data set once."""
    label: str
    """A short name for records: its stages joined by ``+``, else ``"test"`` (or ``"test<i>"``)."""


@dataclass(kw_only=True)
class CaffeRun:
    """A Caffe training run with every setting resolved (see :func:`resolve_caffe_run`)."""

    train_net: CaffeNet
    """The TRAIN-phase net."""
    tests: list[CaffeTest] = field(default_factory=list)
    """The TEST nets (empty: no testing)."""
    solver: SolverConfig
    """Update rule and learning-rate policy."""
    max_iter: int
    """Solver updates (per worker)."""
    batch_size: int
    """Training minibatch size."""
    test_interval: int = 0
    """Updates between tests (0: only at the end)."""
    test_initialization: bool = True
    """Test before the first update."""
    display: int = 0
    """Updates between progress lines (0: none)."""
    snapshot: int = 0
    """Updates between snapshots (0: none before the end)."""
    snapshot_after_train: bool = True
    """Snapshot once more when training ends."""
    snapshot_dir: Path
    """Where snapshots go."""
    snapshot_prefix: str
    """File name stem of the snapshots (``lenet`` -> ``lenet_iter_5000.caffemodel``)."""
    seed: int = 0
    """Seed of the initial weights and the data order."""
    weights: tuple[Path, ...] = ()
    """``.caffemodel`` files loaded into the net before training (fine-tuning), in order."""
    sources: dict[str, DataBinding] = field(default_factory=dict)
    """Data bindings given by the user (besides the BVLC defaults)."""
    max_train_samples: int | None = None
    """Use only the first N training samples (quick runs)."""
    net_text: str | None = None
    """The net prototxt as written (kept in the model folders)."""
    net_path: Path | None = None
    """The net prototxt's file."""
    solver_path: Path | None = None
    """The solver prototxt's file."""

    @property
    def primary_test(self) -> CaffeTest | None:
        """The test whose numbers the summary reports: the last one reading a test or validation split."""
        for test in reversed(self.tests):
            binding = test.net.data_binding
            if binding is not None and binding.split in ("test", "validation"):
                return test
        return self.tests[0] if self.tests else None

    def describe(self) -> dict:
        """The resolved settings as plain values (logged and written to the summary)."""
        return {
            "net": str(self.net_path) if self.net_path else self.train_net.name,
            "solver_file": str(self.solver_path) if self.solver_path else None,
            "solver": self.solver.to_dict(),
            "max_iter": self.max_iter,
            "batch_size": self.batch_size,
            "test_interval": self.test_interval,
            "test_iter": {t.label: t.iters for t in self.tests},
            "display": self.display,
            "snapshot": self.snapshot,
            "snapshot_dir": str(self.snapshot_dir),
            "snapshot_prefix": self.snapshot_prefix,
            "seed": self.seed,
            "weights": [str(w) for w in self.weights],
        }


def parse_sources(text: str | Mapping[str, Any] | None) -> dict[str, DataBinding]:
    """Data bindings from ``"SOURCE=DATASET[:SPLIT],..."`` (or a mapping of the same).

    MNIST-like names (``mnist``, ``mnist-small``) get MNIST's sample shape and pixel scale,
    so Caffe's ``scale: 0.00390625`` keeps meaning what it means in Caffe.

    Raises
    ------
    ValueError
        An entry without ``=``.
    """
    if not text:
        return {}
    items = list(text.items()) if isinstance(text, Mapping) else []
    if isinstance(text, str):
        for entry in filter(None, (e.strip() for e in text.split(","))):
            if "=" not in entry:
                raise ValueError(f"a data source binding reads SOURCE=DATASET[:SPLIT], got {entry!r}")
            key, _, value = entry.partition("=")
            items.append((key.strip(), value.strip()))
    out: dict[str, DataBinding] = {}
    for key, value in items:
        name, _, split = str(value).partition(":")
        binding = DataBinding.parse(value)
        scale = _DATASET_SCALE.get(name.lower())
        if scale is not None and binding.sample_shape is None and not isinstance(value, DataBinding):
            binding = DataBinding(name, split or "train", (1, 28, 28), scale, 10)
        out[key] = binding
    return out


def resolve_caffe_run(
    prototxt: str | os.PathLike | None = None,
    solver: str | os.PathLike | None = None,
    *,
    weights: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    snapshot_dir: str | os.PathLike | None = None,
    sources: str | Mapping[str, Any] | None = None,
    max_iter: int | None = None,
    batch_size: int | None = None,
    test_interval: int | None = None,
    test_iter: int | None = None,
    display: int | None = None,
    snapshot: int | None = None,
    seed: int | None = None,
    solver_overrides: Mapping[str, Any] | None = None,
    default_solver: SolverConfig | None = None,
    max_train_samples: int | None = None,
) -> CaffeRun:
    """Read the Caffe files and settle every setting of the run.

    The Caffe files decide; an argument given here (not ``None``) wins over them.

    Parameters
    ----------
    prototxt : path, optional
        The net. With a solver it replaces the solver's ``net:``.
    solver : path, optional
        The solver. Without it the run uses ``default_solver`` (or ``SolverConfig()``),
        tests the whole TEST-phase data every ``test_interval`` (default: only at the end),
        displays every 100 updates and snapshots only at the end.
    weights : path or paths, optional
        ``.caffemodel`` files to start from (default: the solver's ``weights:``).
    snapshot_dir : path, optional
        Default: a folder named after ``snapshot_prefix`` (its last component, e.g.
        ``lenet``) in the current directory.
    sources : str or mapping, optional
        Extra data bindings, see :func:`parse_sources`.
    max_iter, batch_size, test_interval, test_iter, display, snapshot, seed : int, optional
        Override the files' values (``test_iter`` applies to every test net).
    solver_overrides : mapping, optional
        ``SolverConfig`` fields to change (``base_lr``, ``momentum``...).
    default_solver : SolverConfig, optional
        The solver when no solver file is given.
    max_train_samples : int, optional
        Train on the first N samples only.

    Raises
    ------
    ValueError
        Neither file given, or a bad override.
    FileNotFoundError
        A file that does not exist, or a solver whose ``net:`` cannot be found (the message
        says to pass the net prototxt).
    PrototxtError
        A Caffe file that does not parse or build (file, line, layer).
    """
    if prototxt is None and solver is None:
        raise ValueError("give a net prototxt, a solver prototxt, or both")
    check_at_least(1, max_iter=max_iter, batch_size=batch_size, test_iter=test_iter,
                   max_train_samples=max_train_samples)
    check_at_least(0, test_interval=test_interval, display=display, snapshot=snapshot)
    bindings = parse_sources(sources)
    net_file = Path(prototxt) if prototxt is not None else None
    if net_file is not None and not net_file.is_file():
        raise FileNotFoundError(f"no such net prototxt: {net_file}")

    caffe_solver: CaffeSolver | None = None
    if solver is not None:
        solver_file = Path(solver)
        if not solver_file.is_file():
            raise FileNotFoundError(f"no such solver prototxt: {solver_file}")
        caffe_solver = load_solver_prototxt(solver_file)
        if net_file is None and caffe_solver.net_path is None and caffe_solver.net_text is None:
            named = caffe_solver.net or (caffe_solver.test_nets[0] if caffe_solver.test_nets else None)
            if named is None:
                raise FileNotFoundError(f"{solver_file}: the solver names no net (net: or train_net:); "
                                        "pass the net prototxt with --prototxt")
            raise FileNotFoundError(
                f"{solver_file}: its net {named!r} was not found next to the solver or in its parent folders; "
                "pass the net prototxt with --prototxt PATH")

    def load(phase: str, stages: tuple[str, ...] = (), level: int = 0) -> CaffeNet:
        if caffe_solver is not None:
            return caffe_solver.load_net(phase, stages=stages, level=level, sources=bindings, net=net_file)
        return load_net_prototxt(net_file, phase=phase, sources=bindings, stages=stages, level=level)

    train_state = caffe_solver.train_state if caffe_solver is not None else NetStateSpec("TRAIN")
    train_net = load(train_state.phase, train_state.stages, train_state.level)
    if caffe_solver is not None and train_net.phase != "TRAIN":
        train_net = load("TRAIN")
    _check_trainable(train_net)

    tests: list[CaffeTest] = []
    if caffe_solver is not None:
        config = caffe_solver.config
        stem_fallback = caffe_solver.source_path.stem if caffe_solver.source_path else train_net.name
        if caffe_solver.test_nets:
            logger.warning("%s: separate test_net files %s are not run; the TEST phase of the net is",
                           caffe_solver.source_path, list(caffe_solver.test_nets))
        plan = caffe_solver.test_plan
        for i, (state, iters) in enumerate(plan):
            net = load("TEST", tuple(state.stages), state.level)
            label = "+".join(state.stages) or ("test" if len(plan) == 1 else f"test{i}")
            tests.append(CaffeTest(net=net, iters=test_iter or iters, label=label))
    else:
        config = default_solver or SolverConfig()
        stem_fallback = train_net.name or (net_file.stem if net_file else "caffe")
        try:
            net = load("TEST")
        except ValueError as exc:  # a net without a TEST phase trains without tests
            logger.info("%s: no usable TEST phase (%s); training without tests", net_file, exc)
        else:
            if net.data_layers:
                tests.append(CaffeTest(net=net, iters=test_iter, label="test"))
    if solver_overrides:
        try:
            config = replace(config, **dict(solver_overrides))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad solver override: {exc}") from None
    # the run settings the solver file gives, or those of a run without one
    settings = caffe_solver or CaffeSolver(config=config, test_initialization=False, display=100)
    iters_total = max_iter or settings.config.max_iter
    config = replace(config, max_iter=iters_total)  # policies such as poly read max_iter

    # the snapshots' file name stem: the prefix's last component (else the fallback), in safe characters
    stem = re.sub(r"[^\w.-]+", "_", Path(settings.snapshot_prefix or "").name).strip("._")
    stem = stem or re.sub(r"[^\w.-]+", "_", stem_fallback).strip("._").lower() or "caffe"
    weight_files: list[Path] = []
    if weights is not None:
        given = [weights] if isinstance(weights, (str, os.PathLike)) else list(weights)
        weight_files = [Path(w) for w in given]
    else:
        for w in settings.weights:
            found = resolve_net_path(w, settings.source_path)
            if found is None:
                raise FileNotFoundError(f"{settings.source_path}: weights file {w!r} not found; "
                                        "pass --weights PATH")
            weight_files.append(found)
    for w in weight_files:
        if not w.is_file():
            raise FileNotFoundError(f"no such .caffemodel: {w}")

    if batch_size is not None and train_net.data_layers:
        train_net = _with_batch(train_net, batch_size)
    net_source = net_file or settings.net_path
    return CaffeRun(
        train_net=train_net,
        tests=tests,
        solver=config,
        max_iter=iters_total,
        batch_size=batch_size or train_net.batch_size or 64,
        test_interval=test_interval if test_interval is not None else settings.test_interval,
        test_initialization=settings.test_initialization,
        display=display if display is not None else settings.display,
        snapshot=snapshot if snapshot is not None else settings.snapshot,
        snapshot_after_train=settings.snapshot_after_train,
        snapshot_dir=Path.cwd() / stem if snapshot_dir is None else Path(snapshot_dir),
        snapshot_prefix=stem,
        seed=int(seed if seed is not None else (settings.random_seed or 0)),
        weights=tuple(weight_files),
        sources=bindings,
        max_train_samples=max_train_samples,
        net_text=net_source.read_text(encoding="utf-8") if net_source else settings.net_text,
        net_path=net_source,
        solver_path=settings.source_path,
    )


def _check_trainable(net: CaffeNet) -> None:
    where = net.source_path or net.name
    if not net.data_layers:
        raise ValueError(f"{where}: the TRAIN net has no data layer (Data, ImageData, HDF5Data, MemoryData), so "
                         "there is nothing to train on; a deploy net is for `sparknet caffe import`")
    if net.data_binding is None or net.data_binding.dataset is None:
        spec = net.data_layers[0]
        raise ValueError(f"{where}: data layer {spec.layer!r} reads source {spec.source!r}, which is bound to no "
                         "sparknet data set; bind it with --caffe-sources SOURCE=DATASET[:SPLIT]")
    if not any(getattr(layer, "is_loss", False) for layer in net.net_params):
        raise ValueError(f"{where}: the TRAIN net has no loss layer")


def _with_batch(net: CaffeNet, batch_size: int) -> CaffeNet:
    """The same net with its first data layer's batch size changed."""

    layers = [replace(layer, shape=(batch_size, *layer.shape[1:])) if isinstance(layer, RDDLayer) and layer.shape
              else layer for layer in net.net_params]
    params = NetParams(*layers, name=net.net_params.name)
    data_layers = [replace(spec, batch_size=batch_size, shape=(batch_size, *spec.shape[1:]))
                   for spec in net.data_layers]
    return replace(net, net_params=params, data_layers=data_layers)


# --------------------------------------------------------------------------- data


def _split(binding: DataBinding, cache: dict[str, Any]) -> Any:
    """The split ``binding`` names, its data set loaded once per run (kept in ``cache``, by name)."""
    name = binding.dataset
    if name not in cache:
        try:
            cache[name] = load_dataset(name)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"cannot load data set {name!r} for a Caffe data layer: {exc}; bind the source to "
                             "another data set with --caffe-sources SOURCE=DATASET[:SPLIT]") from None
    part = getattr(cache[name], binding.split, None)
    if part is None:
        raise ValueError(f"data set {name!r} has no split {binding.split!r}")
    return part


def load_net_data(net: CaffeNet, *, samples: int | None = None, seed: int = 0,
                  cache: dict[str, Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The transformed data of a net's (first) data layer, as ``(x, y)`` arrays.

    Parameters
    ----------
    net : CaffeNet
        A net with a bound data layer.
    samples : int, optional
        Take the first ``samples`` rows (all when ``None`` or more than there are).
    seed : int
        Seed of random transforms (mirror, TRAIN-phase crops).
    cache : dict, optional
        Data sets already loaded, by name (shared between calls).

    Returns
    -------
    (ndarray, ndarray)
        float32 features shaped as the net's data blob (without the batch axis), and int64
        labels (zeros when the net reads no label).
    """
    spec = net.data_layers[0] if net.data_layers else None
    if spec is None or spec.binding is None or spec.binding.dataset is None:
        raise ValueError(f"{net.source_path or net.name}: no data layer bound to a data set")
    part = _split(spec.binding, {} if cache is None else cache)
    n = len(part) if samples is None else min(int(samples), len(part))
    if samples is not None and samples > len(part):
        logger.warning("%s %s has %d samples; the test reads %d, so it uses all %d once", spec.binding.dataset,
                       spec.binding.split, len(part), samples, len(part))
    x = np.asarray(part.x[:n])
    sample_shape = spec.binding.sample_shape or tuple(spec.shape[1:])
    if x.ndim == 2 and len(sample_shape) > 1:
        x = x.reshape(n, *sample_shape)
    x = spec.transform(x, np.random.default_rng(seed)) if not spec.transform.is_identity else x.astype(np.float32)
    want = tuple(spec.shape[1:])
    if tuple(x.shape[1:]) != want:
        raise ValueError(f"data layer {spec.layer!r}: samples of {spec.binding.dataset} have shape "
                         f"{tuple(x.shape[1:])} after the transform, the net's data blob takes {want}")
    has_label = len(spec.tops) > 1
    y = np.asarray(part.y[:n]).astype(np.int64) if has_label else np.zeros(n, dtype=np.int64)
    return np.ascontiguousarray(x, dtype=np.float32), y


# --------------------------------------------------------------------------- tests


def _output_blobs(net: CaffeNet) -> list[str]:
    """Blobs no later layer reads (Caffe's net outputs), in order."""
    consumed: set[str] = set()
    outputs: list[str] = []
    for layer in reversed(net.net_params.layers):
        for top in layer.tops:
            if top not in consumed and top not in outputs and top not in layer.bottoms:
                outputs.append(top)
        consumed.update(layer.bottoms)
    return list(reversed(outputs))


class CaffeEvaluator:
    """Runs a run's TEST nets on their data with given weights, as Caffe's ``Solver::Test`` does.

    Parameters
    ----------
    tests : list of CaffeTest
    seed : int
        Seed of the test nets' construction (their weights are overwritten anyway).
    cache : dict, optional
        Data sets already loaded, by name (shared between calls).
    """

    def __init__(self, tests: Sequence[CaffeTest], *, seed: int = 0, cache: dict[str, Any] | None = None,
                 device: str = "cpu"):
        self.tests = list(tests)
        self.device = torch.device(device)
        self._entries = []
        cache = {} if cache is None else cache
        for test in self.tests:
            module = test.net.build(seed=seed).to(self.device)
            module.eval()
            batch = test.net.batch_size or 100
            x, y = load_net_data(test.net, samples=None if test.iters is None else test.iters * batch,
                                 seed=seed, cache=cache)
            outputs = [b for b in _output_blobs(test.net) if b not in module.input_names]
            self._entries.append((test, module, batch, torch.from_numpy(x), torch.from_numpy(y), outputs))
            logger.info("test net %s: %d samples in batches of %d, outputs %s", test.label, len(x), batch, outputs)

    def evaluate(self, weights: Mapping[str, Sequence[torch.Tensor]]) -> dict[str, dict[str, float]]:
        """Every test net's outputs averaged over its batches, keyed by test label.

        Loss blobs are reported with their ``loss_weight`` applied under ``"loss"`` (their
        sum) as well as by name; accuracy under its blob name.
        """
        results: dict[str, dict[str, float]] = {}
        with torch.no_grad():
            for test, module, batch, x, y, outputs in self._entries:
                _copy_weights(weights, module.layer_weights(), test.label)
                sums = {name: 0.0 for name in outputs}
                total, count = 0.0, 0
                for start in range(0, len(x), batch):
                    xb = x[start:start + batch].to(self.device)
                    blobs = {module.feature_input: xb}
                    if module.label_input is not None:
                        blobs[module.label_input] = y[start:start + batch].to(self.device)
                    out = module.run(blobs)
                    n = len(xb)
                    for name in outputs:
                        value = out.get(name)
                        if value is not None and value.dim() == 0:
                            sums[name] += float(value) * n
                    total += sum(float(out[top]) * w for top, w in module.loss_blobs.items() if top in out) * n
                    count += n
                values = {name: s / max(count, 1) for name, s in sums.items()}
                if module.loss_blobs:
                    values["loss"] = total / max(count, 1)
                results[test.label] = values
        return results


def _copy_weights(source: Mapping[str, Sequence[Any]], target: Mapping[str, Sequence[Any]], label: str) -> None:
    for name, tensors in target.items():
        if name not in source:
            raise ValueError(f"test net {label}: layer {name!r} has weights but the TRAIN net has no layer of "
                             "that name; Caffe shares weights between phases by layer name")
        for dst, src in zip(tensors, source[name]):
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(f"test net {label}: layer {name!r} has shape {tuple(dst.shape)} in TEST and "
                                 f"{tuple(src.shape)} in TRAIN")
            dst.copy_(src.detach().to(dst.device, dst.dtype))


def _accuracy_of(values: Mapping[str, float], net: CaffeNet) -> float | None:
    for layer in net.net_params:
        if isinstance(layer, AccuracyLayer) and layer.tops and layer.tops[0] in values:
            return values[layer.tops[0]]
    return None


# --------------------------------------------------------------------------- snapshots


class Snapshotter:
    """Writes ``<dir>/<prefix>_iter_<N>.caffemodel`` and the model folder ``<dir>/<prefix>_iter_<N>/``."""

    def __init__(self, run: CaffeRun):
        self.run = run
        self.written: list[dict] = []

    def write(self, iteration: int, weights: WeightCollection) -> dict:
        """Write one snapshot of ``weights`` (a WeightCollection of the TRAIN net) at ``iteration``."""

        run = self.run
        run.snapshot_dir.mkdir(parents=True, exist_ok=True)
        stem = run.snapshot_dir / f"{run.snapshot_prefix}_iter_{iteration}"
        caffemodel = write_caffemodel(stem.with_name(stem.name + ".caffemodel"), weights, run.train_net)
        folder = self.model_folder(stem, iteration, weights)
        record = {"event": "snapshot", "step": iteration, "caffemodel": str(caffemodel), "model_dir": str(folder)}
        self.written.append(record)
        logger.info("Snapshotting to %s and %s", caffemodel, folder)
        return record

    def model_folder(self, path, iteration: int, weights: WeightCollection):
        """``weights`` saved as a model folder at ``path`` (replaced), its config naming the Caffe net; the folder's
        path."""
        run = self.run
        return save_model(path, run.train_net.net_params, weights.to("cpu"), solver=run.solver,
                          config=model_config(run.train_net, run.net_text, iteration=iteration), overwrite=True)


def model_config(net: CaffeNet, net_text: str | None, **extra: Any) -> dict:
    """The ``config.json`` of a model folder made from a Caffe net: how to feed it, and its prototxt."""
    transform = net.transform
    caffe: dict[str, Any] = {"name": net.name, "phase": net.phase, "stages": list(net.stages)}
    if net_text is not None:
        caffe["net_prototxt"] = net_text
    if net.source_path is not None:
        caffe["source"] = str(net.source_path)
    if transform is not None:
        caffe["transform"] = {"scale": transform.scale, "native_scale": transform.native_scale,
                              "mean_value": list(transform.mean_value), "mean_file": transform.mean_file,
                              "mirror": transform.mirror, "crop_size": transform.crop_size}
    if net.data_binding is not None:
        caffe["dataset"] = net.data_binding.dataset
    return {"caffe": {**caffe, **extra}}


# --------------------------------------------------------------------------- training


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of ``every`` lies in ``(before, after]``."""
    return every > 0 and after // every > before // every


class _Run:
    """State shared by the local and Spark loops: metrics, tests, snapshots."""

    def __init__(self, run: CaffeRun, metrics, evaluator: CaffeEvaluator | None, module, model_dir=None):
        self.run, self.metrics, self.evaluator, self.module = run, metrics, evaluator, module
        self.model_dir = model_dir  # where the fit's weights are saved at the end (None: nowhere but snapshots)
        self.snapshots = Snapshotter(run)
        self.last_eval: dict | None = None  # the last test's record
        self.window_loss, self.window_steps = 0.0, 0  # the training loss since the last display
        self.steps = self.samples = 0  # trained so far

    def weights_from_flat(self, flat) -> WeightCollection:
        out = WeightCollection(self.module.layer_weights()).clone()
        out.load_flat_(flat.detach().cpu())
        return out

    def test(self, step: int, samples: int, weights) -> None:
        results = self.evaluator.evaluate(weights)
        primary = self.run.primary_test
        values = results[primary.label]
        record = {"event": "eval", "step": step, "samples": samples, "wall_s": self.metrics.elapsed(),
                  "loss": values.get("loss"), "test_accuracy": _accuracy_of(values, primary.net),
                  "outputs": results}
        self.metrics.write(record)
        self.last_eval = record
        self.metrics.progress(0, acc=record["test_accuracy"])
        logger.info("Iteration %d, Testing net: %s", step, "; ".join(
            f"{label}: " + ", ".join(f"{k} = {v:.4g}" for k, v in out.items()) for label, out in results.items()))

    def round_done(self, record: dict, flat, *, steps_shown: bool) -> None:
        """A round's record (from the one process's loop or from Spark): display, test and snapshot where due.

        ``flat``: the round's global weights (None: the engine gives none between rounds, so its own test of the
        primary net is written instead of a test or snapshot); ``steps_shown``: the progress line already counted
        the steps. The display of the run's last steps comes only when ``display`` is set; the final weights (the
        average, when kept) are tested and snapshotted by :meth:`finish`.
        """
        run, before, after = self.run, self.steps, int(record["total_steps"])
        self.steps, self.samples = after, int(record["total_samples"])
        if not steps_shown:
            self.metrics.progress(after - before, round=record.get("round"), loss=record.get("loss"),
                                  tau=record.get("tau"))
        finished = record.get("stop_reason") is not None
        self.window_loss += (record.get("loss") or 0.0) * (after - before)
        self.window_steps += after - before
        if (_crossed(before, after, run.display) or (finished and run.display)) and self.window_steps:
            loss, lr = self.window_loss / self.window_steps, run.solver.base_lr * lr_multiplier(run.solver, after)
            self.metrics.write({"event": "train", "step": after, "samples": self.samples,
                                "wall_s": self.metrics.elapsed(), "loss": loss, "lr": lr})
            logger.info("Iteration %d, loss = %.6g, lr = %.6g", after, loss, lr)
            self.window_loss, self.window_steps = 0.0, 0
        if finished:
            return
        if flat is None:
            if "val_loss" in record:
                self.metrics.write({"event": "eval", "step": after, "samples": self.samples,
                                    "wall_s": self.metrics.elapsed(), "loss": record.get("val_loss"),
                                    "test_accuracy": record.get("val_accuracy")})
            return
        if self.evaluator is not None and _crossed(before, after, run.test_interval):
            self.test(after, self.samples, self.weights_from_flat(flat))
        if _crossed(before, after, run.snapshot):
            self.metrics.write(self.snapshots.write(after, self.weights_from_flat(flat)))

    def finish(self, weights: WeightCollection) -> None:
        """The fit's weights at the end: tested, snapshotted as the solver file asks, and saved in the model
        folder asked for."""
        if self.evaluator is not None:
            self.test(self.steps, self.samples, weights)
        if self.run.snapshot_after_train or (self.run.snapshot and self.steps % self.run.snapshot == 0):
            self.metrics.write(self.snapshots.write(self.steps, weights))
        if self.model_dir is not None:
            self.snapshots.model_folder(self.model_dir, self.steps, weights)
            logger.info("model saved to %s", self.model_dir)


def train_caffe(run: CaffeRun, *, workers: int = 1, dist: DistributedConfig | None = None,
                metrics_out: str | os.PathLike | None = None, progress: bool = True, threads: int | None = None,
                device: str = "cpu", spark=None, sinks: Iterable[Callable[[dict], None]] = (), options=None,
                compute: Compute | None = None, gpus_per_worker: float | None = None,
                model_dir: str | os.PathLike | None = None) -> dict:
    """Train a resolved Caffe run; returns the summary record.

    Parameters
    ----------
    run : CaffeRun
        From :func:`resolve_caffe_run`.
    workers : int
        1 trains in this process; more train on Spark (``dist`` says how).
    dist : DistributedConfig, optional
        Engine, tau, strategy, master... (``dist.workers`` is ``workers``). With a Spark
        master or the barrier engine even one worker trains on Spark.
    metrics_out : path, optional
        JSON-lines file: ``train`` records every ``display`` updates, ``eval`` records every
        ``test_interval`` (with every test net's ``outputs``), ``snapshot`` records, Spark's
        ``round`` records, and the ``summary`` last.
    progress : bool
        Show the progress line.
    threads : int, optional
        Torch threads (default: every core in one process, 1 per Spark worker).
    device : str
        ``cpu``, ``cuda`` or ``auto``.
    compute : Compute, optional
        Mixed precision, compilation and memory order of the net (default: float32, eager).
    gpus_per_worker : float, optional
        GPUs each Spark worker asks for, on the training stage only.
    spark : SparkSession, optional
        The session to train in (default: the active one, or one for ``dist.resolved_master``).
    sinks : iterable of callables
        More receivers of every metrics record.
    options : EngineOptions, optional
        The Spark engines' settings (a run on Spark).
    model_dir : path, optional
        Save the fit's final weights here as a model folder (as a snapshot's; replaced).
    """

    dist = replace(dist or DistributedConfig(), workers=workers)  # checked again: the local engine, one worker
    on_spark = not dist.one_process

    seed_everything(run.seed)
    cache: dict[str, Any] = {}
    t0 = time.perf_counter()
    x, y = load_net_data(run.train_net, samples=run.max_train_samples, seed=run.seed, cache=cache)
    module = run.train_net.build(seed=run.seed)
    for path in run.weights:
        loaded = load_caffemodel_into(module, path)
        logger.info("fine-tuning from %s (%d layers)", path, len(loaded))
    evaluator = CaffeEvaluator(run.tests, seed=run.seed, cache=cache, device="cpu") if run.tests else None
    logger.info("Caffe run %s: %d training samples of shape %s, %s", run.train_net.name, len(x), x.shape[1:],
                run.describe())
    setup_s = time.perf_counter() - t0
    with MetricsLogger(metrics_out, progress=progress, total=run.max_iter, sinks=sinks) as metrics:
        state = _Run(run, metrics, evaluator, module, model_dir=model_dir)
        if state.evaluator is not None and run.test_initialization and run.test_interval > 0:
            state.test(0, 0, WeightCollection(module.layer_weights()))
        if on_spark:
            summary = _train_spark(run, state, module, x, y, dist, threads or 1, device, spark, options, compute,
                                   gpus_per_worker)
        else:
            summary = _train_local(run, state, module, x, y, dist, threads, device, compute)
        summary = {"event": "summary", **summary}
        summary.update({
            "model": run.train_net.name, "dataset": run.train_net.data_binding.dataset,
            "setup_s": setup_s + summary.get("setup_s", 0.0), "caffe": run.describe(),
            "test_outputs": None if state.last_eval is None else state.last_eval["outputs"],
            "snapshots": [s["caffemodel"] for s in state.snapshots.written], "train_samples": len(x),
        })
        if state.last_eval is not None:
            summary.update(test_accuracy=state.last_eval["test_accuracy"], test_loss=state.last_eval["loss"])
        metrics.write(summary)
    return summary


def _train_local(run: CaffeRun, state: _Run, module, x, y, dist: DistributedConfig, threads, device,
                 compute) -> dict:
    """The round loop with one in-process worker, in rounds that end on every multiple of ``display``,
    ``test_interval`` and ``snapshot`` (and of 50 steps, for the progress line)."""
    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    net = Net(module, run.solver, batch_size=run.batch_size, device=device, seed=run.seed, compute=compute)
    net.set_training_data((x, y))
    tau = math.gcd(50, *(every for every in (run.display, run.test_interval, run.snapshot) if every > 0))
    strategy = Average()
    exchange = InProcessExchange([net], strategy, metrics=state.metrics, nan_message="the loss became {loss} at "
                                 "iteration {step}; lower base_lr (--lr) or check the data")
    plan = FitPlan.from_config(replace(dist, tau=tau, auto_tau=False, round_seconds=None),
                               strategy, steps=run.max_iter, dataset_rows=len(x))
    flat = run_rounds(exchange, plan, strategy.init_global(net.get_flat()),
                      on_record=lambda record: state.round_done(record, exchange.latest, steps_shown=True))
    state.finish(state.weights_from_flat(flat))
    return {"engine": "local", "workers": 1, "steps": state.steps, "samples": state.samples,
            "train_s": exchange.train_s, "wall_s": state.metrics.elapsed(),
            "samples_per_s": state.samples / exchange.train_s if exchange.train_s else None,
            "threads": threads, "rounds": 0, "bytes_communicated": 0, **returned_summary([], dist.weight_ema)}


def _train_spark(run: CaffeRun, state: _Run, module, x, y, dist, threads, device, spark, options, compute,
                 gpus_per_worker) -> dict:
    tau = dist.tau
    if tau is not None and run.test_interval and run.test_interval % tau:
        logger.warning("test_interval %d is not a multiple of tau %d: tests run at the end of the round that "
                       "passes each multiple of test_interval", run.test_interval, tau)
    rounds_engine = dist.engine is Engine.ROUNDS
    validation = None
    if not rounds_engine and run.primary_test is not None:
        # the barrier engine tests in its own stage; its numbers are the primary test net's
        validation = load_net_data(run.primary_test.net, samples=None if run.primary_test.iters is None else
                                   run.primary_test.iters * (run.primary_test.net.batch_size or 100),
                                   seed=run.seed)
        every = max(1, (run.test_interval or run.max_iter) // (tau or 1))
        dist = replace(dist, eval_every_rounds=every)
        logger.warning("the barrier engine gives no weights between rounds: snapshots are written at the end only, "
                       "and tests report the primary test net's loss and accuracy")
    spark = spark or get_session(dist.resolved_master)

    def on_round(record: dict) -> None:
        # one timeline for every record of the run: seconds since the metrics logger started
        state.metrics.write({**record, "wall_s": state.metrics.elapsed(), "fit_wall_s": record.get("wall_s")})
        state.round_done(record, trainer.latest_flat if rounds_engine else None, steps_shown=False)

    worker = WorkerConfig(solver=run.solver, batch_size=run.batch_size, seed=run.seed, threads=threads, device=device,
                          steps=run.max_iter, compute=compute or Compute(), gpus_per_worker=gpus_per_worker)
    trainer = SparkTrainer(module, worker, dist, spark=spark, on_round=on_round, options=options)
    logger.info("training %s on Spark %s: %d workers, %s engine, tau=%s, %d rows", run.train_net.name,
                spark.sparkContext.master, dist.workers, dist.engine.value, tau, len(x))
    with tempfile.TemporaryDirectory(prefix="sparknet-caffe-") as workdir:
        if is_local_master(spark.sparkContext.master):
            frame = spark.read.parquet(str(dataset_as_parquet(ArrayDataset(x, y), Path(workdir) / "train.parquet")))
        else:  # executors elsewhere cannot read the driver's disk
            frame = frame_from_arrays(spark, x, y)
        result = trainer.fit(frame, validation=validation)
    state.finish(result.weights)
    summary = {k: v for k, v in result.summary.items() if k not in ("test_accuracy", "test_loss")}
    summary.update(steps=summary.get("total_steps"), fit_s=summary.get("wall_s"), wall_s=state.metrics.elapsed(),
                   master=spark.sparkContext.master)
    if validation is not None and result.summary.get("test_accuracy") is not None:
        summary["test_accuracy"] = result.summary["test_accuracy"]
        summary["test_loss"] = result.summary.get("test_loss")
    return summary
