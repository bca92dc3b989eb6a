"""What a figure was measured beside: the load sampler and a command's age."""

from __future__ import annotations

import subprocess
import sys
import time

from sparknet.metrics import LoadSampler, process_age_s


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
