"""How long ``sparknet predict`` takes from its start: a LeNet model folder scores MNIST's 10,000 test digits; and
``sparknet evaluate``, the same model's loss and accuracy on them, beside it.

    python benchmarks/predict_command.py --baseline-rev HEAD~3 --repeats 3 --out benchmarks/results/predict_command.json

It trains LeNet for 300 steps in this process, saves its model folder and writes MNIST's test digits as Parquet
(``features`` array<float>, ``label``), then runs ``python -m sparknet predict`` on them ``--repeats`` times on each
tree (with ``--baseline-rev``, that commit's ``src`` in a worktree, alternated with this tree's), from a folder outside
both, each timed from its process's start to its end (Python, the Spark session and its JVM, the model, the scoring
job and the Parquet written), with the load average sampled before and during. Every run's predictions are checked
against the first's. After each of this tree's runs ``python -m sparknet evaluate`` scores the same rows, timed the
same way; its accuracy is checked against the one the written predictions give. Time nothing else while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from _bench import commit_of, save_json, source_trees, timed_command

ROOT = Path(__file__).resolve().parents[1]


def _model_and_data(where: Path) -> tuple[Path, Path]:
    import numpy as np
    import pyarrow as pa

    from sparknet import Net, zoo
    from sparknet.datasets import mnist
    from sparknet.model_io import save_model
    from sparknet.solvers import SolverConfig

    data = mnist()
    net = Net(zoo.lenet(), SolverConfig(base_lr=0.05), batch_size=64, seed=0)
    net.set_training_data(data.train)
    net.train(300)
    folder = save_model(where / "lenet", net)
    x, y = np.asarray(data.test.x).reshape(len(data.test), -1), np.asarray(data.test.y)
    table = pa.table({"id": np.arange(len(y)), "features": list(x), "label": y})
    pq.write_table(table, where / "mnist_test.parquet")
    return Path(folder), where / "mnist_test.parquet"


def _evaluate(folder: Path, data: Path, env: dict, scored: Path) -> dict:
    """``sparknet evaluate`` on ``data``, timed from its start; its accuracy checked against ``scored``'s."""
    run = timed_command([sys.executable, "-m", "sparknet", "evaluate", "--model-dir", str(folder), "--data", str(data)],
                        cwd=Path(os.sep), env=env, timeout_s=600)
    result = json.loads([line for line in run["stdout_tail"].splitlines() if line.startswith("{")][-1])
    table = pq.read_table(scored, columns=["label", "prediction"]).to_pandas()
    accuracy = float((table["label"] == table["prediction"]).mean())
    if abs(result["accuracy"] - accuracy) > 1e-12:
        raise SystemExit(f"evaluate's accuracy {result['accuracy']} is not the predictions' {accuracy}")
    return {"command_wall_s": run["command_wall_s"], "job_s": result["seconds"], "rows": result["rows"],
            "accuracy": result["accuracy"], "loss": result["loss"],
            **{k: v for k, v in run.items() if k.startswith("load_average")}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-rev", default=None, help="a commit to run beside this tree")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/predict_command.json")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {}
    first = None
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as where, \
            source_trees(ROOT, args.baseline_rev, Path(where)) as trees:
        folder, data = _model_and_data(Path(where))
        for i in range(args.repeats):
            for name, src in trees.items():
                out = Path(where) / f"scored-{i}-{name.split()[0]}"
                cmd = [sys.executable, "-m", "sparknet", "predict", "--model-dir", str(folder), "--data", str(data),
                       "--out", str(out)]
                env = {**os.environ, "PYTHONPATH": str(src)}
                run = timed_command(cmd, cwd=Path(os.sep), env=env, timeout_s=600)
                wall = run["command_wall_s"]
                result = json.loads([line for line in run["stdout_tail"].splitlines() if line.startswith("{")][-1])
                predictions = pq.read_table(out, columns=["id", "prediction"]).to_pandas().sort_values("id")
                predictions = predictions["prediction"].tolist()
                first = first or predictions
                if predictions != first:
                    raise SystemExit(f"{name}: the predictions differ from the first run's")
                runs.setdefault(name, []).append({"command_wall_s": wall, "rows": result["rows"],
                                                  "job_s": result["seconds"],
                                                  **{k: v for k, v in run.items() if k.startswith("load_average")}})
                print(f"{name} {i}: {wall:.2f} s from the command's start, the scoring job {result['seconds']} s",
                      flush=True)
                if name == "this tree":
                    evaluated = _evaluate(folder, data, env, out)
                    runs.setdefault("evaluate", []).append(evaluated)
                    print(f"evaluate {i}: {evaluated['command_wall_s']:.2f} s from the command's start, accuracy "
                          f"{evaluated['accuracy']}", flush=True)
    medians = {name: statistics.median(r["command_wall_s"] for r in rs) for name, rs in runs.items()}
    print(json.dumps(medians))
    save_json({"commit": commit_of(), "baseline_rev": args.baseline_rev,
               "command": "python -m sparknet predict --model-dir lenet --data mnist_test.parquet --out scored",
               "model": "lenet, 300 steps", "rows": 10_000, "repeats": args.repeats, "median_command_s": medians,
               "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
