"""Synthetic data of any shape, for throughput, failure and quick learning tests.

Both generators separate the *task* (fixed by ``task_seed``: class prototypes, or a
transition rule) from the *samples* (drawn with ``seed``), so a training set and a test
set made with different ``seed`` values and the same ``task_seed`` are the same problem.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

from sparknet.datasets._array import ArrayDataset

__all__ = ["synthetic", "synthetic_sequences", "SyntheticImages"]


def synthetic(
    num_samples: int,
    shape: Sequence[int] = (1, 28, 28),
    num_classes: int = 10,
    seed: int = 0,
    dtype: DTypeLike = np.float32,
    *,
    task_seed: int = 0,
    noise: float = 1.0,
) -> ArrayDataset:
    """A learnable classification set: a per-class prototype plus Gaussian noise.

    Each class ``c`` has a prototype ``mu_c`` with standard-normal entries (drawn from
    ``task_seed``); sample ``i`` is ``mu_{y_i} + noise * eps_i`` with labels uniform
    over the classes. A linear model separates the classes well when ``noise`` is about 1
    and the sample has a few hundred features.

    Parameters
    ----------
    num_samples
        How many samples, at least 0.
    shape
        The shape of one sample, e.g. ``(1, 28, 28)`` or ``(20,)``.
    num_classes
        How many classes, at least 1.
    seed
        Seeds the labels and the noise.
    dtype
        The floating dtype of ``x``.
    task_seed
        Seeds the class prototypes (the task). Keep it fixed across train and test.
    noise
        The noise's standard deviation, at least 0.

    Returns
    -------
    ArrayDataset
        ``x`` of ``dtype`` ``[num_samples, *shape]``; ``y`` int64 ``[num_samples]`` in
        ``[0, num_classes)``. The same arguments give the same arrays.
    """
    shape = tuple(int(d) for d in shape)
    if num_samples < 0:
        raise ValueError(f"num_samples must be at least 0, got {num_samples}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be at least 1, got {num_classes}")
    if any(d < 1 for d in shape):
        raise ValueError(f"every dimension of shape must be at least 1, got {shape}")
    if noise < 0:
        raise ValueError(f"noise must be at least 0, got {noise}")
    dtype = np.dtype(dtype)
    if not np.issubdtype(dtype, np.floating):
        raise ValueError(f"dtype must be a floating type, got {dtype}")
    gen_dtype = np.float64 if dtype == np.float64 else np.float32
    prototypes = np.random.default_rng(task_seed).standard_normal((num_classes, *shape), dtype=gen_dtype)
    rng = np.random.default_rng(seed)
    y = rng.integers(0, num_classes, size=num_samples, dtype=np.int64)
    x = rng.standard_normal((num_samples, *shape), dtype=gen_dtype)
    x *= gen_dtype(noise)
    x += prototypes[y]
    return ArrayDataset(x.astype(dtype, copy=False), y)


def synthetic_sequences(
    num_samples: int,
    seq_len: int = 32,
    vocab_size: int = 16,
    seed: int = 0,
    *,
    task_seed: int = 0,
    noise: float = 0.1,
) -> ArrayDataset:
    """A learnable next-token task, shaped like :meth:`CharCorpus.sequences`.

    Tokens follow a fixed random permutation of the vocabulary (drawn from
    ``task_seed``): after token ``a`` comes ``perm[a]``, except that with probability
    ``noise`` a uniformly random token comes instead. A recurrent net learns the rule
    quickly; the best achievable accuracy is about ``1 - noise * (1 - 1/vocab_size)``.

    Parameters
    ----------
    num_samples
        How many sequences.
    seq_len
        Tokens per input sequence.
    vocab_size
        How many distinct tokens, at least 2.
    seed
        Seeds the start tokens and the noise.
    task_seed
        Seeds the permutation (the task).
    noise
        The chance that a token breaks the rule, in [0, 1].

    Returns
    -------
    ArrayDataset
        ``x`` and ``y`` int64 ``[num_samples, seq_len]`` with ``y[i, t] == x[i, t + 1]``
        for ``t < seq_len - 1``.
    """
    if num_samples < 0 or seq_len < 1 or vocab_size < 2:
        raise ValueError(
            "need num_samples >= 0, seq_len >= 1, vocab_size >= 2; got "
            f"{num_samples}, {seq_len}, {vocab_size}"
        )
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise}")
    perm = np.random.default_rng(task_seed).permutation(vocab_size)
    rng = np.random.default_rng(seed)
    tokens = np.empty((num_samples, seq_len + 1), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, vocab_size, size=num_samples)
    flips = rng.random((num_samples, seq_len)) < noise
    randoms = rng.integers(0, vocab_size, size=(num_samples, seq_len))
    for t in range(seq_len):
        tokens[:, t + 1] = np.where(flips[:, t], randoms[:, t], perm[tokens[:, t]])
    return ArrayDataset(tokens[:, :-1].copy(), tokens[:, 1:].copy())


@dataclass(frozen=True)
class SyntheticImages:
    """Image rows made where they are read: row ``i`` depends on ``(seed, i)`` alone, so a Spark executor makes
    the same rows this process would, and no pixel travels (the AlexNet throughput workload: ImageNet's shape).

    Each image is uniform noise in [0, 0.5) plus its class's brightness, ``0.5 * label / num_classes``: a net can
    learn the classes, and every step costs what a real image's does.

    Parameters
    ----------
    num_samples
        Rows in the set.
    shape
        One image, channels first (ImageNet's crop by default).
    num_classes
        Labels are uniform over ``0 .. num_classes - 1``.
    seed
        The set: another seed makes other rows.
    """

    num_samples: int
    shape: tuple[int, ...] = (3, 227, 227)
    num_classes: int = 1000
    seed: int = 0

    def __len__(self) -> int:
        return self.num_samples

    def rows(self, indices: Iterable[int]) -> tuple[np.ndarray, np.ndarray]:
        """The images and labels of rows ``indices``."""
        indices = [int(i) for i in indices]
        x = np.empty((len(indices), *self.shape), np.float32)
        y = np.empty(len(indices), np.int64)
        for k, i in enumerate(indices):
            rng = np.random.default_rng((self.seed, i))
            y[k] = rng.integers(self.num_classes)
            x[k] = rng.random(self.shape, dtype=np.float32) * 0.5 + 0.5 * y[k] / self.num_classes
        return x, y

    @functools.cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self.rows(range(self.num_samples))

    @property
    def x(self) -> np.ndarray:
        """Every image, made in this process (one-process training)."""
        return self._arrays[0]

    @property
    def y(self) -> np.ndarray:
        return self._arrays[1]

