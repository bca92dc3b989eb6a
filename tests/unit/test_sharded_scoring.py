"""The rounds engine's evaluation where the rows stay in Spark, its executor side without Spark: a screen's rows cut
into partitions and chunks are the rows the driver's net screens, and the partitions' results joined are its."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sparknet import zoo
from sparknet.config import WorkerConfig
from sparknet.net import Net, fixed_sample
from sparknet.solvers import SolverConfig
from sparknet.spark.data import ChunkCounts
from sparknet.spark.rounds.executor import WorkerSpec, pack_spec
from sparknet.spark.rounds.validation import score_shard, shard_picks, shard_stats
from sparknet.strategies import Average


def _blobs(n: int, seed: int):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]], dtype=np.float32)
    return (centers[y] + rng.normal(0, 0.6, (n, 2))).astype(np.float32), y.astype(np.int64)


@pytest.mark.parametrize("rows", [(300, 200), (1, 0, 499), (250, 250)])
def test_a_screens_rows_cut_into_partitions_are_the_screens_rows(rows):
    total = sum(rows)
    starts = np.concatenate([[0], np.cumsum(rows)])
    picked = shard_picks(rows, sample=100)
    kept = np.concatenate([start + offsets for start, (keep, offsets) in zip(starts, picked) if keep])
    assert np.array_equal(kept, fixed_sample(total, 100))
    rest = shard_picks(rows, rest_of=100)
    assert all(not keep for keep, _ in rest)
    assert np.array_equal(np.concatenate([s + o for s, (_, o) in zip(starts, rest)]), kept)  # what the rest drops
    assert shard_picks(rows) is None and shard_picks(rows, sample=total) is None  # every row
    assert shard_picks(rows, rest_of=0) is None
    with pytest.raises(ValueError, match="a sample or the rest of one, not both"):
        shard_picks(rows, sample=5, rest_of=5)


@pytest.mark.parametrize("weighted", [False, True])
def test_partitions_of_chunks_scored_apart_and_joined_are_the_drivers_scores(weighted):
    """Three partitions of uneven chunks, scored by score_shard with the broadcast weights: the whole set, a screen
    and the rest of it give the driver's net's results over the same rows in order (counts exactly, the loss to
    rounding), weighted by a last label value where the rows carry one."""
    x, y = _blobs(500, 3)
    w = np.linspace(0.0, 2.0, 500)
    params = zoo.mlp(input_shape=(2,), hidden=(8,), num_classes=3, batch_size=16)
    net = Net(params, SolverConfig(base_lr=0.1), batch_size=16, seed=1)
    flat = torch.randn(net.get_flat().numel(), generator=torch.Generator().manual_seed(2))
    net.set_flat(flat)
    net.set_validation_data((x, y, w) if weighted else (x, y))
    spec = WorkerSpec(fit_id="f0", net=params, loss=None,
                      worker=WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=16, seed=1),
                      strategy=Average(), sample_shape=(2,), weighted=weighted)
    spec_bc, weights_bc = SimpleNamespace(value=pack_spec(spec)), SimpleNamespace(value=flat.numpy())
    labels = np.column_stack([y, w]).astype(np.float32) if weighted else y
    cuts = [0, 70, 130, 300, 310, 500]  # chunks; partitions of 2, 1 and 2 chunks
    chunks = [(x[a:b], labels[a:b], ChunkCounts(rows=b - a)) for a, b in zip(cuts[:-1], cuts[1:])]
    partitions = [chunks[:2], chunks[2:3], chunks[3:]]
    rows = tuple(sum(len(c[1]) for c in part) for part in partitions)
    if weighted:
        stats = [next(shard_stats(True)(i, part)) for i, part in enumerate(partitions)]
        assert sum(s["weight"] for s in stats) == pytest.approx(float(w.sum()), rel=1e-6)

    def scored(**pick):
        score = score_shard(spec_bc, weights_bc, shard_picks(rows, **pick), weighted=weighted, label_width=0)
        parts = [next(score(i, iter(part))) for i, part in enumerate(partitions)]
        parts = [p for p in parts if p is not None]
        out = parts[0]
        for p in parts[1:]:
            out = out.joined(p)
        return out

    for pick, want in (({}, net.evaluate()), ({"sample": 100}, net.evaluate(sample=100)),
                       ({"rest_of": 100}, net.evaluate(rest_of=100))):
        got = scored(**pick)
        assert got.samples == want.samples and got.sums == pytest.approx(want.sums, rel=1e-9)
        assert got.loss == pytest.approx(want.loss, rel=1e-5)
        assert got.weight == (None if not weighted else pytest.approx(want.weight, rel=1e-6))
