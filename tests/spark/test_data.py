"""Input kinds (array, ML vectors, binary images, RDDs) and bad input, checked before any training."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from _spark_testlib import blobs, mlp, module_session, partitioned_rdd
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer
from sparknet.spark import data as spark_data

pytestmark = pytest.mark.spark


# -- without Spark: the converters and the checks ------------------------------------------------
def test_arrow_lists_and_binary_rows_become_float_chunks():
    feats = pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], pa.list_(pa.float32()))
    batch = pa.RecordBatch.from_arrays([feats, pa.array([0.0, 2.0, 1.0])], names=["f", "y"])
    x, y, info = spark_data._arrow_batch(batch.slice(1, 2), "array", 2, None)
    assert x.tolist() == [[3.0, 4.0], [5.0, 6.0]] and y.tolist() == [2, 1] and info.rows == 2

    pixels = np.array([[0, 255, 51, 102], [255, 0, 0, 0]], np.uint8)
    raw = pa.array([r.tobytes() for r in pixels], pa.binary())
    x, _, info = spark_data._arrow_batch(pa.RecordBatch.from_arrays([raw, pa.array([1, 0])], names=["f", "y"]),
                                    "binary", 4, 4)
    assert np.allclose(x, pixels / 255.0) and info.bad_rows == 0
    floats = pa.array([np.arange(4, dtype="<f4").tobytes()], pa.binary())
    x, _, _ = spark_data._arrow_batch(pa.RecordBatch.from_arrays([floats, pa.array([1])], names=["f", "y"]), "binary", 4, 4)
    assert x.tolist() == [[0.0, 1.0, 2.0, 3.0]]


@pytest.mark.parametrize("float_labels, weighted", [(False, False), (True, False), (False, True)])
def test_chunks_made_where_they_are_used_equal_those_read_back_from_spark_s_rows(float_labels, weighted):
    """The stage jobs take ArrowChunks.chunks as they are made; Spark's rows of the same function, read back with
    frame_chunks, hold the same rows, labels and counts, a problem row among them."""
    feats = pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, float("nan")], [7.0, 8.0], [9.0]], pa.list_(pa.float32()))
    labels = pa.array([0, 2, 1, None, 1]) if not float_labels else pa.array([0.5, -1.0, 2.25, None, 1.0])
    columns = [feats, labels] + ([pa.array([1.0, 0.5, 2.0, 1.0, 1.0])] if weighted else [])
    batches = [pa.RecordBatch.from_arrays(columns, names=["f", "y", "w"][:len(columns)])]
    convert = spark_data.ArrowChunks("array", 2, None, "label", float_labels, weighted=weighted, chunk_bytes=16)
    direct = list(convert.chunks(batches))
    read_back = list(spark_data.frame_chunks(convert(batches), float_labels or weighted))
    assert len(direct) == len(read_back) == 3  # two rows of 8 bytes a chunk
    for (x, y, info), (rx, ry, rinfo) in zip(direct, read_back):
        assert x.dtype == rx.dtype == np.float32 and y.dtype == ry.dtype
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)
        assert info == rinfo
    assert sum(c.counts.nonfinite for c in direct) == 1 and sum(c.counts.bad_rows for c in direct) == 1


def test_row_problems_are_counted_not_raised_on_executors():
    feats = pa.array([[1.0, 2.0], [3.0], None, [float("nan"), 1.0]], pa.list_(pa.float32()))
    batch = pa.RecordBatch.from_arrays([feats, pa.array([0.5, None, 1.0, 7.0])], names=["f", "y"])
    _, _, info = spark_data._arrow_batch(batch, "array", 2, None)
    assert info.null_x == 1 and info.null_y == 1 and info.nonint_y == 1
    pairs = [(np.zeros(3), 1), (np.zeros(4), 2), ("text", 0), (np.ones(3), 2)]
    chunks = list(spark_data.pair_chunks(None)(pairs))
    x, y, info = spark_data.merge_chunks(chunks)
    assert info.bad_rows == 1 and info.not_pairs == 1 and x.shape == (2, 3) and y.tolist() == [1, 2]


@pytest.mark.parametrize("change, message", [
    ({"rows": 0, "y_min": None, "y_max": None}, "is empty"),
    ({"rows": 1}, "fewer than the 2 workers"),
    ({"bad_rows": 3, "lengths": [2, 3]}, "must hold 2 values"),
    ({"nonfinite": 2}, "NaN or infinite"),
    ({"nonint_y": 1}, "not whole numbers"),
    ({"y_max": 3}, r"labels range over \[0, 3\] but the net has 3 classes"),
    ({"null_y": 1}, "null label"),
])
def test_check_stats_says_what_is_wrong(change, message):
    stats = {**spark_data.ChunkCounts().to_dict(), "rows": 10, "lengths": [2], "y_min": 0, "y_max": 2, **change}
    with pytest.raises(ValueError, match=message):
        spark_data.check_stats([stats], what="training data", expected_len=2, num_classes=3, num_workers=2)


# -- on Spark -----------------------------------------------------------------------------------
spark = module_session("local[2]")


def _fit(data, *, image_shape=None, net=None, rounds=1, on_round=None, workers=2, **kw):
    trainer = SparkTrainer(net or mlp(), WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=4, seed=0),
                           DistributedConfig(workers=workers, tau=2, rounds=rounds), on_round=on_round)
    return trainer.fit(data, image_shape=image_shape, **kw)


def test_every_input_kind_trains_to_the_same_weights(spark):
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql import types as T

    x, y = blobs(16, seed=3)
    rows = [(x[i].tolist(), int(y[i])) for i in range(16)]
    halves = [rows[:8], rows[8:]]  # two partitions, kept as they are

    def df(schema, convert):
        rdd = spark.sparkContext.parallelize(halves, 2).flatMap(lambda part: part).map(convert)
        return spark.createDataFrame(rdd, schema)

    kinds = {
        "array<float>": df("features array<float>, label long", lambda r: (r[0], r[1])),
        "array<double> + double label": df("features array<double>, label double", lambda r: (r[0], float(r[1]))),
        "vector (dense and sparse)": df(T.StructType([T.StructField("features", VectorUDT()),
                                                       T.StructField("label", T.IntegerType())]), lambda r: (
            Vectors.dense(r[0]) if r[1] % 2 else Vectors.sparse(2, {i: v for i, v in enumerate(r[0]) if v}), r[1])),
        "binary float32": df("features binary, label long",
                             lambda r: (bytearray(np.asarray(r[0], "<f4").tobytes()), r[1])),
        "rdd": partitioned_rdd(spark.sparkContext, [(x[:8], y[:8]), (x[8:], y[8:])]),
    }
    weights = {}
    for name, data in kinds.items():
        res = _fit(data, image_shape=[2] if "binary" in name else None)
        assert res.summary["rows_per_partition"] == [8, 8], name
        weights[name] = res.weights.to_flat(torch.float32)
    ref = weights.pop("rdd")
    for name, w in weights.items():
        assert torch.allclose(w, ref, atol=1e-6), name


def test_a_flat_column_is_reshaped_for_a_conv_net_and_uneven_partitions_work(spark):
    torch.manual_seed(0)
    conv = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(2 * 2 * 2, 3))
    rng = np.random.default_rng(0)
    imgs = rng.random((12, 16), dtype=np.float32)
    labels = rng.integers(0, 3, 12)
    rdd = spark.sparkContext.parallelize([[(imgs[i], int(labels[i])) for i in range(9)],
                                          [(imgs[i], int(labels[i])) for i in range(9, 12)]], 2).flatMap(lambda p: p)
    res = _fit(rdd, image_shape=[1, 4, 4], net=conv)
    assert res.summary["sample_shape"] == [1, 4, 4] and res.summary["rows_per_partition"] == [9, 3]
    assert [w["samples"] for w in res.history[0]["per_worker"]] == [8, 6]  # batch 4 (and 3 rows, twice)


def test_an_empty_partition_sits_out(spark):
    x, y = blobs(10)
    rdd = partitioned_rdd(spark.sparkContext, [(x[:0], y[:0]), (x, y)])
    res = _fit(rdd, rounds=2)
    workers = res.history[-1]["per_worker"]
    assert workers[0].get("empty") and workers[0]["samples"] == 0 and workers[1]["samples"] == 8
    assert res.history[-1]["samples"] == 8 and res.history[-1]["bytes"] == 2 * res.weights.nbytes


@pytest.mark.parametrize("case, message", [
    ("missing column", "feature column 'features' not found"),
    ("string column", "has type string"),
    ("rows differ in length", "rows differ in length"),
    ("wrong length for the net", "must hold 2 values"),
    ("label out of range", r"labels range over \[0, 5\] but the net has 3 classes"),
    ("more workers than rows", "fewer than the 2 workers"),
    ("empty", "is empty"),
    ("nan features", "NaN or infinite"),
])
def test_bad_input_is_refused_before_any_training(spark, case, message):
    rows = {
        "missing column": ("x array<float>, label long", [([1.0, 2.0], 0)] * 4),
        "string column": ("features string, label long", [("1,2", 0)] * 4),
        "rows differ in length": ("features array<float>, label long", [([1.0, 2.0], 0)] * 3 + [([1.0, 2.0, 3.0], 1)]),
        "wrong length for the net": ("features array<float>, label long", [([1.0, 2.0, 3.0], 0)] * 4),
        "label out of range": ("features array<float>, label long", [([1.0, 2.0], 0)] * 3 + [([1.0, 2.0], 5)]),
        "more workers than rows": ("features array<float>, label long", [([1.0, 2.0], 0)]),
        "empty": ("features array<float>, label long", []),
        "nan features": ("features array<float>, label long", [([1.0, float("nan")], 0)] * 4),
    }[case]
    rounds = []
    with pytest.raises(ValueError, match=message):
        _fit(spark.createDataFrame(rows[1], rows[0]), on_round=rounds.append,
             image_shape=[2] if case == "wrong length for the net" else None)
    assert rounds == []


def test_rows_from_the_driver_are_shuffled_once_into_the_same_partitions(spark, tmp_path):
    """Rows handed to Spark by the driver live in the partition objects, and every task over them carries them: the
    rounds engine's job a round would ship the data each round. One shuffle keeps every row in its partition and
    order and ends that; data read from files, or already shuffled, is left as it is."""
    sc = spark.sparkContext
    local = sc.parallelize(list(range(40)), 2).map(lambda v: (v, v * v))  # (a range travels as its bounds only)
    assert spark_data.ships_local_data(local) and spark_data.ships_local_data(local.cache())  # a cache does not end the path
    cut = spark_data.without_local_data(local, 2)
    assert not spark_data.ships_local_data(cut)
    assert cut.glom().collect() == local.glom().collect()  # the same rows, partitions and order
    assert spark_data.without_local_data(local, 3) is local  # a split the caller makes itself (it shuffles anyway)
    shuffled = local.repartition(2)
    assert not spark_data.ships_local_data(shuffled) and spark_data.without_local_data(shuffled, 2) is shuffled
    path = str(tmp_path / "rows.txt")
    (tmp_path / "rows.txt").write_text("\n".join(map(str, range(10))))
    assert not spark_data.ships_local_data(sc.textFile(path, 2))
    frame = spark.createDataFrame([(float(i), i % 2) for i in range(8)], ["x", "label"])
    assert spark_data.ships_local_data(frame.rdd)  # a DataFrame of local rows too


def test_folding_partitions_deals_every_row_of_the_workers_that_left_to_those_left(spark):
    """The barrier engine's elastic restart: partition p's rows go to partition p % n, in order, none left out."""
    rdd = spark.sparkContext.parallelize(range(40), 4).map(lambda v: (v, -v))
    parts = rdd.glom().collect()
    assert spark_data.folded(rdd, 2).glom().collect() == [parts[0] + parts[2], parts[1] + parts[3]]
    assert spark_data.folded(rdd, 3).glom().collect() == [parts[0] + parts[3], parts[1], parts[2]]
    assert spark_data.folded(rdd, 1).glom().collect() == [sum(parts, [])]
    assert spark_data.folded(rdd, 4).glom().collect() == parts


def test_a_dealt_data_set_gives_partition_k_rows_k_k_plus_K_and_so_on(spark, tmp_path, monkeypatch):
    """``sparknet train``'s data set on a local master: written once as two ``.npy`` files, then partition k of K
    holds rows k, k + K, ... in order, read by its own task (``hand``) or through the JVM, none left out; a block
    boundary (``DEAL_BLOCK_ROWS``) inside a partition changes nothing. (Sequences: ``test_sequences_spark``.)"""
    from sparknet.datasets import ArrayDataset
    from sparknet.spark import run

    monkeypatch.setenv("SPARKNET_CACHE", str(tmp_path))
    monkeypatch.setattr(run, "DEAL_BLOCK_ROWS", 16)
    rng = np.random.default_rng(3)
    x, y = rng.random((101, 1, 3, 3), dtype=np.float32), rng.integers(0, 10, 101)
    flat = x.reshape(len(x), -1)
    for k_total in (1, 3, 7):
        dealt = run.dataset_frame(spark, "images", ArrayDataset(x, y), partitions=k_total)
        assert dealt.partitions == k_total and dealt.rows == 101 and "frame" not in vars(dealt)  # none made yet
        through_the_jvm = dealt.frame.rdd.glom().collect()
        assert dealt.frame is dealt.frame  # made once
        for k in range(k_total):
            hand = pa.Table.from_batches(list(dealt.hand(k)))
            assert hand.column("features").to_pylist() == flat[k::k_total].tolist()
            assert hand.column("label").to_pylist() == y[k::k_total].tolist()
            assert [list(r.features) for r in through_the_jvm[k]] == hand.column("features").to_pylist()
    assert sorted(p.name for p in (tmp_path / "arrays").iterdir()) == [
        "images-train-101-1x3x3.features.npy", "images-train-101-1x3x3.label.npy"]
