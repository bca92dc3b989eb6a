"""Reproductions of the SparkNet paper's experiments (Section 3), each a JSON file and a PNG plot.

    sparknet experiment speedup-grid --quick            # Figure 3: speedup over K and tau, S = 0
    sparknet experiment speedup-vs-overhead --quick     # Figure 4: speedup against S/C
    sparknet experiment time-to-accuracy --quick        # Figure 5 on this machine
    sparknet experiment tau-sensitivity --quick         # Figure 6
    sparknet experiment slow-network --quick            # wall clock as the link slows
    sparknet experiment scaling --quick                 # the cost model: checked, then K = 2...256

>>> from sparknet.experiments import run_experiment
>>> result = run_experiment("speedup-grid", quick=True, out="runs/experiments")   # doctest: +SKIP
>>> result["speedup"]["average"]                                                   # doctest: +SKIP

Every experiment module has a ``Config`` dataclass (its full defaults; the training experiments'
extend :class:`ExperimentConfig`), a ``QUICK`` dict of overrides for ``--quick``,
``run(config, out_dir, quick=) -> dict`` and ``plot(result, path)``.
:func:`run_experiment` writes ``NAME.json`` and ``NAME.png`` under the output folder.
The simulation-based experiments (speedup-grid, speedup-vs-overhead) never import pyspark.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import importlib
import json
import logging
import multiprocessing
import os
import platform
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from sparknet.config import DistributedConfig, WorkerConfig, check_at_least
from sparknet.datasets import load_dataset
from sparknet.datasets.cache import atomic_write
from sparknet.metrics import LoadSampler, json_safe, process_age_s
from sparknet.solvers import SolverConfig

__all__ = ["EXPERIMENTS", "DEFAULT_OUT", "ExperimentConfig", "SparkExperimentConfig", "get_experiment", "make_config",
           "run_experiment", "write_result", "load_data", "make_model", "make_solver", "median_step_time",
           "parallel_map", "torch_threads", "environment", "to_target", "measured", "spark_stage",
           "SparkFit", "spark_fit", "pyplot"]

log = logging.getLogger(__name__)

EXPERIMENTS: dict[str, str] = {
    "speedup-grid": "sparknet.experiments.speedup_grid",
    "speedup-vs-overhead": "sparknet.experiments.overhead",
    "time-to-accuracy": "sparknet.experiments.time_to_accuracy",
    "tau-sensitivity": "sparknet.experiments.tau_sensitivity",
    "slow-network": "sparknet.experiments.slow_network",
    "scaling": "sparknet.experiments.scaling",
}
"""Experiment name (as the command line spells it) to the module that runs it."""

DEFAULT_OUT = "runs/experiments"
"""Where results go unless told otherwise (relative to the working directory)."""


def get_experiment(name: str) -> ModuleType:
    """The module of experiment ``name``; ``ValueError`` naming the choices otherwise."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose one of {sorted(EXPERIMENTS)}")
    return importlib.import_module(EXPERIMENTS[name])


def make_config(name: str, *, quick: bool = False, **overrides: Any):
    """The ``Config`` of experiment ``name``: full defaults, or ``--quick`` ones, then ``overrides``.

    ``None`` values in ``overrides`` are ignored (a flag the user did not give).
    """
    module = get_experiment(name)
    values = dict(module.QUICK) if quick else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    names = {f.name for f in dataclasses.fields(module.Config)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"experiment {name!r} has no option(s) {unknown}; it takes {sorted(names)}")
    return module.Config(**values)


def run_experiment(name: str, *, quick: bool = False, out: str | os.PathLike | None = None,
                   plot: bool = True, spark=None, tag: str | None = None, **overrides: Any) -> dict:
    """Run experiment ``name`` (one of :data:`EXPERIMENTS`) and write ``NAME.json`` (and ``NAME.png``) under ``out``.

    ``quick`` runs the small version (minutes, not tens of minutes); ``out`` defaults to :data:`DEFAULT_OUT`;
    ``spark``, for the Spark-based experiments, is a session to run on (and leave running) instead of one of
    their own; ``tag`` writes ``NAME-TAG.json`` and ``.png`` beside the untagged results; ``overrides`` are
    fields of the experiment's ``Config``. Returns the result as written (plus ``json_path`` / ``png_path``).
    """
    module = get_experiment(name)
    if tag is not None and not (tag and all(c.isalnum() or c in "._-" for c in tag) and tag[0] != "."):
        raise ValueError(f"tag must be letters, digits, '.', '_' or '-' (not starting with '.'), got {tag!r}")
    stem = name if tag is None else f"{name}-{tag}"
    config = make_config(name, quick=quick, **overrides)
    out_dir = Path(out or DEFAULT_OUT)
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("experiment %s (%s) -> %s", name, "quick" if quick else "full", out_dir)
    t0 = time.perf_counter()
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    env_before = environment()
    config_json = json.loads(json.dumps(dataclasses.asdict(config), default=str))  # tuples become lists
    with LoadSampler() as load:
        body = module.run(config, out_dir=out_dir, quick=quick, **({} if spark is None else {"spark": spark}))
    # wall_s: this call; process_s: since the process started (a command's user waited that long)
    result = {"experiment": name, "quick": quick, "started": started, "wall_s": time.perf_counter() - t0,
              "process_s": process_age_s(), "config": config_json, "environment": env_before,
              **load.to_dict(), **body}
    json_path = out_dir / f"{stem}.json"
    write_result(result, json_path)
    result["json_path"] = str(json_path)
    if plot:
        png_path = out_dir / f"{stem}.png"
        module.plot(result, png_path)
        result["png_path"] = str(png_path)
    log.info("experiment %s done in %.0f s: %s", name, result["wall_s"], json_path)
    return result


def write_result(result: dict, path: str | os.PathLike) -> Path:
    """Write ``result`` as JSON (NaN and infinity as ``null``), atomically."""
    path = Path(path)
    with atomic_write(path) as f:
        f.write((json.dumps(json_safe(result), indent=1, default=str) + "\n").encode())
    return path


def environment() -> dict:
    """What the numbers were measured on: versions and cores (the load beside them is sampled apart)."""
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "machine": platform.machine()}


# -- the settings every experiment shares -----------------------------------------------------------

@dataclasses.dataclass(kw_only=True)
class ExperimentConfig:
    """What the training experiments set alike: the data, the minibatch, the workers' SGD and the seed.

    Each experiment's ``Config`` extends it (``speedup-vs-overhead`` only reads the grid's) and
    redeclares a field where its default differs; the command line reads every field's help here.
    """

    dataset: str = "mnist"
    """mnist, mnist-small or extended-mnist (deformed MNIST digits, tested on MNIST's 10,000 test digits)."""
    train_samples: int | None = None
    """Use only the first this many training samples (default all; extended-mnist: make this many, default 100,000)."""
    test_samples: int | None = None
    """Evaluate on the first this many test samples (default the whole test set)."""
    batch_size: int = 64
    """Minibatch size of every worker (and of a single process)."""
    lr: float = 0.05
    """Learning rate of the workers' SGD (its base rate where a policy decays it)."""
    momentum: float = 0.9
    """Momentum."""
    seed: int = 0
    """Seed of the weights and of every worker's data order."""

    def __post_init__(self):
        self._check("batch_size", "train_samples", "test_samples")

    def _check(self, *at_least_one: str, target: bool = False, counts: tuple[str, ...] = (),
               choices: dict[str, tuple[str, ...]] | None = None) -> None:
        """``ValueError`` unless every named field is at least 1 (or ``None``), the target (with ``target``) an
        accuracy, every field of ``counts`` a non-empty tuple of such numbers (made one here) and every field of
        ``choices`` (a value or a non-empty tuple of them) among its choices."""
        if target and not 0 < self.target <= 1:
            raise ValueError(f"target is an accuracy in (0, 1], got {self.target}")
        check_at_least(1, **{name: getattr(self, name) for name in at_least_one})
        for name in counts:
            setattr(self, name, tuple(int(v) for v in getattr(self, name)))
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be positive numbers, got {getattr(self, name)}")
        for name, allowed in (choices or {}).items():
            value = getattr(self, name)
            bad = [v for v in (value if isinstance(value, tuple) else (value,)) if v not in allowed]
            if bad or value == ():
                raise ValueError(f"unknown {name} {bad}; choose from {list(allowed)}")

    def data(self):
        """``(train, test)`` of these settings (:func:`load_data`)."""
        return load_data(self.dataset, train_samples=self.train_samples, test_samples=self.test_samples)

    def solver(self):
        """The workers' solver: SGD at a fixed rate."""
        return make_solver("sgd", self.lr, self.momentum)


@dataclasses.dataclass(kw_only=True)
class SparkExperimentConfig(ExperimentConfig):
    """What the experiments that train LeNet on Spark add: K workers, the master, the warm-up fit."""

    workers: int = 2
    """Number of workers K."""
    master: str | None = None
    """Spark master (default local[K])."""
    warmup: bool = True
    """Run one untimed single-step Spark fit first (Python workers started, torch imported)."""

    def __post_init__(self):
        super().__post_init__()
        self._check("workers")


# -- shared pieces ---------------------------------------------------------------------------------

def load_data(dataset: str, *, train_samples: int | None = None, test_samples: int | None = None):
    """``(train, test)`` ArrayDatasets of ``dataset`` (mnist, mnist-small or extended-mnist), optionally cut.

    The cuts take the first samples (the splits are already shuffled), so every process and run sees the same
    subset. ``extended-mnist`` trains on ``train_samples`` (default 100,000) digits made once and cached
    (:func:`~sparknet.datasets.cached_extended_arrays`) and tests on MNIST's test digits.
    """
    name = dataset.strip().lower().replace("_", "-")
    data = load_dataset(name, **({"num_samples": train_samples or 100_000} if name == "extended-mnist" else {}))
    train, test = data.train, data.test
    return tuple(data.subset(n) if n is not None and n < len(data) else data
                 for data, n in ((train, train_samples), (test, test_samples)))


def make_model(name: str, batch_size: int):
    """A zoo net for 28x28 MNIST digits: ``lenet`` or ``mlp``."""
    name = name.lower()
    if name not in ("lenet", "mlp"):
        raise ValueError(f"unknown model {name!r} for the experiments; choose lenet or mlp")
    from sparknet import zoo

    return getattr(zoo, name)(batch_size=batch_size)


def make_solver(solver_type: str = "sgd", lr: float = 0.05, momentum: float = 0.9, weight_decay: float = 0.0,
                **policy):
    """A :class:`~sparknet.solvers.SolverConfig`; a fixed rate (so counts do not depend on a horizon) unless
    ``policy`` (``lr_policy``, ``gamma``, ``power``) says otherwise."""
    return SolverConfig(type=solver_type, base_lr=lr, momentum=momentum, weight_decay=weight_decay,
                        **{"lr_policy": "fixed", **policy})


def to_target(curve: list[dict], target: float) -> dict:
    """Where an accuracy curve (``steps``, ``accuracy``, ``wall_s`` records) first reaches ``target``, and its end."""
    hit = next((r for r in curve if r.get("accuracy") is not None and r["accuracy"] >= target), None)
    return {"reached": hit is not None, "time_to_target_s": hit["wall_s"] if hit else None,
            "steps_to_target": hit["steps"] if hit else None,
            "final_accuracy": curve[-1]["accuracy"] if curve else None}


def median_step_time(net_params, solver, train, *, batch_size: int, steps: int = 50, warmup: int = 5,
                     threads: int = 1, seed: int = 0) -> dict:
    """C(b) of the paper: ``steps`` single solver steps of ``net_params`` on ``train`` timed; median and spread."""
    from sparknet.net import Net

    with torch_threads(threads):
        net = Net(net_params, solver, batch_size=batch_size, seed=seed)
        net.set_training_data(train)
        net.train(warmup)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            net.train(1)
            times.append(time.perf_counter() - t)
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    return {"median_s": statistics.median(times), "p10_s": q[0], "p90_s": q[-1], "steps": steps,
            "batch_size": batch_size, "threads": threads}


@contextlib.contextmanager
def torch_threads(threads: int):
    """Run the block with ``threads`` torch threads, restoring the number it had before."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _pool_init(initializer: Callable | None, args: tuple) -> None:
    import torch

    torch.set_num_threads(1)
    if initializer is not None:
        initializer(*args)


def parallel_map(fn: Callable[[dict], dict], jobs: list[dict], *, processes: int,
                 initializer: Callable | None = None, initargs: tuple = ()) -> list[dict]:
    """``[fn(job) for job in jobs]`` in ``processes`` spawned processes of one torch thread each (with
    ``processes <= 1`` here, after ``initializer``, which is what tests use)."""
    if processes <= 1 or len(jobs) <= 1:
        with torch_threads(1):
            _pool_init(initializer, initargs)
            return [fn(job) for job in jobs]
    with multiprocessing.get_context("spawn").Pool(min(processes, len(jobs)), initializer=_pool_init,
                                      initargs=(initializer, initargs)) as pool:
        return pool.map(fn, jobs, chunksize=1)


def measured(what: str, keys: dict, run: Callable[..., dict], *args) -> dict:
    """``run(*args)``, logged as ``what``; if it raises, a record of the failure instead (``keys``, ``ok: False``,
    the error and the tail of its traceback): the comparison shows what failed."""
    log.info("%s", what)
    t0 = time.perf_counter()
    try:
        return run(*args)
    except Exception as exc:  # kept with its error
        log.error("%s failed: %s: %s", what, type(exc).__name__, exc)
        return {**keys, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                "traceback_tail": traceback.format_exc()[-2000:], "wall_s": time.perf_counter() - t0}


@contextlib.contextmanager
def spark_stage(config: SparkExperimentConfig, train, spark=None, *, engine: str = "rounds", needed: bool = True):
    """``(spark, df, warmup_s)`` for the fits of one experiment, on ``spark`` or on a session of its own (on
    ``config.master``, default ``local[K]``, stopped on the way out); ``df`` is ``train`` read from Parquet (written
    once, cached beside the data set); ``warmup_s`` the seconds of one untimed single-step fit on ``engine`` (``None``
    without ``config.warmup``), so no timed fit pays for starting Python workers and importing torch.
    Without ``needed`` nothing is started: ``(spark, None, None)``."""
    if not needed:
        yield spark, None, None
        return
    # The Spark engine's modules load only where an experiment uses Spark (never in the simulation's processes).
    from sparknet.spark import get_session
    from sparknet.spark.run import dataset_frame

    own = spark is None
    if own:
        spark = get_session(config.master or f"local[{config.workers}]", app_name="sparknet-experiments")
    try:
        df = dataset_frame(spark, config.dataset, train)
        warmup_s = None
        if config.warmup:
            warmup_s = spark_fit(config, spark, df, engine=engine, tau=1, rounds=1, steps=1).wall_s
            log.info("Spark warm-up fit (%s engine, one step): %.1f s", engine, warmup_s)
        yield spark, df, warmup_s
    finally:
        if own:
            try:
                spark.stop()
            except Exception as exc:  # a session whose JVM already died must not hide the results
                log.warning("stopping the Spark session failed: %s: %s", type(exc).__name__, exc)


@dataclasses.dataclass(frozen=True)
class SparkFit:
    """One timed :class:`~sparknet.spark.SparkTrainer` fit: its result and the seconds ``fit`` took."""

    result: Any
    wall_s: float

    @property
    def rounds(self) -> list[dict]:
        return [h for h in self.result.history if h.get("event") == "round"]

    @property
    def curve(self) -> list[dict]:
        """``steps``, ``accuracy`` and ``wall_s`` of every evaluated round."""
        return [{"steps": h["total_steps"], "accuracy": h["val_accuracy"], "wall_s": h["wall_s"]}
                for h in self.rounds if h.get("val_accuracy") is not None]


def spark_fit(config: SparkExperimentConfig, spark, df, test=None, *, steps: int, solver=None, link=None,
              model: str = "lenet", **dist) -> SparkFit:
    """Fit ``model`` (default LeNet) on ``df`` with :class:`~sparknet.spark.SparkTrainer`, evaluating on ``test``;
    timed.

    The experiment's workers and master and the keywords ``dist`` (engine, strategy, tau, ...) make the
    :class:`~sparknet.config.DistributedConfig`; its batch size and seed go to the trainer (one torch
    thread per worker); ``link`` (a :class:`~sparknet.link.LinkModel`) slows every exchange unless it is free.
    """
    from sparknet.spark import EngineOptions, SparkTrainer  # as in spark_stage

    worker = WorkerConfig(solver=solver or SolverConfig(), batch_size=config.batch_size, seed=config.seed, threads=1,
                          steps=steps)
    # every evaluation over the whole test set: the experiments draw accuracy curves
    dist_config = DistributedConfig(workers=config.workers, master=config.master,
                                    **{"eval_screen_rows": 0, "eval_budget": 1.0, **dist})
    trainer = SparkTrainer(make_model(model, config.batch_size), worker, dist_config, spark=spark,
                           options=EngineOptions(link=None if link is None or link.is_free else link))
    t0 = time.perf_counter()
    result = trainer.fit(df, validation=None if test is None else (test.x, test.y))
    return SparkFit(result, time.perf_counter() - t0)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("drawing figures needs matplotlib: pip install 'sparknet[plot]'") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
