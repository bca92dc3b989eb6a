"""The Spark examples run with --quick (imported, sharing this module's local[2] session)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from _spark_testlib import module_session

pytestmark = pytest.mark.spark

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


spark = module_session("local[2]")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sql_train_quick(spark, capsys):
    result = _load("sql_train").main(["--quick", "--json"], spark=spark)
    assert result["train_rows"] == 4000  # the WHERE clause kept the training split only
    assert result["test_accuracy"] > 0.6, result  # 10 classes: chance is 0.1
    assert '"test_accuracy"' in capsys.readouterr().out
    assert not spark.catalog.tableExists("digits")


def test_pipeline_quick(spark):
    result = _load("pipeline").main(["--quick", "--json"], spark=spark)
    assert result["reloaded_identical"] is True
    assert result["test_accuracy"] > 2 * result["chance"], result


def test_async_ps_quick(spark):
    result = _load("async_ps").main(["--quick", "--json", "--tau", "5", "--steps", "40"], spark=spark)
    assert result["steps_per_worker"] == 40 and result["workers"] == 2 and result["epochs"] == 2, result
    # Each worker pushes at least every 5 steps (and after an epoch's last step): all applied, none refused.
    assert result["pushes"] >= 2 * 40 // 5 and result["rejected"] == 0, result
    assert result["test_accuracy"] > 3 * result["chance"], result


def test_caffe_lenet_quick_on_spark(spark, tmp_path):
    caffe_lenet = _load("caffe_lenet")
    if not (caffe_lenet.default_caffe_dir() / "mnist" / "lenet_solver.prototxt").is_file():
        pytest.skip("BVLC Caffe files not found (set SPARKNET_CAFFE_MODELS)")
    result = caffe_lenet.main(["--quick", "--workers", "2", "--tau", "10", "--steps", "20", "--json",
                               "--snapshot-dir", str(tmp_path / "lenet")], spark=spark)
    assert result["workers"] == 2 and result["steps"] == 20, result
    assert result["test_accuracy"] > 2 * 0.1, result  # 10 digits: chance is 0.1


def test_char_lstm_quick_in_its_own_processes():
    """The LSTM example runs its own gloo group (spawned processes), so it runs as a script."""
    import json
    import math
    import subprocess
    import sys

    from sparknet.datasets import shakespeare

    proc = subprocess.run([sys.executable, str(EXAMPLES / "char_lstm.py"), "--quick", "--workers", "2", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["workers"], result["rounds"], result["steps_per_worker"]) == (2, 3, 30)
    # Better than guessing uniformly over the vocabulary (log2 of its size, about 6.4 bits).
    assert result["validation_bpc"] < math.log2(shakespeare().vocab_size) - 0.5, result
    assert result["sample"]["text"], result
