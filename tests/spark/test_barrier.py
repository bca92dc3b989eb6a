"""The barrier engine on local[2]: exactness, records during the stage, stopping together, errors."""

from __future__ import annotations

import sys

import pytest
import torch
import zmq

from _spark_testlib import blobs, flat, hand_rounds, mlp, module_session, partitioned_rdd
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.errors import DeadlineExceeded, WorkerError
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.spark import EngineOptions, SparkTrainer
from sparknet.spark._channel import MetricsReceiver, MetricsSender

pytestmark = pytest.mark.spark


spark = module_session("local[2]")


def _flat(result):
    return result.weights.to_flat(torch.float32)


def test_barrier_average_is_the_sample_weighted_mean_with_records_during_the_stage(spark):
    sc = spark.sparkContext
    x, y = blobs(32, seed=1)
    parts = [(x[:12], y[:12]), (x[12:], y[12:])]
    solver = SolverConfig(base_lr=0.05, momentum=0.9)
    seen = []

    def on_round(record):
        seen.append((record["round"], len(sc.statusTracker().getActiveJobsIds())))

    # a simulated link of 0.4 s a collective keeps the stage running well past round 1's record (the weights
    # do not depend on it): without it the whole stage can end within one of the driver's 50 ms polls
    result = SparkTrainer(mlp(), WorkerConfig(solver=solver, batch_size=8, seed=3), on_round=on_round,
                          dist=DistributedConfig(workers=2, engine="barrier", tau=3, rounds=3, link_latency="400ms")
                          ).fit(partitioned_rdd(sc, parts))
    expected = hand_rounds(mlp(), solver, parts, batch_size=8, seed=3, tau=3, rounds=3)
    assert torch.allclose(_flat(result), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(_flat(result), flat(mlp()), atol=1e-3)
    # records reached the driver while the barrier job was still running
    assert [r for r, _ in seen] == [1, 2, 3] and seen[0][1] >= 1
    last = result.history[-1]
    assert last["engine"] == "barrier" and last["steps"] == 3 and last["samples"] == 48 and last["total_steps"] == 9
    assert last["round_s"] >= last["compute_s"] > 0 and 0 <= last["allreduce_s"] < last["round_s"]
    assert [w["samples"] for w in last["per_worker"]] == [24, 24]
    # each round began after the stage's launch and the one before it, on the driver's clock
    starts = [r["start_s"] for r in result.history]
    assert result.summary["setup_s"] < starts[0] < starts[1] < starts[2]
    assert all(r["start_s"] + r["round_s"] <= r["wall_s"] + 0.01 for r in result.history)
    s = result.summary
    assert s["rounds"] == 3 and s["bytes_communicated"] > 0 and s["metrics_rejected"] == 0
    assert [w["rank"] for w in s["barrier_workers"]] == [0, 1]
    assert sc.getLocalProperty("spark.jobGroup.id") is None


def test_barrier_tau_one_plain_sgd_equals_one_large_batch_step(spark):
    x, y = blobs(16, seed=2)
    parts = [(x[:8], y[:8]), (x[8:], y[8:])]
    solver = SolverConfig(base_lr=0.2, momentum=0.0, weight_decay=0.0)
    result = SparkTrainer(mlp(1), WorkerConfig(solver=solver, batch_size=8),
                          dist=DistributedConfig(workers=2, engine="barrier", tau=1, rounds=1)
                          ).fit(partitioned_rdd(spark.sparkContext, parts))
    big = Net(mlp(1), solver, batch_size=16, seed=0)
    big.set_training_data((x, y))
    big.train(1)
    assert torch.allclose(_flat(result), big.get_flat(), atol=1e-6, rtol=1e-5)


def test_barrier_ranks_stop_together_on_target_accuracy(spark):
    x, y = blobs(64, seed=4)
    rdd = partitioned_rdd(spark.sparkContext, [(x[:32], y[:32]), (x[32:], y[32:])])
    res = SparkTrainer(mlp(), WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=8),
                       dist=DistributedConfig(workers=2, engine="barrier", tau=10, rounds=30, target_accuracy=0.9,
                                              eval_budget=1.0)
                       ).fit(rdd, validation=blobs(50, seed=9))
    assert res.summary["stop_reason"] == "target_accuracy" and res.summary["rounds"] < 30
    assert res.history[-1]["val_accuracy"] >= 0.9
    # the ranks' sharded evaluation agrees with the driver's evaluation of the same weights
    assert res.history[-1]["val_accuracy"] == pytest.approx(res.summary["test_accuracy"])


def _boom_on_rank_one(pred, y):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("rank one fails on purpose")
    return torch.nn.functional.cross_entropy(pred, y)


def test_barrier_failure_names_the_rank(spark):
    import pyspark.cloudpickle as cp

    cp.register_pickle_by_value(sys.modules[__name__])
    try:
        x, y = blobs(16)
        rdd = partitioned_rdd(spark.sparkContext, [(x[:8], y[:8]), (x[8:], y[8:])])
        # no restarts: the rank is named the same after each (test_reliability gives up after restarts)
        trainer = SparkTrainer(mlp(), WorkerConfig(batch_size=4), loss=_boom_on_rank_one,
                               dist=DistributedConfig(workers=2, engine="barrier", tau=2, rounds=2),
                               options=EngineOptions(max_restarts=0))
        with pytest.raises(WorkerError) as info:
            trainer.fit(rdd)
    finally:
        cp.unregister_pickle_by_value(sys.modules[__name__])
    assert info.value.rank == 1 and "rank one fails on purpose" in str(info.value)
    assert "_boom_on_rank_one" in info.value.log_tail


def test_a_stuck_rank_is_named_when_its_peers_collective_times_out(spark):
    # rank 1 hangs in round 2's local steps; rank 0 waits in the allreduce until the collective deadline
    x, y = blobs(16)
    rdd = partitioned_rdd(spark.sparkContext, [(x[:8], y[:8]), (x[8:], y[8:])])
    trainer = SparkTrainer(mlp(), WorkerConfig(batch_size=4), DistributedConfig(workers=2, engine="barrier", tau=1, rounds=4),
                           options=EngineOptions(collective_timeout_s=5, max_restarts=0,
                                                 fault="rank=1,round=2,kind=hang,hang_s=60"))
    with pytest.raises(WorkerError) as info:
        trainer.fit(rdd)
    assert info.value.rank == 1
    assert "rank 1 did not reach round 2's exchange within collective_timeout_s=5 s" in str(info.value)
    assert "rank 0 waited for it" in str(info.value)


def _slot_holder(sc, group: str, seconds: float):
    """A thread (not started) whose Spark job, in job group ``group``, holds one task slot for ``seconds`` (or until
    the group is cancelled)."""
    import threading
    import time

    from sparknet.spark.backend import job_group

    def hold_a_slot():
        with job_group(sc, group, "a job that holds one task slot"):
            try:
                sc.parallelize([0], 1).map(lambda v: time.sleep(seconds) or v).collect()
            except Exception:  # cancelled at the end of the test
                pass

    return threading.Thread(target=hold_a_slot, daemon=True)


def test_driver_wait_has_a_deadline_and_cancels_the_stage(spark):
    """A stage whose tasks cannot all start (one of the two slots held by another job) is cancelled when the
    rendezvous deadline passes, and the driver says why."""
    import time

    from sparknet.spark.backend import cancel_group

    sc = spark.sparkContext
    tracker = sc.statusTracker()
    x, y = blobs(16)
    rdd = partitioned_rdd(sc, [(x[:8], y[:8]), (x[8:], y[8:])])

    holder = _slot_holder(sc, "hold-a-slot", 120)
    holder.start()
    try:
        deadline = time.time() + 60
        while not tracker.getActiveJobsIds() and time.time() < deadline:
            time.sleep(0.1)
        trainer = SparkTrainer(mlp(), WorkerConfig(batch_size=4),
                               DistributedConfig(workers=2, engine="barrier", tau=1, rounds=50),
                               options=EngineOptions(rendezvous_timeout_s=3.0))
        with pytest.raises(DeadlineExceeded, match="did not all start"):
            trainer.fit(rdd)
    finally:
        cancel_group(sc, "hold-a-slot")
        holder.join(60)
    deadline = time.time() + 60
    while tracker.getActiveJobsIds() and time.time() < deadline:
        time.sleep(0.5)
    assert tracker.getActiveJobsIds() == []


def test_a_restarted_stage_whose_tasks_cannot_all_start_is_started_again(spark):
    """A stage started again after a failure finds a slot taken (as one on a host Spark has not yet seen go would
    be): that is one more restart, not the end of the fit, and the fit ends once the slot is free again."""

    from sparknet.spark.backend import cancel_group

    sc = spark.sparkContext
    x, y = blobs(16)
    rdd = partitioned_rdd(sc, [(x[:8], y[:8]), (x[8:], y[8:])])

    # queued while the stage runs: a slot when it fails, held twice the rendezvous deadline (which leaves a stage that
    # can start room to start on two loaded cores)
    holder = _slot_holder(sc, "hold-a-slot-at-restart", 12)

    def on_round(record):
        if record["round"] == 1 and holder.ident is None:
            holder.start()

    trainer = SparkTrainer(mlp(), WorkerConfig(batch_size=4),
                           DistributedConfig(workers=2, engine="barrier", tau=1, rounds=6), on_round=on_round,
                           options=EngineOptions(rendezvous_timeout_s=6.0, max_restarts=6,
                                                 fault="rank=1,round=2,kind=kill"))
    try:
        result = trainer.fit(rdd)
    finally:
        cancel_group(sc, "hold-a-slot-at-restart")
        if holder.ident is not None:
            holder.join(60)
    s = result.summary
    assert [r["round"] for r in result.history if r.get("event") == "round"] == list(range(1, 7))
    assert s["restarts"] >= 2 and any("did not all start" in r["error"] for r in s["restart_log"]), s["restart_log"]


def test_barrier_needs_a_slot_per_worker(spark):
    x, y = blobs(30)
    rdd = partitioned_rdd(spark.sparkContext, [(x[:10], y[:10]), (x[10:20], y[10:20]), (x[20:], y[20:])])
    with pytest.raises(ValueError, match="task slots"):
        SparkTrainer(mlp(), dist=DistributedConfig(workers=3, engine="barrier", tau=1, rounds=1)).fit(rdd)


def test_metrics_channel_lets_in_only_this_fits_tasks():
    """Each fit's channel has keys of its own: a sender with another fit's keys delivers nothing."""
    with MetricsReceiver("127.0.0.1", "127.0.0.1") as rx, MetricsReceiver("127.0.0.1", "127.0.0.1") as other:
        forged = MetricsSender(rx.endpoint, other.client_keys)
        honest = MetricsSender(rx.endpoint, rx.client_keys)
        try:
            forged._dialer.socket.setsockopt(zmq.LINGER, 0)
            forged.send({"event": "round", "round": 99})
            assert rx.recv(2.0) is None  # its handshake never finished
            honest.send({"event": "round", "round": 1, "loss": 0.5})
            assert rx.recv(2.0) == {"event": "round", "round": 1, "loss": 0.5}
        finally:
            forged.close()
            honest.close()


@pytest.mark.parametrize("engine", ["barrier", "rounds"])
def test_a_gpu_share_in_local_mode_trains_without_a_profile_and_says_why(spark, engine):
    x, y = blobs(16, seed=3)
    worker = WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=4, gpus_per_worker=1)
    result = SparkTrainer(mlp(), worker, dist=DistributedConfig(workers=2, engine=engine, tau=2, rounds=1)).fit(
        partitioned_rdd(spark.sparkContext, [(x[:8], y[:8]), (x[8:], y[8:])]))
    scheduling = result.summary["gpu_scheduling"]
    assert scheduling["gpus_per_worker"] == 1 and scheduling["profile"] is None
    assert "local mode" in scheduling["reason"] and "GPU i modulo" in scheduling["reason"]
    assert SparkTrainer(mlp(), WorkerConfig(batch_size=4), dist=DistributedConfig(workers=2, engine=engine, tau=2,
                        rounds=1)).fit(partitioned_rdd(spark.sparkContext, [(x[:8], y[:8]), (x[8:], y[8:])])
                                       ).summary["gpu_scheduling"] is None
