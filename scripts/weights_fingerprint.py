"""Fingerprints of the final weights of seeded runs: the check that a refactor kept behaviour.

Run it (about two minutes on two cores)::

    python scripts/weights_fingerprint.py --out /tmp/after.json
    python scripts/weights_fingerprint.py --check scripts/weights_fingerprint.json

Every run is seeded and counts steps, not seconds, so its final weights are a function of the
code alone: the same code on the same machine gives the same SHA-256 of the final float32
weights. Another CPU (torch picks its kernels by the instructions a CPU has) or other library
versions give other sums: to compare two commits, fingerprint both on one machine::

    git worktree add /tmp/base BASE && PYTHONPATH=/tmp/base/src python /tmp/base/scripts/weights_fingerprint.py --out /tmp/base.json
    python scripts/weights_fingerprint.py --check /tmp/base.json

The report names the machine (``machine``), and ``--check`` says when the file was recorded on
another one. ``scripts/weights_fingerprint.json`` holds the current fingerprints (``runs``), those
recorded before the round loop became one loop, and why the runs that moved since moved;
``--check`` recomputes them and names every run whose weights moved.

The runs: the rounds engine (average, diloco, easgd, int8, a warm start) and the barrier
engine (average, diloco, easgd, sync, int8) in ``local[2]`` on two partitions of different
sizes, the barrier engine with the net split in two (average, diloco), K = 2 workers of G = 2 processes in
``local[4]`` (average, diloco, easgd, int8, overlapped and streamed, a sharded replica, streamed too; split in two,
diloco, its exchange streamed, its rows streamed), one worker of G = 4 processes, two copies of the net split in two
(whole or sharded), and the simulator (average, diloco, easgd, sync, int8).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time

import numpy as np
import torch


def _digest(flat: torch.Tensor) -> str:
    return hashlib.sha256(flat.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def _blobs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]], dtype=np.float32)
    x = (centers[y] + rng.normal(0, 0.6, (n, 2))).astype(np.float32)
    return x, y.astype(np.int64)


def _net():
    from sparknet import zoo

    return zoo.mlp(input_shape=(2,), hidden=(16,), num_classes=3, batch_size=8)


def _solver():
    from sparknet.solvers import SolverConfig

    return SolverConfig(base_lr=0.05, momentum=0.9, weight_decay=1e-4)


@contextlib.contextmanager
def _last_evaluated():
    """Record the weights of every Net evaluation in the block; ``["flat"]`` is the last (the final weights)."""
    from sparknet.net import Net

    seen: dict = {}
    original = Net.evaluate

    def evaluate(self, *args, **kwargs):
        seen["flat"] = self.get_flat().clone()
        return original(self, *args, **kwargs)

    Net.evaluate = evaluate
    try:
        yield seen
    finally:
        Net.evaluate = original


def simulator_runs() -> dict[str, str]:
    from sparknet.datasets import ArrayDataset
    from sparknet.simulate import simulate

    x, y = _blobs(400, 1)
    vx, vy = _blobs(200, 2)
    train, test = ArrayDataset(x, y), ArrayDataset(vx, vy)
    out = {}
    for strategy, compression in (("average", "none"), ("diloco", "none"), ("easgd", "none"), ("sync", "none"),
                                  ("average", "int8")):
        with _last_evaluated() as last:
            simulate(_net(), train, test, workers=3, tau=5, strategy=strategy, solver=_solver(), batch_size=8,
                     steps=40, compression=compression, seed=3)
        out[f"simulate/{strategy}/{compression}"] = _digest(last["flat"])
    return out


def spark_runs(spark) -> dict[str, str]:
    from sparknet.config import DistributedConfig, WorkerConfig
    from sparknet.spark import SparkTrainer

    x, y = _blobs(210, 11)
    val = _blobs(120, 12)
    sc = spark.sparkContext
    parts = [(x[:120], y[:120]), (x[120:], y[120:])]  # 120 and 90 rows: the weighting matters
    rows = [[(px[i], int(py[i])) for i in range(len(py))] for px, py in parts]
    rdd = sc.parallelize(rows, 2).flatMap(lambda r: r).cache()
    cases = [
        ("rounds", "average", {}), ("rounds", "diloco", {}), ("rounds", "easgd", {}),
        ("rounds", "average", {"compression": "int8"}), ("rounds", "average", {"warmup_steps": 7}),
        ("barrier", "average", {}), ("barrier", "diloco", {}), ("barrier", "easgd", {}), ("barrier", "sync", {}),
        ("barrier", "average", {"compression": "int8"}),
    ]
    out = {}
    for engine, strategy, extra in cases:
        dist = DistributedConfig(workers=2, engine=engine, strategy=strategy, tau=6, rounds=4, **extra)
        trainer = SparkTrainer(_net(), WorkerConfig(solver=_solver(), batch_size=8, seed=5), dist=dist, spark=spark)
        result = trainer.fit(rdd, validation=val)
        tag = "+".join(f"{k}={v}" for k, v in sorted(extra.items())) or "plain"
        out[f"{engine}/{strategy}/{tag}"] = _digest(result.weights.to_flat())
    return out


def model_parallel_runs(spark) -> dict[str, str]:
    from sparknet.config import DistributedConfig, WorkerConfig
    from sparknet.spark import SparkTrainer

    x, y = _blobs(200, 21)
    val = _blobs(100, 22)
    df = spark.createDataFrame([(x[i].tolist(), int(y[i])) for i in range(len(y))], ["features", "label"])
    out = {}
    for strategy in ("average", "diloco"):  # the net split in two across the stage's two tasks
        dist = DistributedConfig(workers=2, engine="barrier", model_parallel=2, strategy=strategy, tau=5, rounds=3)
        res = SparkTrainer(_net(), WorkerConfig(solver=_solver(), batch_size=8, seed=7), dist, spark=spark).fit(
            df, validation=val)
        out[f"model_parallel/{strategy}/m=2"] = _digest(res.weights.to_flat())
    return out


def procs_per_worker_runs(spark) -> dict[str, str]:
    """K = 2 workers of G = 2 processes (a local[4] session): the replica whole on each worker's ranks, sharded, or
    split (--model-parallel 2); and one worker of G = 4, two copies of the net split in two, whole or sharded."""
    from sparknet.config import DistributedConfig, WorkerConfig
    from sparknet.spark import SparkTrainer

    x, y = _blobs(240, 31)
    val = _blobs(100, 32)
    rdd = spark.sparkContext.parallelize([(x[i], int(y[i])) for i in range(len(y))], 4).cache()
    cases = [("average", {}), ("diloco", {}), ("easgd", {}), ("average", {"compression": "int8"}),
             ("diloco", {"overlap": True, "fragments": 3}), ("diloco", {"shard_replica": True}),
             ("diloco", {"shard_replica": True, "fragments": 2})]
    out = {}
    for strategy, extra in cases:
        dist = DistributedConfig(workers=2, procs_per_worker=2, engine="barrier", strategy=strategy, tau=5, rounds=4,
                                 **extra)
        res = SparkTrainer(_net(), WorkerConfig(solver=_solver(), batch_size=8, seed=9), dist, spark=spark).fit(
            rdd, validation=val)
        tag = "+".join(f"{k}={v}" for k, v in sorted(extra.items())) or "plain"
        out[f"procs_per_worker/{strategy}/g=2+{tag}"] = _digest(res.weights.to_flat())
    for strategy, extra in [("diloco", {}), ("average", {"fragments": 2}),  # K = 2 workers of M = 2, layers split
                            ("diloco", {"data_mode": "stream"})]:
        dist = DistributedConfig(workers=4, model_parallel=2, engine="barrier", strategy=strategy, tau=5, rounds=4,
                                 **extra)
        res = SparkTrainer(_net(), WorkerConfig(solver=_solver(), batch_size=8, seed=9), dist, spark=spark).fit(
            rdd, validation=val)
        tag = "+".join(f"{k}={v}" for k, v in sorted(extra.items())) or "plain"
        out[f"model_parallel/{strategy}/k=2+m=2+{tag}"] = _digest(res.weights.to_flat())
    for extra in ({}, {"shard_replica": True}):  # one worker of G = 4: two copies split in two, whole or sharded
        dist = DistributedConfig(workers=1, procs_per_worker=4, model_parallel=2, engine="barrier", strategy="diloco",
                                 tau=5, rounds=4, **extra)
        res = SparkTrainer(_net(), WorkerConfig(solver=_solver(), batch_size=8, seed=9), dist, spark=spark).fit(
            rdd, validation=val)
        tag = "+".join(f"{k}={v}" for k, v in sorted(extra.items())) or "plain"
        out[f"model_parallel/diloco/k=1+g=4+m=2+{tag}"] = _digest(res.weights.to_flat())
    return out


def _session(master: str):
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(master).appName("sparknet-fingerprint")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.python.worker.reuse", "true").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def machine() -> dict:
    """What the fingerprints depend on besides the code: the CPU, its kernels and the libraries."""
    import platform

    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {"cpu": model, "arch": platform.machine(), "torch": torch.__version__, "numpy": np.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the fingerprints here (JSON)")
    parser.add_argument("--check", help="compare with the fingerprints in this JSON file")
    parser.add_argument("--only", choices=["simulate", "spark"], help="run one group only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    found: dict[str, str] = {}
    if args.only in (None, "simulate"):
        found.update(simulator_runs())
    if args.only in (None, "spark"):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        spark = _session("local[2]")
        try:
            found.update(spark_runs(spark))
            found.update(model_parallel_runs(spark))
        finally:
            spark.stop()
        spark = _session("local[4]")  # K x G = 2 x 2 barrier tasks at once
        try:
            found.update(procs_per_worker_runs(spark))
        finally:
            spark.stop()
    report = {"machine": machine(), "wall_s": round(time.perf_counter() - t0, 1), "runs": found}
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    if args.check:
        with open(args.check) as f:
            recorded = json.load(f)
        expected = recorded["runs"]
        if recorded.get("machine") != report["machine"]:
            print(f"NOTE    {args.check} was recorded on another machine or with other libraries "
                  f"({recorded.get('machine') or 'not named'}; this one: {report['machine']}): its sums need not "
                  "match; fingerprint the base on this machine with --out and check against that", file=sys.stderr)
        moved = sorted(k for k in found if k in expected and expected[k] != found[k])
        missing = sorted(k for k in expected if k not in found and (args.only is None or k.startswith(
            "simulate" if args.only == "simulate" else ("rounds", "barrier", "model_parallel", "procs_per_worker"))))
        for k in moved:
            print(f"MOVED   {k}", file=sys.stderr)
        for k in missing:
            print(f"MISSING {k}", file=sys.stderr)
        same = sum(1 for k in found if expected.get(k) == found[k])
        print(f"{same} of {len(found)} runs bit-identical to {args.check}", file=sys.stderr)
        return 1 if moved or missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
