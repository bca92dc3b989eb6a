"""Exceptions raised by sparknet.

Bad arguments raise the built-in ``ValueError`` (or ``TypeError``); the classes here
describe failures of a network definition, of a data set, or of a distributed run.
Every class pickles with its fields intact, so an error raised inside a Spark task
reaches the driver whole.
"""

from __future__ import annotations

__all__ = [
    "SparkNetError",
    "GraphError",
    "DatasetError",
    "EngineError",
    "WorkerError",
    "WorkerOutOfMemory",
    "DeadlineExceeded",
    "NonFiniteUpdate",
]


class SparkNetError(Exception):
    """Base class of every sparknet error."""


class GraphError(SparkNetError, ValueError):
    """A network definition is wrong: unknown bottom, cycle, shape mismatch, bad option.

    ``layer`` names the layer at fault (``None`` when the fault is not one layer's).
    """

    def __init__(self, message: str, layer: str | None = None):
        super().__init__(message)
        self.layer = layer

    def __reduce__(self):
        return (type(self), (self.args[0], self.layer))


class DatasetError(SparkNetError):
    """A data set is missing, corrupt or cannot be fetched; the message says how to fix it."""


class EngineError(SparkNetError):
    """A distributed run failed as a whole (a Spark job, a process group, a server)."""


class WorkerError(EngineError):
    """One worker failed. Carries its rank and the tail of its log."""

    def __init__(self, message: str, rank: int | None = None, log_tail: str = ""):
        full = message if rank is None else f"worker {rank}: {message}"
        if log_tail:
            full = f"{full}\n--- last lines of worker {rank} ---\n{log_tail}"
        super().__init__(full)
        self.rank = rank
        self.log_tail = log_tail
        self._message = message

    def __reduce__(self):
        return (type(self), (self._message, self.rank, self.log_tail))


class WorkerOutOfMemory(WorkerError, MemoryError):
    """A worker's process could not get the memory it asked for: past the cap Spark puts on each Python worker
    (``spark.executor.pyspark.memory``), or on its GPU. The message says what the process held and how to make each
    process hold less; a restart would run out the same way, so the barrier engine does not retry it."""

    MARK = "ran out of memory"
    """How a worker's report of it begins."""
    ON_GPU = "on its GPU"
    """What follows :data:`MARK` in a report of a GPU's memory."""
    UNDER_CAP = "under the cap of"
    """What a report of a process stopped by the cap on its memory says."""

    @property
    def on_gpu(self) -> bool:
        """The process ran out of its GPU's memory (the report crossed from the worker as text)."""
        return self._message.startswith(f"{self.MARK} {self.ON_GPU}")

    @property
    def capped(self) -> bool:
        """The process ran out under the cap Spark puts on each Python worker's memory."""
        return self.UNDER_CAP in self._message


class DeadlineExceeded(EngineError, TimeoutError):
    """A wait passed its deadline (rendezvous, collective, server request, driver wait)."""


class NonFiniteUpdate(EngineError, FloatingPointError):
    """No worker's update of a round was finite (every loss or weight became NaN/Inf): training cannot go on.

    A restart from the last good state would diverge the same way, so engines do not retry it.
    """
