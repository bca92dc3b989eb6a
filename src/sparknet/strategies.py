"""Training strategies: what a worker does around its local steps, and how the results merge.

The engines (one process, Spark rounds, Spark barrier) all run the same loop::

    global_flat = strategy.init_global(initial_weights)           # driver / every rank
    every round:
        worker:  strategy.worker_begin(state, net, global_flat)   # load (or pull toward) the global weights
                 net.train(tau, max_seconds, after_backward=strategy.after_backward)
                 delta = strategy.worker_delta(state, net, global_flat)   # what is sent: change since global
        engine:  mean_delta = sum(n_i * delta_i) / sum(n_i)          # weights = samples processed
        driver:  global_flat = strategy.apply(global_flat, mean_delta, num_workers)

Deltas are one flat float32 buffer each (one message per worker per round). A strategy
keeps its driver-side state (e.g. DiLoCo's outer momentum) on the object and its
worker-side state in a ``WorkerState`` the engine keeps per worker.

This module never imports pyspark.
"""

from __future__ import annotations

import abc
import logging
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sparknet._enums import CompressionKind, parse_enum
from sparknet.config import Strategy, check_outer_step
from sparknet.weights import local_view

log = logging.getLogger(__name__)

__all__ = [
    "TrainingStrategy", "WorkerState", "Average", "DiLoCo", "EASGD", "Sync", "make_strategy", "allreduce_gradients",
    "Compressor", "NoCompression", "HalfCompression", "Int8Compression", "Compressed", "make_compressor",
    "CompressionKind", "Downlink", "AutoTau",
]


@dataclass
class WorkerState:
    """What one worker keeps between rounds (its own weights for EASGD, error-feedback residuals...)."""

    local_flat: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


class TrainingStrategy(abc.ABC):
    """One way of combining K workers' local training. Subclasses override the hooks they need."""

    name: Strategy
    #: Whether the engine must call :meth:`after_backward` (gradient allreduce every step).
    needs_gradient_hook: bool = False
    #: Whether workers keep their own weights between rounds instead of restarting from the global ones.
    keeps_local_weights: bool = False
    #: Whether :meth:`apply` takes a part of the weights at a time, a round late (overlapped and streamed
    #: exchanges, :class:`sparknet.loop.Streaming`); such a strategy leaves the worker hooks as they are here.
    streams: bool = False

    def __init__(self, **_ignored):
        pass

    def init_global(self, flat: torch.Tensor) -> torch.Tensor:
        """The global weights training starts from (driver side)."""
        return flat.clone()

    def worker_begin(self, state: WorkerState, net, global_flat: torch.Tensor) -> None:
        """Load the global weights into the worker's net before its local steps."""
        net.set_flat(global_flat)

    def worker_delta(self, state: WorkerState, net, global_flat: torch.Tensor) -> torch.Tensor:
        """The worker's message for this round: its weights minus the global weights (``global_flat`` on the CPU,
        as :meth:`~sparknet.net.Net.get_flat` is, whatever device the net trains on)."""
        return net.get_flat().sub_(global_flat)  # get_flat's own buffer: no second copy of the weights

    def apply(self, global_flat: torch.Tensor, mean_delta: torch.Tensor, num_workers: int,
              part: slice | None = None) -> torch.Tensor:
        """New global weights from the sample-weighted mean of the workers' deltas: the global weights plus
        the strategy's :meth:`_change`.

        ``part``: the mean covers only ``global_flat[part]`` (a streamed exchange's fragment; only a
        strategy that :attr:`streams` gets one); the rest of the weights stays as it is.
        """
        if part is not None and not self.streams:
            raise ValueError(f"{self!r} updates the whole weights at once; overlapped or streamed exchanges need "
                             "average or diloco")
        change = self._change(mean_delta, num_workers, part)
        if part is None:
            return global_flat + change
        out = global_flat.clone()
        out[part] += change
        return out

    def _change(self, mean_delta: torch.Tensor, num_workers: int, part: slice | None) -> torch.Tensor:
        """What :meth:`apply` adds to the global weights (or to their ``part``): the mean delta itself, by default."""
        return mean_delta

    def after_backward(self, net) -> None:  # pragma: no cover - only strategies that need it override
        """Called between backward and the optimizer step (gradient strategies)."""

    def set_link(self, link) -> None:
        """The simulated link every exchange of the strategy's own waits for (gradient strategies)."""

    def gradient_traffic(self) -> tuple[int, float]:
        """Bytes this worker has sent by :meth:`after_backward`, and seconds waited on the link for them."""
        return 0, 0.0

    def state_dict(self) -> dict:
        """Driver-side state for checkpoints."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Average(TrainingStrategy):
    """SparkNet's scheme: the new global weights are the sample-weighted mean of the workers'."""

    name = Strategy.AVERAGE
    streams = True


class DiLoCo(TrainingStrategy):
    """DiLoCo (Douillard et al. 2023): the averaged change is the gradient of an outer optimizer.

    The outer gradient is ``global - mean(worker weights) = -mean_delta``; the outer step is
    SGD with Nesterov momentum, as ``torch.optim.SGD(nesterov=True)`` computes it::

        v = momentum * v + g;   global -= outer_lr * (g + momentum * v)

    With ``outer_lr=1`` and ``outer_momentum=0`` this is plain averaging; with ``outer_lr=1``, a momentum
    of 0.5-0.7 and the workers' own SGD, it is averaging with slow momentum (SlowMo, Wang et al. 2020,
    in Nesterov's form). The momentum ``v`` is the driver's state (every rank's, identically, in the
    barrier engine).

    Parameters
    ----------
    outer_lr : float
        The paper's default, 0.7.
    outer_momentum : float
        The paper's default, 0.9.
    nesterov : bool
        Nesterov momentum (the paper's choice) or heavy-ball momentum.
    """

    name = Strategy.DILOCO
    streams = True

    def __init__(self, outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True, **_ignored):
        check_outer_step(outer_lr, outer_momentum)
        self.outer_lr, self.outer_momentum, self.nesterov = float(outer_lr), float(outer_momentum), bool(nesterov)
        self.velocity: torch.Tensor | None = None

    def apply(self, global_flat, mean_delta, num_workers, part=None):
        if self.velocity is None:
            self.velocity = torch.zeros_like(global_flat)
        return super().apply(global_flat, mean_delta, num_workers, part)

    def _change(self, mean_delta, num_workers, part):
        grad = -mean_delta
        velocity = self.velocity if part is None else self.velocity[part]  # a view: a fragment's momentum alone
        velocity.mul_(self.outer_momentum).add_(grad)
        step = grad + self.outer_momentum * velocity if self.nesterov else velocity
        return -self.outer_lr * step

    def state_dict(self):
        return {"velocity": None if self.velocity is None else self.velocity.clone()}

    def load_state_dict(self, state):
        v = state.get("velocity")
        self.velocity = None if v is None else v.clone()

    def __repr__(self):
        return f"DiLoCo(outer_lr={self.outer_lr}, outer_momentum={self.outer_momentum}, nesterov={self.nesterov})"


class EASGD(TrainingStrategy):
    """Synchronous elastic averaging SGD (Zhang, Choromanska, LeCun 2015).

    Each worker keeps its own weights ``x_i``; the global weights are the center ``c``.
    At every synchronization, with moving rate ``alpha``::

        x_i <- x_i - alpha * (x_i - c)          (on the worker)
        c   <- c + alpha * sum_i (x_i - c)      (on the driver; = c + beta * mean_i (x_i - c))

    both from the values before the update. ``alpha`` defaults to ``beta / K`` with
    ``beta = 0.9``, the paper's choice.
    """

    name = Strategy.EASGD
    keeps_local_weights = True

    def __init__(self, num_workers: int = 1, beta: float = 0.9, alpha: float | None = None, **_ignored):
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.num_workers = int(num_workers)
        self.alpha = float(alpha) if alpha is not None else beta / self.num_workers
        if not 0 < self.alpha * self.num_workers <= 1:
            raise ValueError(f"alpha * K must be in (0, 1] for a stable center, got {self.alpha} * {self.num_workers}")

    def worker_begin(self, state, net, global_flat):
        net.set_flat(global_flat if state.local_flat is None else state.local_flat)

    def worker_delta(self, state, net, global_flat):
        x = net.get_flat()
        delta = x - global_flat
        state.local_flat = x - self.alpha * delta
        return delta

    def _change(self, mean_delta, num_workers, part):
        return (self.alpha * num_workers) * mean_delta

    def __repr__(self):
        return f"EASGD(alpha={self.alpha:.4g}, num_workers={self.num_workers})"


def allreduce_gradients(module: torch.nn.Module, group=None, link=None) -> tuple[int, float]:
    """Average the gradients of ``module``'s weights over ``group`` in place: one allreduce of one flat buffer.

    What a gradient strategy (:class:`Sync`) runs between backward and the solver's step, and what the ranks of a
    worker of several processes run every step (:class:`~sparknet.step.WorkerRanks`). A weight without a gradient
    counts as zeros. Returns the bytes allreduced and the seconds waited for ``link`` (a simulated network).
    """
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [local_view(p.grad) for p in params]  # a split layer's: this rank's part (a DTensor's local shard)
    flat = torch.cat([g.reshape(-1) for g in grads])
    nbytes, world = flat.numel() * flat.element_size(), dist.get_world_size(group)
    waited = link.wait_allreduce(nbytes, world) if link is not None else 0.0
    dist.all_reduce(flat, group=group)
    flat /= world
    for grad, g in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(g.view_as(grad))
    return nbytes, waited


class Sync(TrainingStrategy):
    """The naive scheme: gradients averaged across workers at every step (large-batch SGD).

    Needs a process group (the barrier engine): :meth:`after_backward` allreduces every
    gradient as one flat buffer. Weights stay identical on every worker, so the round's
    synchronization changes nothing and only marks where metrics are taken.
    """

    name = Strategy.SYNC
    needs_gradient_hook = True

    def __init__(self, group=None, link=None, **_ignored):
        self.group = group
        self.link = link
        """A :class:`sparknet.link.LinkModel` every gradient allreduce waits for (the engine sets it)."""
        self.bytes_sent = 0
        self.link_s = 0.0

    def after_backward(self, net) -> None:
        nbytes, waited = allreduce_gradients(net.module, self.group, self.link)
        self.bytes_sent += nbytes
        self.link_s += waited

    def set_link(self, link) -> None:
        self.link = link

    def gradient_traffic(self) -> tuple[int, float]:
        return self.bytes_sent, self.link_s

    def __getstate__(self):
        # A process group does not travel; each task sets its own (and its link).
        return {"group": None, "link": None, "bytes_sent": 0, "link_s": 0.0}


_REGISTRY: dict[Strategy, Callable[..., TrainingStrategy]] = {cls.name: cls for cls in (Average, DiLoCo, EASGD, Sync)}


def make_strategy(name: Strategy | str, **options) -> TrainingStrategy:
    """Build the strategy called ``name`` with its options."""
    key = parse_enum(Strategy, name, "strategy")
    if key not in _REGISTRY:
        raise ValueError(f"strategy {key.value!r} is not available in this engine")
    return _REGISTRY[key](**options)


# -- compression of what workers send ----------------------------------------------------------

@dataclass
class Compressed:
    """An encoded delta: a payload tensor, per-chunk scales, and the original element count."""

    payload: torch.Tensor
    scales: torch.Tensor | None
    numel: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.payload, self.scales) if t is not None)


class Compressor(abc.ABC):
    """Encodes a worker's flat float32 delta; error feedback state lives in the worker's state."""

    kind: CompressionKind
    #: The payload's dtype.
    dtype: torch.dtype = torch.float32
    error_feedback: bool = False

    @abc.abstractmethod
    def compress(self, delta: torch.Tensor, state: WorkerState) -> Compressed:
        """Encode ``delta`` (updating any residual kept in ``state``)."""

    def decompress(self, c: Compressed) -> torch.Tensor:
        """The float32 delta ``c`` stands for."""
        return c.payload.float()

    def _with_residual(self, delta: torch.Tensor, state: WorkerState) -> torch.Tensor:
        """``delta`` in float32 plus what rounding lost from the previous ones (with error feedback)."""
        v = delta.float()
        residual = state.extra.get("residual")
        if self.error_feedback and residual is not None:
            v = v + residual
        return v

    # -- one flat byte buffer per message (what the engines send) --------------------------------
    def wire_nbytes(self, numel: int) -> int:
        """Bytes of the wire message of a ``numel``-element delta (the same for every delta of that size)."""
        return self.dtype.itemsize * numel

    def encode(self, delta: torch.Tensor, state: WorkerState) -> torch.Tensor:
        """:meth:`compress`, as one flat ``uint8`` tensor: the float32 scales (if any), then the payload."""
        c = self.compress(delta, state)
        payload = c.payload.contiguous().view(-1).view(torch.uint8)
        if c.scales is None:
            return payload.clone()
        return torch.cat([c.scales.float().contiguous().view(torch.uint8), payload])

    def decode(self, buf, numel: int) -> torch.Tensor:
        """The float32 delta a wire message of a ``numel``-element delta stands for (the same on every machine:
        no randomness).

        Raises
        ------
        ValueError
            The buffer's length is not that of such a message (a message of another codec or model).
        """
        buf = torch.as_tensor(buf).reshape(-1)
        if buf.dtype is not torch.uint8 or buf.numel() != self.wire_nbytes(numel):
            raise ValueError(f"a {self.kind.value} message of {numel} values is {self.wire_nbytes(numel)} bytes, got "
                             f"{buf.numel()} of {buf.dtype}; sender and receiver must use the same compression")
        return self.decompress(self._unwire(buf, numel))

    def _unwire(self, buf: torch.Tensor, numel: int) -> Compressed:
        return Compressed(buf.clone().view(self.dtype), None, numel)


class NoCompression(Compressor):
    kind = CompressionKind.NONE

    def compress(self, delta, state):
        return Compressed(delta.float(), None, delta.numel())


class HalfCompression(Compressor):
    """fp16 or bf16 with error feedback (the rounding error is added to the next delta)."""

    def __init__(self, dtype: torch.dtype = torch.float16, error_feedback: bool = True):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"half compression takes float16 or bfloat16, got {dtype}")
        self.dtype = dtype
        self.kind = CompressionKind.FP16 if dtype is torch.float16 else CompressionKind.BF16
        self.error_feedback = error_feedback

    def compress(self, delta, state):
        v = self._with_residual(delta, state)
        q = v.to(self.dtype)
        if self.error_feedback:
            state.extra["residual"] = v - q.float()
        return Compressed(q, None, delta.numel())


class Int8Compression(Compressor):
    """Symmetric int8 quantisation in chunks (one float32 scale per chunk) with error feedback.

    ``v = delta + residual``; each chunk is scaled so its largest magnitude maps to 127; the
    part rounding lost becomes the next residual, so nothing is lost over rounds, only
    delayed (Seide et al. 2014; Karimireddy et al. 2019). About 25% of the float32 bytes.

    ``sizes``: the runs a delta is made of (a split worker's weights, in its flat order), each chunked on its own
    from its first value, so that a weight several processes hold whole, in runs of their own, is quantized alike on
    each; ``None``: the delta is chunked as one run.
    """

    kind = CompressionKind.INT8
    dtype = torch.int8

    def __init__(self, chunk: int = 4096, error_feedback: bool = True, sizes: list[int] | None = None):
        if chunk < 1:
            raise ValueError(f"chunk must be positive, got {chunk}")
        self.chunk = int(chunk)
        self.error_feedback = error_feedback
        self.sizes = None if sizes is None else [int(n) for n in sizes]

    def _runs(self, numel: int) -> list[int]:
        if self.sizes is None:
            return [numel]
        if sum(self.sizes) != numel:
            raise ValueError(f"a delta of {numel} values is not made of runs of {sum(self.sizes)}")
        return self.sizes

    def wire_nbytes(self, numel):
        return numel + 4 * sum(math.ceil(n / self.chunk) for n in self._runs(numel))

    def _unwire(self, buf, numel):
        nscales = (self.wire_nbytes(numel) - numel) // 4
        scales = buf[:4 * nscales].clone().view(torch.float32)
        return Compressed(buf[4 * nscales:].clone().view(torch.int8), scales, numel)

    def _chunks(self, v: torch.Tensor) -> torch.Tensor:  # each run zero-padded to whole chunks, one a row
        runs = v.split(self._runs(v.numel()))
        return torch.cat([torch.nn.functional.pad(r, (0, (-r.numel()) % self.chunk)) for r in runs]).view(
            -1, self.chunk)

    def _unchunk(self, rows: torch.Tensor, numel: int) -> torch.Tensor:  # the runs without their padding
        runs = self._runs(numel)
        if len(runs) == 1:
            return rows.reshape(-1)[:numel]
        padded = rows.reshape(-1).split([n + (-n) % self.chunk for n in runs])
        return torch.cat([p[:n] for p, n in zip(padded, runs)])

    def compress(self, delta, state):
        n = delta.numel()
        v = self._with_residual(delta, state)
        vp = self._chunks(v)
        scales = vp.abs().amax(dim=1) / 127.0
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.clamp(torch.round(vp / safe[:, None]), -127, 127).to(torch.int8)
        if self.error_feedback:
            state.extra["residual"] = v - self._unchunk(q.float() * scales[:, None], n)
        return Compressed(self._unchunk(q, n).contiguous(), scales.contiguous(), n)

    def decompress(self, c):
        return self._unchunk(self._chunks(c.payload.float()) * c.scales[:, None], c.numel)


def make_compressor(kind: CompressionKind | str | None, sizes: list[int] | None = None) -> Compressor:
    """Build the compressor ``--compression`` names (none, fp16, bf16, int8; ``sizes``: int8's runs, each chunked on
    its own)."""
    k = parse_enum(CompressionKind, kind or CompressionKind.NONE, "compression")
    if k is CompressionKind.NONE:
        return NoCompression()
    if k is CompressionKind.INT8:
        return Int8Compression(sizes=sizes)
    return HalfCompression(torch.float16 if k is CompressionKind.FP16 else torch.bfloat16)


class Downlink:
    """The global weights sent to workers through a compressor: what the workers hold, kept by the sender.

    Workers start each round from ``seen``, an approximation of the global weights that every
    worker holds identically. Each round the sender encodes ``global - seen`` (the change since
    the last message *plus* whatever earlier messages did not deliver, so no separate residual
    is needed: the error feeds back by itself), and sender and workers both add the decoded
    message to ``seen``. ``seen`` starts at zero, so the first message carries the initial
    weights (in the codec's precision; what is lost arrives in later rounds). Without
    compression the message is the global weights themselves and ``seen`` is exact.

    Parameters
    ----------
    compressor : Compressor
        The codec of the messages.
    numel : int
        Number of weights.
    """

    def __init__(self, compressor: Compressor, numel: int):
        self.compressor, self.numel = compressor, int(numel)
        self.seen = torch.zeros(self.numel, dtype=torch.float32)

    @property
    def exact(self) -> bool:
        return self.compressor.kind is CompressionKind.NONE

    def message(self, global_flat: torch.Tensor) -> torch.Tensor:
        """The wire message bringing workers from ``seen`` towards ``global_flat``; updates ``seen``."""
        if self.exact:
            self.seen = global_flat.detach().float().clone()
            return self.seen.view(torch.uint8).clone()
        buf = self.compressor.encode(global_flat.float() - self.seen, WorkerState())
        self.seen = self.receive(self.seen, buf)
        return buf

    def receive(self, seen: torch.Tensor, buf) -> torch.Tensor:
        """A worker's new ``seen`` from its previous one and the round's message."""
        if self.exact:
            return torch.as_tensor(buf).reshape(-1).clone().view(torch.float32)
        return seen + self.compressor.decode(buf, self.numel)

    def state_dict(self) -> dict:
        return {"seen": self.seen.clone()}

    def load_state_dict(self, state: dict) -> None:
        seen = torch.as_tensor(state["seen"], dtype=torch.float32).reshape(-1)
        if seen.numel() != self.numel:
            raise ValueError(f"downlink state of {seen.numel()} weights does not fit a model of {self.numel}")
        self.seen = seen.clone()


# -- automatic tau -------------------------------------------------------------------------------

class AutoTau:
    """Chooses tau so synchronization stays under a target fraction of wall time.

    With a step time ``C`` and a synchronization cost ``S`` per round, a round of tau steps
    spends ``S / (S + tau * C)`` of its time communicating; keeping that at most ``f`` needs
    ``tau >= S * (1 - f) / (f * C)`` — the SparkNet paper's rule that tau is a small multiple
    of S/C. Medians of the last ``window`` rounds are used; tau is re-chosen every
    ``every`` rounds, within ``[min_tau, max_tau]``.
    """

    def __init__(self, target_fraction: float = 0.1, min_tau: int = 1, max_tau: int = 1000,
                 every: int = 3, window: int = 5, initial: int = 10):
        if not 0 < target_fraction < 1:
            raise ValueError(f"target_fraction must be in (0, 1), got {target_fraction}")
        if not 1 <= min_tau <= max_tau:
            raise ValueError(f"need 1 <= min_tau <= max_tau, got {min_tau}, {max_tau}")
        if every < 1 or window < 1:
            raise ValueError("every and window must be at least 1")
        self.target_fraction, self.min_tau, self.max_tau = float(target_fraction), int(min_tau), int(max_tau)
        self.every, self.window = int(every), int(window)
        self.tau = min(max(int(initial), self.min_tau), self.max_tau)
        self._step_s: deque[float] = deque(maxlen=self.window)  # the last window rounds
        self._sync_s: deque[float] = deque(maxlen=self.window)
        self._rounds = 0

    def observe(self, steps: int, compute_s: float, sync_s: float) -> int:
        """Record one round (local steps, seconds computing, seconds synchronizing); returns the tau to use next."""
        if steps > 0 and compute_s > 0:
            self._step_s.append(compute_s / steps)
        self._sync_s.append(max(sync_s, 0.0))
        self._rounds += 1
        if self._rounds % self.every == 0 and self._step_s:
            step_s, sync_s = statistics.median(self._step_s), statistics.median(self._sync_s)
            self.tau = self.choose(step_s, sync_s)
            log.info("auto tau: step %.4fs, sync %.4fs -> tau %d", step_s, sync_s, self.tau)
        return self.tau

    def choose(self, step_s: float, sync_s: float) -> int:
        """The smallest tau that keeps ``sync_s / (sync_s + tau * step_s)`` within the target."""
        if step_s <= 0:
            return self.max_tau
        f = self.target_fraction
        tau = math.ceil(sync_s * (1 - f) / (f * step_s)) if sync_s > 0 else self.min_tau
        return min(max(tau, self.min_tau), self.max_tau)

    def state_dict(self) -> dict:
        return {"tau": self.tau, "step_s": list(self._step_s), "sync_s": list(self._sync_s), "rounds": self._rounds}

    def load_state_dict(self, state: dict) -> None:
        self.tau, self._rounds = int(state["tau"]), int(state["rounds"])
        self._step_s, self._sync_s = (deque(state[key], maxlen=self.window) for key in ("step_s", "sync_s"))
