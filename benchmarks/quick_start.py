"""The README's quick start, timed as its user waits for it, against two bare one-thread processes.

    python benchmarks/quick_start.py                 # the quick start as it is: 10,000 steps per worker
    python benchmarks/quick_start.py --steps 2000    # shorter (the ratio is then over a shorter run)

Two runs in one script, nothing else on the machine:

- ``bare``: two plain PyTorch processes at once, one thread each, LeNet on MNIST with batch 64,
  ``--steps`` steps each: the machine's limit for two workers (their own start is left out);
- ``quick start``: ``sparknet train --model lenet --dataset mnist --workers 2`` (with ``--steps``
  when given), timed from the command's start to its end: the interpreter, the Spark session and
  its JVMs, MNIST, staging, every round and evaluation.

End-to-end samples/s is the samples the command trained divided by its wall time; the
in-round figure (``samples_per_s`` of its summary) is reported beside it. The load average is
sampled before and every 5 s during each run. Prints and saves JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler, last_summary, timed_command  # noqa: E402
from parallel_efficiency import bare_pair  # noqa: E402

QUICK_START = ["sparknet", "train", "--model", "lenet", "--dataset", "mnist", "--workers", "2"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="steps per worker (default: the quick start's 10,000)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quick_start.json"))
    args = p.parse_args(argv)
    steps = args.steps or 10_000
    os.environ["SPARKNET_BENCH_DIR"] = str(Path(__file__).resolve().parent)
    with LoadSampler() as load:
        bare = bare_pair(steps, 64, 50_000, True)
    bare.update(load.to_dict())
    print("bare", json.dumps(bare), flush=True)
    cmd = [*QUICK_START, *(["--steps", str(args.steps)] if args.steps else []), "--quiet"]
    with tempfile.TemporaryDirectory(prefix="sparknet-bench-") as tmp:
        metrics = Path(tmp) / "run.jsonl"
        run = timed_command([*cmd, "--metrics-out", str(metrics)], cwd=ROOT, timeout_s=args.timeout)
        summary = last_summary(metrics)
    run.pop("stdout_tail", None)
    samples = summary["samples"]
    run.update({"samples": samples, "end_to_end_samples_per_s": samples / run["command_wall_s"],
                "summary": {k: summary.get(k) for k in ("test_accuracy", "steps", "rounds", "wall_s", "train_s",
                                                         "setup_s", "samples_per_s", "stop_reason")}})
    print("quick start", json.dumps(run), flush=True)
    report = {"benchmark": "quick_start", "steps_per_worker": steps, "cpu_count": os.cpu_count(), "bare": bare,
              "quick_start": run,
              "end_to_end_vs_bare": run["end_to_end_samples_per_s"] / bare["samples_per_s"],
              "in_round_vs_bare": (summary.get("samples_per_s") or 0.0) / bare["samples_per_s"]}
    print(json.dumps({k: report[k] for k in ("end_to_end_vs_bare", "in_round_vs_bare")}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
