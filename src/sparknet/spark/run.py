"""``sparknet train --workers K``: the command line's road into the Spark engines.

The data set becomes a Spark DataFrame: on a local master it is written once as two ``.npy`` files (cached
beside the data set), and each of the fit's K partitions copies the rows dealt to it out of them, mapped
into memory, in the task that stages them (no shuffle, no decoding in the JVM or of Parquet); on a cluster,
whose executors cannot read the driver's disk, its rows travel through Spark.
``--data PATH`` is read on the driver (its last rows are the test set) and goes the same way; ``--data URI``
(``file://``, ``s3a://``, ``hdfs://``...) is read by Spark's workers where it lives (:func:`spark_table`). Training
runs through :class:`SparkTrainer`; every round record goes to the metrics file and the progress line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from sparknet._app import build_model, finish_run, load_training_data, run_sinks, seed_everything, scored_rows
from sparknet._fs import is_uri
from sparknet._parquet import TEST_FRACTION, footer_facts, table_info
from sparknet._enums import CompressionKind
from sparknet.config import DistributedConfig, RunConfig, TrainConfig
from sparknet.datasets import SyntheticImages, cache_root
from sparknet.metrics import MetricsLogger, process_age_s, round_reporter, rounds_total
from sparknet.roads import Road, check_road
from sparknet.spark.backend import python_workers_starting
from sparknet.spark.data import DealtRows, arrays_table, frame_from_arrays, held_out, is_dataframe, label_type
from sparknet.spark.session import get_session, is_local_master
from sparknet.spark.trainer import EngineOptions, SparkTrainer

__all__ = ["train_distributed", "dataset_as_arrays", "dataset_as_parquet", "dataset_frame", "training_frame"]

log = logging.getLogger(__name__)


def dataset_as_parquet(dataset, path: Path) -> Path:
    """Write an ArrayDataset as Parquet, once (the columns of :func:`sparknet.spark.data.arrays_table`)."""
    import pyarrow.parquet as pq

    if path.exists():
        return path
    table = arrays_table(dataset.x, dataset.y)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    pq.write_table(table, tmp, row_group_size=8192)
    os.replace(tmp, path)
    return path


def dataset_frame(spark, dataset: str, train, partitions: int | None = None):
    """``train`` of data set ``dataset`` as a DataFrame (``features``, ``label``) every executor can read, or as
    rows a fit takes as one.

    On a local master (every executor on this machine) it is read from files written once beside the
    cache, whose name holds the rows and the shape of one sample and one label, so a data set cut
    differently (another sequence length) gets its own. With ``partitions``, each of that many partitions
    reads the rows dealt to it from the data set's arrays on disk (:func:`dealt_frame`: a
    :class:`~sparknet.spark.data.DealtRows`, whose ``frame`` is the DataFrame): no shuffle deals them out, and
    Spark's JVM never decodes them; without, ``spark.read.parquet`` reads it from Parquet.
    On a cluster the executors cannot read the driver's disk, so the rows travel through Spark itself
    (:func:`sparknet.spark.data.frame_from_arrays`).
    """
    if isinstance(train, SyntheticImages):
        return synthetic_frame(spark, train)
    if not is_local_master(spark.sparkContext.master):
        return frame_from_arrays(spark, train.x, train.y)
    shape = "x".join(str(d) for d in (*np.shape(train.x)[1:], *np.shape(train.y)[1:])) or "1"
    numbers = "-numbers" * np.issubdtype(np.asarray(train.y[:1]).dtype, np.floating)  # labels of a --task not classes
    stem = f"{dataset.lower()}-train-{len(train)}-{shape}{numbers}"
    if partitions is not None:
        return dealt_frame(spark, dataset_as_arrays(train, Path(cache_root()) / "arrays" / stem), partitions)
    path = dataset_as_parquet(train, Path(cache_root()) / "parquet" / f"{stem}.parquet")
    return spark.read.schema(_parquet_schema(path)).parquet(str(path))


def dataset_as_arrays(dataset, stem: Path) -> tuple[Path, Path]:
    """Write an ArrayDataset's rows as two ``.npy`` files, once: ``STEM.features.npy``, one row a sample, and
    ``STEM.label.npy``, in the types :func:`sparknet.spark.data.arrays_table` gives them. Tasks map them into memory
    and copy out only their own rows, where Parquet would have each of them decode the whole file."""
    paths = stem.with_name(stem.name + ".features.npy"), stem.with_name(stem.name + ".label.npy")
    if all(p.exists() for p in paths):
        return paths
    x, y = np.asarray(dataset.x), np.asarray(dataset.y)
    x = x.reshape(len(x), -1).astype(np.int64 if np.issubdtype(x.dtype, np.integer) else np.float32, copy=False)
    stem.parent.mkdir(parents=True, exist_ok=True)
    for path, array in zip(paths, (x, y.astype(label_type(y), copy=False))):
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            np.save(f, np.ascontiguousarray(array))
        os.replace(tmp, path)
    return paths


DEAL_BLOCK_ROWS = 8192
"""Rows a dealt partition's task copies out of the mapped arrays at a time (one Arrow batch)."""


def dealt_frame(spark, paths: tuple[Path, Path], partitions: int) -> DealtRows:
    """The rows of :func:`dataset_as_arrays`'s files (on this machine) in ``partitions`` partitions, dealt out as
    cards are: partition ``k`` holds rows ``k``, ``k + partitions``, ... in order, which its task copies out of the
    files mapped into memory: nothing but the partition's number travels, and the rows never pass through the JVM.
    (Dealt, not cut into contiguous slices: a file whose rows come in some order would give each worker rows of its
    own kind.) A fit takes the :class:`~sparknet.spark.data.DealtRows` as it takes a DataFrame, and stages each hand
    in the task that reads it (``SparkTrainer._frame_staging``); its ``frame`` is the same rows as a DataFrame whose
    tasks read them so, made when first asked for."""
    x_path, y_path = map(str, paths)
    x = np.load(x_path, mmap_mode="r")
    partitions = max(1, min(partitions, len(x)))

    def dealt(k: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows k, k + partitions, ... of the files, mapped (nothing read yet)."""
        return np.load(x_path, mmap_mode="r")[k::partitions], np.load(y_path, mmap_mode="r")[k::partitions]

    def hand(k: int):
        """Arrow batches of partition k's rows."""
        x, y = dealt(k)
        for i in range(0, len(x), DEAL_BLOCK_ROWS):
            yield from arrays_table(x[i:i + DEAL_BLOCK_ROWS], y[i:i + DEAL_BLOCK_ROWS]).to_batches()

    def head(k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``n`` rows of hand ``k`` as the stage job converts them (features float32, labels long)."""
        x, y = dealt(k)
        return np.array(x[:n], dtype=np.float32), np.array(y[:n])

    def frame():
        from pyspark.sql.pandas.types import from_arrow_schema

        def read(batches):
            for batch in batches:
                for k in batch.column(0).to_pylist():
                    yield from hand(k)

        first = (np.load(path, mmap_mode="r")[:1] for path in (x_path, y_path))  # as the files hold them
        schema = from_arrow_schema(arrays_table(*first).schema)
        return spark.range(0, partitions, numPartitions=partitions).mapInArrow(read, schema)

    return DealtRows(spark, hand, partitions, len(x), head, frame)


def _parquet_schema(path: Path):
    """The Spark schema of a Parquet file sparknet wrote, read from its footer here: given to ``spark.read``, it
    spares the session the job that would read the footer to infer it (a second or more of a fit's setup)."""
    import pyarrow.parquet as pq
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(pq.read_schema(path))


def synthetic_frame(spark, images: SyntheticImages, partitions: int | None = None):
    """``images`` as a DataFrame whose rows the executors make themselves (``features``, ``label``), one slice of
    row indices a partition: nothing but the indices travels."""
    from pyspark.sql.pandas.types import from_arrow_schema

    def make(batches):
        for batch in batches:
            x, y = images.rows(batch.column(0).to_numpy())
            yield from arrays_table(x, y).to_batches()

    schema = from_arrow_schema(arrays_table(*images.rows([0])).schema)
    parts = partitions or spark.sparkContext.defaultParallelism
    return spark.range(0, len(images), numPartitions=max(1, min(parts, len(images)))).mapInArrow(make, schema)


SPARK_TEST_ROWS = 10_000
"""The most rows a ``--data`` URI Spark reads holds out for testing when no ``--validation-data`` is given (the
driver scores them)."""


def spark_table(spark, run: RunConfig) -> tuple:
    """``(train, test, info)`` of a ``--data`` URI, as DataFrames Spark's workers read where the table lives (the
    driver reads no row of it but the first, and the labels' largest): ``--validation-data``'s rows are the test
    set, else a seeded sample of 10% of the rows, at most :data:`SPARK_TEST_ROWS`."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType

    facts = _footers(run)
    table, features = _spark_parquet(spark, run.data, "--data", run, schema=_spark_schema(facts),
                                     weight_col=run.weight_col)
    if facts is not None:  # the footers said: no Spark job
        first_features, label, rows = facts.features, facts.label, facts.rows
    else:
        first = table.select("features", "label").head(1)
        if not first:
            raise ValueError(f"{run.data} holds no rows")
        (first_features, label), rows = first[0], None
    sequence = isinstance(table.schema["label"].dataType, ArrayType)  # token ids of one vocabulary, or numbers
    needed = ("label", "features") if sequence else ("label",)
    if run.task.float_labels:  # numbers or 0s and 1s, checked as the executors convert them
        rows = table.count() if rows is None else rows
        info = table_info((len(first_features),), None, outputs=len(label) if sequence else 1)
    else:
        if facts is not None and all(name in facts.largest for name in needed):
            largest = [facts.largest[name] for name in needed]
        else:
            largest = [F.max(F.array_max("label")), F.max(F.array_max("features"))] if sequence else [F.max("label")]
            *largest, rows = table.agg(*largest, F.count(F.lit(1))).first()  # one job: the labels and the rows
        if None in largest:
            raise ValueError(f"{run.data}: every row's label is null; sparknet train needs class ids in 'label'")
        info = table_info((len(first_features),), *largest, len(label) if sequence else None)
    info["features"] = features
    if run.validation_data is not None:  # scored with its weights where it has --weight-col's column
        return table, _spark_parquet(spark, run.validation_data, "--validation-data", run, weight_col=run.weight_col,
                                     weight_optional=True)[0], info
    share = min(TEST_FRACTION, SPARK_TEST_ROWS / max(rows, 1))
    held = held_out(run.seed, ("features", "label"), share)
    log.info("%s: %d rows; a seeded %.2g%% of them held out for testing", run.data, rows, 100 * share)
    return table.filter(~held), table.filter(held), info


def _footers(run: RunConfig):
    """What the footers of a ``file://`` ``--data`` table of ``features`` and ``label`` columns say of it
    (:func:`sparknet._parquet.footer_facts`), read here: its rows, first row and largest label, with no Spark job;
    ``None`` for any other table (another scheme's reader is Spark's, configured for it alone) or where they cannot
    say."""
    from urllib.parse import unquote, urlparse

    if not run.data.lower().startswith("file:") or (run.feature_columns, run.label_col) != (("features",), "label"):
        return None
    return footer_facts(unquote(urlparse(run.data).path))


def _spark_schema(facts):
    """The Spark schema of a table whose footers were read (Spark's own where Spark wrote it), given to its reader
    so that no job infers it; ``None`` without."""
    if facts is None:
        return None
    from pyspark.sql.pandas.types import from_arrow_schema
    from pyspark.sql.types import StructType

    try:
        if facts.spark_schema is not None:
            return StructType.fromJson(json.loads(facts.spark_schema))
        return from_arrow_schema(facts.arrow_schema)
    except (TypeError, ValueError, KeyError) as exc:  # a type Spark names otherwise: Spark infers it
        log.debug("the footers' schema: %s", exc)
        return None


def _spark_parquet(spark, uri: str, flag: str, run: RunConfig, schema=None, weight_col: str | None = None,
                   weight_optional: bool = False) -> tuple:
    """The Parquet table at ``uri`` as Spark reads it, as ``features`` and ``label`` columns (and ``weight``, of
    ``weight_col``; with ``weight_optional``, where the table has it): the columns ``--features-col`` (joined into one
    array where it names several) and ``--label-col`` name, checked to be there (a ``file://`` one on a cluster:
    checked to be seen by every host); and its feature columns (:func:`sparknet._parquet.feature_column`)."""
    from pyspark.errors import AnalysisException
    from pyspark.sql import functions as F

    from sparknet.spark.data import _label_expr, feature_column, spark_feature_column
    from sparknet.spark.shared_path import check_shared_path

    check_shared_path(spark, uri, what=flag)
    try:
        table = (spark.read if schema is None else spark.read.schema(schema)).parquet(uri)
    except AnalysisException as e:
        raise FileNotFoundError(f"{flag} {uri}: Spark cannot read it as Parquet ({str(e).splitlines()[0]})") from None
    if weight_optional and weight_col is not None and weight_col not in table.columns:
        log.warning("%s %s has no weight column %r: its rows are scored unweighted", flag, uri, weight_col)
        weight_col = None
    columns = (*run.feature_columns, *run.label_columns, *([weight_col] if weight_col is not None else []))
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise ValueError(f"{flag} {uri} has no {' or '.join(map(repr, missing))} column (its columns: "
                         f"{', '.join(table.columns)}); sparknet train reads {', '.join(map(repr, columns))} "
                         "(--features-col, --label-col, --weight-col)")
    features = [spark_feature_column(name, table.schema[name].dataType) for name in run.feature_columns]
    if columns == ("features", "label"):
        return table, features
    weight = [] if weight_col is None else [F.col(weight_col).alias("weight")]
    labels = run.label_columns  # several: one array of doubles a row
    return table.select(feature_column(table, list(run.feature_columns))[0].alias("features"),
                        (F.col(labels[0]) if len(labels) == 1 else _label_expr(table, labels)).alias("label"),
                        *weight), features


def training_frame(spark, run: RunConfig, train, partitions: int | None = None, weights=None):
    """The training rows as a DataFrame: ``train`` of the data set, or of ``--data`` without its test rows; on a
    local master dealt to ``partitions`` partitions (:func:`dataset_frame`); of a ``--data`` URI, the DataFrame
    Spark reads (:func:`spark_table`). A ``--data`` table's rows with their ``weights`` (``--weight-col``) travel
    through Spark as a ``weight`` column (:func:`sparknet.spark.data.frame_from_arrays`).

    ``--data`` holds its test set in its last rows (see :mod:`sparknet._parquet`); the Spark
    engines train on the same rows one process trains on, written once beside the cache under
    a name that changes when the files do (or shipped through Spark on a cluster).
    """
    if is_dataframe(train):
        return train
    if weights is not None:
        return frame_from_arrays(spark, train.x, train.y, weights)
    if run.data is None or not is_local_master(spark.sparkContext.master):
        return dataset_frame(spark, run.dataset, train, partitions)
    root = Path(run.data).resolve()
    files = sorted(p for p in ([root] if root.is_file() else root.rglob("*")) if p.is_file())
    stamp = hashlib.sha256(str(root).encode())
    for p in files:
        info = p.stat()
        stamp.update(f"{p.relative_to(root) if p != root else ''}:{info.st_size}:{info.st_mtime_ns};".encode())
    return dataset_frame(spark, f"data-{root.stem}-{stamp.hexdigest()[:16]}", train, partitions)


def train_distributed(run: RunConfig, dist: DistributedConfig, options: EngineOptions | None = None) -> dict:
    """Train as ``run`` and ``dist`` say on Spark, the engines set as ``options`` say; returns the summary record."""
    check_road(Road.SPARK, run, dist, *([options] if options is not None else []))
    seed_everything(run.seed)
    ages = {"imported": process_age_s()}  # Python, torch and sparknet's modules loaded
    with ThreadPoolExecutor(1, thread_name_prefix="sparknet-prepare") as pool:
        prepared = pool.submit(_prepare, run, ages)  # while the Spark session's JVM starts (most of it is waiting)
        spark = get_session(dist.resolved_master)
        ages["session"] = process_age_s()
        with python_workers_starting(spark.sparkContext):  # while the data is read and planned
            train, test, info, net_params = prepared.result()
            if train is None:  # a --data URI: the executors read it where it lives
                train, test, info = spark_table(spark, run)
                ages["loaded"] = process_age_s()
                net_params = build_model(run, info)
            ages["data"] = process_age_s()
            return _train(spark, run, dist, options, train, test, info, net_params, ages)


def _train(spark, run: RunConfig, dist: DistributedConfig, options: EngineOptions | None, train, test, info,
           net_params, ages: dict | None = None) -> dict:
    df = training_frame(spark, run, train, dist.ranks, info.get("weights"))
    config = TrainConfig(run=run, dist=dist).to_dict()
    sinks = run_sinks(run, config)
    failed = True
    result = None
    try:
        with MetricsLogger(run.metrics_out, progress=not run.quiet, total=rounds_total(run.steps, dist),
                           sinks=sinks, early_stop=dist.toward_target) as metrics:
            trainer = SparkTrainer.from_config(net_params, run, dist, spark=spark, on_round=round_reporter(metrics),
                                               options=options, task=run.task)
            link, compressed = dist.link(), dist.compression is not CompressionKind.NONE
            extras = "".join([f", {dist.compression.value} updates" if compressed else "",
                              f", auto tau in [{dist.auto_tau_min}, {dist.auto_tau_max}]" if dist.auto_tau else "",
                              f", link {link.describe()}" if link is not None and not link.is_free else "",
                              f", {dist.ranks // dist.model_parallel} copies split in {dist.model_parallel} parts"
                              if dist.model_parallel > 1 else "",
                              f", {dist.procs_per_worker} processes each{' (sharded)' * dist.shard_replica}"
                              if dist.procs_per_worker > 1 else ""])
            log.info("training %s on %s with %d workers (%s engine, %s, tau=%s%s) on %s; %s",
                     run.model, run.dataset if run.data is None else run.data, dist.workers, dist.engine.value,
                     dist.strategy.value, dist.tau, extras, spark.sparkContext.master,
                     f"{len(train) / dist.workers:.0f} rows per worker" if hasattr(train, "__len__") else
                     "the rows read where they live")
            age = process_age_s()
            result = trainer.fit(df, validation=scored_rows(test, info),
                                 weight_col=None if run.weight_col is None else "weight")
            summary = {"event": "summary", "model": run.model,
                       "dataset": run.dataset if run.data is None else run.data, "master": spark.sparkContext.master,
                       "steps": result.summary.get("total_steps"), **result.summary,
                       # what the command's user waited before the first round began (Python, the session, data)
                       "first_round_s": None if age is None else round(age + _first_round_start(result), 2)}
            if age is not None:  # when each step before the first round ended, in the command's seconds
                before = sorted(((k, v) for k, v in (ages or {}).items() if v is not None), key=lambda kv: kv[1])
                summary["phases_s"] = {**{k: round(v, 2) for k, v in before},  # as they happened (two threads)
                                       "fit": round(age, 2),
                                       **{k: round(age + v, 2) for k, v in result.summary["fit_phases_s"].items()},
                                       "first_round": summary["first_round_s"]}
            if "corpus" in info and summary.get("test_loss") is not None:
                summary["bits_per_char"] = summary["test_loss"] / np.log(2)
            metrics.write(summary)
        failed = False
    finally:
        finish_run(run, sinks, failed=failed, net_params=net_params, weights=result.weights if result else None,
                   solver=run.solver(), config=config, features=info.get("features"))
    return summary


def _first_round_start(result) -> float:
    """Seconds from the fit's start to its first round's (a barrier stage's launch included), or to its end."""
    first = next((h for h in result.history if h.get("event") == "round"), None)
    return result.summary["setup_s"] if first is None or "start_s" not in first else first["start_s"]


def _prepare(run: RunConfig, ages: dict):
    """The data set and the model; when the data set was read, in the command's seconds, into ``ages``. A ``--data``
    URI is Spark's to read, once the session is up: ``None`` for each."""
    train = test = info = net_params = None
    if not is_uri(run.data):
        train, test, info = load_training_data(run)
        ages["loaded"] = process_age_s()
        net_params = build_model(run, info)
        ages["built"] = process_age_s()
    try:  # what the session's first Java calls with arguments import, here while the JVM starts: pyspark's numpy
        import pyspark.testing.utils  # noqa: F401  converter asks this module whether numpy is there, and it
    except ImportError:  # imports pandas (0.3 s on the main thread's way to the session otherwise)
        pass
    return train, test, info, net_params

