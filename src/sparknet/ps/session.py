"""Driver side of asynchronous training: :class:`AsyncSession` (TensorOnSpark's session) and :func:`run_async`.

>>> sess = AsyncSession(zoo.lenet(), SolverConfig(base_lr=0.01), combiner="delta")      # doctest: +SKIP
>>> sess.run(data=train_df, batch_size=64, tau=10, epochs=5,
...          validation_data=mnist().test)                                             # doctest: +SKIP
>>> sess.metrics["test_accuracy"], sess.metrics["staleness_mean"]                      # doctest: +SKIP
>>> sess.weights                                                                       # doctest: +SKIP

``run`` starts a :class:`~sparknet.ps.server.ParameterServer` on the driver (loopback in local mode), then runs one
Spark job per epoch (:func:`sparknet.ps._worker.train_partition` in each task), each under a fresh job id and HMAC
secret that reach the tasks inside the job's closure with the server's transport keys. Between epochs the rows are
reshuffled across partitions (seeded). Every Spark job runs through :func:`sparknet.spark.backend.run_with_deadline`.

A task that Spark retries pulls the current weights and trains again; its pushes for steps the failed attempt already
had applied are acknowledged without being applied twice (the server keeps, per partition, the highest step it
applied).

Nothing here imports pyspark until a session runs.
"""

from __future__ import annotations

import copy
import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence

import numpy as np
import torch

from sparknet._app import (build_model, finish_run, load_training_data, run_sinks, seed_everything, training_rows,
                           scored_rows)
from sparknet.checkpoint import CheckpointError, open_checkpoints
from sparknet.config import Compute, Profile, TrainConfig, check_at_least
from sparknet.errors import EngineError
from sparknet.faults import faults_from
from sparknet.loop import EarlyStop
from sparknet.metrics import MetricsLogger
from sparknet.net import Net
from sparknet.parallel.runner import split_budget
from sparknet.ps import _worker
from sparknet.ps.combiners import Combiner, make_combiner
from sparknet.ps.config import AsyncConfig
from sparknet.ps.server import ParameterServer
from sparknet.roads import Road, check_road
from sparknet.solvers import SolverConfig
from sparknet.spark import data as spark_data
from sparknet.spark.backend import default_round_deadline, run_with_deadline
from sparknet.spark.session import get_session, is_connect, is_local_master
from sparknet.weights import WeightCollection

__all__ = ["AsyncSession", "run_async"]

log = logging.getLogger(__name__)


class AsyncSession:
    """One model trained asynchronously on Spark through a parameter server on the driver.

    TensorOnSpark's ``SparkSession``, renamed so as not to clash with pyspark's.

    Parameters
    ----------
    net : Net, NetParams or torch.nn.Module
        The model. A :class:`~sparknet.net.Net` is used as it is (its solver, batch size and weights; it holds the
        final weights afterwards). A plain module must pickle.
    solver : SolverConfig, optional
        Every worker's local update rule (ignored for a ``Net``, which has its own).
    combiner : str or Combiner
        How pushes merge into the server's copy: ``"mean"``, ``"delta"``, ``"staleness"``, ``"elastic"`` or a
        :class:`~sparknet.ps.Combiner` instance.
    loss : callable, optional
        ``loss(prediction, y)`` for a plain module.
    seed : int
        Seeds the initial weights, each task's data order and the between-epoch shuffle.
    host : str, optional
        Address the server binds to and the tasks connect to (default: ``127.0.0.1`` with a local master, else
        ``spark.driver.host``). Never every interface by default.
    port : int
        Server port (0: the OS picks one).
    threads : int
        Torch threads per task.
    device : str
        Device of each task's net.
    compute : Compute, optional
        Each task's mixed precision, compilation and memory order (default: float32, eager, the default order).
    request_timeout_s : float
        Longest wait of a task for one reply of the server.
    epoch_timeout_s : float, optional
        Longest wait for one epoch's Spark job; it is cancelled after that. Default: 30 minutes for the first
        epoch, then 20 times the slowest seconds per step of the last epoch's tasks times their steps, at least
        10 minutes (each epoch record's ``deadline_s``).
    stall_timeout_s : float, optional
        Cancel an epoch's job when the server hears from no worker for this long (a hung task; the first pull of
        a task comes after its Python worker starts, and every push after ``tau`` steps: raise it for slow steps).
    data_timeout_s : float
        Longest wait for the Spark job that converts and checks the training data, and for the one that collects
        Spark validation data to the driver.
    spark : SparkSession, optional
        Needed only when ``run`` is given local arrays rather than an RDD or DataFrame.
    validation_data : ArrayDataset or (x, y), optional
        Evaluated on the driver after every epoch (``run`` takes it too).
    fault : str, optional
        Injected faults for reliability tests (:mod:`sparknet.faults`, e.g. ``rank=1,round=2,kind=kill``): worker
        ``rank`` fails before its ``round``-th push of an epoch, on that attempt only.
    profile : Profile, optional
        Trace every worker's epoch ``profile.round`` (counted from 0 over the session's epochs) with torch's
        profiler, its steps, pulls and pushes: ``ps-worker-<i>-epoch<E>.json`` and ``.txt`` in ``profile.folder``
        (:class:`~sparknet.config.Profile`, ``--profile-dir``).
    """

    def __init__(self, net, solver: SolverConfig | None = None, *, combiner: str | Combiner = "delta", loss=None,
                 seed: int = 0, host: str | None = None, port: int = 0, threads: int = 1, device: str = "cpu",
                 request_timeout_s: float = 120.0, epoch_timeout_s: float | None = None,
                 stall_timeout_s: float | None = 600.0, data_timeout_s: float = 3600.0, spark=None,
                 validation_data=None, fault: str | None = None, compute: Compute | None = None,
                 profile: Profile | None = None):
        self.net = net if isinstance(net, Net) else Net(net, solver, loss=loss, seed=seed)
        self.combiner = make_combiner(combiner)
        self.loss = loss
        self.seed = int(seed)
        self.host = host
        self.port = int(port)
        self.threads = int(threads)
        check_at_least(1, threads=self.threads)
        self.device = device
        self.compute = compute or Compute()
        self.profile = profile
        for name, value in (("request_timeout_s", request_timeout_s), ("epoch_timeout_s", epoch_timeout_s),
                            ("stall_timeout_s", stall_timeout_s), ("data_timeout_s", data_timeout_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.request_timeout_s, self.data_timeout_s = float(request_timeout_s), float(data_timeout_s)
        self.epoch_timeout_s, self.stall_timeout_s = epoch_timeout_s, stall_timeout_s
        self.spark = spark
        self.faults = faults_from(fault)  # a bad spec fails here, not on the executors
        self.metrics: dict = {"epochs": [], "test_accuracy_by_epoch": []}
        self._iteration = self.net.iteration
        self._epochs_done = 0
        self._last: WeightCollection | None = None  # the server's last copy, where the net holds the best weights
        self._validation = validation_data is not None
        if self._validation:
            self.net.set_validation_data(validation_data)

    @property
    def weights(self) -> WeightCollection:
        """The trained weights (the server's final copy, or the best scored where :meth:`run` stopped early), a
        copy."""
        return self.net.get_weights()

    @property
    def last_weights(self) -> WeightCollection:
        """The server's last copy of the weights (what a checkpoint holds, to go on training from), a copy."""
        return self.net.get_weights() if self._last is None else self._last

    @property
    def epochs_done(self) -> int:
        """Epochs trained so far, over every :meth:`run` (the next one's number)."""
        return self._epochs_done

    @property
    def iteration(self) -> int:
        """Local steps a worker has taken so far, over every :meth:`run` (where its rate schedule stands)."""
        return self._iteration

    def continue_from(self, epochs_done: int, iteration: int) -> None:
        """Go on as after ``epochs_done`` epochs and ``iteration`` local steps a worker: a run resumed from a
        checkpoint, whose weights are already the net's."""
        check_at_least(0, epochs_done=epochs_done, iteration=iteration)
        self._epochs_done, self._iteration = int(epochs_done), int(iteration)

    # -- what the tasks get ---------------------------------------------------------------------
    def _server_host(self, sc) -> str:
        if self.host:
            return self.host
        if is_local_master(sc.master):
            return "127.0.0.1"
        host = sc.getConf().get("spark.driver.host")
        if not host:
            raise ValueError("cannot tell the driver's address (spark.driver.host is unset); pass host=")
        return host

    def _stall_check(self, server: ParameterServer) -> Callable[[], str | None] | None:
        """Why an epoch counts as hung: the server has heard from no worker for ``stall_timeout_s``."""
        stall_s = self.stall_timeout_s
        if stall_s is None:
            return None
        return lambda: (f"stalled: the parameter server heard from no worker for {stall_s:g} s"
                        if time.monotonic() - server.last_heard > stall_s else None)

    # -- data -----------------------------------------------------------------------------------
    def _blocks(self, data, sc, group, num_workers, feed_names, image_shape, sample_shape, weight_col=None):
        """(RDD of (x, y) blocks with ``num_workers`` partitions, the RDD to unpersist, rows per partition); a
        DataFrame's ``weight_col`` rides last in each row's labels."""
        from pyspark import StorageLevel  # optional dependency: needed only once data is dealt

        expected_len = math.prod(sample_shape) if sample_shape else None
        if spark_data.is_dataframe(data) or spark_data.is_rdd(data):
            features_col, label_col = feed_names
            chunks, _ = spark_data.chunk_rdd(data, features_col=features_col, label_col=label_col,
                                             image_shape=image_shape, expected_len=expected_len,
                                             num_partitions=num_workers, float_labels=self.net.task.float_labels,
                                             weight_col=weight_col)
            chunks.persist(StorageLevel.MEMORY_AND_DISK)
            try:
                _, total = spark_data.checked_partitions(sc, group, chunks, timeout_s=self.data_timeout_s,
                                                         expected_len=expected_len, num_classes=None,
                                                         num_workers=num_workers, sample_shape=sample_shape,
                                                         task=self.net.task)
            except BaseException:
                chunks.unpersist()
                raise
            skew = spark_data.describe_skew(total["rows_per_partition"])
            if skew:
                log.warning("%s", skew)
            return chunks.mapPartitions(_worker.blocks_from_chunks, preservesPartitioning=True), chunks, \
                total["rows_per_partition"]
        # Local arrays: an ArrayDataset or (x, y), cut into one block per worker.
        if hasattr(data, "x") and hasattr(data, "y"):
            x, y = np.asarray(data.x), np.asarray(data.y)
        elif isinstance(data, tuple) and len(data) == 2:
            x, y = np.asarray(data[0]), np.asarray(data[1])
        else:
            raise TypeError(f"data must be a Spark DataFrame, an RDD of (ndarray, label), an ArrayDataset or "
                            f"(x, y) arrays; got {type(data).__name__}")
        if len(x) != len(y) or len(y) < num_workers:
            raise ValueError(f"data has {len(x)} feature rows and {len(y)} labels for {num_workers} workers")
        x = x.astype(np.float32, copy=False).reshape(len(x), -1)
        if expected_len is not None and x.shape[1] != expected_len:
            raise ValueError(f"each sample has {x.shape[1]} values but the net takes {sample_shape}")
        parts = np.array_split(np.arange(len(y)), num_workers)
        blocks = sc.parallelize([(x[p], y[p]) for p in parts], num_workers)
        blocks.persist(StorageLevel.MEMORY_AND_DISK)
        return blocks, blocks, [len(p) for p in parts]

    # -- training -------------------------------------------------------------------------------
    def run(self, train_step: Callable | None = None, data=None, *, batch_size: int = 64, tau: int = 10,
            epochs: int = 1, shuffle_within_partition: bool = True, repartition_between_epochs: bool = True,
            feed_names: tuple[str, str | Sequence[str]] | None = None, num_workers: int | None = None,
            steps: int | None = None, image_shape=None, validation_data=None, target_accuracy: float | None = None,
            on_epoch: Callable[[dict], None] | None = None, early_stop=None, weight_col: str | None = None) -> dict:
        """Train asynchronously on ``data`` for ``epochs`` passes; returns :attr:`metrics`.

        Parameters
        ----------
        train_step : callable, optional
            ``train_step(net, (x, y))`` run on each worker for every minibatch (tensors of ``batch_size`` rows);
            it may return a loss. Default: ``net.train(1)`` on the partition's data.
        data : DataFrame, RDD, ArrayDataset or (x, y)
            A DataFrame with a feature and a label column (``feed_names``), an RDD of ``(ndarray, label)``, or
            local arrays (split into ``num_workers`` parts).
        batch_size : int
            Minibatch size of each worker.
        tau : int
            Local steps between pushes (a push gets the server's copy back).
        epochs : int
            Passes over the data; each is one Spark job in which every task makes one pass over its partition.
        shuffle_within_partition : bool
            Each task visits its rows in a random order.
        repartition_between_epochs : bool
            Move every row to a random partition (seeded) before the next epoch.
        feed_names : (str, str or list of str), optional
            The feature and label columns of a DataFrame (default ``("features", "label")``; several label columns
            of numbers, for a regression or multi-label net, are joined in order into one array a row), or the
            fields of an RDD of Rows or dicts (default: the RDD holds ``(x, y)`` pairs).
        num_workers : int, optional
            Partitions, one task each (default: the data's partition count; 2 for local arrays).
        steps : int, optional
            Most local steps per worker over the whole run (the last epoch stops early).
        image_shape : sequence of int, optional
            Shape of one sample for a plain module (a NetParams net knows its own).
        validation_data : ArrayDataset, (x, y), (x, y, w), DataFrame or RDD, optional
            Evaluated on the driver after every epoch; each row weighed by its sample weight where the arrays have
            a third (``w``) or the DataFrame has ``weight_col``.
        target_accuracy : float, optional
            Stop after the first epoch reaching this validation score (accuracy; R-squared for a regression net).
        on_epoch : callable, optional
            Called on the driver with each epoch's record.
        early_stop : EarlyStop, optional
            Early stopping (:class:`sparknet.loop.EarlyStop`, ``--patience``): every epoch's validation result is
            judged, the run stops once ``patience`` epochs in a row have not bettered the best, and the net ends
            with the best weights scored (:attr:`last_weights` keeps the server's last copy); :attr:`metrics` then
            says ``best_epoch`` and its test scores.
        weight_col : str, optional
            A DataFrame column of sample weights (numbers >= 0): a row of weight w counts w times in its batch's
            loss. Local arrays carry their weights as their labels' last value, with a net made ``weighted``.
        """
        if data is None:
            raise ValueError("run() needs data: a DataFrame, an RDD of (ndarray, label), or local arrays")
        if weight_col is not None and not spark_data.is_dataframe(data):
            raise ValueError("weight_col names a DataFrame column; local arrays carry each row's weight as their "
                             "labels' last value, trained by a Net made with weighted=True")
        check_at_least(1, batch_size=batch_size, tau=tau, epochs=epochs, steps=steps)
        if target_accuracy is not None and not 0 < target_accuracy <= 1:
            raise ValueError(f"target_accuracy is a fraction in (0, 1], got {target_accuracy}")
        if train_step is not None and not callable(train_step):
            raise TypeError("train_step must be callable as train_step(net, (x, y))")
        if feed_names is not None:
            feed_names = tuple(feed_names)
            if len(feed_names) != 2:
                raise ValueError(f"feed_names names the feature and the label field, got {feed_names}")
            if spark_data.is_rdd(data):
                data = data.map(_worker.pick_fields(feed_names))
        feed_names = feed_names or ("features", "label")

        is_spark_data = spark_data.is_dataframe(data) or spark_data.is_rdd(data)
        session = data.sparkSession if spark_data.is_dataframe(data) else self.spark
        if session is not None and is_connect(session):
            raise ValueError("the asynchronous parameter server cannot run from a Spark Connect session: its workers "
                             "are RDD tasks that reach a server on the driver, and a Connect client has no RDDs and "
                             "cannot be reached from the executors; train with SparkTrainer (engine='barrier'), which "
                             "runs from Connect, or from a classic session")
        if is_spark_data:
            sc = data.sparkSession.sparkContext if spark_data.is_dataframe(data) else data.context
        else:
            sc = (self.spark or get_session()).sparkContext
        K = int(num_workers or (data.rdd.getNumPartitions() if spark_data.is_dataframe(data) else
                                data.getNumPartitions() if is_spark_data else 2))
        if K < 1:
            raise ValueError(f"num_workers must be at least 1, got {K}")
        net_params = self.net.net_params or getattr(self.net.module, "net_params", None)
        sample_shape = (getattr(net_params, "sample_shape", None)
                        or (tuple(int(d) for d in image_shape) if image_shape else None))
        run_id = uuid.uuid4().hex[:12]
        group = f"sparknet-async-{run_id}"
        if validation_data is not None:
            if spark_data.is_dataframe(validation_data) or spark_data.is_rdd(validation_data):
                spark_validation = validation_data
                validation_data = run_with_deadline(
                    sc, group, "sparknet: collect the validation data",
                    lambda: spark_data.collect_arrays(
                        spark_validation, features_col=feed_names[0], label_col=feed_names[1],
                        image_shape=image_shape, expected_len=math.prod(sample_shape) if sample_shape else None,
                        num_classes=None, sample_shape=sample_shape, task=self.net.task,
                        weight_col=weight_col),
                    timeout_s=self.data_timeout_s, what="collecting the validation data")
            self.net.set_validation_data(validation_data)
            self._validation = True
        evaluate = self._validation

        t_run = time.perf_counter()
        self._last = None
        for key in ("stop_reason", "returned_weights", "best_epoch"):  # an earlier run's early stop
            self.metrics.pop(key, None)
        server = ParameterServer(self.net.get_flat().numpy(), self.combiner, host=self._server_host(sc),
                                 port=self.port, num_workers=K)
        # a NetParams net travels as data; a plain module in the job's closure (Spark's cloudpickle), on the CPU
        net_spec = ({"netparams": net_params.to_dict()} if hasattr(net_params, "to_dict")
                    else {"module": copy.deepcopy(self.net.module).cpu()})
        # last: it caches
        rdd, cached, rows = self._blocks(data, sc, group, K, feed_names, image_shape, sample_shape, weight_col)
        solver = self.net.solver.to_dict()
        steps_done = 0
        history: list[dict] = []
        tasks: list[dict] = []
        log.info("asynchronous training: %d workers, %d rows (%s per partition), %r, sync every %d steps, "
                 "%d epochs", K, sum(rows), rows, self.combiner, tau, epochs)
        try:
            server.start()
            for e in range(epochs):
                if steps is not None and steps_done >= steps:
                    break
                epoch = self._epochs_done
                creds = server.new_job()
                spec = _worker.TaskSpec(
                    endpoint=server.endpoint, job_id=creds.job_id, secret=creds.secret, keys=server.client_keys,
                    net=net_spec, solver=solver, batch_size=int(batch_size), tau=int(tau), seed=self.seed, epoch=epoch,
                    iteration=self._iteration, shuffle=bool(shuffle_within_partition), sample_shape=sample_shape,
                    timeout_s=self.request_timeout_s, threads=self.threads, device=self.device, compute=self.compute,
                    steps=None if steps is None else steps - steps_done, train_step=train_step,
                    loss=self.loss, faults=self.faults, weighted=self.net.weighted or weight_col is not None,
                    profile=self.profile)
                before = server.stats()
                t0 = time.perf_counter()
                deadline = self._epoch_deadline(tasks[-K:] if tasks else None,
                                                None if steps is None else steps - steps_done)
                records = run_with_deadline(sc, group, f"sparknet: asynchronous epoch {epoch}",
                                            rdd.mapPartitionsWithIndex(_worker.train_partition(spec)).collect,
                                            timeout_s=deadline, what=f"asynchronous epoch {epoch}",
                                            stalled=self._stall_check(server))
                wall = time.perf_counter() - t0
                server.check_alive()
                self.net.set_flat(torch.from_numpy(server.weights()))
                stats = server.stats()
                epoch_steps = max((r["steps"] for r in records), default=0)
                steps_done += epoch_steps
                self._iteration += epoch_steps
                self._epochs_done += 1
                tasks.extend(records)
                record = self._epoch_record(epoch, records, before, stats, wall, t_run)
                record["deadline_s"] = deadline
                score = None
                if evaluate:
                    ev = self.net.evaluate()  # the task's metrics; its score (accuracy, or R-squared) is the target's
                    record.update(_test_fields(ev.metrics, ev.loss))
                    self.metrics["test_accuracy_by_epoch"].append(record["test_accuracy"])
                    score = ev.score
                    if early_stop is not None:
                        early_stop.observe(epoch, ev, self.net.get_flat())
                        if early_stop.exhausted:
                            record.update(stop_reason="patience", best_epoch=early_stop.best_round)
                history.append(record)
                self.metrics["epochs"].append(record)
                log.info("epoch %d: %d steps per worker, loss %.4f, %d pushes, staleness %.2f, %.1f s%s", epoch,
                         epoch_steps, record["loss"], record["pushes_applied"], record["staleness_mean"], wall,
                         f", test score {score:.4f}" if evaluate else "")
                if on_epoch is not None:
                    on_epoch(record)
                if target_accuracy is not None and evaluate and score >= target_accuracy:
                    log.info("test score %.4f reached the target %.4f", score, target_accuracy)
                    break
                if record.get("stop_reason") == "patience":
                    self.metrics["stop_reason"] = "patience"
                    log.info("%d epochs without a better test %s than epoch %d's: stopping", early_stop.patience,
                             "score" if early_stop.on_score else "loss", early_stop.best_round)
                    break
                if repartition_between_epochs and e < epochs - 1:
                    rdd = (rdd.mapPartitionsWithIndex(_worker.scatter(self.seed, epoch, K))
                           .partitionBy(K, spark_data.partition_key).values())
        finally:
            server.stop()
            cached.unpersist()
        self._finish_metrics(server.stats(), history, tasks, K, tau, t_run)
        if early_stop is not None and early_stop.weights is not None:  # the best weights scored, not the last
            self._last = self.net.get_weights()
            self.net.set_flat(early_stop.weights)
            best = dict(early_stop.scores)
            loss = best.pop("loss")
            self.metrics.update(returned_weights="best", best_epoch=early_stop.best_round, **_test_fields(best, loss))
        return self.metrics

    def _epoch_deadline(self, last: list[dict] | None, steps_left: int | None) -> float:
        """The longest wait for an epoch's job: ``epoch_timeout_s`` when set; else, as the rounds engine bounds a
        round, 30 minutes for the first epoch, then 20 times the slowest seconds per step (training and pushes)
        of the last epoch's tasks times the steps its slowest task made (at least 10 minutes)."""
        if self.epoch_timeout_s is not None:
            return float(self.epoch_timeout_s)
        done = [r for r in last or () if r["steps"]]
        if not done:
            return default_round_deadline(None, 0)
        step_s = max((r["train_s"] + r["comm_s"]) / r["steps"] for r in done)
        steps = max(r["steps"] for r in done)
        return default_round_deadline(step_s, steps if steps_left is None else min(steps, max(steps_left, 1)))

    @staticmethod
    def _epoch_record(epoch, records, before, stats, wall, t_run) -> dict:
        steps = sum(r["steps"] for r in records)
        loss_w = [(r["loss"], r["steps"]) for r in records if r["steps"] and not math.isnan(r["loss"])]
        applied = stats["pushes_applied"] - before["pushes_applied"]
        stale = stats["staleness_mean"] * stats["pushes_applied"] - before["staleness_mean"] * before["pushes_applied"]
        return {
            "event": "epoch", "epoch": epoch, "wall_s": wall, "elapsed_s": time.perf_counter() - t_run,
            "steps": steps, "steps_per_worker": max((r["steps"] for r in records), default=0),
            "samples": sum(r["samples"] for r in records),
            "loss": sum(l * n for l, n in loss_w) / sum(n for _, n in loss_w) if loss_w else math.nan,
            "version": stats["version"], "pushes_applied": applied,
            "duplicate_pushes": stats["duplicate_pushes"] - before["duplicate_pushes"],
            "staleness_mean": stale / applied if applied else 0.0,
            "retried_tasks": sum(1 for r in records if r["attempt"] > 0),
            "hosts": sorted({r["host"] for r in records}),
            "comm_s": sum(r["comm_s"] for r in records), "train_s": sum(r["train_s"] for r in records),
        }

    def _finish_metrics(self, stats: dict, history, tasks, K, tau, t_run) -> None:
        samples = sum(h["samples"] for h in history)
        train_wall = sum(h["wall_s"] for h in history)
        self.metrics.update({
            "workers": K, "tau": tau, "combiner": self.combiner.name,
            "epochs_run": len(history), "steps_per_worker": sum(h["steps_per_worker"] for h in history),
            "samples": samples, "wall_s": time.perf_counter() - t_run, "train_s": train_wall,
            "samples_per_s": samples / train_wall if train_wall else None, "pushes": stats["pushes_applied"],
            **{k: stats[k] for k in ("pushes_received", "duplicate_pushes", "pulls", "staleness_mean", "staleness_max",
                                     "staleness_histogram", "rejected", "rejected_total", "connections_refused")},
            "server_version": stats["version"], "bytes_communicated": stats["bytes_in"] + stats["bytes_out"],
            "server_busy_s": stats["busy_s"],
            "test_accuracy": history[-1].get("test_accuracy") if history else None,
            **({k: v for k, v in history[-1].items() if k.startswith("test_")} if history else {}),
            "test_loss": history[-1].get("test_loss") if history else None,
            "tasks": tasks,
        })


def _test_fields(metrics: dict, loss: float) -> dict:
    """An evaluation's scores as an epoch record and the summary name them (``test_accuracy`` is there for every
    task: ``None`` where the task has no accuracy)."""
    return {"test_accuracy": metrics.get("accuracy"), **{f"test_{k}": v for k, v in metrics.items()}, "test_loss": loss}


def run_async(run, dist, *, combiner: str = "delta", ps_host: str | None = None,
              on_round: Callable[[dict], None] | None = None) -> dict:
    """``sparknet train --strategy async``: train ``run``'s model on its data set with ``dist.workers`` workers.

    The training set is cut into ``dist.workers`` partitions; every worker trains on its own and pushes and pulls
    every ``dist.tau`` steps. Training stops after ``run.steps`` local steps per worker, after ``dist.epochs``
    epochs, or when ``dist.target_accuracy`` is reached, whichever comes first. The test set is evaluated after
    every epoch; each epoch's record goes to ``on_round`` and ``run.metrics_out``.

    Returns
    -------
    dict
        The summary record (test_accuracy, wall_s, samples_per_s, steps, rounds = epochs, pushes, staleness,
        rejects...).
    """
    cfg = AsyncConfig(combiner=combiner, ps_host=ps_host)
    check_road(Road.PARAMETER_SERVER, run, dist)
    seed_everything(run.seed)
    train, test, info = load_training_data(run)
    train, weighted = training_rows(train, info)
    test = scored_rows(test, info)
    K = dist.workers
    spark = get_session(dist.resolved_master, app_name="sparknet-async")
    net_params = build_model(run, info)
    split_budget(net_params, dist)  # --max-weight-bytes
    net = Net(net_params, run.solver(), batch_size=run.batch_size, seed=run.seed, task=run.task, weighted=weighted)
    sess = AsyncSession(net, combiner=cfg.combiner, seed=run.seed, host=cfg.ps_host, threads=run.threads or 1,
                        device=run.device, spark=spark, compute=run.worker().compute, profile=run.worker().profile)
    per_worker = max(1, (len(train) // K) // run.batch_size)
    epochs = math.ceil(dist.epochs) if dist.epochs is not None else math.ceil(run.steps / per_worker)
    steps = run.steps if dist.epochs is None else min(run.steps, math.ceil(dist.epochs * per_worker))
    config = {**TrainConfig(run=run, dist=dist).to_dict(), "combiner": cfg.combiner}
    checkpoints, ckpt = open_checkpoints(dist, config, net)
    done = 0  # local steps a worker took before this run (a resumed one)
    early = None if dist.patience is None else EarlyStop(dist.patience, dist.min_delta,
                                                         on_score=dist.monitor == "score")
    if ckpt is not None:
        if ckpt.state.get("engine") != "ps":
            raise CheckpointError(f"checkpoint {ckpt.path} was written by the {ckpt.state.get('engine')!r} engine; "
                                  "resume it with the same --strategy and --engine, or choose another "
                                  "--checkpoint-dir")
        net.set_weights(ckpt.weights)
        sess.continue_from(int(ckpt.state["epochs"]), int(ckpt.state["iteration"]))
        done = int(ckpt.state["steps"])
        if early is not None and ckpt.state.get("best") is not None:  # early stopping goes on as the run left it
            early.restore(ckpt.state.get("early_stop"), ckpt.state["best"].to(torch.float32))
        log.info("resuming from %s: epoch %d, step %d", ckpt.path, sess.epochs_done, done)
    warmup = None
    if dist.warmup_steps and ckpt is None:  # a resumed run had its warm-up before its checkpoint
        warmup = _warm_up(net, train, dist.warmup_steps)
        sess.continue_from(0, dist.warmup_steps)  # the workers' learning-rate schedule goes on from there
    sinks = run_sinks(run, config)
    failed = True
    try:
        summary = _train_async(run, dist, sess, train, test, combiner=cfg.combiner, sinks=sinks,
                               steps=max(steps - done, 0), epochs=max(epochs - sess.epochs_done, 0), done=done,
                               checkpoints=checkpoints, on_round=on_round, warmup=warmup, early=early)
        failed = False
    finally:  # the server's final copy saved (--model-dir) and logged (--mlflow) as one process's weights are
        finish_run(run, sinks, failed=failed, net_params=net_params, weights=sess.weights, solver=run.solver(),
                   config=config, features=info.get("features"))
    return summary


def _warm_up(net: Net, train, steps: int) -> dict:
    """SparkNet's warm start: ``steps`` of ``net`` on the driver on the training rows (they are here already),
    before the server starts from its weights; what it did."""
    net.set_training_data(train)
    stats = net.train(steps)
    if not stats.finite:
        raise EngineError("the warm-up on the driver produced NaN/Inf loss; lower the learning rate")
    log.info("warm-up: %d steps on the driver in %.1f s, loss %.4f", stats.steps, stats.wall_s, stats.loss)
    return {"steps": stats.steps, "rows": len(train), "loss": stats.loss, "wall_s": stats.wall_s}


def _train_async(run, dist, sess: AsyncSession, train, test, *, combiner: str, sinks: list, steps: int, epochs: int,
                 done: int, checkpoints, on_round: Callable[[dict], None] | None, warmup: dict | None = None,
                 early=None) -> dict:
    """:func:`run_async`'s training: ``sess`` run on ``train`` for ``steps`` more local steps a worker (``done``
    taken before), every epoch's record written and shown and, where due and at the end, the server's copy
    checkpointed (with early stopping's best weights and count, ``early``, where the run keeps them); then its
    summary (with the driver's ``warmup``, where it had one)."""
    K = dist.workers
    taken = {"steps": done, "saved": sess.epochs_done if done else None}  # a resumed run's start is saved already

    def save() -> None:
        state = {"engine": "ps", "epochs": sess.epochs_done, "steps": taken["steps"], "iteration": sess.iteration}
        if early is not None and early.weights is not None:
            state.update(early_stop=early.counters(), best=early.weights)
        checkpoints.save(sess.epochs_done, sess.last_weights, state)
        taken["saved"] = sess.epochs_done

    with MetricsLogger(run.metrics_out, progress=not run.quiet, total=done + steps, sinks=sinks,
                       early_stop=dist.toward_target) as metrics:
        metrics.progress(done)

        def emit(record):
            metrics.write(record)
            wall = record.get("wall_s")
            metrics.progress(record["steps_per_worker"], epoch=record["epoch"], loss=record.get("loss"),
                             acc=record.get("test_accuracy"), stale=record.get("staleness_mean"),
                             **{"samples/s": record["samples"] / wall if wall else None})
            taken["steps"] += record["steps_per_worker"]
            if checkpoints is not None and checkpoints.due(sess.epochs_done):
                save()
            if on_round is not None:
                on_round(record)

        if epochs and steps:
            m = sess.run(data=train, batch_size=run.batch_size, tau=dist.tau, epochs=epochs,
                         num_workers=K, steps=steps, validation_data=test, target_accuracy=dist.target_accuracy,
                         on_epoch=emit, early_stop=early)
        else:  # resumed at the run's end: nothing left to train, the weights it ended with (the best) scored
            if early is not None and early.weights is not None:
                sess.net.set_flat(early.weights)
            sess.net.set_validation_data(test)
            scored = sess.net.evaluate()
            m = {"steps_per_worker": 0, "samples": 0, "wall_s": 0.0, "train_s": 0.0, "samples_per_s": None,
                 **_test_fields(scored.metrics, scored.loss), "pushes": 0, "duplicate_pushes": 0,
                 "pulls": 0, "staleness_mean": 0.0, "staleness_max": 0, "staleness_histogram": {}, "rejected": {},
                 "bytes_communicated": 0, "test_accuracy_by_epoch": []}
        if checkpoints is not None and taken["saved"] != sess.epochs_done:
            save()  # the end, as the round engines write one
        summary = {
            "event": "summary", "model": run.model, "dataset": run.dataset, "engine": "ps", "strategy": "async",
            "workers": K, "combiner": combiner, "tau": dist.tau,
            "steps": done + m["steps_per_worker"], "rounds": sess.epochs_done, "epochs": sess.epochs_done,
            **{k: m[k] for k in ("samples", "wall_s", "train_s", "samples_per_s", "test_accuracy", "test_loss",
                                 "pushes", "duplicate_pushes", "pulls", "staleness_mean", "staleness_max",
                                 "staleness_histogram", "rejected", "bytes_communicated")},
            "test_accuracy_by_epoch": m["test_accuracy_by_epoch"], "validation_weight": sess.net.validation_weight,
            **{k: v for k, v in m.items() if k.startswith("test_") and k != "test_accuracy_by_epoch"},
            **({"resumed_from_step": done} if done else {}), **({"warmup": warmup} if warmup else {}),
            **{k: m[k] for k in ("returned_weights", "best_epoch", "stop_reason") if k in m},
        }
        metrics.write(summary)
    return summary
