"""Training in one process: the reference loop every distributed engine is measured against.

Run it with::

    sparknet train --model lenet --dataset mnist

It builds the model, loads the data, trains ``--steps`` updates in rounds of ``--tau`` steps with
evaluations on the test set every ``--eval-every`` steps (rounded up to whole rounds; stopping early
at ``--target-accuracy``, ``--rounds`` or ``--epochs``), and writes ``eval`` records and a final ``summary``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import numpy as np
import torch

from sparknet._app import (build_model, finish_run, load_training_data, run_sinks, seed_everything, training_rows,
                           scored_rows)
from sparknet.checkpoint import CheckpointError, open_checkpoints
from sparknet.config import EVAL_EVERY_STEPS, DistributedConfig, RunConfig, TrainConfig
from sparknet.labels import Task
from sparknet.loop import FitPlan, InProcessExchange, ResumeState, returned_summary, run_rounds
from sparknet.metrics import MetricsLogger, returned_scores
from sparknet.net import Net
from sparknet.parallel.runner import split_budget
from sparknet.roads import Road, check_road
from sparknet.strategies import Average

__all__ = ["train_local"]

log = logging.getLogger(__name__)


def train_local(run: RunConfig, dist: DistributedConfig | None = None) -> dict:
    """Train in this process as ``run`` says; returns the summary record.

    This is the round loop of :mod:`sparknet.loop` with one in-process worker: a round is ``dist.tau`` steps (or
    ``dist.round_seconds``), the weights are evaluated every ``run.eval_every`` steps rounded up to whole rounds,
    and the run stops on the first of ``run.steps`` and ``dist``'s stopping rules (``target_accuracy``,
    ``rounds``, ``epochs``).
    ``dist`` also gives the checkpoint settings (``checkpoint_dir``, ``checkpoint_every``,
    ``checkpoint_keep``, ``resume``): a checkpoint holds the weights, the solver with its data
    position and generator, and torch's global generator, so a resumed run repeats an
    uninterrupted one exactly.
    """
    check_road(Road.ONE_PROCESS, run, *([dist] if dist is not None else []))
    threads = run.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    seed_everything(run.seed)
    train, test, info = load_training_data(run)
    net_params = build_model(run, info)
    if dist is not None and dist.max_weight_bytes is not None:
        split_budget(net_params, dist)
    rows, weighted = training_rows(train, info)
    net = Net(net_params, run.solver(), batch_size=run.batch_size, device=run.device, seed=run.seed,
              compute=run.worker().compute, task=run.task, weighted=weighted)
    net.set_training_data(rows)
    net.set_validation_data(scored_rows(test, info))
    config = {"run": TrainConfig(run=run).to_dict()["run"]}
    checkpoints, start = _local_checkpoints(dist, net, config)
    log.info("training %s on %s: %d samples, %d steps of %d, %d threads", run.model, run.dataset,
             len(train), run.steps, run.batch_size, threads)
    sinks = run_sinks(run, config)
    failed = True
    try:
        summary = _train_loop(run, net, sinks=sinks, info=info, threads=threads, checkpoints=checkpoints,
                              start=start, dist=dist)
        failed = False
    finally:
        finish_run(run, sinks, failed=failed, net_params=net_params, weights=net.get_weights(), solver=run.solver(),
                   config=config, features=info.get("features"))
    return summary


def _local_checkpoints(dist: DistributedConfig | None, net: Net, config: dict):
    """The checkpoints ``dist`` asks for (or None) and the state to start from (or None).

    A folder that cannot be written, or a checkpoint of another model, fails here, before training.
    """
    checkpoints, ckpt = open_checkpoints(dist, config, net)
    if ckpt is None:
        return checkpoints, None
    state = ckpt.state
    if state.get("engine") != "local":
        raise CheckpointError(f"checkpoint {ckpt.path} was written by the {state.get('engine')!r} engine; resume it "
                              "with the same --workers and --engine, or choose another --checkpoint-dir")
    net.set_weights(ckpt.weights)
    net.load_solver_state({**state["solver"], "generator": state["solver"]["generator"].to(torch.uint8)})
    torch.set_rng_state(state["torch_rng"].to(torch.uint8))
    log.info("resuming from %s: step %d", ckpt.path, state["steps"])
    return checkpoints, {**state, "round": ckpt.round}


def _train_loop(run: RunConfig, net: Net, *, sinks: list, info: dict, threads: int, checkpoints=None,
                start: dict | None = None, dist: DistributedConfig | None = None) -> dict:
    """The round loop with one in-process worker: a round is ``tau`` steps (or ``round_seconds``), and the weights
    are evaluated every ``eval_every`` steps, rounded up to whole rounds. An evaluated round writes its ``eval``
    record, and a round due for a checkpoint writes one."""
    config = dist or DistributedConfig()
    eval_every = run.eval_every
    if eval_every is None:  # toward a target every round, within the evaluation budget, as the Spark engines do
        eval_every = 1 if config.toward_target else EVAL_EVERY_STEPS
    every = 1 if config.tau is None else -(-eval_every // config.tau)  # whole rounds of tau steps
    strategy = Average()
    resume = ResumeState() if start is None else ResumeState(
        round=int(start["round"]), steps_done=int(start["steps"]), samples_done=int(start["samples"]),
        **{key: start.get(key) for key in ("average", "early_stop", "best")})
    records: list[dict] = []
    with MetricsLogger(run.metrics_out, progress=not run.quiet, total=run.steps, sinks=sinks,
                       early_stop=config.toward_target) as metrics:
        plan = FitPlan.from_config(replace(config, auto_tau=False, eval_every_rounds=every), strategy, steps=run.steps,
                                   dataset_rows=net.num_training_samples, resume=resume)
        progress = plan.progress
        score, said = ("r2", "R-squared") if net.task is Task.REGRESSION else ("accuracy", "accuracy")  # its target
        exchange = InProcessExchange([net], strategy, evaluator=net, metrics=metrics, profile=run.worker().profile)
        exchange.score_shown_as = "r2" if score == "r2" else "acc"
        exchange.steps_done = progress.steps_done
        if start is not None:
            exchange.train_s = float(start["train_s"])
            metrics.progress(progress.steps_done)

        def on_record(record: dict) -> None:
            records.append(record)
            if checkpoints is not None and (checkpoints.due(progress.round) or "stop_reason" in record):
                net.set_flat(exchange.latest)  # what the next round starts from
                state = {"engine": "local", "steps": progress.steps_done, "samples": progress.samples_done,
                         "train_s": exchange.train_s, "solver": net.solver_state(), "torch_rng": torch.get_rng_state(),
                         **plan.kept_state()}
                checkpoints.save(progress.round, net.get_weights(), state)
            if "val_loss" not in record and "screen_loss" not in record:
                return
            out = {"event": "eval", "step": progress.steps_done, "samples": progress.samples_done,
                   "wall_s": metrics.elapsed()}
            if f"val_{score}" in record:  # the whole test set
                exchange.accuracy = record[f"val_{score}"]
                out.update({"loss": record["val_loss"], f"test_{score}": record[f"val_{score}"]})
                log.info("step %d: test %s %.4f, test loss %.4f", progress.steps_done, said, record[f"val_{score}"],
                         record["val_loss"])
            elif f"screen_{score}" in record:  # a fixed sample of it (EvalPlan)
                exchange.accuracy = record[f"screen_{score}"]
                out.update({"screen_loss": record["screen_loss"], f"screen_{score}": record[f"screen_{score}"],
                            "screen_rows": record["screen_rows"]})
                log.info("step %d: test %s %.4f on a sample of %d rows", progress.steps_done, said,
                         record[f"screen_{score}"], record["screen_rows"])
            metrics.write(out)
            metrics.progress(0, loss=exchange.loss, **{exchange.score_shown_as: exchange.accuracy})

        if progress.steps_done < run.steps:
            net.set_flat(run_rounds(exchange, plan, strategy.init_global(net.get_flat()), on_record=on_record))
            scores, loss = returned_scores(records, plan.average is not None)  # the average's, where it is kept
        else:  # resumed from the end of the run: nothing left to train
            last = net.evaluate()
            scores, loss = last.metrics, last.loss
        summary = {
            "event": "summary", "model": run.model, "dataset": run.dataset, "engine": "local", "workers": 1,
            "steps": progress.steps_done, "samples": progress.samples_done, "wall_s": metrics.elapsed(),
            "train_s": exchange.train_s,
            "samples_per_s": progress.samples_done / exchange.train_s if exchange.train_s else None,
            "test_accuracy": scores.get("accuracy"), **{f"test_{k}": v for k, v in scores.items()},
            "test_loss": loss, "validation_weight": net.validation_weight, "threads": threads,
            "rounds": progress.round, "bytes_communicated": 0,
            "stop_reason": records[-1].get("stop_reason") if records else None,
            **returned_summary(records, config.weight_ema),
        }
        if start is not None:
            summary["resumed_from_step"] = int(start["steps"])
        if "corpus" in info:
            summary["bits_per_char"] = loss / np.log(2)
        metrics.write(summary)
    return summary
