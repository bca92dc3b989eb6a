"""Tensor (model) parallelism: a GraphModule's layers split across a model-parallel group.

A layer marked ``parallel="column"`` keeps ``1/M`` of its output features (rows of the ``[out, in]``
weight and of the bias; a convolution's output channels) on each of the ``M`` ranks of a model-parallel
group; ``parallel="row"`` keeps ``1/M`` of its input features (columns of the weight; the bias whole).
The collectives are those of Megatron-LM (Shoeybi et al. 2019), expressed with PyTorch's own tensor
parallelism (:mod:`torch.distributed.tensor.parallel` over a CPU gloo ``DeviceMesh``). A column layer's
output stays split when every path from it runs through element-wise layers into row layers
(:func:`resolve_plan`); docs/MODEL_PARALLEL.md has the collectives of each case.

>>> mesh = init_layout(model_parallel=2).mp_mesh                     # doctest: +SKIP
>>> module = parallelize(zoo.mlp(hidden=(4096, 4096)).build(seed=0), mesh,
...                      plan={"ip1": "column", "ip2": "row"})      # doctest: +SKIP
>>> net = Net(module, SolverConfig(type="rmsprop", base_lr=1e-3))   # doctest: +SKIP

:func:`parallelize` returns a :class:`TensorParallelModule`, which :class:`~sparknet.net.Net` takes like
any GraphModule: its parameters are DTensors, while its :meth:`~TensorParallelModule.layer_weights` are the
plain local shards, so everything that moves flat buffers of weights sees only what this rank holds.
"""

from __future__ import annotations

import functools
import itertools
import types
import logging
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from sparknet.errors import GraphError
from sparknet.layers import (
    ActivationLayer,
    ConvLayer,
    DropoutLayer,
    Filler,
    FillerType,
    GraphModule,
    LinearLayer,
    NetParams,
    ParallelMode,
    PoolLayer,
)
from sparknet.weights import WeightCollection, box_numel, local_view, module_layouts, whole_weights

__all__ = [
    "ParallelPlan", "TensorParallelModule", "WeightBudgetError", "parallelize", "build_parallel", "resolve_plan",
    "local_weight_bytes", "weight_bytes_per_rank", "check_weight_budget", "gather_full_weights",
    "ConvColwiseParallel", "split_meta", "split_dims",
]

log = logging.getLogger(__name__)

PlanLike = Mapping[str, "ParallelMode | str | None"]


class WeightBudgetError(GraphError):
    """The weights one rank would hold exceed its ``max_weight_bytes`` budget."""

    def __init__(self, message: str, needed: int = 0, budget: int = 0):
        super().__init__(message)
        self.needed, self.budget = int(needed), int(budget)

    def __reduce__(self):
        return (type(self), (self.args[0], self.needed, self.budget))


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class ParallelPlan:
    """Which layers split, and how the split flows through the graph.

    Attributes
    ----------
    modes : dict of str to ParallelMode
        Layer name to ``column`` or ``row``.
    gather : dict of str to bool
        Column layer to whether its output is all-gathered (``False``: it stays split
        and feeds row layers directly).
    row_input_dim : dict of str to int or None
        Row layer to the axis its input arrives split on (``None``: it arrives whole
        and the layer takes its own slice).
    """

    modes: dict[str, ParallelMode]
    gather: dict[str, bool]
    row_input_dim: dict[str, int | None]

    def describe(self) -> str:
        """One line per split layer, for logs and docs."""
        lines = []
        for name, mode in self.modes.items():
            if mode is ParallelMode.COLUMN:
                how = "output all-gathered" if self.gather[name] else "output stays split"
            else:
                dim = self.row_input_dim[name]
                how = "input arrives whole" if dim is None else f"input arrives split on axis {dim}"
            lines.append(f"{name}: {mode.value} ({how})")
        return "\n".join(lines)


def _parse_mode(value: Any, layer: str) -> ParallelMode | None:
    if value is None or (isinstance(value, str) and value.lower() in ("none", "")):
        return None
    try:
        return ParallelMode(value.lower() if isinstance(value, str) else value)
    except ValueError:
        raise GraphError(f"layer {layer!r}: parallel mode must be 'column', 'row' or None, got {value!r}",
                         layer=layer) from None


def resolve_plan(module: GraphModule, model_parallel: int, plan: PlanLike | None = None) -> ParallelPlan:
    """The split layers of ``module``: the DSL's ``parallel=`` fields, overridden by ``plan``.

    Parameters
    ----------
    module : GraphModule
        The built net (its ``net_params`` says which layer reads which blob).
    model_parallel : int
        ``M``, the ranks each split layer is divided across; split sizes must divide by it.
    plan : mapping of str to str, optional
        Layer name to ``"column"``, ``"row"`` or ``None`` (``None`` keeps a layer whole even
        when its DSL definition says otherwise).

    Raises
    ------
    GraphError
        An unknown layer, a layer that cannot split that way, or a size not divisible by ``M``.
    """
    net: NetParams = module.net_params
    modes = {layer.name: ParallelMode(layer.parallel) for layer in net.layers
             if isinstance(layer, LinearLayer) and layer.parallel is not None}
    for name, value in (plan or {}).items():
        try:
            layer = net[name]
        except KeyError:
            raise GraphError(f"the parallel plan names layer {name!r}, which the net {net.name!r} does not have; "
                             f"layers: {[ly.name for ly in net.layers]}", layer=name) from None
        mode = _parse_mode(value, name)
        if mode is None:
            modes.pop(name, None)
        else:
            modes[name] = mode
    shapes = net.infer_shapes()
    for name, mode in modes.items():
        layer = net[name]
        if isinstance(layer, ConvLayer):
            if mode is not ParallelMode.COLUMN:
                raise GraphError(f"layer {name!r}: a convolution splits by output channels only (parallel='column')",
                                 layer=name)
            if layer.groups != 1:
                raise GraphError(f"layer {name!r}: a grouped convolution (groups={layer.groups}) cannot be split",
                                 layer=name)
            size, what = layer.num_filters, "num_filters"
        elif isinstance(layer, LinearLayer):
            if layer.transpose:
                raise GraphError(f"layer {name!r}: a transposed weight (transpose=True) cannot be split", layer=name)
            if mode is ParallelMode.COLUMN:
                size, what = layer.num_outputs, "num_outputs"
            else:
                size, what = module.layer_module(name).in_features, "input features"
        else:
            raise GraphError(f"layer {name!r} is a {type(layer).__name__}; only LinearLayer (column or row) and "
                             "ConvLayer (column) split across a model-parallel group", layer=name)
        if size % model_parallel:
            raise GraphError(f"layer {name!r}: {what} = {size} does not divide into {model_parallel} equal shards; "
                             f"choose sizes divisible by the model-parallel degree", layer=name)

    # Follow each column layer's split output through the graph (blob versions in layer order).
    split: dict[str, tuple[str, int]] = {}  # blob -> (column layer, split axis)
    keeps_split = {name: True for name, mode in modes.items() if mode is ParallelMode.COLUMN}
    row_source: dict[str, tuple[str, int] | None] = {}
    for layer in net.layers:
        mode = modes.get(layer.name)
        incoming = [split[b] for b in layer.bottoms if b in split]
        out: tuple[str, int] | None = None
        if mode is ParallelMode.ROW:
            src = incoming[0] if incoming else None
            if src is not None:
                axis = layer._axis(layer.axis, len(shapes[layer.bottoms[0]]))
                if src[1] != axis or (shapes[layer.bottoms[0]][axis] % model_parallel):
                    keeps_split[src[0]] = False
                    src = None
            row_source[layer.name] = src
        elif mode is ParallelMode.COLUMN:
            for src in incoming:
                keeps_split[src[0]] = False
            out = (layer.name, 1 if isinstance(layer, ConvLayer) else len(shapes[layer.tops[0]]) - 1)
        elif incoming:
            sub = module.layer_module(layer.name) if layer.name in module.module_names else None
            # Element-wise layers without parameters keep a split tensor split, as does pooling over split channels.
            elementwise = isinstance(layer, DropoutLayer) or (
                isinstance(layer, ActivationLayer) and (sub is None or not any(True for _ in sub.parameters())))
            preserves = elementwise or (isinstance(layer, PoolLayer) and incoming[0][1] == 1)
            if preserves and len(incoming) == 1 and len(layer.bottoms) == 1:
                out = incoming[0]
            else:
                for src in incoming:
                    keeps_split[src[0]] = False
        for top in layer.tops:
            if out is None:
                split.pop(top, None)
            else:
                split[top] = out
    row_dims = {name: (src[1] if src is not None and keeps_split[src[0]] else None)
                for name, src in row_source.items()}
    return ParallelPlan(modes=modes, gather={n: not k for n, k in keeps_split.items()}, row_input_dim=row_dims)


# --------------------------------------------------------------------------- parallel styles


def _mp_mesh(mesh_or_group: Any):
    """A 1-D DeviceMesh over the model-parallel ranks from a layout, a mesh or a process group."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = getattr(mesh_or_group, "mp_mesh", None)  # a ParallelLayout
    if mesh is not None:
        return mesh
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim == 1:
            return mesh_or_group
        names = mesh_or_group.mesh_dim_names or ()
        if "mp" not in names:
            raise ValueError(f"a {mesh_or_group.ndim}-d device mesh needs a dimension named 'mp', got {names}")
        return mesh_or_group["mp"]
    import torch.distributed as dist

    if isinstance(mesh_or_group, dist.ProcessGroup):
        return DeviceMesh.from_group(mesh_or_group, "cpu", mesh_dim_names=("mp",))
    raise TypeError(f"expected a ParallelLayout, a DeviceMesh or a ProcessGroup, got {type(mesh_or_group).__name__}")


@functools.cache
def _styles():
    """The ParallelStyle classes (made on first use: torch.distributed.tensor is heavy to import)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    def distribute_parameters(module, mesh, placements: dict, src_data_rank) -> None:
        """Replace each of ``module``'s own parameters with a DTensor placed as ``placements[name]``."""
        for pname, param in list(module.named_parameters(recurse=False)):
            dist_param = distribute_tensor(param, mesh, [placements[pname]], src_data_rank=src_data_rank)
            module.register_parameter(pname, nn.Parameter(dist_param, requires_grad=param.requires_grad))

    class _ConvColwise(ParallelStyle):
        """Split a ``Conv2d`` by output channels: weight and bias ``Shard(0)``, output ``Shard(1)``."""

        def __init__(self, *, gather_output: bool = False, use_local_output: bool = True):
            super().__init__()
            self.gather_output = gather_output
            self.use_local_output = use_local_output

        def _partition(self, name, module, mesh):
            distribute_parameters(module, mesh, {"weight": Shard(0), "bias": Shard(0)}, self.src_data_rank)

        @staticmethod
        def _input(module, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return (x, *inputs[1:])

        def _output(self, module, output, mesh):
            if self.gather_output:
                output = output.redistribute(placements=[Replicate()])
            return output.to_local() if self.use_local_output else output

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            if not isinstance(module, nn.Conv2d):
                raise TypeError(f"ConvColwiseParallel splits nn.Conv2d only, got {type(module).__name__}; "
                                "use ColwiseParallel for nn.Linear")
            module.forward = types.MethodType(_conv_local, module)
            return distribute_module(module, device_mesh, self._partition, self._input, self._output)

    def _conv_local(module, x):
        """The convolution of this rank's output channels, on local tensors: DTensor's own convolution labels the
        weight's and bias's gradients Replicate though they hold this rank's channels only (torch 2.13), and the
        solver then fails on them. The input's gradient is this rank's part of a sum (``Partial``): it is summed
        over the ranks on its way back, the all-reduce a column layer's input takes."""
        weight, bias = module.weight, module.bias
        out = module._conv_forward(x.to_local(grad_placements=[Partial()]), weight.to_local(),
                                   None if bias is None else bias.to_local())
        return DTensor.from_local(out, weight.device_mesh, [Shard(1)], run_check=False)

    class _FlattenRowwise(ParallelStyle):
        """Row-split a Linear whose input is flattened from ``axis`` and arrives split on that axis.

        ``RowwiseParallel`` wants its input split on the last axis; a Linear fed by a
        channel-split convolution (``[N, C/M, H, W]``, flattened from axis 1) is split on
        axis 1 instead, and the flattened ``C*H*W`` features are then split in the same
        contiguous chunks as the weight's columns.
        """

        def __init__(self, axis: int, *, input_split: bool):
            super().__init__()
            self.axis = axis
            self.input_split = input_split

        def _partition(self, name, module, mesh):
            distribute_parameters(module, mesh, {"weight": Shard(1), "bias": Replicate()}, self.src_data_rank)

        def _input(self, module, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                layout = Shard(self.axis) if self.input_split else Replicate()
                x = DTensor.from_local(x, mesh, [layout], run_check=False)
            if x.placements[0] != Shard(self.axis):
                x = x.redistribute(placements=[Shard(self.axis)])
            return (x, *inputs[1:])

        @staticmethod
        def _output(module, output, mesh):
            return output.redistribute(placements=[Replicate()]).to_local()

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            return distribute_module(module, device_mesh, self._partition, self._input, self._output)

    return _ConvColwise, _FlattenRowwise


def ConvColwiseParallel(*, gather_output: bool = False, use_local_output: bool = True):
    """A ``ParallelStyle`` splitting an ``nn.Conv2d`` by output channels (torch has none for convolutions).

    Parameters
    ----------
    gather_output : bool
        All-gather the channel-split output (``True``) or return this rank's channels.
    use_local_output : bool
        Return a plain tensor rather than a DTensor.
    """
    conv_cls, _ = _styles()
    return conv_cls(gather_output=gather_output, use_local_output=use_local_output)


def _style_for(module: GraphModule, plan: ParallelPlan, name: str):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    conv_cls, flat_row_cls = _styles()
    layer = module.net_params[name]
    sub = module.layer_module(name)
    if plan.modes[name] is ParallelMode.COLUMN:
        if isinstance(layer, ConvLayer):
            return conv_cls(gather_output=plan.gather[name])
        return ColwiseParallel(output_layouts=Replicate() if plan.gather[name] else Shard(-1))
    dim = plan.row_input_dim[name]
    bottom_ndim = len(module.shapes[layer.bottoms[0]])
    axis = layer.axis + bottom_ndim if layer.axis < 0 else layer.axis
    if axis == bottom_ndim - 1 and getattr(sub, "flatten_from", None) is None:
        return RowwiseParallel(input_layouts=Shard(-1) if dim is not None else Replicate())
    return flat_row_cls(axis, input_split=dim is not None)


# --------------------------------------------------------------------------- the parallel module


class TensorParallelModule(nn.Module):
    """A GraphModule whose split layers hold DTensor shards; what :func:`parallelize` returns.

    Behaves as the GraphModule it wraps (``forward``, ``loss``, ``run``, ``param_groups``
    and its attributes), except that :meth:`layer_weights` gives this rank's local shards
    as plain tensors sharing storage with the parameters. A :class:`~sparknet.net.Net` built
    on it therefore trains with DTensor parameters but reads, writes and averages only the
    local shards.

    Attributes
    ----------
    module : GraphModule
        The wrapped module (its split layers modified in place).
    plan : ParallelPlan
        What was split and how.
    mesh : DeviceMesh
        The 1-D model-parallel mesh.
    """

    def __init__(self, module: GraphModule, plan: ParallelPlan, mesh) -> None:
        super().__init__()
        self.module = module
        self.plan = plan
        self.mesh = mesh

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is None:
                raise
            return getattr(module, name)

    def forward(self, x: Tensor, y: Tensor | None = None) -> Tensor:
        return self.module(x, y)

    def layer_weights(self) -> OrderedDict[str, list[Tensor]]:
        """Layer name to this rank's local tensors (shards of the split layers, views, no copies)."""
        return OrderedDict((name, [local_view(t) for t in tensors])
                           for name, tensors in self.module.layer_weights().items())

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scale the gradients so their norm over the *whole* model is at most ``max_norm``.

        ``torch.nn.utils.clip_grad_norm_`` refuses a mix of DTensor and plain gradients. Here
        the squares of the split shards are summed over the model-parallel group, replicated
        pieces and whole layers are counted once, and every rank applies the same factor, so
        the result equals clipping the unsplit model. Returns the total norm.
        """
        import torch.distributed as dist

        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        split = torch.zeros((), dtype=torch.float64)
        whole = torch.zeros((), dtype=torch.float64)
        for g in grads:
            squares = local_view(g).double().pow(2).sum()
            if any(pl.is_shard() for pl in getattr(g, "placements", ())):
                split += squares
            else:
                whole += squares
        if self.mesh.size() > 1:
            dist.all_reduce(split, group=self.mesh.get_group())
        total = (split + whole).sqrt()
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            for g in grads:
                local_view(g).mul_(coef)  # a view of the gradient's storage
        return total.float()


def parallelize(graph_module: GraphModule, mesh_or_groups: Any, plan: PlanLike | None = None) -> TensorParallelModule:
    """Split the layers of ``graph_module`` across a model-parallel group (in place).

    Every rank of the group must call it with the same net; the split weights are taken
    from the model-parallel rank 0 (scattered), so ranks need not share a seed.

    Parameters
    ----------
    graph_module : GraphModule
        A built net, e.g. ``net_params.build(seed=0)``.
    mesh_or_groups : ParallelLayout, DeviceMesh or ProcessGroup
        The model-parallel group: a :class:`~sparknet.parallel.mesh.ParallelLayout`, a 2-D
        mesh with a dimension named ``"mp"``, a 1-D mesh, or the group itself.
    plan : mapping of str to str, optional
        Overrides of the DSL's ``parallel=`` fields (see :func:`resolve_plan`).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if isinstance(graph_module, TensorParallelModule):
        raise ValueError("this module is already parallelized")
    if not isinstance(graph_module, GraphModule):
        raise TypeError(f"parallelize takes a GraphModule (NetParams.build()), got {type(graph_module).__name__}")
    mesh = _mp_mesh(mesh_or_groups)
    resolved = resolve_plan(graph_module, mesh.size(), plan)
    if not resolved.modes:
        log.warning("no layer of net %r is marked parallel: every rank holds the whole model",
                    graph_module.net_params.name)
    for name in resolved.modes:
        parallelize_module(graph_module.layer_module(name), mesh, _style_for(graph_module, resolved, name))
    log.info("model-parallel degree %d:\n%s", mesh.size(), resolved.describe())
    return TensorParallelModule(graph_module, resolved, mesh)


def split_meta(graph_module: GraphModule, mesh_or_groups: Any, plan: PlanLike | None = None) -> TensorParallelModule:
    """Split a ``graph_module`` built on the ``meta`` device (shapes, no values) over a model-parallel group, in place:
    each rank's parameters become DTensors whose local shards hold nothing yet (give them memory with ``to_empty``
    and values with :meth:`~sparknet.net.Net.set_flat`); nothing is scattered, so no rank ever holds a whole split
    layer. What :func:`build_parallel` and :meth:`~sparknet.net.Net.split` start from."""
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = _mp_mesh(mesh_or_groups)
    resolved = resolve_plan(graph_module, mesh.size(), plan)
    for name in resolved.modes:
        parallelize_module(graph_module.layer_module(name), mesh, _style_for(graph_module, resolved, name),
                           src_data_rank=None)
    return TensorParallelModule(graph_module, resolved, mesh)


def split_dims(graph_module: GraphModule, model_parallel: int, plan: PlanLike | None = None) -> list[int | None]:
    """The dimension each tensor of ``graph_module`` (whole, or on the meta device; in
    :meth:`~sparknet.net.Net.get_flat` order) is cut along once it is split by ``plan`` (:func:`resolve_plan`): a
    column layer's weight and bias their first, a row layer's weight its second; ``None``: whole on every rank. What
    a split worker's layouts are made from (:func:`~sparknet.weights.worker_layouts`)."""
    modes = resolve_plan(graph_module, model_parallel, plan).modes
    dims: list[int | None] = []
    for name, tensors in graph_module.layer_weights().items():
        mode = modes.get(name)
        owned = {} if mode is None else {id(t): p for p, t in graph_module.layer_module(name).named_parameters()}
        dims += [_cut_dim(mode, owned[id(t)]) if id(t) in owned else None for t in tensors]
    return dims


def _cut_dim(mode: ParallelMode | None, name: str) -> int | None:
    """The dimension tensor parallelism cuts a layer's tensor ``name`` along (its styles: a column layer's every
    tensor along its first, a row layer's weight along its second), or ``None``: whole on every rank (a row layer's
    bias, a layer left whole)."""
    if mode is ParallelMode.COLUMN:
        return 0
    if mode is ParallelMode.ROW and not name.rsplit(".", 1)[-1].startswith("bias"):
        return 1
    return None


# --------------------------------------------------------------------------- memory


def local_weight_bytes(module: nn.Module) -> int:
    """Bytes of parameters and buffers this rank holds (the local shard of each DTensor)."""
    module = _inner(module)  # parameters() and buffers() list a tensor once
    return sum(local_view(t).nbytes for t in itertools.chain(module.parameters(), module.buffers()))


def _meta_module(net_params: NetParams, seed: int = 0) -> GraphModule:
    """``net_params`` built on PyTorch's ``meta`` device: shapes only, no memory."""
    with torch.device("meta"):
        return net_params.build(seed=seed)


def weight_bytes_per_rank(net_params: NetParams, model_parallel: int = 1, plan: PlanLike | None = None, *,
                          shard: int = 1) -> int:
    """Bytes of weights each model-parallel rank would hold, computed without allocating them
    (on the ``meta`` device), so cheap for any size. With ``model_parallel=1`` it is the whole model's size;
    ``shard``: every parameter (split or not) then cut along its first dimension in that many parts (a sharded
    replica, FSDP2's way); the first rank's bytes, which hold the largest part. Buffers are never sharded.
    """
    if model_parallel < 1 or shard < 1:
        raise ValueError(f"model_parallel and shard must be at least 1, got {model_parallel}, {shard}")
    module = _meta_module(net_params)
    dims = split_dims(module, model_parallel, plan) if model_parallel > 1 else None
    tensors = [t for ts in module.layer_weights().values() for t in ts]
    first = module_layouts(module, model_parallel, dims, shard)[0]
    counters = sum(b.numel() * b.element_size() for b in module.buffers() if not b.is_floating_point())
    return counters + sum(box_numel(box) * t.element_size() for box, t in zip(first, tensors))


def check_weight_budget(net_params: NetParams, max_weight_bytes: int | None, model_parallel: int = 1,
                        plan: PlanLike | None = None, *, shard: int = 1, procs_per_worker: int = 1) -> int:
    """The bytes of weights each rank needs; :class:`WeightBudgetError` when they would exceed
    ``max_weight_bytes`` (none: no budget). ``shard``: the replica is sharded that many ways; ``procs_per_worker``:
    the processes a worker has, to say whether sharding its replica over them would fit."""
    needed = weight_bytes_per_rank(net_params, model_parallel, plan, shard=shard)
    if max_weight_bytes is not None and needed > max_weight_bytes:
        hint = ""
        sharded = weight_bytes_per_rank(net_params, shard=procs_per_worker) if procs_per_worker > shard else None
        if sharded is not None and sharded <= max_weight_bytes:
            hint = f"; with --shard-replica each of a worker's {procs_per_worker} processes would hold {sharded:,}"
        for m in (m for m in (2, 4, 8, 16) if m > model_parallel and not hint):
            try:
                fits = weight_bytes_per_rank(net_params, m, plan)
            except GraphError:
                continue
            if fits <= max_weight_bytes:
                hint = f"; with --model-parallel {m} each rank would hold {fits:,}"
                break
        how = f"sharded {shard} ways" if shard > 1 else f"with model-parallel degree {model_parallel}"
        raise WeightBudgetError(
            f"net {net_params.name!r} needs {needed:,} bytes of weights per rank {how}, over the budget "
            f"max_weight_bytes={max_weight_bytes:,}{hint}. Split the widest layers (LinearLayer(parallel='column'/"
            "'row') or a plan) and raise the model-parallel degree, shard the replica over more processes, or "
            "raise the budget.", needed=needed, budget=max_weight_bytes)
    return needed


def _init_local_(local: Tensor, global_shape: tuple[int, ...], weight_shape: tuple[int, ...],
                 filler: Filler | None, is_bias: bool) -> None:
    """Initialise one rank's shard as its layer's full tensor would be, scales from the *global* shape."""
    with torch.no_grad():
        if filler is None:  # nn.Linear / nn.Conv2d defaults: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            fan_in = math.prod(weight_shape[1:]) if len(weight_shape) > 1 else weight_shape[0]
            bound = 1.0 / math.sqrt(max(fan_in, 1))
            local.uniform_(-bound, bound)
        elif filler.type in (FillerType.XAVIER, FillerType.MSRA):
            filler._fill_scaled(local, filler._fan(torch.empty(global_shape, device="meta")))
        elif filler.type == FillerType.POSITIVE_UNITBALL and not is_bias:
            raise GraphError("a positive_unitball filler normalises whole rows; build the net whole and "
                             "call parallelize() instead of build_parallel()")
        else:
            filler.fill_(local)


def build_parallel(net_params: NetParams, mesh_or_groups: Any, plan: PlanLike | None = None, *,
                   seed: int = 0, max_weight_bytes: int | None = None) -> TensorParallelModule:
    """Build ``net_params`` directly in split form: no rank ever allocates a whole split layer.

    The budget is checked first. The net is built on the ``meta`` device, split, and only
    then given memory: whole layers are initialised as :meth:`NetParams.build` would
    (one seed per layer, the same on every rank), and each shard of a split layer with
    the distribution its full tensor would have (scales from the global shape), from a
    seed that differs between model-parallel ranks. The weights therefore differ from
    ``net_params.build(seed)``'s; use :func:`parallelize` on a built net when they must match.

    Parameters
    ----------
    mesh_or_groups, plan
        As for :func:`parallelize`.
    max_weight_bytes : int, optional
        Budget of weight bytes per rank; exceeding it raises :class:`WeightBudgetError`
        before anything is allocated.
    """
    from torch.distributed.tensor import DTensor

    mesh = _mp_mesh(mesh_or_groups)
    m = mesh.size()
    check_weight_budget(net_params, max_weight_bytes, m, plan)
    parallel = split_meta(_meta_module(net_params, seed), mesh, plan)
    module, resolved = parallel.module, parallel.plan
    mp_rank = mesh.get_local_rank()
    trace = net_params._trace()  # (layer, bottom shapes, top shapes): what GraphModule built each layer from
    for index, (layer, ins, _) in enumerate(trace):
        if layer.name not in module.module_names:
            continue
        sub = module.layer_module(layer.name)
        if not any(True for _ in itertools.chain(sub.parameters(), sub.buffers())):
            continue
        split = layer.name in resolved.modes
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 100003 + index * 7919 + (mp_rank + 1) * 104729 * split)
            sub.to_empty(device="cpu")
            if not split:
                whole = layer._build(ins)
                layer._apply_fillers(whole)
                sub.load_state_dict(whole.state_dict())
                continue
            weight_shape = tuple(sub.weight.shape)
            for pname, param in sub.named_parameters():
                is_bias = pname.startswith("bias")
                filler = layer.bias_filler if is_bias else layer.weight_filler
                # A replicated piece (a row layer's bias) must be equal on every rank.
                replicated = isinstance(param, DTensor) and param.placements[0].is_replicate()
                with torch.random.fork_rng(devices=[], enabled=replicated):
                    if replicated:
                        torch.manual_seed(seed * 100003 + index * 7919)
                    _init_local_(local_view(param), tuple(param.shape), weight_shape, filler, is_bias)
    log.info("built %s split %d ways: %s bytes of weights on this rank", net_params.name, m,
             f"{local_weight_bytes(module):,}")
    return parallel


# --------------------------------------------------------------------------- whole weights


def _inner(module: Any) -> nn.Module:
    """The module of a :class:`~sparknet.net.Net` (which is not a module itself), or the module itself."""
    return module if isinstance(module, nn.Module) else module.module


def gather_full_weights(module: nn.Module) -> WeightCollection:
    """The whole (unsplit) weights, keyed by layer, on every rank: a collective over the group.

    Every rank of the model-parallel group must call it. Save the result from one rank to
    get an ordinary sparknet model that loads and runs on a single machine.
    """
    module = _inner(module)
    graph = module.module if isinstance(module, TensorParallelModule) else module  # its layers hold DTensors
    return whole_weights(graph.layer_weights())
