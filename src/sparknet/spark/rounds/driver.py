"""Driver side of the rounds engine: one Spark job per round is the round loop's exchange.

Each round (:meth:`SparkRoundsExchange.run_round`): the global weights (or the round's compressed
:class:`~sparknet.strategies.Downlink` message) go out through the fit's relay (:mod:`sparknet.spark._relay`) or a
broadcast, every partition's task (:mod:`sparknet.spark.rounds.executor`) runs its local steps, and the driver sums
the updates in partition order (compressed ones decoded here, in worker order), bit for bit the same whichever way
they travelled. A partition whose staged files are not where Spark ran it is rerun from the persisted chunks; a
worker that lost the weights a compressed message is relative to gets them in full. A watchdog cancels the round's
job past its deadline.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from dataclasses import replace

import numpy as np
import torch

from sparknet._enums import CompressionKind
from sparknet.errors import DeadlineExceeded
from sparknet.loop import Exchange, NetScorer, Progress, ResumeState, RoundPlan, RoundUpdate, run_rounds
from sparknet.spark.backend import Watchdog, default_round_deadline, job_group, spark_call, task_error, task_slots
from sparknet.spark.resources import gpu_profile, with_profile
from sparknet.spark.session import is_local_master
from sparknet._tensortree import unpack_tree
from sparknet.spark._relay import RoundRelay
from sparknet.spark.engine import EngineRun
from sparknet.metrics import returned_scores
from sparknet.spark.rounds.executor import (ROUND_TASK, Partial, RoundTask, WorkerStatus, combine, decode_updates,
                                           pack_spec, run_round, run_round_from_chunks)
from sparknet.spark.rounds.validation import ShardedScorer, ValidationShards
from sparknet.strategies import Downlink, make_compressor

__all__ = ["SparkRoundsExchange", "run_rounds_engine"]

log = logging.getLogger(__name__)


class SparkRoundsExchange(Exchange):
    """One Spark job per round over the staged partitions (``run.source``); the driver sums what the tasks fold.

    ``spec_bc`` is the broadcast packed :class:`~sparknet.spark.rounds.executor.WorkerSpec`. ``relay`` is the driver's
    socket the weights and updates travel through (:mod:`sparknet.spark._relay`; the spec's ``relay`` is its address);
    ``None``, or once a task could not reach it: Spark's broadcasts and results. When the driver holds the workers'
    states (``EngineOptions.worker_state_on_driver``), the tasks send theirs every round, and a partition that moves to a
    host without its state continues from the driver's copy. The round's tasks ask for ``profile``'s resources (a
    worker's GPU share: :mod:`sparknet.spark.resources`). ``scorer`` scores the global weights: the driver's net on
    the validation rows it holds (by default), or a :class:`~sparknet.spark.rounds.validation.ShardedScorer` where
    they stay in Spark.
    """

    engine = "rounds"

    def __init__(self, run: EngineRun, spec_bc, relay=None, profile=None,
                 scorer: NetScorer | ShardedScorer | None = None):
        self.run, self.sc, self.group, self.spec_bc, self.driver_net = run, run.sc, run.group, spec_bc, run.driver_net
        self.scorer = scorer or NetScorer(run.driver_net)
        self.profile = profile
        self.staged, self.chunks, self.workers = run.source, run.chunks, run.dist.workers
        self.compression = run.spec.compression
        self.numel = self.driver_net.get_flat().numel()
        self._background = None
        self.down = None
        if self.compression is not CompressionKind.NONE:
            self.down = Downlink(make_compressor(self.compression), self.numel)
            if run.resume is not None and run.resume.downlink:
                self.down.load_state_dict(run.resume.downlink)
        self.slowest_step_s: float | None = None  # seconds per local step of the slowest round so far
        self.rerun_partitions = 0
        self._want_state = False
        self._worker_states: dict = {}
        held = run.options.worker_state_on_driver  # by default on a cluster (a local master's executors share a disk)
        self.hold_states = not is_local_master(run.sc.master) if held is None else held
        self._hosts: list[str] | None = None  # where the last round's tasks ran
        self._held: ResumeState | None = None  # the workers' states after the last round, with hold_states
        self._slots: int | None = None  # task slots at the start of the last round
        self._short_since: float | None = None  # when the cluster was first seen short of task slots
        self._turn = 0  # the first worker of the next elastic round
        self._stale: set[int] = set()  # workers left out of a round since they last trained
        self._misplaced = False  # Spark ran partitions away from their staged copies in the last round
        self.elastic_rounds = 0
        self.relay = relay
        self._relayed_tasks = None  # the fit's one RDD of relayed rounds (its jobs carry their round in a property)
        self.latest: torch.Tensor | None = None
        """The newest global weights (after the last round)."""

    def run_round(self, plan: RoundPlan, global_flat: torch.Tensor) -> RoundUpdate:
        sc, group, down, r = self.sc, self.group, self.down, plan.round
        checkpoints = self.run.checkpoints  # worker states come back on checkpoint rounds
        self._want_state = checkpoints is not None and (checkpoints.due(r + 1) or plan.last)
        task = RoundTask(plan=plan, numel=self.numel, send_state=self._want_state or self.hold_states,
                         held=self.hold_states)
        t_round = time.perf_counter()
        if self._misplaced:
            self._restage()
            self._misplaced = False
        active = self._elastic_workers(r)
        message = global_flat.numpy() if down is None else down.message(global_flat).numpy()
        weights_bc = None
        if self.relay is not None:
            self.relay.publish(r, message=message)
            task = replace(task, relayed=True)
        else:
            weights_bc = sc.broadcast(message)
        deadline = (self.run.options.round_timeout_s
                    or default_round_deadline(self.slowest_step_s, plan.steps, plan.seconds))
        watchdog = Watchdog(sc, group, deadline)
        full = []
        states_bc = None
        if self._stale.intersection(range(self.workers) if active is None else active):
            states_bc = sc.broadcast(self._held)  # workers back from a pause continue from the driver's copy
        try:
            sc.setJobDescription(f"sparknet round {r + 1}")
            with watchdog:
                tasks = self._round_tasks(task, weights_bc, states_bc)
                if active is None:
                    acc = self._aggregate(tasks, r)
                else:
                    acc = self._run_partitions(tasks, active, r)
                unreachable = sorted(w.index for w in acc.workers if w.status is WorkerStatus.UNREACHABLE)
                if unreachable:  # nothing of the round was done there: the same tasks, through Spark
                    log.warning("round %d: partitions %s could not reach the driver's socket at %s; the weights and "
                                "updates go through Spark's broadcasts and task results from now on", r + 1,
                                unreachable, self.relay.address.endpoint)
                    self.relay.close()
                    self.relay = None
                    task = replace(task, relayed=False)
                    weights_bc = sc.broadcast(message)
                    again = self._round_tasks(task, weights_bc, states_bc)
                    acc = combine(acc.without(WorkerStatus.UNREACHABLE), self._run_partitions(again, unreachable, r))
                for status, why in ((WorkerStatus.MISSING, "are not staged where Spark ran them"),
                                    (WorkerStatus.NEED_STATE, "moved to a host without their solver state")):
                    if redo := sorted(w.index for w in acc.workers if w.status is status):
                        self.rerun_partitions += len(redo)
                        log.warning("round %d: partitions %s %s; rerunning them from the cached chunks%s", r + 1,
                                    redo, why, " with the state the driver holds" if self._held else "")
                        if states_bc is None and self._held is not None:
                            states_bc = sc.broadcast(self._held)
                        acc = self._rerun(acc.without(status), weights_bc, task, redo, states_bc, r)
                        if status is WorkerStatus.MISSING and self.hold_states:
                            # the rerun went where the chunks are, not where Spark sent the task (a host
                            # back, or one whose executor was not ready when the partitions were staged
                            # again): without staging them where Spark runs them, every round reruns them
                            log.warning("round %d: the next round stages every partition again where Spark runs "
                                        "it", r + 1)
                            self._misplaced = True
                full = sorted(w.index for w in acc.workers if w.status is WorkerStatus.NEED_FULL)
                if full:  # their processes lost the weights the round's message is relative to
                    log.warning("round %d: workers %s lost their copy of the weights; sending them in full", r + 1,
                                full)
                    full_bc = None
                    if task.relayed:
                        self.relay.publish(r, full=down.seen.numpy())
                    else:
                        full_bc = sc.broadcast(down.seen.numpy())
                        self.run.broadcasts.append(full_bc)
                    acc = self._rerun(acc.without(WorkerStatus.NEED_FULL), full_bc, replace(task, full=True), full,
                                      states_bc, r)
        except Exception as exc:
            if watchdog.fired:
                raise DeadlineExceeded(f"round {r + 1} did not finish within round_timeout_s={deadline:g} s and was "
                                       f"cancelled: {watchdog.unfinished}; see those tasks' executor logs, or raise "
                                       "round_timeout_s") from exc
            raise
        finally:
            sc.setLocalProperty(ROUND_TASK, None)
            for bc in (weights_bc, states_bc):
                if bc is not None:
                    bc.destroy()
        return self._update(r, acc, message, full, time.perf_counter() - t_round, active)

    def _round_tasks(self, task: RoundTask, weights_bc, states_bc):
        """The round's tasks. Relayed, with nothing broadcast, they are one RDD for the whole fit whose jobs carry
        their round in the :data:`ROUND_TASK` property: no Python RDD and closure to build and ship each round."""
        if task.relayed and weights_bc is None and states_bc is None:
            if self._relayed_tasks is None:
                self._relayed_tasks = with_profile(
                    self.staged.mapPartitionsWithIndex(run_round(self.spec_bc, None, None)), self.profile)
            self.sc.setLocalProperty(ROUND_TASK, task.to_json())
            return self._relayed_tasks
        return with_profile(self.staged.mapPartitionsWithIndex(run_round(self.spec_bc, weights_bc, task, states_bc)),
                            self.profile)

    def _elastic_workers(self, r: int) -> list[int] | None:
        """The workers of round ``r`` (``None``: all K), from the task slots the cluster has now
        (``EngineOptions.elastic_after_s``); when slots are added, the partitions are staged again where Spark
        places the round's tasks, so a new host takes work."""
        if not self.hold_states or self._held is None:  # a first round holds no state to move or pause with
            return None
        slots = task_slots(self.sc)
        if slots is None:
            return None
        if self._slots is not None and slots > self._slots:
            log.warning("round %d: the cluster has %d task slot(s), %d more than the round before; the partitions "
                        "are staged again where Spark runs this round's tasks", r + 1, slots, slots - self._slots)
            self._restage()
        self._slots = slots
        if slots >= self.workers:
            if self._short_since is not None:
                log.warning("round %d: the cluster has task slots for all %d workers again; every round trains "
                            "all of them", r + 1, self.workers)
            self._short_since = None
            return None
        now, elastic_after_s = time.monotonic(), self.run.options.elastic_after_s
        if self._short_since is None:
            self._short_since = now
            log.warning("round %d: the cluster has %d task slot(s) for %d workers; Spark runs the tasks in waves "
                        "on the hosts left%s", r + 1, slots, self.workers,
                        "" if elastic_after_s is None else
                        f" (after {elastic_after_s:g} s each round trains {max(slots, 1)} worker(s) in turn)")
        if elastic_after_s is None or now - self._short_since < elastic_after_s:
            return None
        n = max(slots, 1)
        active = sorted((self._turn + j) % self.workers for j in range(n))
        self._turn = (self._turn + n) % self.workers
        return active

    def _restage(self) -> None:
        """Drop the staged partitions' records: the next job stages each partition again where it runs."""
        level = self.staged.getStorageLevel()
        self.staged.unpersist(blocking=True)
        self.staged.persist(level)
        self._stale = set(range(self.workers))  # a partition staged on a new host continues from the driver's state

    def _sum(self, parts: list, r: int) -> Partial:
        """The partitions' results summed in partition order, each relayed update fetched from the relay first (so
        the sum is the one of the updates travelling in the results)."""
        if self.relay is not None:
            relay = self.relay
            take = functools.partial(relay.take, r, scale=self.down is None)  # take(index, attempt, samples)

            def with_state(w):  # a worker's state that came through the relay
                if w.state_attempt is None:
                    return w
                return replace(w, worker_state=unpack_tree(relay.take_state(r, w.index, w.state_attempt)),
                               state_attempt=None)

            parts = [replace(p, workers=tuple(with_state(w) for w in p.workers)).resolved(take) for p in parts]
        return functools.reduce(combine, parts, None)

    def _run_partitions(self, tasks, partitions: list[int], r: int) -> Partial:
        return _fatal(self._sum(spark_call(self.sc.runJob, tasks, list, partitions), r))

    def _aggregate(self, parts, r: int) -> Partial:
        if self.workers > 8 and self.down is None and self.relay is None:
            # K partial sums need not reach the driver
            return _fatal(spark_call(parts.treeAggregate, None, combine, combine, 2))
        return _fatal(self._sum(spark_call(parts.collect), r))  # relayed or compressed: summed or decoded here only

    def _rerun(self, acc: Partial, weights_bc, task: RoundTask, partitions: list[int], states_bc, r: int) -> Partial:
        redo = with_profile(
            self.chunks.mapPartitionsWithIndex(run_round_from_chunks(self.spec_bc, weights_bc, task, states_bc)),
            self.profile)
        return combine(acc, self._run_partitions(redo, sorted(partitions), r))

    def _update(self, r: int, acc: Partial, message: np.ndarray, full: list[int], round_s: float,
                active: list[int] | None) -> RoundUpdate:
        workers = sorted(acc.workers, key=lambda w: w.index)
        states = {w.index: w.worker_state for w in workers if w.worker_state is not None}
        if self.hold_states:  # a worker left out of the round keeps the state it had: it made no step
            states = {**(self._held.workers if self._held else {}), **states}
            self._held = ResumeState(round=r + 1, workers=states)
        self._worker_states = states
        self._stale = set() if active is None else set(range(self.workers)) - set(active)
        trained = [w for w in workers if w.trained]
        steps = max((w.steps for w in trained), default=0)
        if steps:
            self.slowest_step_s = max(self.slowest_step_s or 0.0, round_s / steps)
        if acc.samples == 0:
            total = torch.zeros(self.numel)
        elif self.down is None:
            total = torch.from_numpy(acc.wsum)
        else:
            total = torch.from_numpy(decode_updates(acc.encoded, self.compression, self.numel))
        nbytes = self.numel * 4
        if self.down is None:
            moved = nbytes * (len(trained) + sum(1 for w in trained if w.finite and w.samples))
        else:  # each worker's message down (the full weights for those that lost theirs), its update up
            moved = message.nbytes * len(trained) + nbytes * len(full) + sum(w.sent_bytes or 0 for w in trained)
        slowest = max(trained, key=lambda w: w.compute_s, default=None)
        fields = {"per_worker": [w.record() for w in workers], "retries": sum(w.attempt for w in workers),
                  "hosts": sorted({w.host for w in workers})}
        if self._hosts is not None and fields["hosts"] != self._hosts:  # a host lost, or one back
            log.warning("round %d: the workers ran on %s (the round before: %s)", r + 1, ", ".join(fields["hosts"]),
                        ", ".join(self._hosts))
        self._hosts = fields["hosts"]
        if fields["retries"]:
            log.warning("round %d: %d task attempt(s) failed and were retried by Spark", r + 1, fields["retries"])
        if self.run.spec.link is not None:  # the tasks wait at once, as on a real network: the longest wait counts
            fields["link_s"] = max((w.link_s or 0.0 for w in trained), default=0.0)
        if self.rerun_partitions:
            fields["rerun_partitions"] = self.rerun_partitions
        if active is not None:
            self.elastic_rounds += 1
            fields["trained_workers"] = active
        return RoundUpdate(workers=None if active is None else len(active), total=total, samples=acc.samples,
                           loss_sum=acc.loss_sum, steps=steps,
                           processed=sum(w.samples for w in trained),
                           compute_s=slowest.compute_s if slowest is not None else 0.0,
                           slowest_steps=slowest.steps if slowest is not None else 0, nbytes=moved,
                           nonfinite=tuple(w.index for w in trained if not w.finite),
                           observe=slowest is not None, fields=fields)

    @property
    def validation_rows(self) -> int | None:
        if isinstance(self.scorer, ShardedScorer):
            return self.scorer.rows
        return None if self.driver_net._val is None else len(self.driver_net._val[0])

    def evaluate(self, global_flat: torch.Tensor, rows: int | None = None, rest_of: int | None = None):
        return self.scorer.evaluate(global_flat, rows, rest_of)

    def background_evaluator(self) -> NetScorer:
        """A copy of the driver's net (sharing its validation and warm-up tensors, which nothing writes) that scores
        weights in a thread of its own while the next round's job runs: the driver's net is the checkpoints' too."""
        if self._background is None:
            net = self.driver_net
            shared = [t for data in (net._val, getattr(net, "_train", None)) if data is not None for t in data]
            self._background = NetScorer(copy.deepcopy(net, {id(t): t for t in shared}))
        return self._background

    def new_global(self, global_flat: torch.Tensor, progress: Progress) -> None:
        self.latest = global_flat

    def round_done(self, record: dict, global_flat: torch.Tensor, progress: Progress) -> None:
        run, r, reason = self.run, progress.round, record.get("stop_reason")
        if run.checkpoints is None or not (run.checkpoints.due(r) or reason is not None):
            return
        if not self._want_state:
            log.warning("round %d: the run stopped on %s before a checkpoint round; the final checkpoint holds "
                        "no worker solver state, so a resume from it restarts the workers' solvers", r, reason)
        plan = run.plan
        record["checkpoint"] = run.save_checkpoint("rounds", ResumeState(
            **vars(progress), global_flat=global_flat,
            workers=self._worker_states if self._want_state else {},
            downlink=None if self.down is None else self.down.state_dict(),
            auto_tau=None if plan.auto is None else plan.auto.state_dict(), **plan.kept_state()))


def _fatal(acc: Partial | None) -> Partial | None:
    """``acc``, unless a worker's round reported that its process ran out of memory: then that worker's error
    (:class:`~sparknet.errors.WorkerOutOfMemory`), the first by partition."""
    failed = sorted((w for w in acc.workers if w.status is WorkerStatus.OUT_OF_MEMORY), key=lambda w: w.index) \
        if acc is not None else []
    if failed:
        raise task_error(failed[0].error)
    return acc


def run_rounds_engine(run: EngineRun):
    """The rounds engine's fit: :func:`sparknet.loop.run_rounds` over a :class:`SparkRoundsExchange`.

    The validation data is evaluated on the driver, by ``run.driver_net``, or where it stays in Spark
    (:class:`~sparknet.spark.rounds.validation.ValidationShards`, one job an evaluation). Returns the final global
    weights, the round records and the engine's summary fields.
    """
    sc, spec, relay = run.sc, run.spec, None
    if run.options.rounds_transport == "socket":
        local, host = run.driver_address()  # a local master: a Unix socket, no CurveZMQ
        numel = int(run.global_flat.numel())
        compressed = spec.compression is not CompressionKind.NONE
        relay = RoundRelay(host, host, max_bytes=8 * numel + (1 << 20), update_bytes=None if compressed else 4 * numel,
                           state_bytes=run.state_bytes(), local=local)
        spec = replace(spec, relay=relay.address)
    try:
        profile, gpus = gpu_profile(sc, spec.worker.gpus_per_worker)
        spec_bc = sc.broadcast(pack_spec(spec))
        run.broadcasts.append(spec_bc)
        scorer = None
        if isinstance(run.validation, ValidationShards):
            scorer = ShardedScorer(sc, run.group, run.validation, spec_bc, profile=profile,
                                   timeout_s=run.options.round_timeout_s)
        exchange = SparkRoundsExchange(run, spec_bc, relay, profile, scorer)
        history: list[dict] = []

        def on_record(record: dict) -> None:
            history.append(record)
            run.emit(record, exchange.latest)

        extra = {}
        with job_group(sc, run.group, f"sparknet rounds ({run.dist.workers} workers)"):  # each round names itself
            global_flat = run_rounds(exchange, run.plan, run.global_flat, on_record=on_record, t0=run.t_fit)
            rounds = [h for h in history if h.get("event") == "round"]
            if scorer is not None and returned_scores(rounds, run.dist.weight_ema is not None) is None:
                scored = scorer.evaluate(global_flat)  # no round scored the weights returned (a resumed fit)
                extra["final_scores"] = scored.metrics, scored.loss
        if scorer is not None:
            extra["evaluation_jobs"] = scorer.jobs
        return global_flat, history, {"rerun_partitions": exchange.rerun_partitions,
                                      "elastic_rounds": exchange.elastic_rounds,
                                      "rounds_transport": "spark" if exchange.relay is None else "socket",
                                      "gpu_scheduling": gpus, "eval_sharded": scorer is not None, **extra}
    finally:
        if relay is not None:
            relay.close()
