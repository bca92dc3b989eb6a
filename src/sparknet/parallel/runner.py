"""Which layers of a net split under model parallelism, and whether a fit's processes can hold their part.

:func:`default_plan` says which layers split when neither the DSL (``parallel=``) nor the caller does:
consecutive Linear layers in column/row pairs whose split stays split between them (no collective inside the
pair); :func:`effective_plan` is the plan a fit uses; :func:`split_budget` checks a fit's plan and weight budget
before any work. The barrier engine trains a split net as workers of several processes
(:meth:`~sparknet.net.Net.split`, :mod:`sparknet.spark.barrier.executor`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from sparknet.errors import GraphError
from sparknet.layers import LinearLayer
from sparknet.parallel.tensor import _meta_module, check_weight_budget, resolve_plan

__all__ = ["default_plan", "effective_plan", "split_budget"]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- plans


def default_plan(net_params, model_parallel: int) -> dict[str, str]:
    """Linear layers in column/row pairs: ``{first: "column", second: "row"}`` for each pair found.

    Walks the Linear layers in order and pairs each with the next one when the first's
    output, split column-wise, reaches the second through element-wise layers only (so
    nothing is communicated inside the pair) and both sizes divide by ``M``. A Linear layer
    that pairs with nothing stays whole. Built on the ``meta`` device: no memory is used.
    """
    module = _meta_module(net_params)
    linears = [layer.name for layer in net_params.layers if isinstance(layer, LinearLayer)]
    off = {name: None for name in linears}  # the DSL's own parallel= fields play no part here
    plan: dict[str, str] = {}
    i = 0
    while i + 1 < len(linears):
        pair = {linears[i]: "column", linears[i + 1]: "row"}
        try:
            resolved = resolve_plan(module, model_parallel, {**off, **pair})
            pairs = not resolved.gather[linears[i]] and resolved.row_input_dim[linears[i + 1]] is not None
        except GraphError:
            pairs = False
        if pairs:
            plan.update(pair)
        i += 2 if pairs else 1
    return plan


def effective_plan(net_params, model_parallel: int, plan: Mapping[str, str | None] | None = None) -> dict:
    """The plan a run uses: ``plan`` when given, else the DSL's ``parallel=`` fields, else :func:`default_plan`.

    Returns the resolved modes, layer name to ``"column"``/``"row"``.

    Raises
    ------
    GraphError
        A layer that cannot split as asked, or sizes that do not divide by ``M``.
    ValueError
        Nothing to split (say which layers with a plan).
    """
    module = _meta_module(net_params)
    declared = any(getattr(layer, "parallel", None) is not None for layer in net_params.layers)
    chosen = plan if plan is not None else (None if declared else default_plan(net_params, model_parallel))
    resolved = resolve_plan(module, model_parallel, chosen)
    if not resolved.modes:
        raise ValueError(f"nothing of the net {net_params.name!r} splits {model_parallel} ways: no pair of Linear "
                         "layers whose sizes divide by the model-parallel degree; name the layers to split with "
                         "--parallel-plan LAYER=column,LAYER=row")
    return {name: mode.value for name, mode in resolved.modes.items()}


def split_budget(net_params, dist) -> tuple[dict | None, int, int]:
    """A fit's model parallelism (``dist``: a :class:`~sparknet.config.DistributedConfig`), checked before any work.

    Returns the plan the net splits by (``None``: it does not split), the bytes of weights one process holds
    (a sharded replica's share) and the whole net's. A process over ``dist.max_weight_bytes`` is refused with a
    :class:`WeightBudgetError` that names the sharding or model-parallel degree that fits (an unsplit net: under
    the plan M = 2 would use).
    """
    m, budget = dist.model_parallel, None if dist.max_weight_bytes is None else int(dist.max_weight_bytes)
    whole = check_weight_budget(net_params, None, 1)
    if m == 1:
        g = dist.procs_per_worker
        return None, check_weight_budget(net_params, budget, 1, default_plan(net_params, 2) if budget else None,
                                         shard=g if dist.shard_replica else 1, procs_per_worker=g), whole
    plan = effective_plan(net_params, m, dist.plan())
    shard = dist.procs_per_worker // m if dist.shard_replica else 1  # a split copy's parts sharded over the copies
    return plan, check_weight_budget(net_params, budget, m, plan, shard=shard), whole
