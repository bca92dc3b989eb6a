"""The Spark examples run with --quick (imported, sharing this module's local[2] session)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from _spark_testlib import start_session

pytestmark = pytest.mark.spark

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def spark():
    session = start_session("local[2]")
    yield session
    session.stop()


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
