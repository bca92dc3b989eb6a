"""A partition's rows on local disk, read whole or streamed through a bounded shuffle buffer.

A worker's training data is written once, chunk by chunk, as two flat files of fixed-size rows
(features ``float32 [L]``, labels of one fixed shape) and a small JSON header
(:class:`RowFileWriter`); the partition is never held whole while it is written. It is then read
one of two ways (:class:`RowFile`):

- **in memory** (:meth:`RowFile.arrays`): copy-on-write memory maps the net shuffles as a whole,
  every epoch a fresh permutation of every row;
- **streamed** (:meth:`RowFile.stream`): a :class:`RowStream` keeps one *window* of rows in a buffer
  of bounded size and hands out minibatches from it. Each epoch visits the file's blocks (a few
  hundred rows each, read contiguously) in a random order; consecutive blocks form a window whose
  rows are shuffled together. The order is a function of (seed, epoch) alone, so the stream's
  position is two numbers (epoch, rows taken) and a worker resumed in another process continues
  with exactly the rows an uninterrupted one would have taken.

Memory while streaming is the window's buffer (``buffer_bytes``), allocated once and refilled in
place; reading a window is ``blocks`` sequential reads. An epoch drops its last incomplete
minibatch, as the in-memory path does.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["RowFile", "RowFileWriter", "RowStream", "BLOCK_BYTES", "DEFAULT_BUFFER_BYTES"]

BLOCK_BYTES = 1 << 20
"""Bytes of features read contiguously at once when streaming (the unit the epoch's order shuffles)."""
DEFAULT_BUFFER_BYTES = 64 << 20
"""Default bytes of feature rows a stream holds at once (its shuffle window)."""


@dataclass(frozen=True)
class RowFile:
    """A partition's rows as written by :class:`RowFileWriter`: ``<stem>.x``, ``<stem>.y``, ``<stem>.json``."""

    stem: str
    rows: int
    x_shape: tuple[int, ...]
    """Shape of one row's features."""
    y_shape: tuple[int, ...]
    """Shape of one row's label (``()`` for one number)."""
    y_dtype: str

    @property
    def row_bytes(self) -> int:
        """Bytes of one row: features and label."""
        return 4 * math.prod(self.x_shape) + np.dtype(self.y_dtype).itemsize * math.prod(self.y_shape)

    @property
    def nbytes(self) -> int:
        """Bytes of every row, what holding the partition in memory takes."""
        return self.rows * self.row_bytes

    @classmethod
    def open(cls, stem: str) -> RowFile | None:
        """The row file at ``stem``, or ``None`` when it is not (completely) written there."""
        try:
            with open(f"{stem}.json") as f:
                meta = json.load(f)
        except FileNotFoundError:
            return None
        return cls(stem=stem, rows=int(meta["rows"]), x_shape=tuple(meta["x_shape"]), y_shape=tuple(meta["y_shape"]),
                   y_dtype=str(meta["y_dtype"]))

    def remove(self) -> None:
        """Delete the files (the header first, so a reader never sees a header without its rows)."""
        for suffix in (".json", ".x", ".y"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(f"{self.stem}{suffix}")

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Every row as copy-on-write memory maps (pages shared by the machine's processes, never written)."""
        x = np.memmap(f"{self.stem}.x", dtype=np.float32, mode="c", shape=(self.rows, *self.x_shape))
        y = np.memmap(f"{self.stem}.y", dtype=self.y_dtype, mode="c", shape=(self.rows, *self.y_shape))
        return x, y

    def stream(self, *, seed: int, buffer_bytes: int = DEFAULT_BUFFER_BYTES, shuffle: bool = True,
               sample_shape: tuple[int, ...] | None = None) -> RowStream:
        """A :class:`RowStream` over these rows."""
        return RowStream(self, seed=seed, buffer_bytes=buffer_bytes, shuffle=shuffle, sample_shape=sample_shape)


class RowFileWriter:
    """Append ``(x [m, L] float32, y [m, ...])`` chunks to a row file; :meth:`close` publishes it.

    Rows whose width (or label shape) differs from the first chunk's make the partition unusable, as
    :func:`sparknet.spark.data.merge_chunks` rules: :attr:`bad_rows` / :attr:`bad_labels` count every
    row then, and nothing is published.
    """

    def __init__(self, stem: str):
        self.stem = stem
        self.rows = 0
        self.bad_rows = self.bad_labels = 0
        self._x_shape = self._y_shape = self._y_dtype = None  # the first chunk's, which every other must match
        self._tmp = f".{os.getpid()}.tmp"
        os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
        self._fx = open(f"{stem}.x{self._tmp}", "wb")
        self._fy = open(f"{stem}.y{self._tmp}", "wb")

    def append(self, x: np.ndarray, y: np.ndarray) -> None:
        """Add one chunk's rows."""
        m = len(y)
        if not m:
            return
        if self._x_shape is None:
            self._x_shape, self._y_shape, self._y_dtype = tuple(x.shape[1:]), tuple(y.shape[1:]), y.dtype.str
        if not (self.bad_rows or self.bad_labels):  # the first misfit makes every row so far count as bad
            if tuple(x.shape[1:]) != self._x_shape:
                self.bad_rows = self.rows
            elif tuple(y.shape[1:]) != self._y_shape:
                self.bad_labels = self.rows
        if self.bad_rows:
            self.bad_rows += m
        elif self.bad_labels:
            self.bad_labels += m
        else:
            self._fx.write(np.ascontiguousarray(x, dtype=np.float32).data)
            self._fy.write(np.ascontiguousarray(y, dtype=self._y_dtype).data)
            self.rows += m

    def close(self, publish: bool = True) -> RowFile | None:
        """Finish the files; with ``publish`` and good rows, move them in place and return the row file."""
        publish = publish and self.rows and not (self.bad_rows or self.bad_labels)
        for f in (self._fx, self._fy):
            f.close()
            if publish:
                os.replace(f.name, f.name.removesuffix(self._tmp))
            else:
                os.remove(f.name)
        if not publish:
            return None
        meta = {"rows": self.rows, "x_shape": list(self._x_shape), "y_shape": list(self._y_shape),
                "y_dtype": self._y_dtype}
        with open(f"{self.stem}.json{self._tmp}", "w") as f:
            json.dump(meta, f)
        os.replace(f"{self.stem}.json{self._tmp}", f"{self.stem}.json")  # last: the header says the rows are there
        return RowFile.open(self.stem)

    @classmethod
    def write(cls, stem: str, chunks: Iterable, on_chunk=None) -> tuple[RowFile | None, RowFileWriter]:
        """Write every ``(x, y, ...)`` chunk; ``on_chunk(chunk)`` sees each first. Returns (row file, writer)."""
        writer = cls(stem)
        try:
            for chunk in chunks:
                if on_chunk is not None:
                    on_chunk(chunk)
                writer.append(chunk[0], chunk[1])
        except BaseException:
            writer.close(publish=False)
            raise
        return writer.close(), writer


class RowStream:
    """Minibatches streamed from a :class:`RowFile` through a shuffle window of at most ``buffer_bytes`` of feature
    rows (at least one block).

    ``seed`` and the epoch decide the order of blocks and of rows within each window (``shuffle=False``: the
    file's order); each feature row is given ``sample_shape`` (default: as written).
    """

    def __init__(self, rows: RowFile, *, seed: int, buffer_bytes: int = DEFAULT_BUFFER_BYTES, shuffle: bool = True,
                 sample_shape: tuple[int, ...] | None = None):
        if rows.rows < 1:
            raise ValueError("a stream needs at least one row")
        self.file, self.seed, self.shuffle = rows, int(seed) & 0xFFFFFFFF, shuffle
        self.sample_shape = tuple(sample_shape) if sample_shape is not None else rows.x_shape
        self._x_numel = math.prod(rows.x_shape)
        self._y_numel = math.prod(rows.y_shape)
        self._y_dtype = np.dtype(rows.y_dtype)
        self.block_rows = max(1, BLOCK_BYTES // (4 * self._x_numel))
        self.num_blocks = -(-rows.rows // self.block_rows)
        self.window_blocks = max(1, min(self.num_blocks, int(buffer_bytes) // (self.block_rows * 4 * self._x_numel)))
        cap = self.window_blocks * self.block_rows
        self._wx = np.empty((cap, self._x_numel), np.float32)
        self._wy = np.empty((cap, self._y_numel), self._y_dtype)
        self._fx = open(f"{rows.stem}.x", "rb", buffering=0)
        self._fy = open(f"{rows.stem}.y", "rb", buffering=0)
        self._window_starts: np.ndarray | None = None  # rows of the epoch before each window (and all of them)
        self._perm: np.ndarray | None = None
        self._new_epoch(0)
        self.windows_read = 0

    @property
    def rows(self) -> int:
        return self.file.rows

    @property
    def buffer_bytes(self) -> int:
        """Bytes the window's buffer holds (features and labels)."""
        return self._wx.nbytes + self._wy.nbytes

    def __len__(self) -> int:
        return self.file.rows

    def close(self) -> None:
        self._fx.close()
        self._fy.close()

    # -- the order ----------------------------------------------------------------------------------
    def _start_order(self) -> None:
        """The epoch's block order and where each of its windows starts in the epoch (rows before it)."""
        self._order = (np.random.default_rng([self.seed, self.epoch]).permutation(self.num_blocks) if self.shuffle
                       else np.arange(self.num_blocks))
        lens = np.minimum(self.block_rows, self.file.rows - self._order * self.block_rows)
        per_window = np.add.reduceat(lens, np.arange(0, self.num_blocks, self.window_blocks))
        self._window_starts = np.concatenate([[0], np.cumsum(per_window)])

    def _load_window(self, w: int) -> None:
        """Read window ``w`` of the epoch (blocks ``w*W .. w*W+W-1`` of its order) into the buffer, shuffled."""
        if self._order is None:
            self._start_order()
        blocks = self._order[w * self.window_blocks:(w + 1) * self.window_blocks]
        n = 0
        for b in np.sort(blocks):  # file order: the reads go forward
            start = int(b) * self.block_rows
            m = min(self.block_rows, self.file.rows - start)
            _read_into(self._fx, start * self._x_numel * 4, self._wx[n:n + m])
            _read_into(self._fy, start * self._y_numel * self._y_dtype.itemsize, self._wy[n:n + m])
            n += m
        self._window, self._wrows = w, n
        self._wstart = int(self._window_starts[w])
        self._perm = (np.random.default_rng([self.seed, self.epoch, w]).permutation(n) if self.shuffle
                      else np.arange(n))
        self.windows_read += 1

    def _take(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``k`` rows of the epoch (spanning windows as needed)."""
        xs, ys = [], []
        while k:
            if self._window < 0 or self.pos >= self._wstart + self._wrows:
                self._load_window(self._window + 1 if self._window >= 0 else 0)
            a = self.pos - self._wstart
            m = min(k, self._wrows - a)
            idx = self._perm[a:a + m]
            xs.append(self._wx[idx])
            ys.append(self._wy[idx])
            self.pos += m
            k -= m
        x = xs[0] if len(xs) == 1 else np.concatenate(xs)
        y = ys[0] if len(ys) == 1 else np.concatenate(ys)
        return x, y

    def next_batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The next minibatch ``(x [b, *sample_shape] float32, y [b, *label shape])``; a new epoch starts when
        fewer than ``b`` rows are left in this one."""
        b = min(int(batch_size), self.file.rows)
        if self.pos + b > self.file.rows:
            self._new_epoch(self.epoch + 1)
        x, y = self._take(b)
        return x.reshape(b, *self.sample_shape), y.reshape(b, *self.file.y_shape)

    def _new_epoch(self, epoch: int) -> None:
        """Start ``epoch``: no rows taken (``pos``), its block order (``_order``) not drawn yet, no window in the
        buffer (``_window`` -1; ``_wstart``: the epoch position of its first row, ``_wrows`` its rows)."""
        self.epoch, self.pos = epoch, 0
        self._order, self._window, self._wstart, self._wrows = None, -1, 0, 0

    # -- position -----------------------------------------------------------------------------------
    def state(self) -> dict:
        """Where the stream is: ``{"epoch", "pos"}``."""
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state(self, state: dict) -> None:
        """Continue from :meth:`state`'s position (in this or another process)."""
        self._new_epoch(int(state["epoch"]))
        pos = int(state["pos"])
        if pos:
            self._start_order()
            w = int(np.searchsorted(self._window_starts, pos, side="right")) - 1
            self._load_window(min(w, len(self._window_starts) - 2))
        self.pos = pos


def _read_into(f, offset: int, out: np.ndarray) -> None:
    """Fill ``out`` with the bytes of ``f`` at ``offset`` (a short read is a truncated file: an error)."""
    view = memoryview(out.reshape(-1).view(np.uint8))
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise OSError(f"{f.name} ends at byte {offset + done}, {len(view) - done} bytes short of its rows")
        done += n
