"""The one round loop (sparknet.loop): the sample-weighted mean, stopping, evaluation, and its single home."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sparknet import zoo
from sparknet.config import DistributedConfig, RunConfig
from sparknet.errors import NonFiniteUpdate
from sparknet.labels import Task
from sparknet.loop import (EvalPlan, FitPlan, InProcessExchange, Progress, StopRule, run_rounds, screen_margin,
                           weighted_mean)
from sparknet.net import EvalResult, Net, fixed_sample
from sparknet.solvers import SolverConfig
from sparknet.strategies import Average
from sparknet.train import train_local

SRC = Path(__file__).resolve().parents[2] / "src" / "sparknet"


def _blobs(n: int, seed: int):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]], dtype=np.float32)
    return (centers[y] + rng.normal(0, 0.6, (n, 2))).astype(np.float32), y.astype(np.int64)


def _net(batch_size: int, seed: int = 0) -> Net:
    net = Net(zoo.mlp(input_shape=(2,), hidden=(8,), num_classes=3, batch_size=batch_size),
              SolverConfig(base_lr=0.1, momentum=0.0, weight_decay=0.0), batch_size=batch_size, seed=seed)
    net.set_training_data(_blobs(64, 1), shuffle=False)
    return net


def test_two_workers_that_process_different_numbers_of_samples_are_averaged_by_samples():
    # worker 0 processes 3 x 8 = 24 samples, worker 1 only 3 x 2 = 6: an unweighted mean fails this test
    nets = [_net(8), _net(2)]
    start = nets[0].get_flat()
    for net in nets[1:]:
        net.set_flat(start)
    alone = [_net(8), _net(2)]
    for net in alone:
        net.set_flat(start)
        net.train(3)
    records = []
    final = run_rounds(InProcessExchange(nets, Average()), FitPlan(strategy=Average(), stop=StopRule(rounds=1, tau=3)),
                       start.clone(), on_record=records.append)
    a, b = alone[0].get_flat(), alone[1].get_flat()
    weighted = start + (24 * (a - start) + 6 * (b - start)) / 30
    assert torch.allclose(final, weighted, atol=1e-6)
    assert not torch.allclose(final, (a + b) / 2, atol=1e-4)
    assert records[0]["samples"] == 30 and records[0]["steps"] == 3 and records[0]["stop_reason"] == "rounds"


def test_a_round_with_no_finite_update_stops_the_run_clearly():
    with pytest.raises(NonFiniteUpdate, match="no worker produced finite weights"):
        weighted_mean(torch.zeros(3), 0)
    nets = [_net(8)]
    nets[0].set_flat(torch.full_like(nets[0].get_flat(), float("nan")))
    with pytest.raises(NonFiniteUpdate, match="round 1: .*non-finite workers: \\[0\\]"):
        run_rounds(InProcessExchange(nets, Average()), FitPlan(strategy=Average(), stop=StopRule(rounds=2, tau=2)),
                   nets[0].get_flat())


def test_the_loop_stops_on_its_rule_and_evaluates_the_last_round():
    x, y = _blobs(200, 2)
    evaluator = _net(8)
    evaluator.set_validation_data((x, y))
    progress = Progress()
    records = []
    run_rounds(InProcessExchange([_net(8), _net(8, seed=1)], Average(), evaluator=evaluator),
               FitPlan(strategy=Average(), stop=StopRule(steps=10, tau=4), progress=progress,
                       evaluation=EvalPlan(every=5)),evaluator.get_flat(), on_record=records.append)
    assert [r["steps"] for r in records] == [4, 4, 2]  # the steps rule caps the last round
    assert [("val_accuracy" in r) for r in records] == [False, False, True]  # evaluated when it stops
    assert records[-1]["stop_reason"] == "steps" and progress.round == 3 and progress.steps_done == 10


class _Scripted(InProcessExchange):
    """An in-process exchange whose accuracy follows a script: (whole set, sample) per round."""

    validation_rows = 10_000

    def __init__(self, nets, script):
        super().__init__(nets, Average())
        self.script, self.calls, self.round_index = script, [], 0

    def run_round(self, plan, global_flat):
        self.round_index = plan.round
        return super().run_round(plan, global_flat)

    def evaluate(self, global_flat, rows=None, rest_of=None):
        """The script's sample, or its whole set: at once, or as the rest of a sample (the loop joins the two)."""
        whole, sample = self.script[self.round_index]
        self.calls.append((self.round_index + 1, rows if rest_of is None else ("rest of", rest_of)))
        n = rows or self.validation_rows
        right = round((whole if rows is None else sample) * n)
        if rest_of is not None:  # what the whole set adds to the sample
            n, right = n - rest_of, right - round(sample * rest_of)
        return EvalResult.of(Task.CLASSIFICATION, n, 0.1 * n, [right, n, right, 0])


def test_screens_between_full_evaluations_and_the_stopping_rule_sees_the_whole_set():
    # the sample reads high in round 3 (a full evaluation follows: 0.97, not yet), near in round 5 (full: 0.991)
    script = [(0.5, 0.5), (0.8, 0.8), (0.97, 0.995), (0.98, 0.97), (0.991, 0.988), (0.995, 0.995)]
    exchange = _Scripted([_net(8)], script)
    records = []
    run_rounds(exchange,
               FitPlan(strategy=Average(), stop=StopRule(rounds=6, tau=1, target_accuracy=0.99),
                       evaluation=EvalPlan(screen_rows=2000, full_every=10)),exchange.nets[0].get_flat(),
               on_record=records.append)
    margin = screen_margin(0.99, 2000)
    assert 0.99 - margin < 0.988 and 0.97 < 0.99 - margin  # round 4's sample is not near, round 5's is
    # a full evaluation after a screen scores the rows the screen left out
    rest = ("rest of", 2000)
    assert exchange.calls == [(1, 2000), (2, 2000), (3, 2000), (3, rest), (4, 2000), (5, 2000), (5, rest)]
    assert [r.get("val_accuracy") for r in records] == [None, None, 0.97, None, 0.991]
    assert [r["screen_accuracy"] for r in records] == [0.5, 0.8, 0.995, 0.97, 0.988]
    assert records[-1]["stop_reason"] == "target_accuracy" and records[-1]["round"] == 5


def test_a_full_evaluation_every_so_often_and_at_the_end_and_none_for_a_small_set():
    script = [(0.5, 0.4)] * 7
    exchange = _Scripted([_net(8)], script)
    records = []
    run_rounds(exchange,
               FitPlan(strategy=Average(), stop=StopRule(rounds=7, tau=1),
                       evaluation=EvalPlan(screen_rows=2000, full_every=3)),exchange.nets[0].get_flat(),
               on_record=records.append)
    assert ["val_accuracy" in r for r in records] == [False, False, True, False, False, True, True]
    exchange = _Scripted([_net(8)], script)
    exchange.validation_rows = 3999  # under twice the sample: every evaluation is whole
    run_rounds(exchange,
               FitPlan(strategy=Average(), stop=StopRule(rounds=2, tau=1), evaluation=EvalPlan(screen_rows=2000)),
               exchange.nets[0].get_flat())
    assert exchange.calls == [(1, None), (2, None)]


class _Timed(_Scripted):
    """Rounds of ``round_s`` seconds, evaluations of ``eval_s`` (slept, so the clock sees them)."""

    def __init__(self, nets, script, round_s, eval_s):
        super().__init__(nets, script)
        self.round_s, self.eval_s = round_s, eval_s

    def run_round(self, plan, global_flat):
        time.sleep(self.round_s)
        return super().run_round(plan, global_flat)

    def evaluate(self, global_flat, rows=None, rest_of=None):
        time.sleep(self.eval_s)
        return super().evaluate(global_flat, rows, rest_of)


def test_an_evaluation_budget_puts_off_evaluations_but_never_the_first_or_the_last():
    # evaluations cost twice a round: a budget of a quarter of the wall time allows about one in six rounds
    exchange = _Timed([_net(8)], [(0.5, 0.5)] * 24, round_s=0.02, eval_s=0.04)
    records = []
    run_rounds(exchange, FitPlan(strategy=Average(), stop=StopRule(rounds=24, tau=1), evaluation=EvalPlan(budget=0.25)),
               exchange.nets[0].get_flat(), on_record=records.append)
    evaluated = [r["round"] for r in records if "val_accuracy" in r]
    assert evaluated[0] == 1 and evaluated[-1] == 24  # the first and the last are never put off
    assert 3 <= len(evaluated) <= 12, evaluated  # far from every round (24 evaluations without a budget)
    spent = sum(r.get("eval_s", 0.0) for r in records)
    assert spent <= 0.25 * records[-1]["wall_s"] + 2 * exchange.eval_s  # within one evaluation of the budget
    exchange = _Timed([_net(8)], [(0.5, 0.5)] * 6, round_s=0.0, eval_s=0.0)
    run_rounds(exchange, FitPlan(strategy=Average(), stop=StopRule(rounds=6, tau=1), evaluation=EvalPlan(budget=None)),
               exchange.nets[0].get_flat())
    assert [c[0] for c in exchange.calls] == [1, 2, 3, 4, 5, 6]  # no budget: every due round
    with pytest.raises(ValueError, match="share of the wall time"):
        EvalPlan(budget=0.0)


@pytest.mark.parametrize("given, target, budget", [
    (None, {}, 0.05),  # no target: evaluations only report
    (None, {"target_accuracy": 0.99}, 0.25),  # toward a target an evaluation is what ends the run
    (None, {"target_loss": 1.5}, 0.25),
    (0.3, {"target_accuracy": 0.99}, 0.3),
    (1.0, {}, None),  # never put off
])
def test_the_evaluations_default_share_of_the_wall_time_is_larger_toward_a_target(given, target, budget):
    plan = FitPlan.from_config(DistributedConfig(eval_budget=given, **target), Average())
    assert plan.evaluation.budget == budget
    with pytest.raises(ValueError, match="share of the wall time"):
        DistributedConfig(eval_budget=0.0)


def test_a_screen_scores_the_same_fixed_sample_of_rows_every_time():
    x, y = _blobs(500, 2)
    net = _net(8)
    net.set_validation_data((x, y))
    a, b = net.evaluate(sample=100), net.evaluate(sample=100)
    assert a.samples == b.samples == 100 and a.accuracy == b.accuracy and a.loss == b.loss
    assert net.evaluate(sample=1000).samples == 500  # a sample as large as the set is the set
    rows = fixed_sample(500, 100)
    whole = net.evaluate((x[rows], y[rows]))
    assert whole.accuracy == a.accuracy and abs(whole.loss - a.loss) < 1e-6
    with pytest.raises(ValueError, match="screen_rows must be 0"):
        EvalPlan(screen_rows=-1)


@pytest.mark.parametrize("task", ["classification", "regression", "unlabelled"])
def test_a_screen_joined_with_the_rows_it_left_out_scores_as_the_whole_set(task):
    """What a full evaluation after a screen scores (the rest of the screen's rows) joined with the screen is the
    whole set's result: the same accuracy and R², the loss to rounding; a screen of every row leaves none."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(500, 6, generator=g)
    if task == "classification":
        module, loss, y = torch.nn.Linear(6, 12), None, torch.randint(0, 12, (500,), generator=g)
    elif task == "regression":
        module, loss, y = torch.nn.Linear(6, 2), torch.nn.MSELoss(), x[:, :2] * 2.0 + 0.3
    else:
        module, loss, y = torch.nn.Linear(6, 6), torch.nn.MSELoss(), torch.zeros(500)  # its input is its target
    net = Net(module, SolverConfig(base_lr=0.1), loss=loss, task="unlabelled" if task == "unlabelled" else None)
    net.set_validation_data((x.numpy(), y.numpy()))
    whole, screen, rest = net.evaluate(), net.evaluate(sample=120), net.evaluate(rest_of=120)
    assert (screen.samples, rest.samples) == (120, 380)
    joined = screen.joined(rest)
    assert joined.samples == whole.samples == 500 and set(joined.metrics) == set(whole.metrics)
    assert joined.metrics == pytest.approx(whole.metrics, rel=1e-12)
    assert joined.loss == pytest.approx(whole.loss, rel=1e-6)
    everything = net.evaluate(sample=500)
    assert net.evaluate(rest_of=500).samples == 0 and everything.joined(net.evaluate(rest_of=500)) == everything
    with pytest.raises(ValueError, match="not both"):
        net.evaluate(sample=10, rest_of=10)


def test_a_full_evaluation_after_a_screen_reads_what_a_whole_pass_reads():
    """A run with screens: every full evaluation (the rest of a screen, joined) is what scoring the round's weights
    on the whole set at once reads. (A target loss sends every screen on to a full evaluation.)"""
    val = _blobs(4000, 5)
    nets = [_net(8, seed=i) for i in range(2)]
    nets[0].set_validation_data(val)
    records, weights = [], {}
    exchange = InProcessExchange(nets, Average(), evaluator=nets[0])
    original = exchange.evaluate

    def evaluate(global_flat, rows=None, rest_of=None):
        if rows is None:  # the weights each full evaluation scores, kept to score again below
            weights[exchange.round_index] = global_flat.clone()
        return original(global_flat, rows, rest_of)

    exchange.evaluate = evaluate
    exchange.round_index = 0
    plain_run = exchange.run_round
    exchange.run_round = lambda plan, flat: (setattr(exchange, "round_index", plan.round), plain_run(plan, flat))[1]
    run_rounds(exchange, FitPlan(strategy=Average(), stop=StopRule(rounds=6, tau=2, target_loss=1e-9),
                                 evaluation=EvalPlan(screen_rows=1000, full_every=100)),
               nets[0].get_flat(), on_record=records.append)
    full = [r for r in records if "val_accuracy" in r]
    assert len(full) == 6 and all(r["screen_rows"] == 1000 for r in full)
    scorer = _net(8)
    scorer.set_validation_data(val)
    for r in full:
        scorer.set_flat(weights[r["round"] - 1])
        again = scorer.evaluate()
        assert r["val_accuracy"] == again.accuracy and r["val_loss"] == pytest.approx(again.loss, rel=1e-6)


def test_one_process_training_is_the_loop_and_stops_at_the_target_accuracy(tmp_path):
    run = RunConfig(model="mlp", dataset="synthetic", steps=2000, eval_every=20, batch_size=32, threads=1,
                    quiet=True, lr=0.05, metrics_out=str(tmp_path / "m.jsonl"))
    first = train_local(run, DistributedConfig(target_accuracy=0.3, eval_budget=1.0))
    assert first["stop_reason"] == "target_accuracy" and first["steps"] < 2000
    assert first["test_accuracy"] >= 0.3
    whole = train_local(RunConfig(**{**run.__dict__, "steps": 60}), None)
    assert whole["stop_reason"] == "steps" and whole["steps"] == 60


def test_one_process_training_toward_a_target_evaluates_every_round_unless_told(tmp_path):
    import json

    def evaluated_steps(eval_every, dist):
        out = tmp_path / f"{eval_every}-{dist is None}.jsonl"
        run = RunConfig(model="mlp", dataset="synthetic", steps=200, eval_every=eval_every, batch_size=32, threads=1,
                        quiet=True, lr=0.05, metrics_out=str(out))
        train_local(run, dist)
        return [r["step"] for r in map(json.loads, out.read_text().splitlines()) if r.get("event") == "eval"]

    never = DistributedConfig(tau=20, target_loss=-1.0, eval_budget=1.0)  # a target the run cannot reach
    assert evaluated_steps(None, never) == list(range(20, 201, 20))  # every round of tau = 20 steps
    assert evaluated_steps(100, never) == [100, 200]  # as told
    assert evaluated_steps(None, DistributedConfig(tau=20)) == [200]  # no target: every 1,000 steps, and the end


def test_one_process_training_stops_at_the_target_loss_judged_on_the_whole_test_set(tmp_path):
    run = RunConfig(model="mlp", dataset="synthetic", steps=2000, eval_every=20, batch_size=32, threads=1,
                    quiet=True, lr=0.05, metrics_out=str(tmp_path / "m.jsonl"))
    # screens of 200 rows, yet the stop is decided by the whole set's loss: every screen goes on to a full pass
    out = train_local(run, DistributedConfig(target_loss=1e-4, eval_budget=1.0, eval_screen_rows=200))
    assert out["stop_reason"] == "target_loss" and out["steps"] < 2000 and out["test_loss"] <= 1e-4


def test_the_stop_rule_takes_a_target_loss():
    rule = StopRule(rounds=10, target_loss=1.5)
    assert rule.reason(1, 50, 100, EvalResult(loss=1.6, accuracy=0.4, samples=10)) is None
    assert rule.reason(2, 100, 200, EvalResult(loss=1.5, accuracy=0.4, samples=10)) == "target_loss"
    assert rule.reason(10, 500, 1000, None) == "rounds"
    with pytest.raises(ValueError, match="target_loss must be a finite number"):
        DistributedConfig(target_loss=float("nan"))
    with pytest.raises(ValueError, match="drop --target-loss"):
        DistributedConfig(target_loss=1.5, strategy="async")


def test_the_outer_update_and_the_weighted_mean_each_live_in_one_place():
    """Every call of a strategy's outer update, and every definition of the weighted mean, in src/."""
    outer, means = [], []
    for path in SRC.rglob("*.py"):
        where = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "apply"
                    and "strateg" in ast.unparse(node.func.value)):
                outer.append(where)
            if isinstance(node, ast.FunctionDef) and "mean" in node.name and "weight" in node.name:
                means.append(where)
    assert outer == ["loop.py"]
    assert means == ["loop.py"]


def test_an_update_counts_only_when_its_loss_and_every_value_are_finite():
    from sparknet.step import finite_update
    from sparknet.net import TrainStats

    ok, diverged = (TrainStats(steps=1, samples=1, loss=0.1, last_loss=0.1, wall_s=0.0, finite=f) for f in (True, False))
    delta = torch.tensor([-3e38, 3e38] * 500 + [1.0])  # finite, near float32's largest
    assert finite_update(ok, delta) and not finite_update(diverged, delta)
    assert finite_update(ok, torch.zeros(0))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for at in (0, 500, 1000):
            hit = delta.clone()
            hit[at] = bad
            assert not finite_update(ok, hit), (bad, at)
