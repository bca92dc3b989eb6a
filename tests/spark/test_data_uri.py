"""``sparknet train --data URI`` on Spark (local[2]): a table named by a URI is read by Spark's workers where it
lives, never through the driver; its held-out rows are ``--validation-data``'s, or a seeded sample of its own."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from _spark_testlib import blobs, module_session
from sparknet import _parquet
from sparknet.cli import main
from sparknet.model_io import load_model

pytestmark = pytest.mark.spark

spark = module_session("local[2]")


def _table(path, x, y, *, columns=("features", "label")) -> str:
    pq.write_table(pa.table({columns[0]: pa.array(list(x), pa.list_(pa.float32())), columns[1]: pa.array(y)}),
                   path)
    return path.as_uri()  # file:///...


def _train(tmp_path, name: str, *flags: str) -> tuple[int, dict]:
    metrics = tmp_path / f"{name}.jsonl"
    code = main(["train", "--model", "mlp", "--workers", "2", "--tau", "10", "--rounds", "3", "--batch-size", "16",
                 "--lr", "0.05", "--metrics-out", str(metrics), "--quiet", *flags])
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return code, records[-1] if records else {}


def test_a_table_named_by_a_uri_trains_where_it_lives_and_holds_out_a_seeded_sample(spark, tmp_path, monkeypatch):
    x, y = blobs(400, seed=2)
    uri = _table(tmp_path / "blobs.parquet", x, y)

    def driver_read(*args, **kwargs):
        raise AssertionError("the driver read the table")

    monkeypatch.setattr(_parquet, "_read_arrays", driver_read)
    code, first = _train(tmp_path, "first", "--data", uri, "--model-dir", str(tmp_path / "model"))
    assert code == 0 and first["event"] == "summary" and first["dataset"] == uri
    from pyspark.sql import functions as F

    # a row is held out where a hash of seed 0 and its values falls in the first tenth of a million buckets
    bucket = F.pmod(F.xxhash64(F.lit(0), "features", "label"), F.lit(1_000_000))
    held = spark.read.parquet(uri).filter(bucket < 100_000)
    assert first["data_rows"] == 400 - held.count() < 400 and first["test_accuracy"] > 0.8
    held_x = np.array([r.features for r in held.collect()], np.float32)
    held_y = np.array([r.label for r in held.collect()])
    scored = load_model(tmp_path / "model").net.evaluate((held_x, held_y)).accuracy
    assert scored == pytest.approx(first["test_accuracy"], abs=1e-6)  # the summary scored the held-out sample
    _, again = _train(tmp_path, "again", "--data", uri)
    assert again["test_loss"] == first["test_loss"]  # the same sample, the same weights


def test_held_out_rows_of_their_own_and_tables_that_cannot_train_say_so(spark, tmp_path, caplog):
    x, y = blobs(300, seed=3)
    uri = _table(tmp_path / "train.parquet", x, y)
    held = _table(tmp_path / "held.parquet", *blobs(90, seed=4))
    code, summary = _train(tmp_path, "held", "--data", uri, "--validation-data", held)
    assert code == 0 and summary["data_rows"] == 300 and summary["test_accuracy"] > 0.8  # every row trains
    assert _train(tmp_path, "none", "--data", (tmp_path / "none.parquet").as_uri())[0] == 2
    assert "--data file://" in caplog.text and "Spark cannot read it as Parquet" in caplog.text
    unlabelled = _table(tmp_path / "unlabelled.parquet", x, y, columns=("features", "target"))
    assert _train(tmp_path, "unlabelled", "--data", unlabelled)[0] == 2
    assert "has no 'label' column (its columns: features, target)" in caplog.text
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"features": pa.array(list(x), pa.list_(pa.float32())),
                             "label": pa.array([None] * len(x), pa.int64())}), nulls)
    assert _train(tmp_path, "nulls", "--data", nulls.as_uri())[0] == 2
    assert "every row's label is null" in caplog.text


def test_a_sequence_table_named_by_a_uri_trains_a_character_model(spark, tmp_path):
    """Token sequences (features and labels ``array<long>``): the vocabulary is the largest id of either column."""
    from sparknet.datasets import synthetic_sequences

    data = synthetic_sequences(300, seq_len=12, vocab_size=9, seed=0)
    x, y = np.asarray(data.x, np.int64), np.asarray(data.y, np.int64)
    path = tmp_path / "sequences.parquet"
    pq.write_table(pa.table({"features": pa.array(list(x), pa.list_(pa.int64())),
                             "label": pa.array(list(y), pa.list_(pa.int64()))}), path)
    metrics = tmp_path / "m.jsonl"
    assert main(["train", "--model", "char_lstm", "--data", path.as_uri(), "--workers", "2", "--tau", "5",
                 "--steps", "10", "--batch-size", "16", "--metrics-out", str(metrics), "--quiet"]) == 0
    summary = json.loads(metrics.read_text().splitlines()[-1])
    assert summary["num_classes"] == max(x.max(), y.max()) + 1 and summary["sample_shape"] == [12]


def test_a_local_table_s_footers_spare_the_jobs_that_read_its_first_row_and_labels(spark, tmp_path, monkeypatch):
    """A file:// table's rows, first row and largest label come from its footers, with no Spark job; a table whose
    footers hold no statistics is asked by Spark's jobs, and trains the same."""
    from pyspark.sql.classic.dataframe import DataFrame

    x, y = blobs(400, seed=6)
    bare = tmp_path / "bare.parquet"
    pq.write_table(pa.table({"features": pa.array(list(x), pa.list_(pa.float32())), "label": pa.array(y)}), bare,
                   write_statistics=False)
    code, asked = _train(tmp_path, "asked", "--data", bare.as_uri())
    assert code == 0

    def no_job(*args, **kwargs):
        raise AssertionError("a Spark job read what the footers say")

    monkeypatch.setattr(DataFrame, "head", no_job)
    monkeypatch.setattr(DataFrame, "agg", no_job)
    code, read = _train(tmp_path, "read", "--data", _table(tmp_path / "stats.parquet", x, y))
    assert code == 0 and read["num_classes"] == asked["num_classes"] == 3
    assert read["data_rows"] == asked["data_rows"] and read["test_loss"] == asked["test_loss"]
