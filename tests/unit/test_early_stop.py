"""Early stopping (DistributedConfig.patience): its rule, what the round loop records and returns with it, one
process's run, and the settings it cannot stand beside."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sparknet.config import CaffeTrainFlags, DistributedConfig, RunConfig
from sparknet.loop import EarlyStop, Exchange, FitPlan, RoundPlan, RoundUpdate, StopRule, returned_summary, run_rounds
from sparknet.metrics import returned_scores
from sparknet.model_io import load_model
from sparknet.net import EvalResult, Net
from sparknet.roads import Road, check_road
from sparknet.strategies import Average
from sparknet.train import train_local

LOSSES = [5.0, 4.0, 4.5, 3.9, 3.95, 4.2, 4.1, 3.0, 2.0, 1.0]
"""The whole set's loss after each round of :class:`_Scripted`."""


class _Scripted(Exchange):
    """One worker whose round r adds 1 to the single weight; the weights after round r score LOSSES[r - 1]."""

    validation_rows = 1

    def run_round(self, plan: RoundPlan, global_flat: torch.Tensor) -> RoundUpdate:
        return RoundUpdate(total=torch.ones(1) * 4, samples=4, loss_sum=4.0, steps=1, processed=4, compute_s=0.0,
                           slowest_steps=1)

    def evaluate(self, global_flat, rows=None, rest_of=None):
        loss = LOSSES[int(global_flat[0]) - 1]
        return EvalResult(loss=loss, accuracy=1.0 / loss, samples=1, metrics={"accuracy": 1.0 / loss})


def _run(patience: int | None, min_delta: float = 0.0, on_score: bool = False, screen_rows: int | None = None):
    from sparknet.loop import EvalPlan

    early = None if patience is None else EarlyStop(patience, min_delta, on_score=on_score)
    plan = FitPlan(strategy=Average(), stop=StopRule(rounds=len(LOSSES), tau=1), early_stop=early,
                   evaluation=EvalPlan(screen_rows=screen_rows))
    records: list[dict] = []
    final = run_rounds(_Scripted(), plan, torch.zeros(1), on_record=records.append)
    return int(final[0]), records


@pytest.mark.parametrize("patience, min_delta, stopped_at, best", [
    (1, 0.0, 3, 2),    # 4.5 does not better 4.0
    (2, 0.0, 6, 4),    # 3.9 bettered 4.0; 3.95 and 4.2 do not better 3.9
    (3, 0.0, 7, 4),
    (4, 0.0, 10, 10),  # 3.0 at round 8 bettered it: never four in a row; the last weights are the best
    (2, 0.5, 4, 2),    # 3.9 is 0.1 better than 4.0, not 0.5
])
def test_the_loop_stops_once_patience_evaluations_have_not_bettered_the_best_and_returns_its_weights(
        patience, min_delta, stopped_at, best):
    weights, records = _run(patience, min_delta)
    assert [r["round"] for r in records] == list(range(1, stopped_at + 1))
    assert weights == best  # the weights after round `best`, not the last round's
    last = records[-1]
    if stopped_at < len(LOSSES):
        assert last["stop_reason"] == "patience"
    assert last["best_round"] == best
    assert returned_scores(records, False) == ({"accuracy": 1.0 / LOSSES[best - 1]}, LOSSES[best - 1])
    assert returned_summary(records, None) == {"returned_weights": "best", "best_round": best}


def test_watching_the_score_counts_higher_as_better():
    weights, records = _run(2, on_score=True)  # the score is 1 / loss: the same rounds better it
    assert weights == 4 and [r["round"] for r in records][-1] == 6


def test_without_patience_the_loop_returns_the_last_weights_and_says_nothing_of_a_best():
    weights, records = _run(None)
    assert weights == len(LOSSES) and "best_round" not in records[-1]
    assert returned_summary(records, None) == {}


def test_with_patience_every_evaluation_scores_the_whole_set():
    _, records = _run(10, screen_rows=1)  # a screen that is never near a target still goes on to the whole set
    assert all("val_loss" in r for r in records)


def test_the_rule_itself():
    early = EarlyStop(2)
    early.observe(1, EvalResult(loss=math.nan, accuracy=0.0, samples=1), torch.zeros(1))
    assert early.best is None and early.since == 1  # a NaN loss is never the best
    early.observe(2, EvalResult(loss=1.0, accuracy=0.0, samples=1), torch.ones(1))
    assert (early.best, early.best_round, early.since) == (1.0, 2, 0)
    early.observe(3, EvalResult(loss=1.0, accuracy=0.0, samples=1), torch.full((1,), 3.0))
    assert early.best_round == 2 and early.since == 1 and not early.exhausted
    copy = EarlyStop(2)
    copy.restore(early.counters(), early.weights)
    assert copy.counters() == {"best": 1.0, "best_round": 2, "since": 1, "scores": {"loss": 1.0}, "judged": 3}
    assert torch.equal(copy.weights, torch.ones(1))
    fresh = EarlyStop(2)
    fresh.restore(early.counters(), None)  # no weights: the count starts afresh rather than return what it lost
    assert fresh.best_round is None and fresh.since == 0


def test_one_process_returns_and_saves_the_best_weights(tmp_path):
    run = RunConfig(model="mlp", dataset="mnist_small", steps=3000, batch_size=32, threads=1, quiet=True, lr=0.5,
                    metrics_out=str(tmp_path / "m.jsonl"), model_dir=str(tmp_path / "model"))
    summary = train_local(run, DistributedConfig(tau=25, patience=2))
    evals = [json.loads(line) for line in open(tmp_path / "m.jsonl") if '"eval"' in line]
    losses = [e["loss"] for e in evals]
    assert summary["stop_reason"] == "patience" and summary["returned_weights"] == "best"
    assert summary["steps"] < 3000 and summary["rounds"] == len(evals)
    assert summary["best_round"] == 1 + losses.index(min(losses)) < summary["rounds"]
    assert summary["test_loss"] == min(losses)
    saved = load_model(tmp_path / "model")
    net = Net(saved.net_params)
    net.set_weights(saved.weights)
    from sparknet.datasets import load_dataset

    assert net.evaluate(load_dataset("mnist_small").test).loss == pytest.approx(min(losses), rel=1e-5)


@pytest.mark.parametrize("settings, refusal", [
    ({"patience": 0}, "at least 1"),
    ({"patience": 2, "min_delta": -0.1}, "min_delta must be a finite number"),
    ({"monitor": "score"}, "give --patience N too"),
    ({"min_delta": 0.1}, "give --patience N too"),
    ({"patience": 2, "monitor": "accuracy"}, "monitor"),
])
def test_settings_it_cannot_stand_beside_are_refused(settings, refusal):
    with pytest.raises(ValueError, match=refusal):
        DistributedConfig(**settings)


def test_a_caffe_run_whose_tests_are_its_solver_s_refuses_it():
    with pytest.raises(ValueError, match="--patience"):
        check_road(Road.CAFFE, RunConfig(), DistributedConfig(patience=2), CaffeTrainFlags(solver="s.prototxt"))
    assert DistributedConfig(patience=2).toward_target  # evaluations end the run: they come as toward a target


@pytest.mark.parametrize("kept", [{"patience": 3, "min_delta": 10.0}, {"weight_ema": 0.5}])
def test_one_process_resumes_with_the_moving_average_and_the_best_weights_as_it_left_them(tmp_path, kept):
    def run(steps, name, resume=False):
        config = RunConfig(model="mlp", dataset="synthetic", steps=steps, batch_size=32, threads=1, quiet=True,
                           lr=0.05, model_dir=str(tmp_path / f"model-{name}"))
        dist = DistributedConfig(tau=20, checkpoint_dir=str(tmp_path / name), checkpoint_every=1, resume=resume,
                                 **kept)
        return train_local(config, dist), load_model(tmp_path / f"model-{name}").weights.to_flat(torch.float32)

    whole, whole_weights = run(140, "whole")
    run(40, "split")
    resumed, resumed_weights = run(140, "split", resume=True)
    assert resumed["resumed_from_step"] == 40 and resumed["steps"] == whole["steps"]
    assert torch.equal(resumed_weights, whole_weights)
    for key in ("returned_weights", "best_round", "stop_reason", "test_loss"):
        assert resumed.get(key) == whole.get(key), key
