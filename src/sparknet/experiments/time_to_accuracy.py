"""Figure 5 of the SparkNet paper on this machine: wall-clock time to a test accuracy, six ways.

    sparknet experiment time-to-accuracy --quick     # MNIST 5k subset, a lower target
    sparknet experiment time-to-accuracy             # LeNet to 99% on MNIST

In one run, one after another, with the same LeNet, minibatch (per worker), solver and
evaluation cadence (every ``eval_every`` local steps, on the same test set):

- ``one-process``: :class:`~sparknet.net.Net` in this process (all cores);
- ``rounds``: sparknet, K workers, the rounds engine (a Spark job per round), averaging;
- ``barrier``: sparknet, K workers, the barrier engine (gloo allreduce per round), averaging;
- ``sync``: sparknet, K workers, gradients allreduced every step (the naive scheme, barrier engine);
- ``async``: sparknet's parameter server, K workers pushing their change every
  ``async_tau`` steps, each push moving the server by 1/K of it (it evaluates once
  per epoch, the only cadence its API offers);
- ``torch-distributor``: Spark's ``TorchDistributor`` running a plain DDP training function on
  K processes (:func:`ddp_train`), the launch overhead recorded.

Time is measured from the call that starts training (data conversion, Spark jobs and process
launch included) to the first evaluation at or above the target. An entry that fails is kept
with its error.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from sparknet.experiments import (SparkExperimentConfig, load_data, make_model, make_solver, measured, pyplot,
                                  spark_fit, spark_stage, to_target, torch_threads)

__all__ = ["Config", "QUICK", "SYSTEMS", "run", "plot", "ddp_train"]

log = logging.getLogger(__name__)

SYSTEMS = ("one-process", "rounds", "barrier", "sync", "async", "torch-distributor")
"""Every system this experiment can time."""


@dataclass(kw_only=True)
class Config(SparkExperimentConfig):
    """Settings of the time-to-accuracy comparison."""

    systems: tuple[str, ...] = SYSTEMS
    """Which systems to time, in order."""
    target: float = 0.99
    """Target test accuracy."""
    weight_decay: float = 5e-4
    """Weight decay."""
    lr_policy: str = "inv"
    """Learning-rate policy (Caffe's LeNet solver: inv, gamma 1e-4, power 0.75)."""
    gamma: float = 1e-4
    """Policy factor."""
    power: float = 0.75
    """Policy exponent."""
    eval_every: int = 100
    """Local steps between evaluations; also tau of the rounds and barrier engines."""
    steps: int = 10000
    """Most local steps per worker (per process for one-process)."""
    async_tau: int = 10
    """Steps between a worker's pushes to the parameter server."""
    async_scale: float | None = None
    """Each push moves the server by this times the worker's change (delta combiner; default 1/K, the
    asynchronous counterpart of averaging: a full-size step per push diverges with K workers)."""
    single_threads: int | None = None
    """Torch threads of the one-process run (default: every core)."""

    def __post_init__(self):
        super().__post_init__()
        self.systems = tuple(self.systems)
        self._check("eval_every", "steps", "async_tau", target=True, choices={"systems": SYSTEMS})

    def solver(self):
        return make_solver("sgd", self.lr, self.momentum, self.weight_decay, lr_policy=self.lr_policy,
                           gamma=self.gamma, power=self.power)


QUICK: dict = {"dataset": "mnist-small", "target": 0.95, "eval_every": 25, "steps": 800}


def _entry(system: str, curve: list[dict], target: float, wall_s: float, **extra) -> dict:
    return {"system": system, "ok": True, **to_target(curve, target), "wall_s": wall_s, "curve": curve, **extra}


# -- the systems ----------------------------------------------------------------------------------

def _one_process(system: str, config: Config, train, test, spark, df) -> dict:
    from sparknet.simulate import simulate

    threads = config.single_threads or os.cpu_count() or 1
    with torch_threads(threads):
        t0 = time.perf_counter()
        r = simulate(make_model("lenet", config.batch_size), train, test, workers=1, tau=config.eval_every,
                     solver=config.solver(), batch_size=config.batch_size, target_accuracy=config.target,
                     steps=config.steps, seed=config.seed)
        curve = [{"steps": h["steps"], "accuracy": h["accuracy"], "wall_s": h["wall_s"]} for h in r.history]
        return _entry("one-process", curve, config.target, time.perf_counter() - t0, threads=threads)


def _spark_engine(system: str, config: Config, train, test, spark, df) -> dict:
    engine, strategy = {"rounds": ("rounds", "average"), "barrier": ("barrier", "average"),
                        "sync": ("barrier", "sync")}[system]
    fit = spark_fit(config, spark, df, test, solver=config.solver(), engine=engine, strategy=strategy,
                    tau=config.eval_every, target_accuracy=config.target, steps=config.steps)
    rounds = fit.rounds
    s = fit.result.summary
    return _entry(system, fit.curve, config.target, fit.wall_s, engine=engine, strategy=strategy,
                  tau=config.eval_every, setup_s=s.get("setup_s"), rounds=s.get("rounds"),
                  samples_per_s=s.get("samples_per_s"), bytes_communicated=s.get("bytes_communicated"),
                  median_round_comm_s=_median([h.get("comm_s") for h in rounds]),
                  median_round_compute_s=_median([h.get("compute_s") for h in rounds]))


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _async(system: str, config: Config, train, test, spark, df) -> dict:
    from sparknet.net import Net
    from sparknet.ps import AsyncSession, DeltaCombiner

    t0 = time.perf_counter()
    net = Net(make_model("lenet", config.batch_size), config.solver(), batch_size=config.batch_size, seed=config.seed)
    scale = config.async_scale if config.async_scale is not None else 1.0 / config.workers
    session = AsyncSession(net, combiner=DeltaCombiner(scale=scale), seed=config.seed, threads=1, spark=spark)
    per_worker = max(1, (len(train) // config.workers) // config.batch_size)
    curve: list[dict] = []

    def on_epoch(record: dict) -> None:
        steps = (curve[-1]["steps"] if curve else 0) + int(record.get("steps_per_worker", 0))
        curve.append({"steps": steps, "accuracy": record.get("test_accuracy"), "wall_s": time.perf_counter() - t0})

    # The DataFrame, not local arrays: shipping 50,000 images from the driver would fill its JVM heap.
    metrics = session.run(data=df, batch_size=config.batch_size,
                          tau=config.async_tau, epochs=math.ceil(config.steps / per_worker),
                          num_workers=config.workers, steps=config.steps, validation_data=(test.x, test.y),
                          target_accuracy=config.target, on_epoch=on_epoch)
    return _entry("async", curve, config.target, time.perf_counter() - t0, tau=config.async_tau,
                  combiner=f"delta, scale {scale:g}",
                  eval_cadence_steps=per_worker, pushes=metrics.get("pushes"),
                  staleness_mean=metrics.get("staleness_mean"), samples_per_s=metrics.get("samples_per_s"))


def ddp_train(cfg: dict, t_call: float) -> dict:
    """The DDP training function ``TorchDistributor`` runs on every process, plain PyTorch as its user would write
    it: a gloo process group, ``DistributedDataParallel`` around LeNet, each rank on its shard of the training set,
    an evaluation of the whole test set (sharded, summed by allreduce) every ``eval_every`` steps, and a stop on
    every rank at once when the target is reached. Returns rank 0's curve (wall seconds from ``t_call``)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from sparknet.optimizers import build_optimizer

    t_start = time.time()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        t_group = time.time()
        train, test = load_data(cfg["dataset"], train_samples=cfg["train_samples"], test_samples=cfg["test_samples"])
        shard = train.shard(rank, world)
        x = torch.from_numpy(shard.x).float()
        y = torch.from_numpy(shard.y).long()
        tx = torch.from_numpy(test.x[rank::world]).float()
        ty = torch.from_numpy(test.y[rank::world]).long()
        module = make_model("lenet", cfg["batch_size"]).build(seed=cfg["seed"])
        model = DistributedDataParallel(module)
        optimizer, scheduler = build_optimizer(module, cfg["solver"])
        gen = torch.Generator().manual_seed(cfg["seed"] + 1000 * rank)
        b = cfg["batch_size"]
        perm, pos = torch.randperm(len(x), generator=gen), 0
        curve: list[dict] = []
        steps = 0
        t_first = None
        while steps < cfg["steps"]:
            model.train()
            for _ in range(min(cfg["eval_every"], cfg["steps"] - steps)):
                if pos + b > len(x):
                    perm, pos = torch.randperm(len(x), generator=gen), 0
                idx = perm[pos:pos + b]
                pos += b
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x[idx]), y[idx])
                loss.backward()
                optimizer.step()
                scheduler.step()
                steps += 1
                if t_first is None:
                    t_first = time.time()
            module.eval()
            with torch.no_grad():
                correct = sum(int((module(tx[i:i + 1000]).argmax(1) == ty[i:i + 1000]).sum())
                              for i in range(0, len(tx), 1000))
            totals = torch.tensor([correct, len(tx)], dtype=torch.float64)
            dist.all_reduce(totals)
            acc = float(totals[0] / totals[1])
            curve.append({"steps": steps, "accuracy": acc, "wall_s": time.time() - t_call})
            if acc >= cfg["target"]:
                break
        return {"rank": rank, "world": world, "curve": curve, "launch_s": t_start - t_call,
                "group_s": t_group - t_start, "first_step_s": (t_first or time.time()) - t_call}
    finally:
        dist.destroy_process_group()


def _torch_distributor(system: str, config: Config, train, test, spark, df) -> dict:
    from pyspark.ml.torch.distributor import TorchDistributor

    keys = ("dataset", "train_samples", "test_samples", "batch_size", "seed", "eval_every", "steps", "target")
    cfg = {**{k: getattr(config, k) for k in keys}, "solver": config.solver()}
    t0 = time.perf_counter()
    t_call = time.time()
    out = TorchDistributor(num_processes=config.workers, local_mode=True, use_gpu=False).run(ddp_train, cfg, t_call)
    wall = time.perf_counter() - t0
    if not out or not out.get("curve"):
        raise RuntimeError(f"TorchDistributor returned no curve: {out!r}")
    return _entry("torch-distributor", out["curve"], config.target, wall, launch_s=out["launch_s"],
                  group_s=out["group_s"], first_step_s=out["first_step_s"], processes=config.workers)


_RUNNERS = {"one-process": _one_process, "rounds": _spark_engine, "barrier": _spark_engine, "sync": _spark_engine,
            "async": _async, "torch-distributor": _torch_distributor}


def run(config: Config, out_dir: Path | None = None, *, quick: bool = False, spark=None) -> dict:
    """Time every system in ``config.systems``; returns the result body."""
    train, test = config.data()
    entries = []
    needs_spark = any(s != "one-process" for s in config.systems)
    with spark_stage(config, train, spark, needed=needs_spark) as (session, df, warmup_s):
        for system in config.systems:
            entry = measured(f"time-to-accuracy: {system}", {"system": system, "reached": False}, _RUNNERS[system],
                             system, config, train, test, session, df)
            if entry.get("ok"):
                log.info("time-to-accuracy: %s %s in %.1f s (final accuracy %.4f)", system,
                         "reached the target" if entry["reached"] else "did NOT reach the target",
                         entry["time_to_target_s"] or entry["wall_s"], entry["final_accuracy"] or float("nan"))
            entries.append(entry)
    base = next((e for e in entries if e["system"] == "one-process" and e.get("reached")), None)
    for e in entries:
        e["speedup_vs_one_process"] = (base["time_to_target_s"] / e["time_to_target_s"]
                                       if base and e.get("reached") and e.get("time_to_target_s") else None)
    summary = {e["system"]: (round(e["time_to_target_s"], 1) if e.get("reached") else
                             ("failed" if not e.get("ok") else "not reached")) for e in entries}
    return {"target": config.target, "workers": config.workers, "spark_warmup_s": warmup_s, "entries": entries,
            "summary": summary}


def plot(result: dict, path: str | Path) -> None:
    """Bars: time to the target per system (failed or not reached marked); beside them the curves."""
    plt = pyplot()
    entries = result["entries"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    names = [e["system"] for e in entries]

    def bar(e: dict) -> tuple[float, str, str]:  # height, color, label
        if e.get("reached"):
            color = "tab:blue" if e["system"] != "one-process" else "tab:gray"
            return e["time_to_target_s"], color, f"{e['time_to_target_s']:.0f} s"
        if e.get("ok"):
            return e.get("wall_s") or 0, "#cccccc", f"not reached\n({(e.get('final_accuracy') or 0):.3f})"
        return 0, "white", "failed"

    heights, colors, labels = map(list, zip(*map(bar, entries)))
    bars = ax.bar(range(len(names)), heights, color=colors, edgecolor="black", lw=0.5)
    setup = [min(e.get("setup_s") or e.get("launch_s") or 0.0, h) for e, h in zip(entries, heights)]
    if any(setup):
        ax.bar(range(len(names)), setup, color="none", edgecolor="black", hatch="//", lw=0.5,
               label="setup (data staging, process launch)")
        ax.legend(fontsize=7, loc="upper right")
    ax.set_ylim(0, max(heights + [1.0]) * 1.2)
    for bar, label in zip(bars, labels):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), label, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_ylabel("wall-clock seconds to target")
    ax.set_title(f"Time to {result['target']:.3f} test accuracy (K = {result['workers']})", fontsize=10)
    for e in entries:
        if e.get("curve"):
            ax2.plot([p["wall_s"] for p in e["curve"]], [p["accuracy"] for p in e["curve"]], label=e["system"],
                     marker="." if len(e["curve"]) < 30 else None)
    ax2.axhline(result["target"], color="gray", lw=0.8, ls="--")
    lo = min([p["accuracy"] for e in entries for p in e.get("curve") or []] + [result["target"] - 0.05])
    ax2.set(xlabel="wall-clock seconds", ylabel="test accuracy", ylim=(max(lo, result["target"] - 0.1), 1.0))
    ax2.legend(fontsize=7)
    ax2.set_title("test accuracy against wall time", fontsize=10)
    fig.savefig(path, dpi=90)
    plt.close(fig)
