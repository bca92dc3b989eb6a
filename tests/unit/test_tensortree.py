"""The rounds engine's per-round state file: every value back as it went in, and a clear error otherwise."""

import io
import os

import numpy as np
import pytest
import torch

from sparknet import SolverConfig, zoo
from sparknet._tensortree import TreeFileError, load_tree, save_tree
from sparknet.net import Net
from sparknet.spark.rounds.executor import export_worker_state
from sparknet.strategies import WorkerState


def _same(a, b):
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


def test_a_tree_of_every_kind_comes_back_equal(tmp_path):
    tree = {0: {"momentum_buffer": torch.randn(5, 3)}, "s": "x", "b": True, "n": None, "f": 0.1, "nan": float("nan"),
            "i": -(2**62), "t": (0.9, 0.999), "l": [torch.tensor(3.0), torch.zeros(0), torch.tensor([True, False])],
            "u8": torch.arange(7, dtype=torch.uint8), "i64": torch.arange(4), "bf": torch.ones(3, dtype=torch.bfloat16),
            "a": np.arange(6, dtype=np.float64).reshape(2, 3), "strided": torch.randn(4, 4).t()}
    path = tmp_path / "s.state"
    save_tree(path, tree)
    back = load_tree(path)
    _same({**tree, "strided": tree["strided"].contiguous()}, back)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_worker_state_loads_into_a_net_and_it_trains_on_identically(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.random((256, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, 256)

    def net():
        n = Net(zoo.lenet(), SolverConfig(base_lr=0.01, momentum=0.9), batch_size=32, seed=3)
        n.set_training_data((x, y))
        return n

    a = net()
    a.train(5)
    save_tree(tmp_path / "w.state", {"version": 1, "worker": export_worker_state(a, WorkerState())})
    b = net()
    b.set_flat(a.get_flat())
    b.load_solver_state(load_tree(tmp_path / "w.state")["worker"]["solver"])
    a.train(4)
    b.train(4)
    assert torch.equal(a.get_flat(), b.get_flat())


@pytest.mark.parametrize("damage", ["empty", "not ours", "cut", "outline"])
def test_a_damaged_file_is_a_clear_error(tmp_path, damage):
    path = tmp_path / "s.state"
    save_tree(path, {"w": torch.randn(100)})
    data = path.read_bytes()
    data = {"empty": b"", "not ours": b"PK\x03\x04" + data[4:], "cut": data[:len(data) // 2],
            "outline": data[:20] + b"{" + data[21:]}[damage]
    path.write_bytes(data)
    with pytest.raises(TreeFileError):
        load_tree(path)


def test_what_it_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(TypeError, match="set"):
        save_tree(tmp_path / "s.state", {"x": {1, 2}})
    assert not list(tmp_path.iterdir())


def test_bytes_from_a_peer_come_back_whole_or_are_refused_with_a_clear_error():
    from sparknet._tensortree import TreeFileError, pack_tree, unpack_tree

    tree = {"global": torch.arange(5.0), "strategy": {0: {"momentum": torch.ones(2)}}, "auto_tau": {"step_s": [0.1]},
            "pair": (1, "a")}
    back = unpack_tree(bytes(pack_tree(tree)))  # as it arrives from a socket: immutable bytes
    assert torch.equal(back["global"], tree["global"]) and torch.equal(back["strategy"][0]["momentum"], torch.ones(2))
    assert back["auto_tau"] == {"step_s": [0.1]} and back["pair"] == (1, "a")
    data = pack_tree(tree)
    with pytest.raises(TreeFileError, match="not a sparknet tree"):
        unpack_tree(b"garbage" * 4)
    with pytest.raises(TreeFileError, match="cut short"):
        unpack_tree(data[:20])
    lying = data.replace(b'"float32",[5]', b'"float32",[9]')  # an outline whose shape its bytes do not hold
    with pytest.raises(TreeFileError):
        unpack_tree(lying)


def _every_kind():
    return {0: {"momentum_buffer": torch.randn(5, 3)}, "s": "x", "n": None, "t": (0.9, 0.999),
            "l": [torch.tensor(3.0), torch.zeros(0), torch.tensor([True, False])], "empty": torch.zeros(0, 4),
            "bf": torch.ones(3, dtype=torch.bfloat16), "a": np.arange(6, dtype=np.float64).reshape(2, 3),
            "strided": torch.randn(4, 4).t()}


def test_a_tree_in_parts_is_the_outline_then_each_tensor_where_it_lies_and_reads_back_equal():
    from sparknet._tensortree import pack_tree, unpack_tree

    tree = _every_kind()
    parts = pack_tree(tree, parts=16)
    assert isinstance(parts, list) and len(parts) == 1 + 8  # the outline, then the tree's 8 tensors
    momentum = tree[0]["momentum_buffer"]
    assert np.shares_memory(parts[1], momentum.numpy())  # not copied: sent from where it lies
    received = [bytes(parts[0])] + [bytearray(memoryview(p).cast("B")) for p in parts[1:]]  # as frames arrive
    back = unpack_tree(received)
    _same({**tree, "strided": tree["strided"].contiguous()}, back)
    assert back[0]["momentum_buffer"].data_ptr() != momentum.data_ptr()
    # the same tree packed whole (more tensors than parts allowed) reads back the same
    assert isinstance(pack_tree(tree, parts=7), bytearray)
    _same(unpack_tree(pack_tree(tree, parts=7)), back)


def test_unpacked_without_a_copy_a_tensor_reads_the_received_bytes_in_place():
    from sparknet._tensortree import pack_tree, unpack_tree

    tree = {"global": torch.arange(6.0), "strategy": {"velocity": torch.ones(3)}}
    received = [bytes(pack_tree(tree, parts=4)[0]), bytearray(tree["global"].numpy().tobytes()),
                bytearray(tree["strategy"]["velocity"].numpy().tobytes())]
    back = unpack_tree(received, copy=False)
    assert torch.equal(back["global"], tree["global"])
    received[1][:4] = np.float32(-1).tobytes()  # the tensor is the frame's own memory: no second copy of the weights
    assert back["global"][0].item() == -1.0
    whole = pack_tree(tree)  # one buffer: copied out all the same (torch cannot save tensors sharing a storage)
    back = unpack_tree(whole, copy=False)
    torch.save(back, io.BytesIO())
    whole[-64:-60] = np.float32(-1).tobytes()
    assert torch.equal(back["strategy"]["velocity"], torch.ones(3))


def test_parts_that_do_not_match_their_outline_are_refused():
    from sparknet._tensortree import TreeFileError, pack_tree, unpack_tree

    tree = {"global": torch.arange(6.0), "velocity": torch.ones(3)}
    parts = [bytes(memoryview(p).cast("B")) for p in pack_tree(tree, parts=4)]
    with pytest.raises(TreeFileError, match="outside"):
        unpack_tree(parts[:2])  # one part missing
    with pytest.raises(TreeFileError, match="outside"):
        unpack_tree([parts[0], parts[1][:8], parts[2]])  # one cut short
    with pytest.raises(TreeFileError, match="more parts"):
        unpack_tree(parts + [b"x"])


def test_a_tree_file_holds_exactly_the_bytes_pack_tree_makes(tmp_path):
    from sparknet._tensortree import pack_tree

    for tree in (_every_kind(), {"version": 3, "none": None}, {"one": torch.arange(16.0)}):
        save_tree(tmp_path / "s.state", tree)
        assert (tmp_path / "s.state").read_bytes() == bytes(pack_tree(tree))
