"""scripts/standalone_cluster.sh: a real standalone master and two workers on 127.0.0.1.

Starts the cluster, trains with SparkTrainer on synthetic data against it, and checks that
the job ran on the standalone master with two executors and that nothing the script started
is left running afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "standalone_cluster.sh"

JOB = r"""
import json, os, sys, urllib.request
from pyspark.sql import SparkSession
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.datasets import synthetic
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer
from sparknet import zoo

master = os.environ["SPARKNET_MASTER"]
spark = (SparkSession.builder.master(master).appName("sparknet-standalone-test")
         .config("spark.executor.memory", "512m").config("spark.executor.cores", "1")
         .config("spark.cores.max", "2").config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
try:
    sc = spark.sparkContext
    ds = synthetic(240, shape=(6,), num_classes=3, seed=1)
    df = spark.createDataFrame([([float(v) for v in x], int(y)) for x, y in zip(ds.x, ds.y)], ["features", "label"])
    result = SparkTrainer(zoo.mlp(input_shape=[6], hidden=[8], num_classes=3),
                          WorkerConfig(solver=SolverConfig(base_lr=0.05), batch_size=16),
                          DistributedConfig(workers=2, tau=5, rounds=2), spark=spark).fit(df)
    with urllib.request.urlopen(os.environ["SPARKNET_MASTER_UI"] + "/json/", timeout=10) as r:
        ui = json.load(r)
    print("RESULT " + json.dumps({
        "master": sc.master, "app": sc.applicationId, "argv_master": sys.argv[1],
        "executors": sc._jsc.sc().getExecutorMemoryStatus().size() - 1,
        "active_apps": [a["id"] for a in ui["activeapps"]], "alive_workers": ui["aliveworkers"],
        "rounds": result.summary["rounds"], "rows_per_partition": result.summary["rows_per_partition"]}))
finally:
    spark.stop()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not running
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _running_under(folder: Path) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if os.readlink(proc / "cwd").startswith(str(folder)):
                    out.append(int(proc.name))
            except OSError:
                continue
    return out


@pytest.mark.skipif(shutil.which("java") is None and not os.environ.get("JAVA_HOME"), reason="needs Java")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks leftovers through /proc")
def test_standalone_cluster_runs_a_job_and_stops_everything(tmp_path):
    folder = tmp_path / "cluster"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dir", str(folder), "--keep", "--timeout", "150", "--",
         sys.executable, "-c", JOB, "$SPARKNET_MASTER"],
        env=env, capture_output=True, text=True, timeout=420)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["master"].startswith("spark://127.0.0.1:")
    assert result["argv_master"] == result["master"]  # '$SPARKNET_MASTER' in the command was replaced
    assert result["app"].startswith("app-") and result["app"] in result["active_apps"]
    assert result["alive_workers"] == 2 and result["executors"] == 2
    assert result["rounds"] == 2 and sum(result["rows_per_partition"]) == 240

    pids = [int(line.split()[1]) for line in (folder / "pids").read_text().splitlines()]
    assert len(pids) == 3  # master and two workers
    assert not [p for p in pids if _alive(p)]
    assert not [p for p in _running_under(folder) if _alive(p)]
    port = int(result["master"].rsplit(":", 1)[1])
    with socket.socket() as s:
        s.settimeout(2)
        assert s.connect_ex(("127.0.0.1", port)) != 0  # the master no longer listens
    assert (folder / "logs" / "master.log").exists()


def test_bad_option_is_refused_without_starting_anything(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "--workers", "zero", "--dir", str(tmp_path / "c")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--workers must be a positive integer" in proc.stderr
    assert not (tmp_path / "c").exists()
