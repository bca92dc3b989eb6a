"""A moving average of the global weights (DistributedConfig.weight_ema) on local[2]: both engines record the
global weights' and the average's scores every round and return the average."""

from __future__ import annotations

import pytest
import torch

from _spark_testlib import blobs, flat, hand_rounds, mlp, module_session, partitioned_rdd
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.loop import WeightAverage
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer

pytestmark = pytest.mark.spark

spark = module_session("local[2]")


@pytest.mark.parametrize("engine", ["rounds", "barrier"])
def test_the_fit_records_both_scores_and_returns_the_average(spark, engine):
    x, y = blobs(48, seed=1)
    parts = [(x[:24], y[:24]), (x[24:], y[24:])]
    val = blobs(200, seed=2)
    solver = SolverConfig(base_lr=0.05, momentum=0.9)
    dist = DistributedConfig(workers=2, engine=engine, tau=3, rounds=4, weight_ema=0.5, eval_budget=1.0)
    result = SparkTrainer(mlp(), WorkerConfig(solver=solver, batch_size=8, seed=3), dist=dist).fit(
        partitioned_rdd(spark.sparkContext, parts), validation=val)

    # the average by hand: the global weights of rounds 1..4 (Listing 3 in one process), folded in with the warm-up
    average = WeightAverage(0.5, flat(mlp()))
    for r in range(1, 5):
        last_global = hand_rounds(mlp(), solver, parts, batch_size=8, seed=3, tau=3, rounds=r)
        average.update(last_global, r)
    returned = result.weights.to_flat(torch.float32)
    assert torch.allclose(returned, average.flat, atol=1e-5)
    assert not torch.allclose(returned, last_global, atol=1e-3)  # the average, not the last global weights

    # every round scored both; the summary's test scores are the returned weights', recomputed here from them
    rounds = [h for h in result.history if h.get("event") == "round"]
    assert len(rounds) == 4
    assert all({"val_accuracy", "val_loss", "val_ema_accuracy", "val_ema_loss"} <= set(h) for h in rounds)
    scorer = Net(mlp(), solver)
    scorer.set_weights(result.weights)
    test = scorer.evaluate(val)
    s = result.summary
    assert s["returned_weights"] == "ema" and s["weight_ema"] == 0.5
    assert s["test_loss"] == pytest.approx(test.loss, rel=1e-5)
    assert s["test_accuracy"] == pytest.approx(test.accuracy)
    assert rounds[-1]["val_ema_loss"] == pytest.approx(test.loss, rel=1e-5)
    scorer.set_flat(last_global)
    plain = scorer.evaluate(val)
    assert s["test_global_loss"] == pytest.approx(plain.loss, rel=1e-4) == rounds[-1]["val_loss"]
    assert s["test_global_accuracy"] == pytest.approx(plain.accuracy)
    assert s["test_global_loss"] != pytest.approx(s["test_loss"], rel=1e-4)


def test_the_estimator_takes_it_as_a_param():
    from sparknet import zoo
    from sparknet.spark.ml import SparkNetEstimator

    net = zoo.mlp(input_shape=[2], hidden=[8], num_classes=3)
    assert SparkNetEstimator(net, weightEma=0.8).configs(2)[1].weight_ema == 0.8
    assert SparkNetEstimator(net).configs(2)[1].weight_ema is None
    with pytest.raises(ValueError, match="weight_ema"):
        SparkNetEstimator(net, weightEma=1.2).configs(2)
