"""The row file: written chunk by chunk, read whole, or streamed through a bounded shuffle window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparknet.rowfile as rowfile
from sparknet.net import Net
from sparknet.rowfile import RowFile, RowFileWriter
from sparknet.solvers import SolverConfig


def _write(tmp_path, n=1000, width=5, chunk=137, name="p0"):
    x = np.arange(n * width, dtype=np.float32).reshape(n, width)
    y = np.arange(n, dtype=np.int64)
    chunks = [(x[i:i + chunk], y[i:i + chunk], {}) for i in range(0, n, chunk)]
    rows, writer = RowFileWriter.write(str(tmp_path / name), chunks)
    return rows, x, y


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 64 rows of 5 values, so a stream over 1,000 rows has 16 blocks."""
    monkeypatch.setattr(rowfile, "BLOCK_BYTES", 64 * 5 * 4)


def test_written_rows_read_back_whole(tmp_path):
    rows, x, y = _write(tmp_path)
    assert (rows.rows, rows.x_shape, rows.y_shape) == (1000, (5,), ())
    assert rows.nbytes == 1000 * (5 * 4 + 8)
    xa, ya = rows.arrays()
    np.testing.assert_array_equal(xa, x)
    np.testing.assert_array_equal(ya, y)
    assert RowFile.open(str(tmp_path / "p0")) == rows


def test_rows_of_another_width_publish_nothing_and_count_every_row(tmp_path):
    stem = str(tmp_path / "p1")
    chunks = [(np.zeros((3, 4), np.float32), np.zeros(3, np.int64), {}),
              (np.zeros((2, 5), np.float32), np.zeros(2, np.int64), {})]
    rows, writer = RowFileWriter.write(stem, chunks)
    assert rows is None and writer.bad_rows == 5
    assert RowFile.open(stem) is None and not list(tmp_path.iterdir())


def test_a_failed_write_leaves_nothing(tmp_path):
    def chunks():
        yield np.zeros((3, 4), np.float32), np.zeros(3, np.int64), {}
        raise RuntimeError("executor lost")

    with pytest.raises(RuntimeError):
        RowFileWriter.write(str(tmp_path / "p2"), chunks())
    assert not list(tmp_path.iterdir())


def test_an_epoch_streams_every_row_once_in_a_shuffled_order(tmp_path, small_blocks):
    rows, x, _ = _write(tmp_path)
    stream = rows.stream(seed=3, buffer_bytes=3 * 64 * 5 * 4)  # a window of 3 blocks
    assert (stream.block_rows, stream.num_blocks, stream.window_blocks) == (64, 16, 3)
    assert stream.buffer_bytes == 3 * 64 * (5 * 4 + 8)
    seen = []
    for _ in range(1000 // 40):
        xb, yb = stream.next_batch(40)
        np.testing.assert_array_equal(xb, x[yb])
        seen.extend(yb.tolist())
    assert sorted(seen) == list(range(1000)) and stream.epoch == 0
    assert seen != sorted(seen)
    stream.next_batch(40)
    assert stream.epoch == 1 and stream.windows_read == 6 + 1


def test_the_order_is_a_function_of_seed_and_epoch_and_resumes_in_another_stream(tmp_path, small_blocks):
    rows, _, _ = _write(tmp_path)
    a = rows.stream(seed=7, buffer_bytes=2 * 64 * 5 * 4)
    for _ in range(37):  # into the second epoch, mid-window
        a.next_batch(32)
    state = a.state()
    ahead = [a.next_batch(32)[1] for _ in range(50)]
    b = rows.stream(seed=7, buffer_bytes=2 * 64 * 5 * 4)
    b.load_state(state)
    assert [v.tolist() for v in ahead] == [b.next_batch(32)[1].tolist() for _ in range(50)]
    c = rows.stream(seed=8, buffer_bytes=2 * 64 * 5 * 4)
    assert c.next_batch(32)[1].tolist() != rows.stream(seed=7, buffer_bytes=2 * 64 * 5 * 4).next_batch(32)[1].tolist()


def test_without_shuffle_the_stream_is_the_file_order(tmp_path, small_blocks):
    rows, _, y = _write(tmp_path)
    stream = rows.stream(seed=0, shuffle=False, buffer_bytes=64 * 5 * 4)
    got = np.concatenate([stream.next_batch(100)[1] for _ in range(10)])
    np.testing.assert_array_equal(got, y)


def test_a_truncated_file_is_a_clear_error(tmp_path, small_blocks):
    rows, _, _ = _write(tmp_path)
    with open(f"{rows.stem}.x", "r+b") as f:
        f.truncate(100)
    with pytest.raises(OSError, match="short of its rows"):
        rows.stream(seed=0).next_batch(10)


def _blob_rows(tmp_path, n=2000):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, n)
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]], dtype=np.float32)
    x = (centers[y] + rng.normal(0, 0.6, (n, 2))).astype(np.float32)
    rows, _ = RowFileWriter.write(str(tmp_path / "blobs"), [(x, y, {})])
    return rows, x, y


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def test_a_net_trains_from_a_stream_and_its_solver_state_carries_the_position(tmp_path, monkeypatch):
    monkeypatch.setattr(rowfile, "BLOCK_BYTES", 100 * 2 * 4)  # blocks of 100 rows, windows of 3 blocks
    rows, x, y = _blob_rows(tmp_path)

    def net():
        n = Net(_mlp(), SolverConfig(base_lr=0.05), batch_size=32, seed=1)
        n.set_training_data(rows.stream(seed=1, buffer_bytes=300 * 2 * 4))
        return n

    a = net()
    assert a.num_training_samples == 2000
    a.train(100)
    assert a.evaluate((x, y)).accuracy > 0.9
    state, weights = a.solver_state(), a.get_flat()
    assert state["stream"]["epoch"] == 1  # 100 steps of 32 is more than one epoch of 2,000 rows
    a.train(30)
    b = net()  # another process picking the worker up: the weights and the solver state
    b.set_flat(weights)
    b.load_solver_state(state)
    b.train(30)
    assert torch.equal(a.get_flat(), b.get_flat())
