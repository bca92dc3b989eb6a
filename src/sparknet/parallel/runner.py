"""One rank's whole run in the D x M layout: build the split net, train rounds, gather the weights.

:func:`run_rank` is what every task of the barrier engine's stage runs for a split net (see
:mod:`sparknet.spark.barrier.executor`; ``DistributedConfig.model_parallel``), and what plain processes run
too: it needs only an initialized default process group (gloo) and this rank's rows. It never imports pyspark.

    job = ModelParallelJob(net=zoo.mlp(), worker=WorkerConfig(solver=SolverConfig(base_lr=0.01)), model_parallel=2,
                           tau=20, rounds=5)
    result = run_rank(job, x, y, validation=(vx, vy))     # on every rank of the default group
    result["weights"]                                      # rank 0: the whole model's flat weights (bytes)

:func:`default_plan` says which layers split when neither the DSL (``parallel=``) nor the
caller does: consecutive Linear layers in column/row pairs whose split stays split between
them (no collective inside the pair); :func:`split_budget` checks a fit's plan and weight budget.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sparknet.collective import CollectiveExchange
from sparknet.config import Strategy, WorkerConfig
from sparknet.errors import GraphError
from sparknet.layers import LinearLayer
from sparknet.loop import EvalPlan, FitPlan, StopRule, run_rounds
from sparknet.net import Net
from sparknet.parallel.mesh import init_layout, replica_seed, share_data_over_mp
from sparknet.parallel.tensor import (_meta_module, build_parallel, check_weight_budget, gather_full_weights,
                                     local_weight_bytes, resolve_plan)
from sparknet.strategies import WorkerState, make_strategy
from sparknet.weights import WeightCollection

__all__ = ["ModelParallelJob", "run_rank", "weights_from_result", "default_plan", "effective_plan", "split_budget"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ModelParallelJob:
    """Everything a rank needs to train its part of a D x M layout (plain, picklable values)."""

    net: Any
    """The :class:`~sparknet.layers.NetParams` to split."""
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    """Every replica's solver, minibatch, seed (of the split weights and each replica's data order), threads
    per rank and ``steps``, the local steps per replica at most (a stopping rule)."""
    model_parallel: int = 2
    """``M``: ranks each replica is split across."""
    strategy: str = "average"
    """How the D replicas combine each round (average, diloco, easgd)."""
    strategy_options: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of :func:`sparknet.strategies.make_strategy`."""
    tau: int = 50
    """Local steps per round."""
    rounds: int | None = None
    """Stop after this many rounds."""
    target_accuracy: float | None = None
    """Stop as soon as validation accuracy reaches this."""
    plan: Mapping[str, str | None] | None = None
    """Which layers split (layer name to column, row or None); ``None``: :func:`effective_plan`."""
    max_weight_bytes: int | None = None
    """Bytes of weights one rank may hold; over it, the build refuses before allocating."""
    eval_every_rounds: int = 1
    """Rounds between evaluations on the validation data (when given)."""
    sample_shape: tuple[int, ...] | None = None
    """Shape of one sample; flat feature rows are reshaped to it."""

    def __post_init__(self):
        if self.model_parallel < 1:
            raise ValueError(f"model_parallel must be at least 1, got {self.model_parallel}")
        if self.tau < 1:
            raise ValueError(f"tau must be at least 1, got {self.tau}")
        if self.rounds is None and self.worker.steps is None and self.target_accuracy is None:
            raise ValueError("give a stopping rule: rounds, worker.steps or target_accuracy")
        for name in ("rounds", "eval_every_rounds"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        key = Strategy(str(getattr(self.strategy, "value", self.strategy)).lower())
        refused = {Strategy.SYNC: "the sync strategy allreduces whole gradients every step and does not know about "
                                  "split layers",
                   Strategy.ASYNC: "the async strategy (parameter server) does not split layers"}
        if key in refused:
            raise ValueError(f"{refused[key]}; use --strategy average, diloco or easgd with --model-parallel")
        object.__setattr__(self, "strategy", key.value)


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
    return plan, check_weight_budget(net_params, budget, m, plan), whole


# --------------------------------------------------------------------------- one rank's run


def run_rank(job: ModelParallelJob, x: np.ndarray | None, y: np.ndarray | None, validation=None, *,
             on_round: Callable[[dict], None] | None = None,
             after_train: Callable[[object, int], None] | None = None) -> dict:
    """Train this rank's part of the D x M layout; every rank of the default process group calls it.

    Parameters
    ----------
    job : ModelParallelJob
        The net, the solver, M, the strategy and the stopping rules.
    x, y : ndarray or None
        This rank's rows; a replica's M ranks pool theirs (:func:`share_data_over_mp`).
    validation : (ndarray, ndarray), optional
        The validation rows, the same on every rank; each replica evaluates its share.
    on_round : callable, optional
        Called on every rank with each round record.
    after_train : callable, optional
        ``after_train(net, round)`` after every round's local steps (fault injection).

    Returns
    -------
    dict
        ``rank``, ``dp_rank``, ``mp_rank``, ``weight_bytes`` (of the weights this rank held),
        ``history`` (the round records) and, on rank 0 only, ``weights``: the whole model's
        float32 weights as bytes in :meth:`WeightCollection.to_flat` order, and ``layers``:
        ``[(name, [shape, ...]), ...]`` to rebuild the collection from them.
    """
    import torch.distributed as dist

    t0 = time.perf_counter()
    worker = job.worker
    torch.set_num_threads(worker.threads)
    layout = init_layout(job.model_parallel)
    x, y = share_data_over_mp(x, y, layout)
    has_data = x is not None and len(x) > 0
    empty = torch.tensor([0.0 if has_data else 1.0])  # every rank raises together when some replica has no rows
    dist.all_reduce(empty)
    if empty.item() > 0:
        raise ValueError(f"{int(empty.item()) // layout.model_parallel} of {layout.data_parallel} model replicas have "
                         "no training rows; give every group of --model-parallel consecutive partitions some data")
    plan = job.plan if job.plan is not None else effective_plan(job.net, job.model_parallel)
    module = build_parallel(job.net, layout, plan, seed=worker.seed, max_weight_bytes=job.max_weight_bytes)
    seed = replica_seed(layout, worker.seed)
    torch.manual_seed(seed)  # the same dropout masks on the replica's ranks
    net = Net(module, worker.solver, batch_size=worker.batch_size, seed=seed)
    net.set_training_data((x.reshape(len(x), *job.sample_shape) if job.sample_shape else x, y))
    options = dict(job.strategy_options)
    if job.strategy == Strategy.EASGD.value:
        options["num_workers"] = layout.data_parallel
    strategy, state = make_strategy(job.strategy, **options), WorkerState()
    # the replica's M ranks run the split forward together on the same rows
    val = None if validation is None else tuple(v[layout.dp_rank::layout.data_parallel] for v in validation)
    exchange = CollectiveExchange(net, strategy, rank=layout.dp_rank, world=layout.data_parallel,
                                  group=layout.dp_group, state=state, has_data=has_data, validation=val,
                                  after_train=after_train)
    history: list[dict] = []
    mesh_fields = {"tau": job.tau, "workers": layout.world_size, "data_parallel": layout.data_parallel,
                   "model_parallel": layout.model_parallel}

    def record_round(record: dict) -> None:
        record.update(mesh_fields)
        history.append(record)
        if on_round is not None:
            on_round(record)

    fit = FitPlan(strategy=strategy, stop=StopRule(rounds=job.rounds, steps=worker.steps, tau=job.tau,
                                                   target_accuracy=job.target_accuracy),
                  evaluation=EvalPlan(every=job.eval_every_rounds))
    setup_s = time.perf_counter() - t0
    global_flat = run_rounds(exchange, fit, strategy.init_global(net.get_flat()), on_record=record_round, t0=t0)
    net.set_flat(global_flat)
    out: dict = {"rank": layout.rank, "dp_rank": layout.dp_rank, "mp_rank": layout.mp_rank,
                 "weight_bytes": local_weight_bytes(net), "setup_s": setup_s, "plan": dict(plan),
                 "history": history if layout.rank == 0 else []}
    if layout.dp_rank == 0:  # every replica holds the same global weights; replica 0 gathers its shards
        whole = gather_full_weights(net)  # a collective over replica 0's model-parallel group
        if layout.rank == 0:
            out["weights"] = whole.to_flat(torch.float32).numpy().tobytes()
            out["layers"] = [(name, [tuple(t.shape) for t in tensors]) for name, tensors in whole.items()]
    return out


def weights_from_result(result: Mapping[str, Any]):
    """The :class:`~sparknet.weights.WeightCollection` of rank 0's :func:`run_rank` result."""
    flat = torch.from_numpy(np.frombuffer(result["weights"], dtype=np.float32).copy())
    like = WeightCollection((name, [torch.empty(shape, device="meta") for shape in shapes])
                            for name, shapes in result["layers"])
    return WeightCollection.from_flat(flat, like)
