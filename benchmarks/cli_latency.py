"""How long ``python -m sparknet`` takes to answer what needs no training: help, its version, a mistyped flag.

    python benchmarks/cli_latency.py --baseline-rev HEAD~2 --repeats 5 --out benchmarks/results/cli_latency.json

Each command line runs ``--repeats`` times on each tree (with ``--baseline-rev``, that commit's ``src`` in a worktree,
alternated with this tree's), from a folder outside both, each timed from its process's start to its end with the
load average sampled before and during; the exit code is recorded (a mistyped flag exits 2). Python's bytecode is
written to a cache of this run's own, outside both trees, as a user's install has it, and the first of each tree's
runs, which writes it, is not counted. Time nothing else while it runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _bench import commit_of, save_json, source_trees, timed_command

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = (
    "--help",
    "--version",
    "version",  # the versions of sparknet, Python, torch and pyspark
    "train --help",
    "train --model lenet --dataset mnist --lrr 0.05",  # one process's road, mistyped
    "train --model lenet --dataset mnist --workers 2 --lrr 0.05",  # Spark's road (its JVM started ahead), mistyped
    "train --model lenet --dataset mnist --min-lr 0.001",  # a solver setting its policy has not (before: at the run)
    "caffe --help",
    "experiment --help",
    "experiment speedup-grid --help",
)
"""What a user types that trains nothing."""


def _timed(argv: list[str], env: dict) -> dict:
    run = timed_command([sys.executable, "-m", "sparknet", *argv], cwd=Path(os.sep), env=env, timeout_s=120,
                        check=False)
    return {"wall_s": run["command_wall_s"], "exit": run["exit"],
            **{k: v for k, v in run.items() if k.startswith("load_average")}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-rev", default=None, help="a commit to run beside this tree")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/cli_latency.json")
    args = parser.parse_args(argv)
    # a daemon loaded ahead (the base's mistyped Spark run) may still write bytecode as its command's process ends
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as where, \
            source_trees(ROOT, args.baseline_rev, Path(where)) as trees:
        envs = {name: {**os.environ, "PYTHONPATH": str(src), "PYTHONPYCACHEPREFIX": str(Path(where) / name[:4])}
                for name, src in trees.items()}
        for env in envs.values():
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            for warm in (["train", "--help"], ["version"]):  # write the tree's bytecode (and torch's, where an older
                _timed(warm, env)  # tree's version loads it): not counted
        runs = {name: {command: [] for command in COMMANDS} for name in trees}
        for i in range(args.repeats):
            for command in COMMANDS:
                for name, env in envs.items():
                    runs[name][command].append(_timed(command.split(), env))
            print(f"repeat {i + 1} of {args.repeats} done", flush=True)
    medians = {name: {command: statistics.median(r["wall_s"] for r in rs) for command, rs in by.items()}
               for name, by in runs.items()}
    for command in COMMANDS:
        print(f"{command:62s} " + "  ".join(f"{name}: {medians[name][command]:.2f} s (exit "
                                            f"{runs[name][command][0]['exit']})" for name in trees), flush=True)
    save_json({"commit": commit_of(), "baseline_rev": args.baseline_rev,
               "commands": [f"python -m sparknet {c}" for c in COMMANDS], "repeats": args.repeats,
               "median_wall_s": medians, "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
