"""Streamed partitions against in-memory ones, and a fit on data several times the executors' memory.

    python benchmarks/streamed.py ratio                        # MNIST, local[2]: streamed / in-memory throughput
    python benchmarks/streamed.py ratio --split --stream-buffer-mb 16   # the same, one worker of LeNet split in two
    python benchmarks/streamed.py big --data DIR --executor-memory 480   # Parquet digits on local-cluster

``ratio``: LeNet on MNIST's 50,000 training images, two workers of the rounds engine on ``local[2]``,
the same fit with ``data_mode="memory"`` and ``data_mode="stream"`` (a 64 MiB window), alternated
``--repeats`` times. The figure compared is the in-round throughput (samples trained per second of
the rounds' wall time, the summary's ``samples_per_s``); each fit's wall time from the start of
``fit`` (conversion, staging and evaluation included) is reported beside it. With ``--split``: one barrier-engine
worker of two processes, LeNet's layers split between them (``--model-parallel 2``), batch 64 a step; held in
memory, each process holds both partitions' rows, streamed, each reads its own and takes 32 rows of every batch from
it, the two shares joined by an all-gather a step. Each process's peak resident memory over its task's start is
reported beside the throughput.

``big``: LeNet on a Parquet folder of 28x28 digits (e.g. ``sparknet data extended-mnist``) on
``local-cluster[2,1,MEM]`` (two executors of ``--executor-memory`` MiB each): the fit chooses its
data mode itself (``auto``), trains ``--rounds`` rounds (or to ``--target`` validation accuracy),
evaluating on MNIST's validation images each round, and the report gives the first round at
``--reach`` accuracy, the staged bytes against the executors' memory and each Python worker's peak
resident memory. The wall time is from the session's start (JVMs included) to the fit's end.

The load average is sampled before and every few seconds during each run. Time nothing else while
it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler  # noqa: E402

KEYS = ("data_mode", "data_mode_reason", "test_accuracy", "samples_per_s", "train_s", "wall_s", "total_steps",
        "rounds", "stop_reason", "data_rows", "rows_per_partition")


def _session(master: str, conf: dict | None = None):
    from sparknet.spark.session import get_session

    return get_session(master, app_name="sparknet-bench-streamed", conf={"spark.ui.enabled": "false", **(conf or {})})


def _trainer(spark, *, mode: str, rounds: int, tau: int, target: float | None = None, buffer_mb: int = 64,
             split: bool = False):
    from sparknet.config import DistributedConfig, WorkerConfig
    from sparknet.solvers import LRPolicy, SolverConfig
    from sparknet.spark import SparkTrainer
    from sparknet.zoo import lenet

    solver = SolverConfig(base_lr=0.05, momentum=0.9, weight_decay=5e-4, lr_policy=LRPolicy.INV, gamma=1e-4,
                          power=0.75)
    return SparkTrainer(lenet(), WorkerConfig(solver=solver, batch_size=64, seed=0, threads=1),
                        DistributedConfig(workers=2, tau=tau, rounds=rounds, target_accuracy=target, data_mode=mode,
                                          stream_buffer_mb=buffer_mb,
                                          **(dict(engine="barrier", model_parallel=2) if split else {})),
                        spark=spark)


def ratio(args) -> dict:
    from sparknet.datasets import mnist
    from sparknet.spark.run import dataset_frame

    data = mnist()
    # a split fit's ranks each start in a Python worker of their own, so that their memory is theirs alone
    spark = _session("local[2]", {"spark.python.worker.reuse": "false"} if args.split else None)
    df = dataset_frame(spark, "mnist", data.train)
    val = (data.validation.x, data.validation.y)
    runs = {"memory": [], "stream": []}
    try:
        kind = dict(split=args.split, buffer_mb=args.stream_buffer_mb)
        _trainer(spark, mode="memory", rounds=2, tau=20, **kind).fit(df, validation=val)  # JIT, JVM, cache warm-up
        for _ in range(args.repeats):
            for mode in ("memory", "stream"):
                with LoadSampler() as load:
                    t0 = time.perf_counter()
                    result = _trainer(spark, mode=mode, rounds=args.rounds, tau=args.tau, **kind).fit(
                        df, validation=val)
                    wall = time.perf_counter() - t0
                s = result.summary
                grown = [round(w["peak_rss_mb"] - w["rss_start_mb"], 1) for w in s.get("barrier_workers") or ()
                         if w.get("peak_rss_mb") is not None and w.get("rss_start_mb") is not None]
                run = {**{k: s.get(k) for k in KEYS}, "fit_wall_s": round(wall, 2),
                       **({"rank_peak_rss_growth_mb": grown} if grown else {}), **load.to_dict()}
                runs[mode].append(run)
                print(json.dumps({"mode": mode, **run}), flush=True)
    finally:
        spark.stop()
    med = {m: statistics.median(r["samples_per_s"] for r in rs) for m, rs in runs.items()}
    return {"part": "ratio", "runs": runs, "median_samples_per_s": med,
            "stream_over_memory": round(med["stream"] / med["memory"], 3),
            "settings": {"master": "local[2]", "workers": 2, "tau": args.tau, "rounds": args.rounds,
                         "batch_size": 64, "stream_buffer_mb": args.stream_buffer_mb, "repeats": args.repeats,
                         "split": args.split}}


def big(args) -> dict:
    from sparknet.datasets import mnist

    t0 = time.perf_counter()
    master = f"local-cluster[2,1,{args.executor_memory}]"
    with LoadSampler() as load:
        spark = _session(master, {"spark.executor.memory": f"{args.executor_memory}m",
                                  "spark.python.worker.reuse": "true"})
        try:
            df = spark.read.parquet(args.data)
            val = mnist().validation
            trainer = _trainer(spark, mode="auto", rounds=args.rounds, tau=args.tau, target=args.target)
            result = trainer.fit(df, validation=(val.x, val.y), image_shape=(1, 28, 28))
        finally:
            spark.stop()
        wall = time.perf_counter() - t0
    s = result.summary
    rounds = [r for r in result.history if r.get("event") == "round"]
    rss = [w.get("peak_rss_mb") for r in rounds for w in r.get("per_worker", ())]
    staged = s["data_rows"] * (28 * 28 * 4 + 8)
    reached = next((r for r in rounds if (r.get("val_accuracy") or 0) >= args.reach), None)
    return {"part": "big", "master": master, "executor_memory_mib": args.executor_memory,
            "staged_bytes": staged, "staged_over_executors_memory": round(staged / (2 * args.executor_memory << 20), 2),
            "parquet_bytes": sum(p.stat().st_size for p in Path(args.data).rglob("*.parquet")),
            f"first_round_at_{args.reach}": None if reached is None else
            {k: reached.get(k) for k in ("round", "total_steps", "val_accuracy", "wall_s")},
            "worker_peak_rss_mb": max(v for v in rss if v is not None) if any(rss) else None,
            "summary": {k: s.get(k) for k in KEYS}, "session_to_end_s": round(wall, 1), **load.to_dict(),
            "settings": {"workers": 2, "tau": args.tau, "rounds": args.rounds, "target": args.target,
                         "batch_size": 64}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=("ratio", "big"))
    p.add_argument("--data", help="big: a Parquet folder of 28x28 digits (features binary, label)")
    p.add_argument("--executor-memory", type=int, default=512, help="big: MiB of each of the two executors")
    p.add_argument("--target", type=float, default=None, help="big: validation accuracy to stop at (default: none)")
    p.add_argument("--reach", type=float, default=0.99, help="big: report the first round at this accuracy")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--tau", type=int, default=None)
    p.add_argument("--repeats", type=int, default=2, help="ratio: fits of each mode, alternated")
    p.add_argument("--split", action="store_true", help="ratio: one worker of two processes, LeNet split in two")
    p.add_argument("--stream-buffer-mb", type=int, default=64, help="ratio: each stream's window")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.part == "ratio":
        args.rounds, args.tau = args.rounds or 8, args.tau or 100
        report = ratio(args)
    else:
        if not args.data:
            p.error("big needs --data")
        args.rounds, args.tau = args.rounds or 32, args.tau or 250
        report = big(args)
    report.update(benchmark="streamed", cpu_count=os.cpu_count())
    name = f"streamed_{args.part}{'_split' if args.split else ''}.json"
    out = Path(args.out or ROOT / "benchmarks" / "results" / name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
