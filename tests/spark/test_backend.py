"""The Spark backend on local[2]: job groups give the caller's back, deadlines cancel, worker failures decode."""

from __future__ import annotations

import time

import pytest

from _spark_testlib import blobs, mlp, module_session, partitioned_rdd
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.errors import DeadlineExceeded, WorkerError
from sparknet.loop import RoundPlan
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer
from sparknet.spark.backend import job_group, python_workers_starting, run_with_deadline
from sparknet.spark.rounds.executor import RoundTask, run_round_from_chunks

pytestmark = pytest.mark.spark

_KEYS = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")


spark = module_session("local[2]")


@pytest.fixture
def sc(spark):
    sc = spark.sparkContext
    yield sc
    for key in _KEYS:
        sc.setLocalProperty(key, None)


def _job_properties(sc) -> tuple:
    return tuple(sc.getLocalProperty(key) for key in _KEYS)


def _running_jobs(sc, group: str, wait_s: float = 20.0) -> list[int]:
    """The group's jobs still running once the status tracker has caught up (at most ``wait_s``)."""
    tracker = sc.statusTracker()
    deadline = time.monotonic() + wait_s
    while True:
        running = [j for j in tracker.getJobIdsForGroup(group)
                   if (info := tracker.getJobInfo(j)) is not None and info.status == "RUNNING"]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


def _ended_jobs(sc, group: str, wait_s: float = 60.0) -> list[str]:
    """The statuses of the group's jobs once the status tracker has heard of one and of the end of all (it hears from
    Spark's listener bus, behind the job's caller); what it holds at ``wait_s``."""
    tracker = sc.statusTracker()
    deadline = time.monotonic() + wait_s
    while True:
        jobs = [tracker.getJobInfo(j) for j in tracker.getJobIdsForGroup(group)]
        statuses = [job.status if job is not None else "UNKNOWN" for job in jobs]
        if (statuses and all(s in ("SUCCEEDED", "FAILED") for s in statuses)) or time.monotonic() > deadline:
            return statuses
        time.sleep(0.1)


def _sleeper(seconds: float):
    def sleep(index, rows):
        import time

        time.sleep(seconds)
        yield index

    return sleep


def test_job_group_gives_the_callers_group_and_description_back(sc):
    sc.setJobGroup("notebook-cell-7", "the caller's cell", interruptOnCancel=False)
    before = _job_properties(sc)
    assert before == ("notebook-cell-7", "the caller's cell", "false")

    with job_group(sc, "sparknet-inner", "sparknet: inner work"):
        assert _job_properties(sc) == ("sparknet-inner", "sparknet: inner work", "true")
        assert sc.parallelize(range(4), 2).count() == 4
    assert _job_properties(sc) == before

    with pytest.raises(ZeroDivisionError):
        with job_group(sc, "sparknet-inner", "sparknet: inner work"):
            1 / 0
    assert _job_properties(sc) == before
    assert _ended_jobs(sc, "sparknet-inner") == ["SUCCEEDED"]  # the inner job ran under its own group
    assert sc.statusTracker().getJobIdsForGroup("notebook-cell-7") == []

    for key in _KEYS:
        sc.setLocalProperty(key, None)
    with job_group(sc, "sparknet-inner", "sparknet: inner work"):
        pass
    assert _job_properties(sc) == (None, None, None)


def test_a_fit_leaves_the_callers_job_group_as_it_was(sc):
    sc.setJobGroup("notebook-cell-8", "the caller's cell", interruptOnCancel=True)
    before = _job_properties(sc)
    x, y = blobs(16, seed=2)
    trainer = SparkTrainer(mlp(1), WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=8, seed=0),
                           dist=DistributedConfig(workers=2, engine="rounds", tau=1, rounds=2))
    result = trainer.fit(partitioned_rdd(sc, [(x[:8], y[:8]), (x[8:], y[8:])]))
    assert result.summary["rounds"] == 2
    assert _job_properties(sc) == before
    # the caller's next job runs under the caller's group again: cancelling that group (a notebook's
    # cell cancel) reaches it
    sc.parallelize(range(2), 2).count()
    assert _ended_jobs(sc, "notebook-cell-8") == ["SUCCEEDED"]


def test_a_job_past_its_deadline_is_cancelled_and_named(sc):
    sc.setJobGroup("notebook-cell-9", "the caller's cell")
    before = _job_properties(sc)
    rdd = sc.parallelize(range(2), 2).mapPartitionsWithIndex(_sleeper(120))
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded) as e:
        run_with_deadline(sc, "sparknet-test-late", "sparknet: a job that sleeps", rdd.collect, timeout_s=4,
                          what="the sleeping job")
    assert time.monotonic() - t0 < 60  # well before the tasks would have finished
    message = str(e.value)
    assert message.startswith("the sleeping job did not finish within 4 s; its Spark jobs were cancelled")
    assert "2 of 2 tasks of stage" in message and ("partitions [0, 1] still running" in message
                                                   or "2 running" in message)
    assert _ended_jobs(sc, "sparknet-test-late") == ["FAILED"]  # the job ran under the group, and was cancelled
    assert _job_properties(sc) == before


def test_a_stall_or_an_interrupt_of_the_wait_cancels_the_job(sc):
    rdd = sc.parallelize(range(2), 2).mapPartitionsWithIndex(_sleeper(120))
    asked = []

    def stalled():
        asked.append(time.monotonic())
        return "stalled: nothing heard for 2 s" if len(asked) >= 2 else None

    with pytest.raises(DeadlineExceeded, match="^the sleeping job stalled: nothing heard for 2 s; its Spark jobs"):
        run_with_deadline(sc, "sparknet-test-stall", "sparknet: a job that sleeps", rdd.collect, timeout_s=None,
                          what="the sleeping job", stalled=stalled)
    assert _running_jobs(sc, "sparknet-test-stall") == []

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_with_deadline(sc, "sparknet-test-interrupt", "sparknet: a job that sleeps", rdd.collect, timeout_s=600,
                          what="the sleeping job", stalled=interrupted)
    assert _running_jobs(sc, "sparknet-test-interrupt") == []


def test_a_rounds_task_failure_is_a_worker_error_with_its_rank_and_log_tail(sc):
    spec_bc = sc.broadcast(None)  # no spec: the task fails as it unpacks it
    rdd = sc.parallelize(range(4), 2).mapPartitionsWithIndex(run_round_from_chunks(spec_bc, spec_bc, RoundTask(plan=RoundPlan(round=0, steps=1), numel=0)))
    try:
        with pytest.raises(WorkerError) as e:
            run_with_deadline(sc, "sparknet-test-rounds-failure", "sparknet: a failing round",
                              lambda: sc.runJob(rdd, list, [1]), timeout_s=300, what="the round")
    finally:
        spec_bc.destroy()
    assert e.value.rank == 1
    assert str(e.value).startswith("worker 1: ")
    assert "_train_round" in e.value.log_tail and "[sparknet" not in e.value.log_tail


def test_python_workers_start_in_the_background_while_the_block_runs(sc):
    """One job of empty tasks, under its own group, runs beside the caller's block; the caller's thread keeps its
    job properties, and its own jobs run meanwhile."""
    before = _job_properties(sc)
    with python_workers_starting(sc) as group:
        assert sc.parallelize(range(4), 2).sum() == 6  # the caller's work goes on
        assert _job_properties(sc) == before
    assert _ended_jobs(sc, group) == ["SUCCEEDED"]
    assert _job_properties(sc) == before


def test_a_block_that_fails_does_not_wait_for_the_python_workers(sc):
    """The block's error comes back at once: the start job, held up behind a job that fills every slot, is
    cancelled rather than waited for."""
    import threading

    def hold():
        with job_group(sc, "sparknet-test-hold", "hold the slots"):
            try:
                sc.parallelize(range(2), 2).mapPartitionsWithIndex(_sleeper(30.0)).collect()
            except Exception:  # cancelled at the end of the test
                pass

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    deadline = time.monotonic() + 30
    while not _running_jobs(sc, "sparknet-test-hold", wait_s=0) and time.monotonic() < deadline:
        time.sleep(0.1)
    t0 = time.monotonic()
    try:
        with pytest.raises(ValueError, match="bad data"), python_workers_starting(sc) as group:
            time.sleep(1.0)
            raise ValueError("bad data")
        assert time.monotonic() - t0 < 15.0  # not the 30 s the slots are held
        assert _running_jobs(sc, group) == []
    finally:
        sc.cancelJobGroup("sparknet-test-hold")
        holder.join(60)
