"""Training from the command line: the steps around a training loop, whichever engine runs it.

``sparknet train`` seeds the generators, loads the data, builds the model, opens the
metrics sinks, trains (in one process, on Spark, model-parallel, or through a parameter
server), then saves the model folder and closes the sinks::

    seed_everything(run.seed)
    train, test, info = load_training_data(run)
    net_params = build_model(run, info)
    sinks = run_sinks(run, config)
    try:
        ...train...
    finally:
        finish_run(run, sinks, failed=..., net_params=net_params, weights=...)

Every engine's entry point calls these functions, so the steps are written once.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

from sparknet import datasets, zoo
from sparknet._fs import filesystem
from sparknet.model_io import save_model
from sparknet._parquet import labels_with_weights, read_parquet_dataset
from sparknet.config import RunConfig
from sparknet.sinks import close_sinks, make_sinks

__all__ = ["seed_everything", "load_training_data", "build_model", "run_sinks", "finish_run"]

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def load_training_data(run: RunConfig):
    """``(train, test, info)`` for ``run.dataset`` (or ``run.data``, a Parquet path).

    ``info`` carries what the model needs to know (input shape, number of classes,
    vocabulary for text).
    """
    if run.data is not None:
        labels = run.label_columns
        return read_parquet_dataset(run.data, run.feature_columns, labels[0] if len(labels) == 1 else labels,
                                    validation=run.validation_data, task=run.task, weight_col=run.weight_col)
    if run.dataset == "shakespeare":  # RunConfig spells data sets and models as the registries do
        corpus = datasets.shakespeare()
        seq_len = 256 if run.model == "gpt_char" else 100  # nanoGPT's context; char_lstm's sequences
        return (corpus.sequences("train", seq_len), corpus.sequences("validation", seq_len),
                {"vocab_size": corpus.vocab_size, "corpus": corpus, "seq_len": seq_len})
    data = datasets.load_dataset(run.dataset)
    train, test = data.train, data.test
    if isinstance(train, datasets.SyntheticImages):  # its rows are made where they train
        return train, test, {"input_shape": train.shape, "num_classes": train.num_classes}
    info = {"input_shape": tuple(train.x.shape[1:]), "num_classes": int(train.y.max()) + 1}
    if np.ndim(train.y) == 2:  # token sequences, a label per position (synthetic-sequences)
        vocab = int(max(train.x.max(), train.y.max())) + 1
        info.update(vocab_size=vocab, seq_len=int(train.x.shape[1]), num_classes=vocab)
    return train, test, info


def training_rows(train, info: dict):
    """``(rows, weighted)``: the training rows a net in this process trains on, and whether their labels carry each
    row's sample weight last (``--weight-col``'s, ``info["weights"]``: :func:`sparknet._parquet.labels_with_weights`),
    as a ``Net(weighted=True)`` takes them."""
    weights = info.get("weights")
    if weights is None:
        return train, False
    return datasets.ArrayDataset(train.x, labels_with_weights(train.y, weights)[0]), True


def scored_rows(test, info: dict):
    """The test rows a net scores: ``test``, or ``(x, y, w)`` with each row's sample weight where ``--weight-col``
    gave them some (``info["test_weights"]``), as :meth:`sparknet.net.Net.set_validation_data` takes them."""
    weights = info.get("test_weights")
    return test if weights is None else (test.x, test.y, weights)


def build_model(run: RunConfig, info: dict):
    """The zoo model ``run.model`` shaped for the data ``info`` describes."""
    kwargs: dict = {"batch_size": run.batch_size}
    if run.model in ("char_lstm", "gpt_char"):
        kwargs.update(vocab_size=info["vocab_size"], seq_len=info.get("seq_len", 100))
    elif run.model == "mlp":  # as many outputs as classes, or as numbers (labels) in a row
        kwargs.update(input_shape=info["input_shape"], num_classes=info.get("outputs", info.get("num_classes")),
                      task=run.task.value)
    return zoo.get_model(run.model, **kwargs)


def run_sinks(run: RunConfig, config: dict, *, name: str | None = None) -> list:
    """The TensorBoard and MLflow sinks ``run`` asks for (none by default), opened before training; ``name``: the
    MLflow run's (default ``<model>-<dataset>``).

    Also refuses, before any training, a ``--model-dir`` URI whose scheme the filesystem layer
    cannot write (``dbfs:/``...; see :func:`sparknet._fs.filesystem`), so it does not fail at the end.
    """
    if run.model_dir:
        filesystem(run.model_dir)
    if run.tensorboard is None and run.mlflow is None:
        return []
    return make_sinks(run.tensorboard, run.mlflow, run_name=name or f"{run.model}-{run.dataset}", params=config,
                      model_dir=run.model_dir)


def finish_run(run: RunConfig, sinks: list, *, failed: bool, net_params=None, weights=None, solver=None,
               config: dict | None = None, input_shape=None, saved: str | None = None,
               features: list | None = None) -> None:
    """Save the model folder (when asked and training succeeded), then close the sinks (an MLflow sink logs the
    model as an MLflow model: from ``run.model_dir``, or from a folder saved for it alone). ``saved``: a model
    folder the run wrote itself (a Caffe run's), which the sinks log as it is; ``features``: the columns of a table
    the model trained on (:func:`sparknet._parquet.feature_column`, the data's ``info["features"]``), kept in its
    metadata for its MLflow signature."""

    def write(path: str):
        if saved is not None:
            return saved
        return save_model(path, net_params, weights, solver=solver, config=config, input_shape=input_shape,
                          metadata={"features": features} if features else None,
                          overwrite=True)  # run.model_dir replaced as before; a scratch folder is new

    try:
        if not failed and run.model_dir and net_params is not None:
            write(run.model_dir)
            log.info("model saved to %s", run.model_dir)
    finally:
        if sinks:
            close_sinks(sinks, failed=failed, write_model=None if net_params is None and saved is None else write)
