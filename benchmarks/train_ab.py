"""One ``sparknet train`` command on two source trees, alternated: does a change move a run's speed or result?

    git worktree add /tmp/base BASE
    python benchmarks/train_ab.py --base-src /tmp/base/src --pairs 3 --out benchmarks/results/train_ab.json \
        -- --model lenet --dataset mnist --steps 1000 --threads 2 --eval-every 1000 --lr 0.05

Each pair runs the command on the base tree (``PYTHONPATH`` ahead of the installed sparknet), then on this
checkout, from a folder outside both; each run is timed from its start, with the load average sampled before and
during it. Time nothing else while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from _bench import commit_of, save_json, timed_command

HERE = Path(__file__).resolve().parents[1] / "src"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-src", required=True, help="the base tree's src folder")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/train_ab.json")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: the arguments of sparknet train")
    args = parser.parse_args(argv)
    train = [a for a in args.train_args if a != "--"]
    cmd = [sys.executable, "-m", "sparknet", "train", *train, "--quiet"]
    runs: dict[str, list[dict]] = {"base": [], "this": []}
    for i in range(args.pairs):
        for tag, src in (("base", Path(args.base_src).resolve()), ("this", HERE)):
            env = {**os.environ, "PYTHONPATH": str(src)}
            run = timed_command(cmd, cwd=Path(os.sep), env=env)
            lines = run.pop("stdout_tail").splitlines()
            run["result"] = json.loads([line for line in lines if line.startswith("{")][-1])
            runs[tag].append(run)
            print(f"{tag} {i}: {run['result'].get('samples_per_s'):.0f} samples/s, accuracy "
                  f"{run['result'].get('test_accuracy')}, {run['command_wall_s']} s from the command's start",
                  flush=True)
    summary = {tag: {"median_samples_per_s": statistics.median(r["result"]["samples_per_s"] for r in rs),
                     "median_command_s": statistics.median(r["command_wall_s"] for r in rs),
                     "test_accuracy": [r["result"].get("test_accuracy") for r in rs]} for tag, rs in runs.items()}
    print(json.dumps(summary, indent=1))
    shown = " ".join(["python", *cmd[1:]])  # the command as a user types it (no interpreter path)
    for rs in runs.values():
        for r in rs:
            r["command"] = shown
    save_json({"command": shown, "base_commit": commit_of(Path(args.base_src).parent),
               "this_commit": commit_of(HERE.parent),
               "summary": summary, "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
