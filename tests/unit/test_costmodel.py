"""The cost model (sparknet.costmodel) and ``sparknet experiment scaling``."""

from __future__ import annotations

import json
import os
import math

import pytest

from sparknet.costmodel import Calibration, RunShape, StepsToTarget, predict_round, predict_run
from sparknet.experiments import run_experiment
from sparknet.experiments.scaling import check_point, measured_points
from sparknet.link import LinkModel

CAL = Calibration(step_s=0.02, cores=2, eval_s_per_row=1e-4, job_s=0.07, job_s_per_worker=0.005, allreduce_s=0.008,
                  barrier_round_s=0.003, setup_s=10.0, model_bytes=1_000_000, threads_speedup=1.6)


def test_a_round_is_compute_sync_link_and_evaluation_and_the_link_costs_what_the_engines_wait():
    link = LinkModel.parse("10ms", "100Mbit")
    barrier = predict_round(RunShape(engine="barrier", workers=4, tau=50, steps=500, eval_rows=1000), CAL, link)
    assert barrier["compute"] == pytest.approx(50 * 0.02 * 2)  # four workers on two cores
    assert barrier["link"] == pytest.approx(link.allreduce_delay(1_000_000, 4) + link.allreduce_delay(24, 4))
    assert barrier["eval"] == pytest.approx(1000 / 4 * 1e-4 * 2)
    assert barrier["sync"] == pytest.approx(0.003 + 0.008 * 2 * 3 / 4)  # a ring moves 2 (K - 1) / K buffers
    assert barrier["total"] == pytest.approx(sum(barrier[k] for k in ("compute", "sync", "link", "eval")))
    rounds = predict_round(RunShape(engine="rounds", workers=4, tau=50, steps=500), CAL, link)
    assert rounds["sync"] == pytest.approx(0.07 + 2 * 0.005)
    assert rounds["link"] == pytest.approx(2 * link.delay(4_000_000))  # K weights down, K updates up, one driver link
    naive = predict_round(RunShape(engine="barrier", workers=2, tau=50, steps=500, strategy="sync"), CAL, link)
    assert naive["link"] == pytest.approx(50 * link.allreduce_delay(1_000_000, 2))  # every step
    assert naive["sync"] == pytest.approx(0.003 + 50 * 0.008)
    big = predict_round(RunShape(engine="barrier", workers=2, tau=50, steps=500, model_bytes=10_000_000), CAL)
    assert big["compute"] == pytest.approx(10 * 50 * 0.02)  # compute scales with the model
    local = predict_round(RunShape(engine="local", workers=1, tau=50, steps=500, threads=2), CAL)
    assert local["compute"] == pytest.approx(50 * 0.02 / 1.6) and local["sync"] == 0.0
    with pytest.raises(ValueError, match="unknown engine"):
        predict_round(RunShape(engine="ring", workers=2, tau=1, steps=1), CAL)


def test_a_solvers_step_and_a_clusters_own_job_latency_are_priced():
    cal = Calibration(**{**CAL.to_dict(), "solver_step": {"sgd": 1.0, "adamw": 1.3}})
    sgd = predict_round(RunShape(engine="barrier", workers=2, tau=50, steps=500), cal)
    adamw = predict_round(RunShape(engine="barrier", workers=2, tau=50, steps=500, solver="adamw"), cal)
    assert adamw["compute"] == pytest.approx(1.3 * sgd["compute"]) and adamw["sync"] == sgd["sync"]
    shape = RunShape(engine="rounds", workers=2, tau=50, steps=500)
    point = {"source": "x", "name": "two hosts", "shape": shape, "link": "free", "what": "in-round seconds",
             "measured_s": 10.0, "with_eval": False}
    here = check_point(point, cal)["predicted_s"]
    there = check_point({**point, "job_s": 0.17}, cal)["predicted_s"]  # a cluster whose job takes 0.1 s longer
    assert there - here == pytest.approx(10 * 0.1)  # ten rounds


def test_a_run_is_setup_and_its_rounds_the_last_one_short():
    shape = RunShape(engine="barrier", workers=2, tau=50, steps=120)
    run = predict_run(shape, CAL)
    assert run["rounds"] == 3
    per = predict_round(shape, CAL)["total"]
    last = predict_round(RunShape(engine="barrier", workers=2, tau=20, steps=120), CAL)["total"]
    assert run["in_rounds"] == pytest.approx(2 * per + last)
    assert run["command"] == pytest.approx(10.0 + run["in_rounds"])


def test_steps_to_target_are_measured_where_measured_and_a_fitted_power_law_beyond():
    steps = StepsToTarget({(2, 50): 800, (8, 50): 400, (4, 10): 570})
    a, b = steps.fit()
    assert b == pytest.approx(0.5, abs=0.02) and a * 2 ** -b == pytest.approx(800, rel=0.03)
    assert steps.steps(2, 50) == (800, True)
    n, measured = steps.steps(32, 50)
    assert not measured and n % 50 == 0 and abs(n - a * 32 ** -b) < 50  # whole rounds
    with pytest.raises(ValueError, match="two worker counts"):
        StepsToTarget({(2, 50): 800}).fit()


def test_a_check_compares_a_run_file_with_the_model(tmp_path):
    summary = {"samples_per_s": 4000.0, "steps": 500, "rounds": 10}
    path = tmp_path / "time_to_99.json"
    path.write_text(json.dumps({"benchmark": "time_to_99", "runs": [
        {"run": "barrier, 2 workers", "command": "sparknet train --workers 2 --tau 50 --engine barrier",
         "summary": summary},
        {"run": "no figures", "command": "sparknet train", "summary": {}}]}))
    points = measured_points([path, tmp_path / "absent.json"])
    assert len(points) == 1 and points[0]["shape"].engine == "barrier" and points[0]["shape"].steps == 500
    assert points[0]["measured_s"] == pytest.approx(500 * 64 * 2 / 4000.0)
    check = check_point(points[0], CAL)
    expected = predict_run(RunShape(engine="barrier", workers=2, tau=50, steps=500), CAL)["in_rounds"]
    assert check["predicted_s"] == pytest.approx(expected)
    assert check["error"] == pytest.approx(expected / points[0]["measured_s"] - 1)


def test_the_scaling_experiment_writes_its_checks_predictions_and_plot(tmp_path):
    result = run_experiment("scaling", quick=True, out=tmp_path, plot=True, measured=(), workers=(2, 16),
                            taus=(50,), links=("free", "50ms,100Mbit"))
    assert result["checks"] == [] and result["within_tolerance"] is None
    cal = result["calibration"]
    assert 0.001 < cal["step_s"] < 1.0 and 0 < cal["eval_s_per_row"] < cal["step_s"]
    # measured by two processes in a process group, not the default constant
    assert 0.0 <= cal["allreduce_s"] < cal["step_s"] * 10 and cal["allreduce_s"] != Calibration().allreduce_s
    preds = result["predictions"]
    assert len(preds) == 2 * 2 * 2  # links x engines x K
    slow = {p["engine"]: p for p in preds if p["workers"] == 16 and p["link"] == "50ms,100Mbit"}
    free = {p["engine"]: p for p in preds if p["workers"] == 16 and p["link"] == "free"}
    assert all(slow[e]["time_to_target_s"] > free[e]["time_to_target_s"] for e in slow)
    assert not slow["barrier"]["steps_measured"] and math.isfinite(slow["barrier"]["time_to_target_s"])
    assert (tmp_path / "scaling.png").stat().st_size > 10_000


def test_a_result_file_with_its_own_constants_and_job_latency_is_priced_with_them(tmp_path):
    run = {"command": "sparknet train --workers 2 --master spark://h:7077 --engine rounds --tau 50",
           "summary": {"samples_per_s": 1000.0, "steps": 500}}
    path = tmp_path / "multihost.json"
    path.write_text(json.dumps({"benchmark": "multihost_lenet", "empty_job_s": 0.2,
                                "calibration": {"step_s": 0.04, "eval_s_per_row": 2e-4}, "runs": {"r": run}}))
    (point,) = measured_points([path])
    assert point["job_s"] == pytest.approx(0.2 * 1.2) and point["calibration"]["step_s"] == 0.04
    checked = check_point(point, CAL)  # CAL's own step (0.02) and job (0.07) are not used for this point
    rounds = 10
    assert checked["predicted_s"] == pytest.approx(rounds * (50 * 0.04 + 0.24))


def test_a_slow_network_run_is_priced_with_the_constants_measured_beside_it(tmp_path):
    run = {"scheme": "naive", "strategy": "sync", "engine": "barrier", "ok": True, "steps_to_target": 100,
           "train_time_to_target_s": 20.0, "link": {"latency_s": 0.0, "bandwidth_bits_per_s": None, "label": "free"}}
    body = {"experiment": "slow-network", "config": {"tau": 50}, "workers": 2, "runs": [run]}
    path = tmp_path / "slow-network.json"
    path.write_text(json.dumps(body))
    (plain,) = measured_points([path])
    assert "calibration" not in plain
    own = {"step_s": 0.05, "eval_s_per_row": 3e-4, "allreduce_s": 0.02, "solver_step": {"sgd": 1.0, "adamw": 1.1}}
    path.write_text(json.dumps({**body, "calibration": own}))
    (point,) = measured_points([path])
    assert point["calibration"] == own
    round_s = 50 * 0.05 + 0.003 + 50 * 0.02 + 10_000 / 2 * 3e-4  # steps, the round's and 50 steps' allreduces, eval
    assert check_point(point, CAL)["predicted_s"] == pytest.approx(2 * round_s)


def test_a_lab_run_is_priced_with_the_step_its_bare_processes_measured_beside_it(tmp_path):
    other = (os.cpu_count() or 1) + 14  # another machine's core count
    runs = [{"run": "one process, 8 threads", "command": "sparknet train --threads 8 --eval-every 50",
             "summary": {"samples_per_s": 10_000.0, "steps": 3800}},
            {"run": "rounds, 8 workers", "command": "sparknet train --workers 8 --tau 50 --master local[8]",
             "summary": {"samples_per_s": 12_800.0, "steps": 1000}},
            {"run": "barrier, 4 workers", "command": "sparknet train --workers 4 --tau 50 --engine barrier",
             "summary": {"samples_per_s": 8_000.0, "steps": 1500}},
            {"run": "bare, 8 processes", "summary": {"samples_per_s": 16_000.0}}]
    path = tmp_path / "lab.json"
    path.write_text(json.dumps({"benchmark": "time_to_99", "cpu_count": other, "runs": runs}))
    (point,) = measured_points([path])  # the one process and K = 4 have no constants of their machine: left out
    assert point["name"] == "rounds, 8 workers"
    assert point["calibration"] == {"step_s": pytest.approx(64 / 2000.0), "cores": other}  # no rates: the mean's
    runs[-1]["summary"]["per_process"] = [2100.0] * 6 + [1800.0, 1600.0]  # a round waits for its slowest worker
    path.write_text(json.dumps({"benchmark": "time_to_99", "cpu_count": other, "runs": runs}))
    (point,) = measured_points([path])
    assert point["calibration"] == {"step_s": pytest.approx(64 / 1600.0), "cores": other}
    rounds = 1000 // 50
    expected = rounds * (50 * 64 / 1600.0 + CAL.job_s + CAL.job_s_per_worker * 6)  # a core each: no sharing
    assert check_point(point, CAL)["predicted_s"] == pytest.approx(expected)
    path.write_text(json.dumps({"benchmark": "time_to_99", "cpu_count": os.cpu_count(), "runs": runs}))
    assert [p["name"] for p in measured_points([path])] == [r["run"] for r in runs[:3]]  # this machine's: all


def test_a_lab_call_without_bare_processes_is_priced_with_those_of_another_call_of_its_machine(tmp_path):
    """A lab call with no time for the K bare processes takes the step of another file's K bare processes from a
    machine of the same core count, and says which file; a K no file measured, or another core count, is not
    priced."""
    other = (os.cpu_count() or 1) + 14
    engines = [{"run": f"rounds, {k} workers", "command": f"sparknet train --workers {k} --tau 50",
                "summary": {"samples_per_s": 12_000.0, "steps": 750}} for k in (8, 4)]
    (tmp_path / "engines.json").write_text(json.dumps({"benchmark": "time_to_99", "cpu_count": other,
                                                        "runs": engines}))
    bare = [{"run": "bare, 8 processes", "summary": {"samples_per_s": 16_000.0, "per_process": [2000.0] * 8}}]
    (tmp_path / "bare.json").write_text(json.dumps({"benchmark": "time_to_99", "cpu_count": other, "runs": bare}))
    (tmp_path / "elsewhere.json").write_text(json.dumps({"benchmark": "time_to_99", "cpu_count": other + 1,
                                                          "runs": [{**bare[0], "run": "bare, 4 processes"}]}))
    paths = [tmp_path / name for name in ("engines.json", "bare.json", "elsewhere.json")]
    (point,) = measured_points(paths)
    assert point["name"] == "rounds, 8 workers" and point["calibration_from"] == "bare.json"
    assert point["calibration"] == {"step_s": pytest.approx(64 / 2000.0), "cores": other}
    assert check_point(point, CAL)["calibration_from"] == "bare.json"
    assert measured_points(paths[:1]) == []  # nothing of its machine measured anywhere
