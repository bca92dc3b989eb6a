"""Checkpoints and model folders on S3: a real S3 server (moto) on loopback, no cloud account.

The server runs as a subprocess bound to 127.0.0.1 and is stopped in ``finally``; dummy
credentials are set for these tests only.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from sparknet import model_io as mio
from sparknet.checkpoint import CheckpointError, CheckpointManager
from sparknet.config import DistributedConfig, RunConfig
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.train import train_local

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")

pytestmark = pytest.mark.timeout(300)

BUCKET = "sparknet-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the moto server exited with code {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"the moto server did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


class _S3:
    """The loopback server: its endpoint, a boto3 client, and URIs inside the test bucket."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")

    def uri(self, prefix: str, scheme: str = "s3") -> str:
        host = self.endpoint.removeprefix("http://")
        return f"{scheme}://{BUCKET}/{prefix}?endpoint_override={host}&scheme=http"

    def keys(self, prefix: str) -> list[str]:
        """The objects under ``prefix/``, without the empty folder markers."""
        listing = self.client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
        return sorted(o["Key"] for o in listing.get("Contents", []) if not o["Key"].endswith("/"))


@pytest.fixture(scope="module")
def s3():
    port = _free_port()
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            mp.delenv(name, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("NO_PROXY", "127.0.0.1")
        for attempt in range(3):  # a port found free may be taken by another process before moto binds it
            proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                _wait_listening(port, proc)
                break
            except Exception as exc:
                proc.kill()
                proc.wait(timeout=10)
                if attempt == 2 or not isinstance(exc, RuntimeError):  # RuntimeError: it exited, the port was taken
                    raise
                port = _free_port()
        try:
            server = _S3(f"http://127.0.0.1:{port}")
            server.client.create_bucket(Bucket=BUCKET)
            yield server
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _net(seed=0) -> Net:
    torch.manual_seed(seed)
    return Net(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)),
               SolverConfig(base_lr=0.05), batch_size=8, seed=seed)


def _same(a, b) -> bool:
    return list(a) == list(b) and all(torch.equal(x, y) for (_, xs), (_, ys) in zip(a.items(), b.items())
                                      for x, y in zip(xs, ys))


# -- checkpoints ------------------------------------------------------------------------------
def test_a_checkpoint_round_trip_on_s3_is_exact(s3):
    mgr = CheckpointManager(s3.uri("exact"))
    mgr.check_writable()
    weights = _net().get_weights()
    state = {"step": 7, "rng": torch.get_rng_state(), "lr": [0.1, 0.05], "name": "x"}
    mgr.save(3, weights, state, config={"model": "mlp"})
    assert mgr.latest() == 3
    ck = mgr.load()
    assert ck.round == 3 and ck.manifest["config"] == {"model": "mlp"}
    assert _same(ck.weights, weights)
    assert ck.state["step"] == 7 and ck.state["lr"] == [0.1, 0.05] and ck.state["name"] == "x"
    assert torch.equal(ck.state["rng"], state["rng"])
    assert s3.keys("exact") == [f"exact/ckpt-00000003/{n}" for n in ("manifest.json", "state.pt",
                                                                     "weights.safetensors")]


def test_s3a_names_the_same_objects(s3):
    weights = _net(1).get_weights()
    CheckpointManager(s3.uri("alias", scheme="s3a")).save(2, weights)
    assert "alias/ckpt-00000002/manifest.json" in s3.keys("alias")
    for scheme in ("s3", "s3n"):
        ck = CheckpointManager(s3.uri("alias", scheme=scheme)).load()
        assert ck.round == 2 and _same(ck.weights, weights)


def test_a_checkpoint_without_its_manifest_is_skipped_and_rotated_away(s3, caplog):
    mgr = CheckpointManager(s3.uri("crash"), keep=2)
    first, second = _net(1).get_weights(), _net(2).get_weights()
    mgr.save(1, first, {"step": 1})
    mgr.save(2, second, {"step": 2})
    s3.client.delete_object(Bucket=BUCKET, Key="crash/ckpt-00000002/manifest.json")  # died before the manifest
    assert any(k.endswith("ckpt-00000002/weights.safetensors") for k in s3.keys("crash"))
    assert mgr.rounds() == [1] and mgr.latest() == 1
    assert "incomplete checkpoint" in caplog.text
    ck = mgr.load()
    assert ck.round == 1 and ck.state == {"step": 1} and _same(ck.weights, first)
    for r in (3, 4, 5):
        mgr.save(r, second, {"step": r})
    assert mgr.rounds() == [4, 5]
    assert {k.split("/")[1] for k in s3.keys("crash")} == {"ckpt-00000004", "ckpt-00000005"}


def _run(steps: int) -> RunConfig:
    return RunConfig(model="mlp", dataset="synthetic", steps=steps, eval_every=20, batch_size=32, threads=1,
                     quiet=True, lr=0.05)


def test_training_with_an_s3_checkpoint_dir_resumes_exactly(s3, monkeypatch):
    # the endpoint from the standard environment variable, the URIs plain
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
    whole = train_local(_run(100), DistributedConfig(checkpoint_dir=f"s3://{BUCKET}/train/whole", checkpoint_every=1,
                                                     tau=20))
    split = f"s3://{BUCKET}/train/split"
    train_local(_run(60), DistributedConfig(checkpoint_dir=split, checkpoint_every=1, tau=20))
    resumed = train_local(_run(100), DistributedConfig(checkpoint_dir=split, checkpoint_every=1, resume=True, tau=20))
    a = CheckpointManager(f"s3://{BUCKET}/train/whole").load()
    b = CheckpointManager(split).load()
    assert a.round == b.round == 5 and resumed["resumed_from_step"] == 60 and resumed["steps"] == 100
    assert _same(a.weights, b.weights)
    assert resumed["test_accuracy"] == whole["test_accuracy"] and resumed["samples"] == whole["samples"]
    assert CheckpointManager(split).rounds() == [3, 4, 5]



def test_one_process_trains_on_a_parquet_table_and_its_held_out_rows_on_s3(s3, tmp_path):
    """--data and --validation-data as S3 URIs (s3a://, as Spark users write them): one process reads them with
    pyarrow, the rows the same as the same files on a local disk give."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sparknet.datasets import synthetic

    splits = {"train": synthetic(600, (16,), 4, seed=3), "held": synthetic(200, (16,), 4, seed=4)}  # one task
    for name, split in splits.items():
        table = pa.table({"features": pa.array(list(np.asarray(split.x, np.float32)), pa.list_(pa.float32())),
                          "label": np.asarray(split.y, np.int64)})
        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        s3.client.put_object(Bucket=BUCKET, Key=f"tables/{name}.parquet", Body=buffer.getvalue())
        pq.write_table(table, tmp_path / f"{name}.parquet")
    runs = {}
    for where, (train, held) in {"s3": (s3.uri("tables/train.parquet", "s3a"), s3.uri("tables/held.parquet", "s3a")),
                                 "disk": (str(tmp_path / "train.parquet"), str(tmp_path / "held.parquet"))}.items():
        runs[where] = train_local(RunConfig(model="mlp", data=train, validation_data=held, steps=40, batch_size=32,
                                            threads=1, quiet=True, lr=0.05))
    assert runs["s3"]["samples"] == runs["disk"]["samples"] == 40 * 32
    assert runs["s3"]["test_accuracy"] == runs["disk"]["test_accuracy"] > 0.5  # scored on the 200 held-out rows
    assert runs["s3"]["test_loss"] == runs["disk"]["test_loss"]
    with pytest.raises(FileNotFoundError, match="no Parquet data at s3a://"):
        train_local(RunConfig(model="mlp", data=s3.uri("tables/none.parquet", "s3a"), steps=1, quiet=True))


# -- model folders ----------------------------------------------------------------------------
def test_a_model_folder_round_trip_on_s3(s3):
    from sparknet import zoo
    from sparknet.datasets import synthetic

    data = synthetic(64, shape=(6,), num_classes=3, seed=1)
    net = Net(zoo.mlp(input_shape=[6], hidden=[8], num_classes=3), SolverConfig(base_lr=0.1), batch_size=16, seed=0)
    net.set_training_data(data)
    net.train(3)
    uri = s3.uri("models/mlp")
    assert mio.save_model(uri, net, config={"steps": 3}) == uri
    assert s3.keys("models/mlp") == sorted(f"models/mlp/{n}" for n in (
        mio.MANIFEST_NAME, "net.json", "weights.safetensors", "solver.json", "config.json"))
    with pytest.raises(FileExistsError):
        mio.save_model(uri, net)
    for where in (uri, s3.uri("models/mlp", scheme="s3a")):
        loaded = mio.load_model(where)
        assert loaded.config == {"steps": 3} and loaded.solver == net.solver
        assert _same(loaded.weights, net.get_weights())
        x = torch.from_numpy(data.x[:10])
        assert torch.equal(loaded.predict(x), net.predict(x))
    with pytest.raises(ValueError, match="not a sparknet model folder"):
        mio.load_model(s3.uri("models/none"))


def test_a_model_overwritten_on_s3_is_replaced_whole_and_a_failed_save_keeps_the_old_one(s3, monkeypatch):
    from sparknet import zoo

    def net(seed):
        return Net(zoo.mlp(input_shape=[6], hidden=[8], num_classes=3), SolverConfig(base_lr=0.1), batch_size=16,
                   seed=seed)

    old, new = net(0), net(1)
    uri = s3.uri("models/swap")
    mio.save_model(uri, old, config={"v": 1})
    real = mio.filesystem

    class Failing:  # the object store refuses the third file written: the new model's copy beside the old one
        def __init__(self, fs):
            self._fs, self.opened = fs, 0

        def __getattr__(self, name):
            return getattr(self._fs, name)

        def open_output_stream(self, where, *args, **kwargs):
            self.opened += 1
            if self.opened == 3:
                raise OSError("refused (injected)")
            return self._fs.open_output_stream(where, *args, **kwargs)

    monkeypatch.setattr(mio, "filesystem", lambda path: (Failing(real(path)[0]), real(path)[1]))
    with pytest.raises(OSError, match="injected"):
        mio.save_model(uri, new, config={"v": 2}, overwrite=True)
    monkeypatch.undo()
    kept = mio.load_model(uri)
    assert kept.config == {"v": 1} and _same(kept.weights, old.get_weights())
    assert not [k for k in s3.keys("models") if ".saving-" in k]  # nothing of the failed save is left
    assert mio.save_model(uri, new, config={"v": 2}, overwrite=True) == uri
    loaded = mio.load_model(uri)
    assert loaded.config == {"v": 2} and _same(loaded.weights, new.get_weights())
    assert s3.keys("models/swap") == sorted(f"models/swap/{n}" for n in (
        mio.MANIFEST_NAME, "net.json", "weights.safetensors", "solver.json", "config.json"))
    assert not [k for k in s3.keys("models") if ".saving-" in k or ".replaced-" in k]


# -- schemes pyarrow cannot write -------------------------------------------------------------
@pytest.mark.parametrize("uri, hint", [("dbfs:/x/ckpt", "FUSE path /dbfs/"),
                                       ("foo://x/ckpt", "this pyarrow cannot write foo://")])
def test_unwritable_schemes_are_refused_before_training(uri, hint, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sparknet.train._train_loop", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(CheckpointError, match=f"--checkpoint-dir: .*{hint}"):
        train_local(_run(20), DistributedConfig(checkpoint_dir=uri))
    with pytest.raises(ValueError, match=hint):
        mio.save_model(uri, _net())
    assert not list(tmp_path.iterdir())  # not taken for a local folder name


def test_profile_traces_are_written_to_s3(s3):
    """--profile-dir takes a URI: the trace and its table go where every worker can write them."""
    import json

    train_local(replace(_run(40), profile_dir=s3.uri("profiles/run1"), profile_round=1), DistributedConfig(tau=20))
    assert s3.keys("profiles/run1") == ["profiles/run1/worker-0-round1.json", "profiles/run1/worker-0-round1.txt"]
    body = s3.client.get_object(Bucket=BUCKET, Key="profiles/run1/worker-0-round1.json")["Body"].read()
    assert "aten::addmm" in {e.get("name") for e in json.loads(body)["traceEvents"]}
