"""The one Spark backend of the engines: job groups, deadlines, watchdogs, worker-error decoding.

Every Spark job sparknet starts (the rounds and barrier engines, model parallelism, the
parameter server's session, ``sparknet doctor``) runs through here:

- :func:`job_group` runs jobs under a group and description, cancels them when the driver is
  interrupted, and gives the caller's own group back afterwards;
- :class:`Watchdog` cancels a group's jobs when one wait passes its deadline;
- :func:`task_error` turns a failed job's text back into the :class:`~sparknet.errors.WorkerError`
  a worker raised through :func:`sparknet.spark._rounds.worker_failure` (rank and log tail), and
  :func:`spark_call` applies it to one Spark action.
"""

from __future__ import annotations

import logging
import re
import threading
from contextlib import contextmanager

from sparknet.errors import EngineError, WorkerError

__all__ = ["job_group", "task_error", "spark_call", "Watchdog", "default_round_deadline"]

log = logging.getLogger(__name__)

_WORKER_RE = re.compile(r"\[sparknet-worker (\d+)\] ([^\n]*)")
_TAIL_RE = re.compile(r"\[sparknet-tail\]\n(.*?)\[sparknet-end\]", re.S)


@contextmanager
def job_group(sc, group: str, description: str):
    """Run Spark jobs under ``group`` with ``description``; cancel them if the driver is interrupted;
    clear both afterwards."""
    sc.setJobGroup(group, description, interruptOnCancel=True)
    try:
        yield
    except BaseException as exc:
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: stop what runs on the cluster
            try:
                sc.cancelJobGroup(group)
            except Exception:  # pragma: no cover - best effort
                pass
        raise
    finally:
        for key in ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel"):
            sc.setLocalProperty(key, None)


def task_error(exc: BaseException | str) -> EngineError:
    """A failed Spark job (or a worker's own report) as a WorkerError with rank and traceback tail."""
    text = str(exc)
    m = _WORKER_RE.search(text)
    if m:
        tail = _TAIL_RE.search(text)
        return WorkerError(m.group(2).strip(), rank=int(m.group(1)), log_tail=tail.group(1).strip() if tail else "")
    lines = [ln for ln in text.splitlines() if ln.strip()][:6]
    return EngineError("Spark job failed: " + "\n".join(lines))


def spark_call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError, EngineError):
        raise
    except Exception as exc:
        raise task_error(exc) from exc


def _unfinished_tasks(sc, group: str) -> str:
    """The tasks of ``group``'s active jobs that have not finished, in words (for a deadline error)."""
    tracker = sc.statusTracker()
    parts = []
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


def default_round_deadline(step_s: float | None, steps: int) -> float:
    """The rounds engine's deadline for a round of ``steps`` when the user set none.

    ``step_s`` is the slowest seconds per local step of the rounds so far (``None`` before the
    first): a round may take 20 times as long as the slowest so far before it counts as hung.
    """
    if step_s is None:
        return FIRST_ROUND_DEADLINE_S
    return max(MIN_ROUND_DEADLINE_S, 20.0 * step_s * max(steps, 1))


class Watchdog:
    """Cancels ``group``'s jobs when one round's wait passes ``timeout_s`` (no deadline when None)."""

    def __init__(self, sc, group: str, timeout_s: float | None):
        self.sc, self.group, self.timeout_s = sc, group, timeout_s
        self.unfinished: str | None = None
        self._timer: threading.Timer | None = None

    def _fire(self) -> None:
        try:
            self.unfinished = _unfinished_tasks(self.sc, self.group)
        except Exception as exc:  # pragma: no cover - the cancel matters more than the words
            self.unfinished = f"(could not list them: {exc})"
        self.sc.cancelJobGroup(self.group)

    def __enter__(self):
        if self.timeout_s is not None:
            self._timer = threading.Timer(self.timeout_s, self._fire)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc):
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join(timeout=30)

    @property
    def fired(self) -> bool:
        return self.unfinished is not None
