"""The rounds engine's worker that runs out of memory under Spark's cap (``spark.executor.pyspark.memory``): it
reports so as its round's result, and the fit fails at once, where a failed task would be retried by Spark
(``spark.task.maxFailures``: here ``local[2,3]``, three attempts; four on a cluster) and run out again each time.

An MLP of 240 MiB of float32 weights (16 layers of 2,048) held by each of K = 2 workers under a cap of 1,800 MiB;
then a small net in the same session trains, in the same Python workers. (Probed on two cores, 2026-11-29: the same
fit trains under 2,100 MiB, and once failed under 2,400 MiB reading its state file back; when each failed task was
retried, Spark ran five attempts here before the job failed.)
"""

from __future__ import annotations

import pytest

from _spark_testlib import blobs, module_session, partitioned_rdd
from sparknet import zoo
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.errors import WorkerOutOfMemory
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer

pytestmark = pytest.mark.spark

CAP_MIB = 1800
spark = module_session("local[2,3]", {"spark.executor.pyspark.memory": f"{CAP_MIB}m"})


def _fit(spark, hidden: list[int]):
    x, y = blobs(128, seed=3)
    return SparkTrainer(zoo.mlp(input_shape=[2], hidden=hidden, num_classes=3),
                        WorkerConfig(solver=SolverConfig(base_lr=0.01, momentum=0.9), batch_size=8, seed=5),
                        dist=DistributedConfig(workers=2, engine="rounds", tau=2, rounds=2)).fit(
        partitioned_rdd(spark.sparkContext, [(x[:64], y[:64]), (x[64:], y[64:])]))


def _failed_tasks(sc) -> int:
    tracker = sc.statusTracker()
    stages = [tracker.getStageInfo(i) for i in range(64)]
    return sum(s.numFailedTasks for s in stages if s is not None)


def test_a_worker_past_the_cap_fails_the_fit_at_once_and_its_task_is_not_retried(spark):
    with pytest.raises(WorkerOutOfMemory) as caught:
        _fit(spark, [2048] * 16)
    message = str(caught.value).split("\n--- last lines")[0]
    assert message.startswith(f"worker {caught.value.rank}: ran out of memory"), message
    assert f"under the cap of {CAP_MIB:,} MiB that spark.executor.pyspark.memory puts on its address space" in message
    assert "--engine barrier --procs-per-worker G --shard-replica" in message
    assert _failed_tasks(spark.sparkContext) == 0  # reported as the round's result: Spark had nothing to retry
    result = _fit(spark, [32])  # the same Python workers, their cached nets of the failed fit gone
    assert [h["round"] for h in result.history if h.get("event") == "round"] == [1, 2]
