"""Train a network on the output of a Spark SQL query: SparkNet's motivating case.

    python examples/sql_train.py                       # MNIST, LeNet, 2 workers on local[2]
    python examples/sql_train.py --quick               # the 5,000-image subset, a small MLP
    python examples/sql_train.py --master spark://127.0.0.1:7077

The data lives in Spark: MNIST is written once as a Parquet table (``split``, ``label``,
``pixels`` as ``array<float>``), registered as the temporary view ``digits``, and the
training set is whatever a SQL query returns (``--query``; by default the training split,
selected with a WHERE clause). :class:`~sparknet.spark.ml.SparkNetEstimator` trains on the
query's DataFrame with K workers averaging every ``--tau`` steps; the returned model scores
the test split (a second query) and the test accuracy is printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("sql_train")

DEFAULT_QUERY = "SELECT pixels AS features, label FROM digits WHERE split = 'train'"
TEST_QUERY = "SELECT pixels AS features, label FROM digits WHERE split = 'test'"


def write_digits_table(data, folder: Path) -> Path:
    """MNIST splits as one Parquet table: split string, label int, pixels array<float>."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = []
    for split, ds in (("train", data.train), ("test", data.test)):
        x = np.ascontiguousarray(ds.x.reshape(len(ds.x), -1), dtype=np.float32)
        width = x.shape[1]
        offsets = pa.array(np.arange(0, (len(x) + 1) * width, width, dtype=np.int32))
        pixels = pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1)))
        parts.append(pa.table({"split": pa.array([split] * len(x)), "label": pa.array(ds.y.astype(np.int32)),
                               "pixels": pixels}))
    path = folder / "digits.parquet"
    pq.write_table(pa.concat_tables(parts), path, row_group_size=8192)
    return path


def digits_view(spark, data, folder: Path):
    """The MNIST table as a DataFrame: read from Parquet on a local master; on a cluster, whose executors cannot
    read this machine's files, its rows are sent through Spark itself."""
    from pyspark.sql import functions as F

    from sparknet.spark import frame_from_arrays, is_local_master

    if is_local_master(spark.sparkContext.master):
        return spark.read.parquet(str(write_digits_table(data, folder)))
    parts = [frame_from_arrays(spark, ds.x.reshape(len(ds.x), -1), ds.y)
             .select(F.lit(split).alias("split"), F.col("label").cast("int").alias("label"),
                     F.col("features").alias("pixels"))
             for split, ds in (("train", data.train), ("test", data.test))]
    return parts[0].unionByName(parts[1])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the 5,000-image MNIST subset and a small MLP (seconds)")
    p.add_argument("--query", default=DEFAULT_QUERY, help="SQL over the view 'digits' giving features and label")
    p.add_argument("--master", default=None, help="Spark master URL (default local[WORKERS])")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--engine", default="rounds", choices=["rounds", "barrier"])
    p.add_argument("--tau", type=int, default=50, help="local steps between averages")
    p.add_argument("--steps", type=int, default=None, help="local steps per worker (default 5000, quick 100)")
    p.add_argument("--lr", type=float, default=None, help="base learning rate (default 0.01, quick 0.05)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    return p


def main(argv=None, spark=None) -> dict:
    """Run the example; returns the result (accuracy, rows, times). ``spark``: a session to reuse."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("py4j").setLevel(logging.WARNING)  # its connection notices say nothing to a user
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    from sparknet import zoo
    from sparknet.datasets import mnist, mnist_small
    from sparknet.spark import get_session
    from sparknet.spark.ml import SparkNetEstimator

    own = spark is None
    if own:
        spark = get_session(args.master or f"local[{args.workers}]", app_name="sparknet-sql-train")
    t0 = time.perf_counter()
    try:
        data = mnist_small() if args.quick else mnist()
        with tempfile.TemporaryDirectory(prefix="sparknet-sql-") as tmp:
            digits_view(spark, data, Path(tmp)).createOrReplaceTempView("digits")
            train = spark.sql(args.query)
            test = spark.sql(TEST_QUERY)
            if args.quick:
                net = zoo.mlp(input_shape=[1, 28, 28], hidden=[64], num_classes=10)
                steps, lr = args.steps or 100, args.lr or 0.05
            else:
                net = zoo.lenet()
                steps, lr = args.steps or 5000, args.lr or 0.01
            est = SparkNetEstimator(net, workers=args.workers, engine=args.engine, tau=min(args.tau, steps),
                                    steps=steps, lr=lr, batchSize=64, seed=0)
            log.info("training on: %s", args.query)
            model = est.fit(train)
            scored = model.transform(test)
            accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored)
            result = {"query": args.query, "train_rows": model.summary["data_rows"],
                      "rounds": model.summary["rounds"], "test_accuracy": accuracy,
                      "train_s": model.summary["train_s"], "wall_s": time.perf_counter() - t0,
                      "master": spark.sparkContext.master}
            spark.catalog.dropTempView("digits")
            model.unpersist()
    finally:
        if own:
            spark.stop()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"test accuracy {accuracy:.4f} after {result['rounds']} rounds on {result['train_rows']} rows "
              f"from the query ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
