"""Driver side of the barrier engine: one barrier stage per fit, supervised, restarted when it fails.

The stage's tasks (:mod:`sparknet.spark.barrier.executor`, the executor side) form a gloo group and run
the round loop on every rank; rank 0 sends each round's record, and every few rounds the global
weights and strategy state, over an authenticated pyzmq channel (:mod:`sparknet.spark._channel`).
:class:`BarrierStage` runs the stage's Spark job in a thread and listens on the channel: records go
to the fit's history and ``on_round`` as they arrive, a silent stage past its deadline is
cancelled, the first rank that failed on its own is named, and checkpoints are assembled from the
ranks' states. :func:`run_barrier_engine` starts a failed stage again from the newest state the
driver holds, at most ``EngineOptions.max_restarts`` times.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from datetime import timedelta

import numpy as np
import torch
from torch.distributed import TCPStore

from sparknet.config import Engine
from sparknet.errors import DeadlineExceeded, EngineError, NonFiniteUpdate, WorkerOutOfMemory
from sparknet.loop import ResumeState
from sparknet.parallel.mesh import cut_state, join_shards
from sparknet.parallel.tensor import split_dims
from sparknet.spark.backend import Held, run_with_deadline, task_error, task_slots, worker_crash
from sparknet.spark.resources import gpu_profile, with_profile
from sparknet.spark.barrier.executor import (RESULT_SCHEMA, STATE_PARTS, GroupPlan, StagePlan, StagedRowsMissing,
                                             run_barrier, run_barrier_frame)
from sparknet.spark.engine import EngineOptions, EngineRun
from sparknet.spark.rounds.executor import pack_spec
from sparknet._tensortree import unpack_tree
from sparknet.spark.data import folded, is_dataframe
from sparknet.spark._channel import MetricsReceiver
from sparknet.spark.session import is_local_master, session_master, spark_setting

__all__ = ["BarrierStage", "run_barrier_engine", "run_connect_stage", "connect_refusal", "workers_to_restart"]

log = logging.getLogger(__name__)


def run_barrier_engine(run: EngineRun):
    """The barrier engine's fit: run the stage; start it again from the driver's newest state when it fails.

    Returns the final global weights, the round records and the engine's summary fields.
    """
    opts, resume = run.options, run.resume
    history: list[dict] = []
    latest = ResumeState(global_flat=run.global_flat)
    if resume is not None:  # its strategy state is the driver's strategy's now; its solver iteration is the workers'
        latest = replace(resume, global_flat=run.global_flat, strategy=run.plan.strategy.state_dict(), iteration=None,
                         downlink=None)
    restarts: list[dict] = []
    profile, gpus = gpu_profile(run.sc, run.spec.worker.gpus_per_worker, workers=run.dist.ranks,
                                procs=run.dist.procs_per_worker)
    t_engine, ready_at, staged_missing = time.perf_counter(), None, False
    workers, G = run.dist.workers, run.dist.procs_per_worker
    elastic: list[dict] = []  # each change in the number of workers
    whole = run  # the fit's partitions, one a task of all the workers
    while True:
        stage = BarrierStage(run, history, restart=len(restarts), profile=profile, workers=workers)
        try:
            final, extra = stage.run(latest)
            break
        except _Grow as grow:  # a host back: more workers (all: each on its own partition) from that round's state
            log.warning("barrier stage: %s; starting it again with %d of the %d workers from there", grow,
                        grow.workers, whole.dist.workers)
            workers = grow.workers
            run = whole if workers == whole.dist.workers else _elastic_run(whole, workers * G)
            latest = replace(stage.latest, workers={})
            elastic.append({"after_round": grow.round, "workers": workers})
            del history[sum(1 for h in history if h["round"] <= latest.round):]
        except _StageFailed as failed:
            ready_at = ready_at or stage.ready_at
            cause = failed.cause
            missing = run.source is not run.chunks and StagedRowsMissing.__name__ in str(cause)
            if not missing and (failed.fatal or len(restarts) >= opts.max_restarts):
                if restarts:
                    log.error("the barrier stage failed %d times in all; giving up", len(restarts) + 1)
                raise cause from failed.__cause__
            latest = stage.latest or latest
            first_line = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
            if missing:  # Spark ran a task away from its partition's staged files (a host lost, or an executor not
                # up when they were staged): the stage starts again over the cached chunks, not counted as a restart
                log.warning("barrier stage: %s; starting it again over the cached chunks", first_line)
                run = whole = replace(run, source=run.chunks)  # only the fit's own partitions are staged
                staged_missing = True
            else:
                restarts.append({"after_round": latest.round, "error": first_line})
                log.warning("barrier stage failed (%s); restart %d of at most %d from round %d", first_line,
                            len(restarts), opts.max_restarts, latest.round)
            left = _workers_after_failure(run.sc, workers, G, opts, latest.round, cause)
            if left < workers:  # a host gone for good: fewer workers go on, with every partition's rows
                log.warning("barrier stage: the cluster has task slots for %d of the %d workers of %d process(es) "
                            "after %g s; the stage goes on with %d worker(s), the rows of the %d partitions dealt "
                            "to their %d tasks until the cluster has the slots of all of them again", left, workers,
                            G, opts.elastic_after_s, left, len(whole.rows), left * G)
                run = _elastic_run(whole, left * G)
                latest, workers = replace(latest, workers={}), left  # the solver states belong to the old partitions
                elastic.append({"after_round": latest.round, "workers": left})
                if not missing:
                    restarts[-1]["workers"] = left
            del history[sum(1 for h in history if h["round"] <= latest.round):]  # their work is redone
    history.sort(key=lambda h: h["round"])
    ready_at = ready_at or stage.ready_at
    # the first stage's launch: its tasks start, write their partitions and join the process group (setup_s ends
    # where the engine starts; the rounds engine's staging jobs run before that, inside setup_s)
    extra.update(restarts=len(restarts), restart_log=restarts, gpu_scheduling=gpus, staged_rows_missing=staged_missing,
                 launch_s=None if ready_at is None else ready_at - t_engine,
                 elastic_workers=workers if workers < run.dist.workers else None, elastic_log=elastic)
    return final, history, extra


def workers_to_restart(slots: int | None, workers: int, procs_per_worker: int, waited_s: float,
                       opts: EngineOptions) -> int | None:
    """How many workers a failed barrier stage starts again with, given the task ``slots`` the cluster has after
    ``waited_s`` seconds of waiting for them (``None``: Spark cannot say); ``None``: wait on.

    All ``workers`` as soon as there are slots for all of them. After ``opts.elastic_after_s`` (a host gone for
    good), as many whole workers as the slots hold, each of its ``procs_per_worker`` processes on a slot (a worker
    never goes on with some of its ranks). :class:`EngineError` once neither came within
    ``opts.rendezvous_timeout_s`` (or ``elastic_after_s``, the longer)."""
    ranks = workers * procs_per_worker
    if slots is None or slots >= ranks:
        return workers
    elastic = opts.elastic_after_s
    if elastic is not None and waited_s >= elastic and slots >= procs_per_worker:
        return slots // procs_per_worker
    if waited_s < max(opts.rendezvous_timeout_s, elastic or 0.0):
        return None
    each = f" of {procs_per_worker} processes" if procs_per_worker > 1 else ""
    go_on = ("" if elastic is None else f"; after elastic_after_s={elastic:g} s it goes on with the workers whose "
             f"{procs_per_worker} task slot(s) it has, and it had fewer")
    raise EngineError(f"the barrier stage failed and cannot start again: it runs all {workers} workers{each} at once "
                      f"({ranks} tasks) but the cluster has {slots} task slot(s) left (an executor or host was lost "
                      f"and did not come back within {max(opts.rendezvous_timeout_s, elastic or 0.0):g} s){go_on}; "
                      "add executors, train with fewer --workers, or use --engine rounds, which finishes on the "
                      "hosts left")


def _workers_after_failure(sc, workers: int, procs_per_worker: int, opts: EngineOptions, round_done: int,
                           cause: BaseException) -> int:
    """Before a restart: wait (bounded) until the cluster can run every worker's tasks at once again, or, a host
    gone for good, fewer workers (:func:`workers_to_restart`); how many."""
    t0 = time.monotonic()
    while True:
        try:
            left = workers_to_restart(task_slots(sc), workers, procs_per_worker, time.monotonic() - t0, opts)
        except EngineError as exc:
            raise EngineError(f"{exc} (it failed after round {round_done})") from cause
        if left is not None:
            return left
        time.sleep(1.0)


def _elastic_run(run: EngineRun, ranks: int) -> EngineRun:
    """``run`` for a stage of ``ranks`` tasks: partition p's chunks go to task ``p % ranks``
    (:func:`~sparknet.spark.data.folded`), so the workers left train on every row."""
    chunks = folded(run.chunks, ranks)
    rows = tuple(sum(run.rows[p] for p in range(i, len(run.rows), ranks)) for i in range(ranks))
    return replace(run, source=chunks, chunks=chunks, rows=rows)


class _Grow(Exception):
    """A stage of fewer workers is stopped after ``round``: the cluster has ``slots``, enough for ``workers``."""

    def __init__(self, round_done: int, slots: int, workers: int):
        super().__init__(f"the cluster has {slots} task slots after round {round_done}")
        self.round, self.slots, self.workers = round_done, slots, workers


class _StageFailed(Exception):
    """One barrier stage failed: ``cause`` is the error to raise if it is not started again."""

    def __init__(self, cause: BaseException, fatal: bool):
        super().__init__(str(cause))
        self.cause, self.fatal = cause, fatal


class BarrierStage:
    """One barrier stage of a fit and the driver's side of its channel.

    Records go to ``history`` (and ``on_round``) as they arrive; ``latest`` keeps the newest
    global weights and strategy state rank 0 sent (what a restart starts from); on checkpoint
    rounds the ranks' solver states are gathered and the checkpoint written as soon as the
    round is complete. Its tasks ask for ``profile``'s resources (a worker's GPU share). It runs ``workers`` workers
    (default: the fit's; fewer after a host was lost for good, whose checkpoints then hold no worker's solver state,
    since those belong to the partitions the fit started with).
    """

    def __init__(self, run: EngineRun, history: list[dict], restart: int, profile=None, workers: int | None = None):
        self.fit, self.checkpoints, self.profile = run, run.checkpoints, profile
        self.workers = run.dist.workers if workers is None else workers
        self.history, self.restart = history, restart
        self.seen = {h["round"] for h in history}
        self.latest: ResumeState | None = None
        self.start: ResumeState | None = None
        """The state the stage started from (:meth:`run`'s)."""
        self.pending: dict[int, dict] = {}  # round -> {"state": ..., "workers": {rank: state}}
        self.states: StagePlan | None = None
        """Which rounds' states the stage's tasks send, once it runs (``None``: before it runs)."""
        self.held: dict[int, tuple[dict, float]] = {}
        """Round records whose round's state is due and not all in (a sharded replica's parts come from several
        ranks), and those after them: recorded once it is, so that a record in the history means its state is on the
        driver."""
        self.lost: set[int] = set()
        """Rounds whose state a rank could not send (the channel full): their records are not held for it."""
        self.errors: list[dict] = []
        self.ready_at: float | None = None
        """When rank 0 said every rank had started and joined the process group (``time.perf_counter()``)."""
        self.final: torch.Tensor | None = None
        """Rank 0's final weights, where they came over the channel."""
        self.grow_checked = 0
        """The newest round after which a stage of fewer workers asked whether the cluster has all their slots."""

    def _maybe_grow(self) -> None:
        """A stage that went on with fewer workers: once a round's state is in (its tasks between two rounds) and the
        cluster has the slots of more whole workers, at most the fit's, :class:`_Grow` (the stage is cancelled, and
        started again with them from that state). Asks Spark once a round."""
        fit, latest = self.fit, self.latest
        if (self.workers == fit.dist.workers or latest is None or latest.round <= self.grow_checked
                or latest.round not in self.seen):  # its record (whether the round was the last) comes after it
            return
        self.grow_checked = latest.round
        if any(h["round"] == latest.round and h.get("stop_reason") for h in self.history):
            return  # the stage is ending anyway
        slots = task_slots(fit.sc)
        more = 0 if slots is None else min(slots // fit.dist.procs_per_worker, fit.dist.workers)
        if more > self.workers:
            raise _Grow(latest.round, slots, more)

    def _record(self, msg: dict, now: float) -> None:
        if msg["round"] in self.seen:
            return
        took = float(msg.get("wall_s", 0.0)) - float(msg.get("start_s", 0.0))  # on the rank's clock
        msg["wall_s"] = now - self.fit.t_fit
        msg["start_s"] = msg["wall_s"] - took
        self.seen.add(msg["round"])
        self.history.append(msg)
        self.fit.emit(msg)

    def _handle(self, msg: dict, now: float) -> None:
        event = msg.get("event")
        if event == "error":
            self.errors.append(msg)
        elif event == "round":
            self.held[int(msg["round"])] = (msg, now)
            self._release()
        elif event == "state_lost":
            log.warning("rank %s could not send round %s's state to the driver (the channel was full): a restart "
                        "starts from an earlier round's", msg.get("rank"), msg["round"])
            self.lost.add(int(msg["round"]))
            self._release()
        elif event == "final" and "payload" in msg:
            weights = msg.pop("payload")
            if len(weights) != 4 * self.fit.global_flat.numel():
                raise EngineError(f"rank 0 sent {len(weights)} bytes of final weights; the net has "
                                  f"{self.fit.global_flat.numel()} float32 weights")
            self.final = torch.frombuffer(weights, dtype=torch.float32)  # the message's own bytes, not a copy
        elif event in ("state", "worker_state") and "payload" in msg:
            tree = unpack_tree(msg.pop("payload"), copy=False)  # the message's own bytes, kept as long as the state
            slot = self.pending.setdefault(int(msg["round"]), {"state": None, "workers": {}})
            if event == "state":
                if "parts" in msg and (tree := _join_parts(slot, msg, tree)) is None:
                    return  # a sharded replica's part; the others are still to come
                counters = {k: msg[k] for k in ("round", "steps_done", "samples_done", "total_bytes", "iteration")}
                state = ResumeState(**counters, global_flat=tree["global"], strategy=tree["strategy"],
                                    auto_tau=tree.get("auto_tau"), average=tree.get("average"),
                                    early_stop=msg.get("early_stop"), best=self._best(msg, tree))
                slot["state"] = state
                if self.latest is None or state.round >= self.latest.round:
                    self.latest = replace(state, workers={})
                self._release()
            else:
                slot["workers"][int(msg["rank"])] = tree
            self._maybe_checkpoint(int(msg["round"]))
            self._forget_old()

    def _best(self, msg: dict, tree: dict):
        """The best weights early stopping has scored, as of the state ``msg`` brings (``tree``): its own weights
        (or average) where its round is the best, else the best an earlier state brought (``None``: not known)."""
        best_round = (msg.get("early_stop") or {}).get("best_round")
        if best_round is None:
            return None
        if best_round == int(msg["round"]):
            return tree["average"] if "average" in tree else tree["global"]
        earlier = self.latest or self.start
        return earlier.best if earlier is not None and (earlier.early_stop or {}).get("best_round") == best_round \
            else None

    def _release(self) -> None:
        """Record the held round records in order, up to the first whose state is due and not in (a state lost on
        the way is passed by a later round's, or by its rank's word that it could not send it)."""
        for r in sorted(self.held):
            msg, now = self.held[r]
            latest = self.latest
            if self.states is not None and self.states.state_due(r, bool(msg.get("stop_reason"))) and (
                    latest is None or latest.round < r) and r not in self.lost:
                return
            del self.held[r]
            self._record(msg, now)
            self._maybe_checkpoint(r)  # the last round's: its states came before the record

    def _forget_old(self) -> None:
        """Drop the rounds behind :attr:`latest` that no checkpoint still waits for: each holds a copy of the
        weights, and a fit without checkpoints would otherwise keep one for every round it ran."""
        cp = self.checkpoints
        if self.latest is not None:
            for r in [r for r in self.pending if r < self.latest.round and (cp is None or not cp.due(r)
                                                                          or r in cp.written)]:
                del self.pending[r]

    def _assembled(self, r: int) -> bool:
        """Whether round ``r``'s checkpoint has every state it is made of (or is written, or none is kept, or a rank
        said its state was lost)."""
        if self.checkpoints is None or r in self.checkpoints.written or r in self.lost:
            return True
        slot = self.pending.get(r)
        return slot is not None and slot["state"] is not None and \
            len(slot["workers"]) >= sum(1 for n in self.fit.rows if n > 0)

    def _maybe_checkpoint(self, r: int) -> None:
        slot = self.pending.get(r)
        if slot is None or slot["state"] is None:
            return
        ranks_with_data = sum(1 for n in self.fit.rows if n > 0)
        if self.latest is not None and self.latest.round == r and len(slot["workers"]) == ranks_with_data:
            self.latest.workers = slot["workers"]  # a restart from here is exact
        cp = self.checkpoints
        final = any(h["round"] == r and h.get("stop_reason") for h in self.history)
        if cp is None or not (cp.due(r) or final) or len(slot["workers"]) < ranks_with_data or r in cp.written:
            return
        kept = slot["workers"] if self.workers == self.fit.dist.workers else {}
        path = self.fit.save_checkpoint("barrier", replace(slot["state"], workers=kept))
        for h in self.history:
            if h["round"] == r:
                h["checkpoint"] = path
        for old in [k for k in self.pending if k <= r]:
            del self.pending[old]

    def run(self, start: ResumeState):
        self.start = start
        run = self.fit
        sc, group, spec, dist, opts = run.sc, run.group, run.spec, run.dist, run.options
        K = self.workers * dist.procs_per_worker
        local, host = run.driver_address()
        # the largest message: a rank's solver and strategy state, or the global weights with the strategy's state
        cap = run.state_bytes()
        receiver = MetricsReceiver(host, host, max_bytes=cap, max_frames=1 + STATE_PARTS, local=local)
        outcome: dict = {}
        clock = {"ready": None, "heard": time.perf_counter()}
        store = None
        try:
            # on one machine the ranks' rendezvous store is here: rank 0's would need Spark's allGather to tell its
            # port (a second). On a cluster it stays on rank 0's executor: torch's store listens on every interface,
            # and the driver listens on its Spark address only
            store = TCPStore(host, 0, K, True, timeout=timedelta(seconds=opts.rendezvous_timeout_s),
                             wait_for_workers=False) if local else None
            flat, begin = start.global_flat, replace(start, global_flat=None)
            parts = ()
            if dist.shard_replica or run.split is not None:  # each rank of a sharded or split replica gets its own
                parts = tuple(sc.broadcast(part) for part in _cut_parts(run, start))  # part of the state, no more
                flat, begin = None, replace(begin, strategy=None, average=None, best=None)
                run.broadcasts.extend(parts)
            payload_bc = sc.broadcast((pack_spec(spec), None if flat is None else np.asarray(flat, dtype=np.float32),
                                       begin))
            run.broadcasts.append(payload_bc)
            val_bc = None
            if run.validation is not None:
                val_bc = sc.broadcast(run.validation)
                run.broadcasts.append(val_bc)
            params = StagePlan(
                group=GroupPlan(workers=K, local=local, rendezvous_timeout_s=opts.rendezvous_timeout_s,
                                collective_timeout_s=opts.collective_timeout_s, procs_per_worker=dist.procs_per_worker,
                                shard_replica=dist.shard_replica, split=run.split, model_parallel=dist.model_parallel,
                                store=None if store is None else f"{host}:{store.port}"),
                fit=run.plan.without_state(), endpoint=receiver.endpoint, channel_bytes=cap, keys=receiver.client_keys,
                restart=self.restart, state_every_rounds=opts.state_every_rounds,
                checkpoint_every=self.checkpoints.every if self.checkpoints is not None else None,
                streaming=dist.streaming(), staged=run.source is not run.chunks, parts=parts)
            self.states = params
            stage = with_profile(run.source.barrier().mapPartitionsWithIndex(run_barrier(payload_bc, params, val_bc)),
                                 self.profile)
            silence = opts.driver_timeout_s or (opts.collective_timeout_s + (dist.round_seconds or 0) + 60)

            def listen() -> str | None:
                """Drain the channel while the stage runs; a reason to cancel it when it is silent too long."""
                while (msg := receiver.recv(0.0)) is not None:
                    clock["heard"] = time.perf_counter()
                    if msg.get("event") == "ready":
                        clock["ready"] = clock["heard"]
                    else:
                        self._handle(msg, clock["heard"])
                self._maybe_grow()
                limit = opts.rendezvous_timeout_s if clock["ready"] is None else silence
                if time.perf_counter() - clock["heard"] <= limit:
                    return None
                what = ("the barrier tasks did not all start and join the process group" if clock["ready"] is None
                        else "the barrier stage sent no round record")
                return (f"stopped: {what} within {limit:.0f} s; the stage needs {K} free task slots at once and every "
                        "worker alive (see the executor logs)")

            try:
                outcome["rows"] = run_with_deadline(sc, group, _stage_name(dist, self.workers), stage.collect,
                                                    timeout_s=None, what="the barrier stage", stalled=listen,
                                                    poll_s=0.05)
            except DeadlineExceeded as exc:
                if self.restart == 0 or clock["ready"] is not None:
                    raise
                # a stage started again whose tasks never all started: Spark still counted a slot on a host that is
                # gone (it notices a host lost without a word only at spark.network.timeout); the engine counts
                # the slots again, and goes on with fewer workers where they are short
                outcome["error"], outcome["not_started"] = exc, True
            except EngineError as exc:  # the stage failed: the raw Spark error, to name the rank that failed first
                outcome["error"] = exc.__cause__ if exc.__cause__ is not None else exc
            while (msg := receiver.recv(0.5 if "error" in outcome else 0.0)) is not None:
                self._handle(msg, time.perf_counter())  # records that raced the end of the stage
            result = [r for r in outcome.get("rows") or [] if r[0] == "result" and not r[2]]
            if result:
                # rank 0 sent its final weights over the channel, or a sharded replica's ranks sent them in parts as
                # the last round's state; and every rank its last round's state, which its checkpoint is made of:
                # they may still be on their way
                last = max((h["round"] for h in result[0][3]), default=0)
                deadline = time.perf_counter() + opts.collective_timeout_s
                while (self.final is None or not self._assembled(last)) and \
                        (left := deadline - time.perf_counter()) > 0:
                    if self.final is None and parts and self.latest is not None and self.latest.round >= last:
                        self.final = torch.as_tensor(self.latest.returned(run.plan), dtype=torch.float32)
                    elif (msg := receiver.recv(min(1.0, left))) is not None:
                        self._handle(msg, time.perf_counter())
        finally:
            receiver.close()
            store = None  # its server stops with it
            self.ready_at = clock["ready"]
        if outcome.get("not_started"):
            raise _StageFailed(outcome["error"], fatal=False)
        if "error" in outcome:
            # the rank that failed first on its own, not a peer whose collective broke because of it
            first = sorted(self.errors, key=lambda e: (bool(e.get("collective")), e.get("time", 0.0)))
            # a rank whose Python worker crashed reported nothing: its peers' broken collectives are not the cause
            crash = None if first and not first[0].get("collective") else worker_crash(
                outcome["error"], spark_setting(sc, "spark.executor.pyspark.memory"))
            cause = crash or (task_error(first[0]["text"]) if first else task_error(outcome["error"]))
            fatal = any(e.get("fatal") for e in self.errors) or isinstance(crash, WorkerOutOfMemory)
            raise _StageFailed(cause, fatal) from outcome["error"]
        final, full_history, workers = _stage_result(outcome.get("rows") or [], self.final)
        if final is None:
            raise EngineError("rank 0 sent its final weights over the driver's channel and they did not arrive "
                              f"within {opts.collective_timeout_s:g} s (--collective-timeout)")
        for r in sorted(self.held):  # the stage ended well: its rounds count whatever state the channel lost
            self._record(*self.held.pop(r))
        for rec in full_history:  # records the channel did not deliver
            self._record(rec, time.perf_counter())
        if self.checkpoints is not None:
            last_round = max((h["round"] for h in self.history), default=0)
            self._maybe_checkpoint(last_round)
            if last_round not in self.checkpoints.written:
                raise EngineError(f"the barrier stage ended but the final checkpoint of round {last_round} could not "
                                  "be assembled (some ranks' solver states did not reach the driver)")
        return final, {"barrier_workers": workers, "metrics_rejected": receiver.rejected}


def _cut_parts(run: EngineRun, start: ResumeState) -> list[dict]:
    """A sharded or split replica's starting state in the parts its ranks hold (:meth:`~sparknet.net.Net.
    cut_layouts`): the global weights, the strategy's flat state, the weights' moving average and early stopping's
    best weights, each cut."""
    dist, net = run.dist, run.driver_net
    whole = torch.as_tensor(start.global_flat, dtype=torch.float32)
    average, best = (None if flat is None else torch.as_tensor(np.asarray(flat, np.float32))
                     for flat in (start.average, start.best))
    split = None if run.split is None else (dist.model_parallel, split_dims(net.module, dist.model_parallel, run.split))
    layouts = net.cut_layouts(split, dist.procs_per_worker // dist.model_parallel if dist.shard_replica else 1)
    return [{"layout": layout, **cut_state({"global": whole, "average": average, "best": best}, whole.numel(), layout),
             "strategy": None if start.strategy is None else cut_state(start.strategy, whole.numel(), layout)}
            for layout in layouts]


def _join_parts(slot: dict, msg: dict, tree: dict) -> dict | None:
    """A sharded or split replica's state: each rank of its first worker sends its part of the global weights and of
    the strategy's flat state (``msg["layout"]``: which rows of every weight); joined into the whole once all are
    in."""
    parts = slot.setdefault("parts", {})
    parts[int(msg["part"])] = (tree, msg["layout"])
    if len(parts) < int(msg["parts"]):
        return None
    trees, layouts = zip(*(parts.pop(j) for j in sorted(parts)))

    def join(values):
        return join_shards(list(values), layouts)

    first = trees[0]
    sizes = [t["global"].numel() for t in trees]
    strategy = {k: join(t["strategy"][k] for t in trees)
                if isinstance(v, torch.Tensor) and [t["strategy"][k].numel() for t in trees] == sizes else v
                for k, v in first["strategy"].items()}
    return {**first, "global": join(t["global"] for t in trees), "strategy": strategy,
            **({"average": join(t["average"] for t in trees)} if "average" in first else {})}


def _stage_name(dist, workers: int | None = None) -> str:
    """The stage's Spark job description: its workers (default: the fit's), and the processes each is made of."""
    each = f" of {dist.procs_per_worker} processes" if dist.procs_per_worker > 1 else ""
    return f"sparknet barrier stage ({dist.workers if workers is None else workers} workers{each})"


def _stage_result(rows: list, sent: torch.Tensor | None = None) -> tuple[torch.Tensor | None, list[dict], list[dict]]:
    """Rank 0's final weights and round records, and every rank's facts, from a stage's rows
    ``(kind, rank, payload, info)`` (:data:`~sparknet.spark.barrier.executor.RESULT_SCHEMA`); where rank 0 sent the
    weights over the channel, ``sent`` (``None``: they did not come)."""
    results = [row for row in rows if row[0] == "result"]
    if not results:
        raise EngineError("the barrier stage ended without rank 0's result")
    final = torch.from_numpy(np.frombuffer(results[0][2], dtype=np.float32).copy()) if results[0][2] else sent
    workers = sorted((info | {"rank": rank} for kind, rank, _, info in rows if kind == "worker"),
                     key=lambda w: w["rank"])
    return final, results[0][3], workers


def connect_refusal(dist, train) -> str | None:
    """Why this fit cannot run from a Spark Connect session, or ``None`` when it can.

    Such a session has DataFrames and ``mapInArrow(..., barrier=True)`` but no SparkContext, RDDs,
    broadcasts or way for the executors to reach the client: the barrier engine runs as one barrier stage
    whose weights travel in its plan and whose results come back as rows (:func:`run_connect_stage`).
    What needs more than that is refused here, before anything runs."""
    if not is_dataframe(train):
        return f"the training data is a {type(train).__name__}; a Spark Connect session trains on a DataFrame"
    if dist.engine is not Engine.BARRIER:
        return ("the rounds engine keeps each worker's state on its executor between one Spark job per round and "
                "sends the weights by broadcast, which a Spark Connect session has no way to do; train with "
                "engine='barrier' (--engine barrier), which runs the whole fit as one barrier stage")
    if dist.checkpoint_dir or dist.resume:
        return ("checkpoints are assembled on the driver from states the barrier stage sends over a socket the "
                "executors open to it, and a Spark Connect client cannot be reached; train without checkpoint_dir "
                "and resume, or from a classic session")
    if dist.warmup_steps:
        return ("warmup_steps trains on a sample of the data collected through an RDD, which a Spark Connect "
                "session does not have; train without warm-up steps")
    return None


def run_connect_stage(run: EngineRun):
    """The barrier engine's fit from a Spark Connect session: one ``mapInArrow(..., barrier=True)`` stage.

    ``run.chunks`` is :func:`~sparknet.spark.data.chunk_frame`'s DataFrame, one partition a worker. The packed spec,
    the starting weights and the validation data travel in the stage's plan; rank 0 returns the final weights
    and every round record as rows. Nothing reaches the client while the stage runs (the executors may not be
    able to reach it), so the records go to ``on_round`` when the stage ends, each with ``wall_s`` counted from
    the fit's start to the stage's launch plus rank 0's own time since its round loop began (its setup left
    out). A stage that fails is started again from the fit's first round, at most ``max_restarts`` times; the
    ranks bound every wait of theirs (``rendezvous_timeout_s``, ``collective_timeout_s``), and
    ``driver_timeout_s``, when set, bounds the whole stage.
    """
    spark, group, spec, dist, opts = run.sc, run.group, run.spec, run.dist, run.options
    K = dist.ranks
    payload = Held((pack_spec(spec), np.asarray(run.global_flat, dtype=np.float32), ResumeState()))
    val = Held(run.validation) if run.validation is not None else None
    params = StagePlan(
        group=GroupPlan(workers=K, local=is_local_master(session_master(spark)),
                        rendezvous_timeout_s=opts.rendezvous_timeout_s, collective_timeout_s=opts.collective_timeout_s,
                        procs_per_worker=dist.procs_per_worker, shard_replica=dist.shard_replica, split=run.split,
                        model_parallel=dist.model_parallel),
        fit=run.plan, streaming=dist.streaming())
    float_labels = spec.task.float_labels or spec.weighted
    profile, gpus = gpu_profile(spark, spec.worker.gpus_per_worker, workers=K, procs=dist.procs_per_worker)
    restarts: list[dict] = []
    while True:
        stage = run.chunks.mapInArrow(run_barrier_frame(payload, replace(params, restart=len(restarts)), val,
                                                    float_labels), RESULT_SCHEMA, barrier=True, profile=profile)
        t_launch = time.perf_counter()
        try:
            rows = run_with_deadline(spark, group, _stage_name(dist), stage.collect,
                                     timeout_s=opts.driver_timeout_s, what="the barrier stage")
            break
        except DeadlineExceeded:
            raise
        except EngineError as exc:
            text = f"{exc}\n{exc.__cause__ or ''}"
            fatal = NonFiniteUpdate.__name__ in text or isinstance(exc, WorkerOutOfMemory)  # a restart would diverge,
            if fatal or len(restarts) >= opts.max_restarts:  # or run out of memory, the same way
                raise
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            restarts.append({"after_round": 0, "error": first_line})
            log.warning("barrier stage failed (%s); restart %d of at most %d from the first round (a Spark Connect "
                        "client holds no newer state)", first_line, len(restarts), opts.max_restarts)
    final, history, workers = _stage_result([(row["kind"], int(row["rank"]), row["payload"], json.loads(row["info"]))
                                             for row in rows])
    for record in history:
        for key in ("wall_s", "start_s"):
            record[key] = (t_launch - run.t_fit) + float(record.get(key, 0.0))
        run.emit(record)
    return final, history, {"barrier_workers": workers, "restarts": len(restarts), "restart_log": restarts,
                            "connect": True, "gpu_scheduling": gpus}
