"""Extended MNIST made on Spark executors (local[2]): written as Parquet, the same bytes however partitioned,
read back and trained on as binary images."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from _spark_testlib import module_session
from sparknet import cli
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.datasets import (IDX_ENV, IMAGE_SHAPE, extended_arrays, extended_mnist, extended_samples, mnist_small,
                               write_extended_mnist)
from sparknet.datasets._extended_write import base_digits
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer
from sparknet.spark import data as spark_data

pytestmark = pytest.mark.spark

spark = module_session("local[2]")

SAMPLES = 4000
SEED = 5


@pytest.fixture(scope="module")
def small():
    """MNIST's 5,000-digit subset: 4,000 base digits to deform, 1,000 real digits to test on."""
    return mnist_small()


@pytest.fixture(scope="module")
def written(spark, small, tmp_path_factory):
    path = tmp_path_factory.mktemp("emnist") / "three"
    return write_extended_mnist(spark, path, SAMPLES, seed=SEED, num_partitions=3, base=small.train)


def _by_index(df) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    table = df.toArrow().sort_by("index")
    pixels = np.frombuffer(b"".join(table.column("features").to_pylist()), np.uint8).reshape(-1, 28, 28)
    return table.column("index").to_numpy(), pixels, table.column("label").to_numpy()


def test_the_rows_are_the_samples_of_the_seed(spark, small, written):
    assert written.rows == SAMPLES and written.partitions == 3 and written.bytes > 0
    df = extended_mnist(spark, written.path)
    assert [(f.name, f.dataType.typeName()) for f in df.schema.fields] == [
        ("features", "binary"), ("label", "integer"), ("index", "long")]
    index, pixels, labels = _by_index(df)
    assert index.tolist() == list(range(SAMPLES))
    images, base_labels = base_digits(small.train)
    want, want_labels = extended_samples(images, base_labels, 0, SAMPLES, seed=SEED)
    assert np.array_equal(pixels, want) and np.array_equal(labels, want_labels)
    assert np.array_equal(labels, base_labels[np.arange(SAMPLES) % len(images)])


def test_another_partitioning_writes_the_same_bytes(spark, small, written, tmp_path):
    other = write_extended_mnist(spark, tmp_path / "seven", SAMPLES, seed=SEED, num_partitions=7, base=small.train)
    assert other.partitions == 7 and len(list((tmp_path / "seven").glob("*.parquet"))) == 7
    a = _by_index(extended_mnist(spark, written.path))
    b = _by_index(extended_mnist(spark, other.path))
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    reseeded = write_extended_mnist(spark, tmp_path / "seed6", 200, seed=SEED + 1, num_partitions=2, base=small.train)
    c = _by_index(extended_mnist(spark, reseeded.path))
    assert (c[1] != a[1][:200]).reshape(200, -1).any(axis=1).all()


def test_an_existing_folder_is_kept_unless_overwrite(spark, small, tmp_path):
    path = tmp_path / "again"
    write_extended_mnist(spark, path, 10, num_partitions=1, base=small.train)
    with pytest.raises(ValueError, match="exists; pass mode='overwrite'"):
        write_extended_mnist(spark, path, 10, num_partitions=1, base=small.train)
    write_extended_mnist(spark, path, 20, num_partitions=2, base=small.train, mode="overwrite")
    assert extended_mnist(spark, path).count() == 20
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="exists"):
        write_extended_mnist(spark, tmp_path / "empty", 10, base=small.train)
    with pytest.raises(ValueError, match="mode"):
        write_extended_mnist(spark, path, 10, mode="append", base=small.train)
    with pytest.raises(ValueError, match="num_samples"):
        write_extended_mnist(spark, tmp_path / "none", 0, base=small.train)


def test_a_folder_of_other_rows_is_refused_by_the_reader(spark, tmp_path):
    spark.createDataFrame([([0.5] * 3, 1)], "features array<double>, label int").write.parquet(str(tmp_path / "x"))
    with pytest.raises(ValueError, match="column 'features' is array, not binary"):
        extended_mnist(spark, tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="no extended-MNIST folder at"):
        extended_mnist(spark, tmp_path / "nothing")


def test_the_trainer_reads_pixels_as_mnist_scales_them(spark, small, written):
    x, y = spark_data.collect_arrays(extended_mnist(spark, written.path).orderBy("index").coalesce(1),
                                features_col="features", label_col="label", image_shape=IMAGE_SHAPE, expected_len=784,
                                num_classes=10, sample_shape=IMAGE_SHAPE)
    local = extended_arrays(SAMPLES, seed=SEED, base=small.train)  # float32 pixel / 255, as mnist() gives images
    assert np.array_equal(x, local.x) and np.array_equal(y, local.y)


def test_a_small_cnn_trained_on_the_written_set_scores_real_digits(spark, small, written):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Conv2d(8, 16, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Flatten(), torch.nn.Linear(16 * 4 * 4, 10))
    trainer = SparkTrainer(net, WorkerConfig(solver=SolverConfig(base_lr=0.05, momentum=0.9), batch_size=32, seed=0),
                           DistributedConfig(workers=2, tau=25, rounds=12), spark=spark)
    result = trainer.fit(extended_mnist(spark, written.path), validation=small.test, image_shape=IMAGE_SHAPE)
    assert result.summary["test_accuracy"] >= 0.85, result.summary


def _write_idx(path, arr: np.ndarray) -> None:
    """One uncompressed IDX file of uint8 values (the format MNIST is published in)."""
    path.write_bytes(struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
                     + arr.astype(np.uint8).tobytes())


def test_the_command_writes_and_reports_the_folder(spark, small, tmp_path, capsys, caplog, monkeypatch):
    """``sparknet data extended-mnist`` on base digits from IDX files (the subset, so nothing is fetched)."""
    idx = tmp_path / "idx"
    idx.mkdir()
    images, labels = base_digits(small.train)
    test_images, test_labels = base_digits(small.test)
    for name, arr in (("train-images-idx3-ubyte", images), ("train-labels-idx1-ubyte", labels),
                      ("t10k-images-idx3-ubyte", test_images), ("t10k-labels-idx1-ubyte", test_labels)):
        _write_idx(idx / name, arr)
    monkeypatch.setenv(IDX_ENV, str(idx))
    out = tmp_path / "cli"
    assert cli.main(["data", "extended-mnist", "--out", str(out), "--samples", "300", "--seed", "2",
                     "--partitions", "2"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["out"] == str(out) and report["rows"] == 300 and report["partitions"] == 2
    assert report["bytes"] == sum(p.stat().st_size for p in out.iterdir() if p.is_file()) and report["seconds"] > 0
    _, pixels, _ = _by_index(extended_mnist(spark, out))  # the module's session is still running
    n_train = len(images) - len(images) // 6  # mnist() keeps the last sixth of IDX training digits for validation
    want, _ = extended_samples(images[:n_train], labels[:n_train], 0, 300, seed=2)
    assert np.array_equal(pixels, want)
    assert cli.main(["data", "extended-mnist", "--out", str(out), "--samples", "10"]) == 2  # exists: refused
    assert f"{out} exists; pass mode='overwrite' (--overwrite)" in caplog.text
