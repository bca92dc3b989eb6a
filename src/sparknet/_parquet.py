"""Reading a Parquet data set (``features`` and ``label`` columns) without Spark.

Used by ``sparknet train --data PATH`` (a path, or a URI pyarrow reads) in one process and by the
parameter server, and for a path on the Spark engines' road (whose URIs Spark reads:
:func:`sparknet.spark.run.spark_table`). ``features`` may be a list of numbers or a Spark ML vector (stored
by Spark as a struct of type, size, indices and values). ``label`` holds class ids, or
arrays of them (``array<long>``, one per position) for a sequence model such as ``char_lstm``,
whose features are then token ids of the same vocabulary; for ``--task regression`` numbers (or arrays of
them, one a net output), and for ``--task multilabel`` arrays of 0s and 1s (or a 0 or 1: one output).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from sparknet._enums import Task
from sparknet.datasets import ArrayDataset
from sparknet.labels import bad_weights

__all__ = ["read_parquet_dataset", "features_to_numpy", "table_info", "feature_column", "arrow_feature_column"]

log = logging.getLogger(__name__)

TEST_FRACTION = 0.1


def features_to_numpy(column) -> np.ndarray:
    """A pyarrow column of lists or ML vectors as a float32 ``[rows, values]`` array."""
    col = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type) or pa.types.is_fixed_size_list(col.type):
        value_type = col.type.value_type
        if not (pa.types.is_integer(value_type) or pa.types.is_floating(value_type)):
            raise ValueError(f"the features column has type {col.type}; it must be an array of numbers or an ML Vector")
        if col.null_count:
            raise ValueError(f"the features column has {col.null_count} null rows; drop or fill them first")
        _check_widths(np.asarray(col.value_lengths()), "arrays")
        values = col.flatten()
        if values.null_count:
            import pyarrow.compute as pc

            parents = np.asarray(pc.list_parent_indices(col))[np.asarray(values.is_null())]
            raise ValueError(f"{len(np.unique(parents))} feature rows hold a null value (first: row {parents[0]}); "
                             "drop or fill them first")
        values = np.asarray(values, dtype=np.float32)
        return values.reshape(len(col), -1 if len(col) else 0)
    if pa.types.is_struct(col.type) and {"type", "values"} <= {f.name for f in col.type}:
        return _vectors_to_numpy(col.to_pylist())
    raise ValueError(f"the features column has type {col.type}; it must be an array of numbers or an ML Vector")


def _joined(table, columns: Sequence[str]) -> np.ndarray:
    """Feature columns (numbers, arrays or ML vectors) as one float32 ``[rows, values]``, joined in order."""
    parts = []
    for name in columns:
        column = table.column(name)
        if _is_number(column.type):
            if column.null_count:
                raise ValueError(f"the feature column {name!r} has {column.null_count} null values; drop or fill "
                                 "them first")
            parts.append(np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float32).reshape(-1, 1))
            continue
        try:
            parts.append(features_to_numpy(column))
        except ValueError as exc:
            raise ValueError(f"{exc} (feature column {name!r})") from None
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)


def feature_column(name: str, number: bool, values: str) -> dict:
    """What a model keeps of a column it trained on (its metadata's ``"features"``, which its MLflow signature reads):
    its name, whether it holds a number a row or an array (or ML vector), and what its values are (``"long"``,
    ``"double"`` or ``"boolean"``)."""
    return {"name": name, "kind": "number" if number else "array", "values": values}


def arrow_feature_column(name: str, arrow_type) -> dict:
    """:func:`feature_column` of a column of this Arrow type."""
    listed = pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or \
        pa.types.is_fixed_size_list(arrow_type)
    value = arrow_type.value_type if listed else arrow_type
    values = "long" if pa.types.is_integer(value) else "boolean" if pa.types.is_boolean(value) else "double"
    return feature_column(name, _is_number(arrow_type), values)


def _is_number(arrow_type) -> bool:
    return pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type) or pa.types.is_boolean(arrow_type)


def _check_widths(widths: np.ndarray, kind: str) -> None:
    """``ValueError`` unless every feature row holds as many values as row 0, and at least one."""
    if len(widths) and (widths != widths[0]).any():
        bad = int(np.argmax(widths != widths[0]))
        raise ValueError(f"feature rows differ in length: row 0 has {widths[0]} values, row {bad} has "
                         f"{widths[bad]}; every row needs the same number of values")
    if len(widths) and widths[0] == 0:
        raise ValueError(f"the feature rows are empty {kind}; every row needs at least one value")


MAX_VECTOR_SIZE = 1 << 24
"""The widest sparse ML vector read (its ``size``): it is made dense, so a small file could otherwise ask for
any amount of memory."""


def _vectors_to_numpy(rows: list) -> np.ndarray:
    """Spark ML vectors (type 0: sparse, with ``size`` and ``indices``; type 1: dense) as float32 ``[rows, size]``."""
    widths = []
    for i, r in enumerate(rows):
        if r is None or r.get("values") is None or r.get("type") not in (0, 1):
            raise ValueError(f"feature row {i} is not an ML vector ({r if r is None else dict(r)}); drop or fill it "
                             "first")
        if None in r["values"]:
            raise ValueError(f"feature row {i} holds a null value; drop or fill it first")
        if r["type"] == 1:
            widths.append(len(r["values"]))
            continue
        size, indices = r.get("size"), r.get("indices")
        if (size is None or not 0 <= size <= MAX_VECTOR_SIZE or indices is None or len(indices) != len(r["values"])
                or not all(j is not None and 0 <= j < size for j in indices)):
            raise ValueError(f"feature row {i} is a sparse ML vector whose size ({size}, at most {MAX_VECTOR_SIZE}) "
                             f"and indices ({indices}) do not fit its {len(r['values'])} values")
        widths.append(size)
    _check_widths(np.asarray(widths, dtype=np.int64), "vectors")
    out = np.zeros((len(rows), widths[0] if widths else 0), dtype=np.float32)
    with np.errstate(over="ignore"):  # a value beyond float32's range becomes inf, which the reader refuses
        for i, r in enumerate(rows):
            out[i, r["indices"] if r["type"] == 0 else slice(None)] = r["values"]
    return out


def read_parquet_dataset(path: str, features_col: str | Sequence[str] = "features",
                         label_col: str | Sequence[str] = "label", *,
                         validation: str | None = None, task: Task = Task.CLASSIFICATION,
                         weight_col: str | None = None):
    """``(train, test, info)`` from a Parquet file or folder (a path, or a URI pyarrow reads: ``file://``,
    ``s3://``/``s3a://``, ``gs://``, ``hdfs://``); the last 10% of rows are the test set, or, with ``validation``,
    every row trains and ``validation``'s rows (the same columns) are the test set. ``task``: what the labels are
    (class ids, numbers, or 0s and 1s; numbers, or 0s and 1s, may be several columns, joined in order into one array a
    row). ``weight_col``: a column of sample weights (numbers >= 0), as float32 ``info["weights"]``, one for each
    row of ``train``, and ``info["test_weights"]``, one for each test row (``validation``'s where it has the column;
    without it, its rows are scored unweighted).

    Raises
    ------
    FileNotFoundError
        Nothing is at ``path``.
    ValueError
        Naming ``path`` and what is wrong: not Parquet, a column missing or of another type, null
        values, NaN or infinite features, rows of different lengths, labels that are not class ids (not
        numbers, or not 0s and 1s, for ``task``), fewer than 2 rows, sample weights that are null, negative or not
        finite.
    """
    x, y, columns, weights = _read_arrays(path, features_col, label_col, task=task, weight_col=weight_col)
    if validation is None:
        n_test = max(1, int(len(x) * TEST_FRACTION))
        train, test = ArrayDataset(x[:-n_test], y[:-n_test]), ArrayDataset(x[-n_test:], y[-n_test:])
        weights, test_weights = (None, None) if weights is None else (weights[:-n_test], weights[-n_test:])
    else:
        train = ArrayDataset(x, y)
        tx, ty, _, test_weights = _read_arrays(validation, features_col, label_col, "--validation-data", task=task,
                                               weight_col=weight_col, weight_optional=True)
        test = ArrayDataset(tx, ty)
        if test.x.shape[1:] != x.shape[1:] or test.y.shape[1:] != y.shape[1:]:
            raise ValueError(f"{validation}: its rows hold {test.x.shape[1:]} features and {test.y.shape[1:]} labels "
                             f"each, {path}'s {x.shape[1:]} and {y.shape[1:]}: held-out rows are of the same table")
    log.info("read %d rows of %d features from %s (%d held out for testing%s)", len(train), x.shape[1], path,
             len(test), "" if validation is None else f", from {validation}")
    if task.float_labels:
        info = table_info(x.shape[1:], None, outputs=y.shape[1] if y.ndim == 2 else 1)
    else:
        info = table_info(x.shape[1:], max(int(y.max()), int(test.y.max())),
                          max(int(x.max()), int(test.x.max())) if y.ndim == 2 else None,
                          y.shape[1] if y.ndim == 2 else None)
    return train, test, {**info, "features": columns, **({} if weights is None else {"weights": weights}),
                         **({} if test_weights is None else {"test_weights": test_weights})}


def labels_with_weights(y: np.ndarray, weights) -> tuple[np.ndarray, int]:
    """Labels ``[n]`` or ``[n, L]`` and the rows' sample weights -> (float32 ``[n, L + 1]``, the weight last, as a
    net trained on weights takes its labels; how many weights are null, NaN, infinite or negative). Class ids stay
    exact: float32 holds whole numbers up to 2^24."""
    y = np.asarray(y)
    n = len(y)
    w = np.asarray(weights, dtype=np.float64).reshape(n)
    labels = y.reshape(n, y.shape[1] if y.ndim == 2 else 1).astype(np.float32)  # no rows: still L columns
    return np.column_stack([labels, w.astype(np.float32)]), bad_weights(w)


def table_info(sample_shape: tuple, label_max: int | None, feature_max: int | None = None, seq_len: int | None = None,
               *, outputs: int | None = None) -> dict:
    """What the model needs to know of a table: its sample's shape and classes; of a sequence table (labels of
    ``seq_len`` positions, features token ids of the same vocabulary: ``feature_max`` given), its vocabulary; of a
    table of numbers or label sets (``outputs`` given: how many a row holds), the width of its net's last layer."""
    if outputs is not None:
        return {"input_shape": tuple(sample_shape), "outputs": int(outputs)}
    info = {"input_shape": tuple(sample_shape), "num_classes": int(label_max) + 1}
    if seq_len is not None:
        vocab = max(int(feature_max), int(label_max)) + 1
        info.update(num_classes=vocab, vocab_size=vocab, seq_len=int(seq_len))
    return info


FOOTER_FILES = 64
"""The most files whose footers :func:`footer_facts` reads (one read each, on the driver)."""

SPARK_SCHEMA_KEY = b"org.apache.spark.sql.parquet.row.metadata"
"""Where a Parquet file Spark wrote keeps Spark's own schema (JSON), ML vectors' types included."""


@dataclass(frozen=True)
class FooterFacts:
    """What a Parquet table's footers say of it, with no column decoded but its first row's."""

    rows: int
    features: Any
    """The first row's features (a list)."""
    label: Any
    """The first row's label (a number or a list)."""
    largest: dict
    """The largest value of each leaf column (``label``, ``features``) that every row group gives statistics of
    (``None``: every value null)."""
    arrow_schema: pa.Schema
    spark_schema: str | None
    """Spark's schema of the table as JSON where Spark wrote it, else ``None``."""


def footer_facts(path: str, columns: Sequence[str] = ("features", "label")) -> FooterFacts | None:
    """The :class:`FooterFacts` of the Parquet file or folder at the local ``path`` (a file or a folder of at most
    :data:`FOOTER_FILES` files, none in a partition folder), read here without decoding the table; ``None`` where
    its footers cannot say (no such columns, a row group without statistics of them, a features column that is not
    a list, more files, partitions), and a reader that decodes the table must ask instead."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    try:
        files = [path] if os.path.isfile(path) else sorted(ds.dataset(path, format="parquet").files)
        if not files or len(files) > FOOTER_FILES or any("=" in os.path.relpath(f, path) for f in files):
            return None
        with contextlib.ExitStack() as stack:  # each file closed once its footer and first row are read
            opened = [stack.enter_context(pq.ParquetFile(f)) for f in files]
            return _facts(opened, columns)
    except (OSError, ValueError, pa.ArrowException) as exc:  # a reader that decodes the table says what is wrong
        log.debug("reading the footers of %s: %s", path, exc)
        return None


def _facts(opened: list, columns: Sequence[str]) -> FooterFacts | None:
    """:func:`footer_facts` of the open Parquet files ``opened``."""
    schema = opened[0].schema_arrow
    if not all(c in schema.names for c in columns) or not pa.types.is_list(schema.field(columns[0]).type):
        return None
    largest: dict = dict.fromkeys(columns)  # None: no value seen yet
    unknown: set = set()  # a row group holds values its statistics do not bound
    rows = 0
    for parquet in opened:
        meta = parquet.metadata
        rows += meta.num_rows
        leaves = {meta.schema.column(i).path.split(".")[0]: i for i in range(meta.num_columns)}
        for name in columns:
            for g in range(meta.num_row_groups):
                chunk = meta.row_group(g).column(leaves[name])
                stats = chunk.statistics
                if stats is not None and stats.has_min_max:
                    largest[name] = stats.max if largest[name] is None else max(largest[name], stats.max)
                elif stats is None or stats.null_count != chunk.num_values:  # not a row group of nulls only
                    unknown.add(name)
    first = next((b for p in opened for b in p.iter_batches(batch_size=1, columns=list(columns))
                  if b.num_rows), None)
    if first is None:
        return None
    spark = (schema.metadata or {}).get(SPARK_SCHEMA_KEY)
    features, label = (first.column(i)[0].as_py() for i in range(2))
    return FooterFacts(rows, features, label, {k: v for k, v in largest.items() if k not in unknown}, schema,
                       spark.decode() if spark is not None else None)


def _read_arrays(path: str, features_col: str | Sequence[str], label_col: str | Sequence[str], flag: str = "--data", *,
                 task: Task = Task.CLASSIFICATION, weight_col: str | None = None, weight_optional: bool = False):
    """The features and labels of the Parquet file or folder at ``path`` (a path or a URI), checked, its feature
    columns (:func:`feature_column`), and the float32 weights of ``weight_col`` (``None`` without, or, with
    ``weight_optional``, where the table has no such column)."""
    import pyarrow.parquet as pq
    from pyarrow import fs as pafs

    from sparknet._fs import filesystem

    fs, inner = filesystem(path)
    if fs.get_file_info(inner).type is pafs.FileType.NotFound:
        raise FileNotFoundError(f"no Parquet data at {path}")
    try:
        table = pq.read_table(inner, filesystem=fs)
    except (OSError, ValueError, pa.ArrowException) as exc:  # ArrowInvalid is a ValueError; not all of Arrow's are
        raise ValueError(f"cannot read {path} as Parquet ({exc}); point {flag} at a Parquet file or a folder "
                         "of Parquet files") from exc
    try:
        x, y = _arrays(table, features_col, label_col, task)
        if weight_optional and weight_col is not None and weight_col not in table.column_names:
            log.warning("%s %s has no weight column %r: its rows are scored unweighted", flag, path, weight_col)
            weight_col = None
        weights = None if weight_col is None else _weights(table, weight_col)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    names = [features_col] if isinstance(features_col, str) else list(features_col)
    return x, y, [arrow_feature_column(name, table.schema.field(name).type) for name in names], weights


def _weights(table, weight_col: str) -> np.ndarray:
    """A table's column of sample weights as float32, checked: numbers, none null, negative or not finite."""
    if weight_col not in table.column_names:
        raise ValueError(f"the table has no weight column {weight_col!r} (columns: {table.column_names})")
    column = table.column(weight_col)
    if not _is_number(column.type):
        raise ValueError(f"weight column {weight_col!r} has type {column.type}; sample weights are numbers")
    w = np.asarray(column.cast(pa.float64()).fill_null(np.nan).to_numpy(), dtype=np.float64)
    if bad := bad_weights(w):
        raise ValueError(f"{bad} rows have a null, NaN, infinite or negative sample weight; weights are numbers >= 0")
    return w.astype(np.float32)


def _arrays(table, features_col: str | Sequence[str], label_col: str | Sequence[str],
            task: Task = Task.CLASSIFICATION) -> tuple[np.ndarray, np.ndarray]:
    """The features (float32 ``[rows, values]``; of several columns, joined in order) and labels (int64 class ids;
    float32 numbers or 0s and 1s, as ``task`` says, of several columns joined in order) of a table, checked for
    training."""
    columns = [features_col] if isinstance(features_col, str) else list(features_col)
    labels = [label_col] if isinstance(label_col, str) else list(label_col)
    for col in (*columns, *labels):
        if col not in table.column_names:
            raise ValueError(f"the table has no column {col!r} (columns: {table.column_names}); it needs "
                             f"{', '.join(map(repr, columns))} (an array of numbers or an ML Vector, or numbers) "
                             f"and {', '.join(map(repr, labels))} (the labels)")
    x = _joined(table, columns)
    if len(labels) > 1 and not task.float_labels:
        raise ValueError(f"the label columns {', '.join(map(repr, labels))} are several: class ids are one column")
    if len(labels) > 1:  # each a number (or an array of them) a row, joined in order
        y = np.concatenate([_values_to_numpy(table.column(c), c, task).reshape(len(x), -1) for c in labels], axis=1)
    elif task.float_labels:
        y = _values_to_numpy(table.column(label_col), label_col, task)
    else:
        y = _labels_to_numpy(table.column(label_col), label_col)
    if y.ndim == 2 and y.shape[1] != x.shape[1] and not task.float_labels:
        raise ValueError(f"the label column {label_col!r} holds {y.shape[1]} ids per row but the features hold "
                         f"{x.shape[1]} values; a sequence needs one label per position: cut both to one length")
    bad = int(len(x) - np.isfinite(x).all(axis=1).sum()) if x.size else 0
    if bad:
        raise ValueError(f"{bad} feature rows hold NaN or infinite values; clean or impute them first")
    if len(x) < 2:
        raise ValueError(f"the table has {len(x)} rows; at least 2 are needed (one to train, one to test)")
    if task.float_labels:
        return x, y
    if y.ndim == 2 and not np.all((x >= 0) & (x == np.round(x))):
        raise ValueError(f"the label column {label_col!r} holds one id per position (a sequence) but the "
                         "features are not all token ids (whole numbers 0, 1, 2, ...)")
    if y.ndim == 2 and x.max() >= MAX_CLASS_ID:
        raise ValueError(f"the features hold token id {x.max():.0f}; ids of a sequence must be below {MAX_CLASS_ID}")
    return x, y


def _label_array(column, label_col: str, unit: str, rule: str) -> tuple[np.ndarray, pa.DataType]:
    """A label column's values, ``[rows]`` or, of arrays (the same length in every row: ``rule`` says why),
    ``[rows, length]``, with their Arrow type; null values refused (``unit``: what one value is called)."""
    col = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if col.null_count:
        raise ValueError(f"the label column {label_col!r} has {col.null_count} null values; drop those rows first")
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type) or pa.types.is_fixed_size_list(col.type)):
        return np.asarray(col.to_numpy(zero_copy_only=False)), col.type
    lengths = np.asarray(col.value_lengths())
    if len(lengths) and ((lengths != lengths[0]).any() or lengths[0] == 0):
        bad = int(np.argmax(lengths != lengths[0]))  # 0 when every row is empty
        raise ValueError(f"label rows of {label_col!r} differ in length: row 0 has {lengths[0]} {unit}, row {bad} has "
                         f"{lengths[bad]}; {rule}")
    values = col.flatten()
    if values.null_count:
        raise ValueError(f"the label column {label_col!r} has {values.null_count} null {unit} inside its arrays; "
                         "drop or fill those rows first")
    return np.asarray(values.to_numpy(zero_copy_only=False)).reshape(len(col), -1 if len(col) else 0), values.type


def _values_to_numpy(column, label_col: str, task: Task) -> np.ndarray:
    """A label column of numbers (``task`` regression) or of 0s and 1s (multilabel) as float32 ``[rows]`` (one a
    row) or ``[rows, outputs]`` (arrays, the same length in every row)."""
    what = "numbers" if task is Task.REGRESSION else "0s and 1s, one for each label"
    y, kind = _label_array(column, label_col, "values", "every row needs as many as the net has outputs")
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
        raise ValueError(f"the label column {label_col!r} has type {column.type}; --task {task.value} needs {what} "
                         "(or arrays of them)")
    y = y.astype(np.float32)
    if not np.isfinite(y).all():
        raise ValueError(f"{int((~np.isfinite(y)).sum())} labels in column {label_col!r} are NaN or infinite "
                         "(or beyond float32's range); clean or impute them first")
    if task is Task.MULTILABEL and not np.isin(y, (0.0, 1.0)).all():
        raise ValueError(f"the label column {label_col!r} holds values other than 0 and 1 (from {y.min():g} to "
                         f"{y.max():g}); --task multilabel needs {what}")
    return y


MAX_CLASS_ID = 1 << 31
"""Class ids (and a sequence's token ids) must be below this."""


def _labels_to_numpy(column, label_col: str) -> np.ndarray:
    """A label column as int64 ``[rows]`` (class ids) or ``[rows, positions]`` (array<long>: a sequence)."""
    y_raw, _ = _label_array(column, label_col, "ids", "a sequence needs one label per position, the same in "
                            "every row")
    if not np.issubdtype(y_raw.dtype, np.number):
        raise ValueError(f"the label column {label_col!r} is not numeric ({column.type}); it must hold class ids "
                         "0, 1, 2, ... (or arrays of them, one per position of a sequence)")
    if y_raw.size and (np.any(y_raw != np.round(y_raw)) or np.any(y_raw < 0)):
        raise ValueError(f"the label column {label_col!r} must hold class ids 0, 1, 2, ... (it holds values from "
                         f"{y_raw.min()} to {y_raw.max()}, not all whole and non-negative)")
    if y_raw.size and y_raw.max() >= MAX_CLASS_ID:  # a float 1e30 or a uint64 would not even fit an int64
        raise ValueError(f"the label column {label_col!r} holds {y_raw.max()}; class ids must be below {MAX_CLASS_ID}")
    return y_raw.astype(np.int64)
