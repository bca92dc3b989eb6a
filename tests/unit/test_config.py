"""Configuration dataclasses validate themselves; the CLI is generated from them."""

import pytest

from sparknet._fields import field_docs, from_args
from sparknet.cli import build_parser
from sparknet.config import DistributedConfig, Engine, RunConfig, Strategy, WorkerConfig
from sparknet.solvers import SolverType


@pytest.mark.parametrize("bad, match", [
    ({"steps": 0}, "steps"), ({"batch_size": 0}, "batch size"), ({"lr": -0.1}, "learning rate"),
    ({"solver_type": "newton"}, "solver type"), ({"threads": 0}, "threads"), ({"device": "tpu"}, "device"),
])
def test_run_config_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        RunConfig(**bad)


@pytest.mark.parametrize("bad, match", [
    ({"tau": 0}, "tau"), ({"workers": 0}, "workers"), ({"engine": "mpi"}, "unknown engine"),
    ({"strategy": "gossip"}, "unknown strategy"), ({"tau": None, "round_seconds": None}, "round needs an end"),
    ({"round_seconds": -1.0}, "round_seconds"), ({"target_accuracy": 1.5}, "target_accuracy"),
    ({"strategy": "sync", "engine": "rounds", "workers": 2}, "barrier"),
    ({"strategy": "diloco", "outer_momentum": 1.5}, r"outer_momentum must be in \[0, 1\)"),
    ({"strategy": "diloco", "outer_lr": 0.0}, "outer_lr must be positive"),
])
def test_distributed_config_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        DistributedConfig(**bad)


@pytest.mark.parametrize("settings, words", [
    ({"outer_momentum": 0.7}, "--outer-momentum only shapes the diloco strategy, and this run's is average"),
    ({"outer_lr": 1.0, "outer_momentum": 0.7, "strategy": "easgd"}, "--outer-lr and --outer-momentum only shape"),
    ({"easgd_beta": 0.5, "strategy": "diloco"}, "--easgd-beta only shapes the easgd strategy"),
])
def test_a_strategy_s_own_settings_given_to_another_strategy_are_refused_not_left_unused(settings, words):
    with pytest.raises(ValueError, match=words):
        DistributedConfig(workers=2, **settings)
    owner = "easgd" if "easgd_beta" in settings else "diloco"
    taken = DistributedConfig(workers=2, **{**settings, "strategy": owner}).strategy_options()  # its own strategy's
    assert taken == ({"num_workers": 2, "beta": 0.5} if owner == "easgd"
                     else {"outer_lr": settings.get("outer_lr", 0.7), "outer_momentum": 0.7})


@pytest.mark.parametrize("bad, match", [
    ({"steps": 0}, "steps"), ({"batch_size": 0}, "batch_size"), ({"threads": 0}, "threads"), ({"device": "tpu"}, "device"),
])
def test_worker_config_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        WorkerConfig(**bad)


def test_the_command_line_gives_every_trainer_one_worker_config():
    run = RunConfig(steps=300, batch_size=32, seed=4, lr=0.05, solver_type="adam", device="cpu")
    worker = run.worker()
    assert (worker.steps, worker.batch_size, worker.seed, worker.threads, worker.device) == (300, 32, 4, 1, "cpu")
    assert worker.solver == run.solver() and worker.solver.type is SolverType.ADAM and worker.solver.base_lr == 0.05
    assert RunConfig(threads=3).worker().threads == 3


def test_spark_trainer_names_the_worker_config_for_its_old_keywords():
    from sparknet import zoo
    from sparknet.spark import SparkTrainer

    with pytest.raises(TypeError, match=r"takes batch_size, max_steps in a WorkerConfig: .*WorkerConfig\(batch_size=\.\.\., "
                                        r"steps=\.\.\.\)"):
        SparkTrainer(zoo.mlp(), dist=DistributedConfig(workers=2, rounds=1), batch_size=8, max_steps=10)
    with pytest.raises(TypeError, match="unexpected keyword arguments: on_rund"):
        SparkTrainer(zoo.mlp(), dist=DistributedConfig(workers=2, rounds=1), on_rund=print)
    with pytest.raises(TypeError, match="worker must be a sparknet.WorkerConfig"):
        SparkTrainer(zoo.mlp(), RunConfig(), DistributedConfig(workers=2, rounds=1))
    trainer = SparkTrainer(zoo.mlp(), WorkerConfig(batch_size=8, steps=10), DistributedConfig(workers=2, rounds=1))
    assert trainer.worker.steps == 10 and trainer.worker.batch_size == 8


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


@pytest.mark.parametrize("bad, match", [
    ({"auto_tau_min": 0}, "auto_tau_min"), ({"auto_tau_min": 50, "auto_tau_max": 10}, "auto_tau_max"),
    ({"auto_tau_every": 0}, "auto_tau_every"), ({"link_latency": "5 parsecs"}, "50ms"),
    ({"link_bandwidth": "100MB"}, "bits per second"),
    ({"strategy": "sync", "engine": "barrier", "compression": "int8"}, "drop --compression"),
    ({"strategy": "sync", "engine": "barrier", "auto_tau": True}, "drop --auto-tau"),
])
def test_engine_option_settings_are_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        DistributedConfig(**bad)


def test_link_and_auto_tau_flags_come_from_the_config():
    from sparknet.link import LinkModel

    args = build_parser().parse_args(["train", "--workers", "2", "--link-latency", "50ms", "--link-bandwidth",
                                      "100Mbit", "--auto-tau", "--auto-tau-max", "200", "--compression", "int8"])
    dist = from_args(DistributedConfig, args)
    assert dist.link() == LinkModel(0.05, 1e8)
    assert dist.auto_tau and dist.auto_tau_max == 200 and dist.auto_tau_min == 1 and dist.compression == "int8"
    assert DistributedConfig().link() is None


@pytest.mark.parametrize("settings, words", [
    ({"engine": "rounds", "workers": 2}, "needs --engine barrier"),
    ({"engine": "barrier", "workers": 2, "compression": "int8"}, "drop --compression"),
    ({"engine": "barrier", "workers": 2, "auto_tau": True}, "drop --auto-tau"),
    ({"engine": "barrier", "workers": 2, "round_seconds": 5.0}, "needs a fixed tau"),
])
def test_the_rules_of_a_per_step_strategy_are_checked_in_one_place(settings, words):
    from sparknet.config import check_per_step_strategy

    with pytest.raises(ValueError, match=words):
        DistributedConfig(strategy="sync", **settings)
    ok = DistributedConfig(strategy="average", **settings)  # the same settings suit a round strategy
    with pytest.raises(ValueError, match=f"strategy Sync\\(\\) .*{words}"):
        check_per_step_strategy(ok, "strategy Sync()")


def test_on_spark_even_one_worker_needs_the_barrier_engine_for_a_per_step_strategy():
    from sparknet.config import check_per_step_strategy

    one = DistributedConfig(strategy="average", engine="rounds", workers=1)
    check_per_step_strategy(one, "sync")  # one process: plain training
    with pytest.raises(ValueError, match="needs --engine barrier"):
        check_per_step_strategy(one, "sync", on_spark=True)


@pytest.mark.parametrize("settings, words", [
    ({"model_parallel": 0}, "at least 1"),
    ({"model_parallel": 2, "workers": 4}, "add --engine barrier"),
    ({"model_parallel": 2, "workers": 3, "engine": "barrier"}, "do not divide into model-parallel groups of 2"),
    ({"model_parallel": 2, "workers": 2, "engine": "barrier", "strategy": "sync"}, "does not know about split layers"),
    ({"model_parallel": 2, "workers": 2, "engine": "barrier", "round_seconds": 3.0}, "fixed --tau"),
    ({"model_parallel": 2, "workers": 2, "engine": "barrier", "auto_tau": True}, "fixed --tau"),
    ({"model_parallel": 2, "workers": 2, "engine": "barrier", "procs_per_worker": 3}, "a multiple of --model-parallel"),
    ({"model_parallel": 2, "workers": 2, "engine": "barrier", "procs_per_worker": 2, "shard_replica": True},
     "a multiple of 2 above it"),
    ({"parallel_plan": "ip1=column"}, "needs --model-parallel M with M > 1"),
    ({"model_parallel": 2, "workers": 2, "engine": "barrier", "parallel_plan": "ip1=sideways"}, "LAYER=column"),
    ({"max_weight_bytes": 0}, "must be positive"),
])
def test_what_a_split_net_cannot_do_is_refused_by_the_config(settings, words):
    with pytest.raises(ValueError, match=words):
        DistributedConfig(**settings)


@pytest.mark.parametrize("settings", [{"overlap": True, "fragments": 2}, {"warmup_steps": 5}, {"epochs": 1.0},
                                      {"checkpoint_dir": "c", "resume": True}, {"weight_ema": 0.9},
                                      {"strategy": "easgd"}, {"link_latency": "50ms"}, {"compression": "bf16"},
                                      {"compression": "fp16"}, {"compression": "int8"}])
def test_a_split_net_runs_as_workers_of_several_processes_whatever_their_exchange(settings):
    # --model-parallel M: W processes are W/M workers of M processes, which take every exchange they take
    dist = DistributedConfig(model_parallel=2, workers=4, engine="barrier", tau=5, **settings)
    engine = dist.as_workers()
    assert (engine.workers, engine.procs_per_worker, engine.model_parallel, engine.ranks) == (2, 2, 2, 4)
    assert dist.strategy_options().get("num_workers", 2) == 2 and DistributedConfig(workers=4).as_workers().workers == 4
    # with --procs-per-worker G, --workers counts workers: each of G processes, G / M copies of the split layers
    both = DistributedConfig(model_parallel=2, procs_per_worker=4, workers=3, engine="barrier", tau=5, **settings)
    assert both.as_workers() is both and (both.ranks, both.strategy_options().get("num_workers", 3)) == (12, 3)


def test_the_parallel_plan_is_read_once_into_modes():
    dist = DistributedConfig(workers=4, engine="barrier", model_parallel=2, parallel_plan="ip1=column, ip2=row,ip3=none")
    assert dist.plan() == {"ip1": "column", "ip2": "row", "ip3": None}
    assert DistributedConfig().plan() is None
    flags = build_parser().parse_args(["train", "--model-parallel", "2", "--parallel-plan", "ip1=column",
                                       "--max-weight-bytes", "1e6", "--workers", "2", "--engine", "barrier"])
    from_flags = from_args(DistributedConfig, flags)
    assert (from_flags.model_parallel, from_flags.plan(), from_flags.max_weight_bytes) == (2, {"ip1": "column"}, 1e6)


def test_the_names_the_command_line_checks_before_torch_loads_are_the_zoo_s_and_the_data_sets():
    from sparknet import config, zoo
    from sparknet.datasets import DATASET_NAMES

    assert config.ZOO_MODELS == tuple(zoo.MODELS)
    assert config.DATASETS == DATASET_NAMES
