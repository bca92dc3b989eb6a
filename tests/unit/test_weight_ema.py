"""The moving average of the global weights (DistributedConfig.weight_ema): its formula, what the round loop records
and returns with it, that it changes nothing when off, and its validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparknet import zoo
from sparknet.cli import build_parser
from sparknet._fields import from_args
from sparknet.config import DistributedConfig, RunConfig
from sparknet.loop import (Exchange, FitPlan, InProcessExchange, RoundPlan, RoundUpdate, StopRule, WeightAverage,
                           returned_summary, run_rounds)
from sparknet.net import EvalResult, Net
from sparknet.solvers import SolverConfig
from sparknet.strategies import Average
from sparknet.train import train_local

DELTAS = [[1.0, 0.0], [0.0, 2.0], [-1.0, 1.0], [3.0, -1.0]]
"""The mean update of each round of :class:`_Scripted`."""


class _Scripted(Exchange):
    """One worker whose round r's update is DELTAS[r]; the 'loss' of weights is their sum, 'accuracy' their first."""

    def run_round(self, plan: RoundPlan, global_flat: torch.Tensor) -> RoundUpdate:
        delta = torch.tensor(DELTAS[plan.round])
        return RoundUpdate(total=delta * 4, samples=4, loss_sum=4.0, steps=1, processed=4, compute_s=0.0,
                           slowest_steps=1)

    validation_rows = 1

    def evaluate(self, global_flat, rows=None):
        return EvalResult(loss=float(global_flat.sum()), accuracy=float(global_flat[0]), samples=1,
                          metrics={"accuracy": float(global_flat[0])})


def test_the_average_follows_its_warm_up_then_its_decay_over_four_rounds():
    start = torch.tensor([1.0, -2.0])
    records = []
    returned = run_rounds(_Scripted(),
                          FitPlan(strategy=Average(), stop=StopRule(rounds=4, tau=1),
                                  average=WeightAverage(0.3, start)),start.clone(), on_record=records.append)
    # by hand: the decay after round r is min(0.3, (1 + r) / (10 + r)): 2/11, 3/12, then 0.3 (4/13 and 5/14 are above)
    g, avg = [1.0, -2.0], [1.0, -2.0]
    for d, delta, record in zip([2 / 11, 3 / 12, 0.3, 0.3], DELTAS, records):
        g = [g[0] + delta[0], g[1] + delta[1]]
        avg = [d * avg[0] + (1 - d) * g[0], d * avg[1] + (1 - d) * g[1]]
        assert record["val_loss"] == pytest.approx(sum(g))  # the global weights, as without the option
        assert record["val_accuracy"] == pytest.approx(g[0])
        assert record["val_ema_loss"] == pytest.approx(sum(avg))  # and the average beside them
        assert record["val_ema_accuracy"] == pytest.approx(avg[0])
    assert g == [4.0, 0.0] and avg[0] != pytest.approx(g[0])  # the two differ: the test tells them apart
    assert torch.allclose(returned, torch.tensor(avg), atol=1e-6)  # the loop returns the average
    assert start.tolist() == [1.0, -2.0]  # the average works on its own copy


def test_without_the_option_the_loop_returns_the_global_weights_and_records_no_average():
    records = []
    returned = run_rounds(_Scripted(), FitPlan(strategy=Average(), stop=StopRule(rounds=4, tau=1)),
                          torch.tensor([1.0, -2.0]), on_record=records.append)
    assert returned.tolist() == [4.0, 0.0]
    assert not [k for r in records for k in r if "ema" in k]
    assert returned_summary(records, None) == {}


def test_the_summary_names_the_returned_average_and_the_last_global_scores():
    records = []
    run_rounds(_Scripted(),
               FitPlan(strategy=Average(), stop=StopRule(rounds=2, tau=1),
                       average=WeightAverage(0.9, torch.tensor([1.0, -2.0]))),torch.tensor([1.0, -2.0]),
               on_record=records.append)
    summary = returned_summary(records, 0.9)
    # the last global weights: [1, -2] + [1, 0] + [0, 2] = [2, 0]
    assert summary == {"returned_weights": "ema", "weight_ema": 0.9, "test_global_loss": 2.0,
                       "test_global_accuracy": 2.0}


def _blobs(n: int, seed: int):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]], dtype=np.float32)
    return (centers[y] + rng.normal(0, 0.6, (n, 2))).astype(np.float32), y.astype(np.int64)


def _exchange(compression: str) -> tuple[InProcessExchange, torch.Tensor]:
    def net(seed: int) -> Net:
        n = Net(zoo.mlp(input_shape=(2,), hidden=(8,), num_classes=3, batch_size=8),
                SolverConfig(base_lr=0.1, momentum=0.9), batch_size=8, seed=seed)
        n.set_training_data(_blobs(64, seed))
        return n

    workers = [net(1), net(2)]
    evaluator = net(0)
    evaluator.set_validation_data(_blobs(90, 9))
    start = evaluator.get_flat()
    return InProcessExchange(workers, Average(), evaluator=evaluator, compression=compression), start


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_scoring_the_average_leaves_the_training_and_the_global_weights_as_they_were(compression):
    runs = {}
    for decay in (None, 0.5):
        exchange, start = _exchange(compression)
        records = []
        globals_seen = []
        exchange.new_global = lambda g, progress, seen=globals_seen: seen.append(g.clone())
        returned = run_rounds(exchange,
                              FitPlan(strategy=Average(), stop=StopRule(rounds=4, tau=3),
                                      average=None if decay is None else WeightAverage(decay, start)),start,
                              on_record=records.append)
        runs[decay] = records, globals_seen, returned
    (plain, plain_globals, plain_final), (averaged, avg_globals, avg_final) = runs[None], runs[0.5]
    for a, b, ga, gb in zip(plain, averaged, plain_globals, avg_globals):
        assert torch.equal(ga, gb)  # bit for bit: scoring the average sends nothing down to the workers
        assert (a["loss"], a["bytes"], a["val_loss"], a["val_accuracy"]) == \
               (b["loss"], b["bytes"], b["val_loss"], b["val_accuracy"])
    assert torch.equal(plain_final, plain_globals[-1])
    hand = WeightAverage(0.5, _exchange(compression)[1])  # the same initial weights, from a fresh build
    for r, g in enumerate(avg_globals, start=1):
        hand.update(g, r)
    assert torch.allclose(avg_final, hand.flat) and not torch.allclose(avg_final, avg_globals[-1], atol=1e-4)
    assert averaged[-1]["val_ema_loss"] != averaged[-1]["val_loss"]


def test_one_process_training_returns_and_reports_the_average(tmp_path):
    run = RunConfig(model="mlp", dataset="synthetic", steps=60, eval_every=20, batch_size=32, threads=1,
                    quiet=True, lr=0.05, metrics_out=str(tmp_path / "m.jsonl"))
    plain = train_local(run, DistributedConfig())
    averaged = train_local(run, DistributedConfig(weight_ema=0.5))
    assert "returned_weights" not in plain
    assert averaged["returned_weights"] == "ema" and averaged["weight_ema"] == 0.5
    # the global weights are those of the plain run (seeded alike); the returned average scores differently
    assert averaged["test_global_accuracy"] == plain["test_accuracy"]
    assert averaged["test_global_loss"] == plain["test_loss"]
    assert averaged["test_loss"] != plain["test_loss"]


@pytest.mark.parametrize("decay", [0.0, 1.0, 1.5, -0.1])
def test_a_decay_outside_zero_to_one_is_refused(decay):
    with pytest.raises(ValueError, match="weight_ema is a decay per round in \\(0, 1\\)"):
        DistributedConfig(weight_ema=decay)
    with pytest.raises(ValueError, match="decay is in \\(0, 1\\)"):
        WeightAverage(decay, torch.zeros(2))


def test_the_average_is_refused_where_the_loop_cannot_keep_it():
    assert DistributedConfig(weight_ema=0.9).weight_ema == 0.9
    with pytest.raises(ValueError, match="async strategy has no rounds"):
        DistributedConfig(weight_ema=0.9, strategy="async")
    assert DistributedConfig(weight_ema=0.9, resume=True, checkpoint_dir="ckpt").resume  # checkpoints hold it


def test_the_command_line_offers_it():
    parser = build_parser()
    args = parser.parse_args(["train", "--weight-ema", "0.95"])
    assert from_args(DistributedConfig, args).weight_ema == 0.95
    assert from_args(DistributedConfig, parser.parse_args(["train"])).weight_ema is None
    with pytest.raises(ValueError, match="weight_ema"):
        from_args(DistributedConfig, parser.parse_args(["train", "--weight-ema", "2"]))
