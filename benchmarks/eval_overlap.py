"""Where the rounds engine evaluates: on the driver, behind the next round (``--eval-overlap``) or on the executors
(``--eval-sharded``), from the command's start.

    python benchmarks/eval_overlap.py                       # LeNet, 2 workers, 1,000 steps, every round scored
    python benchmarks/eval_overlap.py --workers 1 --master 'local[2]'   # a core left for the driver
    python benchmarks/eval_overlap.py --modes plain,sharded  # two of the three

Runs ``sparknet train --model lenet --dataset mnist`` on Spark with the whole test set scored after every
round (``--eval-screen-rows 0 --eval-budget 1``: the most evaluation a run can have) in each of ``--modes``:
``plain`` (the driver scores each round's weights between rounds), ``overlap`` (in a driver thread beside the next
round) and ``sharded`` (the test rows kept in Spark, each evaluation a Spark job on the executors' task slots), the
modes alternating ``--repeat`` times, each timed from the command's start to its end. Reports each run's wall time,
the time inside its rounds (the sum of ``round_s``), the time its evaluations took (``eval_s``), when its first round
began and the load average sampled before and during. Where the driver has a core to itself (a cluster's driver
machine, or ``--workers 1`` on ``local[2]``) overlap hides the evaluations; where every core trains, the thread takes
its CPU from the workers. Prints and saves JSON.
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

from _bench import commit_of, save_json, timed_command  # noqa: E402


MODES = {"plain": [], "overlap": ["--eval-overlap"], "sharded": ["--eval-sharded"]}


def one_run(args, mode: str) -> dict:
    cmd = ["sparknet", "train", "--model", "lenet", "--dataset", "mnist", "--workers", str(args.workers),
           "--steps", str(args.steps), "--lr", "0.05", "--eval-screen-rows", "0", "--eval-budget", "1", "--quiet",
           *(["--master", args.master] if args.master else []), *MODES[mode]]
    with tempfile.TemporaryDirectory(prefix="sparknet-bench-") as tmp:
        metrics = Path(tmp) / "run.jsonl"
        run = timed_command([*cmd, "--metrics-out", str(metrics)], cwd=ROOT, timeout_s=args.timeout)
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rounds = [r for r in records if r.get("event") == "round"]
    summary = next(r for r in reversed(records) if r.get("event") == "summary")
    run.pop("stdout_tail", None)
    run.update(mode=mode, rounds=len(rounds), first_round_s=summary.get("first_round_s"),
               rounds_s=round(sum(r["round_s"] for r in rounds), 2),
               eval_s=round(sum(r.get("eval_s", 0.0) for r in rounds), 2),
               test_accuracy=summary.get("test_accuracy"), fit_wall_s=round(summary["wall_s"], 2))
    print(json.dumps(run), flush=True)
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--master", default=None, help="Spark master (default local[workers])")
    p.add_argument("--steps", type=int, default=1000, help="steps per worker")
    p.add_argument("--modes", default="plain,overlap", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--repeat", type=int, default=2, help="runs of each mode, the modes alternating")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "eval_overlap.json"))
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; choose of {', '.join(MODES)}")
    runs = [one_run(args, mode) for _ in range(args.repeat) for mode in modes]
    report = {"benchmark": "eval_overlap", "workers": args.workers, "master": args.master or f"local[{args.workers}]",
              "steps": args.steps, "cpu_count": os.cpu_count(), "commit": commit_of(), "runs": runs,
              "command_wall_s": {m: [r["command_wall_s"] for r in runs if r["mode"] == m] for m in modes}}
    print(json.dumps(report["command_wall_s"]))
    save_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
