"""Executor side of asynchronous training: the function each partition's task runs.

The driver (:mod:`sparknet.ps.session`) hands :func:`train_partition` a :class:`TaskSpec` of plain values.
Each task pulls the server's weights (step 0), trains, and every ``tau`` steps (and after its last) pushes its
weights or its change since the last pull and loads what the reply says (``local += mix * (reply - local)``),
one round trip, waiting for nobody else; then it yields one record of what it did. Also here: :func:`scatter`,
the executor half of the shuffle between epochs.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from sparknet._malloc import keep_freed_memory
from sparknet._transport import ClientKeys
from sparknet.layers import NetParams
from sparknet.step import round_seed, round_trace
from sparknet.faults import due_fault
from sparknet.config import Compute, Profile
from sparknet.net import Net
from sparknet.ps.client import PSClient
from sparknet.ps.wire import Status
from sparknet.solvers import SolverConfig
from sparknet.spark.rounds.executor import task_attempt, worker_failure

__all__ = ["TaskSpec", "train_partition", "scatter", "blocks_from_chunks", "concat_blocks", "pick_fields"]


@dataclass(frozen=True)
class TaskSpec:
    """Everything a task needs, as plain values (it travels in the job's closure)."""

    endpoint: str
    """``tcp://host:port`` of the parameter server."""
    job_id: bytes
    """This Spark job's id on the wire."""
    secret: bytes = field(repr=False)
    """This job's HMAC key (never sent over the server's socket, never in a repr or a log line)."""
    net: dict
    """``{"netparams": NetParams.to_dict()}`` (plain data), or ``{"module": a torch.nn.Module}`` for a plain module."""
    solver: dict
    """``SolverConfig.to_dict()``."""
    batch_size: int
    tau: int
    seed: int
    epoch: int
    iteration: int
    """The solver iteration this epoch starts at (keeps the learning-rate policy going across epochs)."""
    shuffle: bool
    """Reshuffle the partition's rows (every pass over it)."""
    sample_shape: tuple[int, ...] | None
    timeout_s: float
    threads: int = 1
    device: str = "cpu"
    compute: Compute = field(default_factory=Compute)
    """Mixed precision, compilation and memory order of the task's net."""
    steps: int | None = None
    """Most steps per task (default: one pass over the partition)."""
    train_step: Callable | None = None
    """A user's ``train_step(net, (x, y))``; None: ``net.train(1)`` on the partition."""
    faults: tuple = ()
    """Injected faults (:mod:`sparknet.faults`, tests): ``round`` counts the task's pushes from 1; a fault fires
    after the steps before that push, on its ``attempt``."""
    loss: Callable | None = None
    """The loss of a plain module."""
    weighted: bool = False
    """The labels carry each row's sample weight last (:class:`sparknet.net.Net`'s ``weighted``)."""
    profile: Profile | None = None
    """Trace the task's epoch with torch's profiler where it is the epoch ``profile`` names (``--profile-dir``):
    ``ps-worker-<i>-epoch<E>`` (:func:`sparknet.step.round_trace`)."""
    keys: ClientKeys | None = field(default=None, repr=False)
    """The server's keys a worker connects with (its secret key never in a repr or a log line); the session
    always sets them: a task without them cannot reach the server."""


def pick_fields(names: tuple[str, str]):
    """``row -> (row[features], row[label])`` for an RDD of Rows or dicts (TensorOnSpark's feed names)."""
    features, label = names

    def pick(row):
        try:
            return row[features], row[label]
        except (KeyError, ValueError, TypeError, IndexError):
            raise ValueError(f"an RDD element has no fields {features!r} and {label!r}: {type(row).__name__}") from None

    return pick


def blocks_from_chunks(chunks: Iterable) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(x, y, info)`` chunks of :mod:`sparknet.spark.data` -> ``(x, y)`` blocks (empty ones dropped)."""
    for x, y, _ in chunks:
        if len(y):
            yield x, y


def concat_blocks(blocks: Iterable) -> tuple[np.ndarray | None, np.ndarray | None]:
    """All ``(x, y)`` blocks of a partition as one ``(x, y)``; ``(None, None)`` when empty."""
    xs, ys = [], []
    for x, y in blocks:
        if len(y):
            xs.append(x)
            ys.append(y)
    if not xs:
        return None, None
    if len(xs) == 1:
        return xs[0], ys[0]
    return np.concatenate(xs), np.concatenate(ys)


def scatter(seed: int, epoch: int, num_partitions: int):
    """The ``mapPartitionsWithIndex`` function of the between-epoch shuffle.

    Every row goes to a partition drawn uniformly at random (seeded by ``seed``, ``epoch`` and the source partition),
    as ``(target, (x_rows, y_rows))`` blocks for ``partitionBy``."""

    def run(index: int, blocks: Iterable) -> Iterator:
        x, y = concat_blocks(blocks)
        if x is None:
            return
        rng = np.random.default_rng([seed, epoch, index])
        target = rng.integers(0, num_partitions, size=len(y))
        order = np.argsort(target, kind="stable")
        bounds = np.searchsorted(target[order], np.arange(num_partitions + 1))
        for t in range(num_partitions):
            idx = order[bounds[t]:bounds[t + 1]]
            if len(idx):
                yield t, (x[idx], y[idx])

    return run


def _build_net(spec: TaskSpec, index: int):
    if "netparams" in spec.net:
        model = NetParams.from_dict(spec.net["netparams"])
    else:
        model = spec.net["module"]  # this task's own copy, unpickled by Spark from the job's closure
    keep_freed_memory()
    seed = round_seed(spec.seed, index, spec.epoch)
    net = Net(model, SolverConfig.from_dict(spec.solver), loss=spec.loss, batch_size=spec.batch_size,
              device=spec.device, seed=seed, compute=spec.compute, weighted=spec.weighted)
    if spec.iteration:
        net.set_iteration(spec.iteration)
    return net


def _batches(x: np.ndarray, y: np.ndarray, batch: int, shuffle: bool, rng: np.random.Generator):
    """Endless minibatches (whole ones only, unless the partition is smaller than one)."""
    n = len(y)
    b = min(batch, n)
    while True:
        order = rng.permutation(n) if shuffle else np.arange(n)
        for start in range(0, n - b + 1, b):
            idx = order[start:start + b]
            yield x[idx], y[idx]


def train_partition(spec: TaskSpec):
    """The ``mapPartitionsWithIndex`` function that trains one partition against the server.

    A failure raises :func:`sparknet.spark.rounds.executor.worker_failure`, which the driver decodes into a
    :class:`~sparknet.errors.WorkerError` naming the partition."""

    def run(index: int, blocks: Iterable) -> Iterator[dict]:
        try:
            yield from _train_partition(spec, index, blocks)
        except Exception as exc:
            raise worker_failure(index, exc) from None

    return run


def wire_attempt(ctx=None) -> int:
    """This task attempt's identity on the wire, unique within the application: the low 32 bits of Spark's task
    attempt id (:func:`~sparknet.spark.rounds.executor.task_attempt`; 0 outside a task). Not the attempt number, which a
    stage submitted again starts from 0 again: the server would refuse such a task's steps as replays."""
    return task_attempt(ctx)[1] & 0xFFFFFFFF


def _train_partition(spec: TaskSpec, index: int, blocks: Iterable) -> Iterator[dict]:
    t_start = time.perf_counter()
    attempt, _ = task_attempt()
    x, y = concat_blocks(blocks)
    record = {"event": "task", "worker": index, "host": socket.gethostname(), "attempt": attempt, "epoch": spec.epoch,
              "rows": 0, "steps": 0, "samples": 0, "loss": math.nan, "last_loss": math.nan, "pushes": 0,
              "duplicates": 0, "comm_s": 0.0, "train_s": 0.0, "wall_s": 0.0, "max_latency_s": 0.0}
    if x is None:
        record["wall_s"] = time.perf_counter() - t_start
        yield record
        return
    torch.set_num_threads(spec.threads)
    if spec.sample_shape is not None:
        x = x.reshape(len(x), *spec.sample_shape)
    net = _build_net(spec, index)
    steps = max(1, len(y) // spec.batch_size)
    if spec.steps is not None:
        steps = min(steps, spec.steps)
    if spec.train_step is None:
        net.set_training_data((x, y), shuffle=spec.shuffle, batched=True)
        batches = None
    else:
        batches = _batches(x, y, spec.batch_size, spec.shuffle,
                           np.random.default_rng([spec.seed, spec.epoch, index]))
    record["rows"], record["precision"] = len(y), net.compute.precision.value
    loss_sum = 0.0
    losses = 0
    with (PSClient(spec.endpoint, spec.job_id, spec.secret, keys=spec.keys, worker=index, attempt=wire_attempt(),
                   timeout=spec.timeout_s) as client,
          round_trace(spec.profile, spec.epoch, f"ps-worker-{index}", unit="epoch")):  # its pulls and pushes too
        reply = client.pull(0)
        record["comm_s"] += reply.latency_s
        net.set_flat(torch.from_numpy(reply.weights))
        base, base_version, send_delta = reply.weights, reply.version, reply.send_delta
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            if batches is None:
                stats = net.train(1)
                loss, samples = stats.last_loss, stats.samples
            else:
                xb, yb = next(batches)
                out = spec.train_step(net, (torch.from_numpy(xb), torch.from_numpy(yb)))
                loss = getattr(out, "last_loss", out)
                loss = float(loss) if isinstance(loss, (int, float)) or hasattr(loss, "item") else None
                samples = len(yb)
            record["train_s"] += time.perf_counter() - t0
            record["samples"] += samples
            if loss is not None:  # None: a custom step that reports no loss
                if not math.isfinite(loss):  # NaN included: it once passed as "no loss" and trained on
                    raise FloatingPointError(f"the loss became {loss} at step {step} of epoch "
                                             f"{spec.epoch}; lower the learning rate")
                loss_sum += loss
                losses += 1
                record["last_loss"] = loss
            if step % spec.tau == 0 or step == steps:
                fault = due_fault(spec.faults, index, record["pushes"] + 1, attempt)
                if fault is not None:
                    fault.fire(net)
                flat = net.get_flat().numpy()
                if not np.isfinite(flat).all():  # never sent: the server would refuse it (and count it) anyway
                    raise FloatingPointError(f"worker {index}: its weights hold NaN or infinite values at step "
                                             f"{step} of epoch {spec.epoch}; lower the learning rate")
                reply = client.push(step, flat - base if send_delta else flat, base_version)
                record["pushes"] += 1
                record["duplicates"] += reply.status is Status.DUPLICATE
                record["comm_s"] += reply.latency_s
                record["max_latency_s"] = max(record["max_latency_s"], reply.latency_s)
                new = reply.weights if reply.mix >= 1.0 else flat + np.float32(reply.mix) * (reply.weights - flat)
                net.set_flat(torch.from_numpy(np.ascontiguousarray(new, dtype=np.float32)))
                base, base_version, send_delta = reply.weights, reply.version, reply.send_delta
            record["steps"] = step
    record["loss"] = loss_sum / losses if losses else math.nan
    record["wall_s"] = time.perf_counter() - t_start
    yield record

