"""Training in one process: the reference loop every distributed engine is measured against.

Run it with::

    sparknet train --model lenet --dataset mnist

It builds the model, loads the data, trains ``--steps`` updates with evaluations on the
test set every ``--eval-every`` steps, and writes ``eval`` records and a final ``summary``.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from sparknet._app import build_model, finish_run, load_training_data, run_sinks, seed_everything
from sparknet.checkpoint import CheckpointError, CheckpointManager, model_fingerprint
from sparknet.config import DistributedConfig, RunConfig, TrainConfig
from sparknet.metrics import MetricsLogger
from sparknet.net import Net

__all__ = ["train_local"]

log = logging.getLogger(__name__)


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
