"""What ``sparknet train --data`` reads, in one process: ``--task`` (labels that are numbers, or a 0 or 1 for each
output, trained by an mlp sized to them with the task's loss and metrics) and ``--features-col``/``--label-col``
(the table's own columns, several feature columns joined in order)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparknet import _parquet, zoo
from sparknet.cli import main
from sparknet.config import RunConfig
from sparknet.labels import Task, infer_task
from sparknet.layers import EuclideanLoss, SigmoidCrossEntropyLoss, SoftmaxWithLoss
from sparknet.model_io import load_model


def _features(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 6)).astype(np.float32)


def _write(path, x, label) -> str:
    pq.write_table(pa.table({"features": pa.array(list(x), pa.list_(pa.float32())), "label": label}), path)
    return str(path)


def _numbers(x: np.ndarray, outputs: int) -> np.ndarray:
    w = np.random.default_rng(100).normal(size=(6, outputs)).astype(np.float32)
    return np.tanh(x @ w) + 0.5


def _label_sets(x: np.ndarray) -> np.ndarray:
    return np.stack([x[:, 0] > 0, x[:, 1] + x[:, 2] > 0, x[:, 3] > 0.5], axis=1).astype(np.int64)


def _train(tmp_path, name: str, *flags: str) -> tuple[int, list[dict]]:
    metrics = tmp_path / f"{name}.jsonl"
    code = main(["train", "--model", "mlp", "--threads", "1", "--batch-size", "32", "--metrics-out", str(metrics),
                 "--quiet", *flags])
    return code, [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


@pytest.mark.parametrize("outputs", [1, 3])
def test_a_regression_table_trains_an_mlp_as_wide_as_its_labels_scored_by_r2(tmp_path, outputs):
    x = _features(2000, 0)
    y = _numbers(x, outputs)
    label = pa.array(y[:, 0]) if outputs == 1 else pa.array(list(y), pa.list_(pa.float64()))
    data = _write(tmp_path / "numbers.parquet", x, label)
    code, records = _train(tmp_path, "reg", "--data", data, "--task", "regression", "--steps", "600", "--lr", "0.05",
                           "--eval-every", "300", "--model-dir", str(tmp_path / "model"))
    summary = records[-1]
    assert code == 0 and summary["event"] == "summary" and summary["test_accuracy"] is None
    assert summary["test_r2"] > 0.95 and summary["test_rmse"] < 0.1 and summary["test_mae"] < summary["test_rmse"]
    assert [r["test_r2"] for r in records if r["event"] == "eval"][-1] == summary["test_r2"]
    saved = load_model(tmp_path / "model")
    assert saved.net.task is Task.REGRESSION
    assert saved.net.net_params.layers[-2].num_outputs == outputs
    held = slice(1800, None)  # the last tenth of the rows: the test set
    assert saved.net.evaluate((x[held], y[held, 0] if outputs == 1 else y[held])).metrics["r2"] == pytest.approx(
        summary["test_r2"], abs=1e-6)


def test_a_multilabel_table_trains_with_a_sigmoid_loss_and_stops_at_its_target(tmp_path):
    x = _features(3000, 1)
    data = _write(tmp_path / "sets.parquet", x, pa.array(list(_label_sets(x)), pa.list_(pa.int64())))
    code, records = _train(tmp_path, "sets", "--data", data, "--task", "multilabel", "--steps", "3000", "--lr", "0.1",
                           "--target-accuracy", "0.95", "--model-dir", str(tmp_path / "model"))
    summary = records[-1]
    assert code == 0 and summary["stop_reason"] == "target_accuracy" and summary["steps"] < 3000
    assert summary["test_accuracy"] >= 0.95 and summary["test_f1"] > 0.9 and summary["test_auc"] > 0.95
    assert load_model(tmp_path / "model").net.task is Task.MULTILABEL  # its loss layer says so


def test_a_regression_target_is_set_on_r2_and_the_progress_line_shows_it(tmp_path, capfd):
    x = _features(2000, 2)
    data = _write(tmp_path / "numbers.parquet", x, pa.array(_numbers(x, 1)[:, 0]))
    code, records = _train(tmp_path, "target", "--data", data, "--task", "regression", "--steps", "5000",
                           "--lr", "0.05", "--target-accuracy", "0.98", "--no-quiet")
    summary = records[-1]
    assert code == 0 and summary["stop_reason"] == "target_accuracy" and summary["steps"] < 5000
    assert summary["test_r2"] >= 0.98
    shown = capfd.readouterr().err  # a line a round, each with the score of the round before
    assert " r2=0.9" in shown and " acc=" not in shown


@pytest.mark.parametrize("task, label, match", [
    ("regression", pa.array(["a", "b"] * 5), "has type string; --task regression needs numbers"),
    ("regression", pa.array([1.0, float("nan")] * 5), "5 labels in column 'label' are NaN or infinite"),
    ("regression", pa.array([[1.0], [1.0, 2.0]] * 5), "label rows of 'label' differ in length: row 0 has 1"),
    ("regression", pa.array([1.0, None] * 5), "has 5 null values"),
    ("multilabel", pa.array([[0, 1], [2, 0]] * 5), "holds values other than 0 and 1 \\(from 0 to 2\\)"),
    ("classification", pa.array([0.5, 1.0] * 5), "must hold class ids"),
])
def test_labels_that_are_not_the_task_s_are_refused_by_name(tmp_path, task, label, match):
    data = _write(tmp_path / "bad.parquet", _features(10, 3), label)
    with pytest.raises(ValueError, match=match):
        _parquet.read_parquet_dataset(data, task=Task(task))


def test_the_task_s_settings_are_checked_before_anything_loads():
    with pytest.raises(ValueError, match="--task regression learns the labels of a --data table"):
        RunConfig(task="regression")
    with pytest.raises(ValueError, match="--task multilabel trains --model mlp .* lenet is a classifier"):
        RunConfig(task="multilabel", data="t.parquet")
    with pytest.raises(ValueError, match="task must be one of classification, regression, multilabel"):
        RunConfig(task="unlabelled", data="t.parquet", model="mlp")
    assert RunConfig(task="Regression", data="t.parquet", model="mlp").task is Task.REGRESSION


@pytest.mark.parametrize("task, loss", [("classification", SoftmaxWithLoss), ("regression", EuclideanLoss),
                                        ("multilabel", SigmoidCrossEntropyLoss)])
def test_the_zoo_mlp_ends_in_the_task_s_loss_and_says_its_task(task, loss):
    net = zoo.mlp(input_shape=[6], hidden=[8], num_classes=3, task=task)
    assert isinstance(net.layers[-1], loss) and infer_task(None, net) is Task(task)
    assert net.inputs[1].dtype == ("int64" if task == "classification" else "float32")


def test_named_columns_train_several_feature_columns_joined_in_order(tmp_path):
    x = _features(2000, 4)
    y = _numbers(x, 1)[:, 0]
    columns = {f"x{i}": pa.array(x[:, i]) for i in range(4)}  # four number columns, then an array of two
    table = pa.table({**columns, "rest": pa.array(list(x[:, 4:]), pa.list_(pa.float32())), "target": pa.array(y),
                      "features": pa.array(["not these"] * len(x))})
    pq.write_table(table, tmp_path / "wide.parquet")
    code, records = _train(tmp_path, "wide", "--data", str(tmp_path / "wide.parquet"), "--task", "regression",
                           "--features-col", "x0, x1,x2,x3,rest", "--label-col", "target", "--steps", "600",
                           "--lr", "0.05", "--model-dir", str(tmp_path / "model"))
    assert code == 0 and records[-1]["test_r2"] > 0.95
    saved = load_model(tmp_path / "model")
    assert saved.input_shape == (6,) and saved.config["run"]["features_col"] == "x0, x1,x2,x3,rest"
    held = slice(1800, None)
    assert saved.net.evaluate((x[held], y[held])).metrics["r2"] == pytest.approx(records[-1]["test_r2"], abs=1e-6)


@pytest.mark.parametrize("task", ["regression", "multilabel"])
def test_several_label_columns_train_as_one_array_of_them(tmp_path, task):
    x = _features(1500, 9)
    y = _numbers(x, 2) if task == "regression" else _label_sets(x)
    kind = pa.float64() if task == "regression" else pa.int64()
    pq.write_table(pa.table({"features": pa.array(list(x), pa.list_(pa.float32())),
                             "label": pa.array(list(y), pa.list_(kind)),
                             **{f"y{i}": pa.array(y[:, i], kind) for i in range(y.shape[1])}}), tmp_path / "t.parquet")
    flags = ("--data", str(tmp_path / "t.parquet"), "--task", task, "--steps", "200", "--lr", "0.05")
    code, joined = _train(tmp_path, "joined", *flags, "--label-col", ",".join(f"y{i}" for i in range(y.shape[1])))
    assert code == 0
    code, as_array = _train(tmp_path, "array", *flags)  # the same numbers, as one array column
    assert code == 0 and joined[-1]["test_loss"] == as_array[-1]["test_loss"], (joined[-1], as_array[-1])
    with pytest.raises(ValueError, match="--label-col y0,y1 names several columns: .*class ids are one column"):
        RunConfig(data=str(tmp_path / "t.parquet"), label_col="y0,y1")


def _half_wrong(tmp_path, rows: int = 3000) -> tuple[str, str]:
    """A table whose every other row holds the wrong class at weight 0 (``w``), and a clean table to test on."""
    x, test_x = _features(rows, 7), _features(500, 8)
    right = (x[:, 0] > 0).astype(np.int64)
    wrong = np.arange(rows) % 2 == 1
    pq.write_table(pa.table({"features": pa.array(list(x), pa.list_(pa.float32())),
                             "label": np.where(wrong, 1 - right, right), "w": np.where(wrong, 0, 1)}),
                   tmp_path / "half_wrong.parquet")
    return str(tmp_path / "half_wrong.parquet"), _write(tmp_path / "clean.parquet", test_x,
                                                         (test_x[:, 0] > 0).astype(np.int64))


def test_weight_col_weighs_each_row_s_loss_so_rows_of_weight_0_teach_nothing(tmp_path):
    data, clean = _half_wrong(tmp_path)
    flags = ("--data", data, "--validation-data", clean, "--steps", "300", "--lr", "0.05")
    code, weighed = _train(tmp_path, "weighed", *flags, "--weight-col", "w")
    assert code == 0 and weighed[-1]["test_accuracy"] > 0.95, weighed[-1]
    code, plain = _train(tmp_path, "plain", *flags)  # the wrong rows cancel the right ones
    assert code == 0 and plain[-1]["test_accuracy"] < 0.75, plain[-1]


def test_weight_col_weighs_the_held_out_rows_scores_too(tmp_path, caplog):
    """The held-out tail of a --data table is scored with its weights (its wrong rows, of weight 0, count for
    nothing); a --validation-data table with the weight column is too, one without it is scored unweighted."""
    data, clean = _half_wrong(tmp_path)
    flags = ("--data", data, "--steps", "300", "--lr", "0.05", "--weight-col", "w")
    code, records = _train(tmp_path, "tail", *flags)
    summary = records[-1]
    assert code == 0 and summary["validation_weight"] == 150  # the last 300 rows, every other one of weight 1
    assert summary["test_accuracy"] > 0.95, summary  # an unweighted score of these rows is near 0.5
    assert [r["test_accuracy"] for r in records if r["event"] == "eval"][-1] == summary["test_accuracy"]
    code, records = _train(tmp_path, "own", *flags, "--validation-data", data)
    assert code == 0 and records[-1]["validation_weight"] == 1500 and records[-1]["test_accuracy"] > 0.95
    with caplog.at_level("WARNING"):
        code, records = _train(tmp_path, "clean", *flags, "--validation-data", clean)
    assert code == 0 and records[-1]["validation_weight"] is None and records[-1]["test_accuracy"] > 0.95
    assert "has no weight column 'w': its rows are scored unweighted" in caplog.text
    code, records = _train(tmp_path, "plain", "--data", data, "--steps", "30", "--lr", "0.05")
    assert code == 0 and records[-1]["validation_weight"] is None


def test_a_weight_that_is_negative_null_or_not_finite_is_refused(tmp_path):
    for bad in (-1.0, None, float("nan"), float("inf")):
        weights = pa.array([1.0, 2.0, bad, 0.0])
        pq.write_table(pa.table({"features": pa.array([[0.0]] * 4), "label": [0, 1, 0, 1], "w": weights}),
                       tmp_path / "t.parquet")
        with pytest.raises(ValueError, match="1 rows have a null, NaN, infinite or negative sample weight"):
            _parquet.read_parquet_dataset(str(tmp_path / "t.parquet"), weight_col="w")


def test_named_columns_that_are_not_there_or_not_features_are_refused_by_name(tmp_path, caplog):
    x = _features(10, 5)
    pq.write_table(pa.table({"a": pa.array(x[:, 0]), "name": pa.array(["n"] * 10), "y": pa.array([0, 1] * 5)}),
                   tmp_path / "t.parquet")
    data = str(tmp_path / "t.parquet")
    with pytest.raises(ValueError, match="no column 'b' .* it needs 'a', 'b' .* and 'y'"):
        _parquet.read_parquet_dataset(data, ["a", "b"], "y")
    with pytest.raises(ValueError, match="type string; it must be an array of numbers .*feature column 'name'"):
        _parquet.read_parquet_dataset(data, ["a", "name"], "y")
    with pytest.raises(ValueError, match="name a column twice"):
        RunConfig(data=data, features_col="a,y", label_col="y")
    with pytest.raises(ValueError, match="name a column twice"):
        RunConfig(data=data, features_col="a", label_col="y", weight_col="a")
    for flags in ({"label_col": "y"}, {"weight_col": "w"}):
        with pytest.raises(ValueError, match="--weight-col name the columns of a --data table: give --data too"):
            RunConfig(**flags)
    with pytest.raises(ValueError, match="name columns, got 'a,', 'y' and None"):
        RunConfig(data=data, features_col="a,", label_col="y")
    with pytest.raises(ValueError, match="no weight column 'w'"):
        _parquet.read_parquet_dataset(data, "a", "y", weight_col="w")
    with pytest.raises(ValueError, match="weight column 'name' has type string; sample weights are numbers"):
        _parquet.read_parquet_dataset(data, "a", "y", weight_col="name")


def test_the_footers_of_a_local_table_say_its_rows_first_row_and_largest_values(tmp_path):
    """What a --data file:// table's footers say without a column decoded (Spark's jobs ask otherwise): its rows
    over every file, its first row, each column's largest value; nothing where a row group has values but no
    statistics of them, or the table is partitioned."""
    x = _features(30, 6)
    folder = tmp_path / "table"
    folder.mkdir()
    for part, (rows, labels) in enumerate([(slice(0, 10), [None] * 10), (slice(10, 30), [3, 7] * 10)]):
        pq.write_table(pa.table({"features": pa.array(list(x[rows]), pa.list_(pa.float32())),
                                 "label": pa.array(labels, pa.int64())}), folder / f"part-{part}.parquet")
    (folder / "_SUCCESS").write_text("")
    facts = _parquet.footer_facts(str(folder))
    assert facts.rows == 30 and facts.features == pytest.approx(list(x[0])) and facts.label is None
    assert facts.largest == {"features": pytest.approx(x.max()), "label": 7} and facts.spark_schema is None
    pq.write_table(pa.table({"features": pa.array(list(x), pa.list_(pa.float32())), "label": pa.array([1] * 30)}),
                   tmp_path / "bare.parquet", write_statistics=False)
    assert _parquet.footer_facts(str(tmp_path / "bare.parquet")).largest == {}  # Spark's jobs find them
    (tmp_path / "parted" / "day=1").mkdir(parents=True)
    (folder / "part-1.parquet").rename(tmp_path / "parted" / "day=1" / "part-1.parquet")
    assert _parquet.footer_facts(str(tmp_path / "parted")) is None
    assert _parquet.footer_facts(str(tmp_path / "none")) is None
