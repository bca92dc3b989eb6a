"""Reliability of both engines on local-cluster[2,1,1024]: a killed worker, exact resume, NaN workers, deadlines.

One session for the module: two executor JVMs of one core each, ``spark.task.maxFailures`` 4
(so the rounds engine's tasks are retried), an MLP on three Gaussian blobs. Faults are
injected with :mod:`sparknet.faults` (shipped to the executors inside the job).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from _spark_testlib import mlp, start_session, two_blob_workers
from sparknet.checkpoint import CheckpointError, CheckpointManager
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.errors import DeadlineExceeded, EngineError, WorkerError
from sparknet.solvers import SolverConfig
from sparknet.spark import EngineOptions, SparkTrainer

pytestmark = pytest.mark.spark

SOLVER = SolverConfig(base_lr=0.05, momentum=0.9)


@pytest.fixture(scope="module")
def spark():
    session = start_session("local-cluster[2,1,1024]", {"spark.task.maxFailures": "4"})
    yield session
    session.stop()


@pytest.fixture(scope="module")
def data(spark):
    return two_blob_workers(spark.sparkContext)


def _fit(data, engine, rounds=10, fault=None, tau=4, strategy="average", options=None, **dist):
    rdd, val = data
    opts = options or EngineOptions()
    opts.fault = fault
    trainer = SparkTrainer(mlp(), WorkerConfig(solver=SOLVER, batch_size=8, seed=4), options=opts,
                           dist=DistributedConfig(workers=2, engine=engine, tau=tau, rounds=rounds,
                                                  strategy=strategy, **dist))
    return trainer.fit(rdd, validation=val)


def _flat(result):
    return result.weights.to_flat(torch.float32)


def test_rounds_engine_retries_a_killed_worker_and_counts_its_round_once(data):
    clean = _fit(data, "rounds")
    hurt = _fit(data, "rounds", fault="rank=1,round=3,kind=kill")
    assert hurt.summary["rounds"] == 10 and hurt.summary["retries"] == 1
    assert [h["retries"] for h in hurt.history] == [0, 0, 1] + [0] * 7
    assert [w["attempt"] for w in hurt.history[2]["per_worker"]] == [0, 1]
    # the retry started from the previous round's saved state: the same samples, the same weights
    assert hurt.summary["samples"] == clean.summary["samples"]
    assert torch.allclose(_flat(hurt), _flat(clean), atol=1e-6)
    assert abs(hurt.summary["test_accuracy"] - clean.summary["test_accuracy"]) <= 0.005


def test_barrier_engine_restarts_the_stage_after_a_killed_worker(data):
    clean = _fit(data, "barrier")
    hurt = _fit(data, "barrier", fault="rank=1,round=3,kind=kill")
    s = hurt.summary
    assert s["rounds"] == 10 and s["restarts"] == 1 and s["restart_log"][0]["after_round"] == 2
    assert [h["round"] for h in hurt.history] == list(range(1, 11))
    assert all(h.get("restarts") == 1 for h in hurt.history[2:]) and "restarts" not in hurt.history[1]
    assert abs(s["test_accuracy"] - clean.summary["test_accuracy"]) <= 0.005


def test_barrier_engine_gives_up_after_max_restarts(data):
    with pytest.raises(WorkerError) as info:
        _fit(data, "barrier", rounds=3, fault="rank=0,round=2,kind=raise;rank=0,round=2,kind=raise,attempt=1",
             options=EngineOptions(max_restarts=1))
    assert info.value.rank == 0 and "injected fault" in str(info.value)


@pytest.mark.parametrize("engine, strategy", [("rounds", "diloco"), ("barrier", "diloco"), ("barrier", "easgd")])
def test_resume_is_exact(data, tmp_path, engine, strategy):
    # momentum on the workers and DiLoCo's outer momentum on the driver must both survive the stop
    whole = _fit(data, engine, rounds=5, tau=3, strategy=strategy)
    ckpt = str(tmp_path / "ckpt")
    first = _fit(data, engine, rounds=2, tau=3, strategy=strategy, checkpoint_dir=ckpt, checkpoint_every=1)
    assert first.summary["checkpoints"] == [1, 2]
    resumed = _fit(data, engine, rounds=5, tau=3, strategy=strategy, checkpoint_dir=ckpt, checkpoint_every=2,
                   resume=True)
    assert resumed.summary["resumed_from"] == 2 and [h["round"] for h in resumed.history] == [3, 4, 5]
    assert resumed.history[-1]["total_steps"] == whole.history[-1]["total_steps"]
    assert torch.equal(_flat(resumed), _flat(whole))  # one thread per worker: bitwise
    assert CheckpointManager(ckpt).rounds() == [2, 4, 5]  # the newest three


def test_a_nan_worker_is_left_out_and_all_nan_stops_with_the_checkpoint_intact(data, tmp_path):
    for engine in ("rounds", "barrier"):
        one = _fit(data, engine, rounds=4, fault="rank=1,round=2,kind=nan")
        assert [h.get("nonfinite_workers", 0) for h in one.history] == [0, 1, 0, 0]
        assert one.summary["nonfinite_workers"] == 1 and np.isfinite(_flat(one)).all()
        assert one.history[1]["samples"] == one.history[0]["samples"]  # it trained, but was not averaged

        ckpt = str(tmp_path / engine)
        with pytest.raises(EngineError, match="no worker produced finite weights"):
            _fit(data, engine, rounds=4, fault="rank=0,round=3,kind=nan;rank=1,round=3,kind=nan",
                 checkpoint_dir=ckpt, checkpoint_every=1)
        manager = CheckpointManager(ckpt)
        assert manager.rounds() == [1, 2]
        assert torch.isfinite(manager.load().weights.to_flat(torch.float32)).all()


def test_a_hung_round_is_cancelled_at_its_deadline_naming_the_task(spark, data):
    # round 1 (well within the deadline) runs clean; round 2 hangs on partition 1
    with pytest.raises(DeadlineExceeded, match=r"round 2 did not finish within round_timeout_s=20 s") as info:
        _fit(data, "rounds", rounds=3, tau=1, fault="rank=1,round=2,kind=hang,hang_s=600",
             options=EngineOptions(round_timeout_s=20))
    assert "partitions [1] still running" in str(info.value)
    assert spark.sparkContext.getLocalProperty("spark.jobGroup.id") is None


def test_checkpoint_folder_problems_are_clear_before_training(data, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.raises(CheckpointError, match="checkpoint-dir"):
        _fit(data, "rounds", rounds=1, checkpoint_dir=str(blocked / "ckpt"))
    ckpt = str(tmp_path / "other")
    rdd, val = data
    SparkTrainer(torch.nn.Sequential(torch.nn.Linear(2, 3)), WorkerConfig(solver=SOLVER, batch_size=8),
                 dist=DistributedConfig(workers=2, tau=2, rounds=1, checkpoint_dir=ckpt)).fit(rdd)
    with pytest.raises(CheckpointError, match="belongs to another model"):
        _fit(data, "rounds", rounds=2, checkpoint_dir=ckpt, resume=True)
    assert os.listdir(ckpt) == ["ckpt-00000001"]
