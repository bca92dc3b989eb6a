"""Executor-side pieces of the rounds engine, run in this process without a SparkSession."""

from __future__ import annotations

import numpy as np
import pytest

from _spark_testlib import blobs, flat, mlp
from sparknet.config import WorkerConfig
from sparknet.loop import RoundPlan, StopRule
from sparknet.net import EvalResult
from sparknet.solvers import SolverConfig
from sparknet.spark.rounds import executor as _rounds
from sparknet.spark.data import pair_chunks
from sparknet.spark.rounds.executor import WorkerReport, WorkerSpec, WorkerStatus, combine, fold, pack_spec
from sparknet.strategies import Average

pytestmark = pytest.mark.spark  # imports pyspark


class _Value:  # stands in for a Broadcast
    def __init__(self, value):
        self.value = value


def _stage(tmp_path, fit_id, index, x, y):
    chunks = list(pair_chunks(None)(zip(x, y)))
    (record,) = _rounds.stage_partition(fit_id, str(tmp_path))(index, iter(chunks))
    return record


def _task(round_index: int, steps: int) -> _rounds.RoundTask:
    return _rounds.RoundTask(plan=RoundPlan(round=round_index, steps=steps), numel=0)


def _run(spec_bc, weights, record, index, round_index):
    return _rounds._train_round(spec_bc, _Value(weights), _task(round_index, 3), index, record)


def test_solver_state_follows_a_partition_from_process_to_process(tmp_path, monkeypatch):
    x, y = blobs(20, seed=3)
    spec = WorkerSpec(fit_id="unit", net=mlp(), loss=None,
                      worker=WorkerConfig(solver=SolverConfig(base_lr=0.05, momentum=0.9), batch_size=8),
                      strategy=Average(), sample_shape=(2,),
                      staging_dir=str(tmp_path))
    spec_bc = _Value(pack_spec(spec))
    record = _stage(tmp_path, "unit", 0, x, y)
    assert record["rows"] == 20 and record["dir"].startswith(str(tmp_path))

    def three_rounds(caches):
        g = flat(mlp()).numpy()
        deltas = []
        for r, cache in enumerate(caches):
            monkeypatch.setattr(_rounds, "_CACHE", cache)
            report, delta, encoded = _run(spec_bc, g, record, 0, r)
            assert encoded is None and report.samples > 0
            deltas.append(delta)
            g = g + delta
        return deltas, report

    same_process = {}
    expected, _ = three_rounds([same_process] * 3)
    a, b = {}, {}
    hopping, last = three_rounds([a, b, a])  # round 2 back in A, whose copy is a round old
    assert last.source == "cache"
    for want, got in zip(expected, hopping):
        assert np.allclose(want, got, atol=1e-7)
    assert b[("unit", 0)].version == 1 and a[("unit", 0)].version == 2


def test_empty_and_missing_partitions(tmp_path, monkeypatch):
    monkeypatch.setattr(_rounds, "_CACHE", {})
    spec = WorkerSpec(fit_id="unit2", net=mlp(), loss=None, worker=WorkerConfig(batch_size=4), strategy=Average(),
                      sample_shape=(2,), staging_dir=str(tmp_path))
    spec_bc = _Value(pack_spec(spec))
    g = flat(mlp()).numpy()
    empty, delta, _ = _run(spec_bc, g, {"rows": 0}, 1, 0)
    assert empty.status is WorkerStatus.EMPTY and empty.samples == 0 and delta is None
    elsewhere, delta, _ = _run(spec_bc, g, {"rows": 5, "host": "another-host", "dir": str(tmp_path)}, 2, 0)
    assert elsewhere.status is WorkerStatus.MISSING and delta is None
    # the driver reruns a missing partition from its chunks
    x, y = blobs(5)
    out, delta, _ = _rounds._train_round(spec_bc, _Value(g), _task(0, 1), 2, None,
                                         chunks=iter(list(pair_chunks(None)(zip(x, y)))))
    assert out.source == "chunks" and out.samples == 4 and delta.shape == g.shape


def test_the_warm_up_sample_is_read_where_a_partition_was_staged(tmp_path):
    """``staged_head``: a partition's first rows as its chunks hold them, from its staged files; ``None`` where they
    were staged on another machine (the driver then takes them from the chunks); nothing for an empty partition or a
    quota of none."""
    x, y = blobs(20, seed=3)
    record = _stage(tmp_path, "warm", 0, x, y)
    (part,) = _rounds.staged_head([7, 5])(0, iter([record]))
    want = next(_rounds_head([7], x, y))
    assert np.array_equal(part[0], want[0]) and np.array_equal(part[1], want[1]) and part[0].dtype == np.float32
    assert list(_rounds.staged_head([7])(0, iter([{**record, "host": "another-host"}]))) == [None]
    assert list(_rounds.staged_head([0])(0, iter([record]))) == []
    assert list(_rounds.staged_head([7])(0, iter([{"rows": 0}]))) == []


def _rounds_head(quotas, x, y):
    from sparknet.spark.data import head_rows

    return head_rows(quotas)(0, iter(list(pair_chunks(None)(zip(x, y)))))


def test_fold_weights_by_samples_and_skips_empty_and_nonfinite():
    updates = [
        (WorkerReport(index=0, samples=10, loss=1.0), np.full(3, 1.0, np.float32), None),
        (WorkerReport(index=1, samples=30, loss=2.0), np.full(3, 2.0, np.float32), None),
        (WorkerReport(index=2, status=WorkerStatus.EMPTY), None, None),
        (WorkerReport(index=3, samples=50, loss=float("nan"), finite=False), None, None),
    ]
    acc = None
    for u in updates[:2]:
        acc = fold(acc, u)
    other = None
    for u in updates[2:]:
        other = fold(other, u)
    acc = combine(acc, other)
    # 10 samples of 1.0 and 30 of 2.0: 1.75 (an unweighted mean would give 1.5); the NaN worker's 50 do not count
    assert acc.samples == 40 and np.allclose(acc.wsum / acc.samples, 1.75) and acc.loss_sum / acc.samples == 1.75
    assert sorted(w.index for w in acc.workers) == [0, 1, 2, 3]
    assert [w.index for w in acc.without(WorkerStatus.EMPTY).workers] == [0, 1, 3]


def test_stop_rule():
    rule = StopRule(rounds=5, steps=12, epochs=None, tau=5, dataset_rows=100)
    assert [rule.steps_for_round(done) for done in (0, 5, 10, 12)] == [5, 5, 2, 0]
    assert rule.reason(2, 10, 0, None) is None and rule.reason(3, 12, 0, None) == "steps"
    assert rule.reason(5, 1, 0, None) == "rounds"
    assert StopRule(epochs=1.5, dataset_rows=100, tau=1).reason(1, 1, 150, None) == "epochs"
    scored = EvalResult(loss=0.2, accuracy=0.95, samples=10)
    assert StopRule(target_accuracy=0.9, tau=1).reason(1, 1, 1, scored) == "target_accuracy"
    assert StopRule(round_seconds=1.0, tau=None).steps_for_round(0) == StopRule.UNBOUNDED_STEPS


def test_local_master_helpers():
    from sparknet.spark.session import is_local_master, local_slots

    assert local_slots("local[4]") == 4 and local_slots("local") == 1 and local_slots("local[3, 2]") == 3
    assert local_slots("local-cluster[2,2,1024]") == 4 and local_slots("spark://h:7077") is None
    assert is_local_master("local-cluster[2,1,1024]") and not is_local_master("yarn")
