"""The one round loop (sparknet.loop): the sample-weighted mean, stopping, evaluation, and its single home."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from sparknet import zoo
from sparknet.config import DistributedConfig, RunConfig
from sparknet.errors import NonFiniteUpdate
from sparknet.loop import InProcessExchange, Progress, run_rounds, weighted_mean
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.stopping import StopRule
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
    final = run_rounds(InProcessExchange(nets, Average()), Average(), start.clone(), StopRule(rounds=1, tau=3),
                       on_record=records.append)
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
        run_rounds(InProcessExchange(nets, Average()), Average(), nets[0].get_flat(), StopRule(rounds=2, tau=2))


def test_the_loop_stops_on_its_rule_and_evaluates_the_last_round():
    x, y = _blobs(200, 2)
    evaluator = _net(8)
    evaluator.set_validation_data((x, y))
    progress = Progress()
    records = []
    run_rounds(InProcessExchange([_net(8), _net(8, seed=1)], Average(), evaluator=evaluator), Average(),
               evaluator.get_flat(), StopRule(max_steps=10, tau=4), progress=progress, eval_every=5,
               on_record=records.append)
    assert [r["steps"] for r in records] == [4, 4, 2]  # max_steps caps the last round
    assert [("val_accuracy" in r) for r in records] == [False, False, True]  # evaluated when it stops
    assert records[-1]["stop_reason"] == "max_steps" and progress.round == 3 and progress.steps_done == 10


def test_one_process_training_is_the_loop_and_stops_at_the_target_accuracy(tmp_path):
    run = RunConfig(model="mlp", dataset="synthetic", steps=2000, eval_every=20, batch_size=32, threads=1,
                    quiet=True, lr=0.05, metrics_out=str(tmp_path / "m.jsonl"))
    first = train_local(run, DistributedConfig(target_accuracy=0.3))
    assert first["stop_reason"] == "target_accuracy" and first["steps"] < 2000
    assert first["test_accuracy"] >= 0.3
    whole = train_local(RunConfig(**{**run.__dict__, "steps": 60}), None)
    assert whole["stop_reason"] == "max_steps" and whole["steps"] == 60


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
