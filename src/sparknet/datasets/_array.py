"""In-memory data sets of numpy arrays: :class:`ArrayDataset` and :class:`Splits`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import overload

import numpy as np

__all__ = ["ArrayDataset", "Splits"]


class ArrayDataset:
    """Features and labels held as two numpy arrays of the same length.

    Iterating yields ``(x[i], y[i])`` pairs; slicing and :meth:`shard` return views, not
    copies. The object pickles as its two arrays, so it travels to Spark executors.

    Parameters
    ----------
    x
        Features, first axis the sample axis (e.g. ``[N, 1, 28, 28]`` float32).
    y
        Labels or targets, first axis the sample axis (e.g. ``[N]`` int64).

    Raises
    ------
    ValueError
        ``x`` or ``y`` is a scalar, or their lengths differ.

    Examples
    --------
    >>> ds = ArrayDataset(np.zeros((10, 3), np.float32), np.arange(10))
    >>> len(ds), ds.shard(0, 3).y.tolist()
    (10, [0, 1, 2, 3])
    """

    __slots__ = ("_x", "_y")

    def __init__(self, x: np.ndarray, y: np.ndarray):
        x = np.asarray(x)
        y = np.asarray(y)
        if x.ndim == 0 or y.ndim == 0:
            raise ValueError(
                f"ArrayDataset needs arrays with a sample axis; got x of shape {x.shape} "
                f"and y of shape {y.shape}"
            )
        if len(x) != len(y):
            raise ValueError(
                f"ArrayDataset: x has {len(x)} samples but y has {len(y)}; they must have the "
                "same length (first axis)"
            )
        self._x = x
        self._y = y

    @property
    def x(self) -> np.ndarray:
        """The features, ``[N, ...]``."""
        return self._x

    @property
    def y(self) -> np.ndarray:
        """The labels or targets, ``[N, ...]``."""
        return self._y

    def __len__(self) -> int:
        return len(self._x)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for i in range(len(self._x)):
            yield self._x[i], self._y[i]

    @overload
    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]: ...
    @overload
    def __getitem__(self, index: slice | np.ndarray) -> ArrayDataset: ...

    def __getitem__(self, index):
        """Return sample ``index`` as ``(x, y)``, or a new data set for a slice or index array."""
        if isinstance(index, (int, np.integer)):
            return self._x[index], self._y[index]
        if isinstance(index, slice):
            return ArrayDataset(self._x[index], self._y[index])
        idx = np.asarray(index)
        if idx.ndim != 1 or not (idx.dtype == bool or np.issubdtype(idx.dtype, np.integer)):
            raise TypeError(
                "ArrayDataset indices are an int, a slice, or a 1-D integer or boolean array; "
                f"got {type(index).__name__}"
            )
        return ArrayDataset(self._x[idx], self._y[idx])

    def __getstate__(self) -> tuple[np.ndarray, np.ndarray]:
        return self._x, self._y

    def __setstate__(self, state: tuple[np.ndarray, np.ndarray]) -> None:
        self._x, self._y = state

    def __repr__(self) -> str:
        def spec(a: np.ndarray) -> str:
            return f"{a.dtype}{list(a.shape[1:])}"

        return f"ArrayDataset(n={len(self)}, x={spec(self._x)}, y={spec(self._y)})"

    def subset(self, n: int, seed: int | None = None) -> ArrayDataset:
        """``n`` samples (``0 <= n <= len(self)``): with ``seed=None`` a view of the first ``n``, else a copy of
        ``n`` distinct samples drawn with that seed (kept in their original order)."""
        n = int(n)
        if not 0 <= n <= len(self):
            raise ValueError(f"subset size must be between 0 and {len(self)}, got {n}")
        if seed is None:
            return self[:n]
        idx = np.sort(np.random.default_rng(seed).choice(len(self), size=n, replace=False))
        return self[idx]

    def shard(self, index: int, count: int) -> ArrayDataset:
        """A view of shard ``index`` (``0 <= index < count``) of ``count`` contiguous shards.

        Shard sizes differ by at most one (the first ``len % count`` shards hold one sample more), and
        the shards in order cover the data set exactly once.
        """
        if count < 1:
            raise ValueError(f"shard count must be at least 1, got {count}")
        if not 0 <= index < count:
            raise ValueError(f"shard index must be in [0, {count}), got {index}")
        base, extra = divmod(len(self), count)
        start = index * base + min(index, extra)
        stop = start + base + (1 if index < extra else 0)
        return self[start:stop]

    def shuffled(self, seed: int | None = None) -> ArrayDataset:
        """Return a copy with the samples in a random order (reproducible given ``seed``)."""
        return self[np.random.default_rng(seed).permutation(len(self))]


@dataclass(frozen=True)
class Splits:
    """A data set's train, validation and test splits."""

    train: ArrayDataset
    """The samples to train on."""
    validation: ArrayDataset
    """Held out from training; used to watch progress and choose settings."""
    test: ArrayDataset
    """Held out from everything; reported once."""
