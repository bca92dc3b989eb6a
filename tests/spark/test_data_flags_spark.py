"""``sparknet train --data``'s flags on Spark (local[2]): ``--task``'s numbers and label sets train an mlp on the
rounds engine (a URI read where it lives; a path dealt from the driver's files) and on the parameter server;
``--features-col``/``--label-col`` name a table's own columns, ``--weight-col`` its rows' sample weights (a path's
rows travel through Spark with them, a URI's are read where they live; the parameter server's workers weigh them
too); ``sparknet predict`` scores each saved model
as its task says, on the columns it trained on."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from _spark_testlib import blobs, module_session, regression_table
from sparknet.cli import main
from sparknet.labels import Task
from sparknet.model_io import load_model

pytestmark = pytest.mark.spark

spark = module_session("local[2]")


def _write(path, x, y) -> str:
    label = pa.array(list(y), pa.list_(pa.from_numpy_dtype(y.dtype))) if y.ndim == 2 else pa.array(y)
    pq.write_table(pa.table({"features": pa.array(list(x), pa.list_(pa.float32())), "label": label}), path)
    return str(path)


def _train(tmp_path, name: str, *flags: str) -> tuple[int, dict]:
    metrics = tmp_path / f"{name}.jsonl"
    code = main(["train", "--model", "mlp", "--workers", "2", "--batch-size", "32", "--metrics-out", str(metrics),
                 "--quiet", *flags])
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return code, records[-1] if records else {}


def _label_sets(x: np.ndarray) -> np.ndarray:
    return np.stack([x[:, 0] > 0, x[:, 1] + x[:, 2] > 0, x[:, 3] > 0.5], axis=1).astype(np.int64)


def test_numbers_named_by_a_uri_train_where_they_live_and_predict_scores_them_as_numbers(spark, tmp_path):
    x, y = regression_table(2400, outputs=2, seed=0)
    uri = (tmp_path / "numbers.parquet").as_uri()
    _write(tmp_path / "numbers.parquet", x, y)
    code, summary = _train(tmp_path, "uri", "--data", uri, "--task", "regression", "--tau", "25", "--rounds", "12",
                           "--lr", "0.02", "--model-dir", str(tmp_path / "model"))
    assert code == 0 and summary["test_accuracy"] is None and summary["test_r2"] > 0.95, summary
    assert summary["data_rows"] < 2400  # a seeded sample held out
    assert load_model(tmp_path / "model").net.task is Task.REGRESSION
    vx, vy = regression_table(200, outputs=2, seed=1)
    _write(tmp_path / "new.parquet", vx, vy)
    assert main(["predict", "--model-dir", str(tmp_path / "model"), "--data", str(tmp_path / "new.parquet"),
                 "--out", str(tmp_path / "scored")]) == 0
    scored = pq.read_table(tmp_path / "scored")
    assert "probability" not in scored.column_names
    prediction = np.array(scored.column("prediction").to_pylist())
    order = np.argsort(np.array(scored.column("features").to_pylist())[:, 0])  # rows come back in any order
    truth = vy[np.argsort(vx[:, 0])]
    r2 = 1 - ((prediction[order] - truth) ** 2).sum() / ((truth - truth.mean(0)) ** 2).sum()
    assert prediction.shape == (200, 2) and r2 > 0.9


def test_label_sets_of_a_path_are_dealt_as_floats_and_predict_gives_each_row_s_labels(spark, tmp_path):
    x = np.random.default_rng(2).normal(size=(3000, 6)).astype(np.float32)
    data = _write(tmp_path / "sets.parquet", x, _label_sets(x))
    code, summary = _train(tmp_path, "path", "--data", data, "--task", "multilabel", "--tau", "25", "--rounds", "12",
                           "--lr", "0.1", "--model-dir", str(tmp_path / "model"))
    assert code == 0 and summary["test_accuracy"] > 0.93 and summary["test_f1"] > 0.9, summary
    assert summary["data_rows"] == 2700  # the last tenth tests
    vx = np.random.default_rng(3).normal(size=(200, 6)).astype(np.float32)
    _write(tmp_path / "new.parquet", vx, _label_sets(vx))
    assert main(["predict", "--model-dir", str(tmp_path / "model"), "--data", str(tmp_path / "new.parquet"),
                 "--out", str(tmp_path / "scored")]) == 0
    scored = pq.read_table(tmp_path / "scored").to_pydict()
    right = [set(map(int, p)) == set(np.flatnonzero(s)) for p, s in zip(scored["prediction"], scored["label"])]
    assert np.mean(right) > 0.8  # every label of the row right


def test_the_parameter_server_trains_numbers_and_reports_their_scores(spark, tmp_path):
    x, y = regression_table(1600, seed=4)
    data = _write(tmp_path / "numbers.parquet", x, y)
    code, summary = _train(tmp_path, "ps", "--data", data, "--task", "regression", "--strategy", "async",
                           "--epochs", "8", "--tau", "5", "--lr", "0.02", "--momentum", "0.5")  # see the README
    assert code == 0 and summary["engine"] == "ps" and summary["test_accuracy"] is None
    assert summary["test_r2"] > 0.95 and summary["test_rmse"] > 0, summary


def test_a_table_s_own_columns_named_by_a_uri_train_and_predict_reads_the_same_columns(spark, tmp_path):
    x, y = blobs(600, seed=5)
    table = pa.table({"width": pa.array(x[:, 0]), "height": pa.array(x[:, 1].astype(np.float64)),
                      "kind": pa.array(y), "sparknet_features": pa.array(["mine"] * len(x))})
    pq.write_table(table, tmp_path / "wide.parquet")
    uri = (tmp_path / "wide.parquet").as_uri()
    code, summary = _train(tmp_path, "wide", "--data", uri, "--features-col", "width,height", "--label-col", "kind",
                           "--tau", "10", "--rounds", "6", "--lr", "0.05", "--model-dir", str(tmp_path / "model"))
    assert code == 0 and summary["test_accuracy"] > 0.85 and summary["sample_shape"] == [2], summary
    assert main(["predict", "--model-dir", str(tmp_path / "model"), "--data", str(tmp_path / "wide.parquet"),
                 "--out", str(tmp_path / "scored")]) == 0  # the model's own columns, joined again
    scored = pq.read_table(tmp_path / "scored")
    # the joined columns' scratch column is not written, and the data's own column of that name comes back as it was
    assert scored.column_names == [*table.column_names, "prediction", "probability"] and scored.num_rows == 600
    assert set(scored.column("sparknet_features").to_pylist()) == {"mine"}
    right = np.array(scored.column("prediction").to_pylist()) == np.array(scored.column("kind").to_pylist())
    assert right.mean() > 0.85
    assert main(["predict", "--model-dir", str(tmp_path / "model"), "--data", str(tmp_path / "wide.parquet"),
                 "--out", str(tmp_path / "again"), "--features-col", "width"]) == 2  # one column: not the net's


@pytest.mark.parametrize("where, road", [("path", ("--engine", "barrier", "--rounds", "4")),
                                         ("uri", ("--engine", "rounds", "--rounds", "4")),
                                         ("path", ("--strategy", "async", "--epochs", "2"))],
                         ids=["path-barrier", "uri-rounds", "path-async"])
def test_weight_col_weighs_each_row_on_both_engines_and_the_parameter_server(spark, tmp_path, where, road, caplog):
    """Training and held-out rows alike: every other row holds the wrong class at weight 0, so a net trained
    unweighted learns 50%, and held-out rows scored unweighted would score near 50% whatever the net. Held-out rows
    without the weight column are scored unweighted, and the fit says so."""
    def table(name, seed, rows, weighted=True):
        x = np.random.default_rng(seed).normal(size=(rows, 6)).astype(np.float32)
        right = (x[:, 0] > 0).astype(np.int64)
        wrong = np.arange(len(x)) % 2 == 1
        columns = {"features": pa.array(list(x), pa.list_(pa.float32())),
                   "label": np.where(wrong, 1 - right, right), "w": np.where(wrong, 0, 2)}
        if not weighted:  # the right classes, no weights
            columns = {"features": columns["features"], "label": right}
        pq.write_table(pa.table(columns), tmp_path / f"{name}.parquet")
        path = tmp_path / f"{name}.parquet"
        return path.as_uri() if where == "uri" else str(path)

    data, held = table("t", 7, 3000), table("held", 8, 400)
    code, summary = _train(tmp_path, where, "--data", data, "--validation-data", held, *road, "--weight-col", "w",
                           "--tau", "50", "--lr", "0.05")
    assert code == 0 and summary["test_accuracy"] > 0.95 and summary["validation_weight"] == 400, summary
    assert summary["test_f1"] > 0.95 and summary["test_weighted_precision"] > 0.95, summary  # the barrier's shards too
    if where == "uri":
        with caplog.at_level("WARNING"):
            code, summary = _train(tmp_path, "clean", "--data", data, "--validation-data",
                                   table("clean", 9, 200, weighted=False), "--engine", "rounds", "--rounds", "2",
                                   "--weight-col", "w", "--tau", "50", "--lr", "0.05")
        assert code == 0 and summary["validation_weight"] is None and summary["test_accuracy"] > 0.9, summary
        assert "clean.parquet has no weight column 'w': its rows are scored unweighted" in caplog.text


def test_several_label_columns_of_a_uri_are_one_array_of_numbers_a_row(spark, tmp_path):
    x, y = regression_table(2400, outputs=2, seed=0)
    pq.write_table(pa.table({"features": pa.array(list(x), pa.list_(pa.float32())), "p": y[:, 0], "q": y[:, 1]}),
                   tmp_path / "t.parquet")
    code, summary = _train(tmp_path, "uri", "--data", (tmp_path / "t.parquet").as_uri(), "--label-col", "p,q",
                           "--task", "regression", "--tau", "25", "--rounds", "12", "--lr", "0.02")
    assert code == 0 and summary["test_r2"] > 0.95, summary


def test_evaluate_gives_a_saved_model_s_test_scores_again_on_its_held_out_rows(spark, tmp_path, capsys):
    x, y = regression_table(2000, outputs=2, seed=0)
    pq.write_table(pa.table({"features": pa.array(list(x), pa.list_(pa.float32())), "p": y[:, 0], "q": y[:, 1]}),
                   tmp_path / "t.parquet")
    vx, vy = regression_table(300, outputs=2, seed=1)
    pq.write_table(pa.table({"features": pa.array(list(vx), pa.list_(pa.float32())), "p": vy[:, 0], "q": vy[:, 1]}),
                   tmp_path / "v.parquet")
    code, summary = _train(tmp_path, "run", "--data", str(tmp_path / "t.parquet"), "--validation-data",
                           str(tmp_path / "v.parquet"), "--label-col", "p,q", "--task", "regression", "--tau", "25",
                           "--rounds", "4", "--lr", "0.02", "--model-dir", str(tmp_path / "model"))
    assert code == 0
    capsys.readouterr()
    assert main(["evaluate", "--model-dir", str(tmp_path / "model"), "--data", str(tmp_path / "v.parquet")]) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the label columns: the model's own
    assert metrics["rows"] == 300
    for name in ("loss", "r2", "rmse", "mae"):
        assert metrics[name] == pytest.approx(summary[f"test_{name}"], rel=1e-5), (name, metrics, summary)
    # --weight-col: a row of weight w scores as w copies of it (whole numbers here, so the copies can be written)
    w = np.arange(300) % 3
    pq.write_table(pa.table({"features": pa.array(list(vx), pa.list_(pa.float32())), "p": vy[:, 0], "q": vy[:, 1],
                             "w": w}), tmp_path / "vw.parquet")
    rows = np.repeat(np.arange(300), w)
    pq.write_table(pa.table({"features": pa.array(list(vx[rows]), pa.list_(pa.float32())), "p": vy[rows, 0],
                             "q": vy[rows, 1]}), tmp_path / "copies.parquet")
    scores = []
    for data, flags in (("vw", ["--weight-col", "w"]), ("copies", [])):
        assert main(["evaluate", "--model-dir", str(tmp_path / "model"), "--data", str(tmp_path / f"{data}.parquet"),
                     *flags]) == 0
        scores.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    weighted, copies = scores
    assert weighted["rows"] == 300 and weighted["weight"] == copies["rows"] == w.sum() and "weight" not in copies
    for name in ("loss", "r2", "rmse", "mae"):
        assert weighted[name] == pytest.approx(copies[name], rel=1e-6), (name, weighted, copies)
    assert weighted["rmse"] != pytest.approx(metrics["rmse"], rel=1e-4)


def test_a_model_of_one_number_column_scores_that_column(spark, tmp_path):
    a = np.random.default_rng(4).normal(size=600)
    pq.write_table(pa.table({"a": a, "label": (a > 0).astype(np.int64)}), tmp_path / "one.parquet")
    data = str(tmp_path / "one.parquet")
    assert main(["train", "--data", data, "--features-col", "a", "--model", "mlp", "--steps", "200", "--quiet",
                 "--model-dir", str(tmp_path / "model")]) == 0  # one process
    assert main(["predict", "--model-dir", str(tmp_path / "model"), "--data", data, "--out",
                 str(tmp_path / "scored")]) == 0  # before: refused, a number column taken for a features vector
    scored = pq.read_table(tmp_path / "scored").to_pandas()
    assert (scored["prediction"] == scored["label"]).mean() > 0.95
