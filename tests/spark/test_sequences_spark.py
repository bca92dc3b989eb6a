"""Sequence models (one label per position) through the Spark engines: Parquet, DataFrames, RDDs, checks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from _spark_testlib import module_session
from sparknet import zoo
from sparknet._parquet import read_parquet_dataset
from sparknet.config import DistributedConfig, RunConfig, WorkerConfig
from sparknet.datasets import synthetic_sequences
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer
from sparknet.spark import data as spark_data
from sparknet.spark.run import dataset_as_parquet, dataset_frame, train_distributed

pytestmark = pytest.mark.spark

T, V = 12, 8  # positions per sequence, vocabulary


def char_net():
    return zoo.char_lstm(vocab_size=V, seq_len=T, hidden=16, num_layers=1, batch_size=16)


def sequence_frame(spark, x: np.ndarray, y: list) -> object:
    rows = [(a.astype(float).tolist(), list(map(int, b))) for a, b in zip(x, y)]
    return spark.createDataFrame(rows, "features array<double>, label array<long>")


# -- without Spark: the converters and the checks ------------------------------------------------
def test_arrow_list_labels_become_one_label_per_position():
    feats = pa.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 0.0, 1.0]], pa.list_(pa.float32()))
    labels = pa.array([[2, 3, 4], [5, 6, 7], [0, 1, 2]], pa.list_(pa.int64()))
    x, y, info = spark_data._arrow_batch(pa.RecordBatch.from_arrays([feats, labels], names=["f", "y"]).slice(1, 2),
                                    "array", 3, None)
    assert y.shape == (2, 3) and y.tolist() == [[5, 6, 7], [0, 1, 2]] and x.shape == (2, 3)
    assert info.label_lengths == [3] and (info.y_min, info.y_max) == (0, 7)

    ragged = pa.array([[1, 2, 3], [1, 2], [1, 2, 3]], pa.list_(pa.int64()))
    _, y, info = spark_data._arrow_batch(pa.RecordBatch.from_arrays([feats, ragged], names=["f", "y"]), "array", 3, None)
    assert len(y) == 0 and info.bad_labels == 1 and sorted(info.label_lengths) == [2, 3]
    holes = pa.array([[1, None, 3], None, [1, 2, 3]], pa.list_(pa.int64()))
    _, _, info = spark_data._arrow_batch(pa.RecordBatch.from_arrays([feats, holes], names=["f", "y"]), "array", 3, None)
    assert info.null_y == 1


def test_pairs_with_array_labels_keep_their_positions():
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    pairs = [(x[0], np.array([1, 2, 3])), (x[1], [4, 5, 6]), (x[2], np.array([1, 2])), (x[3], np.array([0, 0, 7]))]
    out, y, info = spark_data.merge_chunks(list(spark_data.pair_chunks(None, chunk_rows=2)(pairs)))
    assert y.tolist() == [[1, 2, 3], [4, 5, 6], [0, 0, 7]] and out.shape == (3, 3)
    assert info.bad_labels == 1 and info.y_max == 7


@pytest.mark.parametrize("change, sample_shape, message", [
    ({"y_max": 11}, (T,), r"labels range over \[0, 11\] but the net has 8 classes \(labels must be 0\.\.7\); "
                          r"check column 'label' \(one label per position; a sequence model's classes are its "
                          r"vocabulary"),
    ({"label_lengths": [11]}, (T,), r"labels in column 'label' hold 11 ids per row but the features have 12 positions"),
    ({"label_lengths": [11, 12], "bad_labels": 3}, None, r"labels in column 'label' differ in length .*3 rows"),
    ({"label_lengths": [0, 12]}, None, r"rows hold one class id, 12 per-position ids"),
])
def test_check_stats_says_what_is_wrong_with_sequence_labels(change, sample_shape, message):
    stats = {**spark_data.ChunkCounts().to_dict(), "rows": 10, "lengths": [T], "label_lengths": [T], "y_min": 0, "y_max": V - 1,
             "label_col": "label", **change}
    with pytest.raises(ValueError, match=message):
        spark_data.check_stats([stats], what="training data", expected_len=T, num_classes=V, sample_shape=sample_shape)
    ok = {**stats, "y_max": V - 1, "label_lengths": [T], "bad_labels": 0}
    assert spark_data.check_stats([ok], what="training data", expected_len=T, num_classes=V,
                             sample_shape=(T,))["label_width"] == T


def test_parquet_reader_sizes_a_char_model_from_the_ids(tmp_path):
    data = synthetic_sequences(40, seq_len=T, vocab_size=V, seed=0)
    path = dataset_as_parquet(data, tmp_path / "seq.parquet")
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    label_type = schema.field("label").type
    assert pa.types.is_list(label_type) and label_type.value_type == pa.int64()
    train, test, info = read_parquet_dataset(str(path))
    assert train.y.shape == (36, T) and test.y.shape == (4, T)
    assert np.array_equal(np.concatenate([train.y, test.y]), data.y)
    assert (info["vocab_size"], info["seq_len"], info["num_classes"]) == (V, T, V)

    short = pa.table({"features": pa.array(data.x[:3].tolist()), "label": pa.array(data.y[:3, :-1].tolist())})
    pq.write_table(short, tmp_path / "short.parquet")
    with pytest.raises(ValueError, match=f"holds {T - 1} ids per row but the features hold {T} values"):
        read_parquet_dataset(str(tmp_path / "short.parquet"))


# -- on Spark ------------------------------------------------------------------------------------
spark = module_session("local[2]")


def test_a_data_sets_parquet_is_read_with_the_schema_its_footer_holds(spark, tmp_path, monkeypatch):
    """``dataset_frame`` gives ``spark.read`` the schema it would infer (no job reads the footer): the same columns,
    sequence labels as arrays of longs, and the same rows."""
    monkeypatch.setenv("SPARKNET_CACHE", str(tmp_path))
    data = synthetic_sequences(40, seq_len=T, vocab_size=V, seed=0)
    frame = dataset_frame(spark, "seq", data)
    path = next((tmp_path / "parquet").glob("seq-train-40-*.parquet"))
    inferred = spark.read.parquet(str(path))
    assert frame.schema == inferred.schema
    assert sorted(map(tuple, frame.collect())) == sorted(map(tuple, inferred.collect()))


def test_a_data_set_in_k_partitions_is_dealt_out_row_by_row(spark, tmp_path, monkeypatch):
    """``dataset_frame(..., partitions=K)``: K partitions, the k-th rows k, k + K, ... of the data set in order, across
    the blocks its task copies out (4,096 rows here, so the deal goes on from one block into the next); the schema of
    the same data set's Parquet, which ``dataset_frame`` without partitions reads."""
    from sparknet.spark import run

    monkeypatch.setenv("SPARKNET_CACHE", str(tmp_path))
    monkeypatch.setattr(run, "DEAL_BLOCK_ROWS", 4096)
    data = synthetic_sequences(20_000, seq_len=T, vocab_size=V, seed=0)
    frame = dataset_frame(spark, "seq", data, partitions=3).frame
    assert frame.schema == dataset_frame(spark, "seq", data).schema and frame.rdd.getNumPartitions() == 3
    parts = frame.rdd.glom().map(lambda rows: [(list(r.features), list(r.label)) for r in rows]).collect()
    assert [len(p) for p in parts] == [6667, 6667, 6666]
    for k, part in enumerate(parts):
        assert np.array_equal(np.array([f for f, _ in part]), data.x[k::3])
        assert np.array_equal(np.array([y for _, y in part]), data.y[k::3])


@pytest.mark.parametrize("engine", ["rounds", "barrier"])
def test_both_engines_train_a_char_model_from_parquet(spark, tmp_path, engine):
    train = synthetic_sequences(256, seq_len=T, vocab_size=V, seed=0)
    val = synthetic_sequences(64, seq_len=T, vocab_size=V, seed=1)
    df = spark.read.parquet(str(dataset_as_parquet(train, tmp_path / "train.parquet")))
    trainer = SparkTrainer(char_net(), WorkerConfig(solver=SolverConfig(base_lr=0.05), batch_size=16), spark=spark,
                           dist=DistributedConfig(workers=2, tau=15, rounds=4, engine=engine))
    result = trainer.fit(df, validation=val)
    losses = [h["loss"] for h in result.history if h.get("event") == "round"]
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0]
    summary = result.summary
    assert summary["data_rows"] == 256 and summary["sample_shape"] == [T]
    assert summary["test_accuracy"] > 0.5  # chance is 1/8; the rule is learnable to about 0.9
    # accuracy is per position: the share of the 64 x 12 next tokens the final weights get right
    pred = result.net.predict(val.x.astype(np.float32)).argmax(-1).numpy()
    assert summary["test_accuracy"] == pytest.approx(float((pred == val.y).mean()))


def test_rdd_of_sequence_pairs_validated_on_a_dataframe(spark):
    train = synthetic_sequences(192, seq_len=T, vocab_size=V, seed=2)
    val = synthetic_sequences(48, seq_len=T, vocab_size=V, seed=3)
    rdd = spark.sparkContext.parallelize(list(zip(train.x, train.y)), 3)
    trainer = SparkTrainer(char_net(), WorkerConfig(solver=SolverConfig(base_lr=0.05), batch_size=16), spark=spark,
                           dist=DistributedConfig(workers=2, tau=15, rounds=3))
    result = trainer.fit(rdd, validation=sequence_frame(spark, val.x, val.y))
    rows = result.summary["rows_per_partition"]
    assert sum(rows) == 192 and min(rows) > 0 and result.summary["input"] == "RDD of (features, label)"
    assert result.summary["test_accuracy"] > 0.4
    with torch.no_grad():
        loss = result.net.evaluate((val.x.astype(np.float32), val.y)).loss
    assert result.summary["test_loss"] == pytest.approx(loss)


def test_a_label_outside_the_vocabulary_names_the_column_and_the_range(spark):
    data = synthetic_sequences(20, seq_len=T, vocab_size=V, seed=4)
    y = data.y.copy()
    y[7, 3] = 11
    df = sequence_frame(spark, data.x, y).withColumnRenamed("label", "next_chars")
    with pytest.raises(ValueError, match=r"labels range over \[0, 11\] but the net has 8 classes \(labels must be "
                                         r"0\.\.7\); check column 'next_chars' \(one label per position"):
        spark_data.collect_arrays(df, features_col="features", label_col="next_chars", image_shape=None, expected_len=T,
                             num_classes=V, sample_shape=(T,))
    # through fit: the class count is the net's vocabulary (its [N, T, V] output), refused before any round
    rounds = []
    trainer = SparkTrainer(char_net(), WorkerConfig(batch_size=8), spark=spark, on_round=rounds.append,
                           dist=DistributedConfig(workers=2, tau=2, rounds=1))
    with pytest.raises(ValueError, match=r"labels range over \[0, 11\] but the net has 8 classes"):
        trainer.fit(df, label_col="next_chars")
    assert rounds == []


def test_label_length_that_does_not_fit_is_refused_before_training(spark):
    data = synthetic_sequences(20, seq_len=T, vocab_size=V, seed=5)
    trainer = SparkTrainer(char_net(), WorkerConfig(batch_size=16), DistributedConfig(workers=2, tau=2, rounds=1), spark=spark)
    short = sequence_frame(spark, data.x, data.y[:, :-1])
    with pytest.raises(ValueError, match=f"labels in column 'label' hold {T - 1} ids per row but the features have "
                                         f"{T} positions"):
        trainer.fit(short)
    ragged = [row if i != 5 else row[:4] for i, row in enumerate(data.y.tolist())]
    with pytest.raises(ValueError, match=r"labels in column 'label' differ in length .*1 rows do not fit"):
        trainer.fit(sequence_frame(spark, data.x, ragged))
    with pytest.raises(ValueError, match="labels hold 11 ids per row but the features have 12 positions"):
        trainer.fit(spark.sparkContext.parallelize([(a, b[:-1]) for a, b in zip(data.x, data.y)], 2))


def test_command_line_data_path_trains_a_char_model(spark, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKNET_CACHE", str(tmp_path / "cache"))
    data = synthetic_sequences(300, seq_len=T, vocab_size=V, seed=6)
    path = dataset_as_parquet(data, tmp_path / "chars.parquet")
    run = RunConfig(model="char_lstm", data=str(path), steps=12, batch_size=16, lr=0.05, quiet=True, threads=1)
    summary = train_distributed(run, DistributedConfig(workers=2, tau=6, master="local[2]"))
    # the engines train on the rows one process trains on: the last 10% of --data is the test set
    assert summary["steps"] == 12 and summary["data_rows"] == 270 and summary["sample_shape"] == [T]
    assert summary["test_accuracy"] > 1.5 / V  # per position; chance is 1/8
    assert summary["test_loss"] < np.log(V)  # cross entropy per position: about ln 8 untrained
