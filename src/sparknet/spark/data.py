"""Training data from Spark into numpy arrays, checked before any training starts.

Driver side, :func:`chunk_rdd` turns a DataFrame (a feature column of ``array<number>``, an
ML ``Vector``, or ``binary`` plus an image shape; an integer or integral-double label column,
or an ``array<long>`` label column for a sequence model, one class id per position) or an RDD
of ``(ndarray, label)`` into an RDD of *chunks* with one partition per worker::

    Chunk(x: float32 [m, L], y: int64 [m] or [m, T], counts: ChunkCounts)

DataFrames convert through Arrow (``mapInArrow``), never row by row. ``info`` counts what is
wrong with the chunk's rows (lengths, nulls, NaN, non-integral labels, label lengths, label range);
:func:`check_stats` turns those counts into one clear ``ValueError`` on the driver before a
single step is trained. Executor side, :func:`write_chunks` writes a partition's chunks to a row
file one at a time (both engines train from it) and :func:`merge_chunks` concatenates them in
memory; both sum their counts.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, NamedTuple

import numpy as np

from sparknet._enums import DataMode, parse_enum
from sparknet.rowfile import RowFile, RowFileWriter
from sparknet.spark.backend import run_with_deadline
from sparknet.labels import Task

__all__ = ["FeatureSource", "Chunk", "ChunkCounts", "chunk_rdd", "merge_chunks", "write_chunks", "DataMode",
           "choose_data_mode", "task_memory", "check_stats", "checked_partitions", "partition_stats", "head_rows",
           "local_arrays", "collect_arrays", "describe_skew", "arrays_table", "frame_from_arrays", "CHUNK_BYTES"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 32 << 20
"""Largest feature payload of one chunk (Arrow binary values must stay far below 2 GiB)."""
SHIP_BYTES = 8 << 20
"""Largest uncompressed piece of local arrays :func:`frame_from_arrays` sends as one row."""
_MAX_EXAMPLES = 4


@dataclass(frozen=True)
class FeatureSource:
    """How the feature column is read: its kind and, when known, the values per row."""

    kind: str
    """``array`` (lists and ML vectors, read as array<float>), ``binary`` or ``pairs`` (an RDD)."""
    expected_len: int | None
    """Values per row the net takes (``None``: whatever the data has, the same in every row)."""
    description: str
    """What the user gave, for messages."""


# -- executor side: chunks ----------------------------------------------------------------------
PROBLEM_KEYS = ("bad_rows", "null_x", "nonfinite", "null_y", "nonint_y", "nonfinite_y", "bad_w", "not_pairs",
                "bad_labels")
"""Counts of rows a partition cannot train on (any one refuses the fit); ``bad_labels``: rows whose label does not
have the length the other rows' labels have."""
_COUNTS = ("rows", *PROBLEM_KEYS)
_EXAMPLES = ("lengths", "shapes", "label_lengths")
"""Up to :data:`_MAX_EXAMPLES` values seen; ``label_lengths``: labels per row (0: one class id; T: one per position
of a sequence)."""


@dataclass
class ChunkCounts:
    """What a chunk's rows hold and what is wrong with them; summed per partition and over the data set
    (:meth:`add`), and turned into one clear error by :func:`check_stats`."""

    rows: int = 0
    bad_rows: int = 0
    null_x: int = 0
    nonfinite: int = 0
    null_y: int = 0
    nonint_y: int = 0
    nonfinite_y: int = 0
    bad_w: int = 0
    not_pairs: int = 0
    bad_labels: int = 0
    lengths: list = field(default_factory=list)
    shapes: list = field(default_factory=list)
    label_lengths: list = field(default_factory=list)
    y_min: float | None = None
    y_max: float | None = None
    label_col: str | None = None

    def add(self, other: ChunkCounts) -> ChunkCounts:
        """Add another chunk's (or partition's) counts."""
        for key in _COUNTS:
            setattr(self, key, getattr(self, key) + getattr(other, key))
        for key in _EXAMPLES:
            self.example(key, *getattr(other, key))
        if other.y_min is not None:
            self.range(other.y_min, other.y_max)
        self.label_col = self.label_col or other.label_col
        return self

    def example(self, key: str, *values) -> None:
        seen = getattr(self, key)
        for value in values:
            if value not in seen and len(seen) < _MAX_EXAMPLES:
                seen.append(value)

    def range(self, lo, hi) -> None:
        self.y_min = lo if self.y_min is None else min(lo, self.y_min)
        self.y_max = hi if self.y_max is None else max(hi, self.y_max)

    @property
    def refused(self) -> bool:
        """Whether any row is one the fit cannot train on."""
        return any(getattr(self, key) for key in PROBLEM_KEYS)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: Mapping) -> ChunkCounts:
        """The counts of a record (JSON, or a partition's record, whose host, folder and index are left out)."""
        return cls(**{f.name: record[f.name] for f in fields(cls) if f.name in record})


class Chunk(NamedTuple):
    """Some rows of a partition, as the engines read them."""

    x: np.ndarray
    """float32 ``[m, L]``."""
    y: np.ndarray
    """int64 class ids ``[m]`` (or ``[m, T]``, one per position), or float32 targets."""
    counts: ChunkCounts


def _labels(y_raw: np.ndarray, info: ChunkCounts, float_labels: bool = False) -> np.ndarray:
    """Count label problems; return labels of the same shape (garbage where a problem was counted):
    int64 class ids, or float32 numbers with ``float_labels``."""
    if y_raw.ndim > 1:
        return _labels(y_raw.reshape(-1), info, float_labels).reshape(y_raw.shape)
    if float_labels:
        if y_raw.dtype.kind not in "biuf":
            info.nonfinite_y += len(y_raw)
            return np.zeros(len(y_raw), np.float32)
        y = y_raw.astype(np.float32)
        finite = np.isfinite(y)
        info.nonfinite_y += int(len(y) - finite.sum())
        if finite.any():
            info.range(float(y[finite].min()), float(y[finite].max()))
        return y
    if y_raw.dtype.kind == "f":
        finite = np.isfinite(y_raw)
        integral = finite & (np.floor(y_raw) == y_raw)
        info.nonint_y += int(len(y_raw) - integral.sum())
        y = np.where(integral, y_raw, 0).astype(np.int64)
    elif y_raw.dtype.kind in "iub":
        y = y_raw.astype(np.int64, copy=False)
    else:
        info.nonint_y += len(y_raw)
        y = np.zeros(len(y_raw), np.int64)
    if len(y):
        info.range(int(y.min()), int(y.max()))
    return y


def _finish(x: np.ndarray, y: np.ndarray, info: ChunkCounts) -> Chunk:
    info.rows += len(y)
    if x.size:
        info.nonfinite += int(len(x) - np.isfinite(x).all(axis=1).sum())
    return Chunk(x, y, info)


def _rows_with_nulls(lists, values) -> int:
    """How many rows of an Arrow list array (``values``: its flattened values) hold a null."""
    import pyarrow.compute as pc

    parents = np.asarray(pc.list_parent_indices(lists).to_numpy(zero_copy_only=False))
    return int(len(np.unique(parents[np.asarray(values.is_null().to_numpy(zero_copy_only=False))])))


def _refused(info: ChunkCounts, key: str, count: int, width: int, y: np.ndarray):
    """Count ``count`` unusable rows under ``key``; the batch becomes a chunk of no rows."""
    setattr(info, key, getattr(info, key) + count)
    return _finish(np.empty((0, width), np.float32), y[:0], info)


def _arrow_sequence_labels(labels, info: ChunkCounts, float_labels: bool = False) -> np.ndarray | None:
    """A list column of per-position labels -> int64 ``[n, T]``, or ``None`` when a row is unusable (counted)."""
    n = len(labels)
    if labels.null_count:
        info.null_y += labels.null_count
        return None
    lengths = np.asarray(labels.value_lengths().to_numpy(zero_copy_only=False), dtype=np.int64)
    info.example("label_lengths", *np.unique(lengths)[:_MAX_EXAMPLES].tolist())
    if n == 0:
        return np.zeros((0, 0), np.int64)
    width = int(lengths[0])
    bad = int(((lengths != width) | (lengths == 0)).sum())
    if bad:
        info.bad_labels += bad
        return None
    values = labels.flatten()
    if values.null_count:  # a null inside a label array: no class to train on at that position
        info.null_y += _rows_with_nulls(labels, values)
        return None
    return _labels(np.asarray(values.to_numpy(zero_copy_only=False)).reshape(n, width), info, float_labels)


_ENCODED = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM")
"""How an encoded image file begins (PNG, JPEG, GIF, BMP): such bytes are decoded, not read as pixels."""


def _decode_images(values: list[bytes], image_shape, info: ChunkCounts) -> np.ndarray | None:
    """Encoded image files -> float32 ``[n, C*H*W]`` pixels in [0, 1] (C 1: grey, 3: RGB, 4: RGBA), or
    ``None`` when a file cannot be decoded to ``image_shape`` (counted as bad rows)."""
    import io

    from PIL import Image  # executors import it only when they decode files

    c, h, w = (int(d) for d in image_shape)
    mode = {1: "L", 3: "RGB", 4: "RGBA"}.get(c)
    out = np.empty((len(values), c * h * w), np.float32)
    for i, raw in enumerate(values):
        try:
            with Image.open(io.BytesIO(raw)) as img:
                pixels = np.asarray(img.convert(mode) if mode else img)
        except Exception:
            pixels = None
        if pixels is None or mode is None or pixels.shape[:2] != (h, w):
            info.bad_rows += len(values) - i
            info.example("lengths", -1 if pixels is None else int(pixels.size))
            return None
        out[i] = (pixels.reshape(h, w, c).transpose(2, 0, 1).reshape(-1) / np.float32(255.0))
    return out


def _spark_image_pixels(data: np.ndarray, n: int, image_shape) -> np.ndarray:
    """Spark's image source (rows of height x width x channels bytes, BGR(A)) -> float32 ``[n, C*H*W]`` RGB(A)."""
    c, h, w = (int(d) for d in image_shape)
    hwc = data.reshape(n, h, w, c)
    if c in (3, 4):
        hwc = hwc[..., [2, 1, 0, *range(3, c)]]
    return hwc.transpose(0, 3, 1, 2).reshape(n, c * h * w).astype(np.float32) / np.float32(255.0)


def _arrow_batch(batch, kind: str, expected_len: int | None, image_numel: int | None, float_labels: bool = False,
                 image_shape=None):
    """One Arrow batch of (features, label) -> (x, y, info); the label is a number or a list of numbers.

    Binary features are uint8 pixels or float32 values of ``image_numel``, or encoded image files
    (PNG, JPEG, GIF, BMP; decoded to ``image_shape``); ``kind`` ``image`` is Spark's image source."""
    import pyarrow as pa

    info = ChunkCounts()
    feats, labels = batch.column(0), batch.column(1)
    n = len(batch)
    if pa.types.is_list(labels.type) or pa.types.is_large_list(labels.type):
        y = _arrow_sequence_labels(labels, info, float_labels)
        if y is None:
            return _finish(np.empty((0, expected_len or 0), np.float32), np.zeros((0, 0), np.int64), info)
    else:
        info.null_y += labels.null_count
        info.example("label_lengths", 0)
        y = _labels(np.asarray(labels.fill_null(0).to_numpy(zero_copy_only=False)), info, float_labels)
    if feats.null_count:
        return _refused(info, "null_x", feats.null_count, expected_len or 0, y)
    if n == 0:
        return _finish(np.empty((0, expected_len or 0), np.float32), y, info)
    if kind in ("binary", "image"):
        offsets = np.frombuffer(feats.buffers()[1], dtype=np.int32)[feats.offset:feats.offset + n + 1]
        lengths = np.diff(offsets)
        numel = image_numel
        data = np.frombuffer(feats.buffers()[2], dtype=np.uint8)
        encoded = kind == "binary" and bytes(data[offsets[0]:offsets[0] + 8]).startswith(_ENCODED)
        if encoded and image_shape is not None:
            x = _decode_images([bytes(data[a:b]) for a, b in zip(offsets[:-1], offsets[1:])], image_shape, info)
            return _finish(np.empty((0, numel), np.float32) if x is None else x, y[:0] if x is None else y, info)
        info.example("lengths", *np.unique(lengths)[:_MAX_EXAMPLES].tolist())
        ok = (lengths == numel) | ((lengths == 4 * numel) & (kind == "binary"))  # the image source: uint8 only
        if not ok.all():
            return _refused(info, "bad_rows", int(n - ok.sum()), numel, y)
        if not (lengths == lengths[0]).all():  # uint8 and float32 rows mixed
            return _refused(info, "bad_rows", int(n - (lengths == lengths[0]).sum()), numel, y)
        data = data[offsets[0]:offsets[-1]]
        if kind == "image":
            return _finish(_spark_image_pixels(data, n, image_shape), y, info)
        if lengths[0] == numel:
            x = data.reshape(n, numel).astype(np.float32) / np.float32(255.0)
        else:
            x = data.view("<f4").reshape(n, numel).astype(np.float32, copy=True)
        return _finish(x, y, info)
    # list<float>
    lengths = np.asarray(feats.value_lengths().to_numpy(zero_copy_only=False), dtype=np.int64)
    info.example("lengths", *np.unique(lengths)[:_MAX_EXAMPLES].tolist())
    want = expected_len if expected_len is not None else (int(lengths[0]) if n else 0)
    bad = int((lengths != want).sum())
    if bad:
        return _refused(info, "bad_rows", bad, want, y)
    values = feats.flatten()
    if values.null_count:  # a null inside a feature array: no number to train on
        return _refused(info, "null_x", _rows_with_nulls(feats, values), want, y)
    x = np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.float32).reshape(n, want)
    return _finish(x, y, info)


_CHUNK_SCHEMA = "x binary, y binary, width long, label_width long, info string"


def _with_weights(y: np.ndarray, weights, info: ChunkCounts) -> np.ndarray:
    """Labels ``[n]`` or ``[n, L]`` and an Arrow column of sample weights -> float32 ``[n, L + 1]``, the weight
    last (:func:`sparknet._parquet.labels_with_weights`). Null, NaN, infinite or negative weights are counted."""
    from sparknet._parquet import labels_with_weights

    # a refused piece keeps no rows, so none of its weights
    out, bad = labels_with_weights(y, weights.fill_null(np.nan).to_numpy(zero_copy_only=False) if len(y) else [])
    info.bad_w += bad
    return out


def split_weights(y: np.ndarray, label_width: int, float_labels: bool) -> tuple[np.ndarray, np.ndarray]:
    """Float32 labels with each row's sample weight last (:func:`_with_weights`) -> (the labels: ``[n]`` where
    ``label_width`` is 0, one label a row, else ``[n, label_width]``; float32 with ``float_labels``, else int64 class
    ids) and the weights as float64."""
    labels, w = y[:, :-1], y[:, -1].astype(np.float64)
    labels = labels if label_width else labels[:, 0]
    return (labels if float_labels else labels.astype(np.int64)), w


@dataclass(frozen=True)
class ArrowChunks:
    """Arrow batches of (features, label[, weight]) -> chunks. :meth:`chunks` gives them to a task that uses them
    where they are made (the stage jobs write them to disk); the instance is the ``mapInArrow`` function that makes
    them rows of chunk bytes for Spark (read them back with :func:`frame_chunks`).

    ``label_width`` is 0 for one label per row, else the labels per row (a sequence, or a vector to
    regress); labels are int64 class ids, or float32 numbers with ``float_labels``. ``weighted``:
    float32 labels with each row's sample weight as one more, last, value (:func:`_with_weights`).
    ``chunk_bytes``: the most feature bytes of one chunk (:func:`chunk_bytes_for`).
    """

    kind: str
    expected_len: int | None
    image_numel: int | None
    label_col: str | None = None
    float_labels: bool = False
    image_shape: tuple | None = None
    weighted: bool = False
    chunk_bytes: int = CHUNK_BYTES

    def chunks(self, batches: Iterable) -> Iterator[Chunk]:
        """The chunks of ``batches``, as :func:`frame_chunks` reads them from this function's rows."""
        row_bytes = max(1, (self.expected_len or self.image_numel or 1) * 4)
        step = max(1, self.chunk_bytes // row_bytes)
        for batch in batches:
            for start in range(0, max(len(batch), 1), step):
                piece = batch.slice(start, step)
                x, y, info = _arrow_batch(piece, self.kind, self.expected_len, self.image_numel, self.float_labels,
                                          self.image_shape)
                if self.weighted:
                    y = _with_weights(y, piece.column(2), info)
                info.label_col = self.label_col
                yield Chunk(x, y, info)

    def __call__(self, batches: Iterator) -> Iterator:
        import pyarrow as pa  # executors import it only when they convert

        for x, y, info in self.chunks(batches):
            yield pa.RecordBatch.from_arrays(
                [pa.array([x.tobytes()], pa.binary()), pa.array([y.tobytes()], pa.binary()),
                 pa.array([x.shape[1] if x.ndim == 2 else 0], pa.int64()),
                 pa.array([y.shape[1] if y.ndim == 2 else 0], pa.int64()), pa.array([json.dumps(info.to_dict())])],
                names=["x", "y", "width", "label_width", "info"])


def _row_to_chunk(row, label_dtype=np.int64) -> Chunk:
    """A chunk row (a Spark ``Row`` or a dict of one) -> ``(x, y, info)``."""
    y = np.frombuffer(row["y"], dtype=label_dtype)
    label_width = int(row["label_width"])
    if label_width:
        y = y.reshape(-1, label_width)
    x = np.frombuffer(row["x"], dtype=np.float32).reshape(len(y), int(row["width"]))
    return Chunk(x, y, ChunkCounts.from_dict(json.loads(row["info"])))


def pair_chunks(expected_len: int | None, chunk_rows: int = 4096, float_labels: bool = False):
    """An RDD partition of ``(ndarray, label)`` pairs -> chunks.

    A label is one class id, or a 1-D array of class ids (one per position of a sequence);
    every pair of a partition must have the same kind and length of label.
    """

    def convert(items: Iterable) -> Iterator:
        xs, ys = [], []
        info = ChunkCounts()
        label_width = None  # 0: one class id per pair; T: T labels per pair

        def flush():
            nonlocal xs, ys, info
            empty = (0, label_width) if label_width else (0,)
            y_raw = np.asarray(ys) if ys else np.zeros(empty, np.int64)
            if y_raw.dtype == object:
                info.nonint_y += y_raw.size
                y_raw = np.zeros(y_raw.shape, np.int64)
            y = _labels(y_raw, info, float_labels)
            width = len(xs[0]) if xs else (expected_len or 0)
            x = np.stack(xs) if xs else np.empty((0, width), np.float32)
            out = _finish(x, y, info)
            xs, ys, info = [], [], ChunkCounts()
            return out

        width = expected_len
        for item in items:
            try:
                a, label = item
            except (TypeError, ValueError):
                info.not_pairs += 1
                continue
            if a is None:
                info.null_x += 1
                continue
            if label is None:
                info.null_y += 1
                continue
            label_ndim = np.ndim(label)
            this_width = 0 if label_ndim == 0 else int(np.size(label))
            if label_width is None:
                label_width = this_width
            info.example("label_lengths", this_width)
            if label_ndim > 1 or this_width != label_width or (label_ndim == 1 and this_width == 0):
                info.bad_labels += 1
                continue
            arr = np.asarray(a)
            if arr.dtype == object or arr.dtype.kind not in "biuf":
                info.not_pairs += 1
                continue
            info.example("shapes", list(arr.shape))
            flat = arr.astype(np.float32, copy=False).reshape(-1)
            if width is None:
                width = flat.size
            info.example("lengths", int(flat.size))
            if flat.size != width:
                info.bad_rows += 1
                continue
            xs.append(flat)
            ys.append(np.asarray(label) if label_ndim else label.item() if hasattr(label, "item") else label)
            if len(xs) >= chunk_rows:
                yield flush()
        yield flush()

    return convert


def merge_chunks(chunks: Iterable) -> tuple[np.ndarray | None, np.ndarray | None, ChunkCounts]:
    """All chunks of a partition -> (x [n, L], y [n] or [n, T], summed counts). ``x`` is ``None`` for no rows."""
    xs, ys = [], []
    total = ChunkCounts()
    for x, y, info in chunks:
        total.add(info)
        if len(y):
            xs.append(x)
            ys.append(y)
    if len({x.shape[1] for x in xs}) > 1:
        total.bad_rows += sum(len(y) for y in ys)
        return None, None, total
    if len({y.shape[1:] for y in ys}) > 1:
        total.bad_labels += sum(len(y) for y in ys)
        return None, None, total
    if not xs:
        return None, None, total
    x = xs[0] if len(xs) == 1 else np.concatenate(xs)
    y = ys[0] if len(ys) == 1 else np.concatenate(ys)
    return x, y, total


def write_chunks(stem: str, chunks: Iterable) -> tuple[RowFile | None, dict]:
    """A partition's chunks -> a :class:`~sparknet.rowfile.RowFile` at ``stem`` (one chunk held at a time) and
    the record of its summed :class:`ChunkCounts`. Nothing is kept for a partition with no rows or with
    problems :func:`check_stats` refuses."""
    total = ChunkCounts()
    rows, writer = RowFileWriter.write(stem, chunks, on_chunk=lambda chunk: total.add(chunk.counts))
    total.bad_rows += writer.bad_rows
    total.bad_labels += writer.bad_labels
    if rows is not None and total.refused:
        rows.remove()
        rows = None
    return rows, total.to_dict()


# -- driver side: in memory or streamed ---------------------------------------------------------
STREAM_FRACTION = 0.5
"""``auto`` streams a partition whose rows take more than this share of the memory one task has."""
def task_memory(sc) -> tuple[int, str]:
    """Bytes of memory one training task has, and how that was worked out.

    ``spark.executor.pyspark.memory`` (the Python workers' own limit) if set, else the executor's memory
    (the driver's on a ``local[...]`` master), shared by the tasks one executor runs at once. ``sc`` may be a
    Spark Connect session (its settings are the server's).
    """
    from sparknet.spark.session import executor_slots, is_local_master, parse_memory, session_master, spark_setting

    master = session_master(sc).strip()
    slots = executor_slots(master) or int(spark_setting(sc, "spark.executor.cores") or "1")
    in_driver = is_local_master(master) and not master.startswith("local-cluster")  # local[...]: one JVM
    key = "spark.executor.pyspark.memory"
    value = spark_setting(sc, key)
    if value is None:
        key = "spark.driver.memory" if in_driver else "spark.executor.memory"
        value = spark_setting(sc, key) or "1g"
    return parse_memory(value) // max(1, slots), f"{key} {value} over {slots} task slot(s)"


def chunk_bytes_for(sc) -> int:
    """Feature bytes of one chunk on this cluster: :data:`CHUNK_BYTES`, or a 64th of the memory one task has
    when that is less (the executor's JVM holds a few copies of a chunk while it hands it to Python: a 512 MiB
    executor runs out of heap on 32 MiB chunks), at least 1 MiB."""
    return max(1 << 20, min(CHUNK_BYTES, task_memory(sc)[0] // 64))


def choose_data_mode(requested, partition_bytes: int, sc, *,
                     held: str = "the largest partition's rows") -> tuple[DataMode, str]:
    """``memory`` or ``stream`` for a fit where a process would hold ``partition_bytes`` of rows in memory (``held``
    says which), and why."""
    mode = parse_enum(DataMode, requested, "data mode")
    size = f"{held} take {partition_bytes / 2**20:,.0f} MiB"
    if mode is not DataMode.AUTO:
        return mode, f"{mode.value} as asked; {size}"
    budget, source = task_memory(sc)
    if partition_bytes > STREAM_FRACTION * budget:
        return DataMode.STREAM, (f"streamed from local disk: {size}, more than {STREAM_FRACTION:.0%} of the "
                                 f"{budget / 2**20:,.0f} MiB one task has ({source})")
    return DataMode.MEMORY, f"in memory: {size}, at most {STREAM_FRACTION:.0%} of the {budget / 2**20:,.0f} MiB one " \
                            f"task has ({source})"


# -- driver side --------------------------------------------------------------------------------
def feature_column(df, features_col) -> tuple:
    """(column expression, kind) for a DataFrame's feature column, or for a list of columns (numbers, arrays or ML
    vectors) concatenated in order into one array<float>: kind ``"array"`` (array<float>), ``"binary"`` (the bytes)
    or ``"image"`` (Spark's image source: its ``data`` bytes). The shape of bytes is the caller's to know
    (:func:`_feature_expr` checks it is given); any other type is refused by name."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if isinstance(features_col, (list, tuple)):
        if not features_col:
            raise ValueError("features_col is an empty list; name at least one feature column")
        parts = [_column_array(df, name, "feature column {name!r} is binary: only numbers, arrays and ML "
                                         "vectors can be concatenated with other columns")[0]
                 for name in features_col]
        return (parts[0] if len(parts) == 1 else F.concat(*parts)), "array"
    dtype = _column_type(df, features_col, "feature")
    if isinstance(dtype, T.ArrayType) and _is_number(dtype.elementType):
        return F.col(features_col).cast(T.ArrayType(T.FloatType())), "array"
    if type(dtype).__name__ == "VectorUDT":
        from pyspark.ml.functions import vector_to_array

        return vector_to_array(F.col(features_col), "float32"), "array"
    if isinstance(dtype, T.BinaryType):
        return F.col(features_col), "binary"
    if isinstance(dtype, T.StructType) and {"data", "height", "width", "nChannels"} <= set(dtype.fieldNames()):
        return F.col(features_col).getField("data"), "image"
    raise ValueError(f"feature column {features_col!r} has type {dtype.simpleString()}; expected array<float>, "
                     "array<double>, an ML Vector, or binary with image_shape")


def _feature_expr(df, features_col, image_shape):
    """:func:`feature_column`, binary and image columns given the ``image_shape`` their bytes are read in."""
    expr, kind = feature_column(df, features_col)
    if kind == "binary" and not image_shape:
        raise ValueError(f"feature column {features_col!r} is binary: pass image_shape= (e.g. [1, 28, 28]) "
                         "so its bytes can be read as uint8 pixels, float32 values or encoded image files")
    if kind == "image" and (not image_shape or len(image_shape) != 3):
        raise ValueError(f"feature column {features_col!r} holds images (Spark's image source): pass "
                         "image_shape=[channels, height, width] (every image must have that shape)")
    return expr, kind


FEATURES_AS = ("concat", "dict")
"""How a list of feature columns reaches the net: concatenated into one array, or as a dict by column."""


_NOT_IN_A_DICT = "feature column {name!r} is {type}: a dict of feature columns holds numbers, arrays and ML vectors"


def feature_layout(df, columns: Sequence[str], shapes: dict | None = None) -> tuple[tuple[str, tuple], ...]:
    """Each feature column's name and the shape of one row of it, for a net that takes a dict of them.

    A number column is ``()``; an array or ML vector column ``(d,)``, ``d`` read from the first
    row where every column is set (one small job), or the shape ``shapes`` gives it (whose size
    must be ``d``). Raises ``ValueError`` for a missing column, a type a dict cannot hold, an empty
    DataFrame or a shape that does not fit.
    """
    from pyspark.sql import functions as F

    if isinstance(columns, str):
        columns = [columns]
    if not columns:
        raise ValueError("features_col is an empty list; name at least one feature column")
    if len(set(columns)) != len(columns):
        raise ValueError(f"features_col names a column twice: {list(columns)}")
    shapes = dict(shapes or {})
    unknown = sorted(set(shapes) - set(columns))
    if unknown:
        raise ValueError(f"image_shape gives shapes of {unknown}, which are not among the feature columns "
                         f"{list(columns)}")
    sized = {}
    for name in columns:
        expr, number = _column_array(df, name, _NOT_IN_A_DICT)
        if not number:
            sized[name] = expr
    widths = {}
    if sized:
        row = df.select(*[F.size(e).alias(f"c{i}") for i, e in enumerate(sized.values())]) \
            .where(" AND ".join(f"c{i} >= 0" for i in range(len(sized)))).first()
        if row is None:
            raise ValueError(f"the feature columns {list(sized)} are empty or null in every row")
        widths = dict(zip(sized, (int(v) for v in row)))
    layout = []
    for name in columns:
        shape = (widths[name],) if name in widths else ()
        if name in shapes:
            given = tuple(int(d) for d in shapes[name])
            if any(d < 1 for d in given) or math.prod(given) != math.prod(shape):
                raise ValueError(f"image_shape gives column {name!r} the shape {given}, but its rows hold "
                                 f"{math.prod(shape)} values")
            shape = given
        layout.append((name, shape))
    return tuple(layout)


def dict_features(df, layout, column: str):
    """``df`` with ``column``: the layout's columns concatenated into one array<float> per row.

    A row whose array or vector holds another number of values than the layout says gets an
    empty part, so the row no longer has the net's length and the data checks count it.
    """
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    parts = []
    for name, shape in layout:
        expr, number = _column_array(df, name, _NOT_IN_A_DICT)
        parts.append(expr if number else F.when(F.size(expr) == math.prod(shape), expr)
                     .otherwise(F.when(expr.isNotNull(), F.array().cast(T.ArrayType(T.FloatType())))))
    return df.withColumn(column, parts[0] if len(parts) == 1 else F.concat(*parts))


def dict_arrays(data, layout):
    """Local validation data for a net that takes a dict: ``({column: array}, labels)`` (and sample weights)
    becomes flat rows in the layout's order; anything else is returned as it is (already flat rows)."""
    if not (isinstance(data, tuple) and len(data) in (2, 3) and isinstance(data[0], dict)):
        return data
    columns, y, *weights = data
    names = [name for name, _ in layout]
    if set(columns) != set(names):
        raise ValueError(f"validation data: the dict holds columns {sorted(columns)}, the net takes {names}")
    n = len(y)
    parts = []
    for name, shape in layout:
        a = np.asarray(columns[name])
        if a.dtype == object or a.dtype.kind not in "biuf":
            raise ValueError(f"validation data: column {name!r} holds {a.dtype}, not numbers")
        if len(a) != n or (n and np.size(a[0]) != math.prod(shape)):
            raise ValueError(f"validation data: column {name!r} has shape {a.shape}; the net takes {n} rows of "
                             f"shape {shape}")
        parts.append(a.reshape(n, -1).astype(np.float32, copy=False))
    return np.concatenate(parts, axis=1), y, *weights


def _column_array(df, name: str, refusal: str):
    """``(expression, is_number)``: one member of a list of feature columns as array<float> (a number as an
    array of one). ``refusal`` (formatted with ``name`` and ``type``) is the error for a column that is neither
    a number, an array nor an ML vector."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    dtype = _column_type(df, name, "feature")
    if _is_number(dtype):
        return F.array(F.col(name).cast(T.FloatType())), True
    expr, kind = feature_column(df, name)
    if kind != "array":
        raise ValueError(refusal.format(name=name, type=dtype.simpleString()))
    return expr, False


def _column_type(df, name: str, what: str):
    """The Spark SQL type of ``df``'s column ``name``; ``ValueError`` (a ``what`` column) when it has none."""
    types = {f.name: f.dataType for f in df.schema.fields}
    if name not in types:
        raise ValueError(f"{what} column {name!r} not found; the DataFrame has columns {list(types)}")
    return types[name]


def _is_number(dtype) -> bool:
    """Whether a Spark SQL type is a number type (a boolean a 0 or 1, as pyarrow's reader of a table takes it)."""
    from pyspark.sql import types as T

    return isinstance(dtype, (T.FloatType, T.DoubleType, T.IntegerType, T.LongType, T.ShortType, T.ByteType,
                              T.DecimalType, T.BooleanType))


def spark_feature_column(name: str, dtype) -> dict:
    """:func:`sparknet._parquet.feature_column` of a Spark column of type ``dtype``: a number, or an array or ML
    vector (of doubles)."""
    from pyspark.sql import types as T

    from sparknet._parquet import feature_column

    value = dtype.elementType if isinstance(dtype, T.ArrayType) else dtype
    return feature_column(name, _is_number(dtype), "long" if isinstance(value, T.IntegralType) else
                          "boolean" if isinstance(value, T.BooleanType) else "double")


def _label_expr(df, label_col: str | Sequence[str]):
    """A DataFrame's label column as the chunks take it (class ids as longs, numbers as doubles, either one a row or
    an array of them); several number columns as one array of doubles a row (a regression's or a multi-label net's
    labels)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if not isinstance(label_col, str):
        for name in label_col:
            if not _is_number(dtype := _column_type(df, name, "label")):
                raise ValueError(f"label column {name!r} has type {dtype.simpleString()}; several label columns are "
                                 "numbers, joined in order into one array a row")
        return F.array(*[F.col(name).cast(T.DoubleType()) for name in label_col])
    dtype = _column_type(df, label_col, "label")
    element = dtype.elementType if isinstance(dtype, T.ArrayType) else dtype  # an array: one label per position
    whole = isinstance(element, (T.IntegerType, T.LongType, T.ShortType, T.ByteType, T.BooleanType))
    if whole or isinstance(element, (T.FloatType, T.DoubleType, T.DecimalType)):
        kind = T.LongType() if whole else T.DoubleType()
        return F.col(label_col).cast(T.ArrayType(kind) if element is not dtype else kind)
    raise ValueError(f"label column {label_col!r} has type {dtype.simpleString()}; expected integer class ids "
                     "(an integer column, or a double column holding whole numbers), array<long> with one "
                     "class id per position for a sequence model, or real numbers (a double column or "
                     "array<double>) for a regression loss")


HASH_BUCKETS = 1_000_000
"""Buckets of the seeded row hash that holds rows out (:func:`held_out`)."""


def held_out(seed: int, columns: Sequence[str], share: float):
    """A boolean Column: whether a row is among a seeded ``share`` of the rows, by a hash of its ``columns``' values —
    the same rows wherever they are read from and however they are partitioned, with no sort of every partition
    (``randomSplit``'s, over the features' arrays too)."""
    from pyspark.sql import functions as F

    return F.pmod(F.xxhash64(F.lit(seed), *columns), F.lit(HASH_BUCKETS)) < round(share * HASH_BUCKETS)


def is_dataframe(obj) -> bool:
    return type(obj).__name__ == "DataFrame" and hasattr(obj, "schema") and hasattr(obj, "mapInArrow")


def is_frame(obj) -> bool:
    """Whether ``obj`` is a DataFrame or rows a fit takes as one (:class:`DealtRows`)."""
    return is_dataframe(obj) or isinstance(obj, DealtRows)


def as_frame(obj):
    """``obj`` as a DataFrame where it is :class:`DealtRows` (its ``frame``, made if not yet), else ``obj``."""
    return obj.frame if isinstance(obj, DealtRows) else obj


def is_rdd(obj) -> bool:
    return hasattr(obj, "mapPartitions") and hasattr(obj, "getNumPartitions") and not is_dataframe(obj)


def weight_expr(data, weight_col: str):
    """A DataFrame's column of sample weights as doubles (what :class:`ArrowChunks` with ``weighted`` reads last); a
    column of anything but numbers is refused by name."""
    from pyspark.sql import functions as F

    if not _is_number(weight_type := _column_type(data, weight_col, "weight")):
        raise ValueError(f"weight column {weight_col!r} has type {weight_type.simpleString()}; sample weights are "
                         "numbers")
    return F.col(weight_col).cast("double")


def chunk_input(data, *, features_col: str | Sequence[str] = "features",
                label_col: str | Sequence[str] | None = "label", image_shape=None, expected_len: int | None = None,
                num_partitions: int | None = None, float_labels: bool = False, weight_col: str | None = None):
    """``(DataFrame, convert, FeatureSource)``: a DataFrame's feature and label columns (and weight), in
    ``num_partitions`` partitions, and the ``mapInArrow`` function (:class:`ArrowChunks`) that turns its batches into
    rows of chunk bytes: what :func:`chunk_frame` runs, for a task function that does more with the chunks where they
    are made (the rounds engine's staging, :func:`sparknet.spark.rounds.executor.stage_frame`)."""
    from pyspark.sql import functions as F

    from sparknet.spark.session import is_connect, warn_unspread

    feat, kind = _feature_expr(data, features_col, image_shape)
    label = F.lit(0).cast("long") if label_col is None else _label_expr(data, label_col)
    columns = [feat.alias("f"), label.alias("y")]
    if weight_col is not None:
        columns.append(weight_expr(data, weight_col).alias("w"))
    df = data.select(*columns)
    connect = is_connect(data)
    # over Spark Connect the partition count cannot be asked without running a job: always dealt out
    if num_partitions is not None and (connect or data.inputFiles() or df.rdd.getNumPartitions() != num_partitions):
        df = df.repartition(num_partitions)
        warn_unspread(data.sparkSession)
    session = data.sparkSession
    return df, *arrow_chunks(kind, session if connect else session.sparkContext, features_col=features_col,
                             label_col=label_col, image_shape=image_shape, expected_len=expected_len,
                             float_labels=float_labels, weight_col=weight_col)


def arrow_chunks(kind: str, sc, *, features_col: str | Sequence[str] = "features",
                 label_col: str | Sequence[str] | None = "label",
                 image_shape=None, expected_len: int | None = None, float_labels: bool = False,
                 weight_col: str | None = None) -> tuple[ArrowChunks, FeatureSource]:
    """``(convert, FeatureSource)`` for feature columns of ``kind`` (:func:`chunk_input`'s names; ``sc``, the
    SparkContext or Spark Connect session whose settings size the chunks): what turns Arrow batches of those columns
    into chunks, and how they are read."""
    image_numel = int(np.prod(image_shape)) if image_shape else None
    if kind in ("binary", "image"):
        expected_len = image_numel
    label_col = label_col if label_col is None or isinstance(label_col, str) else ", ".join(label_col)
    convert = ArrowChunks(kind, expected_len, image_numel, label_col, float_labels,
                          tuple(image_shape) if image_shape else None, weight_col is not None, chunk_bytes_for(sc))
    named = (f"column {features_col!r}" if isinstance(features_col, str)
             else "columns " + ", ".join(map(repr, features_col)))
    return convert, FeatureSource(kind, expected_len, f"DataFrame {named}")


@dataclass(frozen=True)
class DealtRows:
    """A data set in files on the driver's machine, dealt out to ``partitions`` partitions as cards are: partition
    ``k`` holds ``hand(k)``, Arrow batches (``features`` list<float> or list<long>, ``label``) of rows ``k``,
    ``k + partitions``, ... of its ``rows``; ``head(k, n)`` reads the first ``n`` of them on the driver, as the stage
    job converts them. What :func:`sparknet.spark.run.dealt_frame` makes, and training data a fit takes as it takes a
    DataFrame: its stage job reads, converts and stages each hand in one task, with no DataFrame made. :attr:`frame`
    is the same rows as a DataFrame of ``spark`` (``make()``, made the first time it is asked for: as a session's
    first DataFrame, it builds Spark SQL's state, some 0.3 s of the driver's)."""

    spark: Any
    hand: Callable
    partitions: int
    rows: int
    head: Callable
    make: Callable[[], Any] = field(repr=False)

    @functools.cached_property
    def frame(self):
        """The DataFrame (``features``, ``label``) of these partitions."""
        return self.make()


def chunk_frame(data, **kwargs):
    """``(DataFrame, FeatureSource)``: a DataFrame's rows as a DataFrame of chunks (``x``, ``y``, ``width``,
    ``label_width``, ``info``; read them with :func:`frame_chunks`), in ``num_partitions`` partitions: the
    conversion :func:`chunk_rdd` runs, with nothing but DataFrame operations (what a Spark Connect session has).
    Takes :func:`chunk_input`'s arguments."""
    df, convert, source = chunk_input(data, **kwargs)
    return df.mapInArrow(convert, _CHUNK_SCHEMA), source


def frame_chunks(rows: Iterable, float_labels: bool) -> Iterator[tuple[np.ndarray, np.ndarray, dict]]:
    """Rows (or Arrow batches) of :func:`chunk_frame`'s DataFrame -> ``(x, y, info)`` chunks; float32 labels with
    ``float_labels`` (regression, multi-label, sample weights), else int64 class ids."""
    label_dtype = np.float32 if float_labels else np.int64
    for item in rows:
        for row in item.to_pylist() if hasattr(item, "to_pylist") else (item,):  # an Arrow record batch, or a row
            yield _row_to_chunk(row, label_dtype)


def chunks_of(df, convert, float_labels: bool):
    """The RDD of chunks of :func:`chunk_input`'s DataFrame and ``convert`` (float32 labels with ``float_labels``,
    else int64). Like every DataFrame's RDD, made as its query's shuffles run."""
    label_dtype = np.float32 if float_labels else np.int64
    return df.mapInArrow(convert, _CHUNK_SCHEMA).rdd.map(lambda row: _row_to_chunk(row, label_dtype),
                                                        preservesPartitioning=True)


class LazyRDD:
    """An RDD made the first time it is used (``make()``, once), for one a fit needs only on a rare road: a
    DataFrame's RDD runs its query's shuffles as it is made. :meth:`unpersist` of one never made makes nothing."""

    def __init__(self, make: Callable[[], Any]):
        self._make, self._rdd = make, None

    def __getattr__(self, name: str):
        if self._rdd is None:
            self._rdd = self._make()
        return getattr(self._rdd, name)

    def unpersist(self, *args, **kwargs):
        return None if self._rdd is None else self._rdd.unpersist(*args, **kwargs)


def chunk_rdd(data, *, features_col: str = "features", label_col: str | None = "label", image_shape=None,
              expected_len: int | None = None, num_partitions: int | None = None, float_labels: bool = False,
              weight_col: str | None = None):
    """``(rdd, FeatureSource)``: an RDD of chunks with ``num_partitions`` partitions (float32 labels with
    ``float_labels``, else int64).

    Partitions are kept as they are when there are already ``num_partitions`` of them and the
    DataFrame does not read files. A DataFrame read from files is always dealt out again
    (one shuffle, once per fit): files are split by byte ranges, and a small, well-compressed
    Parquet file can leave a partition without any row group — an idle worker all run long.

    Checks the schema (no Spark job runs); row-level problems are counted in the chunks.
    ``label_col=None``: no labels (a DataFrame's features alone, an RDD of feature arrays), every
    row's label a 0 no loss reads. ``weight_col``: a DataFrame's column of sample weights, carried as
    one more, last, float32 value of every row's labels.
    """
    if is_dataframe(data):
        df, convert, source = chunk_input(data, features_col=features_col, label_col=label_col,
                                          image_shape=image_shape, expected_len=expected_len,
                                          num_partitions=num_partitions, float_labels=float_labels,
                                          weight_col=weight_col)
        rdd = chunks_of(df, convert, float_labels or weight_col is not None)
    elif is_rdd(data):
        if weight_col is not None:
            raise ValueError("sample weights are read from a DataFrame column (weight_col); give the data as a "
                             "DataFrame")
        rdd = data if label_col is not None else data.map(lambda features: (features, 0), preservesPartitioning=True)
        if num_partitions is not None and rdd.getNumPartitions() != num_partitions:
            rdd = rdd.repartition(num_partitions)
        rdd = rdd.mapPartitions(pair_chunks(expected_len, float_labels=float_labels), preservesPartitioning=True)
        source = FeatureSource("pairs", expected_len, "RDD of (features, label)")
    else:
        raise TypeError(f"training data must be a Spark DataFrame or an RDD of (ndarray, label), "
                        f"got {type(data).__name__}")
    check_partitions(rdd, num_partitions)
    return rdd, source


def check_partitions(rdd, num_partitions: int | None) -> None:
    """``ValueError`` unless ``rdd`` has ``num_partitions`` partitions (``None``: any number)."""
    if num_partitions is not None and rdd.getNumPartitions() != num_partitions:
        raise ValueError(f"could not split the data into {num_partitions} partitions "
                         f"(got {rdd.getNumPartitions()})")


def ships_local_data(rdd, *, most_rdds: int = 1000) -> bool:
    """Whether every task over ``rdd`` carries rows the driver handed to Spark (``sc.parallelize``, a DataFrame made
    from local rows or arrays): a path of narrow dependencies from ``rdd`` to a ``ParallelCollectionRDD``.

    Spark keeps such rows in the partition objects themselves, and a task is sent with its partition: every job over
    ``rdd``, or over an RDD derived from it without a shuffle, serializes the partition's rows into each task again,
    even when an RDD in between is cached. A shuffle ends the path (its partitions name map outputs, not rows).
    Walks at most ``most_rdds`` RDDs of the lineage (a longer one counts as not shipping local data)."""
    stack, seen = [rdd._jrdd.rdd()], 0
    while stack and seen < most_rdds:
        node = stack.pop()
        seen += 1
        deps = node.dependencies()
        if deps.isEmpty():
            if node.getClass().getSimpleName() == "ParallelCollectionRDD" and not _no_driver_rows(node):
                return True
            continue
        it = deps.iterator()
        while it.hasNext():
            dep = it.next()
            if dep.getClass().getSimpleName() != "ShuffleDependency":
                stack.append(dep.rdd())
    return False


def _no_driver_rows(node) -> bool:
    """Whether a ``ParallelCollectionRDD`` holds no rows of the driver's: only numbers, one a partition
    (``spark.range``'s slices, from which the executors make their own rows,
    :func:`sparknet.spark.run.synthetic_frame`), or nothing at all (``sc.parallelize([], K)``, over which a stage job
    reads a dealt data set, and ``sc.range``'s)."""
    partitions = node.partitions()  # read in the JVM: nothing is copied out
    if all(p.values().size() == 0 for p in partitions):
        return True
    kind = node.elementClassTag().runtimeClass().getSimpleName()
    return kind in ("int", "long", "Integer", "Long") and all(p.values().size() <= 1 for p in partitions)


def partition_key(index: int) -> int:
    """The ``partitionFunc`` that sends a record keyed by a partition's index to that partition."""
    return index


def without_local_data(rdd, num_partitions: int):
    """``rdd`` with the same records in the same partitions and order, behind a shuffle when
    :func:`ships_local_data` (once, at the fit's start), so that the rounds engine's jobs, one a round, do not carry
    the driver's rows in every task (:func:`folded`, into as many partitions)."""
    if rdd.getNumPartitions() != num_partitions or not ships_local_data(rdd):
        return rdd
    log.info("training data: the rows came from the driver (sc.parallelize or local rows) and would travel in every "
             "round's tasks; shuffled once into the same partitions instead")
    return folded(rdd, num_partitions)


def folded(rdd, num_partitions: int):
    """``rdd``'s records in ``num_partitions`` partitions by one shuffle: partition p's go to partition
    ``p % num_partitions``, after those of the partitions before p and in their own order. With as many partitions
    as ``rdd`` has, every record stays where it was; with fewer, the workers left after a host is lost for good
    share the partitions of those that left (the barrier engine's elastic restart), and no row is left out.
    Only partitions fed by several are sorted: one fed by a single partition reads its records in their order."""
    if rdd.getNumPartitions() == num_partitions:
        keyed = rdd.mapPartitionsWithIndex(lambda index, records: ((index, r) for r in records))
        return keyed.partitionBy(num_partitions, partition_key).values()
    keyed = rdd.mapPartitionsWithIndex(lambda index, records: (((index, i), r) for i, r in enumerate(records)))
    return keyed.repartitionAndSortWithinPartitions(num_partitions, lambda key: key[0] % num_partitions).values()


def check_stats(stats: list[dict], *, what: str, expected_len: int | None, num_classes: int | None,
                num_workers: int | None = None, sample_shape=None, task: Task = Task.CLASSIFICATION) -> dict:
    """Sum per-partition counts and raise one clear ``ValueError`` for the first problem found.

    Labels are one class id per row, or (a sequence model) one per position: then every row
    holds as many labels as the features' first axis has positions (``sample_shape[0]``), and
    ``num_classes`` is the vocabulary.

    For regression labels are numbers (one per row, or a vector of the same length in every row),
    checked to be finite; for multi-label, vectors of 0/1 (or of probabilities in [0, 1]).

    Returns the summed counts plus ``"width"`` (values per row), ``"label_width"`` (0, or the
    labels per row of a sequence) and ``"rows_per_partition"``.
    """
    parts = [s if isinstance(s, ChunkCounts) else ChunkCounts.from_dict(s) for s in stats]
    total = functools.reduce(ChunkCounts.add, parts, ChunkCounts())
    labels = f"labels in column {total.label_col!r}" if total.label_col else "labels"
    if total.not_pairs:
        raise ValueError(f"{what}: {total.not_pairs} elements are not (numeric array, label) pairs")
    if total.null_x:
        raise ValueError(f"{what}: {total.null_x} rows have a null feature value (the whole row, or a value "
                         "inside it); drop or fill them first (e.g. DataFrame.dropna or na.fill)")
    if total.null_y:
        raise ValueError(f"{what}: {total.null_y} rows have a null label; drop them first")
    if total.bad_rows or len(total.lengths) > 1:
        seen = sorted(total.lengths)
        if expected_len is not None:
            shape = f" (shape {tuple(sample_shape)})" if sample_shape else ""
            raise ValueError(f"{what}: feature rows must hold {expected_len} values for this net{shape}, "
                             f"but rows hold {seen} values ({total.bad_rows} rows do not fit)")
        raise ValueError(f"{what}: feature rows differ in length ({seen} values); every row needs the same length")
    label_lengths = sorted(total.label_lengths)
    if total.bad_labels or len(label_lengths) > 1:
        seen = ", ".join("one class id" if v == 0 else f"{v} per-position ids" for v in label_lengths)
        raise ValueError(f"{what}: {labels} differ in length (rows hold {seen}; {total.bad_labels} rows do not "
                         "fit); every row needs one class id, or the same number of ids (one per position of "
                         "a sequence)")
    label_width = label_lengths[0] if label_lengths else 0
    classes = task is Task.CLASSIFICATION
    if not classes:
        if total.nonfinite_y:
            raise ValueError(f"{what}: {total.nonfinite_y} {labels} are NaN or infinite (or not numbers); "
                             "drop or fix those rows first")
        if task is Task.MULTILABEL and total.y_min is not None and (total.y_min < 0 or total.y_max > 1):
            raise ValueError(f"{what}: {labels} range over [{total.y_min:g}, {total.y_max:g}]; a multi-label "
                             "net takes 0 or 1 for each of its outputs (or a probability in [0, 1])")
    elif label_width and sample_shape:
        positions = int(tuple(sample_shape)[0])
        if label_width != positions:
            raise ValueError(f"{what}: {labels} hold {label_width} ids per row but the features have {positions} "
                             f"positions (shape {tuple(sample_shape)}); a sequence needs one label per position: "
                             "cut features and labels to the same length")
    for key, problem in (("bad_w", "have a null, NaN, infinite or negative sample weight; weights are numbers >= 0"),
                         ("nonfinite", "hold NaN or infinite feature values; clean or impute them first")):
        if getattr(total, key):
            raise ValueError(f"{what}: {getattr(total, key)} rows {problem}")
    if total.nonint_y and classes:
        raise ValueError(f"{what}: {total.nonint_y} labels are not whole numbers; labels are class ids 0..C-1 "
                         "(to regress numbers, give a regression loss such as torch.nn.MSELoss() or "
                         "task='regression')")
    rows = total.rows
    if rows == 0:
        raise ValueError(f"{what} is empty: there is nothing to train on")
    if num_workers is not None and rows < num_workers:
        raise ValueError(f"{what} has {rows} rows, fewer than the {num_workers} workers asked for; "
                         f"use at most {rows} workers")
    if classes and num_classes is not None and (total.y_min < 0 or total.y_max >= num_classes):
        where = f"; check column {total.label_col!r}" if total.label_col else ""
        if label_width:
            where += " (one label per position; a sequence model's classes are its vocabulary, one per token)"
        raise ValueError(f"{what}: labels range over [{total.y_min}, {total.y_max}] but the net has "
                         f"{num_classes} classes (labels must be 0..{num_classes - 1}){where}")
    if classes and total.y_min is not None and total.y_min < 0:
        where = f" (column {total.label_col!r})" if total.label_col else ""
        raise ValueError(f"{what}: negative label {total.y_min}; labels are class ids 0..C-1{where}")
    return {**total.to_dict(), "width": total.lengths[0] if total.lengths else expected_len,
            "label_width": label_width, "rows_per_partition": [part.rows for part in parts]}


def checked_partitions(sc, group: str, chunks, *, timeout_s: float | None, expected_len: int | None,
                       num_classes: int | None, num_workers: int, sample_shape, stats: list[dict] | None = None,
                       task: Task = Task.CLASSIFICATION, float_labels: bool = False, what: str = "training data"):
    """Driver: ``(stats, total)``, the counts of each partition of ``chunks`` (from :func:`chunk_rdd`, or
    :func:`chunk_frame`'s DataFrame, whose labels are float32 with ``float_labels``) in order and
    :func:`check_stats`' total of them (``ValueError`` for bad data). One Spark job under ``group`` counts
    them, waited for at most ``timeout_s``, unless ``stats`` holds them already (the rounds engine's staging)."""
    if stats is None:
        if is_dataframe(chunks):  # chunk_frame's DataFrame (a Spark Connect session): one row of counts a partition
            frame = chunks.mapInArrow(frame_stats(float_labels), "info string")

            def action():
                return [json.loads(row["info"]) for row in frame.collect()]
        else:
            action = chunks.mapPartitionsWithIndex(partition_stats).collect
        stats = run_with_deadline(sc, group, "sparknet: convert and check the training data", action,
                                  timeout_s=timeout_s, what="the training data's conversion and check")
    stats.sort(key=lambda s: s["index"])
    return stats, check_stats(stats, what=what, expected_len=expected_len, num_classes=num_classes,
                              num_workers=num_workers, sample_shape=sample_shape, task=task)


def frame_stats(float_labels: bool):
    """Executor, the ``mapInArrow`` function: :func:`partition_stats` of one partition of :func:`chunk_frame`'s
    DataFrame, as one row holding its counts as JSON."""

    def stats(batches: Iterator) -> Iterator:
        import pyarrow as pa
        from pyspark import TaskContext

        for info in partition_stats(TaskContext.get().partitionId(), frame_chunks(batches, float_labels)):
            yield pa.RecordBatch.from_arrays([pa.array([json.dumps(info)])], names=["info"])

    return stats


def partition_stats(index: int, chunks: Iterable) -> Iterator[dict]:
    """Executor: the record of one partition's summed :class:`ChunkCounts` and its ``index`` (consumes them)."""
    _, _, counts = merge_chunks(chunks)
    yield {**counts.to_dict(), "index": index}


def head_rows(quotas: list[int]):
    """Executor: the first ``quotas[index]`` rows of a partition as one ``(x, y)`` (reads all chunks)."""

    def take(index: int, chunks: Iterable) -> Iterator:
        want = quotas[index]
        xs, ys, got = [], [], 0
        for x, y, _ in chunks:
            if got < want and len(y):
                k = min(want - got, len(y))
                xs.append(np.array(x[:k]))
                ys.append(np.array(y[:k]))
                got += k
        if xs:
            yield np.concatenate(xs), np.concatenate(ys)

    return take


def local_arrays(data, *, sample_shape, what: str = "validation data",
                 task: Task = Task.CLASSIFICATION) -> tuple:
    """``(x, y)`` numpy arrays of an ArrayDataset, an ``(x, y)`` pair or a list of pairs, in the net's shape
    (float32 labels for regression and multi-label, else int64 class ids; a net without labels takes
    an array of features, its labels zeros). An ``(x, y, w)`` triple gives ``(x, y, w)``: and each row's sample
    weight, as float64 (checked where the net takes them, :meth:`sparknet.net.Net.set_validation_data`)."""
    if isinstance(data, tuple) and len(data) == 3 and hasattr(data[0], "shape"):
        x, y = local_arrays(data[:2], sample_shape=sample_shape, what=what, task=task)
        w = np.asarray(data[2])
        if w.dtype.kind not in "biuf":
            raise ValueError(f"{what}: sample weights are {w.dtype}, not numbers")
        return x, y, w.astype(np.float64).reshape(-1)
    if task is Task.UNLABELLED:
        x = np.asarray(data.x if hasattr(data, "x") else data[0] if isinstance(data, tuple) else data)
        data = (x, np.zeros(len(x), np.int64))
    if hasattr(data, "x") and hasattr(data, "y"):
        x, y = np.asarray(data.x), np.asarray(data.y)
    elif isinstance(data, tuple) and len(data) == 2 and all(hasattr(a, "shape") for a in data):
        x, y = np.asarray(data[0]), np.asarray(data[1])
    else:
        pairs = list(data)
        if not pairs:
            raise ValueError(f"{what} is empty")
        x = np.stack([np.asarray(p[0]) for p in pairs])
        y = np.asarray([p[1] for p in pairs])
    if len(x) != len(y):
        raise ValueError(f"{what}: {len(x)} feature rows but {len(y)} labels")
    if len(x) == 0:
        raise ValueError(f"{what} is empty")
    if x.dtype == object or x.dtype.kind not in "biuf":
        raise ValueError(f"{what}: features are {x.dtype}, not numbers")
    x = x.astype(np.float32, copy=False)
    bad = int(len(x) - np.isfinite(x.reshape(len(x), -1)).all(axis=1).sum())
    if bad:
        raise ValueError(f"{what}: {bad} rows hold NaN or infinite feature values; clean or impute them first")
    if sample_shape is not None:
        per = int(np.prod(x.shape[1:]))
        if per != int(np.prod(sample_shape)):
            raise ValueError(f"{what}: each row has {per} feature values but the net takes shape "
                             f"{tuple(sample_shape)}")
        x = x.reshape(len(x), *sample_shape)
    if y.dtype.kind not in "biuf":
        raise ValueError(f"{what}: labels are {y.dtype}, not numbers")
    if task.float_labels:  # the checks of a DataFrame's labels (finite; in [0, 1] for multi-label)
        info = ChunkCounts()
        y = _labels(y, info, float_labels=True)
        info.rows = len(y)
        check_stats([info], what=what, expected_len=None, num_classes=None, task=task)
        return x, y
    if y.ndim > 2:
        raise ValueError(f"{what}: labels have shape {y.shape}; give one class id per row, or one per position "
                         "of a sequence ([rows, positions])")
    if y.ndim == 2 and sample_shape is not None and y.shape[1] != int(tuple(sample_shape)[0]):
        raise ValueError(f"{what}: labels hold {y.shape[1]} ids per row but the features have "
                         f"{int(tuple(sample_shape)[0])} positions (shape {tuple(sample_shape)}); a sequence needs "
                         "one label per position")
    if y.dtype.kind == "f" and not np.all(np.floor(y) == y):
        raise ValueError(f"{what}: labels are not whole numbers; labels are class ids 0..C-1")
    return x, y.astype(np.int64, copy=False)


def collect_arrays(data, *, features_col: str, label_col: str, image_shape, expected_len: int | None,
                   num_classes: int | None, sample_shape, what: str = "validation data",
                   task: Task = Task.CLASSIFICATION, weight_col: str | None = None) -> tuple:
    """A DataFrame or RDD collected to the driver as checked ``(x, y)`` arrays; ``(x, y, w)`` where ``weight_col`` is
    a column of the DataFrame, its rows' sample weights (float64). Data without that column (an RDD has none) is
    collected unweighted, and the log says so."""
    weight_col = weight_column(data, weight_col, what)
    float_labels = task.float_labels or weight_col is not None  # the weight travels last in float32 labels
    if is_dataframe(data):  # DataFrame operations alone (a Spark Connect session has no RDDs)
        frame, _ = chunk_frame(data, features_col=features_col, label_col=label_col, image_shape=image_shape,
                               expected_len=expected_len, float_labels=float_labels, weight_col=weight_col)
        chunks = frame_chunks(frame.collect(), float_labels)
    else:
        rdd, _ = chunk_rdd(data, features_col=features_col, label_col=label_col, image_shape=image_shape,
                           expected_len=expected_len, float_labels=float_labels, weight_col=weight_col)
        chunks = rdd.collect()
    x, y, info = merge_chunks(chunks)
    checked = check_stats([info], what=what, expected_len=expected_len, num_classes=num_classes,
                          sample_shape=sample_shape, task=task)
    if sample_shape is not None:
        x = x.reshape(len(x), *sample_shape)
    if weight_col is None:
        return x, y
    return x, *split_weights(y, checked["label_width"], task.float_labels)


def weight_column(data, weight_col: str | None, what: str) -> str | None:
    """``weight_col`` where ``data`` is a DataFrame that has that column, else ``None`` (an RDD has none), and the log
    says its rows are scored unweighted."""
    if weight_col is not None and not (is_dataframe(data) and weight_col in data.columns):
        log.info("%s has no weight column %r: its rows are scored unweighted", what, weight_col)
        return None
    return weight_col


def describe_skew(rows_per_partition: list[int]) -> str | None:
    """A warning text when partitions are very uneven, else ``None``."""
    nonzero = [r for r in rows_per_partition if r]
    if len(nonzero) < len(rows_per_partition):
        return (f"{len(rows_per_partition) - len(nonzero)} of {len(rows_per_partition)} partitions are empty; "
                "their workers will sit idle")
    if nonzero and max(nonzero) > 2 * max(1, min(nonzero)):
        return f"partitions are uneven ({min(nonzero)} to {max(nonzero)} rows)"
    return None


# -- local arrays into Spark ----------------------------------------------------------------------
def label_type(y) -> type:
    """The type a table holds labels ``y`` in: int64 class ids, or float32 where they are numbers (a regression's,
    or a multi-label net's 0s and 1s)."""
    return np.float32 if np.issubdtype(np.asarray(y).dtype, np.floating) else np.int64


def arrays_table(x, y, weights=None):
    """Local arrays as an Arrow table: ``features`` list<float> (list<long> for integer ids), ``label`` (and
    ``weight``, a double a row, of ``weights``).

    ``label`` is long, or list<long> with one class id per position when ``y`` is ``[N, T]`` (a sequence); float
    (list<float>: a vector a row) where ``y`` holds floating-point numbers (:func:`label_type`).
    """
    import pyarrow as pa

    def list_column(values: np.ndarray):  # rows of a 2-D array as one Arrow list column, no object per row
        rows, width = values.shape
        offsets = pa.array(np.arange(0, (rows + 1) * width, width, dtype=np.int32))
        return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1)))

    x, y = np.asarray(x), np.asarray(y)
    if y.ndim not in (1, 2) or len(y) != len(x):
        raise ValueError(f"cannot write {len(x)} feature rows with labels of shape {y.shape} as a table; "
                         "labels must be [rows] (one class id each) or [rows, positions] (one per position)")
    x = x.reshape(len(x), -1)
    x = np.ascontiguousarray(x, dtype=np.int64 if np.issubdtype(x.dtype, np.integer) else np.float32)
    kind = label_type(y)
    label = list_column(np.ascontiguousarray(y, dtype=kind)) if y.ndim == 2 else pa.array(y.astype(kind))
    weight = {} if weights is None else {"weight": pa.array(np.asarray(weights, dtype=np.float64).reshape(len(x)))}
    return pa.table({"features": list_column(x), "label": label, **weight})


def frame_from_arrays(spark, x, y, weights=None):
    """Local arrays as a DataFrame whose rows travel through Spark, not through a path on the driver's disk.

    The table of :func:`arrays_table` is cut into pieces of at most :data:`SHIP_BYTES`, each an
    Arrow IPC stream (zstd) in one row of a ``binary`` column; ``mapInArrow`` unpacks them on the
    executors. Nothing is pickled but Spark's own task data, and no executor needs the driver's files.
    """
    import pyarrow as pa
    from pyspark.sql.pandas.types import from_arrow_schema

    table = arrays_table(x, y, weights)
    step = max(1, SHIP_BYTES * max(1, table.num_rows) // max(1, table.nbytes))
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    pieces = []
    for start in range(0, max(1, table.num_rows), step):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
            writer.write_table(table.slice(start, step))
        pieces.append((len(pieces), sink.getvalue().to_pybytes()))
    blobs = spark.createDataFrame(spark.sparkContext.parallelize(pieces, len(pieces)), "piece int, blob binary")
    return blobs.mapInArrow(_unpack_pieces, from_arrow_schema(table.schema))


def _unpack_pieces(batches: Iterator) -> Iterator:
    import pyarrow as pa

    for batch in batches:
        for blob in batch.column("blob").to_pylist():
            with pa.ipc.open_stream(pa.py_buffer(blob)) as reader:
                yield from reader
