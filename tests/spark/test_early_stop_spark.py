"""Early stopping (DistributedConfig.patience) on local[2]: both engines stop once the whole validation set's score
has not bettered the best for ``patience`` evaluations, and return the best round's weights; a barrier stage
restarted after a failure goes on counting from the best weights scored before it."""

from __future__ import annotations

import pytest
import torch

from _spark_testlib import blobs, hand_rounds, mlp, module_session, partitioned_rdd
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.spark import EngineOptions, SparkTrainer

pytestmark = pytest.mark.spark

spark = module_session("local[2]")

SOLVER = SolverConfig(base_lr=0.05, momentum=0.9)
X, Y = blobs(48, seed=1)
PARTS = [(X[:24], Y[:24]), (X[24:], Y[24:])]
VAL = blobs(200, seed=2)


def _fit(spark, engine: str, fault: str | None = None, **dist):
    options = EngineOptions()
    options.fault = fault
    config = DistributedConfig(**{"workers": 2, "engine": engine, "tau": 3, "rounds": 12, "eval_budget": 1.0, **dist})
    return SparkTrainer(mlp(), WorkerConfig(solver=SOLVER, batch_size=8, seed=3), dist=config, options=options).fit(
        partitioned_rdd(spark.sparkContext, PARTS), validation=VAL)


def _scored(result):
    scorer = Net(mlp(), SOLVER)
    scorer.set_weights(result.weights)
    return scorer.evaluate(VAL)


@pytest.mark.parametrize("engine, extra", [("rounds", {}), ("barrier", {}), ("rounds", {"eval_overlap": True})])
def test_the_fit_stops_after_patience_evaluations_without_betterment_and_returns_the_best_weights(spark, engine,
                                                                                                   extra):
    # no later evaluation betters the first by 10 (a loss cannot fall so far): the first round's weights are the
    # best, and the third evaluation without betterment stops the fit at round 4 (scored behind the next round's
    # training, at round 5: the round it is judged in)
    result = _fit(spark, engine, patience=3, min_delta=10.0, **extra)
    rounds = [h for h in result.history if h.get("event") == "round"]
    assert [h["round"] for h in rounds] == [1, 2, 3, 4, 5][:5 if extra else 4]
    assert all("val_loss" in h for h in rounds)  # every evaluation scored the whole set
    assert rounds[-1]["stop_reason"] == "patience" and rounds[-1]["best_round"] == 1
    first = hand_rounds(mlp(), SOLVER, PARTS, batch_size=8, seed=3, tau=3, rounds=1)
    assert torch.allclose(result.weights.to_flat(torch.float32), first, atol=1e-5)
    s = result.summary
    assert s["returned_weights"] == "best" and s["best_round"] == 1 and s["stop_reason"] == "patience"
    test = _scored(result)
    assert s["test_loss"] == pytest.approx(test.loss, rel=1e-5) == rounds[0]["val_loss"]
    assert s["test_accuracy"] == pytest.approx(test.accuracy)


def test_the_loss_falling_keeps_the_fit_going_and_the_last_weights_are_then_the_best(spark):
    result = _fit(spark, "rounds", patience=2)
    rounds = [h for h in result.history if h.get("event") == "round"]
    losses = [h["val_loss"] for h in rounds]
    assert len(rounds) >= 4  # the loss of these blobs falls for rounds on end
    # the rule by hand: stopped at the first round after which two evaluations in a row did not better the best
    best, since, stop = None, 0, None
    for r, loss in enumerate(losses, 1):
        best, since = (loss, 0) if best is None or loss < best else (best, since + 1)
        if since >= 2:
            stop = r
            break
    assert (rounds[-1].get("stop_reason") == "patience") is (stop is not None)
    assert len(rounds) == (stop or 12)
    assert result.summary["best_round"] == 1 + losses.index(min(losses))
    assert result.summary["test_loss"] == pytest.approx(_scored(result).loss, rel=1e-5) == min(losses)


def test_a_restarted_barrier_stage_goes_on_from_the_best_weights_scored_before_it(spark):
    # round 3 fails once: the stage restarts from round 2's state, which says round 1 is the best and one evaluation
    # has not bettered it; counting on, round 4 is the third (a count started afresh would stop at round 5 with
    # round 3's weights)
    result = _fit(spark, "barrier", fault="rank=1,round=3,kind=raise", patience=3, min_delta=10.0)
    s = result.summary
    assert s["restarts"] == 1 and s["restart_log"][0]["after_round"] == 2
    assert [h["round"] for h in result.history] == [1, 2, 3, 4]
    assert s["stop_reason"] == "patience" and s["best_round"] == 1
    first = hand_rounds(mlp(), SOLVER, PARTS, batch_size=8, seed=3, tau=3, rounds=1)
    assert torch.allclose(result.weights.to_flat(torch.float32), first, atol=1e-5)


def test_patience_needs_validation_data_and_a_labelled_net_for_its_score(spark):
    trainer = SparkTrainer(mlp(), WorkerConfig(solver=SOLVER, batch_size=8),
                           dist=DistributedConfig(workers=2, tau=3, rounds=4, patience=2))
    with pytest.raises(ValueError, match="patience needs validation data"):
        trainer.fit(partitioned_rdd(spark.sparkContext, PARTS))


def test_the_estimator_takes_patience_as_params():
    from sparknet import zoo
    from sparknet.spark.ml import SparkNetEstimator

    net = zoo.mlp(input_shape=[2], hidden=[8], num_classes=3)
    dist = SparkNetEstimator(net, patience=4, monitor="score", minDelta=0.01).configs(2)[1]
    assert (dist.patience, dist.monitor, dist.min_delta) == (4, "score", 0.01)
    assert SparkNetEstimator(net).configs(2)[1].patience is None
    with pytest.raises(ValueError, match="patience"):
        SparkNetEstimator(net, patience=0).configs(2)


def test_the_estimator_stops_on_its_validation_rows_and_its_model_holds_the_best_weights(spark):
    from sparknet import zoo
    from sparknet.spark.ml import SparkNetEstimator

    x, y = blobs(240, seed=5)
    df = spark.createDataFrame([(x[i].tolist(), int(y[i]), i >= 200) for i in range(len(y))],
                               "features array<float>, label long, is_val boolean")
    est = SparkNetEstimator(zoo.mlp(input_shape=[2], hidden=[8], num_classes=3, batch_size=8), workers=2, tau=3,
                            rounds=12, lr=0.05, patience=2, minDelta=10.0, quiet=True,
                            validationIndicatorCol="is_val")
    model = est.fit(df)
    s = model.summary
    # the first evaluation is never put off (the budget may put off later ones): round 1 is the best
    assert s["stop_reason"] == "patience" and s["best_round"] == 1 and 3 <= s["rounds"] < 12
    held_out = model.transform(df.filter("is_val")).toPandas()
    assert (held_out["label"] == held_out["prediction"]).mean() == pytest.approx(s["test_accuracy"])


@pytest.mark.parametrize("engine", ["rounds", "barrier"])
@pytest.mark.parametrize("kept", [{"patience": 3, "min_delta": 10.0}, {"weight_ema": 0.5},
                                  {"patience": 2, "weight_ema": 0.5}])
def test_a_resumed_fit_goes_on_with_the_moving_average_and_the_best_weights_as_the_uninterrupted_one(
        spark, tmp_path, engine, kept):
    whole = _fit(spark, engine, **kept, rounds=6)
    ckpt = str(tmp_path / "ckpt")
    first = _fit(spark, engine, **kept, rounds=2, checkpoint_dir=ckpt, checkpoint_every=1)
    assert first.summary["checkpoints"] == [1, 2]
    resumed = _fit(spark, engine, **kept, rounds=6, checkpoint_dir=ckpt, resume=True)
    assert resumed.summary["resumed_from"] == 2
    assert [h["round"] for h in resumed.history] == [h["round"] for h in whole.history][2:]
    assert torch.equal(resumed.weights.to_flat(torch.float32), whole.weights.to_flat(torch.float32))
    for key in ("returned_weights", "best_round", "stop_reason", "test_loss"):
        assert resumed.summary.get(key) == whole.summary.get(key), key


@pytest.mark.parametrize("kept", [{"patience": 3, "min_delta": 10.0}, {"patience": 2, "weight_ema": 0.5}])
def test_a_fit_scored_behind_its_rounds_resumes_from_a_checkpoint_of_a_round_not_yet_scored(spark, tmp_path, kept):
    # with --eval-overlap a round is scored while the next one trains, so round 2's checkpoint is written before
    # round 2 is judged: the resumed fit scores it behind its first round, as the uninterrupted fit did (without,
    # the first stop would come a round late)
    import shutil

    every = tmp_path / "every"
    whole = _fit(spark, "rounds", **kept, eval_overlap=True, rounds=6, checkpoint_dir=str(every), checkpoint_every=1,
                 checkpoint_keep=10)
    second = tmp_path / "second"
    shutil.copytree(every / "ckpt-00000002", second / "ckpt-00000002")
    resumed = _fit(spark, "rounds", **kept, eval_overlap=True, rounds=6, checkpoint_dir=str(second), resume=True)
    assert resumed.summary["resumed_from"] == 2
    assert [h["round"] for h in resumed.history] == [h["round"] for h in whole.history][2:]
    assert torch.equal(resumed.weights.to_flat(torch.float32), whole.weights.to_flat(torch.float32))
    for key in ("returned_weights", "best_round", "stop_reason", "test_loss"):
        assert resumed.summary.get(key) == whole.summary.get(key), key
