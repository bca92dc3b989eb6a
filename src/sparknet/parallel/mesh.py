"""The layout of a stage's ranks: W = D workers x C copies x M model-parallel ranks,
``rank = (dp_rank * C + inner_rank) * M + mp_rank``.

A **model-parallel group** (``mp``) holds one copy of the model split ``M`` ways; its ranks run every
step together on the *same* batch. The **inner group** holds a worker's ``C`` copies (whole replicas, FSDP2's
shards of one, or copies of a split one), which train on their own batches and average their gradients every
step. A **data-parallel group** (``dp``, a column) holds the ranks with the same place in every worker; the
training strategy's allreduce of each rank's flat part runs over it.

Everything here needs only an initialized default process group (gloo); the subgroups are made by
:func:`torch.distributed.device_mesh.init_device_mesh` and are destroyed with the default group.
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparknet.weights import box_numel, box_size

__all__ = [
    "ParallelLayout", "layout_coords", "init_layout", "share_data_over_mp", "SharedStream", "join_shards", "cut_shard",
    "cut_state", "leave_process_group",
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
    """Where this rank sits in the D x C x M layout, and the process groups it talks over.

    Attributes
    ----------
    world_size, rank : int
        Of the default process group.
    data_parallel, copies, model_parallel : int
        ``D`` (workers), ``C`` (copies in a worker) and ``M``; ``D * C * M == world_size``.
    dp_rank, inner_rank, mp_rank : int
        This rank's coordinates: its worker, its copy in the worker, and its part of the copy.
    mesh : DeviceMesh
        The 3-D mesh, dimensions named ``("dp", "inner", "mp")``.
    """

    world_size: int
    rank: int
    data_parallel: int
    model_parallel: int
    dp_rank: int
    mp_rank: int
    mesh: Any = field(repr=False)
    copies: int = 1
    inner_rank: int = 0
    peers: Any = field(default=None, repr=False)
    """The ranks of every copy that hold this rank's part (C > 1 and M > 1; else a group of the mesh's is it)."""

    @property
    def worker_rank(self) -> int:
        """This rank's index among its worker's C x M ranks."""
        return self.inner_rank * self.model_parallel + self.mp_rank

    @property
    def mp_mesh(self):
        """The 1-D mesh over this rank's model-parallel group (what :func:`parallelize` takes)."""
        return self.mesh["mp"]

    @property
    def inner_mesh(self):
        """The 1-D mesh over the worker's copies this rank is one of (what FSDP2 shards a replica over)."""
        return self.mesh["inner"]

    @property
    def dp_group(self):
        """The process group of the ranks holding the same place in every worker."""
        return self.mesh.get_group("dp")

    @property
    def mp_group(self):
        """The process group of the ranks holding this copy's parts."""
        return self.mesh.get_group("mp")

    @property
    def inner_group(self):
        """The process group of the worker's ranks holding the same part in each of its copies."""
        return self.mesh.get_group("inner")

    @property
    def part_group(self):
        """The ranks of every worker and copy holding this rank's part of the model."""
        return self.dp_group if self.copies == 1 else self.peers


def init_layout(model_parallel: int, *, copies: int = 1, device_type: str = "cpu") -> ParallelLayout:
    """Split the initialized default process group into D workers of ``copies`` x M ranks.

    Every rank of the default group must call it (making the subgroups is collective).

    Parameters
    ----------
    model_parallel : int
        ``M``; with ``copies``, must divide the world size.
    copies : int
        ``C``: copies of the model in each worker (whole, sharded or split ``M`` ways), averaging their gradients
        every step.
    device_type : str
        The mesh's device type (``"cpu"`` for gloo).

    Raises
    ------
    RuntimeError
        No default process group.
    ValueError
        ``C x M`` does not divide the world size.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("init_layout needs an initialized default process group: call "
                           "torch.distributed.init_process_group first (the barrier engine does)")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp_rank, place = layout_coords(rank, world, copies * model_parallel)
    inner_rank, mp_rank = divmod(place, model_parallel)
    d = world // (copies * model_parallel)
    mesh = init_device_mesh(device_type, (d, copies, model_parallel), mesh_dim_names=("dp", "inner", "mp"))
    peers = None
    if copies > 1 and model_parallel > 1:  # made by every rank, in the same order
        peers, _ = dist.new_subgroups_by_enumeration([list(range(j, world, model_parallel))
                                                      for j in range(model_parallel)])
    layout = ParallelLayout(world_size=world, rank=rank, data_parallel=d, model_parallel=model_parallel,
                            dp_rank=dp_rank, mp_rank=mp_rank, mesh=mesh, copies=copies, inner_rank=inner_rank,
                            peers=peers)
    log.debug("rank %d: worker %d of %d, copy %d of %d, part %d of %d", rank, dp_rank, d, inner_rank, copies,
              mp_rank, model_parallel)
    return layout


def join_shards(parts, layouts):
    """One whole flat buffer from the ranks' parts of it (what each rank's :meth:`~sparknet.net.Net.get_flat` of a
    sharded or split net gives, or any buffer laid out the same way), in rank order.

    ``layouts[j]``: rank j's :meth:`~sparknet.net.Net.shard_layout` (:func:`~sparknet.weights.worker_layouts`): each
    weight's box. Boxes of one weight are the same or apart (the cuts' rule); a box several ranks hold (a weight whole
    on each, a layer left whole) is taken from the first of them.
    """
    import torch

    joined = torch.empty(sum(box_size(box) for box in layouts[0]), dtype=parts[0].dtype)
    offsets, start = [0] * len(parts), 0
    for i, whole in enumerate(layouts[0]):
        size = box_size(whole)
        weight = joined[start:start + size].view([n for *_, n in whole])
        written: list = []
        for j, (part, layout) in enumerate(zip(parts, layouts)):
            box, n = layout[i], box_numel(layout[i])
            if n and box not in written:
                if any(_overlap(box, other) for other in written):
                    raise ValueError(f"the parts of weight {i} overlap: {box} and {written}")
                weight[tuple(slice(first, end) for first, end, _ in box)] = (
                    part[offsets[j]:offsets[j] + n].view([end - first for first, end, _ in box]))
                written.append(box)
            offsets[j] += n
        covered = sum(box_numel(box) for box in written)
        if covered != size:
            raise ValueError(f"the parts of weight {i} cover {covered} of its {size} values")
        start += size
    return joined


def _overlap(a, b) -> bool:
    return all(max(fa, fb) < min(ea, eb) for (fa, ea, _), (fb, eb, _) in zip(a, b))


def cut_state(state: dict, whole: int, layout) -> dict:
    """``state`` with each of its tensors of ``whole`` values (a flat buffer laid out as the weights: the global
    weights, their moving average, a strategy's flat state) cut to one rank's part (:func:`cut_shard`), the other
    values as they are: what a sharded replica's rank holds of a whole state."""
    import torch

    return {k: cut_shard(v, layout) if isinstance(v, torch.Tensor) and v.numel() == whole else v
            for k, v in state.items()}


def cut_shard(whole, layout):
    """This rank's part of a whole flat buffer (``layout``: its :meth:`~sparknet.net.Net.shard_layout`); what
    :func:`join_shards` joins again."""
    import torch

    total = sum(box_size(box) for box in layout)
    if total != whole.numel():
        raise ValueError(f"a buffer of {whole.numel()} values does not match the layout's {total}")
    pieces, offset = [], 0
    for box in layout:
        weight = whole[offset:offset + box_size(box)].view([size for *_, size in box])
        pieces.append(weight[tuple(slice(first, end) for first, end, _ in box)].reshape(-1))
        offset += box_size(box)
    return torch.cat(pieces) if pieces else whole[:0]


# --------------------------------------------------------------------------- data


_ROW_DTYPES = ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
"""The dtypes of rows a worker's ranks share (:func:`share_data_over_mp`), by their index in a header."""
_MAX_DIMS = 8


def _gather_rows(array: np.ndarray | None, group, group_size: int) -> np.ndarray | None:
    """Concatenate every rank's rows (in group-rank order) on every rank of ``group``: a header of each rank's shape
    and dtype all-gathered, then its bytes broadcast from it into one buffer, all as tensors (nothing is
    unpickled)."""
    import torch
    import torch.distributed as dist

    head = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64)  # present, dtype, dimensions, shape
    if array is not None:
        array = np.ascontiguousarray(array)
        if array.dtype.name not in _ROW_DTYPES or array.ndim > _MAX_DIMS:
            raise ValueError(f"rows of dtype {array.dtype} and {array.ndim} dimensions cannot be shared among a "
                             f"worker's ranks (dtypes {', '.join(_ROW_DTYPES)}, at most {_MAX_DIMS} dimensions)")
        head[:3] = torch.tensor([1, _ROW_DTYPES.index(array.dtype.name), array.ndim])
        head[3:3 + array.ndim] = torch.tensor(array.shape)
    heads = [torch.empty_like(head) for _ in range(group_size)]
    dist.all_gather(heads, head, group=group)
    held = [(np.dtype(_ROW_DTYPES[int(h[1])]), tuple(int(d) for d in h[3:3 + int(h[2])])) if h[0] else None
            for h in heads]
    kinds = [k for k in held if k is not None]
    if len({(shape[1:], dtype) for dtype, shape in kinds}) > 1:
        raise ValueError("partitions of one worker differ in row shape or dtype: "
                         f"{[(shape, str(dtype)) for dtype, shape in kinds]}")
    if not kinds:
        return None
    sizes = [0 if k is None else math.prod(k[1]) * k[0].itemsize for k in held]
    # every rank's rows in one buffer, in rank order, each rank's bytes sent by that rank to the others in turn: an
    # all-gather would hold a second buffer of them all while it runs
    whole = torch.empty(sum(sizes), dtype=torch.uint8)
    ends = np.cumsum([0, *sizes])
    me = dist.get_rank(group)
    for i, n in enumerate(sizes):
        if not n:
            continue
        piece = whole[ends[i]:ends[i + 1]]
        if i == me:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only memory map: only read here
                piece.copy_(torch.from_numpy(array.reshape(-1).view(np.uint8)))
        dist.broadcast(piece, group_src=i, group=group)
    return whole.numpy().view(kinds[0][0]).reshape(-1, *kinds[0][1][1:])


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


class SharedStream:
    """One stream of minibatches for the M ranks of a split copy, each rank reading its own partition from disk.

    Every step each rank takes its share of the batch from its own :class:`~sparknet.rowfile.RowStream` (``b // M``
    rows, one more on the first ``b % M`` ranks, at most its partition's rows) and one all-gather over the copy's
    group joins the shares in model-parallel rank order, so the M ranks train on the same batch while each holds one
    shuffle window of its own rows, not the copy's M partitions (:func:`share_data_over_mp`). With shares of b / M,
    a split copy's step is the step of M whole processes that each stream their partition with batch b / M and
    average their gradients.

    ``rows`` and ``epoch`` are the copy's (every rank's partition counted); :meth:`state` is this rank's place in
    its own stream and the rows the copy has drawn."""

    def __init__(self, stream, layout: ParallelLayout):
        import torch
        import torch.distributed as dist

        self.stream, self.group, self.size = stream, layout.mp_group, layout.model_parallel
        self.me = layout.mp_rank
        self._x_numel, self._y_numel = math.prod(stream.sample_shape), math.prod(stream.file.y_shape)
        y_dtype = np.dtype(stream.file.y_dtype)
        if y_dtype.name not in _ROW_DTYPES:
            raise ValueError(f"labels of dtype {y_dtype} cannot be shared among a worker's ranks")
        head = torch.tensor([stream.rows, self._x_numel, self._y_numel, _ROW_DTYPES.index(y_dtype.name)])
        heads = [torch.empty_like(head) for _ in range(self.size)]
        dist.all_gather(heads, head, group=self.group)
        if len({tuple(h[1:].tolist()) for h in heads}) > 1:
            raise ValueError("partitions of one worker differ in row shape or label dtype: "
                             f"{[tuple(h[1:].tolist()) for h in heads]} (values, labels, label dtype)")
        self._rows_each = [int(h[0]) for h in heads]
        self.rows = sum(self._rows_each)
        self._y_dtype = y_dtype
        self._row_bytes = 4 * self._x_numel + y_dtype.itemsize * self._y_numel
        self.drawn = 0

    @property
    def epoch(self) -> int:
        """Whole passes the copy has made over its rows."""
        return self.drawn // self.rows

    def __len__(self) -> int:
        return self.rows

    def close(self) -> None:
        self.stream.close()

    def next_batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The copy's next minibatch ``(x [b, *sample_shape] float32, y [b, *label shape])``, the same on its M
        ranks (collective: every rank of the copy calls it with the same ``batch_size``)."""
        import torch
        import torch.distributed as dist

        b = min(int(batch_size), self.rows)
        pieces = [min(b // self.size + (i < b % self.size), r) for i, r in enumerate(self._rows_each)]
        buf = torch.zeros(max(pieces) * self._row_bytes, dtype=torch.uint8)
        mine = pieces[self.me]
        if mine:
            x, y = self.stream.next_batch(mine)
            raw = np.concatenate([np.ascontiguousarray(x, np.float32).reshape(-1).view(np.uint8),
                                  np.ascontiguousarray(y, self._y_dtype).reshape(-1).view(np.uint8)])
            buf[:raw.size] = torch.from_numpy(raw)
        bufs = [torch.empty_like(buf) for _ in range(self.size)]
        dist.all_gather(bufs, buf, group=self.group)
        xs, ys = [], []
        for n, got in zip(pieces, bufs):
            raw = got.numpy()
            xs.append(raw[:4 * n * self._x_numel].view(np.float32).reshape(n, *self.stream.sample_shape))
            ys.append(raw[4 * n * self._x_numel:n * self._row_bytes].view(self._y_dtype)
                      .reshape(n, *self.stream.file.y_shape))
        self.drawn += sum(pieces)
        return np.concatenate(xs), np.concatenate(ys)

    def state(self) -> dict:
        """This rank's place in its own stream, and the rows the copy has drawn."""
        return {"own": self.stream.state(), "drawn": self.drawn}

    def load_state(self, state: dict) -> None:
        """Continue from :meth:`state` (this rank's, saved in this or another process)."""
        self.stream.load_state(state["own"])
        self.drawn = int(state["drawn"])


def leave_process_group() -> None:
    """Destroy this process's default process group (if it has one), and forget DTensor's cached sharding decisions:
    each holds the device mesh it was made on.

    A mesh compares equal to any other of the same shape whatever its process groups, so a Python worker that Spark
    reuses for a later barrier stage, where it is another rank in new groups, would be handed back an old mesh whose
    groups are gone: "Could not resolve the process group registered under the name 4", and the stage restarts."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if "torch.distributed.tensor" in sys.modules:  # else no DTensor was made here, and nothing is cached
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache  # private: what clears both caches

        _clear_sharding_prop_cache()
