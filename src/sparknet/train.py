"""Training in one process: the reference loop every distributed engine is measured against.

Run it with::

    sparknet train --model lenet --dataset mnist

It builds the model, loads the data, trains ``--steps`` updates with evaluations on the
test set every ``--eval-every`` steps, and writes ``eval`` records and a final ``summary``.
"""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import torch

from sparknet.checkpoint import CheckpointError
from sparknet.config import DistributedConfig, RunConfig, TrainConfig
from sparknet.metrics import MetricsLogger
from sparknet.net import Net

__all__ = ["train_local", "load_training_data", "build_model", "seed_everything", "run_sinks", "finish_run"]

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
    from sparknet import datasets

    if run.data is not None:
        from sparknet._parquet import read_parquet_dataset

        train, test, info = read_parquet_dataset(run.data)
        return train, test, info
    name = run.dataset.lower()
    if name == "shakespeare":
        corpus = datasets.shakespeare()
        seq_len = 100
        return (corpus.sequences("train", seq_len), corpus.sequences("validation", seq_len),
                {"vocab_size": corpus.vocab_size, "corpus": corpus, "seq_len": seq_len})
    data = datasets.load_dataset(name)
    train, test = data.train, data.test
    return train, test, {"input_shape": tuple(train.x.shape[1:]), "num_classes": int(train.y.max()) + 1}


def build_model(run: RunConfig, info: dict):
    """The zoo model ``run.model`` shaped for the data ``info`` describes."""
    from sparknet import zoo

    kwargs: dict = {"batch_size": run.batch_size}
    name = run.model.lower()
    if name == "char_lstm":
        kwargs.update(vocab_size=info["vocab_size"], seq_len=info.get("seq_len", 100))
    elif name in ("mlp",):
        kwargs.update(input_shape=info["input_shape"], num_classes=info["num_classes"])
    return zoo.get_model(name, **kwargs)


def run_sinks(run: RunConfig, config: dict) -> list:
    """The TensorBoard and MLflow sinks ``run`` asks for (none by default)."""
    if run.tensorboard is None and run.mlflow is None:
        return []
    from sparknet.tools.sinks import make_sinks

    return make_sinks(run.tensorboard, run.mlflow, run_name=f"{run.model}-{run.dataset}", params=config,
                      model_dir=run.save_model)


def finish_run(run: RunConfig, sinks: list, *, failed: bool, net_params=None, weights=None, solver=None,
               config: dict | None = None, input_shape=None) -> None:
    """Save the model folder (when asked and training succeeded), then close the sinks."""
    try:
        if not failed and run.save_model and net_params is not None:
            from sparknet._model_io import save_model

            save_model(run.save_model, net_params, weights, solver=solver, config=config, input_shape=input_shape,
                       overwrite=True)
            log.info("model saved to %s", run.save_model)
    finally:
        if sinks:
            from sparknet.tools.sinks import close_sinks

            close_sinks(sinks, failed=failed)


def train_local(run: RunConfig, dist: DistributedConfig | None = None) -> dict:
    """Train in this process as ``run`` says; returns the summary record.

    ``dist`` is read for its checkpoint settings only (``checkpoint_dir``, ``checkpoint_every``,
    ``checkpoint_keep``, ``resume``): here a round is one ``eval_every`` interval of steps, and
    a checkpoint holds the weights, the solver with its data position and generator, and
    torch's global generator, so a resumed run repeats an uninterrupted one exactly.
    """
    threads = run.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    seed_everything(run.seed)
    train, test, info = load_training_data(run)
    net_params = build_model(run, info)
    net = Net(net_params, run.solver(), batch_size=run.batch_size, device=run.device, seed=run.seed)
    net.set_training_data(train)
    net.set_validation_data(test)
    config = {"run": TrainConfig(run=run).to_dict()["run"]}
    checkpoints, start = _local_checkpoints(dist, net, config)
    log.info("training %s on %s: %d samples, %d steps of %d, %d threads", run.model, run.dataset,
             len(train), run.steps, run.batch_size, threads)
    sinks = run_sinks(run, config)
    failed = True
    try:
        summary = _train_loop(run, net, sinks=sinks, info=info, threads=threads, checkpoints=checkpoints,
                              start=start)
        failed = False
    finally:
        finish_run(run, sinks, failed=failed, net_params=net_params, weights=net.get_weights(), solver=run.solver(),
                   config=config)
    return summary


def _local_checkpoints(dist: DistributedConfig | None, net: Net, config: dict):
    """The checkpoint manager ``dist`` asks for (or None) and the state to start from (or None).

    A folder that cannot be written, or a checkpoint of another model, fails here, before training.
    """
    if dist is None or not dist.checkpoint_dir:
        return None, None
    from sparknet.checkpoint import CheckpointManager, model_fingerprint

    manager = CheckpointManager(dist.checkpoint_dir, keep=dist.checkpoint_keep)
    manager.check_writable()
    manager.every = dist.checkpoint_every
    manager.config = config
    if not dist.resume or manager.latest() is None:
        if dist.resume:
            log.info("no checkpoint in %s yet: starting from the beginning", dist.checkpoint_dir)
        return manager, None
    ckpt = manager.load(expect_fingerprint=model_fingerprint(net.get_weights()))
    state = ckpt.state
    if state.get("engine") != "local":
        raise CheckpointError(f"checkpoint {ckpt.path} was written by the {state.get('engine')!r} engine; resume it "
                              "with the same --workers and --engine, or choose another --checkpoint-dir")
    net.set_weights(ckpt.weights)
    solver = dict(state["solver"])
    solver["generator"] = solver["generator"].to(torch.uint8)
    net.load_solver_state(solver)
    torch.set_rng_state(state["torch_rng"].to(torch.uint8))
    log.info("resuming from %s: step %d", ckpt.path, state["steps"])
    return manager, state


def _save_local(checkpoints, net: Net, interval: int, *, steps: int, samples: int, train_s: float) -> None:
    state = {"engine": "local", "steps": steps, "samples": samples, "train_s": train_s,
             "solver": net.solver_state(), "torch_rng": torch.get_rng_state()}
    checkpoints.save(interval, net.get_weights(), state, config=checkpoints.config)


def _train_loop(run: RunConfig, net: Net, *, sinks: list, info: dict, threads: int, checkpoints=None,
                start: dict | None = None) -> dict:
    samples = 0 if start is None else int(start["samples"])
    train_s = 0.0 if start is None else float(start["train_s"])
    last_eval = None
    with MetricsLogger(run.metrics_out, progress=not run.quiet, total=run.steps, sinks=sinks) as metrics:
        done = 0 if start is None else int(start["steps"])
        interval = 0 if start is None else -(-done // run.eval_every)
        if start is not None:
            metrics.progress(done)
        while done < run.steps:
            chunk = min(run.eval_every, run.steps - done)
            # Train in short pieces so the progress line moves; evaluate at eval_every.
            piece_done = 0
            while piece_done < chunk:
                piece = min(50, chunk - piece_done)
                stats = net.train(piece)
                piece_done += stats.steps
                samples += stats.samples
                train_s += stats.wall_s
                metrics.progress(stats.steps, loss=stats.loss, lr=net.learning_rate,
                                 acc=None if last_eval is None else last_eval.accuracy)
                if not stats.finite:
                    raise FloatingPointError(
                        f"the loss became {stats.last_loss} at step {done + piece_done}; "
                        "lower the learning rate (--lr) or check the data for NaN values")
            done += piece_done
            last_eval = net.evaluate()
            metrics.write({"event": "eval", "step": done, "samples": samples, "wall_s": metrics.elapsed(),
                           "loss": last_eval.loss, "test_accuracy": last_eval.accuracy})
            metrics.progress(0, loss=stats.loss, acc=last_eval.accuracy)
            log.info("step %d: test accuracy %.4f, test loss %.4f", done, last_eval.accuracy, last_eval.loss)
            interval += 1
            if checkpoints is not None and (interval % checkpoints.every == 0 or done >= run.steps):
                _save_local(checkpoints, net, interval, steps=done, samples=samples, train_s=train_s)
        if last_eval is None:  # resumed from the end of the run: nothing left to train
            last_eval = net.evaluate()
        wall = metrics.elapsed()
        summary = {
            "event": "summary", "model": run.model, "dataset": run.dataset, "engine": "local", "workers": 1,
            "steps": done, "samples": samples, "wall_s": wall, "train_s": train_s,
            "samples_per_s": samples / train_s if train_s else None,
            "test_accuracy": last_eval.accuracy, "test_loss": last_eval.loss, "threads": threads,
            "rounds": 0, "bytes_communicated": 0,
        }
        if start is not None:
            summary["resumed_from_step"] = int(start["steps"])
        if "corpus" in info:
            summary["bits_per_char"] = last_eval.loss / np.log(2)
        metrics.write(summary)
    return summary
