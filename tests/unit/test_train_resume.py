"""Checkpoints and exact resume of the one-process path (``sparknet train`` with one worker)."""

from __future__ import annotations

import pytest
import torch

from sparknet.checkpoint import CheckpointError, CheckpointManager
from sparknet.config import DistributedConfig, RunConfig
from sparknet.train import train_local


def _run(steps: int, **kw) -> RunConfig:
    return RunConfig(model="mlp", dataset="synthetic", steps=steps, eval_every=20, batch_size=32, threads=1,
                     quiet=True, lr=0.05, **kw)


def _dist(folder, resume=False, every=1) -> DistributedConfig:
    # rounds of 20 steps: the runs stop at round ends, so a resumed run's rounds are the uninterrupted one's
    return DistributedConfig(checkpoint_dir=str(folder), checkpoint_every=every, resume=resume, tau=20)


def test_a_stopped_and_resumed_run_ends_with_the_same_weights_bitwise(tmp_path):
    whole = train_local(_run(100), _dist(tmp_path / "whole"))
    train_local(_run(60), _dist(tmp_path / "split"))
    resumed = train_local(_run(100), _dist(tmp_path / "split", resume=True))
    a = CheckpointManager(str(tmp_path / "whole")).load()
    b = CheckpointManager(str(tmp_path / "split")).load()
    assert a.round == b.round == 5 and resumed["resumed_from_step"] == 60 and resumed["steps"] == 100
    for (name, xs), (_, ys) in zip(a.weights.items(), b.weights.items()):
        assert all(torch.equal(x, y) for x, y in zip(xs, ys)), name
    assert resumed["test_accuracy"] == whole["test_accuracy"] and resumed["samples"] == whole["samples"]
    # the rotation keeps the newest three
    assert CheckpointManager(str(tmp_path / "whole")).rounds() == [3, 4, 5]


def test_resume_with_nothing_saved_starts_fresh_and_every_n_intervals_is_honoured(tmp_path):
    summary = train_local(_run(60), _dist(tmp_path, resume=True, every=2))
    assert "resumed_from_step" not in summary
    assert CheckpointManager(str(tmp_path)).rounds() == [2, 3]  # every second interval, and the end


def test_another_models_checkpoint_is_refused_before_training(tmp_path):
    train_local(_run(20), _dist(tmp_path))
    with pytest.raises(CheckpointError, match="another model"):
        train_local(RunConfig(model="lenet", dataset="mnist-small", steps=20, eval_every=20, threads=1, quiet=True),
                    _dist(tmp_path, resume=True))


def test_an_unwritable_checkpoint_folder_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError, match="--checkpoint-dir"):
        train_local(_run(20), _dist(blocker / "ckpt"))


def test_one_process_rounds_are_tau_steps_and_evaluations_come_every_eval_every_steps(tmp_path):
    import json

    out = tmp_path / "m.jsonl"
    run = RunConfig(model="mlp", dataset="synthetic", steps=60, eval_every=25, batch_size=32, threads=1, quiet=True,
                    lr=0.05, metrics_out=str(out))
    train_local(run, DistributedConfig(checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=1, tau=10))
    assert CheckpointManager(str(tmp_path / "ck")).rounds() == [4, 5, 6]  # six rounds of 10 steps, newest three kept
    evals = [r["step"] for r in map(json.loads, out.read_text().splitlines()) if r["event"] == "eval"]
    assert evals == [30, 60]  # every 25 steps, rounded up to whole rounds: every third round
