"""Data sets by name, for the command line: :func:`load_dataset`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sparknet.datasets._array import Splits
from sparknet.datasets._extended import Deformation
from sparknet.datasets._extended_write import cached_extended_arrays
from sparknet.datasets._mnist import mnist, mnist_small
from sparknet.datasets._shakespeare import shakespeare
from sparknet.datasets._synthetic import SyntheticImages, synthetic, synthetic_sequences

__all__ = ["DATASET_NAMES", "load_dataset"]


def _splits_of(make: Callable[..., Any], default_samples: int) -> Callable[..., Splits]:
    """A loader of ``make``'s train, validation and test sets, drawn with seeds ``seed``, ``seed + 1``, ``seed + 2``."""

    def splits(num_samples: int = default_samples, num_test: int | None = None, seed: int = 0, **kwargs: Any) -> Splits:
        n = max(1, num_samples // 5) if num_test is None else num_test
        return Splits(train=make(num_samples, seed=seed, **kwargs), validation=make(n, seed=seed + 1, **kwargs),
                      test=make(n, seed=seed + 2, **kwargs))

    return splits


def _extended_mnist_splits(num_samples: int = 100_000, seed: int = 0, **kwargs: Any) -> Splits:
    data = mnist()
    train = cached_extended_arrays(num_samples, seed=seed, deformation=Deformation(**kwargs), base=data.train)
    return Splits(train=train, validation=data.validation, test=data.test)


def _imagenet_synthetic(num_samples: int = 1280, num_test: int = 128, seed: int = 0) -> Splits:
    test = SyntheticImages(num_test, seed=seed + 1)
    return Splits(train=SyntheticImages(num_samples, seed=seed), validation=test, test=test)


_LOADERS: dict[str, Callable[..., Any]] = {
    "mnist": mnist,
    "mnist-small": mnist_small,
    "extended-mnist": _extended_mnist_splits,
    "shakespeare": shakespeare,
    "synthetic": _splits_of(synthetic, 10_000),
    "synthetic-sequences": _splits_of(synthetic_sequences, 2_000),
    "imagenet-synthetic": _imagenet_synthetic,
}

#: The names :func:`load_dataset` accepts.
DATASET_NAMES: tuple[str, ...] = tuple(_LOADERS)


def load_dataset(name: str, **kwargs: Any) -> Any:
    """Load a data set by name.

    Parameters
    ----------
    name
        One of :data:`DATASET_NAMES` (``_`` and ``-`` are interchangeable, case is
        ignored):

        - ``"mnist"``: :func:`mnist`, an ``MNIST`` (train / validation / test).
        - ``"mnist-small"``: :func:`mnist_small`, an ``MNIST`` (4,000 / 1,000 / 1,000).
        - ``"extended-mnist"``: a :class:`Splits` whose ``train`` is the first ``num_samples``
          (default 100,000) deformed digits of seed ``seed`` (:func:`cached_extended_arrays`; other
          keywords are :class:`Deformation` fields), made once here and cached, and whose
          ``validation`` and ``test`` are MNIST's. Millions go to Parquet through Spark:
          :func:`write_extended_mnist`.
        - ``"shakespeare"``: :func:`shakespeare`, a ``CharCorpus``.
        - ``"synthetic"``: a :class:`Splits` of :func:`synthetic` sets of one task:
          ``num_samples`` (default 10,000) to train, ``num_test`` (default a fifth of
          that) each to validation and test, drawn with seeds ``seed``, ``seed + 1``,
          ``seed + 2``; other keywords go to :func:`synthetic`.
        - ``"imagenet-synthetic"``: ImageNet-shaped :class:`SyntheticImages` (3x227x227, 1,000
          classes), ``num_samples`` (default 1,280) to train and ``num_test`` (default 128) to
          validate and test; on Spark the executors make the training rows themselves.
        - ``"synthetic-sequences"``: the same with :func:`synthetic_sequences`
          (default 2,000 sequences).
    **kwargs
        Passed to the loader.

    Returns
    -------
    MNIST, Splits or CharCorpus
        Every image or synthetic set has ``.train``, ``.validation`` and ``.test``.

    Raises
    ------
    ValueError
        ``name`` is not known.
    """
    key = name.strip().lower().replace("_", "-")
    if key not in _LOADERS:
        raise ValueError(f"unknown data set {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    return _LOADERS[key](**kwargs)
