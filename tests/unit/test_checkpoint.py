"""Checkpoints: written manifest last, rotated, verified, and exact for a Net's full state."""

import os

import numpy as np
import pytest
import torch

from sparknet.checkpoint import CheckpointError, CheckpointManager, model_fingerprint
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.strategies import DiLoCo


def _net(seed=0):
    torch.manual_seed(seed)
    return Net(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)),
               SolverConfig(base_lr=0.05, lr_policy="step", stepsize=5, gamma=0.5), batch_size=8, seed=seed)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64)


def test_resume_from_a_checkpoint_is_bitwise_exact(tmp_path):
    a = _net()
    a.set_training_data(_data())
    a.train(12)
    strategy = DiLoCo()
    strategy.apply(a.get_flat(), torch.ones_like(a.get_flat()) * 0.01, 2)
    mgr = CheckpointManager(str(tmp_path / "ck"))
    mgr.save(3, a.get_weights(), {"solver": a.solver_state(), "strategy": strategy.state_dict(),
                                  "rng": torch.get_rng_state()}, config={"model": "mlp"})
    a.train(9)

    b = _net(seed=5)
    b.set_training_data(_data())
    ck = mgr.load(expect_fingerprint=model_fingerprint(b.get_weights()))
    assert ck.round == 3 and ck.manifest["config"] == {"model": "mlp"}
    b.set_weights(ck.weights)
    b.load_solver_state(ck.state["solver"])
    restored = DiLoCo()
    restored.load_state_dict(ck.state["strategy"])
    assert torch.equal(restored.velocity, strategy.velocity)
    b.train(9)
    assert b.get_weights().max_abs_diff(a.get_weights()) == 0.0


def test_rotation_keeps_the_newest(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep=2)
    w = _net().get_weights()
    for r in (1, 2, 3, 4):
        mgr.save(r, w)
    assert mgr.rounds() == [3, 4] and mgr.latest() == 4
    assert not any(name.startswith(".tmp") for name in os.listdir(tmp_path))


def test_corruption_and_other_models_are_refused(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    w = _net().get_weights()
    path = mgr.save(7, w)
    with pytest.raises(CheckpointError, match="another model"):
        mgr.load(expect_fingerprint="0" * 16)
    with open(os.path.join(path, "weights.safetensors"), "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(CheckpointError, match="corrupt"):
        mgr.load()


def test_empty_folder_and_unwritable_folder(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        CheckpointManager(str(tmp_path)).load()
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # running as root: permissions do not stop writes
            blocker = tmp_path / "file"
            blocker.write_text("x")
            with pytest.raises(CheckpointError, match="checkpoint folder"):
                CheckpointManager(str(blocker / "sub"))
        else:
            with pytest.raises(CheckpointError, match="not writable"):
                CheckpointManager(str(locked)).check_writable()
    finally:
        locked.chmod(0o700)


def test_file_uri(tmp_path):
    mgr = CheckpointManager(f"file://{tmp_path}/uri")
    mgr.save(0, _net().get_weights())
    assert mgr.load().round == 0


def test_a_save_that_stopped_before_its_manifest_is_never_listed_and_is_rotated_away(tmp_path, caplog):
    mgr = CheckpointManager(str(tmp_path), keep=2)
    first, second = _net(1).get_weights(), _net(2).get_weights()
    mgr.save(1, first, {"step": 1})
    mgr.save(2, second, {"step": 2})
    os.remove(tmp_path / "ckpt-00000002" / "manifest.json")  # died before the manifest
    mgr.save(3, second, {"step": 3})
    (tmp_path / "ckpt-00000003" / "manifest.json").write_text('{"format": "sparknet-che')  # died in it
    assert mgr.rounds() == [1] and mgr.latest() == 1
    assert caplog.text.count("skipping incomplete checkpoint") >= 2
    assert mgr.load().state == {"step": 1}
    mgr.save(4, second, {"step": 4})
    assert mgr.rounds() == [1, 4]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001", "ckpt-00000004"]


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, caplog):
    mgr = CheckpointManager(str(tmp_path))
    first, second = _net(1).get_weights(), _net(2).get_weights()
    mgr.save(1, first, {"step": 1})
    path = mgr.save(2, second, {"step": 2})
    with open(os.path.join(path, "state.pt"), "ab") as f:
        f.write(b"\x00")
    ck = mgr.load()
    assert ck.round == 1 and ck.weights.max_abs_diff(first) == 0.0
    assert "state.pt does not match its recorded SHA-256" in caplog.text
    with pytest.raises(CheckpointError, match="corrupt"):
        mgr.load(2)  # asked for by round: no fallback


def test_saving_a_round_again_replaces_it_whole(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    mgr.save(5, _net(1).get_weights(), {"step": 1})
    second = _net(2).get_weights()
    mgr.save(5, second, {"step": 2})
    ck = mgr.load()
    assert ck.round == 5 and ck.state == {"step": 2} and ck.weights.max_abs_diff(second) == 0.0
