"""Evaluation off the critical path: the rounds engine with and without ``--eval-overlap``, from the command's start.

    python benchmarks/eval_overlap.py                       # LeNet, 2 workers, 1,000 steps, every round scored
    python benchmarks/eval_overlap.py --workers 1 --master 'local[2]'   # a core left for the driver

Runs ``sparknet train --model lenet --dataset mnist`` on Spark with the whole test set scored after every
round (``--eval-screen-rows 0 --eval-budget 1``: the most evaluation a run can have), first as it is, then with
``--eval-overlap``, alternating ``--repeat`` times, each timed from the command's start to its end. Reports each
run's wall time, the time inside its rounds (the sum of ``round_s``), the time its evaluations took
(``eval_s``, which with overlap runs in a driver thread beside the next round) and the load average sampled
before and during. Where the driver has a core to itself (a cluster's driver machine, or ``--workers 1`` on
``local[2]``) overlap hides the evaluations; where every core trains, the thread takes its CPU from the
workers. Prints and saves JSON.
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

from _bench import save_json, timed_command  # noqa: E402


def one_run(args, overlap: bool) -> dict:
    cmd = ["sparknet", "train", "--model", "lenet", "--dataset", "mnist", "--workers", str(args.workers),
           "--steps", str(args.steps), "--lr", "0.05", "--eval-screen-rows", "0", "--eval-budget", "1", "--quiet",
           *(["--master", args.master] if args.master else []), *(["--eval-overlap"] if overlap else [])]
    with tempfile.TemporaryDirectory(prefix="sparknet-bench-") as tmp:
        metrics = Path(tmp) / "run.jsonl"
        run = timed_command([*cmd, "--metrics-out", str(metrics)], cwd=ROOT, timeout_s=args.timeout)
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rounds = [r for r in records if r.get("event") == "round"]
    summary = next(r for r in reversed(records) if r.get("event") == "summary")
    run.pop("stdout_tail", None)
    run.update(overlap=overlap, rounds=len(rounds), rounds_s=round(sum(r["round_s"] for r in rounds), 2),
               eval_s=round(sum(r.get("eval_s", 0.0) for r in rounds), 2),
               test_accuracy=summary.get("test_accuracy"), fit_wall_s=round(summary["wall_s"], 2))
    print(json.dumps(run), flush=True)
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--master", default=None, help="Spark master (default local[workers])")
    p.add_argument("--steps", type=int, default=1000, help="steps per worker")
    p.add_argument("--repeat", type=int, default=2, help="pairs of runs (plain, overlapped), alternating")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "eval_overlap.json"))
    args = p.parse_args(argv)
    runs = [one_run(args, overlap) for _ in range(args.repeat) for overlap in (False, True)]
    by = {o: [r for r in runs if r["overlap"] is o] for o in (False, True)}
    report = {"benchmark": "eval_overlap", "workers": args.workers, "master": args.master or f"local[{args.workers}]",
              "steps": args.steps, "cpu_count": os.cpu_count(), "runs": runs,
              "command_wall_s": {"plain": [r["command_wall_s"] for r in by[False]],
                                 "overlap": [r["command_wall_s"] for r in by[True]]}}
    print(json.dumps(report["command_wall_s"]))
    save_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
