"""Configuration dataclasses validate themselves; the CLI is generated from them."""

import pytest

from sparknet.cli import build_parser, field_docs
from sparknet.config import DistributedConfig, Engine, RunConfig, Strategy


@pytest.mark.parametrize("bad, match", [
    ({"steps": 0}, "steps"), ({"batch_size": 0}, "batch size"), ({"lr": -0.1}, "learning rate"),
    ({"solver_type": "lbfgs"}, "solver type"), ({"threads": 0}, "threads"), ({"device": "tpu"}, "device"),
])
def test_run_config_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        RunConfig(**bad)


@pytest.mark.parametrize("bad, match", [
    ({"tau": 0}, "tau"), ({"workers": 0}, "workers"), ({"engine": "mpi"}, "unknown engine"),
    ({"strategy": "gossip"}, "unknown strategy"), ({"tau": None, "round_seconds": None}, "round needs an end"),
    ({"round_seconds": -1.0}, "round_seconds"), ({"target_accuracy": 1.5}, "target_accuracy"),
    ({"strategy": "sync", "engine": "rounds", "workers": 2}, "barrier"),
])
def test_distributed_config_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        DistributedConfig(**bad)


def test_enums_parse_any_case():
    d = DistributedConfig(engine="BARRIER", strategy="DiLoCo", workers=3)
    assert d.engine is Engine.BARRIER and d.strategy is Strategy.DILOCO
    assert d.resolved_master == "local[3]"


def test_cli_flags_come_from_the_dataclasses():
    parser = build_parser()
    args = parser.parse_args(["train", "--model", "mlp", "--steps", "7", "--workers", "2", "--engine", "barrier",
                              "--tau", "5", "--quiet", "--solver-type", "adam"])
    assert (args.model, args.steps, args.workers, args.engine, args.tau, args.quiet, args.solver_type) == (
        "mlp", 7, 2, "barrier", 5, True, "adam")
    defaults = parser.parse_args(["train"])
    assert defaults.steps == RunConfig().steps and defaults.tau == DistributedConfig().tau
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--engine", "mpi"])


def test_help_texts_are_the_field_docstrings():
    docs = field_docs(DistributedConfig)
    assert "Local steps per round" in docs["tau"]
    assert "rounds or barrier" in docs["engine"]


@pytest.mark.parametrize("bad, match", [
    ({"checkpoint_every": 0}, "checkpoint_every"), ({"checkpoint_keep": 0}, "checkpoint_keep"),
    ({"resume": True}, "resume needs --checkpoint-dir"),
])
def test_checkpoint_settings_are_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        DistributedConfig(**bad)


def test_checkpoint_flags_come_from_the_config():
    args = build_parser().parse_args(["train", "--checkpoint-dir", "ckpts", "--resume", "--checkpoint-every", "5"])
    assert args.checkpoint_dir == "ckpts" and args.resume is True and args.checkpoint_every == 5
    assert args.checkpoint_keep == 3
