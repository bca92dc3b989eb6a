"""The Spark-based experiments (time to accuracy, tau sensitivity, slow network) on local[2], tiny data.

Each runs in its quick mode cut down further (a few hundred MNIST images, a low target) and
the JSON is checked for structure and sane values — never for timings.
"""

from __future__ import annotations

import json

import pytest

from _spark_testlib import module_session
from sparknet.experiments import run_experiment

pytestmark = [pytest.mark.spark, pytest.mark.slow]

TINY = dict(train_samples=400, test_samples=200)


spark = module_session("local[2]")


def test_time_to_accuracy_records_every_system_reached_or_failed(spark, tmp_path):
    systems = ("one-process", "rounds", "barrier", "sync", "async", "torch-distributor")
    result = run_experiment("time-to-accuracy", quick=True, out=tmp_path, spark=spark, systems=systems, target=0.6,
                            eval_every=10, steps=200, **TINY)
    saved = json.loads((tmp_path / "time-to-accuracy.json").read_text())
    assert (tmp_path / "time-to-accuracy.png").stat().st_size > 1000
    assert [e["system"] for e in saved["entries"]] == list(systems)
    assert set(saved["summary"]) == set(systems)
    for e in saved["entries"]:
        if not e["ok"]:
            assert e["error"] and not e["reached"]  # a failure is kept with its error
            continue
        assert e["curve"], e["system"]
        assert all(0 <= p["accuracy"] <= 1 and p["wall_s"] > 0 and p["steps"] > 0 for p in e["curve"])
        walls = [p["wall_s"] for p in e["curve"]]
        assert walls == sorted(walls)
        if e["reached"]:
            assert e["time_to_target_s"] > 0 and e["steps_to_target"] > 0
            assert max(p["accuracy"] for p in e["curve"]) >= 0.6
    by = {e["system"]: e for e in saved["entries"]}
    # sparknet's own engines must work here; the one-process reference too.
    for system in ("one-process", "rounds", "barrier", "sync"):
        assert by[system]["ok"] and by[system]["reached"], by[system].get("error")
    assert by["rounds"]["setup_s"] >= 0 and by["rounds"]["rounds"] >= 1
    if by["torch-distributor"]["ok"]:
        assert by["torch-distributor"]["launch_s"] > 0
    assert result["summary"] == saved["summary"]


def test_tau_sensitivity_gives_a_curve_per_tau(spark, tmp_path):
    run_experiment("tau-sensitivity", quick=True, out=tmp_path, spark=spark, taus=(2, 10), steps=20, eval_every=10,
                   **TINY)
    saved = json.loads((tmp_path / "tau-sensitivity.json").read_text())
    assert (tmp_path / "tau-sensitivity.png").stat().st_size > 1000
    assert [r["tau"] for r in saved["runs"]] == [2, 10]
    for r in saved["runs"]:
        assert r["ok"], r.get("error")
        assert r["rounds"] == 20 // r["tau"]
        assert len(r["curve"]) == 2  # every 10 steps
        assert [p["steps"] for p in r["curve"]] == [10, 20]
        assert all(0 <= p["accuracy"] <= 1 and 0 <= p["train_wall_s"] <= p["wall_s"] for p in r["curve"])


def test_slow_network_applies_the_link_inside_the_engine(spark, tmp_path):
    run_experiment("slow-network", quick=True, out=tmp_path, spark=spark, link_latency=("20ms",),
                   link_bandwidth=("100Mbit",), target=0.6, tau=10, steps=30, max_seconds=30.0, **TINY)
    saved = json.loads((tmp_path / "slow-network.json").read_text())
    assert (tmp_path / "slow-network.png").stat().st_size > 1000
    assert [lk["label"] for lk in saved["links"]] == ["0s, inf", "20ms, 100Mbit"]
    assert len(saved["runs"]) == 6
    for r in saved["runs"]:
        assert r["ok"], r.get("error")
        assert r["curve"] and r["step_budget"] >= 10
        assert r["engine"] == "barrier"
        # timed from the first round's start: the stage's launch (its tasks start, write their partitions and join
        # the process group) is recorded beside the setup, not counted as training
        assert 0 < r["launch_s"] < r["wall_s"] - r["setup_s"]
        assert r["train_wall_s"] == pytest.approx(r["curve"][-1]["wall_s"] - r["setup_s"] - r["launch_s"])
        if r["link"]["label"] == "0s, inf":
            assert r["modelled_link_s_per_step"] == 0 and r["link_s"] is None  # a free link: no option, no wait
        else:
            assert r["modelled_link_s_per_step"] > 0
            # the engine itself waited, at least the link's cost of the steps it ran
            assert r["link_s"] >= r["modelled_link_s_per_step"] * (r["rounds"] * 10) * 0.999
    assert set(saved["calibration"]) >= {"step_s", "eval_s_per_row", "allreduce_s"}  # the cost model's, this hour
    naive = [r for r in saved["runs"] if r["scheme"] == "naive"]
    average = [r for r in saved["runs"] if r["scheme"] == "average"]
    # The naive scheme pays the link every step, averaging once every tau steps.
    assert naive[1]["modelled_link_s_per_step"] == pytest.approx(10 * average[1]["modelled_link_s_per_step"])


def test_the_speedup_grid_in_seconds_runs_every_cell_as_a_spark_fit(spark, tmp_path):
    """Figure 3 timed for real: every (K, tau) a barrier fit of K workers at once to the target, its seconds the sum
    of its rounds' up to the one that reached it, beside the speedup its step counts give."""
    run_experiment("speedup-grid", quick=True, out=tmp_path, spark=spark, wall_clock=True, model="mlp",
                            workers=(1, 2, 3), taus=(20,), strategies=("average",), target=0.8, eval_every=10,
                            baseline_steps=600, large_batch_reference=False, **TINY)
    saved = json.loads((tmp_path / "speedup-grid.json").read_text())
    assert (tmp_path / "speedup-grid.png").stat().st_size > 1000
    assert saved["measure"] == "seconds" and saved["T_a"]["average"] > 0
    n_a = saved["N_a"]["average"]
    assert n_a % 10 == 0 and 0 < n_a <= 600  # one worker, evaluated every 10 steps
    assert [(c["workers"], c["tau"]) for c in saved["cells"]] == [(1, 20), (2, 20), (3, 20)]
    refused = saved["cells"].pop()  # three barrier workers on two slots: kept with its error, the grid went on
    assert refused["ok"] is False and "task slots" in refused["error"] and refused["speedup"] is None
    for cell in saved["cells"]:
        assert cell["reached"] and cell.get("ok", True), cell
        assert cell["steps_per_worker"] == cell["rounds"] * cell["tau"]  # the fit stopped at the target
        assert 0 < cell["seconds"] < cell["from_fit_start_s"] and cell["setup_s"] > 0
        assert cell["speedup"] == pytest.approx(saved["T_a"]["average"] / cell["seconds"])
        assert cell["speedup_steps"] == pytest.approx(n_a / (cell["rounds"] * cell["tau"]))
        # where the two speedups part, the steps' milliseconds say by how much
        one = saved["baselines"][0]["step_ms"]
        assert cell["speedup"] == pytest.approx(cell["speedup_steps"] * one / cell["step_ms"])
        assert cell["speedup_k1"] == pytest.approx(saved["cells"][0]["seconds"] / cell["seconds"])
    table = saved["speedup"]["average"]
    assert table == [[saved["cells"][0]["speedup"]], [saved["cells"][1]["speedup"]], [None]]
