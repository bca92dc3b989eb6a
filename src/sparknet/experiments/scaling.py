"""Beyond this machine: the cost model (sparknet.costmodel) checked against measured runs, then K = 2...256.

    sparknet experiment scaling --quick     # constants measured here without Spark; the checks and the plot
    sparknet experiment scaling             # also an empty Spark job's latency on local[2]

1. **Calibrate** (:func:`calibrate`): LeNet's step and evaluation times with one thread on this machine and,
   in the full run, an empty Spark job on ``local[2]``.
2. **Check** every measured run found in the files given (``--measured``; by default this project's own
   results): each run's shape (engine, K, tau, steps, rounds, link) goes into the model, and the predicted
   time is set beside the measured one: in-round time for ``sparknet train`` runs, the training wall time
   (evaluations of the whole test set every round included) for the slow-network experiment's runs. A run of
   ``time_to_99.py`` with K workers takes its step from the K bare processes timed in the same call, and the
   call's cores; another machine's run with nothing measured beside it is not priced.
3. **Predict** time to target for K = 2...256 workers with a core each, every tau and link asked for, both
   engines, the model's size scaled: steps to the target from the simulator's measurements (K = 2, 4, 8) and
   beyond from the power law fitted to them, which the plot draws dashed.

Nothing is trained here: the experiment runs in seconds.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from sparknet.costmodel import JOB_OVER_EMPTY, Calibration, RunShape, StepsToTarget, predict_run
from sparknet.experiments import make_solver, pyplot, torch_threads
from sparknet.link import LinkModel

__all__ = ["Config", "QUICK", "run", "plot", "calibrate", "calibration_around", "check_point", "measured_points",
           "STEPS_TO_98_5"]

log = logging.getLogger(__name__)

STEPS_TO_98_5 = {(2, 10): 650, (2, 50): 700, (2, 200): 600, (4, 10): 450, (4, 50): 450, (4, 200): 600,
                 (8, 10): 350, (8, 50): 350, (8, 200): 600}
"""Local steps per worker for LeNet (SGD, lr 0.05, momentum 0.9, batch 64, averaging) to reach 98.5% on
MNIST in the simulator (benchmarks/results/strategies.json, evaluated every 50 steps or every round)."""

DEFAULT_MEASURED = ("benchmarks/results/time_to_99.json", "benchmarks/results/multihost_lenet_relay.json",
                    "benchmarks/results/quick_start.json", "docs/figures/slow-network.json",
                    *(f"benchmarks/results/lab_t99_{name}.json"
                      for name in ("k8_h200", "k16_h200", "k8_engines_h200", "k8_engines_h200_c", "k8_every_h200",
                                   "k16_h200_b")))


@dataclass(kw_only=True)
class Config:
    """Settings of the scaling predictions."""

    workers: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 256)
    """Worker counts predicted (a core each)."""
    taus: tuple[int, ...] = (10, 50, 200)
    """Local steps per round."""
    links: tuple[str, ...] = ("free", "1ms,10Gbit", "10ms,1Gbit", "50ms,100Mbit")
    """Links: ``free`` or ``LATENCY,BANDWIDTH``."""
    model_scales: tuple[float, ...] = (1.0, 10.0)
    """Model sizes as multiples of LeNet's."""
    measured: tuple[str, ...] = DEFAULT_MEASURED
    """Result files to check the model against (those absent are skipped)."""
    spark: bool = True
    """Measure an empty Spark job's latency on local[2] (else the calibration's default)."""
    tolerance: float = 0.15
    """The largest relative error a check passes with."""
    calibration: str | None = None
    """A scaling.json whose calibration is used instead of this machine's now (the measured points were taken
    on the day it was measured; a machine's step time drifts between days). Its solver ratios, if it has none,
    are measured here: a ratio of two steps moves less than either."""

    def __post_init__(self):
        self.workers = tuple(int(k) for k in self.workers)
        self.taus = tuple(int(t) for t in self.taus)
        if min(self.workers, default=2) < 1 or min(self.taus, default=1) < 1:
            raise ValueError(f"workers and taus must be positive, got {self.workers} and {self.taus}")
        for text in self.links:
            parse_link(text)


QUICK: dict = {"spark": False, "model_scales": (1.0,)}
"""``--quick``: no Spark session (the calibration's job latency), LeNet's size only."""


def parse_link(text: str) -> LinkModel:
    """``free`` or ``LATENCY,BANDWIDTH`` (``10ms,1Gbit``)."""
    if text == "free":
        return LinkModel()
    latency, _, bandwidth = text.partition(",")
    return LinkModel.parse(latency or None, bandwidth or None)


# -- the calibration ------------------------------------------------------------------------------------

def calibrate(spark=None, *, batch_size: int = 64, rows: int = 2048, steps: int = 30) -> Calibration:
    """The cost model's constants measured here: LeNet's step and its evaluation per row with one thread,
    what a gradient allreduce adds to a step of two ranks (:func:`allreduce_step_cost`),
    and, given ``spark``, the rounds engine's cost per round from an empty Spark job
    (:data:`~sparknet.costmodel.JOB_OVER_EMPTY` times it).

    The step is timed over ``steps`` steps in one call, as a worker runs its tau steps; the other
    experiments' :func:`~sparknet.experiments.median_step_time` times single calls (C(b) of the paper),
    which carry a call's own overhead and read about 10% higher.
    """
    import torch

    from sparknet import zoo
    from sparknet.net import Net

    g = torch.Generator().manual_seed(0)
    x = torch.rand(rows, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (rows,), generator=g)

    def timed_net(solver) -> tuple[float, Net]:
        net = Net(zoo.lenet(batch_size=batch_size), solver, batch_size=batch_size)
        net.set_training_data((x, y))
        net.train(5)
        t = time.perf_counter()
        net.train(steps)
        return (time.perf_counter() - t) / steps, net

    with torch_threads(1):
        step_s, net = timed_net(make_solver("sgd", 0.01, 0.9, 5e-4))
        adamw_s, _ = timed_net(make_solver("adamw", 0.001, 0.9, 1e-4))
        net.set_validation_data((x, y))
        net.evaluate()  # the first pass allocates
        t = time.perf_counter()
        for _ in range(3):
            net.evaluate()
        eval_s_per_row = (time.perf_counter() - t) / (3 * rows)
        model_bytes = net.get_flat().numel() * 4
    values = {"step_s": step_s, "solver_step": {"sgd": 1.0, "adamw": adamw_s / step_s},
              "eval_s_per_row": eval_s_per_row, "model_bytes": model_bytes,
              "allreduce_s": allreduce_step_cost(batch_size=batch_size, rows=rows, steps=steps)}
    if spark is not None:
        from sparknet.spark.backend import empty_job_s

        values["job_s"] = empty_job_s(spark) * JOB_OVER_EMPTY
    return Calibration(**values)


ALLREDUCE_DEADLINE_S = 180.0
"""Longest wait for :func:`allreduce_step_cost`'s two processes (their start, imports and steps)."""


def allreduce_step_cost(*, batch_size: int = 64, rows: int = 2048, steps: int = 30, repeats: int = 2) -> float:
    """Seconds a gloo allreduce of LeNet's gradient adds to each step of two one-thread ranks running side by side
    on this machine, as the naive scheme (:class:`~sparknet.strategies.Sync`) runs them: its own time and the wait
    for the slower rank. Two fresh processes (a process group over loopback) each time ``steps`` steps without the
    allreduce and ``steps`` with it, alternating ``repeats`` times; the medians' difference per step, rank 0's."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="sparknet-calibration-") as tmp:
        out = Path(tmp) / "rank0.json"
        ctx = mp.start_processes(_allreduce_rank, args=(tmp, batch_size, rows, steps, repeats), nprocs=2,
                                 join=False, start_method="spawn")
        try:
            deadline = time.monotonic() + ALLREDUCE_DEADLINE_S
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the allreduce calibration did not finish within {ALLREDUCE_DEADLINE_S:g} s")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.terminate()
                    proc.join(5.0)
        return json.loads(out.read_text())["allreduce_s"]


def _allreduce_rank(rank: int, tmp: str, batch_size: int, rows: int, steps: int, repeats: int) -> None:
    import statistics

    import torch
    import torch.distributed as dist

    from sparknet import zoo
    from sparknet.net import Net
    from sparknet.strategies import Sync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(rank)
        net = Net(zoo.lenet(batch_size=batch_size), make_solver("sgd", 0.01, 0.9, 5e-4), batch_size=batch_size)
        net.set_training_data((torch.rand(rows, 1, 28, 28, generator=g), torch.randint(0, 10, (rows,), generator=g)))
        sync = Sync()
        net.train(5, after_backward=sync.after_backward)  # the group's connections, the first steps' allocations
        plain, synced = [], []
        for _ in range(repeats):
            for hook, times in ((None, plain), (sync.after_backward, synced)):
                dist.barrier()
                t = time.perf_counter()
                net.train(steps, after_backward=hook)
                times.append((time.perf_counter() - t) / steps)
        if rank == 0:
            Path(tmp, "rank0.json").write_text(json.dumps(
                {"allreduce_s": max(0.0, statistics.median(synced) - statistics.median(plain))}))
    finally:
        dist.destroy_process_group()


def calibration_around(before: dict, after: dict) -> dict:
    """:func:`calibrate` read just before and after a benchmark's runs: ``calibration`` (their mean: this machine's
    speed moves by a fifth within an hour) and ``calibration_readings``."""
    readings = {k: [before[k], after[k]] for k in ("step_s", "eval_s_per_row", "allreduce_s")}
    mean = {k: sum(v) / 2 for k, v in readings.items()}
    mean["solver_step"] = {s: (before["solver_step"][s] + after["solver_step"][s]) / 2 for s in before["solver_step"]}
    return {"calibration": mean, "calibration_readings": readings}


# -- the measured points --------------------------------------------------------------------------------

def measured_points(paths) -> list[dict]:
    """Every run in the result files that the model can predict: its shape, link and measured seconds.

    A run of another machine is priced with the step of the K bare processes measured beside it (the same call of
    ``time_to_99.py``), else with those of another file of the same machine (its core count) and K, named in
    ``calibration_from`` (a lab call with no time for them: the same machine kind, another visit), else not at all."""
    paths = [Path(p) for p in paths]
    files = {path: json.loads(path.read_text()) for path in paths if path.exists()}
    elsewhere = {}  # (cores, K) -> (file, step): bare processes measured in some file
    for path, data in files.items():
        for k in _bare_workers(data):
            elsewhere.setdefault((data.get("cpu_count"), k), (path.name, _bare_step(data, k)))
    points = []
    for path in paths:
        if path not in files:
            log.info("scaling: %s not found, skipped", path)
            continue
        data = files[path]
        slow = data.get("experiment") == "slow-network"
        found, runs = (_slow_network_points(data, path.name), []) if slow else ([], data.get("runs"))
        if isinstance(runs, dict):
            runs = [{"run": k, **v} for k, v in runs.items()]
        if data.get("benchmark") == "quick_start":
            runs = [{"run": "quick start", **data["quick_start"]}]
        for run in runs or []:
            point = _train_point(run, path.name)
            if point is not None:
                if data.get("empty_job_s") and "--master" in run.get("command", ""):  # that cluster's own latency
                    point["job_s"] = data["empty_job_s"] * JOB_OVER_EMPTY
                found.append(point)
        for point in found:
            if data.get("calibration"):  # the machine's step and evaluation on the day the runs were taken
                point["calibration"] = data["calibration"]
            shape, cores = point["shape"], data.get("cpu_count", os.cpu_count())
            beside = None
            if shape.engine != "local":
                beside = _bare_step(data, shape.workers)
                if beside is None and cores != os.cpu_count() and (cores, shape.workers) in elsewhere:
                    point["calibration_from"], beside = elsewhere[cores, shape.workers]
            if beside is not None:
                point["calibration"] = {**point.get("calibration", {}), **beside}
            elif cores != os.cpu_count() and not point.get("calibration"):
                # another machine's run, and nothing measured beside it: this machine's constants do not price it
                log.info("scaling: %s: %r ran on %s cores with no step measured beside it; not priced", path.name,
                         point["name"], data["cpu_count"])
                continue
            points.append(point)
    return points


def _bare_workers(data: dict) -> list[int]:
    """K of every run of K bare one-thread processes in a ``time_to_99.py`` file."""
    if data.get("benchmark") != "time_to_99":
        return []
    return [int(r["run"].split()[1]) for r in data.get("runs") or []
            if str(r.get("run", "")).startswith("bare, ") and (r.get("summary") or {}).get("samples_per_s")]


def _bare_step(data: dict, workers: int, batch: int = 64) -> dict | None:
    """A K-worker run's step and cores from the K bare one-thread processes ``time_to_99.py`` ran in the same call
    (what K processes at once get from that machine: a step slower than one process's alone, where they share its
    memory and caches), or ``None`` where it ran none. The step is the slowest process's: every round waits for its
    slowest worker (on the 16-core lab, K = 8: the slowest worker's compute 1.20-1.24 of the mean one's, the slowest
    bare process 1.21 of the mean's)."""
    if data.get("benchmark") != "time_to_99":
        return None
    name = f"bare, {workers} processes"
    bare = next((r["summary"] for r in data.get("runs") or [] if r.get("run") == name and r.get("summary")), None)
    if not bare or not bare.get("samples_per_s"):
        return None
    per_process = min(bare.get("per_process") or [bare["samples_per_s"] / workers])
    return {"step_s": batch / per_process, "cores": int(data.get("cpu_count") or workers)}


def _train_point(run: dict, source: str) -> dict | None:
    """A ``sparknet train`` run: its in-round seconds are its samples over its in-round samples/s."""
    s, command = run.get("summary") or {}, run.get("command", "")
    if not s.get("samples_per_s") or not s.get("steps"):
        return None
    argv = command.split()
    if "--round-seconds" in argv:  # rounds of so many seconds, each worker its own steps: not what the model prices
        return None
    flag = lambda name, default: argv[argv.index(name) + 1] if name in argv else default  # noqa: E731
    workers = int(flag("--workers", "1"))
    engine = "local" if workers == 1 and "--master" not in argv else flag("--engine", "rounds")
    tau = int(flag("--tau", "50")) if engine != "local" else int(flag("--eval-every", "1000"))
    steps = int(s.get("steps") or 0)
    batch = int(flag("--batch-size", "64"))
    samples = steps * batch * workers
    shape = RunShape(engine=engine, workers=workers, tau=tau, steps=steps, threads=int(flag("--threads", "2")))
    return {"source": source, "name": run.get("run"), "shape": shape, "link": "free", "batch": batch,
            "what": "in-round seconds", "measured_s": samples / s["samples_per_s"], "with_eval": False}


def _slow_network_points(data: dict, source: str) -> list[dict]:
    cfg, points = data["config"], []
    for run in data["runs"]:
        if not run.get("ok") or not run.get("steps_to_target"):
            continue
        link = run["link"]
        strategy = "sync" if run["strategy"] == "sync" else "average"
        shape = RunShape(engine=run["engine"], workers=int(data["workers"]), tau=int(cfg["tau"]),
                         steps=int(run["steps_to_target"]), strategy=strategy, eval_rows=10_000.0,
                         solver="adamw" if run["strategy"] == "diloco" else "sgd")  # DiLoCo's inner AdamW
        model = LinkModel(latency_s=link["latency_s"], bandwidth_bits_per_s=link["bandwidth_bits_per_s"])
        points.append({"source": source, "name": f"{run['scheme']} over {link['label']}", "shape": shape,
                       "link": model, "what": "training seconds, evaluations included",
                       "measured_s": run["train_time_to_target_s"], "with_eval": True})
    return points


def check_point(point: dict, cal: Calibration) -> dict:
    """The model's seconds for one measured point, and its relative error."""
    link = point["link"] if isinstance(point["link"], LinkModel) else parse_link(point["link"])
    shape = point["shape"] if point["with_eval"] else replace(point["shape"], eval_rows=0.0)
    if point.get("calibration"):  # the constants its benchmark measured beside it
        cal = replace(cal, **point["calibration"])
    if point.get("job_s"):  # the Spark job latency measured on the run's own cluster
        cal = replace(cal, job_s=point["job_s"])
    predicted = predict_run(shape, cal, link)["in_rounds"]
    error = predicted / point["measured_s"] - 1.0
    return {"source": point["source"], "name": point["name"], "engine": shape.engine, "workers": shape.workers,
            "tau": shape.tau, "steps": shape.steps, "link": link.describe(), "what": point["what"],
            "measured_s": point["measured_s"], "predicted_s": predicted, "error": error,
            **({"calibration_from": point["calibration_from"]} if point.get("calibration_from") else {})}


# -- the experiment -------------------------------------------------------------------------------------

def run(config: Config, out_dir: Path | None = None, *, quick: bool = False) -> dict:
    spark = None
    if config.spark:
        from sparknet.spark import get_session

        spark = get_session("local[2]", app_name="sparknet-scaling-calibration")
    try:
        cal = calibrate(spark)
    finally:
        if spark is not None:
            spark.stop()
    here = cal
    if config.calibration:
        stored = json.loads(Path(config.calibration).read_text())["calibration"]
        cal = Calibration(**{**stored, "solver_step": stored.get("solver_step") or here.solver_step})
        log.info("scaling: this machine now %s; using %s's", here.to_dict(), config.calibration)
    log.info("scaling: calibration %s", cal.to_dict())
    checks = [check_point(p, cal) for p in measured_points(config.measured)]
    for c in checks:
        log.info("scaling: %-40s measured %7.1f s, predicted %7.1f s (%+.0f%%)", f"{c['source']}: {c['name']}",
                 c["measured_s"], c["predicted_s"], 100 * c["error"])
    steps = StepsToTarget(STEPS_TO_98_5)
    a, b = steps.fit()
    predictions = []
    for scale, link_text, tau, engine, k in itertools.product(config.model_scales, config.links, config.taus,
                                                              ("rounds", "barrier"), config.workers):
        n, is_measured = steps.steps(k, tau)
        shape = RunShape(engine=engine, workers=k, tau=tau, steps=n, model_bytes=int(cal.model_bytes * scale))
        p = predict_run(shape, replace(cal, cores=max(k, 1)), parse_link(link_text))  # a core each
        predictions.append({"model_scale": scale, "link": link_text, "tau": tau, "engine": engine, "workers": k,
                            "steps_to_target": n, "steps_measured": is_measured, "time_to_target_s": p["command"],
                            "in_rounds_s": p["in_rounds"], "round": p["round"]})
    worst = max((abs(c["error"]) for c in checks), default=None)
    return {"calibration": cal.to_dict(), "calibration_from": config.calibration, "measured_here": here.to_dict(),
            "checks": checks, "worst_error": worst,
            "within_tolerance": None if worst is None else worst <= config.tolerance,
            "steps_to_target_fit": {"a": a, "b": b, "target": 0.985, "measured": {f"{k},{t}": v for (k, t), v in
                                                                                 STEPS_TO_98_5.items()}},
            "predictions": predictions}


def plot(result: dict, path) -> None:
    plt = pyplot()
    preds = [p for p in result["predictions"] if p["model_scale"] == result["predictions"][0]["model_scale"]]
    links = list(dict.fromkeys(p["link"] for p in preds))
    tau = 50 if any(p["tau"] == 50 for p in preds) else preds[0]["tau"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    for i, link in enumerate(links):
        for engine, style in (("barrier", "-"), ("rounds", "--")):
            rows = sorted((p for p in preds if p["link"] == link and p["engine"] == engine and p["tau"] == tau),
                          key=lambda p: p["workers"])
            ax.plot([p["workers"] for p in rows], [p["time_to_target_s"] for p in rows], style, color=f"C{i}",
                    marker="o" if engine == "barrier" else "x", label=f"{engine}, {link}")
    ax.set_xscale("log", base=2)
    ax.set(yscale="log", xlabel="workers K (a core each)", ylabel="predicted time to 98.5%, setup included (s)",
           title=f"LeNet on MNIST, tau = {tau}")
    ax.axvspan(8, max(p["workers"] for p in preds), color="0.92", zorder=0)
    ax.text(9, ax.get_ylim()[1] * 0.6, "steps to target extrapolated", fontsize=8)
    ax.legend(fontsize=7)
    checks = result["checks"]
    if checks:
        lo = min(min(c["measured_s"], c["predicted_s"]) for c in checks) * 0.8
        hi = max(max(c["measured_s"], c["predicted_s"]) for c in checks) * 1.2
        bx.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        bx.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="0.9")
        colors = {"barrier": "C0", "rounds": "C1", "local": "C2"}
        for c in checks:
            bx.plot(c["measured_s"], c["predicted_s"], "o", color=colors.get(c["engine"], "C3"))
            bx.annotate(f"{c['name']} ({100 * c['error']:+.0f}%)", (c["measured_s"], c["predicted_s"]), fontsize=6)
        for engine, color in colors.items():
            bx.plot([], [], "o", color=color, label=engine)
        bx.legend(fontsize=7)
        bx.set(xscale="log", yscale="log", xlabel="measured (s)", ylabel="predicted (s)",
               title=f"the model against measured runs (band: ±15%; worst {100 * result['worst_error']:.0f}%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
