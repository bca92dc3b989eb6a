"""examples/model_parallel.py runs as a user runs it: its own gloo processes, one model split in two."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "model_parallel.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300)


def test_two_workers_hold_half_the_weights_each_and_learn(tmp_path):
    proc = _run("--workers", "2", "--model-parallel", "2", "--width", "256", "--rounds", "2", "--tau", "20",
                "--lr", "1e-3", "--out", str(tmp_path / "model"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (s["data_parallel"], s["model_parallel"]) == (1, 2)
    assert all(0.45 < b / s["whole_weight_bytes"] < 0.55 for b in s["weight_bytes_per_worker"]), s
    assert s["test_accuracy"] > 0.5, s  # 10 classes: chance is 0.1
    assert (tmp_path / "model").is_dir()


def test_a_share_over_the_budget_is_refused_before_any_process_starts():
    proc = _run("--workers", "2", "--model-parallel", "1", "--width", "512", "--max-weight-bytes", "1e6")
    assert proc.returncode == 2
    assert "over the budget" in proc.stderr and "--model-parallel 4" in proc.stderr, proc.stderr  # the degree that fits
