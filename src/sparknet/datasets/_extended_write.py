"""Extended MNIST as Parquet, made on Spark's executors: :func:`write_extended_mnist` and :func:`extended_mnist`.

Driver side. The base digits reach the executors once, as a broadcast of their raw bytes
(MNIST's 50,000 training images: 39 MB); ``spark.range(num_samples)`` gives each task its
sample ids and :func:`sparknet.datasets._extended.arrow_samples` turns them into rows
(``features`` binary: 784 uint8 pixels, row-major 28 x 28; ``label`` int; ``index`` long,
the sample's number). A sample's bytes depend on the seed and its index only, so any number
of partitions writes the same set. Nothing here imports pyspark: the session passed in does
the work.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
from pyarrow import fs as pafs

from sparknet._fs import filesystem
from sparknet.datasets._array import ArrayDataset
from sparknet.datasets._extended import (CHUNK, ROW_SCHEMA, SIDE, Deformation, arrow_samples, check_count,
                                         extended_samples)
from sparknet.datasets._mnist import _dataset, mnist
from sparknet.datasets.cache import atomic_write, cache_root, exclusive
from sparknet.errors import DatasetError

__all__ = ["ExtendedWrite", "write_extended_mnist", "extended_mnist", "extended_arrays", "cached_extended_arrays",
           "base_digits", "SAMPLES_PER_PARTITION"]

log = logging.getLogger(__name__)

SAMPLES_PER_PARTITION = 100_000
"""Most samples one partition (one Parquet file, about 25 MB) gets when ``num_partitions`` is not given."""
_MODES = {"error": "errorifexists", "overwrite": "overwrite"}  # ours -> Spark's save modes
_COLUMNS = {"features": "binary", "label": "integer"}


@dataclass(frozen=True)
class ExtendedWrite:
    """What :func:`write_extended_mnist` wrote."""

    path: str
    """The Parquet folder."""
    rows: int
    """Samples written."""
    partitions: int
    """Spark partitions (Parquet files) they were written from."""
    bytes: int | None
    """Bytes of the folder's files (``None`` where the folder cannot be listed from here)."""
    seconds: float
    """Wall time of the Spark job, broadcast and writing included."""


def base_digits(base: ArrayDataset | tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The base digits as uint8 ``[N, 28, 28]`` pixels 0..255 and uint8 labels.

    ``base``: ``None`` for MNIST's training split (:func:`sparknet.datasets.mnist`, cached after the
    first fetch), an :class:`ArrayDataset` of images in [0, 1] (``[N, 1, 28, 28]`` or ``[N, 28, 28]``,
    as :func:`mnist` gives them: pixel / 255), or an ``(images, labels)`` pair of uint8 pixels; any
    other images, or labels that are not 0..255 integers, are a ``ValueError``.
    """
    if base is None:
        base = mnist().train
    x, y = (base.x, base.y) if isinstance(base, ArrayDataset) else base
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim == 4 and x.shape[1] == 1:
        x = x[:, 0]
    if x.ndim != 3 or x.shape[1:] != (SIDE, SIDE) or len(x) == 0:
        raise ValueError(f"base images must be [N, 28, 28] or [N, 1, 28, 28] with N >= 1, got {list(x.shape)}")
    if x.dtype.kind == "f":
        if not (np.isfinite(x).all() and x.min() >= 0 and x.max() <= 1):
            raise ValueError("float base images must hold pixel / 255 in [0, 1] (as mnist() gives them)")
        x = np.rint(x * np.float32(255)).astype(np.uint8)
    elif x.dtype != np.uint8:
        raise ValueError(f"base images must be uint8 pixels or floats in [0, 1], got {x.dtype}")
    if y.shape != (len(x),) or y.dtype.kind not in "iu" or (len(y) and (y.min() < 0 or y.max() > 255)):
        raise ValueError(f"base labels must be {len(x)} integers in 0..255, one per image, "
                         f"got {y.dtype}{list(y.shape)}")
    return np.ascontiguousarray(x), y.astype(np.uint8)


def _exists(path: str) -> bool | None:
    """Whether ``path`` exists (``None`` when this process cannot tell: Spark's own check decides then)."""
    try:
        fs, inside = filesystem(path)
        return fs.get_file_info(inside).type != pafs.FileType.NotFound
    except (OSError, ValueError):
        return None


def _folder_bytes(path: str) -> int | None:
    """Bytes of the files under ``path`` (``None`` when this process cannot list it)."""
    try:
        fs, inside = filesystem(path)
        infos = fs.get_file_info(pafs.FileSelector(inside, recursive=True))
    except (OSError, ValueError):
        return None
    return sum(i.size or 0 for i in infos if i.type == pafs.FileType.File)


def write_extended_mnist(spark, path: str | os.PathLike, num_samples: int, *, seed: int = 0,
                         num_partitions: int | None = None, mode: str = "error",
                         deformation: Deformation | None = None,
                         base: ArrayDataset | tuple[np.ndarray, np.ndarray] | None = None) -> ExtendedWrite:
    """Generate ``num_samples`` (at least 1) extended-MNIST digits on ``spark``'s executors and write them as Parquet.

    Sample ``i`` is base digit ``i mod N`` (of ``base``, see :func:`base_digits`; default MNIST's
    50,000 training images) elastically distorted and jittered as ``deformation`` says
    (:func:`sparknet.datasets._extended.extended_samples`), with its label; the same ``seed`` and
    index give the same bytes on any machine and with any ``num_partitions``. The rows are
    ``features`` (binary, 784 uint8 pixels, row-major 28 x 28), ``label`` (int) and ``index``
    (long, ``i``); :func:`extended_mnist` reads them back for ``SparkTrainer.fit(df,
    image_shape=(1, 28, 28))``.

    ``path`` must be writable by every executor (on a cluster ``hdfs://``, ``s3a://`` or a shared
    mount; ``sparknet data extended-mnist`` checks this first); ``mode`` ``"error"`` refuses an
    existing one, ``"overwrite"`` replaces it. ``num_partitions`` (one Parquet file each, at most
    ``num_samples``) defaults to enough that none holds more than :data:`SAMPLES_PER_PARTITION`
    samples, and at least Spark's default parallelism. The session is left running.

    Raises ``ValueError`` for an argument out of range, malformed base digits or an existing
    ``path`` under ``mode="error"``; :class:`DatasetError` when MNIST is not cached and cannot be
    fetched.
    """
    num_samples = check_count("num_samples", num_samples, 1)
    seed = check_count("seed", seed, 0)
    if mode not in _MODES:
        raise ValueError(f"mode must be 'error' or 'overwrite', got {mode!r}")
    sc = spark.sparkContext
    if num_partitions is None:
        num_partitions = max(sc.defaultParallelism, -(-num_samples // SAMPLES_PER_PARTITION))
    num_partitions = min(check_count("num_partitions", num_partitions, 1), num_samples)
    path = os.fspath(path)
    if mode == "error" and _exists(path):
        raise ValueError(f"{path} exists; pass mode='overwrite' (--overwrite) to replace it")
    images, labels = base_digits(base)
    t0 = time.perf_counter()
    shared = sc.broadcast((images.tobytes(), labels.tobytes()))
    try:
        ids = spark.range(0, num_samples, 1, numPartitions=num_partitions)
        rows = ids.mapInArrow(arrow_samples(shared, seed, deformation), ROW_SCHEMA)
        rows.write.mode(_MODES[mode]).parquet(path)
    finally:
        shared.destroy()
    seconds = time.perf_counter() - t0
    written = ExtendedWrite(path=path, rows=num_samples, partitions=num_partitions, bytes=_folder_bytes(path),
                            seconds=seconds)
    log.info("wrote %d extended-MNIST samples (seed %d, %d partitions) to %s in %.1f s",
             num_samples, seed, num_partitions, path, seconds)
    return written


def extended_mnist(spark, path: str | os.PathLike):
    """Read a folder :func:`write_extended_mnist` wrote, as a DataFrame of ``features`` (binary), ``label`` (int)
    and ``index`` (long) ready to train on.

    Train with ``SparkTrainer.fit(df, image_shape=IMAGE_SHAPE)`` (``(1, 28, 28)``): the ``features``
    bytes become pixels / 255 in [0, 1], as ``sparknet train --dataset mnist`` scales them. Nothing at
    ``path`` is a ``FileNotFoundError``; rows without those two columns are a ``ValueError``.
    """
    path = os.fspath(path)
    if _exists(path) is False:
        raise FileNotFoundError(f"no extended-MNIST folder at {path}; write one with write_extended_mnist "
                                "(or sparknet data extended-mnist)")
    df = spark.read.parquet(path)
    types = {f.name: f.dataType.typeName() for f in df.schema.fields}
    for name, kind in _COLUMNS.items():
        if types.get(name) != kind:
            raise ValueError(f"{path} is not an extended-MNIST folder: column {name!r} is "
                             f"{types.get(name, 'missing')}, not {kind}; write it with write_extended_mnist")
    return df


def extended_arrays(num_samples: int, *, seed: int = 0, deformation: Deformation | None = None,
                    base: ArrayDataset | tuple[np.ndarray, np.ndarray] | None = None,
                    processes: int = 1) -> ArrayDataset:
    """The first ``num_samples`` of the set made in this process, as :func:`mnist` gives images: float32
    ``[num_samples, 1, 28, 28]`` (pixel / 255) and int64 labels, the pixels :func:`write_extended_mnist` writes for
    the same seed. ``processes`` above 1 makes them in that many processes, a contiguous range each: the same
    bytes (a sample's depend on its index only), in about ``1 / processes`` of the time (a million take some three
    minutes on one core)."""
    num_samples = check_count("num_samples", num_samples, 0)
    processes = check_count("processes", processes, 1)
    images, labels = base_digits(base)
    parts = min(processes, -(-num_samples // CHUNK))  # no process gets less than one vectorised step
    if parts <= 1:
        return _dataset(*extended_samples(images, labels, 0, num_samples, seed=seed, deformation=deformation))
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    cuts = [num_samples * i // parts for i in range(parts + 1)]
    x, y = np.empty((num_samples, SIDE, SIDE), np.uint8), np.empty(num_samples, labels.dtype)
    # spawned, not forked: the caller may hold torch's threads, which a fork does not carry
    with ProcessPoolExecutor(parts, mp_context=multiprocessing.get_context("spawn")) as pool:
        make = functools.partial(extended_samples, images, labels, seed=seed, deformation=deformation)
        for a, b, (part_x, part_y) in zip(cuts, cuts[1:], pool.map(make, cuts[:-1], cuts[1:])):
            x[a:b], y[a:b] = part_x, part_y
    return _dataset(x, y)


def cached_extended_arrays(num_samples: int, *, seed: int = 0, deformation: Deformation | None = None,
                           base: ArrayDataset | tuple[np.ndarray, np.ndarray] | None = None) -> ArrayDataset:
    """:func:`extended_arrays`, made once (in a process a core) and cached under the data cache as float32 ``.npy``
    files named by the count, the seed and a digest of the deformation and the base digits; read back memory-mapped
    and read-only, so every process on the machine shares one copy of the pages (a million digits are 3.1 GB, made in
    about a minute on one core of the machines here). ``DatasetError`` if the cached files do not hold what their
    name says (delete them and run again)."""
    num_samples = check_count("num_samples", num_samples, 1)
    deformation = deformation or Deformation()
    images, labels = base_digits(base)
    digest = hashlib.sha256(repr(deformation).encode() + images.tobytes() + labels.tobytes()).hexdigest()[:12]
    path = cache_root() / "extended_mnist" / f"train-{num_samples}-seed{seed}-{digest}.x.npy"
    label_path = path.with_name(path.name.replace(".x.npy", ".y.npy"))
    if not path.exists():
        with exclusive(path.with_name(f".{path.name}.lock")):
            if not path.exists():  # not made by another process while this one waited
                log.info("making %d extended-MNIST digits (seed %d) for %s", num_samples, seed, path)
                data = extended_arrays(num_samples, seed=seed, deformation=deformation, base=(images, labels),
                                       processes=len(os.sched_getaffinity(0)))
                for target, array in ((label_path, data.y), (path, data.x)):  # images last: they mark it complete
                    with atomic_write(target) as f:
                        np.save(f, np.ascontiguousarray(array))
    x, y = np.load(path, mmap_mode="r"), np.load(label_path)
    if x.shape != (num_samples, 1, SIDE, SIDE) or x.dtype != np.float32 or y.shape != (num_samples,):
        raise DatasetError(f"cached {path} holds {x.dtype} {list(x.shape)} and {len(y)} labels, not {num_samples} "
                           "digits; delete it and its .y.npy and run again")
    return ArrayDataset(x, y)
