"""The conjugate-gradient solver as the local solver of averaging rounds on Spark local[2]."""

from __future__ import annotations

import pytest
import torch

from _spark_testlib import blobs, hand_rounds, mlp, module_session, partitioned_rdd
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer

pytestmark = pytest.mark.spark

spark = module_session("local[2]")


def test_cg_trains_as_the_local_solver_of_averaging_rounds(spark):
    # two workers of 200 rows, minibatches of 100: each round is 4 conjugate-gradient steps per worker, then the mean
    x, y = blobs(400, seed=21)
    parts = [(x[:200], y[:200]), (x[200:], y[200:])]
    solver = SolverConfig(type="cg", base_lr=0.1)
    records = []
    result = SparkTrainer(mlp(), WorkerConfig(solver=solver, batch_size=100, seed=4),
                          dist=DistributedConfig(workers=2, engine="rounds", tau=4, rounds=5),
                          on_round=records.append).fit(partitioned_rdd(spark.sparkContext, parts),
                                                       validation=blobs(300, seed=22))
    assert [r["steps"] for r in records] == [4] * 5 and result.summary["samples"] == 5 * 2 * 4 * 100
    assert result.summary["test_accuracy"] >= 0.9
    assert records[-1]["loss"] < 0.5 * records[0]["loss"]

    # one round is exactly the workers' conjugate-gradient steps run by hand in one process, then their mean (later
    # rounds are not compared: a line search's accept-or-extend choices turn the mean's last-bit rounding, which
    # differs between the engine and the hand loop, into visible differences)
    one = SparkTrainer(mlp(), WorkerConfig(solver=solver, batch_size=100, seed=4),
                       dist=DistributedConfig(workers=2, engine="rounds", tau=4, rounds=1)).fit(
        partitioned_rdd(spark.sparkContext, parts))
    expected = hand_rounds(mlp(), solver, parts, batch_size=100, seed=4, tau=4, rounds=1)
    assert torch.allclose(one.weights.to_flat(torch.float32), expected, atol=1e-5, rtol=1e-5)
    sgd = hand_rounds(mlp(), solver.replace(type="sgd"), parts, batch_size=100, seed=4, tau=4, rounds=1)
    assert not torch.allclose(sgd, expected, atol=1e-2)  # what SGD at the same rate would have made


@pytest.mark.parametrize("solver_type", ["cg", "lbfgs"])
def test_a_line_search_solver_under_the_sync_strategy_is_refused_before_any_work(spark, solver_type):
    with pytest.raises(ValueError, match=f"the {solver_type} solver's line search"):
        SparkTrainer(mlp(), WorkerConfig(solver=SolverConfig(type=solver_type)),
                     dist=DistributedConfig(workers=2, engine="barrier", strategy="sync", tau=5))
    assert spark.sparkContext.statusTracker().getActiveJobsIds() == []
