"""Workers of several processes on two hosts of two task slots each (scripts/netns_cluster.py): K = 2 workers of
G = 2 processes. A worker's ranks are placed on one host, so the gradients they average at every step never
cross the network; only the exchange every tau steps does. A host lost mid-run takes its worker's two ranks with
it, and the stage starts again from the driver's newest state when the host is back, as one-process workers do.

Its own rig (two task slots a host); needs root, and under CI (``CI=true``) a rig that cannot start fails the run.
"""

from __future__ import annotations

import pytest

from _rig import (LOSS_NOTICED, finished_after_one_restart, finished_on_fewer_workers, host_lost_after_round,
                  host_lost_for_good, rig_session, started_rig)
from sparknet import zoo
from sparknet.collective import FIELDS
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.datasets import synthetic
from sparknet.solvers import SolverConfig

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def rig():
    yield from started_rig(cores=2, memory="1536m")


@pytest.fixture(scope="module")
def spark(rig):
    import time

    from sparknet.spark.backend import task_slots

    settings = {"spark.locality.wait": "0s", **LOSS_NOTICED}
    with rig_session(rig, "sparknet-worker-processes-tests", **settings) as session:
        deadline = time.monotonic() + 120  # both hosts' executors registered: four task slots
        while task_slots(session.sparkContext) != 4:
            assert time.monotonic() < deadline, "the rig's two hosts did not offer four task slots within 120 s"
            time.sleep(0.5)
        yield session


def _frame(spark, n=1200):
    ds = synthetic(n, shape=(6,), num_classes=3, seed=0, noise=1.0)
    rows = [([float(v) for v in x], int(y)) for x, y in zip(ds.x, ds.y)]
    return spark.createDataFrame(spark.sparkContext.parallelize(rows, 4), "features array<double>, label long")


def _trainer(spark, hidden, dist, batch_size=16, **kwargs):
    from sparknet.spark import SparkTrainer

    return SparkTrainer(zoo.mlp(input_shape=[6], hidden=hidden, num_classes=3),
                        WorkerConfig(solver=SolverConfig(base_lr=0.05, momentum=0.9), batch_size=batch_size, seed=3),
                        dist, spark=spark, **kwargs)


def _places(summary) -> dict[int, set[str]]:
    hosts: dict[int, set[str]] = {}
    for rank in summary["barrier_workers"]:
        hosts.setdefault(rank["worker"], set()).add(rank["host"])
    return hosts


def test_a_workers_every_step_traffic_stays_on_its_host(spark, rig):
    df = _frame(spark)
    val = synthetic(300, shape=(6,), num_classes=3, seed=5, noise=1.0)
    # about 1.06 M weights (4.2 MB of float32 gradients a step): one step's allreduce dwarfs Spark's own messages
    trainer = _trainer(spark, [1024, 1024], DistributedConfig(workers=2, procs_per_worker=2, engine="barrier",
                                                              tau=50, rounds=1))
    before = [rig.link_bytes(i) for i in (1, 2)]
    result = trainer.fit(df, validation=(val.x, val.y))
    crossed = sum(rig.link_bytes(i) - b for i, b in zip((1, 2), before))
    s = result.summary
    places = _places(s)
    assert all(len(hosts) == 1 for hosts in places.values()), places  # each worker's two ranks on one host
    assert places[0] | places[1] == {rig.hostname(1), rig.hostname(2)}
    record = [r for r in result.history if r.get("event") == "round"][-1]
    step_bytes = record["inner_allreduce_bytes"] // 50  # one step's gradients, as rank 0 allreduced them
    assert step_bytes > 4_000_000
    # had each step's allreduce crossed the network, the links would carry at least one step's gradients per
    # step: 50 x step_bytes (with each worker's ranks placed on both hosts they carried about 400 x). They carry
    # the one exchange, the weights there and back, and Spark's own messages: about 8 x. The exchange crosses once
    # a worker, not once a process: each of its two columns carries half of it (a ring allreduce of two workers
    # moves twice its buffer) and the ranks trade their halves on their host. When each column carried all of it,
    # the links carried about 12 x.
    assert record["bytes"] == 2 * 2 * 4 * -(-(record["inner_allreduce_bytes"] // 200 + 2 * FIELDS) // 2)  # 2 columns
    assert crossed < 10 * step_bytes, (crossed, step_bytes)
    assert s["test_accuracy"] > 0.5


def test_a_split_workers_every_step_traffic_stays_on_its_host(spark, rig):
    df = _frame(spark)
    # 2 workers of 2 processes, ip1 (6 -> 1024) split by columns and ip2 (1024 -> 1024) by rows: every step each
    # worker's ranks allreduce ip2's 128 x 1024 outputs (0.5 MB) forward, and ip1's input gradients back
    trainer = _trainer(spark, [1024, 1024], DistributedConfig(workers=4, model_parallel=2, engine="barrier", tau=50,
                                                              rounds=1), batch_size=128)
    before = [rig.link_bytes(i) for i in (1, 2)]
    result = trainer.fit(df)
    crossed = sum(rig.link_bytes(i) - b for i, b in zip((1, 2), before))
    places = _places(result.summary)
    assert all(len(hosts) == 1 for hosts in places.values()) and len(places[0] | places[1]) == 2, places
    exchange = result.history[-1]["bytes"]  # both columns of both workers: each process's part, there and back
    activations = 50 * 128 * 1024 * 4  # one worker's ranks' forward allreduces in a round, had they crossed
    print(f"crossed {crossed:,} bytes; the exchange {exchange:,}; a worker's activations {activations:,}")
    # the links carry the exchange (counted on both), the first worker's parts of the state to the driver, the
    # starting parts and Spark's own messages: less than one worker's round of activations would add
    assert crossed < 2 * exchange + activations, (crossed, exchange)


def test_a_host_lost_mid_run_takes_its_workers_ranks_and_the_run_finishes_when_it_is_back(spark, rig):
    from sparknet.spark import EngineOptions

    df = _frame(spark)
    val = synthetic(300, shape=(6,), num_classes=3, seed=5, noise=1.0)
    # a simulated link of 0.3 s a collective keeps round 3 running when host 1 dies
    with host_lost_after_round(rig, spark.sparkContext, slots=4) as kill_after_round_two:
        trainer = _trainer(spark, [16], DistributedConfig(workers=2, procs_per_worker=2, engine="barrier", tau=10,
                                                          rounds=6, link_latency="300ms"),
                           on_round=kill_after_round_two, options=EngineOptions(rendezvous_timeout_s=90))
        result = trainer.fit(df, validation=(val.x, val.y))
    s = finished_after_one_restart(result, rounds=6)
    places = _places(s)
    assert sorted(places) == [0, 1] and all(len(hosts) == 1 for hosts in places.values())
    assert set().union(*places.values()) == {rig.hostname(1), rig.hostname(2)}


@pytest.mark.parametrize("replica", ["whole", "sharded", "split"])
def test_a_host_gone_for_good_takes_its_workers_ranks_together_and_the_worker_left_finishes(spark, rig, tmp_path,
                                                                                           replica):
    """Host 1 dies after round 2 and stays down: the stage starts again with the one whole worker host 2's two slots
    hold, its two ranks on the rows of all four partitions, and every round is recorded. A sharded or split replica
    goes on from the whole state its parts were joined into, cut for the worker left; its checkpoints hold the
    global state and no solver state (those belonged to the partitions the fit started with)."""
    from sparknet.checkpoint import CheckpointManager
    from sparknet.spark import EngineOptions

    df = _frame(spark)
    val = synthetic(300, shape=(6,), num_classes=3, seed=5, noise=1.0)
    folder = str(tmp_path / "ckpt")
    with host_lost_for_good(rig, spark.sparkContext, slots=4) as kill_after_round_two:
        shape = dict(workers=4, model_parallel=2) if replica == "split" else dict(
            workers=2, procs_per_worker=2, shard_replica=replica == "sharded")
        trainer = _trainer(spark, [16], DistributedConfig(engine="barrier", tau=10, rounds=6, link_latency="300ms",
                                                          checkpoint_dir=folder, checkpoint_every=2, **shape),
                           on_round=kill_after_round_two, options=EngineOptions(rendezvous_timeout_s=60,
                                                                                elastic_after_s=0))
        result = trainer.fit(df, validation=(val.x, val.y))
    s = finished_on_fewer_workers(result, rounds=6, workers=1)
    assert _places(s) == {0: {rig.hostname(2)}}
    assert sorted(w["proc"] for w in s["barrier_workers"]) == [0, 1]
    assert sum(w["rows"] for w in s["barrier_workers"]) == df.count()
    before, last = (CheckpointManager(folder).load(r) for r in (2, 6))
    assert len(before.state["workers"]) == 4 and last.state["workers"] == {}
    assert last.state["steps_done"] == 60
    if replica != "whole":
        held = s["weight_bytes_per_rank" if replica == "sharded" else "weight_bytes_per_worker"]
        assert len(held) == 2 and max(held) < result.weights.nbytes


def test_one_round_of_two_workers_of_two_processes_is_two_one_process_workers_with_twice_the_batch(spark, rig):
    """Every partition one minibatch: a worker's two ranks average two 8-row gradients a step, as one rank with
    the 16 rows of both partitions does. The partitions each worker got are read from the first fit's placement."""
    import numpy as np
    import torch

    ds = synthetic(32, shape=(6,), num_classes=3, seed=2, noise=1.0)
    parts = [(ds.x[i * 8:(i + 1) * 8], ds.y[i * 8:(i + 1) * 8]) for i in range(4)]

    def rdd(pieces):
        rows = [[([float(v) for v in x], int(label)) for x, label in zip(*p)] for p in pieces]
        return spark.sparkContext.parallelize(rows, len(rows)).flatMap(lambda r: r)

    def fit(pieces, procs, batch):
        from sparknet.spark import SparkTrainer

        return SparkTrainer(zoo.mlp(input_shape=[6], hidden=[16], num_classes=3),
                            WorkerConfig(solver=SolverConfig(base_lr=0.1, momentum=0.9), batch_size=batch, seed=3),
                            DistributedConfig(workers=2, procs_per_worker=procs, engine="barrier", tau=4, rounds=1),
                            spark=spark).fit(rdd(pieces))

    two = fit(parts, 2, 8)
    workers = [sorted(r["rank"] for r in two.summary["barrier_workers"] if r["worker"] == w) for w in (0, 1)]
    assert sorted(sum(workers, [])) == [0, 1, 2, 3] and all(len(set(_places(two.summary)[w])) == 1 for w in (0, 1))
    one = fit([tuple(np.concatenate(a) for a in zip(*(parts[i] for i in ranks))) for ranks in workers], 1, 16)
    w2, w1 = (r.weights.to_flat(torch.float32) for r in (two, one))
    assert torch.allclose(w2, w1, atol=1e-5, rtol=1e-4), float((w2 - w1).abs().max())
    assert two.history[-1]["samples"] == one.history[-1]["samples"] == 4 * 32
