"""Elastic rounds on two worker hosts: a host gone for good leaves one worker a round, one back is used again.

The session sets ``spark.locality.wait=0s``, as a cluster whose hosts come and go should: with
Spark's default 3 s, a round shorter than that stays on the host that holds its data, and a host
that came back gets no task (docs/RELIABILITY.md).
"""

from __future__ import annotations


import numpy as np
import pytest

from _rig import rig_session, wait_for_slots, wait_for_tasks_on
from sparknet import zoo
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.datasets import synthetic
from sparknet.solvers import SolverConfig

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def spark(cluster):
    with rig_session(cluster, "sparknet-elastic-tests", **{"spark.locality.wait": "0s"}) as session:
        yield session


def test_a_host_gone_leaves_one_worker_a_round_in_turn_and_a_host_back_is_used_again(spark, cluster):
    from sparknet.spark import EngineOptions, SparkTrainer

    sc = spark.sparkContext
    ds = synthetic(1200, shape=(6,), num_classes=3, seed=0, noise=1.0)
    rows = [([float(v) for v in x], int(y)) for x, y in zip(ds.x, ds.y)]
    df = spark.createDataFrame(sc.parallelize(rows, 2), "features array<double>, label long")
    val = synthetic(300, shape=(6,), num_classes=3, seed=5, noise=1.0)
    events = []

    def on_round(record):
        if record["round"] == 2:  # host 1 gone: wait until the driver has seen its executor go
            cluster.kill_host(1)
            wait_for_slots(sc, 1)
            events.append("killed")
        elif record["round"] == 5:  # host 1 back: wait until the application has an executor there again
            cluster.start_host(1)
            wait_for_slots(sc, 2)
            wait_for_tasks_on(sc, cluster.hostname(1))
            events.append("back")

    trainer = SparkTrainer(zoo.mlp(input_shape=[6], hidden=[16], num_classes=3),
                           WorkerConfig(solver=SolverConfig(base_lr=0.05, momentum=0.9), batch_size=16, seed=3),
                           dist=DistributedConfig(workers=2, tau=10, rounds=8), spark=spark, on_round=on_round,
                           options=EngineOptions(elastic_after_s=0, round_timeout_s=180))
    try:
        result = trainer.fit(df, validation=(val.x, val.y))
    finally:
        if not cluster.host_up(1):
            cluster.start_host(1)
    assert events == ["killed", "back"]
    rounds = [r for r in result.history if r.get("event") == "round"]
    assert [r["workers"] for r in rounds] == [2, 2, 1, 1, 1, 2, 2, 2]
    # while host 1 is gone, one worker trains each round, the two in turn, on the host left
    assert [r.get("trained_workers") for r in rounds] == [None, None, [0], [1], [0], None, None, None]
    for r in rounds[2:5]:
        assert [w["index"] for w in r["per_worker"]] == r["trained_workers"]
        assert r["hosts"] == [cluster.hostname(2)]
    # host 1 is back: both workers train every round and host 1 takes tasks again
    assert all(sorted(w["index"] for w in r["per_worker"]) == [0, 1] for r in rounds[5:])
    assert cluster.hostname(1) in {h for r in rounds[5:] for h in r["hosts"]}
    assert result.summary["elastic_rounds"] == 3
    assert result.summary["samples"] == sum(r["samples"] for r in rounds)
    assert result.summary["test_accuracy"] > 0.8 and np.isfinite(result.weights.to_flat().numpy()).all()
