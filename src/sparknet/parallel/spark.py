"""Driver side of model-parallel training on Spark: one barrier stage of W = D x M tasks.

>>> result = fit_model_parallel(zoo.mlp(), train_df, workers=4,               # doctest: +SKIP
...                             job=ModelParallelJob(net=zoo.mlp(), model_parallel=2, tau=20, rounds=5),
...                             validation=mnist().test)
>>> result.summary["weight_bytes_per_worker"], result.summary["test_accuracy"]  # doctest: +SKIP

What it does, in order (every Spark job under one job group, each waited for with a deadline;
the caller's own job group is left as it was):

1. refuses what cannot run, before any task starts: workers not a multiple of M, more
   workers than task slots, a plan that does not split, a rank's weights over
   ``max_weight_bytes``;
2. the training data becomes one partition per task (:func:`sparknet.spark._data.chunk_rdd`),
   checked as the other engines check it (at most ``data_timeout_s``); every replica (M consecutive
   partitions) must have rows;
3. one barrier stage: each task runs :func:`sparknet.parallel._spark_task.model_parallel_task`;
   the driver waits for it at most ``stage_timeout_s`` and cancels the job group otherwise;
4. rank 0's gathered whole weights become a :class:`~sparknet.weights.WeightCollection`;
   the driver scores them on the validation data.

The driver holds the whole model at the end (to evaluate and save it); the workers never do.
This module imports pyspark only inside its functions; the executor side lives beside it, in
:mod:`sparknet.parallel._spark_task`.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass, replace

from sparknet.errors import EngineError
from sparknet.metrics import rounds_summary
from sparknet.net import Net
from sparknet.parallel._spark_task import model_parallel_task
from sparknet.parallel.runner import ModelParallelJob, effective_plan, num_classes_of, weights_from_result
from sparknet.parallel.tensor import check_weight_budget
from sparknet.spark import _data
from sparknet.spark._backend import check_barrier_slots, quietly, run_with_deadline
from sparknet.spark._barrier import GroupPlan
from sparknet.spark._session import get_session, is_local_master

__all__ = ["fit_model_parallel", "ModelParallelResult", "StageOptions"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class StageOptions:
    """Timeouts of the model-parallel barrier stage."""

    rendezvous_timeout_s: float = 180.0
    """Longest wait for every task to start and join the process group."""
    collective_timeout_s: float = 300.0
    """Longest wait of one collective (the gloo group's timeout)."""
    stage_timeout_s: float = 24 * 3600.0
    """Longest the driver waits for the whole stage before cancelling it."""
    data_timeout_s: float = 3600.0
    """Longest wait for the Spark job that converts and checks the training data."""

    def __post_init__(self):
        for name in ("rendezvous_timeout_s", "collective_timeout_s", "stage_timeout_s", "data_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")


@dataclass
class ModelParallelResult:
    """What :func:`fit_model_parallel` returns."""

    weights: object
    """The whole model's final weights (a :class:`~sparknet.weights.WeightCollection`)."""
    history: list[dict]
    """One record per round (``{"event": "round", ...}``)."""
    summary: dict
    """rounds, total_steps, samples, wall_s, test_accuracy, weight_bytes_per_worker, plan..."""


def _sample_shape(net_params) -> tuple[int, ...]:
    shape = getattr(net_params, "sample_shape", None)
    if shape is None:
        raise ValueError(f"the net {net_params.name!r} declares no input shape; model parallelism needs a NetParams "
                         "whose first input layer has a shape")
    return tuple(int(d) for d in shape)


def fit_model_parallel(net_params, train, *, job: ModelParallelJob, workers: int, validation=None, spark=None,
                       features_col: str = "features", label_col: str = "label",
                       options: StageOptions | None = None) -> ModelParallelResult:
    """Train ``net_params`` split M ways in D = workers / M replicas, in one Spark barrier stage.

    Parameters
    ----------
    net_params : NetParams
        The net; ``job.net`` is replaced by it.
    train : DataFrame or RDD
        As for :meth:`sparknet.spark.SparkTrainer.fit` (a feature column of numbers and an
        integer label); dealt into ``workers`` partitions, one per task. A replica trains on
        the union of its M partitions.
    job : ModelParallelJob
        M, the solver, the strategy, tau and the stopping rules.
    workers : int
        W, the tasks of the stage; a multiple of ``job.model_parallel``.
    validation : ArrayDataset or (x, y), optional
        Scored every ``job.eval_every_rounds`` rounds on the workers (each replica a share),
        and at the end on the driver.
    spark : SparkSession, optional
        Default: the active session, or ``local[workers]``.
    options : StageOptions, optional
        Timeouts.

    Raises
    ------
    ValueError
        A layout, plan, budget or data problem (before any task starts).
    WorkerError
        A worker failed; it carries the rank and the tail of the worker's traceback.
    EngineError
        The stage failed otherwise (a Spark error).
    DeadlineExceeded
        The data check ran past ``options.data_timeout_s`` or the stage past
        ``options.stage_timeout_s`` (its jobs are cancelled).
    """
    from pyspark import StorageLevel  # optional dependency: needed only to fit

    t_fit = time.perf_counter()
    options = options or StageOptions()
    m = job.model_parallel
    if workers < 1 or workers % m:
        raise ValueError(f"{workers} workers do not divide into model-parallel groups of {m}; use a number of "
                         f"workers that is a multiple of --model-parallel (e.g. {max(m, workers - workers % m)})")
    sample_shape = _sample_shape(net_params)
    plan = effective_plan(net_params, m, job.plan)
    per_rank = check_weight_budget(net_params, job.max_weight_bytes, m, plan)
    whole_bytes = check_weight_budget(net_params, None, 1)
    job = replace(job, net=net_params, plan=plan, sample_shape=sample_shape)
    spark = spark or get_session(f"local[{workers}]")
    sc = spark.sparkContext
    check_barrier_slots(sc, workers, "the barrier stage")
    expected_len = math.prod(sample_shape)
    num_classes = num_classes_of(net_params)
    val = _data.local_arrays(validation, sample_shape=sample_shape) if validation is not None else None
    if val is not None and num_classes is not None and (val[1].min() < 0 or val[1].max() >= num_classes):
        raise ValueError(f"validation data: labels range over [{val[1].min()}, {val[1].max()}] but the net has "
                         f"{num_classes} classes")
    group = f"sparknet-mp-{uuid.uuid4().hex[:12]}"
    chunks, source = _data.chunk_rdd(train, features_col=features_col, label_col=label_col,
                                     expected_len=expected_len, num_partitions=workers)
    chunks.persist(StorageLevel.MEMORY_AND_DISK)
    broadcasts = []
    try:
        _, total = _data.checked_partitions(sc, group, chunks, timeout_s=options.data_timeout_s,
                                            expected_len=expected_len, num_classes=num_classes, num_workers=workers,
                                            sample_shape=sample_shape)
        rows = total["rows_per_partition"]
        empty = [d for d in range(workers // m) if sum(rows[d * m:(d + 1) * m]) == 0]
        if empty:
            raise ValueError(f"model replicas {empty} have no training rows (rows per partition: {rows}); "
                             "every group of --model-parallel consecutive partitions needs data")
        job_bc = sc.broadcast(job)
        broadcasts.append(job_bc)
        val_bc = None
        if val is not None:
            val_bc = sc.broadcast(val)
            broadcasts.append(val_bc)
        params = GroupPlan(workers=workers, local=is_local_master(sc.master),
                           rendezvous_timeout_s=options.rendezvous_timeout_s,
                           collective_timeout_s=options.collective_timeout_s)
        stage = chunks.barrier().mapPartitionsWithIndex(model_parallel_task(job_bc, params, val_bc))
        log.info("model-parallel stage: %d workers = %d replicas x %d shards; plan %s; %s bytes of weights per "
                 "worker (%s whole)", workers, workers // m, m, plan, f"{per_rank:,}", f"{whole_bytes:,}")
        t_train = time.perf_counter()
        out = run_with_deadline(sc, group, f"sparknet model-parallel stage ({workers} workers)", stage.collect,
                                timeout_s=options.stage_timeout_s, what="the model-parallel stage") or []
        train_s = time.perf_counter() - t_train
    finally:
        quietly(chunks.unpersist)
        for bc in broadcasts:
            quietly(bc.destroy)
    results = sorted((row[2] for row in out if row[0] == "rank"), key=lambda r: r["rank"])
    if len(results) != workers or "weights" not in results[0]:
        raise EngineError(f"the model-parallel stage returned {len(results)} of {workers} results"
                          + ("" if results and "weights" in results[0] else " and no weights from rank 0"))
    weights = weights_from_result(results[0])
    history = results[0]["history"]
    test = None
    if val is not None:
        driver_net = Net(net_params, job.worker.solver, batch_size=job.worker.batch_size)
        driver_net.set_weights(weights)
        test = driver_net.evaluate(val)
    summary = {
        "engine": "barrier", "strategy": job.strategy, "workers": workers, "data_parallel": workers // m,
        "model_parallel": m, "plan": plan, "tau": job.tau,
        **rounds_summary(history, test, t_fit=t_fit, t_train=t_train, train_s=train_s),
        "weight_bytes_per_worker": [r["weight_bytes"] for r in results], "whole_weight_bytes": whole_bytes,
        "max_weight_bytes": job.max_weight_bytes, "data_rows": int(total["rows"]), "rows_per_partition": rows,
        "sample_shape": list(sample_shape), "num_classes": num_classes, "input": source.description,
        "barrier_workers": [{k: r[k] for k in ("rank", "dp_rank", "mp_rank", "host", "pid", "attempt", "setup_s")}
                            for r in results],
    }
    return ModelParallelResult(weights=weights, history=history, summary=summary)

