"""A Spark ML Pipeline: VectorAssembler -> SparkNetEstimator, scored by an evaluator.

    python examples/pipeline.py              # 20,000 rows of 32 numeric columns, 10 classes
    python examples/pipeline.py --quick      # 1,200 rows, a few rounds (seconds)

Tabular data as Spark ML sees it: one numeric column per feature and an integer label. A
``VectorAssembler`` packs the columns into an ML ``Vector``; a ``SparkNetEstimator`` trains a
small MLP on it with two workers averaging every ``--tau`` steps; the fitted
``PipelineModel`` adds ``prediction`` and ``probability`` columns, a
``MulticlassClassificationEvaluator`` measures accuracy, and a save/load round trip of the
whole pipeline gives the same predictions.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time

log = logging.getLogger("pipeline")


def frame(spark, ds, columns):
    """An ArrayDataset as a DataFrame with one double column per feature and a label."""
    import pandas as pd

    pdf = pd.DataFrame(ds.x.astype("float64"), columns=columns)
    pdf["label"] = ds.y.astype("int64")
    return spark.createDataFrame(pdf)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny data, a few rounds")
    p.add_argument("--master", default=None, help="Spark master URL (default local[WORKERS])")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tau", type=int, default=20)
    p.add_argument("--rounds", type=int, default=None, help="averaging rounds (default 30, quick 5)")
    p.add_argument("--model-dir", default=None,
                   help="where the fitted pipeline is saved and reloaded from: a location every host can reach "
                        "(hdfs://, s3a://, a shared mount); default: a temporary folder on a local master, and on "
                        "a cluster no save")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    return p


def main(argv=None, spark=None) -> dict:
    """Run the example; returns the result. ``spark``: a session to reuse (not stopped)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("py4j").setLevel(logging.WARNING)  # its connection notices say nothing to a user
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.feature import VectorAssembler

    from sparknet import zoo
    from sparknet.datasets import synthetic
    from sparknet.spark import get_session, is_local_master
    from sparknet.spark.ml import SparkNetEstimator

    n_train, n_test, width, classes = (1200, 400, 16, 4) if args.quick else (20000, 4000, 32, 10)
    rounds = args.rounds or (5 if args.quick else 30)
    columns = [f"x{i}" for i in range(width)]
    own = spark is None
    if own:
        spark = get_session(args.master or f"local[{args.workers}]", app_name="sparknet-pipeline")
    t0 = time.perf_counter()
    try:
        # noise 2: hard enough that the net has something to learn, easy enough to learn it.
        train = frame(spark, synthetic(n_train, shape=(width,), num_classes=classes, seed=1, noise=2.0), columns)
        test = frame(spark, synthetic(n_test, shape=(width,), num_classes=classes, seed=2, noise=2.0), columns)
        pipeline = Pipeline(stages=[
            VectorAssembler(inputCols=columns, outputCol="features"),
            SparkNetEstimator(zoo.mlp(input_shape=[width], hidden=[64], num_classes=classes),
                              workers=args.workers, tau=args.tau, rounds=rounds, lr=0.05, batchSize=32, seed=0),
        ])
        model = pipeline.fit(train)
        evaluator = MulticlassClassificationEvaluator(metricName="accuracy")
        scored = model.transform(test)
        accuracy = evaluator.evaluate(scored)
        identical = None
        if args.model_dir is None and not is_local_master(spark.sparkContext.master):
            log.info("no --model-dir: executors on other hosts cannot read this machine's temporary folder, so the "
                     "save and reload are left out")
        else:
            with tempfile.TemporaryDirectory(prefix="sparknet-pipeline-") as tmp:
                folder = args.model_dir or f"{tmp}/model"
                model.write().overwrite().save(folder)
                reloaded = PipelineModel.load(folder)
                before = [r.prediction for r in scored.select("prediction").collect()]
                after = [r.prediction for r in reloaded.transform(test).select("prediction").collect()]
                identical = before == after
        result = {"test_accuracy": accuracy, "chance": 1.0 / classes, "rounds": model.stages[-1].summary["rounds"],
                  "reloaded_identical": identical, "wall_s": time.perf_counter() - t0}
    finally:
        if own:
            spark.stop()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"test accuracy {accuracy:.4f} (chance {1.0 / classes:.2f}) after {result['rounds']} rounds; "
              f"saved and reloaded pipeline predicts the same: {result['reloaded_identical']}")
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
