"""A worker's memory capped as Spark caps it: ``spark.executor.pyspark.memory`` limits each Python worker's address
space (``RLIMIT_AS``), and an allocation past it fails.

On ``local[4]`` with every Python worker capped at 2,900 MiB, an MLP of 240 MiB of float32 weights (16 layers of
2,048) on K = 2 workers of G = 2 processes. Held whole, each process keeps the weights, the solver's momentum and the
round's copies of them: the fit fails at once, its error naming the cap and ``--shard-replica``. Sharded over each
worker's two processes, the fit trains; the weights the driver joins score what the workers reported. (Probed on two
cores, 2026-11-29: the whole fit fails under caps of 2,800-3,200 MiB and trains under 3,300 MiB; the sharded one
trains under 2,600-3,000 MiB and fails under 2,400 MiB. Before rank 0 sent its state from where it lies, the whole fit
failed under 3,700 MiB too.)
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from _spark_testlib import module_session
from sparknet import zoo
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.errors import WorkerOutOfMemory
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer

pytestmark = pytest.mark.spark

CAP_MIB = 2900
spark = module_session("local[4]", {"spark.executor.pyspark.memory": f"{CAP_MIB}m"})


def _fit(spark, shard: bool):
    rng = np.random.RandomState(0)
    x, y = rng.randn(256, 6).astype(np.float32), rng.randint(0, 3, 256)
    vx, vy = rng.randn(64, 6).astype(np.float32), rng.randint(0, 3, 64)
    rdd = spark.sparkContext.parallelize([(x[i], int(y[i])) for i in range(len(x))], 4)
    dist = DistributedConfig(workers=2, procs_per_worker=2, shard_replica=shard, engine="barrier", tau=3, rounds=2)
    net = zoo.mlp(input_shape=[6], hidden=[2048] * 16, num_classes=3)
    return SparkTrainer(net, WorkerConfig(solver=SolverConfig(base_lr=0.01, momentum=0.9), batch_size=8, seed=5),
                        dist=dist).fit(rdd, (vx, vy))


def test_a_replica_held_whole_past_the_cap_fails_at_once_naming_the_cap_and_the_sharded_replica(spark, caplog):
    with caplog.at_level(logging.WARNING, logger="sparknet"), pytest.raises(WorkerOutOfMemory) as caught:
        _fit(spark, shard=False)
    message = str(caught.value).split("\n--- last lines")[0]
    # what fails first is Python's allocation (MemoryError), torch's (RuntimeError: can't allocate memory), or a
    # native thread's or ZeroMQ's, which aborts the process: then Spark's error says it crashed
    assert message.startswith(f"worker {caught.value.rank}: ran out of memory"), message
    assert f"under the cap of {CAP_MIB:,} MiB that spark.executor.pyspark.memory puts on its address space" in message
    assert "Each process holds the whole replica, 240 MiB of weights" in message
    assert "--procs-per-worker G --shard-replica" in message
    assert isinstance(caught.value, MemoryError)
    assert "its Python worker crashed" in message or "memory" in caught.value.log_tail.splitlines()[-1].lower()
    # a restart would run out the same way: there is none
    assert not [r for r in caplog.records if "restart" in r.getMessage()], [r.getMessage() for r in caplog.records]


def test_the_same_replica_sharded_over_each_workers_processes_trains_under_the_cap(spark):
    result = _fit(spark, shard=True)
    s = result.summary
    weights, held = 4 * result.weights.to_flat(torch.float32).numel(), s["weight_bytes_per_rank"]
    assert held[0] + held[1] == held[2] + held[3] == weights and max(held) < 0.51 * weights, held  # a half each
    assert all(w["peak_rss_mb"] < CAP_MIB for w in s["barrier_workers"]), s["barrier_workers"]
    last = result.history[-1]
    assert last["round"] == 2 and s["test_accuracy"] == pytest.approx(last["val_accuracy"])
    assert result.net.evaluate().accuracy == pytest.approx(s["test_accuracy"])
