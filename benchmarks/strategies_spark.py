"""Every strategy trains MNIST LeNet with K Spark workers to a target test accuracy, in each engine it runs on.

    python benchmarks/strategies_spark.py                          # K=4, target 98.5%, all strategies, both engines
    python benchmarks/strategies_spark.py --only average:rounds    # one cell

Each cell is one ``sparknet train`` command in its own process (its own Spark session on
``local[K]``), stopping at the target accuracy (evaluated on the 10k test images every
``--eval-every-rounds`` rounds) or after ``--steps`` local steps per worker. The cell's
summary (accuracy, rounds, steps per worker, bytes communicated, wall time) is saved after
every cell, with the command that produced it and the machine's load average.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler  # noqa: E402

# (strategy, engine, extra flags): the solver each strategy is used with, as in benchmarks/strategies.py.
CELLS = [
    ("average", "rounds", ["--lr", "0.05", "--tau", "50"]),
    ("average", "barrier", ["--lr", "0.05", "--tau", "50"]),
    ("diloco", "rounds", ["--solver-type", "adamw", "--lr", "1e-3", "--weight-decay", "1e-4", "--tau", "50"]),
    ("diloco", "barrier", ["--solver-type", "adamw", "--lr", "1e-3", "--weight-decay", "1e-4", "--tau", "50"]),
    ("easgd", "rounds", ["--lr", "0.05", "--tau", "10"]),
    ("easgd", "barrier", ["--lr", "0.05", "--tau", "10"]),
    ("sync", "barrier", ["--lr", "0.05", "--tau", "50"]),  # gradients allreduced every step; tau = report interval
]


def run_cell(strategy: str, engine: str, extra: list[str], args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cmd = ["sparknet", "train", "--model", "lenet", "--dataset", "mnist", "--workers", str(args.workers),
               "--engine", engine, "--strategy", strategy, "--target-accuracy", str(args.target),
               "--steps", str(args.steps), "--threads", "1", "--quiet", "--metrics-out", str(metrics)]
        if args.compression != "none":
            cmd += ["--compression", args.compression]
        if "--eval-every-rounds" not in extra:
            cmd += ["--eval-every-rounds", str(args.eval_every_rounds)]
        cmd += extra
        with LoadSampler() as load:
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            wall = time.perf_counter() - t0
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    summary = next((r for r in reversed(records) if r.get("event") == "summary"), {})
    out = {"strategy": strategy, "engine": engine, "workers": args.workers, "target": args.target,
           "compression": args.compression,
           "command": shlex.join(cmd[:cmd.index("--metrics-out")] + cmd[cmd.index("--metrics-out") + 2:]),
           "returncode": proc.returncode, "process_wall_s": wall, **load.to_dict()}
    if proc.returncode != 0:
        out["error"] = proc.stderr[-2000:]
    for key in ("test_accuracy", "rounds", "total_steps", "steps", "samples", "bytes_communicated", "wall_s",
                "train_s", "setup_s", "stop_reason", "tau"):
        if key in summary:
            out[key] = summary[key]
    out["reached"] = out.get("test_accuracy", 0.0) >= args.target
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--target", type=float, default=0.985)
    p.add_argument("--steps", type=int, default=4000, help="local steps per worker at most")
    p.add_argument("--eval-every-rounds", type=int, default=2)
    p.add_argument("--only", nargs="*", default=None, help="strategy:engine cells to run (default: all)")
    p.add_argument("--compression", default="none", help="none, fp16, bf16 or int8 for every cell")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one cell may take")
    p.add_argument("--out", default="benchmarks/results/strategies_spark.json")
    args = p.parse_args(argv)
    cells = [c for c in CELLS if args.only is None or f"{c[0]}:{c[1]}" in args.only]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for strategy, engine, extra in cells:
        r = run_cell(strategy, engine, extra, args)
        results.append(r)
        print(json.dumps({k: r.get(k) for k in ("strategy", "engine", "reached", "test_accuracy", "rounds", "steps",
                                                 "bytes_communicated", "wall_s", "returncode")}), flush=True)
        out.write_text(json.dumps({"benchmark": "strategies_spark", "args": vars(args), "python": sys.version.split()[0],
                                   "complete": len(results) == len(cells), "results": results}, indent=1))
    print(f"saved {out}")
    return results


if __name__ == "__main__":
    main()
