"""What a figure was measured beside: the load sampler and a command's age."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from sparknet.metrics import LoadSampler, process_age_s, rounds_summary


def test_the_load_sampler_records_before_and_samples_during():
    with LoadSampler(every_s=0.05) as load:
        time.sleep(0.4)
    out = load.to_dict()
    assert len(out["load_average_before"]) == 3 and all(v >= 0 for v in out["load_average_before"])
    assert 3 <= len(out["load_average_during"]) <= 9  # one sample per 0.05 s of the 0.4 s
    n = len(out["load_average_during"])
    time.sleep(0.15)
    assert len(load.to_dict()["load_average_during"]) == n  # stopped: nothing more is sampled


def test_a_process_age_counts_from_the_interpreter_start():
    code = "import time; time.sleep(0.6); from sparknet.metrics import process_age_s; print(process_age_s())"
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    outside = time.perf_counter() - t0
    age = float(out.stdout.strip())
    assert 0.6 <= age <= outside + 0.05  # the sleep before the import is counted; no more than the parent saw
    assert process_age_s() > age - 0.05  # this test process is older than the child was at its end


def test_the_summary_says_what_the_rounds_waited_for():
    """A round lasts as long as its slowest worker: the summary adds up, round by round, the slowest worker's
    steps and the workers' mean, beside the rounds' own seconds."""
    rounds = [{"samples": 128, "round_s": 2.0, "bytes": 0, "per_worker": [{"compute_s": 1.0}, {"compute_s": 1.5}]},
              {"samples": 128, "round_s": 3.0, "bytes": 0, "per_worker": [{"compute_s": 2.5}, {"compute_s": 0.5}]},
              {"samples": 128, "round_s": 1.0, "bytes": 0}]  # a round whose workers said nothing
    now = time.perf_counter()
    summary = rounds_summary(rounds, None, t_fit=now, t_train=now, train_s=6.0)
    assert summary["rounds_s"] == 6.0 and summary["samples_per_s"] == pytest.approx(384 / 6.0)
    assert summary["slowest_compute_s"] == pytest.approx(1.5 + 2.5)
    assert summary["mean_compute_s"] == pytest.approx(1.25 + 1.5)
    assert summary["compute_s_by_worker"] == [3.5, 2.0]  # worker 0 the slower one over the fit, not in every round
    by_rank = [{"samples": 1, "round_s": 1.0, "bytes": 0, "per_worker": [{"rank": 1, "compute_s": 0.25},
                                                                       {"rank": 0, "compute_s": 0.5}]}]
    assert rounds_summary(by_rank, None, t_fit=now, t_train=now, train_s=1.0)["compute_s_by_worker"] == [0.5, 0.25]
    assert "slowest_compute_s" not in rounds_summary(rounds[2:], None, t_fit=now, t_train=now, train_s=1.0)
