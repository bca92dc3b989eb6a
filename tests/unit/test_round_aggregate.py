"""The rounds engine's aggregate: what tasks report and how the driver sums it (no Spark).

``fold`` and ``combine`` are treeAggregate's two functions; they must give the sample-weighted
sum whatever the order and the tree's shape, and keep every worker's report.
"""

import functools
import math
import pickle

import numpy as np
import pytest

from sparknet.spark.rounds.executor import Partial, WorkerReport, WorkerStatus, combine, fold


def _update(index, samples, delta, *, finite=True, loss=1.0):
    report = WorkerReport(index=index, samples=samples, steps=samples // 2, loss=loss, finite=finite, host="h",
                          pid=1)
    return report, (np.asarray(delta, dtype=np.float32) if finite else None), None


def test_workers_with_different_sample_counts_sum_by_samples_in_any_order_and_tree():
    updates = [_update(0, 10, [1.0, 0.0]), _update(1, 30, [0.0, 2.0]), _update(2, 0, [5.0, 5.0]),
               _update(3, 20, [1.0, 1.0])]
    flat = functools.reduce(fold, updates, None)
    tree = combine(combine(fold(None, updates[3]), fold(None, updates[1])),
                   combine(fold(None, updates[2]), fold(None, updates[0])))
    for acc in (flat, tree):
        assert acc.samples == 60
        np.testing.assert_allclose(acc.wsum, [10 * 1 + 20 * 1, 30 * 2 + 20 * 1])
        assert acc.loss_sum == pytest.approx(60.0)
        assert sorted(w.index for w in acc.workers) == [0, 1, 2, 3]
    mean = flat.wsum / flat.samples  # an unweighted mean of the three non-empty deltas differs
    assert not np.allclose(mean, np.mean([[1, 0], [0, 2], [1, 1]], axis=0))


def test_a_non_finite_worker_is_reported_but_adds_nothing():
    acc = functools.reduce(fold, [_update(0, 8, [1.0]), _update(1, 8, None, finite=False, loss=math.nan)], None)
    assert acc.samples == 8 and acc.loss_sum == pytest.approx(8.0)
    assert [w.finite for w in sorted(acc.workers, key=lambda w: w.index)] == [True, False]


def test_a_report_is_frozen_pickles_and_its_record_leaves_out_what_is_unknown():
    report = WorkerReport(index=2, status=WorkerStatus.EMPTY, loss=0.0, host="h", pid=7)
    with pytest.raises(AttributeError):
        report.samples = 3
    assert pickle.loads(pickle.dumps(report)) == report
    record = report.record()
    assert record["empty"] is True and record["samples"] == 0
    assert "task_s" not in record and "worker_state" not in record
    acc = Partial(wsum=None, samples=0, loss_sum=0.0,
                  workers=(report, WorkerReport(index=3, status=WorkerStatus.MISSING)))
    assert [w.index for w in acc.without(WorkerStatus.MISSING).workers] == [2]


def test_a_round_task_travels_as_json_in_its_job_property_and_comes_back_whole():
    from sparknet.loop import RoundPlan
    from sparknet.spark.rounds.executor import ROUND_TASK, RoundTask, _job_task

    for task in (RoundTask(plan=RoundPlan(round=7, steps=50), numel=431080, relayed=True),
                 RoundTask(plan=RoundPlan(round=0, steps=2**62, seconds=2.5, last=True), numel=3, send_state=True,
                           full=True, held=True, relayed=True)):
        assert RoundTask.from_json(task.to_json()) == task
    with pytest.raises(RuntimeError, match=f"carries no {ROUND_TASK} property"):
        _job_task()  # outside a Spark task there is no job to read it from
