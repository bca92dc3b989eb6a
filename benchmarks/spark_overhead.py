"""Per-round overhead of the two Spark engines for LeNet-sized weights (1.7 MB).

    python benchmarks/spark_overhead.py                  # local[2], 25 rounds per engine, 5 warm-up
    python benchmarks/spark_overhead.py --master local-cluster[2,1,1024] --rounds 40
    python benchmarks/spark_overhead.py --engines rounds --transport spark   # weights by broadcast, updates in results
    sudo python scripts/netns_cluster.py --workers 2 -- \
        python benchmarks/spark_overhead.py --master '$SPARKNET_MASTER' --engines rounds   # two worker hosts

Overhead of a round = its wall time minus the longest worker's local training time
(``round_s - compute_s`` in the round records): for the rounds engine that is the Spark job
(task launch and results, the weights and deltas through the driver's relay socket, or through a
broadcast and the task results with ``--transport spark``; the strategy step on the driver); for the barrier engine the allreduce, the strategy step and the record sent to
the driver. Each engine trains LeNet (Listing 2) with K=2 workers, one thread each, tau=2,
batch 64, on MNIST-shaped synthetic data; the first rounds warm the workers up and are left
out, the median of the rest is reported. An empty Spark job is timed as well (before, and
between the rounds under the same load): the floor under the rounds engine. Prints and saves
JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler  # noqa: E402


def _session(master: str):
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from sparknet.spark import get_session

    return get_session(master, conf={"spark.ui.enabled": "false", "spark.executor.memory": "768m",
                                     "spark.sql.shuffle.partitions": "2"}, log_level="ERROR")


def _data(spark, rows: int):
    import numpy as np

    rng = np.random.default_rng(0)
    half = rows // 2
    parts = [[(rng.random((1, 28, 28), dtype=np.float32), int(rng.integers(0, 10))) for _ in range(half)]
             for _ in range(2)]
    return spark.sparkContext.parallelize(parts, 2).flatMap(lambda p: p).cache()


def engine_overhead(spark, data, engine: str, rounds: int, warmup: int, tau: int, transport: str = "socket") -> dict:
    from sparknet import DistributedConfig, SolverConfig, WorkerConfig, zoo
    from sparknet.spark import EngineOptions, SparkTrainer

    records, floors = [], []
    probe = spark.sparkContext.parallelize(range(2), 2).cache()
    probe.count()

    def on_round(record):
        records.append(record)
        if engine == "rounds":  # an empty job between two rounds: Spark's own floor, under the same load
            t = time.perf_counter()
            probe.map(lambda v: v).collect()
            floors.append(time.perf_counter() - t)

    trainer = SparkTrainer(zoo.lenet(), WorkerConfig(solver=SolverConfig(base_lr=0.01), batch_size=64, threads=1),
                           DistributedConfig(workers=2, engine=engine, tau=tau, rounds=rounds + warmup),
                           spark=spark, on_round=on_round, options=EngineOptions(rounds_transport=transport))
    result = trainer.fit(data)
    kept = records[warmup:]
    overhead = [r["round_s"] - r["compute_s"] for r in kept]
    out = {
        "engine": engine, "rounds_measured": len(kept), "tau": tau,
        "rounds_transport": result.summary.get("rounds_transport"),
        "weights_bytes": result.weights.nbytes,
        "overhead_s_median": statistics.median(overhead),
        "overhead_s_p10": sorted(overhead)[len(overhead) // 10],
        "overhead_s_p90": sorted(overhead)[(9 * len(overhead)) // 10],
        "round_s_median": statistics.median(r["round_s"] for r in kept),
        "compute_s_median": statistics.median(r["compute_s"] for r in kept),
        "setup_s": result.summary["setup_s"],
    }
    if engine == "barrier":
        out["allreduce_s_median"] = statistics.median(r["allreduce_s"] for r in kept)
    else:
        out["task_s_median"] = statistics.median(max(w.get("task_s", 0.0) for w in r["per_worker"]) for r in kept)
        out["in_task_extra_s_median"] = statistics.median(
            max(w.get("task_s", 0.0) - w["compute_s"] for w in r["per_worker"]) for r in kept)
        out["empty_job_between_rounds_s_median"] = statistics.median(floors[warmup:])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--rounds", type=int, default=25, help="rounds measured per engine")
    ap.add_argument("--warmup", type=int, default=5, help="rounds left out at the start")
    ap.add_argument("--tau", type=int, default=2)
    ap.add_argument("--rows", type=int, default=2048, help="training rows (two partitions)")
    ap.add_argument("--engines", default="rounds,barrier")
    ap.add_argument("--transport", default="socket", choices=["socket", "spark"],
                    help="how the rounds engine moves weights and updates (EngineOptions.rounds_transport)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "spark_overhead.json"))
    args = ap.parse_args(argv)

    load = LoadSampler(every_s=2.0).start()
    spark = _session(args.master)
    try:
        data = _data(spark, args.rows)
        from sparknet.spark.backend import empty_job_s

        results = {
            "benchmark": "spark_overhead", "master": spark.sparkContext.master, "spark": spark.version,
            "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "empty_job_s_median": empty_job_s(spark, repeats=15, warmup=5),
            "engines": {},
        }
        for engine in args.engines.split(","):
            results["engines"][engine] = engine_overhead(spark, data, engine, args.rounds, args.warmup, args.tau,
                                                          args.transport)
    finally:
        spark.stop()
        load.stop()
    results.update(load.to_dict())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"load average {results['load_average_before'][0]:.1f} before, {results['load_average_during']} during, "
          f"on {results['cpus']} cores; "
          f"empty Spark job: {results['empty_job_s_median'] * 1000:.1f} ms (median)")
    for name, r in results["engines"].items():
        print(f"{name:8s} overhead per round: {r['overhead_s_median'] * 1000:8.1f} ms median "
              f"(p10 {r['overhead_s_p10'] * 1000:.1f}, p90 {r['overhead_s_p90'] * 1000:.1f}; "
              f"round {r['round_s_median'] * 1000:.1f} ms, compute {r['compute_s_median'] * 1000:.1f} ms)")
        if "empty_job_between_rounds_s_median" in r:
            print(f"{'':8s} an empty Spark job between the rounds took "
                  f"{r['empty_job_between_rounds_s_median'] * 1000:.1f} ms; work inside the tasks beyond "
                  f"training {r['in_task_extra_s_median'] * 1000:.1f} ms")
    print(f"saved {out}")
    return results


if __name__ == "__main__":
    main()
