"""Driver side of the Spark engines: :class:`SparkTrainer`.

>>> trainer = SparkTrainer(zoo.lenet(), WorkerConfig(solver=SolverConfig(base_lr=0.01), batch_size=64),
...                        DistributedConfig(workers=2, engine="rounds", tau=50, rounds=20))
>>> result = trainer.fit(train_df, validation=mnist().test)          # doctest: +SKIP
>>> result.summary["test_accuracy"], result.history[-1]["loss"]      # doctest: +SKIP

``fit`` runs, in order (each a Spark job under one job group per fit):

1. the training data becomes an RDD of numpy chunks with one partition per worker, cached
   (:mod:`sparknet.spark.data`); every problem in it (missing or non-numeric column, wrong
   feature length, NaN, labels out of range, more workers than rows, no rows) is one clear
   ``ValueError`` before any step is trained;
2. warm start: ``dist.warmup_steps`` steps on the driver, on a bounded sample of the data;
3. the engine: **rounds** (:mod:`sparknet.spark.rounds.driver`; one Spark job per round) or **barrier**
   (:mod:`sparknet.spark.barrier.driver`; one barrier stage, a gloo group, one allreduce per round);
4. cleanup: broadcasts destroyed, caches and staged files removed, job group cleared.

Both engines run the same :class:`~sparknet.strategies.TrainingStrategy` hooks, compression, automatic tau and
simulated link (docs/DESIGN.md's engine section says how each engine does each). A failed rounds-engine task is
retried by Spark from the previous round's saved state; a failed barrier stage is started again from the newest
state the driver holds (``EngineOptions.max_restarts``). With ``dist.checkpoint_dir`` both engines write a
checkpoint (:mod:`sparknet.checkpoint`) every ``dist.checkpoint_every`` rounds and at the end, from which
``dist.resume`` goes on exactly as an uninterrupted fit would. Faults for tests: :mod:`sparknet.faults`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from sparknet._malloc import keep_freed_memory
from sparknet._parquet import labels_with_weights
from sparknet.checkpoint import CheckpointError, RoundCheckpoints, open_checkpoints, set_rng_state
from sparknet.config import DistributedConfig, Engine, RunConfig, WorkerConfig, check_per_step_strategy
from sparknet.errors import EngineError, WorkerOutOfMemory
from sparknet.faults import faults_from
from sparknet.loop import FitPlan, ResumeState, returned_summary, check_streaming
from sparknet.metrics import returned_scores, rounds_summary
from sparknet.net import FeatureDict, Net
from sparknet.parallel.runner import split_budget
from sparknet.solvers import check_gradient_hook
from sparknet.spark import data as spark_data
from sparknet.spark.backend import check_barrier_slots, quietly, run_with_deadline
from sparknet.spark.barrier.driver import connect_refusal, run_barrier_engine, run_connect_stage
from sparknet.spark.engine import EngineOptions, EngineRun
from sparknet.spark.rounds.executor import (WorkerSpec, cleanup_partition, stage_frame, stage_hands, stage_partition,
                                            staged_head)
from sparknet.spark.rounds.driver import run_rounds_engine
from sparknet.spark.rounds.validation import ValidationShards, shard_stats
from sparknet.spark.session import get_session, is_connect, is_local_master, session_parallelism
from sparknet.strategies import TrainingStrategy, make_strategy
from sparknet.labels import Task, infer_task
from sparknet.weights import WeightCollection

__all__ = ["SparkTrainer", "TrainResult", "EngineOptions"]

CLEANUP_TIMEOUT_S = 300.0
"""Longest wait for the job that removes a fit's staged files (a failure to remove them is only logged)."""

log = logging.getLogger(__name__)


class _WarmupStopped(Exception):
    """The warm-up of a fit that failed while it trained, ended at its next step."""


@dataclass
class TrainResult:
    """What :meth:`SparkTrainer.fit` returns."""

    weights: WeightCollection
    """The final global weights."""
    history: list[dict]
    """One record per round (``{"event": "round", ...}``), as passed to ``on_round``."""
    summary: dict
    """rounds, bytes_communicated, wall_s, samples, samples_per_s, test_accuracy, stop_reason..."""
    net: Net = field(repr=False)
    """A driver-side Net holding the final weights (with the validation data, when given)."""


def _input_shape(net) -> tuple[int, ...] | None:
    """Sample shape of a NetParams net (first input layer's shape without the batch axis)."""
    params = net if hasattr(net, "layers") and hasattr(net, "build") else getattr(net, "net_params", None)
    return getattr(params, "sample_shape", None)


def _copy_module(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of the user's module for the driver, or a clear error when it cannot be copied."""
    try:
        return copy.deepcopy(module)
    except Exception as exc:
        raise TypeError(f"the model cannot be copied or pickled for the executors ({type(exc).__name__}: {exc}); "
                        "keep locks, open files, sockets and generators out of the module's attributes (create "
                        "them in forward, or drop them in __getstate__)") from exc


def _unused_column(df, name: str) -> str:
    """``name``, or ``name_2``, ``name_3``... whichever the DataFrame does not have."""
    taken = set(df.columns)
    candidates = (name if i == 1 else f"{name}_{i}" for i in range(1, len(taken) + 2))
    return next(c for c in candidates if c not in taken)


def _data_named(layout) -> str:
    """The training data, for messages: with a dict of feature columns, the columns and their shapes."""
    if layout is None:
        return "training data"
    return "training data (a dict of the columns " + ", ".join(
        f"{name!r} {list(shape)}" if shape else repr(name) for name, shape in layout) + ")"


class SparkTrainer:
    """Trains one network across K Spark workers by periodic averaging (SparkNet, Listing 3).

    Parameters
    ----------
    net : NetParams or torch.nn.Module
        The network. A plain module takes ``loss=`` (default cross entropy) and its features
        in the shape they come in (or ``image_shape`` in :meth:`fit`). A module must pickle
        (its class importable on the executors).
    worker : WorkerConfig, optional
        What every worker does: its solver (default SGD, lr 0.01, momentum 0.9), minibatch, seed,
        threads and device, and ``steps``, the local steps per worker at most (a stopping rule
        beside ``dist.rounds``/``epochs``/``target_accuracy``; the first one reached stops
        training). With device ``auto``/``cuda`` a task uses the GPU Spark assigned it
        (``spark.task.resource.gpu.amount``) and falls back to the CPU, saying why.
    dist : DistributedConfig, optional
        Workers, engine (``rounds`` or ``barrier``), strategy, tau and/or round_seconds,
        warmup_steps, the stopping rules (rounds, epochs, target_accuracy), master,
        eval_every_rounds. Default: the rounds engine, tau 50, one worker per default task
        slot of the session (then give ``worker.steps``).
    loss : callable, optional
        ``loss(prediction, y)`` for a plain module.
    strategy : TrainingStrategy, optional
        How workers combine (default: built from ``dist.strategy``).
    spark : SparkSession, optional
        Default: the active session, or a new one for ``dist.resolved_master``.
    on_round : callable, optional
        Called on the driver with every round record, as it happens.
    options : EngineOptions, optional
        Timeouts, staging directory, cache level, warm-up sample bounds.
    task : Task or str, optional
        ``"classification"`` (integer class ids), ``"regression"`` (a double label, or an array of
        doubles per row), ``"multilabel"`` (an array of 0/1 per row) or ``"unlabelled"``; default:
        inferred from the loss (:mod:`sparknet.labels`). A regression fit is scored by R², RMSE and MAE
        (``val_r2``, ``test_r2``...), and ``dist.target_accuracy`` is a target on R².
    """

    @classmethod
    def from_config(cls, net, run: RunConfig, dist: DistributedConfig, **kwargs) -> SparkTrainer:
        """A trainer for ``net`` as ``sparknet train`` would configure it: ``run.worker()`` and ``dist``.

        ``kwargs`` are the other keyword arguments of :class:`SparkTrainer` (``spark``, ``on_round``,
        ``loss``, ``strategy``, ``options``).
        """
        return cls(net, run.worker(), dist, **kwargs)

    def __init__(self, net, worker: WorkerConfig | None = None, dist: DistributedConfig | None = None, *, loss=None,
                 strategy: TrainingStrategy | None = None, spark=None, on_round: Callable[[dict], None] | None = None,
                 options: EngineOptions | None = None, task: Task | str | None = None, **moved):
        if unknown := sorted(set(moved) - {"solver", "batch_size", "seed", "threads", "device", "max_steps"}):
            raise TypeError(f"SparkTrainer got unexpected keyword arguments: {', '.join(unknown)}")
        if moved:  # the keywords SparkTrainer took before WorkerConfig
            fields = ", ".join(("steps" if k == "max_steps" else k) + "=..." for k in sorted(moved))
            raise TypeError(f"SparkTrainer takes {', '.join(sorted(moved))} in a WorkerConfig: "
                            f"SparkTrainer(net, WorkerConfig({fields}), dist)")
        if not (isinstance(net, torch.nn.Module) or (hasattr(net, "build") and hasattr(net, "layers"))):
            raise TypeError(f"net must be a NetParams or a torch.nn.Module, got {type(net).__name__}")
        if worker is not None and not isinstance(worker, WorkerConfig):
            raise TypeError(f"worker must be a sparknet.WorkerConfig, got {type(worker).__name__}")
        self.dist = dist or DistributedConfig(workers=1, tau=50)
        self._workers_from_session = dist is None
        if self.dist.engine is Engine.LOCAL:
            raise ValueError("engine 'local' trains in one process without Spark; use engine 'rounds' or 'barrier' "
                             "here (or sparknet.Net for one process)")
        self.worker = worker or WorkerConfig()
        if (self.dist.model_parallel > 1 or self.dist.max_weight_bytes is not None) and not hasattr(net, "layers"):
            raise ValueError("model parallelism and a weight budget (model_parallel, max_weight_bytes) need a "
                             "NetParams net: its layers are what splits and what is counted")
        if self.dist.model_parallel > 1 and self.worker.device != "cpu":
            raise ValueError("model parallelism splits layers over CPU gloo groups; use device cpu")
        if self.dist.shard_replica and self.worker.device != "cpu":
            raise ValueError("a sharded replica gathers and reduce-scatters its weights over the stage's CPU gloo "
                             "groups; use device cpu (sharded replicas on GPUs need NCCL groups, not built yet)")
        self.strategy = strategy if strategy is not None else make_strategy(self.dist.strategy,
                                                                            **self.dist.strategy_options())
        check_streaming(self.strategy, self.dist.streaming())
        if self.strategy.needs_gradient_hook:
            check_per_step_strategy(self.dist, f"strategy {self.strategy!r}", on_spark=True)
            check_gradient_hook(self.worker.solver, f"strategy {self.strategy!r}")
        self.net = net
        self.loss = loss
        self.task = infer_task(loss, net if hasattr(net, "layers") else getattr(net, "net_params", None), task)
        self._task_given = task is not None
        self.spark = spark
        self.on_round = on_round
        self.options = options or EngineOptions()
        link = self.options.link if self.options.link is not None else self.dist.link()
        self.link = None if link is not None and link.is_free else link
        self.latest_flat: torch.Tensor | None = None
        """The rounds engine's global weights after the newest round, as one flat buffer (what ``on_round`` may
        read to test or snapshot them; the barrier engine keeps its weights on the executors until the end)."""

    # -- fit ----------------------------------------------------------------------------------
    def fit(self, train, validation=None, *, features_col: str | Sequence[str] = "features",
            label_col: str | Sequence[str] | None = "label", weight_col: str | None = None,
            image_shape=None, initial_weights=None, features_as: str = "concat") -> TrainResult:
        """Train on ``train`` (a DataFrame or an RDD of ``(ndarray, label)``).

        Parameters
        ----------
        train : DataFrame, RDD or DealtRows
            Feature column of ``array<float>``/``array<double>``, an ML ``Vector`` (dense or
            sparse), or ``binary`` with ``image_shape`` (uint8 pixels scaled to [0, 1], or
            little-endian float32); an integer (or whole-number double) label column, or for a
            sequence model an ``array<long>`` column with one label per position. An RDD holds
            ``(ndarray, label)`` pairs (the label a 1-D array for a sequence model). It is split into
            ``dist.workers`` partitions (kept as they are when it already has that many; uneven and empty
            ones work). :class:`~sparknet.spark.data.DealtRows` (``sparknet.spark.run.dataset_frame`` with
            ``partitions``) are a data set in files on this machine, staged by the tasks that read them.
        validation : DataFrame, RDD, ArrayDataset, (x, y) or (x, y, w) arrays, optional
            Evaluated on the driver (rounds) or in shards on the workers (barrier) every
            ``dist.eval_every_rounds`` rounds, and at the end. A DataFrame that holds ``weight_col``, and
            ``(x, y, w)`` arrays, are scored with each row weighed by its sample weight (a row of weight w counts
            as w rows in the loss and the metrics, as Spark's evaluators count it); the summary's
            ``validation_weight`` is then the rows' total weight.
        features_col, label_col : str
            Column names of a DataFrame. ``features_col`` may be a list of columns (numbers, arrays,
            ML vectors), concatenated in that order into each row's features, or passed to the net
            as a dict (``features_as="dict"``). ``label_col=None`` (or
            ``task="unlabelled"``) trains without labels: the loss takes the input (an autoencoder), the
            DataFrame needs no label column, an RDD holds feature arrays, and the validation data is
            features alone. ``label_col`` may be a list of number columns, joined in order into one array a
            row, for a net that learns numbers or label sets (a regression or multi-label task).
        weight_col : str, optional
            A DataFrame column of sample weights (numbers >= 0): a row of weight w counts w times in its
            batch's loss — a plain module's, the weighted mean of its rows' losses; a layer-DSL net's, each loss
            layer's (:meth:`sparknet.layers.GraphModule.loss`). A validation DataFrame that has the column is
            scored with its weights.
        image_shape : sequence of int, optional
            Shape of one sample (e.g. ``[1, 28, 28]``); needed for binary features and for plain
            modules that take more than a flat vector. With ``features_as="dict"``, a dict of shapes by
            column (e.g. ``{"pixels": [1, 28, 28]}``) for the columns the net takes in another shape.
        initial_weights : WeightCollection or flat tensor, optional
            Weights to start from (before any warm-up) instead of the net's own initialisation.
        features_as : str
            ``"concat"`` (default): the feature columns are concatenated into one tensor per batch.
            ``"dict"``: a plain module's ``forward`` takes ``{column: tensor}`` (:class:`~sparknet.net.FeatureDict`):
            a number column as ``[n]``, an array or vector column as ``[n, d]`` (``d`` read from the
            first row; every row must hold as many), or in the shape ``image_shape`` gives it. The
            training data must be a DataFrame; validation data is a DataFrame with the same columns
            or ``({column: array}, labels)``. The returned weights carry the module's own names.
        """
        t_fit = time.perf_counter()
        phases: dict[str, float] = {}  # seconds from the fit's start to the end of each step before the rounds
        mark = lambda name: phases.__setitem__(name, round(time.perf_counter() - t_fit, 3))  # noqa: E731
        keep_freed_memory()  # the driver's per-round sums and evaluations (sparknet._malloc)
        spark = self.spark or get_session(None if self._workers_from_session else self.dist.resolved_master)
        connect = is_connect(spark)  # a Spark Connect session: DataFrame operations only, no SparkContext
        sc = spark if connect else spark.sparkContext
        if self._workers_from_session:  # no DistributedConfig given: one worker per default task slot (or per G)
            self.dist.workers = max(1, session_parallelism(spark) // self.dist.procs_per_worker)
        dist, m = self.dist.as_workers(), self.dist.model_parallel  # --model-parallel M alone: W/M workers of M
        K, ranks = dist.workers, dist.ranks  # workers, and the processes (partitions) they are made of
        rules = (dist.rounds, self.worker.steps, dist.epochs, dist.target_accuracy, dist.target_loss)
        if all(v is None for v in rules):
            raise ValueError("give a stopping rule: worker.steps, dist.rounds, dist.epochs, dist.target_accuracy or "
                             "dist.target_loss")
        for target in ("target_accuracy", "target_loss", "patience"):
            if getattr(dist, target) is not None and validation is None:
                raise ValueError(f"{target} needs validation data to measure it on")
        task = self._fit_task(label_col)
        if label_col is not None and not isinstance(label_col, str):
            label_col = list(label_col)
            if not label_col or len(set(label_col)) != len(label_col):
                raise ValueError(f"label_col names one or more distinct columns, got {label_col}")
            if not task.float_labels:
                raise ValueError("several label columns are the numbers or the 0s and 1s of a regression or a "
                                 "multi-label net, joined in order into one array a row; class ids are one column "
                                 f"(this fit's task is {task.value})")
        if task is Task.UNLABELLED:
            label_col = None
            if dist.target_accuracy is not None:
                raise ValueError("a net trained without labels is scored by its loss alone; target_accuracy cannot "
                                 "be set on it (give rounds, epochs or steps)")
            if dist.monitor != "loss":
                raise ValueError("a net trained without labels is scored by its loss alone; early stopping watches "
                                 "it (monitor='loss')")
        if connect and (refusal := connect_refusal(dist, train)) is not None:
            raise ValueError(f"cannot train from a Spark Connect session: {refusal}")
        if features_as not in spark_data.FEATURES_AS:
            raise ValueError(f"features_as must be one of {', '.join(spark_data.FEATURES_AS)}, got {features_as!r}")
        net = self.net
        dict_shapes = None
        if features_as == "dict":
            train = spark_data.as_frame(train)  # its columns read as a DataFrame's
            if not isinstance(self.net, torch.nn.Module) or _input_shape(self.net) is not None:
                raise ValueError("features_as='dict' passes the columns to a plain torch.nn.Module's forward as a "
                                 "dict; a NetParams net takes one input blob (use the default, concatenated)")
            if not spark_data.is_dataframe(train):
                raise ValueError("features_as='dict' reads the dict's entries from a DataFrame's columns; give the "
                                 "training data as a DataFrame")
            if image_shape is not None and not isinstance(image_shape, dict):
                raise ValueError("with features_as='dict', image_shape is a dict of shapes by column, e.g. "
                                 "{'pixels': [1, 28, 28]}")
            dict_shapes, image_shape = image_shape, None
        if dist.engine is Engine.BARRIER:
            check_barrier_slots(sc, ranks, "the barrier engine" if ranks == K else
                                f"the barrier engine ({K} workers of {dist.procs_per_worker} processes)")
        sample_shape = _input_shape(self.net)
        if image_shape is not None:
            image_shape = tuple(int(d) for d in image_shape)
            if any(d < 1 for d in image_shape):
                raise ValueError(f"image_shape must hold positive sizes, got {image_shape}")
            if sample_shape is not None and math.prod(image_shape) != math.prod(sample_shape):
                raise ValueError(f"image_shape {image_shape} holds {math.prod(image_shape)} values but the net's input "
                                 f"layer takes {sample_shape} ({math.prod(sample_shape)} values)")
            sample_shape = sample_shape or image_shape
        expected_len = math.prod(sample_shape) if sample_shape is not None else None
        worker = self.worker
        fit_id = uuid.uuid4().hex[:12]
        group = f"sparknet-{fit_id}"
        layout = None
        if features_as == "dict":  # the columns' sizes (one small job), then one array column the data path reads
            layout = self._data_job(sc, group, "sparknet: read the feature columns' sizes",
                                    lambda: spark_data.feature_layout(train, features_col, dict_shapes),
                                    "the feature columns' sizes")
            features_col = _unused_column(train, "sparknet_features")
            train = spark_data.dict_features(train, layout, features_col)
            if spark_data.is_dataframe(validation):
                validation = spark_data.dict_features(validation, layout, features_col)
            elif validation is not None:
                validation = spark_data.dict_arrays(validation, layout)
            net = FeatureDict(net, layout)
            sample_shape, expected_len = (net.width,), net.width
            log.info("features: the net takes a dict of the columns %s", dict(layout))
        def new_driver_net() -> Net:  # on this thread: a net's seeded build draws from torch's global generator
            return Net(_copy_module(net) if isinstance(net, torch.nn.Module) else net, worker.solver,
                       loss=self.loss, batch_size=worker.batch_size, device="cpu", seed=worker.seed, task=task,
                       weighted=weight_col is not None)

        driver_net = new_driver_net()
        if initial_weights is not None:
            if isinstance(initial_weights, WeightCollection):
                driver_net.set_weights(initial_weights)
            else:
                driver_net.set_flat(torch.as_tensor(initial_weights, dtype=torch.float32).reshape(-1))
        checkpoints, resume = self._open_checkpoints(driver_net)  # before any Spark job: a bad folder fails fast
        split = None
        if hasattr(self.net, "layers") and (m > 1 or dist.max_weight_bytes is not None):
            if m > 1 and sample_shape is None:
                raise ValueError(f"the net {self.net.name!r} declares no input shape; model parallelism needs a "
                                 "NetParams whose first input layer has a shape")
            plan, per_worker, whole = split_budget(self.net, self.dist)
            if m > 1:
                split = {"plan": plan, "whole_weight_bytes": whole, "max_weight_bytes": dist.max_weight_bytes}
                log.info("model parallelism: %d processes = %d copies x %d parts; plan %s; %s bytes of weights per "
                         "process (%s whole)", ranks, ranks // m, m, plan, f"{per_worker:,}", f"{whole:,}")

        from pyspark import StorageLevel

        columns = dict(features_col=features_col, label_col=label_col, image_shape=image_shape,
                       expected_len=expected_len, num_partitions=ranks, float_labels=task.float_labels,
                       weight_col=weight_col)
        level = getattr(StorageLevel, self.options.storage_level)
        frame_staged = dealt = None  # the stage job run where a DataFrame's rows are converted; a dealt data set's
        # the barrier stage reads such files only on one machine: on a cluster Spark may run a barrier task on
        # another host than the one that staged its partition (seen on the test rig), and the stage starts again
        if not connect and spark_data.is_frame(train) and (dist.engine is Engine.ROUNDS
                                                               or is_local_master(sc.master)):
            frame_staged, chunks, source, dealt = self._frame_staging(train, fit_id, level, columns)
        if frame_staged is None:
            chunk = spark_data.chunk_frame if connect else spark_data.chunk_rdd  # a DataFrame or an RDD of chunks
            chunks, source = chunk(spark_data.as_frame(train), **columns)
            if dist.engine is Engine.ROUNDS and not connect:  # a job a round: no partition may carry the rows
                chunks = spark_data.without_local_data(chunks, K)
            chunks.persist(level)
        if layout is not None:
            source = dataclasses.replace(source, description=f"DataFrame columns {', '.join(map(repr, dict(layout)))} "
                                                             "as a dict")
        mark("planned")
        staged = None
        broadcasts = []
        persisted = []  # the validation rows' chunks, where they stay in Spark (eval_sharded)
        ahead = pool = None
        stop_warmup = threading.Event()
        if dist.warmup_steps and resume is None and dealt is not None:
            # its sample is on this machine: the warm-up trains in a thread while Spark stages the rows
            pool = ThreadPoolExecutor(1, thread_name_prefix="sparknet-warmup")
            warm_net = new_driver_net()
            warm_net.set_flat(driver_net.get_flat())  # the fit's initial weights, where it was given some
            ahead = self._warmup_ahead(pool, dealt, warm_net, sample_shape, done=lambda: mark("warmed"),
                                       stop=stop_warmup)
        try:
            stats = None
            if dist.engine is Engine.ROUNDS or frame_staged is not None:  # the barrier stage reads staged files too
                staged = frame_staged if frame_staged is not None else chunks.mapPartitionsWithIndex(
                    stage_partition(fit_id, self.options.staging_dir), preservesPartitioning=True)
                staged.persist(StorageLevel.MEMORY_ONLY)
                stats = self._data_job(sc, group, "sparknet: convert, check and stage the training data",
                                       staged.collect, "the training data's conversion, check and staging")
                mark("staged")
            stats, total = spark_data.checked_partitions(sc, group, chunks, timeout_s=self.options.data_timeout_s,
                                                    stats=stats, expected_len=expected_len, num_classes=None,
                                                    num_workers=ranks, sample_shape=sample_shape, task=task,
                                                    float_labels=task.float_labels or weight_col is not None,
                                                    what=_data_named(layout))
            if sample_shape is None:
                shapes = [tuple(s) for s in total["shapes"]]
                width = int(total["width"])
                sample_shape = shapes[0] if len(shapes) == 1 and math.prod(shapes[0]) == width else (width,)
            outputs = self._probe(driver_net, sample_shape)  # every net: a shape that does not fit fails here
            num_classes = outputs if task is Task.CLASSIFICATION else None
            spark_data.check_stats(stats, what=_data_named(layout), expected_len=math.prod(sample_shape),
                              num_classes=num_classes, num_workers=ranks, sample_shape=sample_shape, task=task)
            self._rows = list(total["rows_per_partition"])
            if skew := spark_data.describe_skew(total["rows_per_partition"]):
                log.warning("%s", skew)
            row_bytes = 4 * math.prod(sample_shape) + 8 * (max(1, total["label_width"]) + (weight_col is not None))
            # in memory, each process of a split copy holds the rows of the copy's M partitions
            data_mode, data_mode_why = spark_data.choose_data_mode(
                dist.data_mode, (m if split else 1) * max(self._rows) * row_bytes, sc,
                held=f"the rows of a split copy's {m} partitions (what each of its processes would hold)" if split else
                "the largest partition's rows")
            log.info("training data: %s", data_mode_why)
            if (self.strategy.needs_gradient_hook or ranks > K) and 0 in total["rows_per_partition"]:
                who = ("a strategy that allreduces gradients every step" if self.strategy.needs_gradient_hook else
                       f"a worker of several processes (its {dist.procs_per_worker} processes step together)")
                raise ValueError(f"{who} needs data in every partition (rows per partition: {self._rows})")
            if dist.eval_sharded and validation is not None:
                val = self._validation_shards(sc, group, validation, persisted, level, sample_shape,
                                              num_classes, features_col, label_col, image_shape, task, weight_col)
            else:
                val = self._data_job(sc, group, "sparknet: collect the validation data",
                                     lambda: self._validation(validation, sample_shape, num_classes, features_col,
                                                              label_col, image_shape, task, weight_col),
                                     "the validation data's collection")
            mark("checked")  # and the validation rows collected, or counted where they stay
            if val is not None and not isinstance(val, ValidationShards):
                driver_net.set_validation_data(val)
            warmup = None
            if ahead is not None:
                warmed, warmup = ahead.result()
                driver_net.set_flat(warmed)
            elif dist.warmup_steps and resume is None:  # a resumed run had its warm-up before its checkpoint
                warmup = self._warmup(sc, group, chunks, staged, total, driver_net, sample_shape)
                mark("warmed")
            global_flat = resume.global_flat if resume is not None else self.strategy.init_global(driver_net.get_flat())
            worker_net = net
            if isinstance(net, torch.nn.Module):  # a CPU copy of a module; its shapes only where the ranks cut it
                worker_net = copy.deepcopy(net).to("meta" if dist.shard_replica else "cpu")
            spec = WorkerSpec(fit_id=fit_id, net=worker_net, loss=self.loss, worker=worker, task=task,
                              weighted=weight_col is not None, strategy=self.strategy, sample_shape=tuple(sample_shape),
                              outputs=outputs,
                              start_iteration=dist.warmup_steps, staging_dir=self.options.staging_dir,
                              stream=data_mode is spark_data.DataMode.STREAM,
                              stream_buffer_bytes=dist.stream_buffer_mb << 20,
                              faults=faults_from(self.options.fault), compression=dist.compression, link=self.link,
                              resume=None if resume is None else ResumeState(round=resume.round,
                                                                             workers=resume.workers))
            plan = FitPlan.from_config(dist, self.strategy, steps=worker.steps, dataset_rows=int(total["rows"]),
                                       resume=resume)
            run = EngineRun(sc=sc, group=group, source=staged if staged is not None else chunks, chunks=chunks,
                            spec=spec, global_flat=global_flat, plan=plan, validation=val, driver_net=driver_net,
                            broadcasts=broadcasts, t_fit=t_fit, dist=dist, options=self.options,
                            rows=tuple(self._rows), emit=self._emit, checkpoints=checkpoints, resume=resume,
                            split=None if split is None else split["plan"])
            t_train = time.perf_counter()
            mark("launch")
            run_engine = run_connect_stage if connect else _ENGINES[dist.engine]
            try:
                global_flat, history, extra = run_engine(run)
            except WorkerOutOfMemory as exc:  # the worker said what it held; the fit says how to hold less
                raise WorkerOutOfMemory(f"{exc._message}. {self._holding_less(4 * global_flat.numel(), exc)}",
                                        exc.rank, exc.log_tail) from None
            train_s = time.perf_counter() - t_train
        finally:
            if pool is not None:  # a fit that failed before it needed the warm-up ends it at its next step
                stop_warmup.set()
                pool.shutdown(wait=True)
            self._cleanup(sc, group, fit_id, staged, chunks, broadcasts, persisted)

        driver_net.set_flat(global_flat)
        rounds = [h for h in history if h.get("event") == "round"]
        test = returned_scores(rounds, dist.weight_ema is not None)
        if test is None and val is not None:  # no round scored the weights returned (a resumed fit with none left)
            test = extra.pop("final_scores", None)  # scored where the validation rows are
            if test is None:
                scored = driver_net.evaluate()
                test = scored.metrics, scored.loss
        summary = {
            "engine": dist.engine.value, "strategy": getattr(self.strategy.name, "value", str(self.strategy.name)),
            "workers": K, "procs_per_worker": dist.procs_per_worker, "tau": dist.tau,
            "round_seconds": dist.round_seconds,
            **rounds_summary(rounds, test, t_fit=t_fit, t_train=t_train, train_s=train_s),
            **returned_summary(rounds, dist.weight_ema),
            "data_rows": int(total["rows"]), "rows_per_partition": total["rows_per_partition"],
            "sample_shape": list(sample_shape), "num_classes": num_classes, "input": source.description,
            # the validation rows' total sample weight, where their scores weigh each row (none: each row once)
            "validation_weight": val.weight if isinstance(val, ValidationShards) else driver_net.validation_weight,
            "feature_columns": None if layout is None else {name: list(shape) for name, shape in layout},
            "data_mode": data_mode.value, "data_mode_reason": data_mode_why,
            "warmup": warmup, "fit_phases_s": phases, "retries": sum(h.get("retries", 0) for h in rounds),
            "nonfinite_workers": sum(h.get("nonfinite_workers", 0) for h in rounds),
            "resumed_from": None if resume is None else resume.round,
            "checkpoints": None if checkpoints is None else checkpoints.written,
            "compression": dist.compression, "overlap": dist.overlap, "fragments": dist.fragments,
            "link": None if self.link is None else self.link.to_dict(),
            "link_s": sum(h.get("link_s", 0.0) for h in rounds) if self.link is not None else None,
            "auto_tau": dist.auto_tau, "final_tau": rounds[-1].get("next_tau", rounds[-1]["tau"]) if rounds else None,
            **extra,
        }
        if dist.shard_replica:
            summary.update(shard_replica=True, **{f"{what}_per_rank": [w[what] for w in summary["barrier_workers"]]
                                                  for what in ("weight_bytes", "solver_state_bytes")})
        if split is not None:
            summary.update(data_parallel=ranks // m, model_parallel=m, **split,
                           weight_bytes_per_worker=[w["weight_bytes"] for w in summary["barrier_workers"]])
        return TrainResult(weights=driver_net.get_weights(), history=history, summary=summary, net=driver_net)

    # -- pieces of fit ------------------------------------------------------------------------
    def _holding_less(self, weight_bytes: int, report: WorkerOutOfMemory) -> str:
        """How each of this fit's processes can hold less, for a worker that ran out of memory (``report``)."""
        d, size = self.dist, f"{weight_bytes / 2**20:,.0f} MiB"
        if report.on_gpu:  # a sharded replica and model parallelism run on the CPU only
            return "Train with a smaller --batch-size or with --precision bf16, or on a GPU with more memory"
        if d.shard_replica:
            hold = (f"Each of a worker's {d.procs_per_worker} processes holds 1/{d.procs_per_worker} of the replica's "
                    f"{size} of weights and of its solver state: more processes a worker (--procs-per-worker) hold "
                    "less each")
        elif d.model_parallel > 1:
            hold = (f"Each process holds 1/{d.model_parallel} of the replica's layers: more parts (--model-parallel) "
                    "hold less each")
        else:
            hold = (f"Each process holds the whole replica, {size} of weights, beside its solver state and the round's "
                    f"copies of them: {'' if d.engine is Engine.BARRIER else '--engine barrier '}--procs-per-worker G "
                    "--shard-replica splits the weights and the solver state over a worker's G processes (FSDP2)")
        more = ("raise the cap (spark.executor.pyspark.memory)" if report.capped else
                "give each process more memory")
        return f"{hold}; or {more}, or train with a smaller --batch-size"

    def _open_checkpoints(self, driver_net: Net) -> tuple[RoundCheckpoints | None, ResumeState | None]:
        """The checkpoint folder (checked writable) and, with ``dist.resume``, the state to resume from (its weights
        loaded into ``driver_net``)."""
        dist = self.dist
        # the configurations' enums are str enums: the manifest's JSON holds their values
        config = {"dist": asdict(dist), "worker": asdict(self.worker), "strategy": repr(self.strategy)}
        checkpoints, ckpt = open_checkpoints(dist, config, driver_net)
        if ckpt is None:
            return checkpoints, None
        state = ckpt.state
        written = ckpt.manifest.get("config", {}).get("dist", {})
        shape = {"workers": written.get("workers"), "procs_per_worker": written.get("procs_per_worker", 1),
                 "shard_replica": written.get("shard_replica", False),
                 "model_parallel": written.get("model_parallel", 1)}
        if shape != {name: getattr(dist, name) for name in shape}:
            flags = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in shape.items()
                             if v is not False and not (k in ("procs_per_worker", "model_parallel") and v == 1))
            how = (", sharded" if shape["shard_replica"] else "") + (
                f", split in {shape['model_parallel']} parts" if shape["model_parallel"] > 1 else "")
            raise CheckpointError(f"checkpoint {ckpt.path} was written by a run of {shape['workers']} workers of "
                                  f"{shape['procs_per_worker']} processes{how}"
                                  f"; resume with {flags} (each process's solver state belongs to its partition "
                                  "and its part of the weights)")
        self.strategy.load_state_dict(state.get("strategy") or {})
        set_rng_state(state["rng"])
        log.info("resuming from %s: round %d, %d steps per worker done", ckpt.path, ckpt.round, state["steps_done"])
        driver_net.set_weights(ckpt.weights)
        return checkpoints, dataclasses.replace(ResumeState.from_checkpoint(ckpt.round, state),
                                                global_flat=driver_net.get_flat())

    def _fit_task(self, label_col: str | None) -> Task:
        """This fit's task: ``label_col=None`` trains without labels (the loss takes the input)."""
        if label_col is not None or self.task is Task.UNLABELLED:
            return self.task
        if self._task_given:
            raise ValueError(f"label_col=None trains without labels, but the trainer's task is {self.task.value!r}; "
                             "give a label column, or task='unlabelled'")
        return Task.UNLABELLED

    @staticmethod
    def _probe(driver_net: Net, sample_shape) -> int | None:
        """Run the net on two zero samples: a clear error if the shape does not fit; the class count."""
        try:
            out = driver_net.predict(np.zeros((2, *sample_shape), np.float32))
        except Exception as exc:
            raise ValueError(f"the net cannot take features of shape {tuple(sample_shape)}: {exc}; "
                             "pass image_shape= or fix the feature column") from exc
        if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[0] == 2:
            return int(out.shape[1])
        if isinstance(out, torch.Tensor) and out.dim() == 3 and out.shape[0] == 2 and out.shape[1] == sample_shape[0]:
            return int(out.shape[2])  # a sequence model: [N, T, vocabulary], a label per position
        return None

    def _data_job(self, sc, group: str, description: str, action, what: str):
        """One Spark action on the fit's data, waited for at most ``options.data_timeout_s``."""
        return run_with_deadline(sc, group, description, action, timeout_s=self.options.data_timeout_s, what=what)

    def _validation(self, validation, sample_shape, num_classes, features_col, label_col, image_shape, task,
                    weight_col):
        """The validation rows as ``(x, y)`` arrays, or ``(x, y, w)`` where they come with sample weights: a
        DataFrame's ``weight_col``, or a third array."""
        if validation is None:
            return None
        if spark_data.is_dataframe(validation) or spark_data.is_rdd(validation):
            val = spark_data.collect_arrays(validation, features_col=features_col, label_col=label_col,
                                            image_shape=image_shape, expected_len=math.prod(sample_shape),
                                            num_classes=num_classes, sample_shape=sample_shape, task=task,
                                            weight_col=weight_col)
        else:
            val = spark_data.local_arrays(validation, sample_shape=sample_shape, task=task)
        y = val[1]
        if num_classes is not None and len(y) and (y.min() < 0 or y.max() >= num_classes):
            raise ValueError(f"validation data: labels range over [{y.min()}, {y.max()}] but the net has "
                             f"{num_classes} classes")
        return val

    def _validation_shards(self, sc, group, validation, persisted: list, level, sample_shape, num_classes,
                           features_col, label_col, image_shape, task, weight_col) -> ValidationShards:
        """The validation rows kept in Spark (``eval_sharded``) in a partition a task slot of the session (at least
        one a worker: an evaluation runs between rounds, when every slot is free), persisted (and put in
        ``persisted`` for the fit's cleanup). A DataFrame or an RDD is converted into chunks as the training rows are,
        then counted and checked in one job: the driver holds none of its rows. Local arrays, checked here, are cut
        into as many contiguous slices (their rows in order, so a screen scores the rows the driver's net would) and
        handed to Spark once, through one shuffle, as :func:`~sparknet.spark.data.without_local_data` hands the
        training rows: not in every evaluation's tasks."""
        parts = max(self.dist.workers, session_parallelism(sc))
        if spark_data.is_dataframe(validation) or spark_data.is_rdd(validation):
            weight_col = spark_data.weight_column(validation, weight_col, "validation data")
            chunks, _ = spark_data.chunk_rdd(validation, features_col=features_col, label_col=label_col,
                                             image_shape=image_shape, expected_len=math.prod(sample_shape),
                                             num_partitions=parts, weight_col=weight_col,
                                             float_labels=task.float_labels or weight_col is not None)
            chunks = spark_data.without_local_data(chunks, parts)
            persisted.append(chunks.persist(level))
            stats = self._data_job(sc, group, "sparknet: convert, check and count the validation data where it stays",
                                   chunks.mapPartitionsWithIndex(shard_stats(weight_col is not None)).collect,
                                   "the validation data's conversion and check")
            _, total = spark_data.checked_partitions(sc, group, chunks, timeout_s=None, stats=stats,
                                                     expected_len=math.prod(sample_shape), num_classes=num_classes,
                                                     num_workers=None, sample_shape=sample_shape, task=task,
                                                     what="validation data")
            rows, label_width = tuple(total["rows_per_partition"]), int(total["label_width"])
            weight = math.fsum(s["weight"] for s in stats) if weight_col is not None else None
        else:
            arrays = self._validation(validation, sample_shape, num_classes, features_col, label_col, image_shape,
                                      task, weight_col)
            x, y = arrays[0], arrays[1]
            w = arrays[2] if len(arrays) == 3 else None
            labels = y if w is None else labels_with_weights(y, w)[0]
            bounds = np.linspace(0, len(x), parts + 1).astype(int)
            chunks = spark_data.folded(sc.parallelize([(x[a:b], labels[a:b], None)
                                                       for a, b in zip(bounds[:-1], bounds[1:])], parts), parts)
            persisted.append(chunks.persist(level))
            rows, label_width = tuple(int(n) for n in np.diff(bounds)), y.shape[1] if y.ndim == 2 else 0
            weight = None if w is None else math.fsum(np.asarray(w, dtype=np.float64))
        if weight is not None and not weight > 0:
            raise ValueError(f"validation data: all {sum(rows)} rows have a sample weight of 0, so no score "
                             "could be measured on them")
        log.info("validation data: %d rows in %d partitions stay in Spark; each evaluation scores them there",
                 sum(rows), len(rows))
        return ValidationShards(chunks=chunks, rows=rows, label_width=label_width, weight=weight)

    def _warmup(self, sc, group, chunks, staged, total, driver_net: Net, sample_shape) -> dict:
        """``warmup_steps`` on the driver, on a bounded sample of the training data: each partition's first rows,
        read where the stage job wrote them (``staged``), else taken from its chunks (the rows converted again where
        they are not cached, as a DataFrame staged where it was converted is not)."""
        quotas = self._warmup_quotas(total["rows_per_partition"], sample_shape)
        parts = None
        if staged is not None:
            parts = self._data_job(sc, group, "sparknet: read the warm-up sample where the training data is staged",
                                   staged.mapPartitionsWithIndex(staged_head(quotas)).collect,
                                   "the warm-up sample's collection")
            if any(part is None for part in parts):  # staged on another machine than its task ran on
                parts = None
        if parts is None:
            parts = self._data_job(sc, group, "sparknet: sample the training data for the warm-up",
                                   chunks.mapPartitionsWithIndex(spark_data.head_rows(quotas)).collect,
                                   "the warm-up sample's collection")
        return self._warm_up(driver_net, parts, sample_shape)

    def _warmup_ahead(self, pool, dealt, net: Net, sample_shape, done: Callable[[], None], stop: threading.Event):
        """The warm-up of :class:`~sparknet.spark.data.DealtRows` (a data set dealt from files on this machine), in
        ``pool``'s thread while Spark stages its rows: the same sample :meth:`_warmup` would read (each partition's
        first rows, read here), trained on ``net`` (built like the fit's driver net); ``done`` called at its end, and
        it ends after the step during which ``stop`` is set (a fit that failed). A future of its weights and what it
        did."""
        rows = [len(range(k, dealt.rows, dealt.partitions)) for k in range(dealt.partitions)]
        sample_shape = sample_shape or dealt.head(0, 0)[0].shape[1:]  # a net that declares none takes a row as it is
        quotas = self._warmup_quotas(rows, sample_shape)

        def run():
            info = self._warm_up(net, [dealt.head(k, q) for k, q in enumerate(quotas) if q and rows[k]],
                                 sample_shape, stop)
            done()
            return net.get_flat(), {**info, "while_staging": True}

        return pool.submit(run)

    def _warmup_quotas(self, rows: list[int], sample_shape) -> list[int]:
        """How many of its first rows each partition gives the warm-up's sample (``rows``: each one's rows)."""
        n = sum(rows)
        limit = min(n, self.options.warmup_max_samples,
                    max(1, self.options.warmup_max_bytes // (4 * math.prod(sample_shape))))
        return [math.ceil(limit * r / n) for r in rows]

    def _warm_up(self, net: Net, parts: list, sample_shape, stop: threading.Event | None = None) -> dict:
        """``warmup_steps`` of ``net`` on the sample ``parts`` (an ``(x, y)`` a partition, in order); what it did.
        ``stop`` set, it ends after the step it is in (``_WarmupStopped``); a line-search solver, which takes no hook
        between its steps' backward and update, ends only with its last step."""
        x, y = (np.concatenate(column) for column in zip(*parts))
        net.set_training_data((x.reshape(len(x), *sample_shape), y))

        def stopped(_net) -> None:
            if stop.is_set():
                raise _WarmupStopped

        hook = None if stop is None or net.solver.type.needs_closure else stopped
        stats = net.train(self.dist.warmup_steps, after_backward=hook)
        if not stats.finite:
            raise EngineError("the warm-up on the driver produced NaN/Inf loss; lower the learning rate")
        log.info("warm-up: %d steps on %d rows in %.1f s, loss %.4f", stats.steps, len(x), stats.wall_s, stats.loss)
        return {"steps": stats.steps, "rows": len(x), "loss": stats.loss, "wall_s": stats.wall_s}

    def _emit(self, record: dict, latest: torch.Tensor | None = None) -> None:
        """A round record to ``on_round``; ``latest``: the global weights after it (the rounds engine's)."""
        if latest is not None:
            self.latest_flat = latest
        if self.on_round is not None:
            self.on_round(record)

    def _frame_staging(self, train, fit_id: str, level, columns: dict):
        """``(staged, chunks, source, dealt)`` for a fit over a DataFrame or :class:`~sparknet.spark.data.DealtRows`:
        ``staged``, the RDD of the stage job, whose tasks make the rows into chunks and write them where they are
        (:func:`stage_frame`), and ``chunks``, an RDD of the chunks made only if a rerun needs it (the staged files
        gone). ``staged`` is ``None`` where the rows would travel in every round's tasks (a DataFrame of the driver's
        rows already in as many partitions): those are staged from :func:`~sparknet.spark.data.chunk_rdd`'s RDD,
        behind a shuffle. ``dealt``: the ``DealtRows`` whose stage job reads, converts and stages each hand in one
        task, with no DataFrame made (else ``None``)."""
        float_labels = columns["float_labels"] or columns["weight_col"] is not None  # a weight rides with the labels
        named = (columns["features_col"], columns["label_col"]) == ("features", "label")
        in_place = isinstance(train, spark_data.DealtRows) and train.partitions == columns["num_partitions"]
        # dealt rows are in their partitions already: no asking the JVM how many (a query planned, about 0.5 s)
        as_dealt = {**columns, "num_partitions": None} if in_place else columns
        dealt = train if in_place and named and columns["weight_col"] is None else None  # hands hold no weights
        if dealt is not None:  # read, converted, staged in one task, no DataFrame made: its features are arrays
            sc = dealt.spark.sparkContext
            convert, source = spark_data.arrow_chunks("array", sc, **{k: v for k, v in columns.items()
                                                                     if k != "num_partitions"})
            staged = sc.parallelize([], dealt.partitions).mapPartitionsWithIndex(
                stage_hands(fit_id, self.options.staging_dir, convert, dealt.hand), preservesPartitioning=True)

            def frame():  # the same rows through a DataFrame, for a rerun
                return spark_data.chunk_input(dealt.frame, **as_dealt)[0]
        else:
            df, convert, source = spark_data.chunk_input(spark_data.as_frame(train), **as_dealt)
            staged = df.mapInArrow(stage_frame(fit_id, self.options.staging_dir, convert),
                                   "info string").rdd.map(lambda row: json.loads(row[0]), preservesPartitioning=True)
            frame = lambda: df  # noqa: E731
        spark_data.check_partitions(staged, columns["num_partitions"])
        if spark_data.ships_local_data(staged):
            return None, None, source, None
        chunks = spark_data.LazyRDD(lambda: spark_data.chunks_of(frame(), convert, float_labels).persist(level))
        return staged, chunks, source, dealt

    # -- cleanup ------------------------------------------------------------------------------
    @staticmethod
    def _cleanup(sc, group, fit_id, staged, chunks, broadcasts, persisted=()) -> None:
        if staged is not None:
            try:
                run_with_deadline(sc, group, "sparknet: remove staged data",
                                  staged.mapPartitionsWithIndex(cleanup_partition(fit_id)).collect,
                                  timeout_s=CLEANUP_TIMEOUT_S, what="the staged data's removal")
            except Exception as exc:  # cleanup must not hide the real outcome
                log.warning("could not remove the staged training data of fit %s: %s", fit_id, exc)
            quietly(staged.unpersist)
        quietly(chunks.unpersist)
        for rdd in persisted:
            quietly(rdd.unpersist)
        for bc in broadcasts:
            quietly(bc.destroy)


_ENGINES = {Engine.ROUNDS: run_rounds_engine, Engine.BARRIER: run_barrier_engine}
"""Each engine's driver side: ``run(EngineRun) -> (global_flat, history, summary fields)``."""
