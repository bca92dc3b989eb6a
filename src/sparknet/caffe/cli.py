"""The command line's Caffe parts: ``sparknet train --prototxt/--solver`` and ``sparknet caffe``.

::

    sparknet train --solver lenet_solver.prototxt --workers 2
    sparknet train --prototxt lenet_train_test.prototxt --solver lenet_solver.prototxt --weights init.caffemodel
    sparknet caffe inspect lenet_train_test.prototxt        # layers, shapes, parameters
    sparknet caffe inspect lenet_solver.prototxt            # the solver's settings
    sparknet caffe inspect lenet_iter_10000.caffemodel      # the weights in the file
    sparknet caffe export --model-dir out/lenet --out lenet # lenet.prototxt + lenet.caffemodel
    sparknet caffe import --prototxt lenet.prototxt --weights lenet.caffemodel --out out/lenet

Which settings win
------------------
The Caffe files decide a run; a ``sparknet train`` flag overrides them only when it is
given with a value other than its default (the command line cannot tell ``--steps 10000``
from no ``--steps``). The flags that map onto Caffe settings: ``--steps`` (``max_iter``),
``--batch-size`` (the TRAIN data layer's ``batch_size``), ``--seed`` (``random_seed``),
``--eval-every`` (``test_interval``), ``--lr``, ``--momentum``, ``--weight-decay``,
``--solver-type``, ``--lr-policy``, ``--gamma``, ``--power``; and this module's own
``--test-iter``, ``--display``, ``--snapshot-every``. ``--model``, ``--dataset`` and
``--data`` are refused: the net and its data layers say what to train on what (bind other
sources with ``--caffe-sources``). Without a solver file, the ``sparknet train`` flags are
the solver. ``--model-dir`` saves the final weights as a model folder (a snapshot's kind),
``--tensorboard`` and ``--mlflow`` log the run; a Caffe run of one worker refuses the settings
of the Spark engines and of sparknet's own evaluations and checkpoints (its tests and
snapshots are the solver's), as :func:`sparknet.roads.check_road` lists.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from sparknet._app import finish_run, run_sinks
from sparknet._fields import changed
from sparknet.model_io import load_model, save_model
from sparknet.caffe import train as caffe_train
from sparknet.caffe.caffemodel import (_shape_text, _table, describe_caffemodel, load_caffemodel_into,
                                       read_caffemodel_layers, write_caffemodel)
from sparknet.caffe.prototxt import PrototxtError, load_net_prototxt, net_to_prototxt
from sparknet.caffe.solver import load_solver_prototxt
from sparknet.config import EVAL_EVERY_STEPS, CaffeTrainFlags, DistributedConfig, RunConfig, TrainConfig
from sparknet.roads import Road, check_road
from sparknet.sinks import wants_model
from sparknet.weights import WeightCollection

logger = logging.getLogger(__name__)

__all__ = ["CaffeTrainFlags", "train_caffe_files", "describe_net", "describe_solver", "file_kind", "run_inspect",
           "run_export", "run_import"]


# RunConfig field -> resolve_caffe_run argument, and RunConfig field -> SolverConfig field.
_RUN_SETTINGS = {"steps": "max_iter", "batch_size": "batch_size", "seed": "seed", "eval_every": "test_interval"}
_SOLVER_SETTINGS = {"solver_type": "type", "lr": "base_lr", "momentum": "momentum", "weight_decay": "weight_decay",
                    "lr_policy": "lr_policy", "gamma": "gamma", "power": "power", "lr_warmup": "lr_warmup",
                    "min_lr": "min_lr", "momentum2": "momentum2", "clip_gradients": "clip_gradients"}


def train_caffe_files(run: RunConfig, dist: DistributedConfig, flags: CaffeTrainFlags, options=None) -> dict:
    """``sparknet train`` with Caffe files (``--prototxt`` and/or ``--solver``): the run's summary record.

    Parameters
    ----------
    run, dist : RunConfig, DistributedConfig
        The ``sparknet train`` flags; see the module docstring for which ones override the
        Caffe files.
    flags : CaffeTrainFlags
        This module's flags; a ``ValueError`` when they name no Caffe file.
    options : EngineOptions, optional
        The Spark engines' settings, for a run on Spark.
    """
    if not flags.given:
        raise ValueError("a Caffe run needs --prototxt NET, --solver SOLVER or both")
    check_road(Road.CAFFE, run, dist, flags, *([options] if options is not None else []))
    given = changed(run)
    overrides = {caffe: given[name] for name, caffe in _RUN_SETTINGS.items() if name in given}
    solver_overrides = {caffe: given[name] for name, caffe in _SOLVER_SETTINGS.items() if name in given}
    if flags.solver is None:
        # without a solver file the sparknet flags are the solver, defaults included
        solver_overrides = {}
        overrides.setdefault("max_iter", run.steps)
        overrides.setdefault("test_interval", run.eval_every or EVAL_EVERY_STEPS)
    if overrides or solver_overrides:
        logger.info("command-line settings over the Caffe files: %s", {**overrides, **solver_overrides})
    try:
        plan = caffe_train.resolve_caffe_run(
            flags.prototxt, flags.solver, weights=flags.weights, snapshot_dir=flags.snapshot_dir,
            sources=flags.caffe_sources, test_iter=flags.test_iter, display=flags.display,
            snapshot=flags.snapshot_every, solver_overrides=solver_overrides, default_solver=run.solver(),
            max_train_samples=flags.max_train_samples, **overrides)
    except PrototxtError as exc:
        if "sources=" not in str(exc):
            raise
        # the library's hint names the Python argument; say what the command line takes
        raise PrototxtError(f"{exc}; on the command line: --caffe-sources SOURCE=DATASET[:SPLIT]", layer=exc.layer,
                            path=exc.path, line=exc.line, column=exc.column) from None
    sinks = run_sinks(run, {"caffe": plan.describe(), "dist": TrainConfig(dist=dist).to_dict()["dist"]},
                      name=f"caffe-{plan.train_net.name}")
    failed = True
    # the model folder is train_caffe's to save (a snapshot's kind): for MLflow alone, into a scratch folder
    scratch = tempfile.mkdtemp(prefix="sparknet-model-") if run.model_dir is None and wants_model(sinks) else None
    model_dir = run.model_dir if scratch is None else os.path.join(scratch, "model")
    try:
        summary = caffe_train.train_caffe(plan, workers=dist.workers, dist=dist, metrics_out=run.metrics_out,
                                          progress=not run.quiet, threads=run.threads, device=run.device,
                                          options=options, compute=run.worker().compute,
                                          gpus_per_worker=run.gpus_per_worker, sinks=sinks, model_dir=model_dir)
        failed = False
    finally:
        try:
            finish_run(run, sinks, failed=failed, saved=model_dir)
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
    return summary


# --------------------------------------------------------------------------- inspect


_SOLVER_KEYS = re.compile(r"^\s*(base_lr|lr_policy|max_iter|net|train_net|solver_type|test_iter|test_interval|"
                          r"snapshot_prefix|momentum|weight_decay)\s*:", re.M)


def file_kind(path: str | Path) -> str:
    """``"caffemodel"``, ``"solver"`` or ``"net"``, from the file's name and content."""
    path = Path(path)
    if path.suffix in (".caffemodel", ".binaryproto") or b"\0" in path.read_bytes()[:4096]:
        return "caffemodel"
    text = path.read_text(encoding="utf-8", errors="replace")
    if re.search(r"^\s*(layers?|input)\s*[{:]", text, re.M):
        return "net"
    return "solver" if _SOLVER_KEYS.search(text) else "net"


def _param_counts(net) -> dict[str, int]:
    """Learnable values per layer, without allocating the weights (built on torch's meta device)."""
    try:
        with torch.device("meta"):
            module = net.net_params.build(seed=0)
    except Exception:  # some layer cannot be built on meta tensors: build it for real
        module = net.net_params.build(seed=0)
    return {name: sum(t.numel() for t in module.layer_module(name).parameters())
            for name in module.module_names}


def _caffe_type(net, layer) -> str:
    """The Caffe type of a sparknet layer; a data layer's blobs show as ``Data (layer name)``."""
    for spec in net.data_layers:
        if layer.name in spec.tops and not layer.bottoms:
            return f"{spec.type} ({spec.layer})"
    return net.layer_types.get(layer.name, type(layer).__name__)


def _net_layers(path: str | Path, phase: str, stages: tuple[str, ...]) -> tuple[Any, list[dict], int]:
    """A net for ``phase``, a record per layer (what ``inspect --json`` prints) and its learnable values."""
    net = load_net_prototxt(path, phase=phase, stages=tuple(stages))
    shapes = net.net_params.infer_shapes()
    counts = _param_counts(net)
    layers = [{"layer": layer.name, "type": _caffe_type(net, layer), "bottoms": list(layer.bottoms),
               "tops": list(layer.tops), "shapes": [list(shapes.get(t) or ()) for t in layer.tops],
               "params": counts.get(layer.name, 0)} for layer in net.net_params]
    return net, layers, sum(counts.values())


def describe_net(path: str | Path, *, phase: str = "TRAIN", stages: tuple[str, ...] = ()) -> str:
    """A table of a net prototxt's layers for ``phase``: type, bottoms, tops, output shapes, parameters.

    What ``sparknet caffe inspect NET`` prints.
    """
    net, layers, total = _net_layers(path, phase, stages)
    rows = [("layer", "type", "bottoms", "tops", "output shape", "params")]
    rows += [(r["layer"], r["type"], ", ".join(r["bottoms"]) or "-", ", ".join(r["tops"]) or "-",
              ", ".join(_shape_text(s) for s in r["shapes"]) or "-", f"{r['params']:,}") for r in layers]
    lines = [f"{path}: net {net.name!r}, phase {net.phase}" + (f", stages {list(stages)}" if stages else "")]
    lines += _table(rows, right=(5,))
    lines.append(f"{len(net.net_params)} layers, {total:,} learnable parameters")
    for spec in net.data_layers:
        binding = spec.binding
        bound = f"{binding.dataset}:{binding.split}" if binding and binding.dataset else "unbound"
        lines.append(f"data layer {spec.layer!r}: source {spec.source!r} -> {bound}, batch {spec.batch_size}, "
                     f"transform scale {spec.transform.scale:g}"
                     + (f", crop {spec.transform.crop_size}" if spec.transform.crop_size else "")
                     + (", mirror" if spec.transform.mirror else ""))
    return "\n".join(lines)


def solver_settings(path: str | Path) -> dict[str, Any]:
    """A solver prototxt's settings as plain values (what ``inspect --json`` prints)."""
    solver = load_solver_prototxt(path)
    settings = solver.config.to_dict()
    kind = solver.config.type.value
    relevant = {"stepsize": solver.config.lr_policy.value in ("step", "sigmoid"),
                "stepvalues": solver.config.lr_policy.value == "multistep",
                "momentum2": kind in ("adam", "adamw"),
                "delta": kind in ("adagrad", "adadelta", "adam", "adamw", "rmsprop"),
                "rms_decay": kind == "rmsprop"}
    settings = {k: v for k, v in settings.items() if relevant.get(k, True)}
    settings.update(net=solver.net, net_path=str(solver.net_path) if solver.net_path else None,
                    test_iter=list(solver.test_iter), test_states=[list(s.stages) for s in solver.test_states])
    settings.update({name: getattr(solver, name) for name in (
        "test_interval", "test_initialization", "display", "average_loss", "snapshot", "snapshot_prefix",
        "snapshot_after_train", "random_seed", "solver_mode")})
    settings["weights"] = list(solver.weights)
    return settings


def describe_solver(path: str | Path) -> str:
    """A solver prototxt's settings, one per line; what ``sparknet caffe inspect SOLVER`` prints."""
    settings = solver_settings(path)
    lines = [f"{path}: solver"]
    width = max(len(k) for k in settings)
    for key, value in settings.items():
        if value is None or value == [] or value == ():
            continue
        lines.append(f"  {key.ljust(width)}  {value}")
    if settings.get("net") and not settings.get("net_path"):
        lines.append(f"  (net {settings['net']!r} not found near the solver: pass --prototxt to sparknet train)")
    return "\n".join(lines)


def run_inspect(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    kind = file_kind(path) if args.kind == "auto" else args.kind
    if kind == "caffemodel" and args.json:
        print(json.dumps([{"layer": layer.name, "type": layer.type, "blobs": [list(b.shape) for b in layer.blobs],
                           "params": layer.num_params} for layer in read_caffemodel_layers(path)]))
    elif kind == "caffemodel":
        print(describe_caffemodel(path))
    elif kind == "solver":
        print(json.dumps(solver_settings(path)) if args.json else describe_solver(path))
    elif args.json:
        print(json.dumps(_net_layers(path, args.phase, tuple(args.stage))[1]))
    else:
        print(describe_net(path, phase=args.phase, stages=tuple(args.stage)))
    return 0


# --------------------------------------------------------------------------- export / import


def export_model_dir(model_dir: str | Path, out_prefix: str | Path) -> tuple[Path, Path]:
    """Write ``PREFIX.prototxt`` and ``PREFIX.caffemodel`` from a sparknet model folder.

    A folder made from Caffe files (``sparknet caffe import`` or a Caffe run's snapshot)
    gives back its original prototxt, data layers included; any other layer-DSL net is
    translated layer by layer, its inputs becoming ``Input`` layers.

    Raises
    ------
    ValueError
        A folder holding a pickled torch module (no layer definitions to export), or a
        layer Caffe has no equivalent of.
    """
    saved = load_model(model_dir)
    if saved.net_params is None:
        raise ValueError(f"{model_dir}: the model is a pickled torch module, not a layer-DSL net; "
                         "only nets made of sparknet layers export to Caffe")
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    caffe = (saved.config or {}).get("caffe") or {}
    text = caffe.get("net_prototxt")
    definition: Any = saved.net_params
    if text:
        try:
            definition = load_net_prototxt(text, phase=caffe.get("phase", "TRAIN"),
                                           stages=tuple(caffe.get("stages") or ()))
        except Exception as exc:  # the stored text should always load; fall back to a translation
            logger.warning("%s: the stored Caffe prototxt does not load (%s); translating the net instead",
                           model_dir, exc)
            definition, text = saved.net_params, None
    if not text:
        text = net_to_prototxt(saved.net_params)
    prototxt = out_prefix.with_name(out_prefix.name + ".prototxt")
    prototxt.write_text(text, encoding="utf-8")
    caffemodel = write_caffemodel(out_prefix.with_name(out_prefix.name + ".caffemodel"), saved.weights, definition)
    return prototxt, caffemodel


def import_caffe(prototxt: str | Path, out: str | Path, *, weights: str | Path | None = None,
                 solver: str | Path | None = None, phase: str = "TRAIN", seed: int = 0,
                 overwrite: bool = False) -> Path:
    """A sparknet model folder from a Caffe net prototxt (and ``.caffemodel`` weights).

    Parameters
    ----------
    prototxt : path
        The net.
    out : path
        The model folder to write.
    weights : path, optional
        The weights; every layer with weights must be in the file. Without it the
        weights are the fillers' (seeded by ``seed``).
    solver : path, optional
        Stored as the folder's ``solver.json``.
    phase : {"TRAIN", "TEST"}
        Which layers to keep.
    """
    prototxt = Path(prototxt)
    if not prototxt.is_file():
        raise FileNotFoundError(f"no such net prototxt: {prototxt}")
    net = load_net_prototxt(prototxt, phase=phase)
    module = net.build(seed=seed)
    if weights is not None:
        if not Path(weights).is_file():
            raise FileNotFoundError(f"no such .caffemodel: {weights}")
        load_caffemodel_into(module, weights, strict=True)
    else:
        logger.warning("no --weights: the model folder holds the net's initial (filler) weights")
    solver_config = load_solver_prototxt(solver).config if solver is not None else None
    return save_model(out, net.net_params, WeightCollection(module.layer_weights()), solver=solver_config,
                      config=caffe_train.model_config(net, prototxt.read_text(encoding="utf-8"),
                                                      weights=str(weights) if weights else None),
                      overwrite=overwrite)


def run_export(args: argparse.Namespace) -> int:
    if not Path(args.model_dir).is_dir():
        raise FileNotFoundError(f"no model folder at {args.model_dir}")
    print(*export_model_dir(args.model_dir, args.out), sep="\n")
    return 0


def run_import(args: argparse.Namespace) -> int:
    if args.model_dir is None:
        raise ValueError("give the model folder to write: --model-dir DIR")
    print(import_caffe(args.prototxt, args.model_dir, weights=args.weights, solver=args.solver, phase=args.phase,
                       seed=args.seed, overwrite=args.overwrite))
    return 0
