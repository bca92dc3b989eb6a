"""The 2-D layout: W workers = D data-parallel groups x M model-parallel ranks.

Ranks are laid out row-major, ``rank = dp_rank * M + mp_rank``::

    M = 2, D = 3         mp_rank 0   mp_rank 1
    dp_rank 0            rank 0      rank 1       <- one model replica, split in two
    dp_rank 1            rank 2      rank 3
    dp_rank 2            rank 4      rank 5
                         ^ one data-parallel group per shard

A **model-parallel group** (a row) holds one replica of the model split ``M`` ways; its ranks
run every step together on the *same* batch. A **data-parallel group** (a column) holds
the ranks with the same shard in every replica; periodic averaging, or any training
strategy, runs over it: each rank allreduces one flat buffer of its own shard with the
ranks holding that shard in the other replicas.

Everything here needs only an initialized default process group (gloo); the subgroups
are made by :func:`torch.distributed.device_mesh.init_device_mesh` and are destroyed with
the default group (``torch.distributed.destroy_process_group()``, which the code that
initialized it calls in ``finally``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sparknet.strategies import TrainingStrategy, WorkerState

__all__ = [
    "ParallelLayout",
    "layout_coords",
    "init_layout",
    "broadcast_over_dp_",
    "average_over_dp_",
    "share_data_over_mp",
    "dp_round",
    "RoundResult",
    "replica_seed",
    "ReplicaWorker",
    "model_parallel_worker",
]

log = logging.getLogger(__name__)


def layout_coords(rank: int, world_size: int, model_parallel: int) -> tuple[int, int]:
    """``(dp_rank, mp_rank)`` of a global rank in the row-major D x M layout.

    Raises
    ------
    ValueError
        ``model_parallel`` does not divide ``world_size``, or ``rank`` is out of range.
    """
    if model_parallel < 1 or world_size < 1:
        raise ValueError(f"world_size and model_parallel must be at least 1, got {world_size}, {model_parallel}")
    if world_size % model_parallel:
        raise ValueError(f"{world_size} workers do not divide into model-parallel groups of {model_parallel}; "
                         f"use a number of workers that is a multiple of --model-parallel")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    return divmod(rank, model_parallel)


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits in the D x M layout, and the process groups it talks over.

    Attributes
    ----------
    world_size, rank : int
        Of the default process group.
    data_parallel, model_parallel : int
        ``D`` and ``M``; ``D * M == world_size``.
    dp_rank, mp_rank : int
        This rank's coordinates: its replica, and its shard within the replica.
    mesh : DeviceMesh
        The 2-D mesh, dimensions named ``("dp", "mp")``.
    """

    world_size: int
    rank: int
    data_parallel: int
    model_parallel: int
    dp_rank: int
    mp_rank: int
    mesh: Any = field(repr=False)

    @property
    def mp_mesh(self):
        """The 1-D mesh over this rank's model-parallel group (what :func:`parallelize` takes)."""
        return self.mesh["mp"]

    @property
    def dp_group(self):
        """The process group of the ranks holding the same shard in every replica."""
        return self.mesh.get_group("dp")

    @property
    def mp_group(self):
        """The process group of the ranks holding this replica."""
        return self.mesh.get_group("mp")

    @property
    def mp_ranks(self) -> list[int]:
        """Global ranks of this rank's model-parallel group."""
        return [self.dp_rank * self.model_parallel + i for i in range(self.model_parallel)]

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's data-parallel group."""
        return [d * self.model_parallel + self.mp_rank for d in range(self.data_parallel)]


def init_layout(model_parallel: int, *, device_type: str = "cpu") -> ParallelLayout:
    """Split the initialized default process group into D data-parallel x M model-parallel groups.

    Every rank of the default group must call it (making the subgroups is collective).

    Parameters
    ----------
    model_parallel : int
        ``M``; must divide the world size.
    device_type : str
        The mesh's device type (``"cpu"`` for gloo).

    Raises
    ------
    RuntimeError
        No default process group.
    ValueError
        ``M`` does not divide the world size.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("init_layout needs an initialized default process group: call "
                           "torch.distributed.init_process_group first (the barrier engine does)")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp_rank, mp_rank = layout_coords(rank, world, model_parallel)
    d = world // model_parallel
    mesh = init_device_mesh(device_type, (d, model_parallel), mesh_dim_names=("dp", "mp"))
    layout = ParallelLayout(world_size=world, rank=rank, data_parallel=d, model_parallel=model_parallel,
                            dp_rank=dp_rank, mp_rank=mp_rank, mesh=mesh)
    log.debug("rank %d: replica %d of %d, shard %d of %d", rank, dp_rank, d, mp_rank, model_parallel)
    return layout


def replica_seed(layout: ParallelLayout, seed: int) -> int:
    """A seed equal across a model-parallel group and different between replicas.

    The ranks of one replica must draw the same batches (and the same dropout masks on
    whole activations): seed their :class:`~sparknet.net.Net` and ``torch.manual_seed``
    with this.
    """
    return int(seed) + 1000 * layout.dp_rank


# --------------------------------------------------------------------------- data


def _gather_rows(array: np.ndarray | None, group, group_size: int) -> np.ndarray | None:
    """Concatenate every rank's rows (in group-rank order) on every rank of ``group``."""
    import torch.distributed as dist

    local = np.ascontiguousarray(array) if array is not None else None
    meta = [] if local is None else [len(local), *local.shape[1:]]
    metas: list[Any] = [None] * group_size
    dist.all_gather_object(metas, (meta, None if local is None else str(local.dtype)), group=group)
    shapes = [m for m in metas if m[0]]
    if not shapes:
        return None
    tail, dtype = shapes[0][0][1:], np.dtype(shapes[0][1])
    for m in shapes:
        if m[0][1:] != tail or np.dtype(m[1]) != dtype:
            raise ValueError(f"partitions of one model-parallel group differ in row shape or dtype: {metas}")
    counts = [m[0][0] if m[0] else 0 for m in metas]
    width = int(np.prod(tail)) if tail else 1
    longest = max(counts)
    t = torch.zeros(longest * width, dtype=torch.from_numpy(np.zeros(0, dtype)).dtype)
    if local is not None and len(local):
        t[: local.size] = torch.from_numpy(np.require(local.reshape(-1), requirements="W"))  # read-only chunks copy
    parts = [torch.empty_like(t) for _ in range(group_size)]
    dist.all_gather(parts, t, group=group)
    rows = [p[: c * width].numpy().reshape(c, *tail) for p, c in zip(parts, counts) if c]
    return np.concatenate(rows)


def share_data_over_mp(x: np.ndarray | None, y: np.ndarray | None,
                       layout: ParallelLayout) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Give every rank of a model-parallel group the union of the group's partitions.

    The ranks of one replica compute one model together, so they must see the same
    samples in the same order; when each rank was handed its own partition (a Spark task
    per rank), the group's partitions are concatenated in model-parallel rank order.
    """
    if layout.model_parallel == 1:
        return x, y
    group = layout.mp_group
    return (_gather_rows(x, group, layout.model_parallel), _gather_rows(y, group, layout.model_parallel))


# --------------------------------------------------------------------------- averaging


def broadcast_over_dp_(net, layout: ParallelLayout, src_dp_rank: int = 0) -> None:
    """Make every replica's shard equal to replica ``src_dp_rank``'s (one flat broadcast)."""
    import torch.distributed as dist

    if layout.data_parallel == 1:
        return
    flat = net.get_flat()
    dist.broadcast(flat, src=layout.dp_ranks[src_dp_rank], group=layout.dp_group)
    net.set_flat(flat)


def average_over_dp_(net, layout: ParallelLayout, samples: float | None = None) -> torch.Tensor:
    """Average this rank's shard with the same shard in the other replicas, in place.

    One flat float32 buffer of the local shard is allreduced over the data-parallel group
    (weighted by ``samples`` when given, e.g. the samples each replica processed).

    Returns
    -------
    Tensor
        The averaged flat shard.
    """
    import torch.distributed as dist

    flat = net.get_flat()
    if layout.data_parallel == 1:
        return flat
    weight = 1.0 if samples is None else float(samples)
    buf = torch.cat([flat * weight, torch.tensor([weight])])
    dist.all_reduce(buf, group=layout.dp_group)
    flat = buf[:-1] / buf[-1]
    net.set_flat(flat)
    return flat


@dataclass(frozen=True)
class RoundResult:
    """One round of :func:`dp_round`, as every rank of the data-parallel group sees it."""

    global_flat: torch.Tensor
    """The new global weights of this rank's shard."""
    samples: int
    """Samples processed by all replicas (each replica counted once)."""
    loss: float
    """Sample-weighted mean training loss over the replicas."""
    steps: int
    """Local steps each replica made (the most of any)."""
    compute_s: float
    """Seconds of local training (the slowest replica)."""
    sync_s: float
    """Seconds in the allreduce."""
    nbytes: int
    """Bytes of the allreduced buffer."""


def dp_round(strategy: TrainingStrategy, state: WorkerState, net, global_flat: torch.Tensor,
             layout: ParallelLayout, steps: int, max_seconds: float | None = None,
             train: Callable[[int, float | None], Any] | None = None) -> RoundResult:
    """One round of any training strategy over the data-parallel group, on this rank's shard.

    The same loop as the barrier engine's, with the data-parallel group in place of the
    whole world: local steps, then one sum-allreduce of ``[n * delta | n, loss * n]`` and a
    two-number max-allreduce of ``[steps, compute_s]`` over the D replicas, then the
    strategy's step from the sample-weighted mean delta. Each model-parallel rank does this for its own shard; ranks of one replica
    hold the same counts, so every shard takes the same weighting.

    ``train(steps, max_seconds)`` replaces ``net.train`` for the local steps when given (a
    custom loop, e.g. one carrying a recurrent state across batches); it returns a
    :class:`~sparknet.net.TrainStats`.
    """
    import torch.distributed as dist

    strategy.worker_begin(state, net, global_flat)
    stats = (train or net.train)(steps, max_seconds)
    delta = strategy.worker_delta(state, net, global_flat)
    finite = bool(stats.finite and torch.isfinite(delta).all())
    n = float(stats.samples) if finite else 0.0
    loss = stats.loss if finite and stats.samples else 0.0
    tail = torch.tensor([n, loss * n, float(stats.steps), stats.wall_s])
    buf = torch.cat([delta * n, tail]) if finite else torch.cat([torch.zeros_like(delta), tail])
    t0 = time.perf_counter()
    if layout.data_parallel > 1:
        dist.all_reduce(buf[: -2], group=layout.dp_group)
        top = buf[-2:].clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=layout.dp_group)
        buf[-2:] = top
    sync_s = time.perf_counter() - t0
    p = delta.numel()
    total = float(buf[p])
    if total <= 0:
        raise FloatingPointError("no replica produced finite weights in this round")
    new_global = strategy.apply(global_flat, buf[:p] / total, layout.data_parallel)
    if not strategy.keeps_local_weights:
        net.set_flat(new_global)
    return RoundResult(global_flat=new_global, samples=int(total), loss=float(buf[p + 1]) / total,
                       steps=int(buf[p + 2]), compute_s=float(buf[p + 3]), sync_s=sync_s,
                       nbytes=buf.numel() * 4)


# --------------------------------------------------------------------------- an engine's worker


@dataclass
class ReplicaWorker:
    """One rank's part of a model-parallel replica, ready for an engine's round loop.

    An engine that averages over the whole world (the barrier engine) runs its loop over
    ``group`` with ``rank``/``world`` instead of the global ones, starting from
    ``shard_flat``; at the end :meth:`whole_flat` turns this rank's shard of the global
    weights back into the whole model's flat buffer.
    """

    net: Any
    """The :class:`~sparknet.net.Net` over the :class:`~sparknet.parallel.TensorParallelModule`."""
    layout: ParallelLayout
    shard_flat: torch.Tensor
    """This rank's shard of the starting global weights (what ``net.get_flat()`` returns)."""
    has_data: bool

    @property
    def group(self):
        """The data-parallel group: where the round's allreduce runs."""
        return self.layout.dp_group

    @property
    def rank(self) -> int:
        """This rank's index in the data-parallel group (its replica)."""
        return self.layout.dp_rank

    @property
    def world(self) -> int:
        """Size of the data-parallel group (``D``)."""
        return self.layout.data_parallel

    def split_validation(self, x, y):
        """This replica's share of the validation rows (the same on the replica's M ranks)."""
        return x[self.rank::self.world], y[self.rank::self.world]

    def whole_flat(self, shard_flat: torch.Tensor) -> torch.Tensor:
        """The whole model's flat weights from this rank's shard: a collective over the replica."""
        from sparknet.parallel.tensor import gather_full_weights

        self.net.set_flat(shard_flat)
        return gather_full_weights(self.net).to_flat(torch.float32)


def model_parallel_worker(net_params, solver, model_parallel: int, *, x, y, whole_flat, batch_size: int,
                          seed: int, data_seed: int, device: str = "cpu", plan=None,
                          sample_shape: tuple[int, ...] | None = None, start_iteration: int = 0) -> ReplicaWorker:
    """Set up one barrier task as a rank of a D x M layout (after the default group is initialized).

    Parameters
    ----------
    net_params : NetParams
        The net (its ``parallel=`` fields, or ``plan``, say what splits).
    solver : SolverConfig
        Every worker's update rule.
    model_parallel : int
        ``M``.
    x, y : ndarray or None
        This task's partition; the replica's ``M`` partitions are pooled so its ranks train
        on the same rows.
    whole_flat : array-like
        The driver's starting weights, whole (``Net.get_flat()`` of the unsplit net).
    batch_size, seed : int
        Minibatch size and the seed the whole net is built with before the driver's
        weights are loaded.
    data_seed : int
        Seed of the data order; it is offset per replica (equal within a replica).
    plan : mapping, optional
        Overrides of the DSL's ``parallel=`` fields.
    sample_shape : tuple of int, optional
        Shape of one sample; flat rows are reshaped to it.
    start_iteration : int
        The solver iteration to start at (after a warm-up).
    """
    from sparknet.net import Net
    from sparknet.parallel.tensor import parallelize
    from sparknet.weights import WeightCollection

    layout = init_layout(model_parallel)
    x, y = share_data_over_mp(x, y, layout)
    module = net_params.build(seed=seed)
    start = torch.as_tensor(np.asarray(whole_flat, dtype=np.float32))
    WeightCollection(module.layer_weights()).load_flat_(start)
    module = parallelize(module, layout, plan)
    rseed = replica_seed(layout, data_seed)
    torch.manual_seed(rseed)  # the same dropout masks on the replica's ranks
    net = Net(module, solver, batch_size=batch_size, device=device, seed=rseed)
    has_data = x is not None and len(x) > 0
    if has_data:
        net.set_training_data((x.reshape(len(x), *sample_shape) if sample_shape else x, y))
    net.set_iteration(start_iteration)
    return ReplicaWorker(net=net, layout=layout, shard_flat=net.get_flat(), has_data=has_data)
