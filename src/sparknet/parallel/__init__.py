"""Model parallelism: layers split across workers, in a D x M layout of data x model parallelism.

:func:`parallelize` splits the layers of a :class:`~sparknet.layers.GraphModule` across a
model-parallel group with PyTorch's tensor parallelism (DTensor over a gloo ``DeviceMesh``);
:func:`init_layout` makes the data- and model-parallel groups from an initialized default
process group; :func:`run_rank` is one rank's whole run (what each task of the barrier engine's stage runs
for a split net, ``DistributedConfig.model_parallel``): the round loop of :mod:`sparknet.loop`
with the data-parallel group's allreduce (:mod:`sparknet.collective`) as its exchange, each
rank on its own shard. See ``docs/MODEL_PARALLEL.md``.
"""

from sparknet.parallel.mesh import (
    ParallelLayout,
    init_layout,
    layout_coords,
    replica_seed,
    share_data_over_mp,
)
from sparknet.parallel.runner import ModelParallelJob, default_plan, effective_plan, run_rank, split_budget
from sparknet.parallel.tensor import (
    ConvColwiseParallel,
    ParallelPlan,
    TensorParallelModule,
    WeightBudgetError,
    build_parallel,
    check_weight_budget,
    gather_full_weights,
    local_weight_bytes,
    parallelize,
    resolve_plan,
    weight_bytes_per_rank,
)

__all__ = [
    "ParallelLayout", "init_layout", "layout_coords", "replica_seed", "share_data_over_mp",
    "ParallelPlan", "TensorParallelModule", "WeightBudgetError", "ConvColwiseParallel", "parallelize", "build_parallel",
    "resolve_plan", "local_weight_bytes", "weight_bytes_per_rank", "check_weight_budget", "gather_full_weights",
    "ModelParallelJob", "run_rank", "default_plan", "effective_plan", "split_budget",
]
