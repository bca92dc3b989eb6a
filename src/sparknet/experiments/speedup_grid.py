"""Figure 3 of the SparkNet paper: speedup over one worker for every K and tau, with S = 0.

    sparknet experiment speedup-grid --quick       # K in {1,2,4}, tau in {1,5,25}, MNIST 5k subset
    sparknet experiment speedup-grid               # K in {1,2,4,8,16}, tau in {1,2,5,10,25,100,500}
    sparknet experiment speedup-grid --dataset extended-mnist --train-samples 1000000 --target 0.985 \
        --eval-every 25 --strategies average --taus 1 5 25 100 --tag extended   # a task of thousands of steps
    sparknet experiment speedup-grid --wall-clock ...   # the same cells as Spark fits of K workers, in seconds

Iterations are counted, not seconds, so the K logical workers of a cell run one after another in one process
(:func:`sparknet.simulate.simulate`, the very strategy code the Spark engines run) and cells run in parallel
processes. For each cell the speedup to test accuracy ``a`` is

    N_a(b) / (tau * M_a(b, K, tau))

with N_a(b) the serial steps one worker with the same inner solver needs to reach ``a`` (evaluated every
``eval_every`` steps; averaging uses SGD with momentum, DiLoCo the AdamW of its paper, so each has its own N_a)
and M_a the rounds of tau steps the K workers need (the averaged model exists only at round ends, so it is
evaluated every round, or every few rounds when tau < ``eval_every``). The paper's Figure 3 caption prints the
ratio the other way up; its text and Figure 4 use this one, where more than 1 means faster than one worker.

Checks written into the JSON: the K=1 row of plain averaging is the single-worker run, so its speedups are 1 up
to the resolution ``ceil(N_a / tau) * tau`` of a round; the tau=1 column of averaging is large-batch SGD (with
``large_batch_reference`` the naive scheme, one worker with batch K*b, runs beside it).

With ``wall_clock`` every cell is instead a real Spark fit: K workers of one torch thread each (the barrier engine
by default) running at once on ``local[max K]`` (or ``master``), the cells one after another in one session, each
timed in seconds: its rounds up to the one whose evaluation reaches ``a``, each from its start to its new global
weights (the evaluations and the stage's launch left out; the paper's Figures 3-5 are wall-clock times). The
speedup is over one worker in this process (one thread, the same solver, its rows in its own memory as a worker's
are, evaluated as often, evaluations left out): T_a / T(K, tau). Beside it each cell keeps the speedup its own step
counts give, N_a / (tau * M_a): what the simulation measures. Where the two disagree the difference is the cost of
running for real, a parallel step's ``step_ms`` against the one worker's: the exchanges, Spark's rounds, and K
processes sharing the machine's cores and memory. ``speedup_k1`` is the same over the K = 1 cell of the same tau,
one Spark worker in a process of its own as the K are: the stricter reading where that worker steps faster than the
one in this process (two cores, the MLP: 2.5-3.4 against 3.2-4.8 ms a step, the one here evaluating between its steps in
the same process). K = 1 runs first, then the largest K, and each cell is logged as it ends.

Cells that do not reach ``a`` within ``budget * N_a`` parallel steps are recorded with ``speedup: null`` and
shown hatched (``diverged: true`` when their accuracy fell to chance). The K=1 cells run first; where a single
worker diverges (DiLoCo's outer momentum on top of a few inner steps can), the other cells of that column first
run ``probe_fraction`` of the budget and stop there if they diverged too.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from sparknet.experiments import (ExperimentConfig, load_data, make_model, make_solver, measured, parallel_map,
                                  pyplot)

__all__ = ["Config", "QUICK", "run", "plot", "speedup_table"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Config(ExperimentConfig):
    """Settings of the speedup grid (full defaults; ``QUICK`` holds the quick ones)."""

    workers: tuple[int, ...] = (1, 2, 4, 8, 16)
    """Numbers of workers K (rows)."""
    taus: tuple[int, ...] = (1, 2, 5, 10, 25, 100, 500)
    """Local steps between synchronizations (columns)."""
    strategies: tuple[str, ...] = ("average", "diloco")
    """Strategies, one heatmap each."""
    model: str = "mlp"
    """lenet or mlp (the counts do not depend on the hardware; mlp makes the full grid fit in minutes here)."""
    target: float = 0.965
    """Target test accuracy a."""
    solver_type: str = "sgd"
    """Every averaging (and EASGD) worker's update rule, and that of their single-worker baseline."""
    lr_policy: str = "fixed"
    """Learning-rate policy of those workers and their baseline (fixed, inv, step, ...; Caffe's LeNet solver: inv,
    gamma 1e-4, power 0.75). Each worker decays its rate by its own local steps, as the single worker does."""
    gamma: float = 1e-4
    """Policy factor (inv: 1e-4 in Caffe's LeNet solver; step: the factor at every stepsize steps)."""
    power: float = 0.75
    """Policy exponent (inv)."""
    stepsize: int = 10000
    """Steps between the step policy's decays."""
    diloco_solver_type: str = "adamw"
    """DiLoCo's inner update rule (the DiLoCo paper's AdamW); its speedups are against one worker with it."""
    diloco_lr: float = 1e-3
    """DiLoCo's inner learning rate (fixed)."""
    diloco_weight_decay: float = 1e-4
    """DiLoCo's inner weight decay."""
    diloco_outer_lr: float = 0.7
    """DiLoCo's outer learning rate."""
    diloco_outer_momentum: float = 0.9
    """DiLoCo's outer Nesterov momentum."""
    eval_every: int = 50
    """Steps between evaluations (whole rounds when tau is larger)."""
    baseline_steps: int = 20000
    """Most steps of the single-worker run that measures N_a."""
    budget: float = 1.5
    """A cell stops after budget * N_a parallel steps (speedup below 1/budget is 'not reached')."""
    diverged_accuracy: float = 0.2
    """A run whose accuracy ends at or below this (chance is 0.1) has diverged."""
    probe_fraction: float = 0.2
    """Cells of a (strategy, tau) whose single worker diverged first run this fraction of the budget."""
    large_batch_reference: bool = True
    """Also run the naive scheme (one worker, batch K*b) for every K > 1: the tau=1 column's twin."""
    processes: int = 2
    """Cells run in this many processes (one torch thread each)."""
    wall_clock: bool = False
    """Time every cell as a real Spark fit of K workers running at once, in seconds (see the module's text), instead
    of counting steps in a simulation."""
    master: str | None = None
    """Spark master of the wall-clock cells (default local[max K])."""
    engine: str = "barrier"
    """Spark engine of the wall-clock cells (rounds or barrier)."""

    def __post_init__(self):
        super().__post_init__()
        self.strategies = tuple(str(s).lower() for s in self.strategies)
        if not 0 < self.probe_fraction <= 1:
            raise ValueError(f"probe_fraction must be in (0, 1], got {self.probe_fraction}")
        if not self.budget >= 1:
            raise ValueError(f"budget is a multiple of N_a, at least 1, got {self.budget}")
        self._check("eval_every", "baseline_steps", "processes", target=True, counts=("workers", "taus"),
                    choices={"strategies": ("average", "diloco", "easgd"), "engine": ("rounds", "barrier")})
        self.lr_policy = str(self.lr_policy).lower()
        make_solver(**solver_for(self, "average"))  # an unknown policy or a bad factor fails here, not in the pool


QUICK: dict = {
    "workers": (1, 2, 4), "taus": (1, 5, 25), "dataset": "mnist-small", "test_samples": None, "target": 0.9,
    "eval_every": 10, "baseline_steps": 1500,
}


# -- work done in the pool's processes -----------------------------------------------------------

_DATA: dict = {}


def _load(dataset: str, train_samples: int | None, test_samples: int | None) -> None:
    key = (dataset, train_samples, test_samples)
    if _DATA.get("key") != key:
        _DATA["key"] = key
        _DATA["train"], _DATA["test"] = load_data(dataset, train_samples=train_samples, test_samples=test_samples)


def _baseline(job: dict) -> dict:
    """N_a(b): one worker, plain SGD, evaluated every ``eval_every`` steps until the target (``simulate`` with
    K = 1 and rounds of ``eval_every`` steps)."""
    from sparknet.simulate import simulate

    t0 = time.perf_counter()
    r = simulate(make_model(job["model"], job["batch_size"]), _DATA["train"], _DATA["test"], workers=1,
                 tau=job["eval_every"], solver=make_solver(**job["solver"]), batch_size=job["batch_size"],
                 target_accuracy=job["target"], steps=job["steps"], seed=job["seed"])
    curve = [{"steps": h["steps"], "accuracy": h["accuracy"]} for h in r.history]
    return {"kind": "baseline", "reached": r.reached, "N_a": r.total_steps if r.reached else None,
            "steps": r.total_steps, "accuracy": r.accuracy, "curve": curve, "cell_s": time.perf_counter() - t0}


def _cell(job: dict) -> dict:
    """One (strategy, K, tau) cell, or a large-batch reference run, through ``simulate``."""
    from sparknet.simulate import simulate

    t0 = time.perf_counter()

    def attempt(steps: int):
        return simulate(make_model(job["model"], job["batch_size"]), _DATA["train"], _DATA["test"],
                        workers=job["workers"], tau=job["tau"], strategy=job["strategy"],
                        solver=make_solver(**job["solver"]), batch_size=job["batch_size"],
                        target_accuracy=job["target"], steps=steps, eval_every_steps=job["eval_every"],
                        seed=job["seed"], strategy_options=job.get("options"))

    probe = job.get("probe_steps")
    probed = bool(probe and probe < job["steps"])
    # A probed cell (its single worker diverged) runs a short run first and spends the whole budget only if it
    # is still learning (the same seeds make the probe the start of the full run).
    r = attempt(probe if probed else job["steps"])
    if probed and not r.reached and r.accuracy > job["diverged_accuracy"]:
        r = attempt(job["steps"])
    diverged = not r.reached and not (r.accuracy > job.get("diverged_accuracy", 0.0))
    out = {k: v for k, v in job.items() if k not in ("options", "model", "target", "seed")}
    out.update(reached=r.reached, rounds=r.rounds, steps_per_worker=r.steps_per_worker, accuracy=r.accuracy,
               diverged=diverged, probed=probed,
               curve=[{"round": h["round"], "steps": h["steps"], "accuracy": h["accuracy"]} for h in r.history],
               cell_s=time.perf_counter() - t0)
    return out


# -- the experiment -------------------------------------------------------------------------------

def solver_for(config: Config, strategy: str) -> dict:
    """The inner solver (``make_solver`` arguments) of a strategy's workers."""
    if strategy == "diloco":
        return {"solver_type": config.diloco_solver_type, "lr": config.diloco_lr, "momentum": config.momentum,
                "weight_decay": config.diloco_weight_decay}
    solver = {"solver_type": config.solver_type, "lr": config.lr, "momentum": config.momentum}
    if config.lr_policy != "fixed":
        # (a fixed rate keeps the arguments, and so the results' solver keys, as they were)
        solver.update(lr_policy=config.lr_policy, gamma=config.gamma, power=config.power, stepsize=config.stepsize)
    return solver


def _rate_words(solver: dict) -> str:
    """The learning rate's policy for a plot's title: nothing for a fixed rate, else a second line
    ``"lr 0.05, inv (gamma 0.0001, power 0.75)"``."""
    policy = solver.get("lr_policy", "fixed")
    if policy == "fixed":
        return ""
    knobs = {"step": ("gamma", "stepsize"), "exp": ("gamma",), "inv": ("gamma", "power"), "poly": ("power",)}
    args = ", ".join(f"{k} {solver[k]:g}" for k in knobs.get(policy, ("gamma", "power", "stepsize"))
                     if solver.get(k) is not None)
    return f"\nlr {solver.get('lr'):g}, {policy}" + (f" ({args})" if args else "")


def _solver_key(solver: dict) -> str:
    return ",".join(f"{k}={solver[k]}" for k in sorted(solver))


def _jobs(config: Config, n_a: dict[str, int]) -> list[dict]:
    common = {"model": config.model, "batch_size": config.batch_size, "target": config.target, "seed": config.seed}
    jobs = []
    for strategy in config.strategies:
        solver = solver_for(config, strategy)
        limit = config.budget * n_a[_solver_key(solver)]
        for k in config.workers:
            for tau in config.taus:
                job = {**common, "kind": "cell", "strategy": strategy, "workers": k, "tau": tau, "solver": solver,
                       "steps": max(tau, math.ceil(limit / tau) * tau),
                       "probe_steps": max(tau, math.ceil(config.probe_fraction * limit / tau) * tau),
                       "diverged_accuracy": config.diverged_accuracy,
                       "eval_every": max(config.eval_every, tau)}
                if strategy == "diloco":
                    job["options"] = {"outer_lr": config.diloco_outer_lr,
                                      "outer_momentum": config.diloco_outer_momentum}
                jobs.append(job)
    if config.large_batch_reference:
        solver = solver_for(config, "average")
        limit = config.budget * n_a[_solver_key(solver)]
        for k in config.workers:
            if k > 1:
                jobs.append({**common, "kind": "large_batch", "strategy": "sync", "workers": k, "tau": 1,
                             "solver": solver, "steps": math.ceil(limit), "eval_every": config.eval_every})
    # Longest first (work grows with K), so the pool ends together.
    jobs.sort(key=lambda j: -j["workers"])
    return jobs


def speedup_table(cells: list[dict], strategy: str, workers, taus, *, key: str = "speedup") -> list[list[float | None]]:
    """Rows K, columns tau: each cell's ``key`` (``None`` where the target was not reached)."""
    by = {(c["workers"], c["tau"]): c.get(key) for c in cells if c.get("strategy") == strategy
          and c.get("kind", "cell") == "cell"}
    return [[by.get((k, t)) for t in taus] for k in workers]


def run(config: Config, out_dir: Path | None = None, *, quick: bool = False, spark=None) -> dict:
    """Measure N_a for each inner solver, then run every cell; returns the result body."""
    if config.wall_clock:
        return _run_wall_clock(config, spark)
    initargs = (config.dataset, config.train_samples, config.test_samples)
    pool_map = functools.partial(parallel_map, processes=config.processes, initializer=_load, initargs=initargs)
    strategies = (*config.strategies, *(("average",) if config.large_batch_reference else ()))
    solvers = {_solver_key(solver_for(config, s)): solver_for(config, s) for s in strategies}  # one N_a per solver
    base_jobs = [{"kind": "baseline", "model": config.model, "batch_size": config.batch_size, "solver": solver,
                  "seed": config.seed, "target": config.target, "steps": config.baseline_steps,
                  "eval_every": config.eval_every, "solver_key": key} for key, solver in solvers.items()]
    log.info("speedup grid: measuring N_a for %d solver(s) (one worker, target %.3f)", len(base_jobs), config.target)
    baselines = pool_map(_baseline, base_jobs)
    n_a: dict[str, int] = {}
    for job, base in zip(base_jobs, baselines):
        base["solver"] = job["solver"]
        _check_baseline(base, job["solver"], config)
        n_a[job["solver_key"]] = base["N_a"]
    log.info("N_a = %s; running %d cells on %d processes", n_a, len(config.workers) * len(config.taus)
             * len(config.strategies), config.processes)
    # Single workers first: a (strategy, tau) whose K = 1 run diverges has its other cells probed
    # before they get the whole budget (divergence is what costs most: K workers for budget * N_a steps).
    jobs = _jobs(config, n_a)
    first = [j for j in jobs if j["kind"] == "cell" and j["workers"] == 1]
    results = pool_map(_cell, [{**j, "probe_steps": None} for j in first])
    diverged_columns = {(r["strategy"], r["tau"]) for r in results if r["diverged"]}
    rest = [j if (j["strategy"], j["tau"]) in diverged_columns else {**j, "probe_steps": None}
            for j in jobs if j not in first]
    if diverged_columns:
        log.info("single workers diverged for %s: probing those columns first", sorted(diverged_columns))
    results += pool_map(_cell, rest)
    cells, large_batch = [], []
    for r in results:
        base_n = n_a[_solver_key(r["solver"])]
        parallel_steps = r["rounds"] * r["tau"] if r["kind"] == "cell" else r["steps_per_worker"]
        r["N_a"] = base_n
        r["parallel_steps"] = parallel_steps if r["reached"] else None
        r["speedup"] = base_n / parallel_steps if r["reached"] and parallel_steps else None
        (cells if r["kind"] == "cell" else large_batch).append(r)
    cells.sort(key=lambda c: (config.strategies.index(c["strategy"]), c["workers"], c["tau"]))
    large_batch.sort(key=lambda c: c["workers"])
    table = {s: speedup_table(cells, s, config.workers, config.taus) for s in config.strategies}
    n_a_by_strategy = {s: n_a[_solver_key(solver_for(config, s))] for s in config.strategies}
    return {"N_a": n_a_by_strategy, "baselines": baselines, "workers": list(config.workers),
            "taus": list(config.taus), "strategies": list(config.strategies), "speedup": table, "cells": cells,
            "large_batch": large_batch, "checks": _checks(n_a_by_strategy.get("average"), cells, large_batch)}


def _check_baseline(base: dict, solver: dict, config: Config) -> None:
    """``RuntimeError`` unless the single worker's run ``base`` reached the target: no N_a to count speedups from."""
    if not base["reached"]:
        raise RuntimeError(f"one worker with {solver} did not reach the target accuracy {config.target} in "
                           f"{config.baseline_steps} steps (it reached {base['accuracy']:.4f}); lower the target or "
                           "raise baseline_steps")


# -- the grid in seconds, on Spark ------------------------------------------------------------------

def _one_worker_in_seconds(config: Config, solver: dict, train, test) -> dict:
    """T_a and N_a: one worker in this process, one torch thread, evaluated every ``eval_every`` steps, timed
    without its evaluations, until the target or ``baseline_steps``."""
    import numpy as np

    from sparknet.experiments import torch_threads
    from sparknet.net import Net

    with torch_threads(1):
        net = Net(make_model(config.model, config.batch_size), make_solver(**solver), batch_size=config.batch_size,
                  seed=config.seed)
        # its rows in its own memory, as a Spark worker holds the rows it staged: read through the data cache's
        # mapped pages, its steps took 15-30% longer than on a copy (two cores, the MLP: page faults on a first pass,
        # small pages), which flattered every speedup
        net.set_training_data((np.array(train.x), np.array(train.y)))
        net.set_validation_data(test)
        steps, train_s, accuracy, curve = 0, 0.0, 0.0, []
        while steps < config.baseline_steps and accuracy < config.target:
            t = time.perf_counter()
            net.train(config.eval_every)
            train_s += time.perf_counter() - t
            steps += config.eval_every
            accuracy = net.evaluate().metrics["accuracy"]
            curve.append({"steps": steps, "accuracy": accuracy, "train_s": train_s})
    reached = accuracy >= config.target
    return {"kind": "baseline", "reached": reached, "N_a": steps if reached else None, "steps": steps,
            "T_a": train_s if reached else None, "step_ms": 1000 * train_s / steps if reached else None,
            "accuracy": accuracy, "curve": curve, "solver": solver}


def _spark_cell(config: Config, spark, df, test, strategy: str, solver: dict, k: int, tau: int,
                limit: float) -> dict:
    """One (strategy, K, tau) cell as a real Spark fit, timed from its first round to the one reaching the target."""
    from sparknet.experiments import SparkExperimentConfig, spark_fit

    fit_config = SparkExperimentConfig(dataset=config.dataset, batch_size=config.batch_size, seed=config.seed,
                                       workers=k, master=spark.sparkContext.master, warmup=False)
    options = ({"outer_lr": config.diloco_outer_lr, "outer_momentum": config.diloco_outer_momentum}
               if strategy == "diloco" else {})
    every = max(1, math.ceil(config.eval_every / tau))  # rounds between evaluations
    fit = spark_fit(fit_config, spark, df, test, steps=max(tau, math.ceil(limit / tau) * tau),
                    solver=make_solver(**solver), model=config.model, engine=config.engine, strategy=strategy,
                    tau=tau, eval_every_rounds=every, target_accuracy=config.target,
                    # rows in memory, as the one worker's are (auto streams a million digits from disk at K <= 4
                    # on sixteen slots of a 16 GiB driver)
                    data_mode="memory", **options)
    rounds, summary = fit.rounds, fit.result.summary
    hit = next((r for r in rounds if (r.get("val_accuracy") or 0.0) >= config.target), None)
    upto = rounds[:rounds.index(hit) + 1] if hit else rounds
    last = rounds[-1] if rounds else {}
    cell = {"kind": "cell", "strategy": strategy, "workers": k, "tau": tau, "solver": solver,
            "reached": hit is not None,
            "rounds": hit["round"] if hit else len(rounds), "steps_per_worker": last.get("total_steps", 0),
            "data_mode": summary.get("data_mode"),
            "accuracy": last.get("val_accuracy"), "diverged": False, "eval_every_rounds": every,
            "setup_s": summary["setup_s"], "fit_s": fit.wall_s, "eval_s": sum(r.get("eval_s", 0.0) for r in upto),
            "samples_per_s": summary.get("samples_per_s"),
            # the rounds up to the one that reached the target, each from its start to its new global weights:
            # the steps and the exchanges, not the evaluations nor the stage's launch
            "seconds": sum(r["round_s"] for r in upto) if hit else None,
            "from_fit_start_s": hit["wall_s"] if hit else None}
    accuracy = cell["accuracy"]
    cell["diverged"] = hit is None and not (accuracy is not None and accuracy > config.diverged_accuracy)
    return cell


def _run_wall_clock(config: Config, spark=None) -> dict:
    """The grid in seconds: the one-worker baselines here, then every cell a Spark fit, in one session."""
    from sparknet.spark import get_session
    from sparknet.spark.run import dataset_frame

    train, test = load_data(config.dataset, train_samples=config.train_samples, test_samples=config.test_samples)
    baselines, by_solver = [], {}
    for strategy in config.strategies:
        solver = solver_for(config, strategy)
        key = _solver_key(solver)
        if key not in by_solver:
            log.info("speedup grid in seconds: one worker with %s", solver)
            base = by_solver[key] = _one_worker_in_seconds(config, solver, train, test)
            baselines.append(base)
            _check_baseline(base, solver, config)
    own = spark is None
    if own:
        spark = get_session(config.master or f"local[{max(config.workers)}]", app_name="sparknet-speedup-grid")
    cells = []
    try:
        for strategy in config.strategies:
            base = by_solver[_solver_key(solver_for(config, strategy))]
            # K = 1 first (every other cell's speedup_k1 is over it), then the largest K: what a run cut short most
            # needs
            one = {}
            for k in sorted(config.workers, key=lambda k: (k != 1, -k)):
                df = dataset_frame(spark, config.dataset, train, k)  # dealt to the K workers from files here
                for tau in config.taus:
                    # a cell that fails is kept with its error (not reached): the grid goes on
                    keys = {"kind": "cell", "strategy": strategy, "workers": k, "tau": tau, "reached": False,
                            "rounds": 0, "seconds": None}
                    cell = measured(f"speedup grid in seconds: {strategy}, K = {k}, tau = {tau}", keys, _spark_cell,
                                    config, spark, df, test, strategy, solver_for(config, strategy), k, tau,
                                    config.budget * base["N_a"])
                    cell["N_a"], cell["T_a"] = base["N_a"], base["T_a"]
                    cell["parallel_steps"] = cell["rounds"] * tau if cell["reached"] else None
                    cell["speedup_steps"] = base["N_a"] / cell["parallel_steps"] if cell["reached"] else None
                    cell["speedup"] = base["T_a"] / cell["seconds"] if cell["reached"] and cell["seconds"] else None
                    # a parallel step's milliseconds, its round's share counted: speedup = speedup_steps times the
                    # one worker's step_ms over this one's, so where the two speedups part, this says by how much
                    cell["step_ms"] = 1000 * cell["seconds"] / cell["parallel_steps"] if cell["speedup"] else None
                    # over the K = 1 cell of the same tau as well: one Spark worker, in a process of its own as the
                    # K are (where the one worker in this process steps slower than a Spark worker, the stricter
                    # reading)
                    if k == 1:
                        one[tau] = cell["seconds"]
                    cell["speedup_k1"] = one[tau] / cell["seconds"] if one.get(tau) and cell["speedup"] else None
                    cells.append(cell)
                    if cell["speedup"]:  # each cell as it ends: a run cut short keeps them in its log
                        log.info("%s, K = %d, tau = %d: %.1f s to %s in %d rounds, speedup %.2f, over K = 1 %s (by "
                                 "its steps %.2f; %.2f ms a step, the one worker's %.2f)", strategy, k, tau,
                                 cell["seconds"], config.target, cell["rounds"], cell["speedup"],
                                 "—" if cell["speedup_k1"] is None else f"{cell['speedup_k1']:.2f}",
                                 cell["speedup_steps"], cell["step_ms"], base["step_ms"])
                    else:
                        log.info("%s, K = %d, tau = %d: not reached (accuracy %s)", strategy, k, tau,
                                 cell.get("accuracy"))
    finally:
        if own:
            spark.stop()
    order = {s: i for i, s in enumerate(config.strategies)}, {k: i for i, k in enumerate(config.workers)}
    cells.sort(key=lambda c: (order[0][c["strategy"]], order[1][c["workers"]], config.taus.index(c["tau"])))
    return {"measure": "seconds", "N_a": {s: by_solver[_solver_key(solver_for(config, s))]["N_a"]
                                          for s in config.strategies},
            "T_a": {s: by_solver[_solver_key(solver_for(config, s))]["T_a"] for s in config.strategies},
            "baselines": baselines, "workers": list(config.workers), "taus": list(config.taus),
            "strategies": list(config.strategies),
            "speedup": {s: speedup_table(cells, s, config.workers, config.taus) for s in config.strategies},
            "speedup_steps": {s: speedup_table(cells, s, config.workers, config.taus, key="speedup_steps")
                              for s in config.strategies},
            "speedup_k1": {s: speedup_table(cells, s, config.workers, config.taus, key="speedup_k1")
                           for s in config.strategies},
            "cells": cells, "large_batch": []}


def _checks(n_a: int | None, cells: list[dict], large_batch: list[dict]) -> dict:
    checks: dict = {}
    k1 = [c for c in cells if c["strategy"] == "average" and c["workers"] == 1]
    if k1 and n_a:
        # A round ends every tau steps, so one worker reaches a at ceil(N_a / tau) * tau at best.
        expected = {str(c["tau"]): n_a / (math.ceil(n_a / c["tau"]) * c["tau"]) for c in k1}
        checks["k1_average"] = {
            "speedups": {str(c["tau"]): c["speedup"] for c in k1},
            "expected_from_round_resolution": expected,
            "max_abs_deviation_from_1": max((abs(c["speedup"] - 1) for c in k1 if c["speedup"] is not None),
                                            default=None),
            "all_reached": all(c["reached"] for c in k1),
        }
    tau1 = {c["workers"]: c["speedup"] for c in cells if c["strategy"] == "average" and c["tau"] == 1}
    if large_batch:
        checks["tau1_vs_large_batch"] = [
            {"workers": lb["workers"], "average_tau1_speedup": tau1.get(lb["workers"]),
             "large_batch_speedup": lb["speedup"]} for lb in large_batch]
    ks = sorted(tau1)
    if ks and all(tau1[k] is not None for k in ks):
        checks["tau1_sublinear"] = all(tau1[k] <= k * 1.05 for k in ks)
    return checks


def plot(result: dict, path: str | Path) -> None:
    """One heatmap per strategy: rows K, columns tau, the speedup written in each cell."""
    import numpy as np
    from matplotlib.colors import LogNorm

    plt = pyplot()
    strategies = result["strategies"]
    workers, taus = result["workers"], result["taus"]
    values = [v for s in strategies for row in result["speedup"][s] for v in row if v]
    vmax = max(values + [2.0])
    vmin = min(values + [0.5])
    fig, axes = plt.subplots(1, len(strategies), figsize=(max(0.75 * len(taus), 3.6) * len(strategies) + 1.2,
                                                          0.5 * len(workers) + 2.0), squeeze=False,
                             layout="constrained")
    image = None
    for ax, strategy in zip(axes[0], strategies):
        table = np.array([[np.nan if v is None else v for v in row] for row in result["speedup"][strategy]], float)
        masked = np.ma.masked_invalid(table)
        ax.set_facecolor("#dddddd")
        image = ax.imshow(masked, cmap="viridis", norm=LogNorm(vmin=vmin, vmax=vmax), aspect="auto")
        for i in range(len(workers)):
            for j in range(len(taus)):
                v = table[i, j]
                if np.isnan(v):
                    ax.text(j, i, "—", ha="center", va="center", color="black", fontsize=8)
                    ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//", color="#888888",
                                               lw=0))
                else:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8,
                            color="white" if v < math.sqrt(vmin * vmax) else "black")
        ax.set_xticks(range(len(taus)), [str(t) for t in taus])
        ax.set_yticks(range(len(workers)), [str(k) for k in workers])
        ax.set_xlabel("τ (steps between synchronizations)", fontsize=9)
        ax.set_ylabel("K (workers)", fontsize=9)
        solver = next((c["solver"] for c in result["cells"] if c["strategy"] == strategy), {})
        ax.set_title(f"{strategy} ({solver.get('solver_type')} inside, N_a = {result['N_a'][strategy]})"
                     + _rate_words(solver), fontsize=9)
    cfg = result.get("config", {})
    measure = ("T_a/T(K, τ) in seconds, K Spark workers at once" if result.get("measure") == "seconds" else
               "N_a/(τ·M_a), S = 0")
    fig.suptitle(f"Speedup {measure} to {cfg.get('target')} test accuracy\n({cfg.get('model')}, "
                 f"{cfg.get('dataset')}, b={cfg.get('batch_size')}; — = not reached in {cfg.get('budget')}·N_a steps)",
                 fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="speedup")
    fig.savefig(path, dpi=90)
    plt.close(fig)
