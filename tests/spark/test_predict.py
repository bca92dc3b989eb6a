"""`sparknet predict`: a saved model scores Parquet through Spark; the output matches the net."""

import json
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from sparknet import Net, zoo
from sparknet.model_io import save_model
from sparknet.cli import main
from sparknet.tools.predict import predict

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def spark():
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2]").appName("test-predict")
               .config("spark.ui.enabled", "false").config("spark.python.worker.reuse", "true")
               .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("predict")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0).astype(np.int64)
    net = Net(zoo.mlp(input_shape=[5], hidden=[8], num_classes=3), batch_size=16, seed=0)
    net.set_training_data((x, y))
    net.train(20)
    folder = save_model(root / "model", net)
    data = root / "data.parquet"
    pq.write_table(pa.table({"id": np.arange(60), "features": list(x), "label": y}), data)
    return folder, data, net, x


def _expected(net, x):
    with torch.no_grad():
        probs = torch.softmax(net.predict(torch.from_numpy(x)).double(), dim=1).numpy()
    return probs.argmax(1), probs


def test_predict_writes_inputs_plus_prediction_and_probability(spark, model_and_data, tmp_path):
    folder, data, net, x = model_and_data
    out = tmp_path / "scored"
    result = predict(folder, str(data), str(out), spark=spark, partitions=2)
    assert result.rows == 60
    assert result.columns == ["id", "features", "label", "prediction", "probability"]
    table = pq.read_table(out).to_pandas().sort_values("id")
    classes, probs = _expected(net, x)
    np.testing.assert_array_equal(table["prediction"].to_numpy(), classes.astype(np.float64))
    got = np.stack(table["probability"].to_numpy())  # a plain list column, readable without Spark
    np.testing.assert_allclose(got, probs, atol=1e-6)
    np.testing.assert_allclose(got.sum(1), 1.0, atol=1e-9)
    assert not spark.sparkContext._jsc.sc().isStopped()


def test_predict_command(spark, model_and_data, tmp_path, capsys):
    folder, data, _, _ = model_and_data
    out = tmp_path / "cli"
    args = ["predict", "--model-dir", str(folder), "--data", str(data), "--out", str(out), "--probability-vector"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] == 60 and report["out"] == str(out)
    from pyspark.ml.linalg import VectorUDT

    assert isinstance(spark.read.parquet(str(out)).schema["probability"].dataType, VectorUDT)
    assert main(args) == 2  # an existing output is refused before any Spark job (--overwrite replaces it)
    with pytest.raises(ValueError, match="exists; pass --overwrite"):
        predict(folder, str(data), str(out), spark=spark)


def test_missing_inputs_are_clear(spark, model_and_data, tmp_path):
    folder, data, _, _ = model_and_data
    with pytest.raises(ValueError, match="not a sparknet model folder"):
        predict(tmp_path / "nope", str(data), str(tmp_path / "o"), spark=spark)
    with pytest.raises(FileNotFoundError, match="no Parquet data"):
        predict(folder, str(tmp_path / "nope.parquet"), str(tmp_path / "o"), spark=spark)
    with pytest.raises(ValueError, match="feature column .pixels. not found"):
        predict(folder, str(data), str(tmp_path / "o"), spark=spark, features_col="pixels")


def test_a_scoring_job_past_its_deadline_is_cancelled_and_says_so(spark, model_and_data, tmp_path):
    from sparknet.errors import DeadlineExceeded

    folder, data, _, _ = model_and_data
    with pytest.raises(DeadlineExceeded, match="the scoring and writing job did not finish within 0.001 s"):
        predict(folder, str(data), str(tmp_path / "late"), spark=spark, timeout_s=0.001)
    assert not spark.sparkContext._jsc.sc().isStopped()  # the caller's session keeps running
    result = predict(folder, str(data), str(tmp_path / "late"), spark=spark, overwrite=True)  # and works again
    assert result.rows == 60


class _NoContext:
    """A SparkContext with a master and nothing else: check_shared_path's short-cuts use no more."""

    def __init__(self, master):
        self.master = master

    def __getattr__(self, name):
        raise AssertionError(f"asked Spark for {name}")


class _NoSpark:
    def __init__(self, master):
        self.sparkContext = _NoContext(master)


@pytest.mark.parametrize("master,path", [("local[2]", "/only/here"), ("local-cluster[2,1,1024]", "file:///only/here"),
                                         ("spark://h:7077", "hdfs://nn/data"), ("spark://h:7077", "s3a://b/k"),
                                         ("yarn", "gs://b/k"), ("yarn", "abfss://c@a.dfs.core.windows.net/k"),
                                         ("yarn", "dbfs:/x")])
def test_check_shared_path_asks_nothing_on_a_local_master_or_for_a_remote_uri(master, path):
    from sparknet.spark.shared_path import check_shared_path

    check_shared_path(_NoSpark(master), path, what="--data")
    check_shared_path(_NoSpark(master), path, what="--out", write=True)


def test_check_shared_path_asks_the_executors_about_plain_paths_and_file_uris():
    from sparknet.spark.shared_path import check_shared_path

    for path in ("/only/here", "file:///only/here", "relative/path"):
        with pytest.raises(AssertionError, match="asked Spark"):
            check_shared_path(_NoSpark("spark://h:7077"), path, what="--data")


def test_predict_reads_the_columns_the_model_trained_on_from_its_folder(spark, model_and_data, tmp_path):
    """A model whose folder keeps the table's own columns (as sparknet train and the Estimator write them) is scored
    on those columns with no --features-col, by predict and by the model's transform: numbers and an array, joined in
    the order it trained on."""
    from pyspark.sql import functions as F

    _, _, net, x = model_and_data
    folder = save_model(tmp_path / "model", net, metadata={"features": [
        {"name": "first", "kind": "number"}, {"name": "rest", "kind": "array"}]})
    data = tmp_path / "named.parquet"
    pq.write_table(pa.table({"rest": list(x[:, 1:]), "first": x[:, 0], "id": np.arange(60)}), data)
    out = tmp_path / "scored"
    assert predict(folder, str(data), str(out), spark=spark).rows == 60
    table = pq.read_table(out).to_pandas().sort_values("id")
    assert list(table.columns) == ["rest", "first", "id", "prediction", "probability"]
    np.testing.assert_array_equal(table["prediction"].to_numpy(), _expected(net, x)[0].astype(np.float64))
    # the model's own transform takes them too, where its featuresCol is not set and the data has no such column
    from sparknet.spark.ml import SparkNetModel

    model = SparkNetModel.fromModelFolder(str(folder))
    assert model.trainedColumns == ["first", "rest"]
    scored = model.transform(spark.read.parquet(str(data))).toPandas().sort_values("id")
    np.testing.assert_array_equal(scored["prediction"].to_numpy(), _expected(net, x)[0].astype(np.float64))
    with pytest.raises(ValueError, match="feature column 'rest' has type double"):  # a column named: that column alone
        model.setFeaturesCol("rest").transform(spark.read.parquet(str(data)).withColumn("rest", F.lit(1.0)))
