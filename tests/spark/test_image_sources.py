"""Spark's image and binaryFile data sources, read directly by the trainer (local[2])."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _spark_testlib import module_session
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer
from sparknet.spark import data as spark_data

pytestmark = pytest.mark.spark


spark = module_session("local[2]")


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("images"))


def write_images(root):
    """120 RGB PNGs of 6 x 8 pixels in class0/ and class1/: class 0 is red on the left half, class 1 on the right."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in (0, 1):
        (root / f"class{label}").mkdir()
        for i in range(60):
            pixels = rng.integers(0, 60, size=(6, 8, 3), dtype=np.uint8)
            half = slice(0, 4) if label == 0 else slice(4, 8)
            pixels[:, half, 0] = rng.integers(180, 255, size=(6, 4), dtype=np.uint8)  # red
            pixels[:, :, 2] = 30  # a blue plane that is not red: BGR read as RGB would swap them
            Image.fromarray(pixels, "RGB").save(root / f"class{label}" / f"{i:03d}.png")
    return root


def _labelled(df, path_col):
    from pyspark.sql import functions as F

    return df.withColumn("label", F.regexp_extract(F.col(path_col), r"class(\d)", 1).cast("long"))


def _image_frame(spark, root):
    df = spark.read.format("image").option("recursiveFileLookup", "true").load(str(root))
    return _labelled(df, "image.origin").withColumn("path", df["image.origin"])


def _file_frame(spark, root):
    df = (spark.read.format("binaryFile").option("recursiveFileLookup", "true").option("pathGlobFilter", "*.png")
          .load(str(root)))
    return _labelled(df, "path")


def _arrays(df, features_col):
    rows = df.orderBy("path")
    x, y = spark_data.collect_arrays(rows.coalesce(1), features_col=features_col, label_col="label",
                                image_shape=(3, 6, 8), expected_len=None, num_classes=2, sample_shape=(3, 6, 8))
    return x, y


def test_both_sources_give_the_pixels_of_the_files_channels_first_in_rgb(spark, image_dir):
    from PIL import Image

    x_img, y_img = _arrays(_image_frame(spark, image_dir), "image")
    x_bin, y_bin = _arrays(_file_frame(spark, image_dir), "content")
    first = sorted(image_dir.glob("class*/*.png"))[0]
    want = np.asarray(Image.open(first).convert("RGB")).transpose(2, 0, 1) / np.float32(255.0)
    np.testing.assert_allclose(x_bin[0], want, atol=1e-7)
    np.testing.assert_allclose(x_img, x_bin, atol=1e-7)
    assert (y_img == y_bin).all() and sorted(set(y_img.tolist())) == [0, 1]


@pytest.mark.parametrize("source", ["image", "binaryFile"])
def test_a_net_trains_on_a_directory_of_images(spark, image_dir, source):
    df = _image_frame(spark, image_dir) if source == "image" else _file_frame(spark, image_dir)
    features = "image" if source == "image" else "content"
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(4 * 6 * 8, 2))
    trainer = SparkTrainer(net, WorkerConfig(solver=SolverConfig(base_lr=0.05, momentum=0.9), batch_size=16, seed=0),
                           DistributedConfig(workers=2, tau=10, rounds=6), spark=spark)
    result = trainer.fit(df, validation=df, features_col=features, image_shape=[3, 6, 8])
    assert result.summary["test_accuracy"] > 0.95, result.summary


def test_an_image_of_another_size_is_refused_with_its_shape(spark, image_dir):
    trainer = SparkTrainer(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 2)),
                           WorkerConfig(batch_size=16), DistributedConfig(workers=2, tau=2, rounds=1), spark=spark)
    with pytest.raises(ValueError, match="feature rows must hold 192 values"):
        trainer.fit(_file_frame(spark, image_dir), features_col="content", image_shape=[3, 8, 8])
