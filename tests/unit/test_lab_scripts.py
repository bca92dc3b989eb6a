"""The lab's benchmark scripts read their own JSON right: which processes a run names, and the scaling points."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from plot_scaling import plot, points  # noqa: E402
import time_to_99  # noqa: E402
from time_to_99 import _processes  # noqa: E402


def test_a_runs_name_gives_its_processes():
    assert _processes("rounds, 8 workers") == 8
    assert _processes("barrier, 8 workers, 1000 warm-up steps") == 8
    assert _processes("barrier, 2 workers of 4 processes, lr 0.1") == 8


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
                      _run("rounds, 4 workers, 1000 warm-up steps", 30.0, 8500.0)]}
    second = {"runs": [_run("rounds, 2 workers", 70.0, 4000.0), _run("rounds, 2 workers", 65.0, 4500.0)]}
    data = points([first, second])
    assert data["time"]["rounds"] == {2: 65.0, 4: 40.0}  # the median of three calls' runs at K = 2
    assert data["speed"]["rounds"] == {2: 4500.0, 4: 9000.0}
    assert data["time"]["barrier (K x G)"] == {4: 50.0} and data["speed"]["bare one-thread processes"] == {4: 10000.0}
    assert data["time"]["TorchDistributor (DDP)"] == {4: 80.0}
    assert data["time"]["rounds, 1000 warm-up steps"] == {4: 30.0}  # a series of its own
    assert data["one_process"] == {"one process, 1 thread": 100.0}
    plot(data, tmp_path / "scaling.png", "test")
    assert (tmp_path / "scaling.png").stat().st_size > 1000
