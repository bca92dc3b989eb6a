"""Model parallelism: layers split across workers, in a D x M layout of data x model parallelism.

:func:`parallelize` splits the layers of a :class:`~sparknet.layers.GraphModule` across a
model-parallel group with PyTorch's tensor parallelism (DTensor over a gloo ``DeviceMesh``);
:func:`init_layout` makes the data- and model-parallel groups from an initialized default
process group. The barrier engine trains a split net as workers of several processes
(``DistributedConfig.model_parallel``, :meth:`~sparknet.net.Net.split`): each worker's ranks hold its layers'
parts, and the round's exchange runs between the ranks of every worker that hold the same part. See
``docs/MODEL_PARALLEL.md``.
"""

from sparknet.parallel.mesh import (
    ParallelLayout,
    SharedStream,
    init_layout,
    layout_coords,
    share_data_over_mp,
)
from sparknet.parallel.runner import default_plan, effective_plan, split_budget
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
    split_dims,
    split_meta,
    weight_bytes_per_rank,
)

__all__ = [
    "ParallelLayout", "init_layout", "layout_coords", "share_data_over_mp", "SharedStream",
    "ParallelPlan", "TensorParallelModule", "WeightBudgetError", "ConvColwiseParallel", "parallelize", "build_parallel",
    "resolve_plan", "local_weight_bytes", "weight_bytes_per_rank", "check_weight_budget", "gather_full_weights",
    "default_plan", "effective_plan", "split_budget", "split_meta", "split_dims",
]
