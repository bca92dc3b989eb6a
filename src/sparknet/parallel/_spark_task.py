"""Executor side of model-parallel training on Spark: one barrier stage of W = D x M tasks.

Every task of the stage runs :func:`model_parallel_task`:

1. reads its partition's chunks (one partition per task);
2. rendezvous: rank 0 opens a ``TCPStore`` on a port the OS picks, ``BarrierTaskContext.allGather``
   shares ``host:port``, every rank joins a gloo process group whose collectives time out;
3. :func:`sparknet.parallel.runner.run_rank`: the layout, the split net, the rounds over the
   data-parallel groups, the whole weights gathered to rank 0;
4. yields ``("rank", result)`` rows; the process group is destroyed in ``finally``.

A failing rank raises :func:`sparknet.spark._rounds.worker_failure`, as the other engines' tasks
do; the driver turns it into a :class:`~sparknet.errors.WorkerError` with the rank and the tail
of its traceback.

The driver side, beside it, is :mod:`sparknet.parallel.spark`.
"""

from __future__ import annotations

import logging
import os
import socket

import torch.distributed as dist

from sparknet.parallel.runner import run_rank
from sparknet.spark._barrier import GroupPlan, rendezvous
from sparknet.spark._data import merge_chunks
from sparknet.spark._rounds import worker_failure

__all__ = ["model_parallel_task"]

log = logging.getLogger(__name__)


def model_parallel_task(job_bc, params: GroupPlan, val_bc=None):
    """The stage's task function (``rdd.barrier().mapPartitionsWithIndex``).

    ``job_bc`` is a broadcast :class:`~sparknet.parallel.runner.ModelParallelJob`; ``params`` says
    how the tasks form their gloo group; ``val_bc`` a broadcast ``(x, y)`` of validation rows.
    """

    def task(index: int, chunks):
        from pyspark import BarrierTaskContext  # optional dependency: needed only where the task runs

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        try:
            yield from _run(ctx, rank, job_bc.value, params, None if val_bc is None else val_bc.value, chunks)
        except Exception as exc:
            raise worker_failure(rank, exc) from None  # the driver decodes it into a WorkerError

    return task


def _run(ctx, rank: int, job, params: GroupPlan, validation, chunks):
    x, y, _ = merge_chunks(chunks)
    del chunks
    store = None
    try:
        store = rendezvous(ctx, rank, params)  # the barrier engine's own: TCPStore + gloo, bounded waits
        result = run_rank(job, x, y, validation)
        result.update(host=socket.gethostname(), pid=os.getpid(), attempt=ctx.attemptNumber())
        yield ("rank", rank, result)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        del store
