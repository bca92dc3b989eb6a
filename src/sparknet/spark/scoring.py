"""The executor side of :meth:`SparkNetModel.transform <sparknet.spark.ml.SparkNetModel._transform>`: what a scoring
task runs on the Arrow batches of its partition.

A Python worker builds the model once, by its content hash, from the files broadcast to it (:func:`cached_model`),
decodes each batch's feature cells (:func:`decode_features`) and yields the scores (:func:`score_batches`). This
module imports neither pyspark's ML classes nor the driver's trainer: a scoring worker imports it alone, and the
Python daemon sparknet's sessions start loads it before it forks (:mod:`sparknet.spark._daemon`).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from sparknet import model_io
from sparknet.labels import Task, parse_task, score_columns, task_sums
from sparknet.spark.rounds.executor import task_device

__all__ = ["score_batches", "evaluation_sums", "cached_model", "decode_features", "executor_device", "BUILDS"]

log = logging.getLogger(__name__)

CACHE_SIZE = 2
_MODELS: OrderedDict[str, Any] = OrderedDict()
BUILDS: dict[str, int] = {}  # cache key -> times built in this process (for tests and logs)
_LOCK = threading.Lock()


def cached_model(key: str, files_bc, device: str, allow_pickle: bool):
    """The model with content hash ``key``, built once per Python worker process."""
    device = executor_device(device)
    with _LOCK:
        cache_key = f"{key}@{device}"
        model = _MODELS.get(cache_key)
        if model is None:
            log.info("building model %s on %s in process %d", key, device, os.getpid())
            model = model_io.unpack_model(files_bc.value, device=device, allow_pickle=allow_pickle)
            _MODELS[cache_key] = model
            BUILDS[cache_key] = BUILDS.get(cache_key, 0) + 1
            while len(_MODELS) > CACHE_SIZE:
                _MODELS.popitem(last=False)
        else:
            _MODELS.move_to_end(cache_key)
        return model


def executor_device(device: str) -> str:
    """The device a scoring task uses, chosen as a training task's is (:func:`~sparknet.spark.rounds.executor.
    task_device`: the GPU Spark assigned it, else the CPU for ``auto``); ``cuda`` without CUDA is an error."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but this executor's torch sees no CUDA device")
    return task_device(device)[0]


def decode_features(values, kind: str, shape: tuple[int, ...] | None) -> np.ndarray:
    """One Arrow batch of feature cells (numpy arrays or bytes) to a float32 [n, *shape] array."""
    n = len(values)
    if n and any(v is None for v in values):
        raise ValueError("the features column holds nulls; drop or fill them before transform()")
    width = int(np.prod(shape)) if shape else None
    if n == 0:
        return np.zeros((0, *(shape or (0,))), dtype=np.float32)
    if kind == "binary":
        # As the trainer reads them: one byte per value (uint8 pixels, scaled to [0, 1]) or
        # four (little-endian float32).
        sizes = {len(v) for v in values}
        if len(sizes) == 1 and width is not None and sizes == {4 * width}:
            flat = [np.frombuffer(v, dtype="<f4") for v in values]
        else:
            flat = [np.frombuffer(v, dtype=np.uint8).astype(np.float32) / np.float32(255.0) for v in values]
    else:
        flat = list(values)
    lengths = {len(v) for v in flat}
    if len(lengths) != 1 or (width is not None and lengths != {width}):
        want = f"{width} ({'x'.join(map(str, shape))})" if width is not None else "one length"
        raise ValueError(f"feature vectors have lengths {sorted(lengths)[:5]}; the net takes {want}")
    x = np.stack(flat).astype(np.float32, copy=False)
    return x.reshape(n, *shape) if shape else x


def score_batches(batches, *, key: str, files_bc, kind: str, shape, threads: int, chunk: int,
                   device: str, allow_pickle: bool, task: str = "classification") -> Iterator:
    """Score Arrow batches as :func:`sparknet.labels.score_columns` says: logits, softmax probabilities and arg-max
    predictions; a regressor: its outputs; a multi-label net: the indices of the labels whose sigmoid is above one
    half, and each label's sigmoid."""
    import pandas as pd

    torch.set_num_threads(threads)
    model = cached_model(key, files_bc, device, allow_pickle)
    shape = tuple(shape) if shape else None
    task = parse_task(task)
    for series in batches:
        x = decode_features(series.to_numpy(), kind, shape)
        with torch.no_grad():
            parts = [model.predict(torch.from_numpy(x[start:start + chunk])) for start in range(0, len(x), chunk)]
        if parts:
            yield pd.DataFrame(score_columns(torch.cat(parts), task))
        elif task is Task.REGRESSION:  # a batch of no rows
            yield pd.DataFrame({"prediction": []})
        else:
            yield pd.DataFrame({"prediction": [] if task is Task.MULTILABEL else np.zeros(0), "probability": [],
                                "raw": []})


def evaluation_sums(batches, *, key: str, files_bc, kind: str, shape, threads: int, chunk: int, device: str,
                    allow_pickle: bool, task: str, label_col: str | None, num_classes: int | None,
                    weighted: bool = False) -> Iterator:
    """One partition's share of :meth:`SparkNetModel.evaluate <sparknet.spark.ml.SparkNetModel.evaluate>`: Arrow
    batches of (features, label[, weight]) -> one batch of one row, ``info`` (what the rows hold and what is wrong
    with them, as a fit counts them: :class:`~sparknet.spark.data.ChunkCounts`) and ``result`` (the rows scored,
    their total ``weight`` when ``weighted``, their loss sum and the task's additive sums,
    :func:`sparknet.labels.task_sums`, each row weighed by its sample weight when ``weighted``). Rows a fit would
    refuse are counted, not scored: the driver names them. The loss is the net's own (its loss layers) where the
    model holds a layer-DSL net of the task scored; a plain module's loss is not in its files (``NaN``)."""
    import json

    import pyarrow as pa

    from sparknet.spark.data import ArrowChunks, ChunkCounts, split_weights

    torch.set_num_threads(threads)
    model = cached_model(key, files_bc, device, allow_pickle)
    task = parse_task(task)
    shape = tuple(shape)
    width = int(np.prod(shape))
    convert = ArrowChunks(kind, width, width if kind in ("binary", "image") else None, label_col, task.float_labels,
                          shape, weighted=weighted)
    own_loss = model.net_params is not None and model.net.task is task
    counts, rows, weight, loss_sum, sums = ChunkCounts(), 0, 0.0, 0.0, None
    for x, y, info in convert.chunks(batches):
        counts.add(info)
        if info.refused or not len(y) or info.bad_w:
            continue
        w = None
        if weighted:  # float32 labels with the weight last (a fit's)
            y, w = split_weights(y, info.label_lengths[0] if info.label_lengths else 0, task.float_labels)
        if num_classes is not None and (y.min() < 0 or y.max() >= num_classes):
            continue
        for start in range(0, len(y), chunk):
            xb, yb = x[start:start + chunk].reshape(-1, *shape), y[start:start + chunk]
            wb = None if w is None else w[start:start + chunk]
            with torch.no_grad():
                if own_loss:
                    result = model.net.evaluate((xb, yb), batch_size=chunk, weights=wb)
                    loss, part = result.loss * result.counted if result.counted else 0.0, list(result.sums)
                else:
                    loss, part = math.nan, task_sums(task, model.predict(torch.from_numpy(xb)), torch.from_numpy(yb),
                                                     None if wb is None else torch.from_numpy(wb))
            rows, loss_sum = rows + len(yb), loss_sum + loss
            weight += len(yb) if wb is None else float(wb.sum())
            sums = part if sums is None else [a + b for a, b in zip(sums, part)]
    result = {"samples": rows, "weight": weight if weighted else None, "loss_sum": loss_sum, "sums": sums}
    yield pa.RecordBatch.from_arrays([pa.array([json.dumps(counts.to_dict())]), pa.array([json.dumps(result)])],
                                     names=["info", "result"])
