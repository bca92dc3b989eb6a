"""What the barrier engine's state message costs a large net's rounds: the same fit with the global weights and the
strategy's state sent to the driver every round (the default: a restarted stage loses no round) and every 1,000
rounds (in effect, only the last).

    python benchmarks/state_every_round.py                     # 3 pairs, 16 hidden layers of 2,048 (240 MiB)
    python benchmarks/state_every_round.py --width 1024 --pairs 5
    python benchmarks/state_every_round.py --baseline-rev e755803   # that commit's every-round fits beside these

Each fit is a fresh process: K = 2 barrier workers of one process on ``local[2]``, an MLP of 6 inputs, 16 hidden
layers of ``--width`` and 3 classes, SGD with momentum, batch 8, tau 2, 8 rounds; the two settings alternate. Per
fit: the median of the rounds' ``round_s`` (the driver's wall time of a round, the exchange and the state message
included) and of their ``compute_s`` (the slowest worker's local steps), the first round left out, and the driver's
peak resident memory. On one machine the driver's reading of each state (its unpacking) shares the cores with the
ranks; a machine with cores to spare pays rank 0's packing alone. With ``--baseline-rev`` that commit, checked out in a
temporary worktree, runs its every-round fit in each pair too. Prints and saves JSON, with the load average sampled
before and during each fit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler, commit_of, save_json, source_trees  # noqa: E402

FIT = r"""
import json, resource, statistics, sys
import numpy as np
from sparknet import zoo
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.solvers import SolverConfig
from sparknet.spark import EngineOptions, SparkTrainer
from sparknet.spark.session import get_session

every, width = int(sys.argv[1]), int(sys.argv[2])
spark = get_session("local[2]")
try:
    rng = np.random.RandomState(0)
    x, y = rng.randn(256, 6).astype(np.float32), rng.randint(0, 3, 256)
    rdd = spark.sparkContext.parallelize([(x[i], int(y[i])) for i in range(256)], 2)
    result = SparkTrainer(zoo.mlp(input_shape=[6], hidden=[width] * 16, num_classes=3),
                          WorkerConfig(solver=SolverConfig(base_lr=0.01, momentum=0.9), batch_size=8, seed=5),
                          dist=DistributedConfig(workers=2, engine="barrier", tau=2, rounds=8),
                          options=EngineOptions(state_every_rounds=every)).fit(rdd)
    rounds = [h for h in result.history if h.get("event") == "round"][1:]
    print("RESULT " + json.dumps({
        "weights_mb": result.weights.nbytes / 2**20,
        "round_s": statistics.median(h["round_s"] for h in rounds),
        "compute_s": statistics.median(h["compute_s"] for h in rounds),
        "driver_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)
finally:
    spark.stop()
"""


def one_fit(every: int, width: int, timeout_s: float, src: Path = ROOT / "src") -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    with LoadSampler() as load:
        proc = subprocess.run([sys.executable, "-c", FIT, str(every), str(width)], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the fit with the state every {every} rounds failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return {"state_every_rounds": every, **json.loads(lines[-1][len("RESULT "):]), **load.to_dict()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2048, help="width of each of the 16 hidden layers")
    p.add_argument("--pairs", type=int, default=3, help="fits of each setting, alternating")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each fit may take")
    p.add_argument("--baseline-rev", default=None, help="an earlier commit whose every-round fit runs in each pair")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "state_every_round.json"))
    args = p.parse_args(argv)
    fits = []
    with tempfile.TemporaryDirectory(prefix="sparknet-bench-") as tmp, \
            source_trees(ROOT, args.baseline_rev, Path(tmp)) as trees:
        runs = [(name, src, 1) for name, src in trees.items()] + [("this tree", trees["this tree"], 1000)]
        for _ in range(args.pairs):
            for name, src, every in runs:
                fit = {"tree": name, **one_fit(every, args.width, args.timeout, src)}
                shown = ("tree", "state_every_rounds", "round_s", "compute_s", "driver_peak_rss_mb")
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in fit.items() if k in shown}),
                      flush=True)
                fits.append(fit)
    medians = {f"{name}, every {every}": {
        key: statistics.median(f[key] for f in fits if f["tree"] == name and f["state_every_rounds"] == every)
        for key in ("round_s", "driver_peak_rss_mb")} for name, _, every in runs}
    out = save_json({"benchmark": "state_every_round", "width": args.width, "cpu_count": os.cpu_count(),
                     "commit": commit_of(), "baseline_rev": args.baseline_rev,
                     "fits": fits, "medians": medians}, args.out)
    print(json.dumps({"medians": medians, "out": out.name}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
