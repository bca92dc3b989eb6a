"""Generating extended MNIST on Spark's executors: seconds, rows per second and bytes on disk.

    python benchmarks/extended_mnist.py                                   # 1,000,000 samples on local[2]
    python benchmarks/extended_mnist.py --samples 200000 --repeats 1
    python benchmarks/extended_mnist.py --out emnist-1m --keep           # leave the last folder to train on

A warm-up write of 20,000 samples starts the Python workers first; then ``--repeats`` timed
writes of ``--samples`` samples (:func:`sparknet.datasets.write_extended_mnist`, MNIST's 50,000
training digits as the base, seed 0, the default partitioning) replace one another in
``--out``. A write's seconds run from the broadcast of the base digits to the last Parquet
file closed (the session's start and MNIST's loading are outside it). Beside them, the same
deformation in this process on one core (:func:`sparknet.datasets.extended_samples`, 20,000
samples), the floor a task cannot go below. Prints and saves JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _session(master: str):
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from sparknet.spark import get_session

    return get_session(master, conf={"spark.ui.enabled": "false"}, log_level="ERROR")


def in_process_us_per_sample(base, samples: int) -> float:
    """Microseconds per sample of the deformation alone, in this process (numpy's own BLAS threads)."""
    from sparknet.datasets import extended_samples

    images, labels = base
    extended_samples(images, labels, 0, 2048)  # warm-up
    t0 = time.perf_counter()
    extended_samples(images, labels, 0, samples)
    return (time.perf_counter() - t0) / samples * 1e6


def timed_writes(spark, base, out: Path, samples: int, repeats: int) -> list[dict]:
    from sparknet.datasets import write_extended_mnist

    runs = []
    for _ in range(repeats):
        with LoadSampler() as load:
            written = write_extended_mnist(spark, str(out), samples, base=base, mode="overwrite")
        runs.append({"seconds": round(written.seconds, 2), "rows_per_s": round(written.rows / written.seconds),
                     "bytes": written.bytes, "partitions": written.partitions, **load.to_dict()})
        print(json.dumps(runs[-1]), flush=True)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--out", default=None, help="Parquet folder (default a temporary one)")
    p.add_argument("--keep", action="store_true", help="leave --out in place at the end")
    p.add_argument("--json", default=str(RESULTS / "extended_mnist.json"))
    args = p.parse_args()

    import numpy as np

    from sparknet.datasets import mnist
    from sparknet.datasets._extended_write import base_digits

    base = base_digits(mnist().train)
    scratch = Path(tempfile.mkdtemp(prefix="emnist-bench-"))
    out = Path(args.out) if args.out else scratch / "set"
    spark = _session(args.master)
    try:
        from sparknet.datasets import write_extended_mnist

        write_extended_mnist(spark, str(scratch / "warmup"), 20_000, base=base)
        runs = timed_writes(spark, base, out, args.samples, args.repeats)
    finally:
        spark.stop()
    per_sample = in_process_us_per_sample(base, 20_000)
    seconds = [r["seconds"] for r in runs]
    result = {
        "benchmark": "extended_mnist", "samples": args.samples, "master": args.master, "runs": runs,
        "median_seconds": statistics.median(seconds),
        "median_rows_per_s": round(args.samples / statistics.median(seconds)),
        "bytes_on_disk": runs[-1]["bytes"], "bytes_per_sample": round(runs[-1]["bytes"] / args.samples, 1),
        "in_process_us_per_sample": round(per_sample, 1), "kept": args.keep,
        "platform": platform.platform(), "cpus": os.cpu_count(), "numpy": np.__version__,
    }
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(scratch / "warmup", ignore_errors=True)
    if not any(scratch.iterdir()):
        scratch.rmdir()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))


if __name__ == "__main__":
    main()
