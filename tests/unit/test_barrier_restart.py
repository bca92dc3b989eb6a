"""How many workers a failed barrier stage starts again with: all of them when the cluster has their slots again,
whole workers only after ``elastic_after_s`` (a host gone for good), and a clear refusal once nothing fits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from sparknet.errors import EngineError
from sparknet.spark import EngineOptions
from sparknet.spark.barrier.driver import workers_to_restart


def _opts(elastic_after_s=60.0, rendezvous_timeout_s=180.0):
    return EngineOptions(elastic_after_s=elastic_after_s, rendezvous_timeout_s=rendezvous_timeout_s)


def test_every_worker_as_soon_as_the_cluster_has_their_slots_again():
    assert workers_to_restart(4, 2, 2, 0.0, _opts()) == 2
    assert workers_to_restart(6, 2, 2, 500.0, _opts()) == 2
    assert workers_to_restart(None, 3, 1, 0.0, _opts()) == 3  # Spark cannot count its slots: try them all


def test_fewer_whole_workers_only_after_elastic_after_s():
    assert workers_to_restart(2, 2, 2, 59.0, _opts()) is None  # the host may come back: wait on
    assert workers_to_restart(2, 2, 2, 60.0, _opts()) == 1  # one worker of two processes, on the two slots left
    assert workers_to_restart(3, 2, 2, 60.0, _opts()) == 1  # never a worker with some of its ranks
    assert workers_to_restart(5, 4, 2, 0.0, _opts(elastic_after_s=0)) == 2


def test_a_cluster_without_the_slots_of_one_whole_worker_waits_then_refuses():
    assert workers_to_restart(1, 2, 2, 170.0, _opts()) is None  # under G slots: not elastic, wait for the host
    with pytest.raises(EngineError, match=r"runs all 2 workers of 2 processes at once \(4 tasks\) but the cluster "
                                          r"has 1 task slot\(s\) left .* within 180 s\); after elastic_after_s=60 s "
                                          r"it goes on with the workers whose 2 task slot\(s\) it has"):
        workers_to_restart(1, 2, 2, 180.0, _opts())


def test_without_elastic_restarts_it_waits_the_rendezvous_timeout_then_refuses():
    opts = _opts(elastic_after_s=None, rendezvous_timeout_s=20.0)
    assert workers_to_restart(1, 2, 1, 19.0, opts) is None
    with pytest.raises(EngineError, match=r"runs all 2 workers at once \(2 tasks\) but the cluster has 1 task "
                                          r"slot\(s\) left .* within 20 s\); add executors"):
        workers_to_restart(1, 2, 1, 20.0, opts)


def test_an_elastic_wait_longer_than_the_rendezvous_timeout_is_waited_whole():
    opts = _opts(elastic_after_s=300.0, rendezvous_timeout_s=20.0)
    assert workers_to_restart(1, 2, 1, 200.0, opts) is None
    assert workers_to_restart(1, 2, 1, 300.0, opts) == 1


@settings(max_examples=300, deadline=None)
@given(slots=st.integers(0, 64), workers=st.integers(1, 16), procs=st.integers(1, 4),
       waited=st.floats(0, 400), elastic=st.one_of(st.none(), st.floats(0, 300)))
def test_a_restart_never_asks_for_more_slots_than_the_cluster_has_nor_goes_on_short_before_its_time(
        slots, workers, procs, waited, elastic):
    opts = _opts(elastic_after_s=elastic, rendezvous_timeout_s=180.0)
    try:
        left = workers_to_restart(slots, workers, procs, waited, opts)
    except EngineError:
        assert slots < workers * procs and waited >= max(180.0, elastic or 0.0)
        return
    if left is None:
        return
    assert 1 <= left <= workers and (left == workers or left * procs <= slots)
    if left < workers:
        assert elastic is not None and waited >= elastic


def test_a_failed_jobs_error_says_sparks_reason_not_py4js_call():
    """A stage that failed without a rank's own report (its host gone): the restart log's line is Spark's reason."""
    from sparknet.spark.backend import task_error

    text = ("An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.\n"
            ": org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover from a failed "
            "barrier ResultStage.\n\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages")
    error = task_error(text)
    assert type(error) is EngineError
    assert str(error).splitlines()[0] == ("Spark job failed: org.apache.spark.SparkException: Job aborted due to stage "
                                          "failure: Could not recover from a failed barrier ResultStage.")
