"""The paper's simulation-based experiments (speedup grid, speedup against overhead), the link model,
the strategy wrapper that applies it, and the ``sparknet experiment`` command line — on tiny data.

Structure and sane values are checked, never timings.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from sparknet.experiments import get_experiment, make_config, make_solver, run_experiment
from sparknet.experiments.overhead import naive_speedup, periodic_speedup
from sparknet.link import LinkModel, format_bandwidth, parse_bandwidth, parse_duration

TINY_GRID = dict(workers=(1, 2), taus=(1, 4), strategies=("average", "diloco"), train_samples=600, test_samples=300,
                 target=0.75, eval_every=4, baseline_steps=400, budget=2.0, processes=1)


# -- the link model ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, seconds", [("50ms", 0.05), ("1.5s", 1.5), ("200us", 2e-4), ("0", 0.0), (2, 2.0),
                                           ("3 ms", 0.003)])
def test_durations_parse_with_units(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text, bits", [("100Mbit", 1e8), ("1Gbit", 1e9), ("500kbit/s", 5e5), ("64bit", 64.0),
                                        ("1e6", 1e6), ("2.5Gbit", 2.5e9)])
def test_bandwidths_parse_with_units(text, bits):
    assert parse_bandwidth(text) == pytest.approx(bits)


@pytest.mark.parametrize("text", ["10mbps", "3MB", "-1", "fast", "5 parsecs"])
def test_unreadable_or_byte_spelled_bandwidths_are_refused(text):
    with pytest.raises(ValueError):
        parse_bandwidth(text)


def test_unlimited_bandwidth_and_free_link():
    assert parse_bandwidth("inf") is None and parse_bandwidth(None) is None
    assert LinkModel().is_free and LinkModel().delay(10**9) == 0.0
    assert format_bandwidth(1e8) == "100Mbit" and format_bandwidth(None) == "inf"
    with pytest.raises(ValueError):
        parse_duration("-5ms")
    with pytest.raises(ValueError):
        LinkModel(latency_s=-1.0)


def test_delay_is_latency_plus_bits_over_bandwidth_and_wait_returns_it():
    link = LinkModel.parse("50ms", "100Mbit")
    assert link.delay(1_250_000) == pytest.approx(0.05 + 0.1)  # 10 Mbit over 100 Mbit/s
    assert link.delay(0) == pytest.approx(0.05)
    tiny = LinkModel.parse("1us", "1Gbit")
    assert tiny.wait(125) == pytest.approx(1e-6 + 1e-6)
    assert link.describe() == "50ms, 100Mbit"
    assert LinkModel.parse("10ms", "10Mbit").to_dict()["bandwidth_bits_per_s"] == 1e7


def test_ring_allreduce_delay():
    link = LinkModel.parse("10ms", "8Mbit")  # 1 MB/s
    assert link.allreduce_delay(1_000_000, 1) == 0.0
    # K = 2: two steps, each half the buffer: 2 latencies + 1 MB at 1 MB/s.
    assert link.allreduce_delay(1_000_000, 2) == pytest.approx(2 * 0.01 + 1.0)
    # K = 4: six steps of a quarter each.
    assert link.allreduce_delay(1_000_000, 4) == pytest.approx(6 * 0.01 + 1.5)


# -- the strategy wrapper that applies a link ------------------------------------------------------

def test_slow_network_config_pairs_latencies_with_bandwidths():
    cfg = make_config("slow-network", link_latency=("50ms",), link_bandwidth=("100Mbit",))
    links = cfg.links()
    assert links[0].is_free and links[1] == LinkModel(0.05, 1e8)
    with pytest.raises(ValueError):
        make_config("slow-network", link_latency=("50ms", "1ms"), link_bandwidth=("100Mbit",))
    with pytest.raises(ValueError):
        make_config("slow-network", link_latency=("fast",), link_bandwidth=("100Mbit",))


# -- the speedup grid and the overhead curves ------------------------------------------------------

@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    out = tmp_path_factory.mktemp("experiments")
    return run_experiment("speedup-grid", quick=True, out=out, **TINY_GRID), out


def test_grid_json_has_a_speedup_per_cell_and_strategy(grid):
    result, out = grid
    saved = json.loads((out / "speedup-grid.json").read_text())
    assert (out / "speedup-grid.png").stat().st_size > 1000
    assert saved["workers"] == [1, 2] and saved["taus"] == [1, 4] and saved["strategies"] == ["average", "diloco"]
    for strategy in ("average", "diloco"):
        table = saved["speedup"][strategy]
        assert len(table) == 2 and all(len(row) == 2 for row in table)
        assert saved["N_a"][strategy] > 0
    assert len(saved["cells"]) == 8
    for cell in saved["cells"]:
        assert {"strategy", "workers", "tau", "reached", "rounds", "parallel_steps", "speedup", "curve"} <= set(cell)
        if cell["reached"]:
            assert cell["speedup"] > 0
            assert cell["parallel_steps"] == cell["rounds"] * cell["tau"]
            assert cell["speedup"] == pytest.approx(cell["N_a"] / cell["parallel_steps"])
        else:
            assert cell["speedup"] is None
    assert saved["config"]["target"] == TINY_GRID["target"] and saved["quick"] is True


def test_grid_k1_row_of_averaging_is_the_single_worker_run(grid):
    result, _ = grid
    k1 = result["checks"]["k1_average"]
    assert k1["all_reached"]
    for tau, speedup in k1["speedups"].items():
        # Averaging one worker changes nothing: it reaches the target at N_a, rounded up to a whole round.
        assert speedup == pytest.approx(k1["expected_from_round_resolution"][tau], abs=0.35)
        assert 0.5 < speedup <= 1.5


def test_grid_tau1_column_is_large_batch_sgd(grid):
    result, _ = grid
    (pair,) = result["checks"]["tau1_vs_large_batch"]
    assert pair["workers"] == 2
    if pair["average_tau1_speedup"] is not None and pair["large_batch_speedup"] is not None:
        assert pair["average_tau1_speedup"] == pytest.approx(pair["large_batch_speedup"], rel=0.35)


def test_simulated_k1_averaging_follows_the_single_worker_weights():
    from sparknet.experiments import load_data, make_model
    from sparknet.step import worker_seed
    from sparknet.net import Net
    from sparknet.simulate import simulate

    train, test = load_data("mnist-small", train_samples=300, test_samples=100)
    solver = make_solver("sgd", 0.05, 0.9)
    # The run's initial weights (seed 3) and its one worker's data order (that worker's seed).
    net = Net(make_model("mlp", 16), solver, batch_size=16, seed=worker_seed(3, 0))
    net.set_flat(Net(make_model("mlp", 16), solver, batch_size=16, seed=3).get_flat())
    net.set_training_data(train)
    net.set_validation_data((test.x, test.y))
    accs = []
    for _ in range(3):
        net.train(5)
        accs.append(net.test())
    r = simulate(make_model("mlp", 16), train, test, workers=1, tau=5, strategy="average", solver=solver,
                 batch_size=16, steps=15, seed=3)
    assert [h["accuracy"] for h in r.history] == pytest.approx(accs, abs=0.02)


def test_overhead_curves_from_the_grid(grid):
    _, out = grid
    result = run_experiment("speedup-vs-overhead", quick=True, out=out, points=9, timed_steps=3)
    saved = json.loads((out / "speedup-vs-overhead.json").read_text())
    assert (out / "speedup-vs-overhead.png").stat().st_size > 1000
    assert saved["grid"].endswith("speedup-grid.json")
    assert saved["C_s"] > 0 and len(saved["s_over_c"]) == 9
    assert saved["s_over_c"][0] == pytest.approx(0.1) and saved["s_over_c"][-1] == pytest.approx(1000)
    (curve,) = saved["curves"]
    assert curve["workers"] == 2
    for s, naive in zip(saved["s_over_c"], curve["naive"]):
        assert naive == pytest.approx(1 / (0.5 + s))
        if s >= 1:
            assert naive < 1
    assert saved["checks"]["naive_below_1_for_s_ge_c"] and saved["checks"]["all_speedups_positive"]
    for strategy in ("average", "diloco"):
        values = [v for v in curve[strategy] if v is not None]
        assert all(v > 0 for v in values)
        assert values == sorted(values, reverse=True)  # more overhead never helps
    assert result["checks"] == saved["checks"]


def test_naive_and_periodic_speedup_formulas():
    assert naive_speedup(0.0, 5) == pytest.approx(5.0)
    assert naive_speedup(1.0, 5) == pytest.approx(1 / 1.2)
    cells = [{"reached": True, "rounds": 100, "tau": 1}, {"reached": True, "rounds": 30, "tau": 5},
             {"reached": False, "rounds": 9, "tau": 25}]
    # N_a = 200: at S = 0 tau = 1 gives 2.0, tau = 5 gives 1.33; at S = 10C tau = 5 wins.
    assert periodic_speedup(0.0, 200, cells) == (pytest.approx(2.0), 1)
    value, tau = periodic_speedup(10.0, 200, cells)
    assert tau == 5 and value == pytest.approx(200 / (30 * 15))
    assert periodic_speedup(1.0, 200, [cells[2]]) == (None, None)


# -- configs and the command line ----------------------------------------------------------------

def test_quick_configs_override_the_full_defaults():
    full = make_config("speedup-grid")
    quick = make_config("speedup-grid", quick=True, target=0.5)
    assert full.workers == (1, 2, 4, 8, 16) and full.taus == (1, 2, 5, 10, 25, 100, 500)
    assert quick.dataset == "mnist-small" and quick.target == 0.5
    with pytest.raises(ValueError, match="no option"):
        make_config("speedup-grid", wokers=(1,))
    with pytest.raises(ValueError, match="unknown experiment"):
        get_experiment("figure-7")
    with pytest.raises(ValueError):
        make_config("speedup-grid", taus=(0, 1))


def test_every_experiment_has_a_config_quick_run_and_plot():
    from sparknet.experiments import EXPERIMENTS

    for name in EXPERIMENTS:
        module = get_experiment(name)
        module.Config(**module.QUICK)
        assert callable(module.run) and callable(module.plot)


def test_command_line_flags_come_from_the_config():
    from sparknet.experiments.cli import add_config_arguments, config_overrides
    from sparknet.experiments.slow_network import Config as SlowConfig
    from sparknet.experiments.speedup_grid import Config as GridConfig

    p = argparse.ArgumentParser()
    add_config_arguments(p, GridConfig)
    args = p.parse_args(["--workers", "1", "2", "--target", "0.8", "--no-large-batch-reference"])
    assert config_overrides(args, GridConfig) == {"workers": (1, 2), "target": 0.8, "large_batch_reference": False}
    p = argparse.ArgumentParser()
    add_config_arguments(p, SlowConfig)
    args = p.parse_args(["--link-latency", "50ms", "--link-bandwidth", "100Mbit"])
    assert config_overrides(args, SlowConfig) == {"link_latency": ("50ms",), "link_bandwidth": ("100Mbit",)}


def test_grid_learning_rate_policy_reaches_the_workers_solver(monkeypatch):
    from types import SimpleNamespace

    from sparknet.experiments import speedup_grid as g
    from sparknet.experiments.cli import add_config_arguments, config_overrides
    from sparknet.solvers import LRPolicy

    # fixed (the default) keeps the solver's arguments, and so earlier results' keys, as they were
    assert g.solver_for(g.Config(**g.QUICK), "average") == {"solver_type": "sgd", "lr": 0.05, "momentum": 0.9}
    p = argparse.ArgumentParser()
    add_config_arguments(p, g.Config)
    flags = config_overrides(p.parse_args(["--lr-policy", "inv", "--gamma", "1e-3", "--power", "0.5"]), g.Config)
    assert flags == {"lr_policy": "inv", "gamma": 1e-3, "power": 0.5}
    config = g.Config(**{**g.QUICK, **flags})
    seen = []

    def fake_simulate(model, train, test, *, solver, **kwargs):
        seen.append(solver)
        return SimpleNamespace(reached=True, rounds=1, steps_per_worker=2, accuracy=1.0, history=[])

    monkeypatch.setattr("sparknet.simulate.simulate", fake_simulate)  # the cell imports it as it runs
    monkeypatch.setattr(g, "_DATA", {"train": None, "test": None})
    jobs = g._jobs(config, {g._solver_key(g.solver_for(config, s)): 100 for s in config.strategies})
    g._cell(next(j for j in jobs if j["strategy"] == "average"))
    g._cell(next(j for j in jobs if j["strategy"] == "diloco"))
    assert seen[0].lr_policy is LRPolicy.INV and (seen[0].gamma, seen[0].power) == (1e-3, 0.5)
    assert seen[1].lr_policy is LRPolicy.FIXED  # DiLoCo's inner AdamW keeps its fixed rate
    with pytest.raises(ValueError):
        g.Config(**g.QUICK, lr_policy="sometimes")


def test_sparknet_experiment_subcommand_runs_the_grid(tmp_path, capsys):
    import sparknet.experiments.cli  # noqa: F401  (registers the subcommand until the CLI loads it itself)
    from sparknet.cli import main

    rc = main(["experiment", "speedup-grid", "--quick", "--out", str(tmp_path), "--workers", "1", "--taus", "2",
               "--strategies", "average", "--train-samples", "300", "--test-samples", "100", "--target", "0.5",
               "--eval-every", "2", "--processes", "1", "--no-large-batch-reference"])
    assert rc == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["experiment"] == "speedup-grid"
    saved = json.loads((tmp_path / "speedup-grid.json").read_text())
    assert saved["speedup"]["average"][0][0] > 0 and not math.isnan(saved["speedup"]["average"][0][0])


# -- extended MNIST ----------------------------------------------------------------------------------

def test_extended_mnist_is_made_once_cached_and_tested_on_mnist(tmp_path, monkeypatch):
    import numpy as np

    from sparknet.datasets import extended_arrays, mnist
    from sparknet.experiments import load_data

    monkeypatch.setenv("SPARKNET_CACHE", str(tmp_path))
    train, test = load_data("extended-mnist", train_samples=40, test_samples=30)
    assert train.x.shape == (40, 1, 28, 28) and train.x.dtype == np.float32 and train.y.dtype == np.int64
    assert np.array_equal(train.x, extended_arrays(40).x) and np.array_equal(train.y, extended_arrays(40).y)
    assert np.array_equal(test.x, mnist().test.x[:30]) and np.array_equal(test.y, mnist().test.y[:30])
    (cached,) = (tmp_path / "extended_mnist").glob("train-40-seed0-*.x.npy")
    again, _ = load_data("extended_mnist", train_samples=40)
    assert not again.x.flags.writeable and np.array_equal(again.x, train.x)  # memory-mapped from the cache
    np.save(cached, np.zeros((3, 1, 28, 28), np.float32))
    with pytest.raises(Exception, match="delete it"):
        load_data("extended-mnist", train_samples=40)


def test_tagged_grid_on_extended_mnist_is_written_beside_the_untagged_one(tmp_path, monkeypatch):
    from sparknet.cli import main

    monkeypatch.setenv("SPARKNET_CACHE", str(tmp_path / "cache"))
    rc = main(["experiment", "speedup-grid", "--quick", "--out", str(tmp_path), "--tag", "extended",
               "--dataset", "extended-mnist", "--train-samples", "300", "--test-samples", "100", "--workers", "1",
               "--taus", "2", "--strategies", "average", "--target", "0.3", "--eval-every", "2", "--processes", "1",
               "--no-large-batch-reference"])
    assert rc == 0
    saved = json.loads((tmp_path / "speedup-grid-extended.json").read_text())
    assert (tmp_path / "speedup-grid-extended.png").exists() and not (tmp_path / "speedup-grid.json").exists()
    assert saved["config"]["dataset"] == "extended-mnist" and saved["config"]["train_samples"] == 300
    assert saved["speedup"]["average"][0][0] > 0
    with pytest.raises(ValueError, match="tag"):
        run_experiment("speedup-grid", out=tmp_path, tag="../elsewhere")


def test_a_speedup_grid_plot_names_a_decaying_rate():
    from sparknet.experiments.speedup_grid import _rate_words

    assert _rate_words({"solver_type": "sgd", "lr": 0.05, "momentum": 0.9}) == ""  # a fixed rate: as before
    inv = {"solver_type": "sgd", "lr": 0.05, "lr_policy": "inv", "gamma": 1e-4, "power": 0.75, "stepsize": None}
    assert _rate_words(inv) == "\nlr 0.05, inv (gamma 0.0001, power 0.75)"
    step = {"lr": 0.1, "lr_policy": "step", "gamma": 0.1, "power": None, "stepsize": 100}
    assert _rate_words(step) == "\nlr 0.1, step (gamma 0.1, stepsize 100)"
