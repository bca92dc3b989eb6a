"""The rounds engine's evaluation on the executors (``--eval-sharded``): the validation rows stay in Spark.

The fit converts its validation data into chunks as it does its training rows (:func:`sparknet.spark.data.chunk_rdd`,
a partition a task slot), keeps them persisted and counts and checks them in one job (:func:`shard_stats`), so the
driver never holds a held-out row. Each evaluation is then one Spark job over those partitions
(:class:`ShardedScorer`): the weights go out in a broadcast, every task scores its partition's rows with a net of its
own, built from the fit's :class:`~sparknet.spark.rounds.executor.WorkerSpec` once per Python worker and fit
(:func:`score_shard`), and returns an :class:`~sparknet.net.EvalResult`, whose additive sums the driver joins in
partition order. A screen's fixed random sample is drawn as the driver's net draws it (:func:`sparknet.net.
fixed_sample` over the rows' places, partitions in order) and cut into each partition's part on the driver
(:func:`shard_picks`).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sparknet.errors import DeadlineExceeded
from sparknet.net import EvalResult, Net, fixed_sample
from sparknet.spark.backend import Watchdog, default_round_deadline, spark_call
from sparknet.spark.data import ChunkCounts, split_weights
from sparknet.spark.resources import with_profile
from sparknet.spark.rounds.executor import _SPECS, build_worker_net, task_device, unpack_spec

__all__ = ["ValidationShards", "ShardedScorer", "shard_stats", "shard_picks", "score_shard"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ValidationShards:
    """A fit's validation rows where Spark holds them: what the trainer hands the rounds engine for ``--eval-sharded``
    in place of arrays."""

    chunks: Any
    """The persisted RDD of the rows' chunks (:func:`sparknet.spark.data.chunk_rdd`), a partition a task slot of the
    session (at least one a worker)."""
    rows: tuple[int, ...]
    """Rows per partition, in partition order."""
    label_width: int
    """Labels per row (0: one), as :func:`sparknet.spark.data.check_stats` found them."""
    weight: float | None
    """The rows' total sample weight where their labels carry one (each row then weighed by it), else ``None``."""

    @property
    def total(self) -> int:
        return sum(self.rows)


def shard_stats(weighted: bool):
    """Executor, ``mapPartitionsWithIndex``: a partition's summed :class:`~sparknet.spark.data.ChunkCounts` as a
    record, with its ``index`` and, ``weighted``, its rows' total ``weight`` (the last value of their float32 labels,
    as :func:`sparknet.spark.data.split_weights` reads it)."""

    def stats(index: int, chunks):
        counts, weight = ChunkCounts(), 0.0
        for _, y, info in chunks:
            counts.add(info)
            if weighted and len(y) and not info.refused:
                weight += float(np.asarray(y)[:, -1].astype(np.float64).sum())
        yield {**counts.to_dict(), "index": index, "weight": weight if weighted else None}

    return stats


def shard_picks(rows: tuple[int, ...], sample: int | None = None, rest_of: int | None = None) -> list | None:
    """Which rows of each partition an evaluation scores, as :meth:`Net.evaluate <sparknet.net.Net.evaluate>`'s
    ``sample`` and ``rest_of`` choose them over the rows of all partitions in order: ``None`` (every row), or a
    ``(keep, offsets)`` a partition, ``keep`` saying whether its sorted ``offsets`` are the rows scored or the rows
    left out."""
    total = sum(rows)
    if sample is not None and rest_of is not None:
        raise ValueError("score a sample or the rest of one, not both")
    size = sample if sample is not None else rest_of
    if not size or (sample is not None and sample >= total):
        return None
    keep = sample is not None
    chosen = fixed_sample(total, size) if size < total else np.arange(total)
    starts = np.concatenate([[0], np.cumsum(rows)])
    return [(keep, chosen[np.searchsorted(chosen, lo):np.searchsorted(chosen, hi)] - lo)
            for lo, hi in zip(starts[:-1], starts[1:])]


_NETS: dict[str, Net] = {}
"""Each fit's evaluating net in this Python worker (built once, then given each evaluation's weights)."""


def _scoring_net(spec) -> Net:
    net = _NETS.get(spec.fit_id)
    if net is None:
        for old in [k for k in _NETS if k not in _SPECS]:  # fits this process no longer holds a spec of
            del _NETS[old]
        net = _NETS[spec.fit_id] = build_worker_net(spec, 0, None, task_device(spec.worker.device)[0])
    return net


def score_shard(spec_bc, weights_bc, picks: list | None, *, weighted: bool, label_width: int):
    """Executor, ``mapPartitionsWithIndex``: the partition's rows (those ``picks`` names for it) scored with the
    broadcast weights, as one :class:`~sparknet.net.EvalResult` (``None``: no row scored)."""

    def score(index: int, chunks):
        spec = unpack_spec(spec_bc.value)
        torch.set_num_threads(spec.worker.threads)
        net = _scoring_net(spec)
        net.set_flat(torch.from_numpy(np.asarray(weights_bc.value)))
        keep, offsets = picks[index] if picks is not None else (False, np.zeros(0, dtype=np.int64))
        result, start = None, 0
        for x, y, _ in chunks:
            n = len(y)
            inside = offsets[(offsets >= start) & (offsets < start + n)] - start
            start += n
            chosen = np.zeros(n, dtype=bool) if keep else np.ones(n, dtype=bool)
            chosen[inside] = keep
            if not chosen.any():
                continue
            w = None
            if weighted:
                y, w = split_weights(np.asarray(y), label_width, spec.task.float_labels)
            x = np.asarray(x).reshape(n, *spec.sample_shape)
            part = net.evaluate((x[chosen], np.asarray(y)[chosen]), weights=None if w is None else w[chosen])
            result = part if result is None else result.joined(part)
        yield result

    return score


class ShardedScorer:
    """Scores weights where the validation rows are (:class:`ValidationShards`): one Spark job an evaluation, in the
    fit's job group, cancelled past its deadline (``timeout_s``; by default 20 times the slowest evaluation so far,
    as a round's), its tasks asking for ``profile``'s resources as the round's do."""

    def __init__(self, sc, group: str, shards: ValidationShards, spec_bc, *, profile=None,
                 timeout_s: float | None = None):
        self.sc, self.group, self.shards, self.spec_bc, self.profile = sc, group, shards, spec_bc, profile
        self.timeout_s = timeout_s
        self.slowest_s: float | None = None
        self.jobs = 0  # evaluations run

    @property
    def scores(self) -> bool:
        return True

    @property
    def rows(self) -> int:
        return self.shards.total

    def evaluate(self, flat: torch.Tensor, rows: int | None = None, rest_of: int | None = None) -> EvalResult:
        shards = self.shards
        picks = shard_picks(shards.rows, rows, rest_of)
        deadline = self.timeout_s or default_round_deadline(self.slowest_s, 1)
        weights_bc = self.sc.broadcast(flat.detach().cpu().numpy())
        watchdog = Watchdog(self.sc, self.group, deadline)
        t = time.perf_counter()
        try:
            self.sc.setJobDescription("sparknet: score the weights where the validation rows are")
            tasks = with_profile(shards.chunks.mapPartitionsWithIndex(
                score_shard(self.spec_bc, weights_bc, picks, weighted=shards.weight is not None,
                            label_width=shards.label_width)), self.profile)
            with watchdog:
                parts = spark_call(tasks.collect)
        except Exception as exc:
            if watchdog.fired:
                raise DeadlineExceeded(f"an evaluation on the executors did not finish within {deadline:g} s and was "
                                       f"cancelled: {watchdog.unfinished}; see those tasks' executor logs, or raise "
                                       "round_timeout_s") from exc
            raise
        finally:
            weights_bc.destroy()
        self.jobs += 1
        took = time.perf_counter() - t
        self.slowest_s = max(self.slowest_s or 0.0, took)
        scored = [p for p in parts if p is not None]
        if not scored:
            return EvalResult(loss=float("nan"), accuracy=float("nan"), samples=0)
        return functools.reduce(EvalResult.joined, scored)

    evaluate_average = evaluate
