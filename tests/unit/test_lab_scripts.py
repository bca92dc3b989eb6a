"""The lab's benchmark scripts read their own JSON right: which processes a run names, and the scaling points."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from plot_scaling import plot, points  # noqa: E402
import time_to_99  # noqa: E402
from time_to_99 import _processes, runs_for, selected  # noqa: E402


def test_a_runs_name_gives_its_processes():
    assert _processes("rounds, 8 workers") == 8
    assert _processes("barrier, 8 workers, 1000 warm-up steps") == 8
    assert _processes("barrier, 2 workers of 4 processes, lr 0.1") == 8


def test_slow_momentum_runs_average_with_an_outer_nesterov_step_cold_and_warm(monkeypatch):
    monkeypatch.setattr(time_to_99, "TRAIN", ["sparknet", "train"])
    runs = runs_for([8], [1, 8], warmup=[500], slow_momentum=[0.7])
    slow = runs["rounds, 8 workers, slow momentum 0.7"]
    assert slow[slow.index("--strategy") + 1] == "diloco"
    assert slow[slow.index("--outer-lr") + 1] == "1" and slow[slow.index("--outer-momentum") + 1] == "0.7"
    assert "--warmup-steps" not in slow and "--engine" not in slow  # the rounds engine, cold
    warm = runs["barrier, 8 workers, slow momentum 0.7, 500 warm-up steps"]
    assert warm[warm.index("--warmup-steps") + 1] == "500" and warm[warm.index("--engine") + 1] == "barrier"
    assert "--strategy" not in runs["rounds, 8 workers"]  # the plain runs stay plain averaging
    assert _processes("rounds, 8 workers, slow momentum 0.7, 500 warm-up steps") == 8


def test_the_evaluations_other_places_are_runs_of_the_rounds_engine_beside_its_plain_run(monkeypatch):
    monkeypatch.setattr(time_to_99, "TRAIN", ["sparknet", "train"])
    runs = runs_for([8], [1], overlap=True, sharded=True)
    plain = runs["rounds, 8 workers"]
    assert runs["rounds, 8 workers, overlapped evaluation"] == [*plain, "--eval-overlap"]
    assert runs["rounds, 8 workers, sharded evaluation"] == [*plain, "--eval-sharded"]
    assert "barrier, 8 workers, sharded evaluation" not in runs  # the barrier engine scores on its ranks already
    assert selected(list(runs), "rounds, 8 workers") == [name for name in runs if name.startswith("rounds")]


def test_only_picks_runs_by_a_part_of_their_name_or_by_the_whole_name():
    names = ["one process, 1 thread", "rounds, 8 workers", "rounds, 8 workers, slow momentum 0.7",
             "barrier, 8 workers", "barrier, 8 workers, slow momentum 0.7", "torch_distributor, 8 processes"]
    assert selected(names, None) == names
    assert selected(names, "one process|rounds, 8|=barrier, 8 workers|torch") == [
        "one process, 1 thread", "rounds, 8 workers", "rounds, 8 workers, slow momentum 0.7", "barrier, 8 workers",
        "torch_distributor, 8 processes"]
    assert selected(names, "slow momentum") == [names[2], names[4]]
    assert selected(names, "=rounds") == []  # a whole name, not a part of one


def test_every_run_trains_on_the_data_set_and_to_the_target_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(time_to_99, "RUNS", {})
    monkeypatch.setattr(time_to_99, "TRAIN", [])
    for name in ("SPARKNET_BENCH_EVAL_BUDGET", "SPARKNET_BENCH_DATASET", "SPARKNET_BENCH_TARGET"):
        monkeypatch.delenv(name, raising=False)  # what main sets for its runs
    out = tmp_path / "t99.json"
    assert time_to_99.main(["--workers", "2", "--threads", "1", "--shapes", "2x2@0.1", "--target", "0.985",
                            "--only", "no run has this name", "--out", str(out)]) == 0
    runs = time_to_99.RUNS
    assert set(runs) == {"one process, 1 thread", "rounds, 2 workers", "barrier, 2 workers",
                         "barrier, 2 workers of 2 processes, lr 0.1"}
    for cmd in runs.values():
        assert cmd[cmd.index("--dataset") + 1] == "mnist"
        assert cmd[cmd.index("--target-accuracy") + 1] == "0.985"
    assert runs["barrier, 2 workers of 2 processes, lr 0.1"][-2:] == ["--lr", "0.1"]  # after the default's, so it wins
    assert time_to_99._dataset() == ("mnist", 0.985)  # what the DDP processes read
    assert json.loads(out.read_text())["target"] == 0.985


def _run(name, wall=None, samples_per_s=None):
    return {"run": name, "command_wall_s": wall, "summary": {"samples_per_s": samples_per_s}}


def test_scaling_points_take_the_median_of_repeats_and_keep_every_series(tmp_path):
    first = {"runs": [_run("one process, 1 thread", 100.0), _run("rounds, 2 workers", 60.0, 5000.0),
                      _run("rounds, 4 workers", 40.0, 9000.0), _run("bare, 4 processes", samples_per_s=10000.0),
                      _run("torch_distributor, 4 processes", 80.0),
                      _run("barrier, 2 workers of 2 processes", 50.0, 8000.0),
                      _run("rounds, 4 workers, 1000 warm-up steps", 30.0, 8500.0),
                      _run("rounds, 4 workers, slow momentum 0.7", 25.0, 8400.0),
                      _run("rounds, 4 workers, slow momentum 0.7, 500 warm-up steps", 20.0, 8300.0),
                      _run("barrier, 2 workers of 2 processes, lr 0.1", 45.0, 7900.0)]}
    second = {"runs": [_run("rounds, 2 workers", 70.0, 4000.0), _run("rounds, 2 workers", 65.0, 4500.0)]}
    data = points([first, second])
    assert data["time"]["rounds"] == {2: 65.0, 4: 40.0}  # the median of three calls' runs at K = 2
    assert data["speed"]["rounds"] == {2: 4500.0, 4: 9000.0}
    assert data["time"]["barrier (K x G)"] == {4: 50.0} and data["speed"]["bare one-thread processes"] == {4: 10000.0}
    assert data["time"]["TorchDistributor (DDP)"] == {4: 80.0}
    assert data["time"]["rounds, 1000 warm-up steps"] == {4: 30.0}  # a series of its own
    assert data["time"]["rounds, slow momentum 0.7"] == {4: 25.0}
    assert data["time"]["rounds, slow momentum 0.7, 500 warm-up steps"] == {4: 20.0}
    assert data["time"]["barrier (K x G), lr 0.1"] == {4: 45.0}  # not the default rate's series
    assert data["one_process"] == {"one process, 1 thread": 100.0}
    plot(data, tmp_path / "scaling.png", "test")
    assert (tmp_path / "scaling.png").stat().st_size > 1000
