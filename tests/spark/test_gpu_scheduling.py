"""Spark schedules the workers' GPUs (--gpus-per-worker): a resource profile on the training stage only.

One executor JVM with two task slots "has" GPUs 3 and 5 through a discovery script, as in Spark's own
resource-scheduling tests; no task asks for a GPU by default, so the stages that read and stage the data run
without one, and only the training stage asks for its share. torch has no CUDA here: each task reports the
address Spark gave it and trains on the CPU, saying why.
"""

from __future__ import annotations

import pytest
import torch

from _spark_testlib import blobs, fake_gpus, mlp, partitioned_rdd, start_session, stop_session
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    gpus = fake_gpus(tmp_path_factory.mktemp("gpu"), ["3", "5"], per_executor=2)
    session = start_session("local-cluster[1,2,1024]", gpus)
    yield session
    stop_session(session, gpus)


def _fit(spark, engine: str, gpus: float | None):
    x, y = blobs(16, seed=8)
    rdd = partitioned_rdd(spark.sparkContext, [(x[:8], y[:8]), (x[8:], y[8:])])
    worker = WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=4, device="auto", gpus_per_worker=gpus)
    return SparkTrainer(mlp(), worker, dist=DistributedConfig(workers=2, engine=engine, tau=2, rounds=1)).fit(rdd)


def _workers(result) -> list[dict]:
    """Each worker's record of where it trained (the barrier engine's summary, the rounds engine's round)."""
    return result.summary.get("barrier_workers") or result.history[0]["per_worker"]


def _addresses(result) -> list[list[str]]:
    return [w["gpu_addresses"] for w in _workers(result)]


@pytest.mark.parametrize("engine", ["barrier", "rounds"])
def test_each_worker_gets_a_whole_gpu_of_its_own_and_says_which(spark, engine):
    assert not torch.cuda.is_available()
    result = _fit(spark, engine, 1)
    addresses = _addresses(result)
    assert sorted(a for task in addresses for a in task) == ["3", "5"]
    assert result.summary["gpu_scheduling"]["profile"] is not None
    for worker in _workers(result):
        assert worker["device"] == "cpu" and "assigned GPU" in worker["device_reason"]


@pytest.mark.parametrize("engine", ["barrier", "rounds"])
def test_half_a_gpu_each_puts_two_workers_on_one_address(spark, engine):
    addresses = _addresses(_fit(spark, engine, 0.5))
    assert len(addresses) == 2 and all(len(task) == 1 for task in addresses)
    assert addresses[0] == addresses[1] and addresses[0][0] in ("3", "5")


def test_the_stages_before_training_ask_for_no_gpu(spark):
    from pyspark import TaskContext

    def resources(_):
        yield sorted(TaskContext.get().resources())

    _fit(spark, "barrier", 1)  # a profile on the training stage leaves the session's default as it was
    assert spark.sparkContext.parallelize(range(2), 2).mapPartitions(resources).collect() == [[], []]


def test_more_gpus_than_the_executors_have_is_refused_before_anything_waits(spark):
    with pytest.raises(ValueError, match="more GPUs than an executor has"):
        _fit(spark, "barrier", 3)
    with pytest.raises(ValueError, match="2 workers.*GPU"):
        _fit(spark, "barrier", 2)  # one executor of two GPUs holds one such worker at a time, not the stage's two


@pytest.mark.parametrize("gpus", [0, -1, 1.5, 0.3])
def test_a_share_spark_cannot_split_a_gpu_into_is_a_clear_error(gpus):
    with pytest.raises(ValueError, match="gpus_per_worker"):
        WorkerConfig(gpus_per_worker=gpus)


def test_synthetic_images_are_made_on_the_executors_and_train(spark):
    from sparknet.datasets import SyntheticImages
    from sparknet.spark.run import synthetic_frame

    images = SyntheticImages(12, shape=(3, 5, 5), num_classes=4, seed=3)
    frame = synthetic_frame(spark, images, partitions=2)
    rows = sorted(frame.collect(), key=lambda r: tuple(r.features))
    x, y = images.x, images.y
    expected = sorted(zip(x.reshape(12, -1).tolist(), y.tolist()))
    assert [(pytest.approx(list(r.features)), r.label) for r in rows] == [(f, label) for f, label in expected]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(75, 4))
    result = SparkTrainer(net, WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=3),
                          dist=DistributedConfig(workers=2, engine="rounds", tau=2, rounds=1)).fit(frame)
    assert result.summary["data_rows"] == 12


def test_a_worker_of_two_processes_gives_each_its_part_of_the_workers_gpus(spark):
    from sparknet.spark.resources import gpu_profile

    x, y = blobs(16, seed=8)
    rdd = partitioned_rdd(spark.sparkContext, [(x[:8], y[:8]), (x[8:], y[8:])])

    def fit(gpus):
        worker = WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=4, device="auto", gpus_per_worker=gpus)
        return SparkTrainer(mlp(), worker, dist=DistributedConfig(workers=1, procs_per_worker=2, engine="barrier",
                                                                  tau=2, rounds=1)).fit(rdd)

    whole = fit(2)  # one worker, two GPUs: one for each of its processes
    assert sorted(a for task in _addresses(whole) for a in task) == ["3", "5"]
    assert whole.summary["gpu_scheduling"]["gpus_per_process"] == 1
    half = fit(1)  # one GPU: its two processes share it
    assert [len(task) for task in _addresses(half)] == [1, 1] and len({a for t in _addresses(half) for a in t}) == 1
    with pytest.raises(ValueError, match=r"--gpus-per-worker 2 over --procs-per-worker 3 gives each process 0.666667 GPUs"):
        gpu_profile(spark.sparkContext, 2, workers=3, procs=3)
