"""LeNet training steps with glibc's default malloc thresholds against sparknet's (``sparknet._malloc``).

    python benchmarks/malloc_steps.py                  # 300 steps, batch 64, one thread, 3 pairs of runs

Each run is a fresh Python process that trains LeNet on MNIST-shaped data for ``--steps`` steps on one
thread, after 5 warm-up steps, and reports the minor page faults, the system and user CPU seconds and
samples/s of those steps; ``tuned`` calls :func:`sparknet._malloc.keep_freed_memory` first (what
sparknet's executors, daemon and command line do), ``plain`` does not (a bare PyTorch process).
The two kinds alternate. Prints and saves JSON with the load average sampled before and during.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler, save_json  # noqa: E402

_RUN = """
import json, resource, sys, time
import numpy as np, torch
torch.set_num_threads(1)
from sparknet import SolverConfig, zoo
from sparknet._malloc import keep_freed_memory
from sparknet.net import Net
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
rng = np.random.default_rng(0)
net = Net(zoo.lenet(), SolverConfig(base_lr=0.01, momentum=0.9), batch_size=64)
net.set_training_data((rng.random((4096, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, 4096)))
net.train(5)
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
net.train(int(sys.argv[2]))
r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
print(json.dumps({"faults": r1.ru_minflt - r0.ru_minflt, "sys_s": r1.ru_stime - r0.ru_stime,
                  "user_s": r1.ru_utime - r0.ru_utime, "samples_per_s": 64 * int(sys.argv[2]) / (t1 - t0)}))
"""


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "malloc_steps.json"))
    args = p.parse_args(argv)
    runs: dict[str, list[dict]] = {"plain": [], "tuned": []}
    with LoadSampler() as load:
        for _ in range(args.pairs):
            for mode in runs:
                out = subprocess.run([sys.executable, "-c", _RUN, mode, str(args.steps)], capture_output=True,
                                     text=True, timeout=900, check=True)
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(mode, runs[mode][-1], flush=True)
    result = {"benchmark": "malloc_steps", "steps": args.steps, "runs": runs,
              "median": {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()},
              **load.to_dict()}
    result["tuned_vs_plain_samples_per_s"] = (result["median"]["tuned"]["samples_per_s"]
                                              / result["median"]["plain"]["samples_per_s"])
    print(json.dumps(result["median"]), f"tuned/plain samples/s {result['tuned_vs_plain_samples_per_s']:.3f}")
    save_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
