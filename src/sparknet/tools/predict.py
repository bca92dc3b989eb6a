"""``sparknet predict``: batch scoring of Parquet data through Spark with a saved model; ``sparknet evaluate``: its
loss and metrics on labelled Parquet data, scored where the rows live (:meth:`SparkNetModel.evaluate
<sparknet.spark.ml.SparkNetModel.evaluate>`).

Reads a sparknet model folder (:mod:`sparknet.model_io`) and a Parquet data set, scores
every row with :meth:`sparknet.spark.ml.SparkNetModel.transform` (an Arrow-batched pandas
UDF; the weights reach the executors as one broadcast), and writes Parquet with the input
columns plus what the model's task gives: for a classifier ``prediction`` (the arg-max class,
a double) and ``probability`` (the softmax of the logits); for a regressor ``prediction`` alone
(its output, or its outputs); for a multi-label net ``prediction`` (the indices of the labels
it predicts) and ``probability`` (each label's sigmoid).

Vectors (``probability``, a regressor's several outputs) are written as plain ``array<double>``
so any Parquet reader (pandas, pyarrow, DuckDB) reads them as lists; ``--probability-vector``
keeps Spark ML's vector type instead.

Examples
--------
::

    sparknet predict --model-dir out/lenet --data mnist_test.parquet --out scored.parquet --master local[4]

>>> predict("out/lenet", "mnist_test.parquet", "scored.parquet")   # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sparknet._fields import OldName
from sparknet.config import column_names
from sparknet.spark.backend import run_with_deadline
from sparknet.spark.session import get_session, is_connect
from sparknet.spark.shared_path import check_shared_path

__all__ = ["PredictResult", "predict", "evaluate"]

log = logging.getLogger(__name__)
APP_NAME = "sparknet-predict"
"""The name of the Spark session ``sparknet predict`` starts."""


PREDICT_TIMEOUT_S = 24 * 3600.0
"""Default longest wait for ``sparknet predict``'s scoring and writing job (``--timeout``)."""


@dataclass(frozen=True)
class PredictResult:
    """What :func:`predict` wrote."""

    out: str
    """The Parquet output path."""
    rows: int
    """Rows scored and written."""
    columns: list[str]
    """The output's columns."""
    seconds: float
    """Wall time of the scoring job, reading and writing included."""


def predict(model_dir: str | os.PathLike, data: str, out: str, *, spark=None, master: str | None = None,
            features_col: str | None = None, prediction_col: str = "prediction",
            probability_col: str = "probability", probability_vector: bool = False, overwrite: bool = False,
            score_batch_size: int | None = None, threads: int | None = None, partitions: int | None = None,
            allow_pickle: bool = False, timeout_s: float | None = PREDICT_TIMEOUT_S) -> PredictResult:
    """Score a Parquet data set with a saved model and write the result as Parquet; return what was written.

    Parameters
    ----------
    model_dir : path
        A sparknet model folder (``sparknet train`` and ``SparkNetModel.saveModelFolder``
        write them): a local path or a URI (``s3://``...); only this process reads it.
    data : str
        Parquet file or folder with a features column: an array of numbers, an ML vector, or
        binary images. The executors read it, so on a cluster it must be where every host can
        read it (``hdfs://``, ``s3a://``, a shared mount); a path on this machine only is
        refused before any work.
    out : str
        Where to write the scored Parquet folder (the executors write it: the same holds).
    spark : SparkSession, optional
        The session to use (left running); otherwise one is started for ``master`` and
        stopped at the end (an already running session is used and left running).
    master : str, optional
        Spark master URL for a new session (default ``local[*]``).
    features_col : str, optional
        The feature column, or several (numbers, arrays or ML vectors), comma-separated, joined in that order
        into one array (default: the columns the model was trained on, as its folder records them
        (:attr:`~sparknet.spark.ml.SparkNetModel.trainedColumns`), else ``features``).
    prediction_col, probability_col : str
        Output column names (an empty name leaves that column out).
    probability_vector : bool
        Keep ``probability`` (and a regressor's prediction of several outputs) as a Spark ML vector instead of
        ``array<double>``. A regressor writes no ``probability``.
    overwrite : bool
        Replace ``out`` if it exists (otherwise an existing ``out`` is an error).
    score_batch_size : int, optional
        Rows per forward pass on the executors.
    threads : int, optional
        Torch threads per scoring task (default 1).
    partitions : int, optional
        Repartition the input to this many partitions first (to use more executors).
    allow_pickle : bool
        Allow a model folder that holds a pickled torch module (trusted files only).
    timeout_s : float or None
        Longest wait for the scoring and writing job (default a day); past it the job is cancelled
        and :class:`~sparknet.errors.DeadlineExceeded` says which tasks had not finished. ``None``:
        no deadline.
    """
    if "://" not in out and Path(out).exists() and not overwrite:
        raise ValueError(f"{out} exists; pass --overwrite (overwrite=True) to replace it")
    model = _model(model_dir, data, features_col, allow_pickle, predictionCol=prediction_col,
                   probabilityCol=probability_col, rawPredictionCol="", scoreBatchSize=score_batch_size,
                   threads=threads)
    with _session(spark, master, model) as spark:
        t0 = time.perf_counter()
        df = _table(spark, data, partitions)  # --data checked first, then --out
        check_shared_path(spark, out, what="--out", write=True)
        scored = model.transform(df)
        if not probability_vector:  # a classifier's probability, a regressor's several outputs: plain arrays
            from pyspark.ml.functions import vector_to_array
            from pyspark.ml.linalg import VectorUDT

            for column in (probability_col, prediction_col):
                if column and column in scored.columns and isinstance(scored.schema[column].dataType, VectorUDT):
                    scored = scored.withColumn(column, vector_to_array(scored[column]))

        def write() -> PredictResult:
            scored.write.mode("overwrite" if overwrite else "errorifexists").parquet(out)
            written = spark.read.parquet(out)
            return PredictResult(out=out, rows=written.count(), columns=written.columns,
                                 seconds=time.perf_counter() - t0)

        group = f"sparknet-predict-{os.urandom(4).hex()}"
        result = run_with_deadline(spark if is_connect(spark) else spark.sparkContext, group,
                                   f"sparknet predict: score {data} into {out}", write, timeout_s=timeout_s,
                                   what="the scoring and writing job")
    log.info("scored %d rows with %s into %s in %.1f s", result.rows, model_dir, out, result.seconds)
    return result


def evaluate(model_dir: str | os.PathLike, data: str, *, spark=None, master: str | None = None,
             features_col: str | None = None, label_col: str | None = None, weight_col: str | None = None,
             score_batch_size: int | None = None, threads: int | None = None, partitions: int | None = None,
             allow_pickle: bool = False, timeout_s: float | None = PREDICT_TIMEOUT_S) -> dict:
    """A saved model's loss and its task's metrics on a labelled Parquet data set, each partition scored where it
    lives and the sums joined on the driver (:meth:`~sparknet.spark.ml.SparkNetModel.evaluate`); ``rows``,
    ``loss``, each metric by name, and ``seconds``. ``label_col``: the label column, or several number columns,
    comma-separated (default: what the model trained on, else ``label``); ``weight_col``: a column of sample weights
    each row's loss and metrics are weighed by (default: each row counts once); the rest as :func:`predict` takes
    them."""
    model = _model(model_dir, data, features_col, allow_pickle, scoreBatchSize=score_batch_size, threads=threads)
    with _session(spark, master, model) as spark:
        t0 = time.perf_counter()
        metrics = model.evaluate(_table(spark, data, partitions), label_col, weightCol=weight_col, timeout_s=timeout_s)
    return {**metrics, "seconds": round(time.perf_counter() - t0, 2)}


@contextlib.contextmanager
def _session(spark, master: str | None, model):
    """The session to score in: ``spark``, else the one running, else one started for ``master`` and stopped after;
    the model's broadcast dropped after."""
    own = spark is None and _no_active_session()
    if spark is None:
        spark = get_session(master, app_name=APP_NAME)
    try:
        yield spark
    finally:
        model.unpersist()
        if own:
            spark.stop()


def _model(model_dir, data: str, features_col: str | None, allow_pickle: bool, **params):
    """The saved model, set to score ``features_col`` (default: the columns it trained on), once a local ``data``
    is found there (before any session starts); ``params`` the :class:`~sparknet.spark.ml.SparkNetModel` Params
    given (``None``: its default)."""
    from sparknet.spark.ml import SparkNetModel  # imports pyspark: loaded when scoring starts

    if "://" not in data and not Path(data).exists():
        raise FileNotFoundError(f"no Parquet data at {data}")
    model = SparkNetModel.fromModelFolder(str(model_dir), allow_pickle=allow_pickle,
                                          **{k: v for k, v in params.items() if v is not None})
    if features_col is None and model.trainedColumns is None:  # an older folder says them in its settings only
        features_col = ((model.config or {}).get("run") or {}).get("features_col")
    columns = [] if features_col is None else list(column_names(features_col))  # none: the model's own
    if len(columns) == 1:
        model.set(model.featuresCol, columns[0])
    elif columns:  # joined in order as the model scores them
        model.set(model.featuresCols, columns)
    return model


def _table(spark, data: str, partitions: int | None):
    """The Parquet data at ``data`` as Spark reads it (repartitioned to ``partitions``), checked to be where every
    host reads it."""
    check_shared_path(spark, data, what="--data")
    df = spark.read.parquet(data)
    return df if partitions is None else df.repartition(partitions)


def _no_active_session() -> bool:
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession() is None


def configure_command(p: argparse.ArgumentParser) -> None:
    """The arguments of ``sparknet predict`` (``sparknet.cli`` lists the command)."""
    p.add_argument("--model-dir", default=None, help="sparknet model folder (as sparknet train --model-dir saves it)")
    p.add_argument("--model", dest="model_dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS, action=OldName)
    p.add_argument("--data", required=True, help="Parquet file or folder to score")
    p.add_argument("--out", required=True, help="Parquet folder to write")
    p.add_argument("--prediction-col", default="prediction",
                   help="output column of the class, or the numbers (default prediction)")
    p.add_argument("--probability-col", default="probability",
                   help="output column of the class probabilities (default probability)")
    p.add_argument("--probability-vector", action="store_true",
                   help="write probability (and a regressor's several outputs) as Spark ML vectors, not array<double>")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    _scoring_flags(p, "the scoring and writing job")
    p.set_defaults(_run=_run)


def configure_evaluate(p: argparse.ArgumentParser) -> None:
    """The arguments of ``sparknet evaluate`` (``sparknet.cli`` lists the command)."""
    p.add_argument("--model-dir", required=True, help="sparknet model folder (as sparknet train --model-dir saves it)")
    p.add_argument("--data", required=True, help="labelled Parquet file or folder to evaluate on")
    p.add_argument("--label-col", default=None,
                   help="label column, or several number columns, comma-separated (default: the model's, else label)")
    p.add_argument("--weight-col", default=None,
                   help="column of sample weights (numbers >= 0): the loss and the metrics weigh each row by it "
                        "(default: each row counts once)")
    _scoring_flags(p, "the evaluation job")
    p.set_defaults(_run=_run_evaluate)


def _scoring_flags(p: argparse.ArgumentParser, job: str) -> None:
    """The flags ``predict`` and ``evaluate`` share: the session, the columns the model reads, how its tasks score,
    the job's deadline."""
    p.add_argument("--master", default=None, help="Spark master URL (default local[*])")
    p.add_argument("--features-col", default=None,
                   help="feature column, or several, comma-separated, joined in that order (default: the columns "
                        "the model was trained on, else features)")
    p.add_argument("--score-batch-size", type=int, default=None, help="rows per forward pass (default 1024)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per scoring task (default 1)")
    p.add_argument("--partitions", type=int, default=None, help="repartition the input first")
    p.add_argument("--allow-pickle", action="store_true",
                   help="allow a model folder holding a pickled torch module (trusted files only)")
    p.add_argument("--timeout", type=float, default=PREDICT_TIMEOUT_S,
                   help=f"seconds {job} may take before it is cancelled (default: a day)")
    p.add_argument("--verbose", action="store_true", help="debug logging, Spark's included")
    # _session and _app_name: the master and the name of the session it starts (python -m sparknet starts it while
    # torch loads)
    p.set_defaults(_session=lambda args: args.master or "local[*]", _app_name=APP_NAME)


def _run_evaluate(args: argparse.Namespace) -> int:
    print(json.dumps(evaluate(args.model_dir, args.data, master=args.master, features_col=args.features_col,
                              label_col=args.label_col, weight_col=args.weight_col,
                              score_batch_size=args.score_batch_size, threads=args.threads,
                              partitions=args.partitions, allow_pickle=args.allow_pickle, timeout_s=args.timeout)))
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.model_dir is None:
        raise ValueError("give the model folder to score with: --model-dir DIR")
    result = predict(args.model_dir, args.data, args.out, master=args.master, features_col=args.features_col,
                     prediction_col=args.prediction_col, probability_col=args.probability_col,
                     probability_vector=args.probability_vector, overwrite=args.overwrite,
                     score_batch_size=args.score_batch_size, threads=args.threads, partitions=args.partitions,
                     allow_pickle=args.allow_pickle, timeout_s=args.timeout)
    print(json.dumps({**asdict(result), "seconds": round(result.seconds, 2)}))
    return 0
