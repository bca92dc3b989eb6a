"""WeightCollection: an ordered map from layer name to that layer's tensors.

This is SparkNet's unit of communication. A driver broadcasts one, workers train from it
and send one back, and the driver averages them. Arithmetic works layer by layer; for the
wire, :meth:`WeightCollection.to_flat` packs every tensor into one contiguous buffer and
:meth:`WeightCollection.from_flat` unpacks it again.
"""

from __future__ import annotations

import json
import math
import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from os import PathLike
from pathlib import Path

import torch

__all__ = ["WeightCollection", "local_view", "worker_layouts", "shard_slice", "whole_weights"]


def whole_weights(layers: Mapping[str, Sequence[torch.Tensor]]) -> WeightCollection:
    """CPU copies of whole weights: a DTensor's gathered from every rank of its mesh (each must call it), any other
    tensor copied as it is. What tensor parallelism and a sharded replica both return at the end."""
    return WeightCollection((name, [(t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
                                    for t in ts]) for name, ts in layers.items())


def local_view(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a weight: a DTensor's local shard (a view sharing its storage, as tensor parallelism
    and a sharded replica hold them), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    if to_local is None:
        return t
    with torch.no_grad():
        return to_local()


class WeightCollection(Mapping[str, list[torch.Tensor]]):
    """An ordered map from layer name to the list of that layer's tensors.

    Parameters
    ----------
    layers : mapping or iterable of (name, tensors) pairs
        Each value is a sequence of tensors (a layer's weight, bias, running statistics).
        The tensors are kept as given (no copy); use :meth:`clone` for an independent copy.

    Examples
    --------
    >>> a = WeightCollection({"ip": [torch.ones(2, 2), torch.zeros(2)]})
    >>> b = (a + a) / 2
    >>> b.allclose(a)
    True
    """

    __slots__ = ("_layers",)

    def __init__(self, layers: Mapping[str, Sequence[torch.Tensor]] | Iterable = ()):
        items = layers.items() if isinstance(layers, Mapping) else layers
        self._layers: OrderedDict[str, list[torch.Tensor]] = OrderedDict()
        for name, tensors in items:
            if not isinstance(name, str):
                raise TypeError(f"layer names must be str, got {type(name).__name__}")
            if isinstance(tensors, torch.Tensor):
                tensors = [tensors]
            tensors = list(tensors)
            for i, t in enumerate(tensors):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"layer {name!r} tensor {i} is a {type(t).__name__}, not a torch.Tensor")
            self._layers[name] = tensors

    # -- Mapping ---------------------------------------------------------------------------
    def __getitem__(self, name: str) -> list[torch.Tensor]:
        return self._layers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def __repr__(self) -> str:
        parts = (f"{name}: [{', '.join('x'.join(map(str, t.shape)) or 'scalar' for t in ts)}]"
                 for name, ts in self._layers.items())
        return f"WeightCollection({', '.join(parts)})"

    def tensors(self) -> Iterator[tuple[str, int, torch.Tensor]]:
        """Yield ``(layer, index, tensor)`` in order."""
        for name, ts in self._layers.items():
            for i, t in enumerate(ts):
                yield name, i, t

    # -- sizes -----------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        """Number of elements across all tensors."""
        return sum(t.numel() for _, _, t in self.tensors())

    @property
    def nbytes(self) -> int:
        """Bytes the tensors occupy (and the size of :meth:`to_flat`'s buffer)."""
        return sum(t.numel() * t.element_size() for _, _, t in self.tensors())

    # -- checks ----------------------------------------------------------------------------
    def check_compatible(self, other: WeightCollection, *, dtypes: bool = True) -> None:
        """Raise ``ValueError`` naming the first layer or tensor where ``other`` differs (in names, counts, shapes,
        and with ``dtypes`` in dtypes)."""
        if not isinstance(other, WeightCollection):
            raise TypeError(f"expected a WeightCollection, got {type(other).__name__}")
        mine, theirs = list(self._layers), list(other._layers)
        if mine != theirs:
            i = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
            if i is not None:
                raise ValueError(f"layer names differ at position {i}: {mine[i]!r} vs {theirs[i]!r}")
            raise ValueError(f"layer {(mine[len(theirs):] or theirs[len(mine):])[0]!r} is in one collection only")
        for name in mine:
            a_ts, b_ts = self._layers[name], other._layers[name]
            if len(a_ts) != len(b_ts):
                raise ValueError(f"layer {name!r} has {len(a_ts)} tensors in one collection and {len(b_ts)} in the other")
            for i, (a, b) in enumerate(zip(a_ts, b_ts)):
                if a.shape != b.shape:
                    raise ValueError(f"layer {name!r} tensor {i}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
                if dtypes and a.dtype != b.dtype:
                    raise ValueError(f"layer {name!r} tensor {i}: dtype {a.dtype} vs {b.dtype}")

    # -- arithmetic ------------------------------------------------------------------------
    def _zip(self, other: WeightCollection, op) -> WeightCollection:
        self.check_compatible(other)
        return WeightCollection((name, [op(a, b) for a, b in zip(ts, other._layers[name])])
                                for name, ts in self._layers.items())

    def _map(self, op) -> WeightCollection:
        return WeightCollection((name, [op(t) for t in ts]) for name, ts in self._layers.items())

    def __add__(self, other: WeightCollection) -> WeightCollection:
        return self._zip(other, torch.add)

    def __sub__(self, other: WeightCollection) -> WeightCollection:
        return self._zip(other, torch.sub)

    def __mul__(self, scalar: float) -> WeightCollection:
        _check_scalar(scalar)
        return self._map(lambda t: t * scalar)

    __rmul__ = __mul__

    def __truediv__(self, scalar: float) -> WeightCollection:
        _check_scalar(scalar)
        if scalar == 0:
            raise ZeroDivisionError("division of a WeightCollection by zero")
        return self._map(lambda t: t / scalar)

    def __neg__(self) -> WeightCollection:
        return self._map(torch.neg)

    def clone(self) -> WeightCollection:
        """A deep copy, detached from autograd."""
        return self._map(lambda t: t.detach().clone())

    def zeros_like(self) -> WeightCollection:
        """A collection of the same layout filled with zeros."""
        return self._map(torch.zeros_like)

    def to(self, *args, **kwargs) -> WeightCollection:
        """Apply ``Tensor.to`` to every tensor (device or dtype)."""
        return self._map(lambda t: t.to(*args, **kwargs))

    def copy_into(self, target: WeightCollection) -> None:
        """Copy these values into ``target``'s tensors in place, casting dtypes if needed."""
        self.check_compatible(target, dtypes=False)  # values are cast on copy
        with torch.no_grad():
            for (_, _, src), (_, _, dst) in zip(self.tensors(), target.tensors()):
                dst.copy_(src)

    @staticmethod
    def mean(collections: Sequence[WeightCollection], weights: Sequence[float] | None = None) -> WeightCollection:
        """The (weighted) mean of several collections.

        Parameters
        ----------
        collections : sequence of WeightCollection
            All with the same layer names, shapes and dtypes.
        weights : sequence of float, optional
            Non-negative weights (for SparkNet: the samples each worker processed). They need
            not sum to one; they are normalised. Equal weights when omitted.
        """
        collections = list(collections)
        if not collections:
            raise ValueError("mean of no WeightCollections")
        if weights is None:
            weights = [1.0] * len(collections)
        weights = [float(w) for w in weights]
        if len(weights) != len(collections):
            raise ValueError(f"{len(weights)} weights for {len(collections)} collections")
        if any(w < 0 or not math.isfinite(w) for w in weights):
            raise ValueError(f"weights must be finite and non-negative, got {weights}")
        total = sum(weights)
        if total <= 0:
            raise ValueError("weights sum to zero: nothing to average")
        for other in collections[1:]:
            collections[0].check_compatible(other)

        def average(*ts: torch.Tensor) -> torch.Tensor:
            if not ts[0].is_floating_point():  # integer tensors (counters) cannot be averaged: keep the largest
                return torch.stack(ts).max(dim=0).values
            acc = torch.zeros_like(ts[0], dtype=torch.float64)
            for t, w in zip(ts, weights):
                acc.add_(t.to(torch.float64), alpha=w / total)
            return acc.to(ts[0].dtype)

        return WeightCollection((name, [average(*ts) for ts in zip(*(c._layers[name] for c in collections))])
                                for name in collections[0]._layers)

    def allclose(self, other: WeightCollection, rtol: float = 1e-5, atol: float = 1e-8) -> bool:
        """Whether every tensor is close to its counterpart (layouts must match)."""
        self.check_compatible(other)
        return all(torch.allclose(a, b, rtol=rtol, atol=atol) for (_, _, a), (_, _, b) in zip(self.tensors(), other.tensors()))

    def max_abs_diff(self, other: WeightCollection) -> float:
        """Largest absolute element-wise difference."""
        self.check_compatible(other)
        diffs = [(a - b).abs().max().item() for (_, _, a), (_, _, b) in zip(self.tensors(), other.tensors()) if a.numel()]
        return max(diffs, default=0.0)

    def is_finite(self) -> bool:
        """Whether no tensor holds NaN or infinity."""
        return all(bool(torch.isfinite(t).all()) for _, _, t in self.tensors() if t.is_floating_point())

    # -- flat buffers ----------------------------------------------------------------------
    def to_flat(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """All tensors, in order, packed into one contiguous 1-D tensor.

        Parameters
        ----------
        dtype : torch.dtype, optional
            The buffer's dtype. By default the common dtype of the tensors; a collection of
            mixed dtypes needs an explicit one.
        """
        ts = [t for _, _, t in self.tensors()]
        if dtype is None:
            dtypes = {t.dtype for t in ts}
            if len(dtypes) > 1:
                raise ValueError(f"tensors have several dtypes {sorted(map(str, dtypes))}; pass dtype=")
            dtype = dtypes.pop() if dtypes else torch.float32
        if not ts:
            return torch.empty(0, dtype=dtype)
        return torch.cat([t.detach().reshape(-1).to(dtype) for t in ts])

    @staticmethod
    def from_flat(buffer: torch.Tensor, like: WeightCollection) -> WeightCollection:
        """Unpack a buffer made by :meth:`to_flat` into the layout of ``like``.

        The result's tensors take ``like``'s dtypes. A buffer of the wrong size raises
        ``ValueError``.
        """
        if buffer.dim() != 1:
            raise ValueError(f"a flat buffer is 1-D, got shape {tuple(buffer.shape)}")
        if buffer.numel() != like.numel:
            raise ValueError(f"buffer has {buffer.numel()} elements but the layout needs {like.numel}")
        pieces = iter(buffer.split([t.numel() for _, _, t in like.tensors()]))
        return like._map(lambda t: next(pieces).view(t.shape).to(t.dtype).clone())

    def load_flat_(self, buffer: torch.Tensor) -> None:
        """Copy a flat buffer's values into these tensors in place."""
        if buffer.numel() != self.numel:
            raise ValueError(f"buffer has {buffer.numel()} elements but the layout needs {self.numel}")
        with torch.no_grad():
            for (_, _, t), piece in zip(self.tensors(), buffer.split([t.numel() for _, _, t in self.tensors()])):
                t.copy_(piece.view(t.shape))

    # -- files -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat ``{"layer/index": tensor}`` dictionary (contiguous copies), for safetensors."""
        # A layer name may itself hold "/": the index is always the part after the last one.
        return {f"{name}/{i}": t.detach().contiguous().clone() for name, i, t in self.tensors()}

    @staticmethod
    def from_state_dict(state: Mapping[str, torch.Tensor], order: Sequence[str] | None = None) -> WeightCollection:
        """Inverse of :meth:`state_dict`. ``order`` gives the layer order (default: as stored)."""
        layers: OrderedDict[str, dict[int, torch.Tensor]] = OrderedDict()
        for key, t in state.items():
            name, sep, idx = key.rpartition("/")
            if not sep or not idx.isdigit():
                raise ValueError(f"key {key!r} is not of the form 'layer/index'")
            layers.setdefault(name, {})[int(idx)] = t
        names = list(order) if order is not None else list(layers)
        out = []
        for name in names:
            if name not in layers:
                raise ValueError(f"layer {name!r} missing from the stored weights")
            by_idx = layers[name]
            if sorted(by_idx) != list(range(len(by_idx))):
                raise ValueError(f"layer {name!r} has tensor indices {sorted(by_idx)}")
            out.append((name, [by_idx[i] for i in range(len(by_idx))]))
        return WeightCollection(out)

    def to_bytes(self, metadata: Mapping[str, str] | None = None) -> bytes:
        """Safetensors bytes of the tensors (copied to the CPU), the layer order in the metadata."""
        from safetensors.torch import save

        meta = {"sparknet.layers": "\n".join(self._layers)}
        if metadata:
            meta.update({str(k): str(v) for k, v in metadata.items()})
        return save(self.to("cpu").state_dict(), metadata=meta)

    @staticmethod
    def from_bytes(data: bytes) -> WeightCollection:
        """Read :meth:`to_bytes`'s bytes; ``ValueError`` if they are truncated or corrupt (header or tensors)."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        # safetensors' header: little-endian u64 length, then JSON with "__metadata__".
        if len(data) < 8:
            raise ValueError("weights file is truncated")
        (n,) = struct.unpack("<Q", data[:8])
        if n > len(data) - 8:
            raise ValueError(f"weights file is cut short: its header claims {n} bytes, {len(data) - 8} follow")
        try:
            header = json.loads(data[8:8 + n])
        except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested too deep to read
            raise ValueError(f"weights file has a corrupt header: {e}") from None
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        order = meta.get("sparknet.layers") if isinstance(meta, dict) else None
        if not isinstance(header, dict) or not isinstance(meta or {}, dict) or not isinstance(order or "", str):
            raise ValueError("weights file has a corrupt header: not the JSON object of a safetensors file")
        try:
            state = load(data)
        except SafetensorError as e:
            raise ValueError(f"weights file is corrupt: {e}") from None
        return WeightCollection.from_state_dict(state, order.split("\n") if order else None)

    def save(self, path: str | PathLike, metadata: Mapping[str, str] | None = None) -> None:
        """Write to a safetensors file (:meth:`to_bytes`)."""
        Path(path).write_bytes(self.to_bytes(metadata))

    @staticmethod
    def load(path: str | PathLike) -> WeightCollection:
        """Read a file written by :meth:`save`."""
        return WeightCollection.from_bytes(Path(path).read_bytes())

def _check_scalar(value) -> None:
    if isinstance(value, (WeightCollection, torch.Tensor)) or not isinstance(value, (int, float)):
        raise TypeError(f"a WeightCollection is scaled by a Python number, got {type(value).__name__}")


def worker_layouts(weights, split: int = 1, shard: int = 1) -> list[list[tuple]]:
    """The layout of each of a worker's ``split x shard`` ranks' part of a flat buffer of ``weights`` (``(shape,
    split_dim, sharded)`` triples, in the flat buffer's order): rank ``c * split + m`` holds part m of a weight with a
    ``split_dim`` cut along it in ``split`` parts (tensor parallelism's), then part c of that cut along its first
    dimension in ``shard`` parts where ``sharded`` (FSDP2's rule for a parameter); every cut as ``torch.chunk`` cuts
    (the last parts small or empty). A weight with neither is whole on every rank.

    A rank's entry for a weight is its box: ``(first, end, size)`` for each of the weight's dimensions, the rank
    holding ``weight[first:end, ...]`` in row-major order (an empty box as ``(0, 0, size)`` in every dimension).
    :meth:`~sparknet.net.Net.shard_layout` is one rank's of them."""
    layouts = []
    for rank in range(split * shard):
        c, m = divmod(rank, split)
        layout = []
        for shape, split_dim, sharded in weights:
            box = _cut_box(whole_box(shape), split_dim, m, split)
            layout.append(_cut_box(box, 0 if sharded and len(shape) else None, c, shard))
        layouts.append(layout)
    return layouts


def module_layouts(module, split: int = 1, dims=None, shard: int = 1) -> list[list[tuple]]:
    """:func:`worker_layouts` of a graph module's weights (its ``layer_weights()``, in flat order), each cut along its
    dimension in ``dims`` (:func:`~sparknet.parallel.tensor.split_dims`; ``None``: nothing split), its parameters
    sharded ``shard`` ways and its buffers never."""
    tensors = (t for ts in module.layer_weights().values() for t in ts)
    return worker_layouts([(tuple(t.shape), None if dims is None else dims[i],
                            shard > 1 and isinstance(t, torch.nn.Parameter)) for i, t in enumerate(tensors)],
                          split, shard)


def whole_box(shape) -> tuple:
    """The box of a weight of ``shape`` held whole."""
    return tuple((0, n, n) for n in shape)


def local_box(box) -> tuple:
    """``box`` as :func:`worker_layouts` writes it: an empty one as ``(0, 0, size)`` in every dimension."""
    if box_numel(box):
        return tuple(box)
    return tuple((0, 0, n) for _, _, n in box)


def _cut_box(box: tuple, dim: int | None, j: int, parts: int) -> tuple:
    """Part ``j`` of ``box`` cut along ``dim`` in ``parts`` as ``torch.chunk`` cuts (``dim`` ``None``: ``box``)."""
    if dim is None or parts == 1:
        return box
    first, end, size = box[dim]
    chunk = -(-(end - first) // parts)
    start = min(first + j * chunk, end)
    return local_box(box[:dim] + ((start, min(start + chunk, end), size),) + box[dim + 1:])


def box_numel(box) -> int:
    """Values a box holds."""
    return math.prod(end - first for first, end, _ in box)


def box_size(box) -> int:
    """Values of the whole weight a box is part of."""
    return math.prod(size for *_, size in box)


def _held_before(box, index: int) -> int:
    """Values of ``box`` at row-major indices of its weight below ``index``."""
    if index <= 0:
        return 0
    if not box:  # a scalar: its one value, at index 0
        return 1
    (first, end, _), rest = box[0], box[1:]
    inner = box_size(rest)
    if inner == 0:
        return 0
    q, r = divmod(index, inner)
    return max(0, min(q, end) - first) * box_numel(rest) + (_held_before(rest, r) if first <= q < end else 0)


def shard_slice(part: slice, layout) -> slice:
    """Where the values of ``part``, a slice of a whole flat buffer, lie in one rank's part of it (``layout``: its
    :meth:`~sparknet.net.Net.shard_layout`): ``parallel.mesh.cut_shard(whole, layout)[shard_slice(part, layout)]``
    holds the values of ``whole[part]`` this rank holds, in order.

    One slice, because a rank holds each weight's box in row-major order, as the whole buffer lies: the box's values
    before ``part`` all come before those in it. A streamed exchange's fragment of a sharded replica (every rank of a
    column exchanges its values of the same fragment of the whole weights)."""

    def held_before(index: int) -> int:
        held = offset = 0
        for box in layout:
            held += _held_before(box, index - offset)
            offset += box_size(box)
        return held

    return slice(held_before(part.start), held_before(part.stop))

