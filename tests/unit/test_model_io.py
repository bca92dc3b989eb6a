"""Model folders: save, load, integrity and version checks (no Spark)."""

from __future__ import annotations

import json

import pytest
import torch

from sparknet import model_io as mio
from sparknet.net import Net
from sparknet.solvers import SolverConfig


@pytest.fixture()
def trained():
    from sparknet import zoo
    from sparknet.datasets import synthetic

    data = synthetic(128, shape=(6,), num_classes=3, seed=1)
    net = Net(zoo.mlp(input_shape=[6], hidden=[8], num_classes=3), SolverConfig(base_lr=0.1), batch_size=16, seed=0)
    net.set_training_data(data)
    net.train(5)
    return net, torch.from_numpy(data.x[:20])


def test_netparams_round_trip(tmp_path, trained):
    net, x = trained
    path = mio.save_model(tmp_path / "m", net, config={"run": {"steps": 5}}, metadata={"note": "t"})
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [mio.MANIFEST_NAME, "net.json", "weights.safetensors", "solver.json", "config.json"])
    loaded = mio.load_model(path)
    assert loaded.manifest["kind"] == "netparams"
    assert loaded.input_shape == (6,)
    assert loaded.solver == net.solver
    assert loaded.config == {"run": {"steps": 5}}
    assert loaded.manifest["metadata"] == {"note": "t"}
    assert loaded.weights.allclose(net.get_weights(), rtol=0, atol=0)
    assert torch.equal(loaded.predict(x), net.predict(x))
    assert loaded.net_params.to_dict() == net.net_params.to_dict()


def test_netparams_needs_weights(trained):
    net, _ = trained
    with pytest.raises(ValueError, match="weights="):
        mio.pack_model(net.net_params)
    files = mio.pack_model(net.net_params, net.get_weights())
    assert mio.model_id(files) == mio.model_id(mio.pack_model(net.net_params, net.get_weights()))
    assert mio.model_id(files) != mio.model_id(mio.pack_model(net.net_params, net.get_weights() * 2.0))


def test_plain_module_uses_pickle_only_when_allowed(tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    module[1].running_mean.fill_(0.5)
    path = mio.save_model(tmp_path / "m", module, input_shape=(4,))
    assert json.loads((path / mio.MANIFEST_NAME).read_text())["kind"] == "module"
    with pytest.raises(ValueError, match="allow_pickle=True"):
        mio.load_model(path)
    loaded = mio.load_model(path, allow_pickle=True)
    x = torch.randn(5, 4)
    module.eval()
    assert torch.equal(loaded.predict(x), module(x))


def _corrupt(path, text):
    (path / mio.MANIFEST_NAME).write_text(text)


@pytest.mark.parametrize("text, match", [
    ("{not json", "not valid JSON"),
    ('{"format": "something-else", "format_version": 1}', "not a sparknet model manifest"),
    ('{"format": "sparknet.model", "format_version": "one"}', "format_version"),
    ('{"format": "sparknet.model", "format_version": 1, "kind": "netparams"}', "lacks the 'net' entry"),
])
def test_corrupt_manifest_is_a_clear_error(tmp_path, trained, text, match):
    path = mio.save_model(tmp_path / "m", trained[0])
    _corrupt(path, text)
    with pytest.raises(ValueError, match=match):
        mio.load_model(path)


def test_newer_format_version_is_refused(tmp_path, trained):
    path = mio.save_model(tmp_path / "m", trained[0])
    manifest = json.loads((path / mio.MANIFEST_NAME).read_text())
    manifest["format_version"] = mio.FORMAT_VERSION + 1
    _corrupt(path, json.dumps(manifest))
    with pytest.raises(ValueError, match=f"format version {mio.FORMAT_VERSION + 1}.*upgrade"):
        mio.load_model(path)


def test_damaged_or_missing_files(tmp_path, trained):
    path = mio.save_model(tmp_path / "m", trained[0])
    data = bytearray((path / "weights.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "weights.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        mio.load_model(path)
    (path / "weights.safetensors").unlink()
    with pytest.raises(ValueError, match="missing"):
        mio.load_model(path)
    with pytest.raises(ValueError, match="not a sparknet model folder"):
        mio.load_model(tmp_path)


def test_overwrite_rules(tmp_path, trained):
    net, x = trained
    path = mio.save_model(tmp_path / "m", net)
    with pytest.raises(FileExistsError):
        mio.save_model(path, net)
    net.set_weights(net.get_weights() * 0.5)
    mio.save_model(path, net, overwrite=True)
    assert torch.equal(mio.load_model(path).predict(x), net.predict(x))
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not a sparknet model folder"):
        mio.save_model(other, net, overwrite=True)
    assert (other / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "other"]  # the swap leaves no folder beside them
