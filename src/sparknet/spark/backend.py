"""The one Spark backend of the engines: job groups, deadlines, watchdogs, worker-error decoding.

Every Spark job sparknet starts (the rounds and barrier engines, model parallelism, the parameter server's
session, ``sparknet doctor``) runs through here: under a job group the caller's own is given back after
(:func:`job_group`), waited for at most a deadline (:func:`run_with_deadline`, :class:`Watchdog`), with a failed
job's text turned back into the :class:`~sparknet.errors.WorkerError` a worker raised (:func:`task_error`).

Nothing here imports pyspark: ``sc`` is the caller's ``SparkContext``.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from typing import TypeVar

from sparknet.errors import DeadlineExceeded, EngineError, WorkerError, WorkerOutOfMemory
from sparknet.spark.session import (executor_slots, is_connect, local_slots, parse_memory, session_master,
                                   session_parallelism)

__all__ = ["job_group", "run_with_deadline", "cancel_group", "task_error", "worker_crash", "spark_call", "Watchdog",
           "default_round_deadline", "check_barrier_slots", "task_slots", "quietly", "python_workers_starting"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_WORKER_RE = re.compile(r"\[sparknet-worker (\d+)\] ([^\n]*)")
_TAIL_RE = re.compile(r"\[sparknet-tail\]\n(.*?)\[sparknet-end\]", re.S)
_JOB_PROPERTIES = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")
CANCEL_GRACE_S = 30.0
"""Longest wait for a cancelled action's thread to return before it is left behind (a daemon)."""
_POLL_S = 1.0


@contextmanager
def job_group(sc, group: str, description: str):
    """Run this thread's Spark jobs under ``group`` with ``description``.

    The jobs are cancelled if the driver is interrupted (``KeyboardInterrupt``, ``SystemExit``).
    On exit the thread's job group, description and interrupt-on-cancel setting are what they
    were on entry: the caller's own, or none. ``sc`` may be a Spark Connect session: the group is
    then a tag on the thread's operations (``addTag``), cancelled with ``interruptTag``.
    """
    if is_connect(sc):  # a Spark Connect session: this thread's operations carry the group as a tag
        sc.addTag(group)
        restore = partial(sc.removeTag, group)
    else:
        saved = {key: sc.getLocalProperty(key) for key in _JOB_PROPERTIES}
        sc.setJobGroup(group, description, interruptOnCancel=True)

        def restore():
            for key, value in saved.items():
                sc.setLocalProperty(key, value)
    try:
        yield
    except BaseException as exc:
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: stop what runs on the cluster
            cancel_group(sc, group)
        raise
    finally:
        restore()


def check_barrier_slots(sc, workers: int, what: str) -> None:
    """``ValueError`` unless ``sc`` has a task slot for each of ``workers`` barrier tasks (``what`` runs them)."""
    master = session_master(sc)
    slots = local_slots(master) or session_parallelism(sc)
    if workers > slots:
        raise ValueError(f"{what} runs all {workers} workers at once but {master} has {slots} task slots; "
                         f"use at most {slots} workers or a bigger cluster")


def task_slots(sc) -> int | None:
    """Tasks the cluster can run at once now (executors lost are not counted); ``None`` if Spark cannot say."""
    slots = local_slots(session_master(sc))
    if slots is not None or is_connect(sc):
        return slots
    try:
        jsc = sc._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # an internal Spark method: a version without it gives no count
        log.debug("could not count the cluster's task slots", exc_info=True)
        return None


def empty_job_s(spark, repeats: int = 20, warmup: int = 5) -> float:
    """Median seconds of an empty Python job on two cached partitions (Spark's floor for one round)."""
    import statistics

    rdd = spark.sparkContext.parallelize(range(2), 2).cache()
    try:
        rdd.count()
        times = []
        for _ in range(warmup + repeats):
            t = time.perf_counter()
            rdd.map(lambda v: v).collect()
            times.append(time.perf_counter() - t)
        return statistics.median(times[warmup:])
    finally:
        rdd.unpersist()


START_WORKERS_TIMEOUT_S = 120.0
"""Longest a fresh session's Python workers may take to start (:func:`python_workers_starting`) before the job
that starts them is cancelled."""


def _no_rows(rows):
    return iter(())


def start_python_workers(sc, group: str | None = None) -> None:
    """Start the session's Python workers: one empty task an executor, as a job under ``group`` (default a group of
    its own), waited for; its failure is logged, never raised (the fit's jobs would meet the same problem and say
    so). A fresh session has no Python daemon yet: the first Python task of each executor waits for one to start
    (and, where none was loaded ahead, to import torch and sparknet: seconds)."""
    master = session_master(sc)
    slots, per_executor = local_slots(master), executor_slots(master)
    executors = slots // per_executor if slots and per_executor else session_parallelism(sc)
    try:
        with job_group(sc, group or f"sparknet-start-workers-{uuid.uuid4().hex[:12]}",
                       "sparknet: start the Python workers"):
            sc.parallelize(range(executors), executors).mapPartitions(_no_rows).count()
    except Exception as exc:  # cancelled, or a problem the fit's jobs will report
        log.debug("starting the Python workers: %s", exc)


@contextmanager
def python_workers_starting(sc, *, timeout_s: float = START_WORKERS_TIMEOUT_S):
    """Run the block while a background job starts the session's Python workers on every executor
    (:func:`start_python_workers`; its job group, given to the block, is ``None`` over Spark Connect), so that the
    fit's first Python job finds the daemon up while the driver reads and plans the training data. On leaving the
    block the job is waited for at most what is left of ``timeout_s`` (not at all when the block raised), then
    cancelled. Nothing runs over Spark Connect (no RDDs there).
    """
    if is_connect(sc):
        yield None
        return
    group = f"sparknet-start-workers-{uuid.uuid4().hex[:12]}"
    done = threading.Event()

    def start() -> None:
        try:
            start_python_workers(sc, group)
        finally:
            done.set()

    thread = threading.Thread(target=start, name=group, daemon=True)
    t0 = time.monotonic()
    thread.start()
    failed = True
    try:
        yield group
        failed = False
    finally:  # a block that failed does not wait for the workers
        if failed or not done.wait(max(0.0, timeout_s - (time.monotonic() - t0))):
            cancel_group(sc, group)
        thread.join(CANCEL_GRACE_S)


class Held:
    """A value carried in the task's closure and read as a broadcast is (``.value``): what a stage started from a
    Spark Connect session, which has no broadcasts, ships its weights, validation data and models in."""

    def __init__(self, value):
        self.value = value


def quietly(fn: Callable[[], object]) -> None:
    """Call ``fn``, a cleanup step (an unpersist, a broadcast's destroy): a failure is logged, never raised."""
    try:
        fn()
    except Exception as exc:  # pragma: no cover - cleanup must not hide the outcome
        log.debug("cleanup step failed: %s", exc)


def run_with_deadline(sc, group: str, description: str, action: Callable[[], T], *, timeout_s: float | None,
                      what: str, stalled: Callable[[], str | None] | None = None, poll_s: float = _POLL_S) -> T:
    """``action()``'s value: it runs Spark jobs under ``group`` in a daemon thread (:func:`job_group`), waited for at
    most ``timeout_s`` seconds (``None`` only where the user asked for no deadline).

    ``stalled`` is asked every ``poll_s`` seconds while the action runs (it may do the caller's own listening, e.g.
    drain a channel); a reason it returns ends the wait as the deadline would: the group's jobs are cancelled, the
    thread is given :data:`CANCEL_GRACE_S` to return (else it is left behind) and
    :class:`~sparknet.errors.DeadlineExceeded` names ``what`` (``"epoch 3"``) and the tasks that had not finished.
    An interrupt of the waiting thread cancels the group the same way and propagates. A failed action raises the
    :class:`~sparknet.errors.WorkerError` or ``EngineError`` :func:`task_error` decodes; ``ValueError``,
    ``TypeError`` and sparknet's own errors propagate as they are.
    """
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s}")
    outcome: dict = {}

    def run() -> None:
        try:
            with job_group(sc, group, description):
                outcome["value"] = action()
        except BaseException as exc:  # handed to the waiting thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"{group}-action", daemon=True)
    t0 = time.monotonic()
    thread.start()
    reason = None
    try:
        while thread.is_alive():
            left = None if timeout_s is None else timeout_s - (time.monotonic() - t0)
            if left is not None and left <= 0:
                reason = f"did not finish within {timeout_s:g} s"
                break
            thread.join(poll_s if left is None else min(poll_s, left))
            if thread.is_alive() and stalled is not None:
                reason = stalled()
                if reason:
                    break
    except BaseException:  # KeyboardInterrupt while waiting: stop what runs on the cluster
        cancel_group(sc, group)
        thread.join(CANCEL_GRACE_S)
        raise
    if reason is not None:
        unfinished = _describe_unfinished(sc, group)
        log.error("%s %s; cancelling its Spark jobs", what, reason)
        cancel_group(sc, group)
        thread.join(CANCEL_GRACE_S)
        if thread.is_alive():
            log.warning("the thread of %s did not return within %g s of the cancel; left behind", what, CANCEL_GRACE_S)
        raise DeadlineExceeded(f"{what} {reason}; its Spark jobs were cancelled ({unfinished})")
    if "error" in outcome:
        exc = outcome["error"]
        if isinstance(exc, (ValueError, TypeError, EngineError)) or not isinstance(exc, Exception):
            raise exc
        raise task_error(exc) from exc
    return outcome["value"]


def cancel_group(sc, group: str) -> None:
    """Cancel every running job of ``group`` (best effort: an error here must not hide the caller's)."""
    try:
        if is_connect(sc):
            sc.interruptTag(group)
        else:
            sc.cancelJobGroup(group)
    except Exception:  # pragma: no cover - best effort: the caller's error matters more
        log.debug("could not cancel job group %s", group, exc_info=True)


def task_error(exc: BaseException | str) -> EngineError:
    """A failed Spark job (or a worker's own report) as a WorkerError with rank and traceback tail."""
    text = str(exc)
    m = _WORKER_RE.search(text)
    if m:
        tail = _TAIL_RE.search(text)
        message = m.group(2).strip()
        kind = WorkerOutOfMemory if message.startswith(WorkerOutOfMemory.MARK) else WorkerError
        return kind(message, rank=int(m.group(1)), log_tail=tail.group(1).strip() if tail else "")
    if crash := worker_crash(text):
        return crash
    # Py4J's first line names only the Java call ("An error occurred while calling z:...collectAndServe."); Spark's
    # reason follows it ("org.apache.spark.SparkException: Job aborted due to stage failure: ...")
    lines = [ln.removeprefix(": ") for ln in text.splitlines()
             if ln.strip() and not ln.startswith("An error occurred while calling")][:6]
    return EngineError("Spark job failed: " + "\n".join(lines))


_CRASH_RE = re.compile(r"(?:ResultTask\(\d+, (\d+)\)|task (\d+)\.\d+ in stage).*?Python worker exited unexpectedly "
                       r"\(crashed\)(?::\s*([^\n]*))?", re.S)


def worker_crash(error: BaseException | str, memory_cap: str | None = None) -> WorkerError | None:
    """A failed Spark job whose task's Python worker crashed (it could not report), as that task's worker's failure;
    ``None`` where ``error`` says nothing of a crash. Under a cap on each Python worker's memory (``memory_cap``:
    ``spark.executor.pyspark.memory``, which Spark applies as an address-space limit), a
    :class:`~sparknet.errors.WorkerOutOfMemory`: a native thread or allocation that cannot get memory there aborts
    the process (ZeroMQ's and torch's do), and a restart would crash the same way."""
    m = _CRASH_RE.search(str(error))
    if m is None:
        return None
    rank, how = int(m.group(1) or m.group(2)), (m.group(3) or "").strip() or "no Python traceback"
    stacks = []  # the threads' stacks Python's fault handler wrote (Spark's own stack follows them)
    for line in str(error)[m.end():].splitlines()[:60]:
        if line.startswith(("\tat ", "org.apache.spark")):
            break
        stacks.append(line)
    tail = "\n".join(stacks).strip()
    if memory_cap is None:
        return WorkerError(f"its Python worker crashed ({how})", rank=rank, log_tail=tail)
    return WorkerOutOfMemory(f"{WorkerOutOfMemory.MARK}, most likely: its Python worker crashed ({how}) "
                             f"{WorkerOutOfMemory.UNDER_CAP} {parse_memory(memory_cap) / 2**20:,.0f} MiB that "
                             "spark.executor.pyspark.memory "
                             "puts on its address space, where a thread or a native allocation that cannot get memory "
                             "aborts the process", rank=rank, log_tail=tail)


def spark_call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` (a Spark action) with a failed job's error decoded by :func:`task_error`."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError, EngineError):
        raise
    except Exception as exc:
        raise task_error(exc) from exc


def _describe_unfinished(sc, group: str) -> str:
    """The tasks of ``group``'s active jobs that have not finished, in words (for a deadline error)."""
    if is_connect(sc):
        return "a Spark Connect client cannot list the unfinished tasks; see the Spark UI"
    parts = []
    try:
        tracker = sc.statusTracker()
        for job_id in tracker.getJobIdsForGroup(group):
            job = tracker.getJobInfo(job_id)
            if job is None or job.status != "RUNNING":
                continue
            for stage_id in job.stageIds:
                stage = tracker.getStageInfo(stage_id)
                if stage is None or stage.numCompletedTasks >= stage.numTasks:
                    continue
                running = _running_partitions(sc, stage_id, stage.currentAttemptId)
                where = f"partitions {running} still running" if running else f"{stage.numActiveTasks} running"
                parts.append(f"{stage.numTasks - stage.numCompletedTasks} of {stage.numTasks} tasks of stage "
                             f"{stage_id} not finished ({where})")
    except Exception as exc:  # pragma: no cover - the cancel matters more than the words
        return f"could not list the unfinished tasks: {exc}"
    return "; ".join(parts) or "no task left running"


def _running_partitions(sc, stage_id: int, attempt: int) -> list[int]:
    """Partition indices of a stage's running tasks, from the JVM's status store (empty if unavailable)."""
    try:
        seq = sc._jsc.sc().statusStore().taskList(stage_id, attempt, 100_000)
        return sorted({int(seq.apply(i).index()) for i in range(seq.size()) if seq.apply(i).status() == "RUNNING"})
    except Exception:  # pragma: no cover - an internal API; the counts still say enough
        return []


FIRST_ROUND_DEADLINE_S = 1800.0
MIN_ROUND_DEADLINE_S = 600.0


def default_round_deadline(step_s: float | None, steps: int, seconds: float | None = None) -> float:
    """The rounds engine's deadline for a round of at most ``steps`` local steps and ``seconds`` seconds.

    ``step_s`` is the slowest seconds per local step of the rounds so far (``None`` before the
    first): a round may take 20 times as long as the slowest so far before it counts as hung. A
    time-budgeted round (``steps`` unbounded) counts the steps its ``seconds`` allow, not a step
    count no worker will reach.
    """
    if step_s is None:
        return FIRST_ROUND_DEADLINE_S
    if seconds is not None and step_s > 0:
        steps = min(steps, max(1, math.ceil(seconds / step_s)))
    return max(MIN_ROUND_DEADLINE_S, 20.0 * step_s * max(steps, 1))


class Watchdog:
    """Cancels ``group``'s jobs when one round's wait passes ``timeout_s`` (no deadline when None)."""

    def __init__(self, sc, group: str, timeout_s: float | None):
        self.sc, self.group, self.timeout_s = sc, group, timeout_s
        self.unfinished: str | None = None
        self._timer: threading.Timer | None = None

    def _fire(self) -> None:
        self.unfinished = _describe_unfinished(self.sc, self.group)
        cancel_group(self.sc, self.group)

    def __enter__(self):
        if self.timeout_s is not None:
            # threading caps its waits (TIMEOUT_MAX); a longer one would raise in the timer's thread
            self._timer = threading.Timer(min(self.timeout_s, threading.TIMEOUT_MAX), self._fire)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc):
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join(CANCEL_GRACE_S)

    @property
    def fired(self) -> bool:
        return self.unfinished is not None
