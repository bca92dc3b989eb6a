"""One worker's local work in a round, written once: every exchange calls :class:`WorkerStep`.

A round on a worker is always the same five steps, whatever carries its update afterwards::

    begin    the net starts from the global weights (or, keeping its own, from where it was)
    train    the round's local steps (tau, or its seconds)
    delta    the worker's message: its weights minus the global weights
    check    the update counts only if its loss and every value stayed finite
    compress the message through the round's codec (error feedback in the worker's state)

The device rule lives here too: the net trains on its own device, and everything an exchange sums,
sends or keeps (the global weights, the delta, the wire message) is a float32 CPU tensor.

No pyspark import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparknet._enums import CompressionKind
from sparknet.config import Profile, Streaming
from sparknet.net import TrainStats
from sparknet.strategies import TrainingStrategy, WorkerState, allreduce_gradients, make_compressor

__all__ = ["worker_seed", "round_seed", "seed_draws", "finite_update", "WorkerStream", "StepResult", "WorkerStep",
           "WorkerRanks", "sum_stats", "round_trace"]

log = logging.getLogger(__name__)


def worker_seed(seed: int, index: int) -> int:
    """The seed of worker ``index``'s Net (its data order): distinct per worker, fixed per run; every engine's."""
    return int(seed) * 100_003 + int(index) + 1


def round_seed(seed: int, index: int, round_index: int) -> int:
    """The seed of worker ``index``'s random draws in round (or epoch) ``round_index``, counted from 0."""
    return (worker_seed(seed, index) * 1_000_003 + int(round_index)) % (2**63 - 1)


def seed_draws(seed: int) -> None:
    """Seed torch's global generator (what dropout draws from) for a round.

    Only the CPU's while CUDA is not in use: ``torch.manual_seed`` also queues a lazy seeding of
    every CUDA device, which records a stack trace on each call (about 2 ms, every round).
    """
    if torch.cuda.is_initialized():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def finite_update(stats: TrainStats, delta: torch.Tensor) -> bool:
    """The one rule for a worker's round: its update enters the average only if its loss stayed finite and
    every value of the update is finite (the parameter server applies the same rule to a push's values)."""
    # The least and the largest value are finite exactly when every value is (aminmax carries a NaN through): one
    # pass and no copy of the update (abs().amax() made one: 90 ms a round for 63 M weights, aminmax 8 ms).
    if not stats.finite:
        return False
    if delta.numel() == 0:
        return True
    low, high = torch.aminmax(delta)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def sum_stats(parts: list[TrainStats]) -> TrainStats:
    """One :class:`~sparknet.net.TrainStats` for consecutive calls of ``Net.train``."""
    steps = sum(p.steps for p in parts)
    loss = sum(p.loss * p.steps for p in parts if p.steps) / steps if steps else math.nan
    return TrainStats(steps=steps, samples=sum(p.samples for p in parts), loss=loss,
                      last_loss=parts[-1].last_loss if parts else math.nan, wall_s=sum(p.wall_s for p in parts),
                      finite=all(p.finite for p in parts))


@contextlib.contextmanager
def round_trace(profile: Profile | None, round_index: int, name: str, unit: str = "round"):
    """Trace what runs inside with torch's profiler when ``round_index`` is ``profile``'s round, and write the trace
    and its table of ops (:class:`~sparknet.config.Profile`) into its folder as ``<name>-<unit><round_index>``
    (``unit``: ``"epoch"`` for the parameter server's workers); otherwise nothing. A round that fails writes
    nothing."""
    if profile is None or round_index != profile.round:
        yield
        return
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from sparknet._fs import filesystem

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_initialized() else [])]
    with torch_profile(activities=activities, record_shapes=True) as prof:
        yield
    try:  # a trace that cannot be written costs the fit nothing but the trace
        fs, folder = filesystem(profile.folder)
        fs.create_dir(folder, recursive=True)
        stem = f"{folder}/{name}-{unit}{round_index}"
        with tempfile.TemporaryDirectory(prefix="sparknet-profile-") as tmp:  # the trace is written to a local file
            prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
            with open(os.path.join(tmp, "trace.json"), "rb") as src, fs.open_output_stream(stem + ".json") as out:
                out.write(src.read())
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        with fs.open_output_stream(stem + ".txt") as out:
            out.write(table.encode())
    except (OSError, ValueError) as exc:
        log.warning("%s: %s %d's trace could not be written to %s (%s); the fit goes on without it", name, unit,
                    round_index, profile.folder, exc)
        return
    log.info("%s: %s %d traced into %s.json", name, unit, round_index, stem)


class WorkerStream:
    """One worker's side of a :class:`~sparknet.config.Streaming` exchange: its weights between exchanges.

    ``base`` holds, for every weight, where the worker's progress not yet sent counts from. :meth:`take`
    sends a part's progress (the base moves to where the worker is, and that point is kept until the
    part's new global weights come back); :meth:`arrive` takes them, keeping what the worker trained
    since it sent that part.
    """

    def __init__(self):
        self.base: torch.Tensor | None = None
        self.sent: list[torch.Tensor] = []  # the worker's weights of each part sent and not yet back, oldest first

    def begin(self, net, global_flat: torch.Tensor) -> None:
        """Before the first round (or after a NaN): the worker starts from the global weights."""
        net.set_flat(global_flat)
        self.base = global_flat.detach().to(device="cpu", dtype=torch.float32).clone()
        self.sent.clear()

    def take(self, net, part: slice) -> torch.Tensor:
        """The worker's progress on ``part`` since its base; the base moves to where the worker is."""
        x = net.get_flat()[part].cpu()
        delta = x - self.base[part]
        self.base[part] = x
        self.sent.append(x.clone())
        return delta

    def state_dict(self, net) -> dict:
        """The worker's own weights and where its progress counts from: what a resumed fit continues from."""
        return {"own": net.get_flat(), "base": self.base.clone(), "sent": [x.clone() for x in self.sent]}

    def load_state_dict(self, net, saved: dict) -> None:
        """Continue from :meth:`state_dict`'s dict: the worker's own weights into ``net``."""
        net.set_flat(torch.as_tensor(saved["own"], dtype=torch.float32))
        self.base = torch.as_tensor(saved["base"], dtype=torch.float32).clone()
        self.sent = [torch.as_tensor(x, dtype=torch.float32).clone() for x in saved["sent"]]

    def arrive(self, net, global_flat: torch.Tensor, part: slice) -> None:
        """The global weights of ``part`` came back (the oldest part sent): they, plus what the worker trained
        since it sent that part."""
        sent = self.sent.pop(0) if self.sent else self.base[part].clone()
        shift = global_flat[part].cpu() - sent
        x = net.get_flat()
        x[part] += shift.to(x.device)
        self.base[part] += shift
        net.set_flat(x)


class WorkerRanks:
    """The processes of one worker (``--procs-per-worker G``, ``--model-parallel M``), which train as one process.

    A whole replica on each rank (the default): each rank draws its own minibatch from its own partition; every step
    their gradients are averaged over ``group`` before the solver steps, so their weights and solver states stay
    identical and the worker trains with G times the batch. After the round's local steps :meth:`pool` gives every
    rank the worker's counts: the samples of all its copies and their mean loss.

    Parameters
    ----------
    group : ProcessGroup
        The worker's ranks that hold the same part in each of its copies (a torch.distributed group): a whole
        replica's G ranks, a sharded one's G, a split one's G / M.
    procs : int, optional
        The worker's processes, G (default: ``group``'s size).
    sharded : bool
        The worker's replica is sharded over them (:meth:`~sparknet.net.Net.shard`): FSDP2 averages the gradients
        as it reduce-scatters them, and only the counts are pooled here.
    split : bool
        The worker's layers are split over M of its ranks (:meth:`~sparknet.net.Net.split`): a copy's ranks run
        every step on the same batch, its rows shared among them, so their counts are the same; the G / M copies in
        ``group`` average their gradients as whole replicas do.
    """

    def __init__(self, group, *, procs: int | None = None, sharded: bool = False, split: bool = False):
        import torch.distributed as dist

        self.group, self.size, self.sharded, self.split = group, dist.get_world_size(group), sharded, split
        self.procs = self.size if procs is None else procs
        self.bytes_sent = 0
        """Bytes of gradients this rank allreduced inside its worker so far."""

    @property
    def averages(self) -> bool:
        """The ranks in ``group`` average their gradients every step here (several whole or split copies; a sharded
        replica's FSDP2 does it itself)."""
        return self.size > 1 and not self.sharded

    def after_backward(self, net) -> None:
        self.bytes_sent += allreduce_gradients(net.module, self.group)[0]

    def pool(self, stats: TrainStats) -> TrainStats:
        """The worker's round from this rank's: samples and loss over its copies, finite only if every one's is (a
        split copy's ranks all trained on its batches: their counts are the same)."""
        import torch.distributed as dist

        if self.size == 1:
            return stats
        sums = torch.tensor([stats.samples, stats.loss * stats.samples if stats.samples else 0.0,
                             0.0 if stats.finite else 1.0], dtype=torch.float64)
        dist.all_reduce(sums, group=self.group)
        samples = int(sums[0])
        return dataclasses.replace(stats, samples=samples, loss=float(sums[1]) / samples if samples else math.nan,
                                   finite=bool(sums[2] == 0))


@dataclass(frozen=True)
class StepResult:
    """What one worker's round gives its exchange."""

    stats: TrainStats
    """The local steps' counts, loss and seconds."""
    delta: torch.Tensor | None
    """The update (float32, CPU) when it is finite; ``None`` when it is not (it must not enter the average)."""
    message: torch.Tensor | None = None
    """The compressed update as one ``uint8`` wire message (a codec other than none, a finite update with
    samples); ``None`` otherwise."""

    @property
    def finite(self) -> bool:
        return self.delta is not None

    @property
    def counts(self) -> bool:
        """Whether the update enters the sample-weighted sum (finite, with samples)."""
        return self.delta is not None and self.stats.samples > 0

    @property
    def nbytes(self) -> int:
        """Bytes of the update as it is sent (its wire message, or its float32 values)."""
        return int(self.message.numel()) if self.message is not None else 4 * int(self.delta.numel())


class WorkerStep:
    """One worker's round: begin from the global weights, train, take the delta, check it, compress it.

    Parameters
    ----------
    net : Net
        The worker's net, holding its training data.
    strategy : TrainingStrategy
        Its worker hooks (``worker_begin``, ``worker_delta``; ``after_backward`` every step for a gradient
        strategy, when ``gradient_hook``).
    state : WorkerState, optional
        The strategy's and the codec's state of this worker (a resumed one's).
    compression : str
        The codec of the update.
    streaming : Streaming, optional
        An overlapped or streamed exchange: the worker keeps its own weights (:class:`WorkerStream`) and sends
        one part's progress a round.
    seed : callable, optional
        ``seed(round)`` reseeds torch's generator before the local steps (dropout draws the same numbers
        whichever process runs the round).
    after_train : callable, optional
        ``after_train(net, round)`` after the local steps (fault injection).
    train : callable, optional
        ``train(steps, max_seconds) -> TrainStats`` in place of ``net.train`` (a custom local loop).
    gradient_hook : bool
        Run a gradient strategy's ``after_backward`` in every step (False where the workers share no
        process group, as K nets in one process).
    ranks : WorkerRanks, optional
        This worker is several processes: their gradients are averaged every step, their counts pooled.
    profile : Profile, optional
        Trace one of the worker's rounds with torch's profiler (:func:`round_trace`), its files named ``name``.
    """

    def __init__(self, net, strategy: TrainingStrategy, *, state: WorkerState | None = None,
                 compression: CompressionKind | str = CompressionKind.NONE, streaming: Streaming | None = None,
                 seed: Callable[[int], int] | None = None, after_train: Callable | None = None,
                 train: Callable | None = None, gradient_hook: bool = True, ranks: WorkerRanks | None = None,
                 profile: Profile | None = None, name: str = "worker-0"):
        if train is not None and (ranks is not None or gradient_hook and strategy.needs_gradient_hook):
            raise ValueError(f"{strategy!r} or a worker of several processes allreduces gradients inside net.train; "
                             "a custom train loop cannot run it")
        if ranks is not None and strategy.needs_gradient_hook:
            raise ValueError(f"{strategy!r} allreduces gradients over every rank at every step already; a worker of "
                             "several processes is for strategies that exchange every tau steps")
        self.net, self.strategy, self.streaming = net, strategy, streaming
        self.state = state if state is not None else WorkerState()
        self.stream = WorkerStream()
        # a split worker's int8 chunks start at every weight, so a layer its processes hold whole is quantized alike
        sizes = [t.numel() for ts in net.weights.values() for t in ts] if ranks is not None and ranks.split else None
        codec = make_compressor(compression, sizes)
        self.codec = None if codec.kind is CompressionKind.NONE else codec
        self.seed, self.after_train, self.train = seed, after_train, train
        self.hook = strategy.after_backward if gradient_hook and strategy.needs_gradient_hook else None
        self.ranks = ranks
        if ranks is not None and ranks.averages:
            self.hook = ranks.after_backward
        self.profile, self.name = profile, name

    def run(self, steps: int, global_flat: torch.Tensor, *, round: int = 0, seconds: float | None = None,
            part: slice | None = None, arrived: slice | None = None) -> StepResult:
        """Round ``round``: ``steps`` local steps (or ``seconds``) from ``global_flat``.

        Streamed, the worker goes on from its own weights, first taking the new global weights of ``arrived``
        (the part that came back), and sends its progress on ``part``.
        """
        with round_trace(self.profile, round, self.name):
            return self._run(steps, global_flat, round, seconds, part, arrived)

    def _run(self, steps: int, global_flat: torch.Tensor, round: int, seconds: float | None, part: slice | None,
             arrived: slice | None) -> StepResult:
        net, strategy, stream = self.net, self.strategy, self.stream
        global_flat = global_flat.cpu()  # the exchange's buffers are on the CPU; set_flat moves them to the device
        if self.streaming is None:
            strategy.worker_begin(self.state, net, global_flat)
        elif stream.base is None:
            stream.begin(net, global_flat)
        elif arrived is not None:
            stream.arrive(net, global_flat, arrived)
        if self.seed is not None:
            seed_draws(self.seed(round))
        if self.train is not None:
            stats = self.train(steps, seconds)
        else:
            stats = net.train(steps, max_seconds=seconds, after_backward=self.hook)
        if self.ranks is not None:
            stats = self.ranks.pool(stats)
        if self.after_train is not None:
            self.after_train(net, round)
        if self.streaming is None:
            delta = strategy.worker_delta(self.state, net, global_flat)
        else:
            delta = stream.take(net, part)
        if not finite_update(stats, delta):
            if self.streaming is not None:
                stream.begin(net, global_flat)  # its own weights are lost: it starts again from the global ones
            return StepResult(stats, None)
        message = None
        if self.codec is not None and stats.samples:  # the error-feedback residual is the worker's state
            message = self.codec.encode(delta, self.state)
        return StepResult(stats, delta, message)
