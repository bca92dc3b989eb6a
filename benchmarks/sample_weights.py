"""What sample weights cost a layer-DSL net: ``sparknet train`` on one table with and without ``--weight-col``.

    python benchmarks/sample_weights.py --repeats 3 --out benchmarks/results/sample_weights.json

The table holds 60,000 rows of 64 numbers, a class among 10 and a weight column of ones, so the weighted run learns
what the plain run learns. Each run is ``sparknet train --data TABLE --model mlp --steps STEPS`` in one process (one
thread), the two alternated ``--repeats`` times, each timed from its command's start with the load average sampled
before and during; the summary's ``samples_per_s`` is the training loop's own rate. The weighted loss is each loss
layer's per-row branch (``sparknet.layers._RowLoss``), its labels one float column wider; the weighted run's held-out
rows (the table's last 6,000) are scored with their weights too (``validation_weight`` in the records). Time nothing
else while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _bench import commit_of, save_json, timed_command

ROWS, WIDTH, CLASSES = 60_000, 64, 10


def _table(where: Path) -> Path:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    centres = rng.normal(size=(CLASSES, WIDTH)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=ROWS)
    x = centres[y] + rng.normal(scale=2.0, size=(ROWS, WIDTH)).astype(np.float32)
    path = where / "table.parquet"
    pq.write_table(pa.table({"features": pa.array(list(x), pa.list_(pa.float32())), "label": y,
                             "w": np.ones(ROWS)}), path)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--out", default="benchmarks/results/sample_weights.json")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {"plain": [], "weighted": []}
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as where:
        table = _table(Path(where))
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
        for i in range(args.repeats):
            for name, extra in (("plain", []), ("weighted", ["--weight-col", "w"])):
                cmd = [sys.executable, "-m", "sparknet", "train", "--data", str(table), "--model", "mlp", "--steps",
                       str(args.steps), "--threads", "1", "--quiet", *extra]
                run = timed_command(cmd, cwd=Path(os.sep), env=env, timeout_s=900)
                result = json.loads([line for line in run["stdout_tail"].splitlines() if line.startswith("{")][-1])
                runs[name].append({"command_wall_s": run["command_wall_s"], "samples_per_s": result["samples_per_s"],
                                   "test_accuracy": result["test_accuracy"], "test_loss": result["test_loss"],
                                   "validation_weight": result.get("validation_weight"),
                                   **{k: v for k, v in run.items() if k.startswith("load_average")}})
                print(f"{name} {i}: {run['command_wall_s']:.2f} s from the command's start, "
                      f"{result['samples_per_s']:.0f} samples/s, accuracy {result['test_accuracy']}", flush=True)
    medians = {name: {"command_wall_s": statistics.median(r["command_wall_s"] for r in rs),
                      "samples_per_s": statistics.median(r["samples_per_s"] for r in rs)} for name, rs in runs.items()}
    print(json.dumps(medians))
    save_json({"commit": commit_of(), "rows": ROWS, "width": WIDTH, "classes": CLASSES, "steps": args.steps,
               "command": "python -m sparknet train --data TABLE --model mlp --steps STEPS --threads 1 "
                          "[--weight-col w]",
               "repeats": args.repeats, "medians": medians, "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
