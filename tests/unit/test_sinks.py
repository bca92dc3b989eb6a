"""TensorBoard and MLflow sinks: the per-round metrics are read back from what they wrote."""

import json
import os
from pathlib import Path

import numpy as np
import torch

import pytest
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sparknet import Net, zoo
from sparknet.model_io import MANIFEST_NAME, save_model
from sparknet.metrics import MetricsLogger
from sparknet.sinks import MLflowSink, TensorBoardSink, close_sinks, make_sinks, record_scalars


def _records(rounds=5):
    out = []
    for r in range(1, rounds + 1):
        out.append({"event": "round", "round": r, "steps": 10, "total_steps": 10 * r, "samples": 1280,
                    "total_samples": 1280 * r, "wall_s": 0.5 * r, "round_s": 0.5, "compute_s": 0.4,
                    "comm_s": 0.1, "loss": 2.0 / r, "val_accuracy": 0.5 + 0.05 * r, "bytes": 3_400_000, "tau": 10,
                    "per_worker": [{"index": 0, "samples": 640, "loss": 2.1 / r},
                                   {"index": 1, "samples": 640, "loss": 1.9 / r}]})
    out.append({"event": "summary", "test_accuracy": 0.8, "wall_s": 2.6, "samples": 1280 * rounds,
                "samples_per_s": 2461.5, "steps": 10 * rounds, "rounds": rounds, "model": "lenet"})
    return out


def test_scalars_are_against_the_training_step():
    pairs = record_scalars(_records(3))
    assert [step for step, _ in pairs] == [10, 20, 30, 30]
    step, first = pairs[0]
    assert first["train/loss"] == 2.0 and first["round/tau"] == 10 and first["round/bytes"] == 3_400_000
    assert first["throughput/samples_per_s"] == pytest.approx(1280 / 0.5)
    assert first["worker/1/loss"] == pytest.approx(1.9)
    assert pairs[-1][1]["summary/test_accuracy"] == 0.8
    evals = record_scalars([{"event": "eval", "step": 100, "samples": 6400, "wall_s": 2.0, "loss": 0.5,
                             "test_accuracy": 0.9},
                            {"event": "eval", "step": 200, "samples": 12800, "wall_s": 3.0, "loss": 0.4,
                             "test_accuracy": 0.95}])
    assert evals[1] == (200, {"test/loss": 0.4, "test/accuracy": 0.95, "throughput/samples_per_s": 6400.0})


def test_tensorboard_event_files_hold_the_rounds(tmp_path):
    logdir = tmp_path / "tb"
    sink = TensorBoardSink(logdir)
    try:
        with MetricsLogger(tmp_path / "m.jsonl", progress=False, sinks=[sink]) as metrics:
            for record in _records(5):
                metrics.write(record)
    finally:
        sink.close()
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "validation/accuracy", "throughput/samples_per_s", "round/tau", "round/bytes",
            "worker/0/loss", "worker/1/loss"} <= tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [10, 20, 30, 40, 50]
    assert [e.value for e in loss] == pytest.approx([2.0, 1.0, 2 / 3, 0.5, 0.4])
    assert [e.value for e in acc.Scalars("round/bytes")] == [3_400_000] * 5
    assert acc.Scalars("summary/test_accuracy")[0].value == pytest.approx(0.8)


def test_mlflow_file_store_run_has_params_metrics_and_model(tmp_path):
    folder = save_model(tmp_path / "model", Net(zoo.mlp(input_shape=[4], hidden=[8], num_classes=3), seed=0))
    store = tmp_path / "mlruns"
    env_before = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    sinks = make_sinks(mlflow_uri=str(store), experiment="tests", run_name="r1",
                       params={"run": {"lr": 0.05, "model": "lenet"}, "dist": {"workers": 2, "tau": 10}},
                       model_dir=folder)
    try:
        with MetricsLogger(None, progress=False, sinks=sinks) as metrics:
            for record in _records(4):
                metrics.write(record)
    finally:
        close_sinks(sinks)
    sink = sinks[0]
    assert isinstance(sink, MLflowSink)
    assert os.environ.get("MLFLOW_ALLOW_FILE_STORE") == env_before  # the opt-in did not leak
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # reading a file store back needs it too
    try:
        client = MlflowClient(tracking_uri=store.resolve().as_uri())
        run = client.get_run(sink.run_id)
        assert run.info.status == "FINISHED" and run.info.run_name == "r1"
        assert run.data.params["run.lr"] == "0.05" and run.data.params["dist.tau"] == "10"
        assert run.data.params["run.model"] == "lenet"
        history = client.get_metric_history(sink.run_id, "train/loss")
        assert sorted((m.step, m.value) for m in history) == [(10, 2.0), (20, 1.0), (30, pytest.approx(2 / 3)),
                                                              (40, 0.5)]
        acc = client.get_metric_history(sink.run_id, "validation/accuracy")
        assert [m.step for m in sorted(acc, key=lambda m: m.step)] == [10, 20, 30, 40]
        assert len(client.get_metric_history(sink.run_id, "worker/1/loss")) == 4
        assert run.data.metrics["summary/test_accuracy"] == 0.8
        names = {f.path for f in client.list_artifacts(sink.run_id, "model")}
        assert "model/MLmodel" in names  # an MLflow model (pyfunc), holding the sparknet folder
        inner = {f.path for f in client.list_artifacts(sink.run_id, "model/artifacts/model")}  # the folder's name
        assert f"model/artifacts/model/{MANIFEST_NAME}" in inner
        assert "model/artifacts/model/weights.safetensors" in inner
    finally:
        if env_before is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)


def test_failed_run_is_marked_failed(tmp_path):
    store = tmp_path / "mlruns"
    with pytest.raises(RuntimeError, match="boom"):
        with MLflowSink(store, experiment="tests") as sink:
            sink({"event": "round", "round": 1, "steps": 1, "loss": 1.0})
            raise RuntimeError("boom")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        assert MlflowClient(store.resolve().as_uri()).get_run(sink.run_id).info.status == "FAILED"
    finally:
        os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)


def test_make_sinks_without_any_is_empty():
    assert make_sinks() == []
    json.dumps(record_scalars(_records(1)))


def test_a_run_inside_the_users_active_run_logs_a_pyfunc_model(tmp_path, monkeypatch):
    """sparknet train --mlflow '' inside mlflow.start_run(): it joins that run (no second run), leaves it open,
    and logs an MLflow model that mlflow.pyfunc.load_model scores a pandas frame with; the store is SQLite."""
    import mlflow
    import pandas as pd

    from sparknet.model_io import load_model
    from sparknet.cli import main
    from sparknet.datasets import synthetic

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    try:
        mlflow.set_experiment("notebook")
        with mlflow.start_run(run_name="mine") as mine:
            rc = main(["train", "--model", "mlp", "--dataset", "synthetic", "--steps", "20", "--eval-every", "10",
                       "--threads", "1", "--mlflow", "", "--model-dir", str(tmp_path / "m"), "--quiet"])
            assert rc == 0
            assert mlflow.active_run().info.run_id == mine.info.run_id  # still the user's, still open
        client = mlflow.tracking.MlflowClient(uri)
        runs = client.search_runs([mine.info.experiment_id])
        assert [r.info.run_id for r in runs] == [mine.info.run_id]  # joined: no second run
        run = client.get_run(mine.info.run_id)
        assert run.info.status == "FINISHED" and "test/accuracy" in run.data.metrics and "run.lr" in run.data.params
        model = mlflow.pyfunc.load_model(f"runs:/{mine.info.run_id}/model")
        assert model.metadata.signature is not None
        ds = synthetic(8, seed=5)
        frame = pd.DataFrame({"features": [row.astype("float64") for row in ds.x.reshape(8, -1)]})
        out = model.predict(frame)
        want = load_model(tmp_path / "m").predict(torch.from_numpy(ds.x.reshape(8, -1))).argmax(1).double().numpy()
        assert list(out["prediction"]) == list(want)
        assert np.allclose(np.stack(out["probability"]).sum(axis=1), 1.0)
        version = mlflow.register_model(f"runs:/{mine.info.run_id}/model", "sparknet-mlp")
        assert int(version.version) == 1
    finally:
        mlflow.set_tracking_uri(None)


def test_the_default_store_is_a_sqlite_file(tmp_path, monkeypatch):
    from sparknet.sinks import resolve_tracking_uri

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(None) == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert resolve_tracking_uri("runs/x.db") == f"sqlite:///{tmp_path.resolve() / 'runs' / 'x.db'}"
    with MLflowSink(experiment="tests") as sink:
        sink({"event": "round", "round": 1, "steps": 1, "loss": 1.0})
    assert (tmp_path / "mlflow.db").exists() and "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    assert MlflowClient(resolve_tracking_uri(None)).get_run(sink.run_id).info.status == "FINISHED"


def test_a_caffe_run_logs_its_model_to_mlflow_without_a_model_folder_of_its_own(tmp_path, monkeypatch):
    """sparknet train --solver ... --mlflow URI with no --model-dir: the run's model folder is written for MLflow
    alone, logged as an MLflow model whose net is the Caffe file's, then removed."""
    import tempfile

    import mlflow

    from sparknet.cli import main

    models = Path(__file__).resolve().parents[2].parent / "shared" / "caffe-models" / "mnist"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))  # where the run's scratch folder goes
    (tmp_path / "scratch").mkdir()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["train", "--solver", str(models / "lenet_solver.prototxt"), "--steps", "10", "--test-iter", "1",
                 "--caffe-sources", "mnist_train_lmdb=mnist-small,mnist_test_lmdb=mnist-small:test",
                 "--max-train-samples", "320", "--threads", "1", "--snapshot-dir", str(tmp_path / "snaps"),
                 "--mlflow", uri, "--quiet"]) == 0
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("sparknet").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "caffe-LeNet"
    mlflow.set_tracking_uri(uri)
    try:
        model = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    finally:
        mlflow.set_tracking_uri(None)
    assert model.metadata.signature is not None
    assert list((tmp_path / "scratch").glob("sparknet-model-*")) == []  # the run's scratch folder removed


def test_a_model_trained_on_a_tables_own_columns_is_an_mlflow_model_of_those_columns(tmp_path):
    """sparknet train --features-col rooms,shape,age --mlflow: the MLflow model's signature names the table's columns
    (of the table's own types), and mlflow.pyfunc scores a frame of them, joined as training joined
    them; a frame without one of them is refused by the signature, naming it."""
    import mlflow
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq
    from mlflow.exceptions import MlflowException

    from sparknet.cli import main
    from sparknet.model_io import load_model

    rng = np.random.default_rng(0)
    n = 400
    rooms, age, shape = rng.integers(1, 6, n), rng.normal(size=n), rng.normal(size=(n, 3))
    label = (rooms + shape[:, 0] > 3).astype(np.int64)
    pq.write_table(pa.table({"rooms": rooms, "shape": list(shape), "age": age, "label": label}), tmp_path / "t.parquet")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["train", "--data", str(tmp_path / "t.parquet"), "--features-col", "rooms,shape,age",
                 "--model", "mlp", "--steps", "40", "--threads", "1", "--mlflow", uri,
                 "--model-dir", str(tmp_path / "m"), "--quiet"]) == 0
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("sparknet").experiment_id])
    mlflow.set_tracking_uri(uri)
    try:
        model = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    finally:
        mlflow.set_tracking_uri(None)
    inputs = model.metadata.signature.inputs.to_dict()
    # the table's own types: a column of whole numbers takes whole numbers (MLflow refuses floats for it)
    assert [(c["name"], c["type"]) for c in inputs] == [("rooms", "long"), ("shape", "array"), ("age", "double")]
    assert inputs[1]["items"] == {"type": "double"}
    frame = pd.DataFrame({"age": age[:8], "rooms": rooms[:8], "shape": list(shape[:8])})
    out = model.predict(frame)  # the columns in any order: joined in the model's
    joined = np.concatenate([rooms[:8, None], shape[:8], age[:8, None]], axis=1).astype(np.float32)
    want = load_model(tmp_path / "m").predict(torch.from_numpy(joined)).argmax(1).double().numpy()
    assert list(out["prediction"]) == list(want)
    with pytest.raises(MlflowException, match="age"):
        model.predict(frame.drop(columns=["age"]))
