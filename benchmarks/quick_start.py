"""The README's quick start, timed as its user waits for it, against two bare one-thread processes.

    python benchmarks/quick_start.py                 # 10,000 steps per worker, against the bare pair
    python benchmarks/quick_start.py --steps 2000    # shorter (the ratio is then over a shorter run)
    python benchmarks/quick_start.py --to-target     # the README's command: to 99% test accuracy, twice

With ``--to-target`` it runs the README's first command's training (``--lr 0.05 --target-accuracy
0.99``) ``--repeat`` times, each timed from the command's start to its end, with its test accuracy,
rounds and the load average; no bare pair (a run that stops at a target has no fixed work to compare).

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
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "quick_start.json"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler, last_summary, timed_command  # noqa: E402
from parallel_efficiency import bare_pair  # noqa: E402

QUICK_START = ["sparknet", "train", "--model", "lenet", "--dataset", "mnist", "--workers", "2"]
TO_TARGET = [*QUICK_START, "--lr", "0.05", "--target-accuracy", "0.99"]
"""The README's quick start command (its training part)."""


def to_target(args) -> int:
    runs = []
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="sparknet-bench-") as tmp:
            metrics = Path(tmp) / "run.jsonl"
            run = timed_command([*TO_TARGET, "--quiet", "--metrics-out", str(metrics)], cwd=ROOT,
                                timeout_s=args.timeout)
            summary = last_summary(metrics)
        run.pop("stdout_tail", None)
        run["summary"] = {k: summary.get(k) for k in ("test_accuracy", "steps", "rounds", "wall_s", "setup_s",
                                                       "samples_per_s", "stop_reason")}
        print(f"run {i + 1}", json.dumps(run), flush=True)
        runs.append(run)
    report = {"benchmark": "quick_start_to_target", "command": " ".join(TO_TARGET), "cpu_count": os.cpu_count(),
              "runs": runs, "command_wall_s": [r["command_wall_s"] for r in runs],
              "test_accuracy": [r["summary"]["test_accuracy"] for r in runs]}
    print(json.dumps({k: report[k] for k in ("command_wall_s", "test_accuracy")}))
    out = Path(args.out if args.out != DEFAULT_OUT else DEFAULT_OUT.with_name("quick_start_to_99.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="steps per worker (default: the quick start's 10,000)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--to-target", action="store_true", help="the README's command, to 99%% test accuracy")
    p.add_argument("--repeat", type=int, default=2, help="runs of --to-target")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.to_target:
        return to_target(args)
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
