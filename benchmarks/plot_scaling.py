"""The scaling curve of ``time_to_99.py`` runs as one figure: time to 99% and in-round speed against K.

    python benchmarks/plot_scaling.py benchmarks/results/time_to_99_lab*.json --out docs/figures/lab-scaling.png

Reads one or more JSON files of :mod:`time_to_99` (several calls' runs add up: the lab's tables grow over several
calls) and draws two panels. Left: seconds from each command's start to 99% against K, for each engine and for
TorchDistributor's DDP on K processes, with one process (each of its thread counts) as a flat line. Right: in-round
samples/s against K beside K bare one-thread processes at once (the machine's limit for K workers). Where a run
was repeated, the median is drawn. Writes the PNG and, beside it, the points as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from time_to_99 import _processes  # noqa: E402


def points(reports: list[dict]) -> dict:
    """``{"time": {series: {K: s}}, "speed": {series: {K: samples/s}}, "one_process": {run: s}}``, medians."""
    time_s, speed = defaultdict(lambda: defaultdict(list)), defaultdict(lambda: defaultdict(list))
    one = defaultdict(list)
    for report in reports:
        for run in report["runs"]:
            name, summary = run["run"], run.get("summary") or {}
            if name.startswith("one process"):
                one[name].append(run["command_wall_s"])
            elif name.startswith("bare"):
                speed["bare one-thread processes"][int(name.split(",")[1].split()[0])].append(summary["samples_per_s"])
            elif name.startswith("torch_distributor"):
                time_s["TorchDistributor (DDP)"][int(name.split(",")[1].split()[0])].append(run["command_wall_s"])
            else:
                # the engine, then what the run does beyond K workers ("slow momentum 0.7", "500 warm-up steps")
                engine, _workers, *more = (part.strip() for part in name.split(","))
                series = engine + (" (K x G)" if "processes" in name else "") + "".join(f", {m}" for m in more)
                k = _processes(name)
                time_s[series][k].append(run["command_wall_s"])
                if summary.get("samples_per_s"):
                    speed[series][k].append(summary["samples_per_s"])

    def medians(table):
        return {series: {k: statistics.median(v) for k, v in sorted(ks.items())} for series, ks in table.items()}

    return {"time": medians(time_s), "speed": medians(speed),
            "one_process": {name: statistics.median(v) for name, v in one.items()}}


def plot(data: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    for series, ks in data["time"].items():
        left.plot(list(ks), list(ks.values()), marker="o", label=series)
    for i, (name, seconds) in enumerate(sorted(data["one_process"].items())):
        left.axhline(seconds, color=f"C{7 + i % 3}", linestyle="--", label=name)
    left.set_xlabel("processes K (K x G for a worker of G)")
    left.set_ylabel("seconds to 99%, from the command's start")
    for series, ks in data["speed"].items():
        right.plot(list(ks), list(ks.values()), marker="o", label=series,
                   linestyle=":" if series.startswith("bare") else "-")
    right.set_xlabel("processes K")
    right.set_ylabel("in-round samples/s")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="time_to_99.py JSON files")
    p.add_argument("--out", required=True, help="the PNG to write (its points beside it, .json)")
    p.add_argument("--title", default="LeNet on MNIST to 99%: sparknet's engines, TorchDistributor and one process")
    args = p.parse_args(argv)
    data = points([json.loads(Path(f).read_text()) for f in args.results])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(data, out, args.title)
    out.with_suffix(".json").write_text(json.dumps({"sources": args.results, **data}, indent=1) + "\n")
    print(json.dumps(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
