"""``sparknet data NAME``: make a data set at scale on Spark's executors and write it as Parquet.

One data set so far, ``extended-mnist`` (:func:`sparknet.datasets.write_extended_mnist`):
MNIST's training digits, elastically distorted and jittered, as many as asked. The output
folder is checked first (on a cluster, a path only this machine sees is refused), the job
runs under a deadline, and one JSON line says where it wrote, the rows, bytes and seconds.

Examples
--------
::

    sparknet data extended-mnist --out /data/emnist-1m --samples 1000000 --master local[2]
"""

from __future__ import annotations

import argparse
import json
import uuid

from sparknet.datasets import write_extended_mnist
from sparknet.spark.backend import run_with_deadline
from sparknet.spark.session import get_session
from sparknet.spark.shared_path import check_shared_path
from sparknet.tools.predict import _no_active_session

__all__ = ["configure_command", "deadline_s"]

APP_NAME = "sparknet-data"
"""The name of the Spark session ``sparknet data`` starts."""

_SECONDS_PER_SAMPLE = 1e-3
"""The default deadline allows this per sample (two cores make one in about 0.05 ms)."""
_MIN_DEADLINE_S = 600.0


def deadline_s(samples: int, timeout_s: float | None) -> float | None:
    """The job's deadline: ``timeout_s`` as given (0: none), else 1 ms a sample and at least 10 minutes."""
    if timeout_s is None:
        return max(_MIN_DEADLINE_S, samples * _SECONDS_PER_SAMPLE)
    if timeout_s < 0:
        raise ValueError(f"--timeout must be >= 0 seconds (0: no deadline), got {timeout_s}")
    return timeout_s or None


def _run_extended_mnist(args: argparse.Namespace) -> int:
    timeout_s = deadline_s(args.samples, args.timeout)
    own_session = _no_active_session()
    spark = get_session(args.master, app_name=APP_NAME)
    try:
        check_shared_path(spark, args.out, what="--out", write=True)
        written = run_with_deadline(
            spark.sparkContext, f"sparknet-data-{uuid.uuid4().hex[:8]}",
            f"sparknet: extended MNIST, {args.samples} samples", timeout_s=timeout_s,
            what=f"writing {args.samples} extended-MNIST samples",
            action=lambda: write_extended_mnist(spark, args.out, args.samples, seed=args.seed,
                                                num_partitions=args.partitions,
                                                mode="overwrite" if args.overwrite else "error"))
    finally:
        if own_session:
            spark.stop()
    print(json.dumps({"out": written.path, "rows": written.rows, "partitions": written.partitions,
                      "bytes": written.bytes, "seconds": round(written.seconds, 2),
                      "rows_per_s": round(written.rows / written.seconds, 1)}))
    return 0


def configure_command(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``sparknet data`` (``sparknet.cli`` lists the command)."""
    sub = parser.add_subparsers(dest="data_set", required=True, metavar="NAME")
    help_text = "MNIST's training digits, elastically distorted and jittered, as many as asked (Parquet)"
    p = sub.add_parser("extended-mnist", help=help_text, description=help_text)
    p.add_argument("--out", required=True, help="Parquet folder to write (every executor must be able to write it)")
    p.add_argument("--samples", type=int, required=True, help="how many deformed digits to make")
    p.add_argument("--seed", type=int, default=0, help="the deformations' seed (default 0)")
    p.add_argument("--partitions", type=int, default=None,
                   help="Spark partitions, one Parquet file each (default: 100,000 samples each, at least "
                        "Spark's default parallelism)")
    p.add_argument("--master", default=None, help="Spark master URL (default local[*])")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds the job may take (default 1 ms a sample, at least 600; 0: no deadline)")
    p.add_argument("--verbose", action="store_true", help="debug logging, Spark's included")
    # _session: the master of the session it starts (python -m sparknet starts it while torch loads)
    p.set_defaults(_run=_run_extended_mnist, _session=lambda args: args.master or "local[*]", _app_name=APP_NAME)
