"""A worker that runs out of memory: what its report says, how the driver reads it back, and what the fit advises.

Spark caps each Python worker's address space where ``spark.executor.pyspark.memory`` is set; past it an allocation
fails in Python or torch (an error the worker reports), or aborts the process in native code (a crash Spark reports).
``tests/spark/test_memory_cap.py`` runs both against a real cap.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from sparknet import zoo
from sparknet.config import DistributedConfig
from sparknet.errors import WorkerError, WorkerOutOfMemory
from sparknet.spark import SparkTrainer
from sparknet.spark.backend import task_error, worker_crash
from sparknet.spark.rounds import executor
from sparknet.spark.rounds.executor import out_of_memory, worker_failure

CRASH = """An error occurred while calling o123.collectAndServe.
: org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover from a failed barrier \
ResultStage. Most recent failure reason: Stage failed because barrier task ResultTask(4, 2) finished unsuccessfully.
org.apache.spark.SparkException: Python worker exited unexpectedly (crashed): Fatal Python error: Aborted

Thread 0x00007f64dd816b80 (most recent call first):
  File "sparknet/net.py", line 550 in forward_backward
\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator$$anonfun$1.applyOrElse(PythonRunner.scala:1136)
"""


@pytest.fixture
def capped(monkeypatch):
    """This process as Spark's Python worker under spark.executor.pyspark.memory = 3g."""
    monkeypatch.setattr(executor, "_address_space_cap", lambda: 3072.0)
    monkeypatch.setenv("PYSPARK_EXECUTOR_MEMORY_MB", "3072")


def test_an_allocation_past_the_cap_is_reported_with_the_cap_and_the_processs_peaks(capped):
    for exc in (MemoryError(), RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate "
                                            "memory: you tried to allocate 251863052 bytes")):
        text = out_of_memory(exc)
        assert text.startswith(f"{WorkerOutOfMemory.MARK} ({type(exc).__name__}"), text
        assert "under the cap of 3,072 MiB that spark.executor.pyspark.memory puts on its address space" in text
        assert "MiB mapped" in text and "MiB resident" in text
    # a thread that cannot start is out of memory only under a cap
    assert out_of_memory(RuntimeError("Resource temporarily unavailable")).startswith(WorkerOutOfMemory.MARK)


def test_other_errors_are_not_out_of_memory():
    assert out_of_memory(ValueError("bad labels")) is None
    assert out_of_memory(RuntimeError("Resource temporarily unavailable")) is None  # no cap in this process
    assert out_of_memory(RuntimeError("Connection closed by peer")) is None


def test_a_gpu_out_of_memory_says_so():
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert out_of_memory(exc) == (f"{WorkerOutOfMemory.MARK} on its GPU (OutOfMemoryError: CUDA out of memory. "
                                  "Tried to allocate 2.00 GiB)")


def test_the_driver_reads_a_workers_report_back_as_out_of_memory_and_other_failures_as_they_were(capped):
    try:
        raise MemoryError()
    except MemoryError as exc:
        error = task_error(worker_failure(3, exc))
    assert type(error) is WorkerOutOfMemory and isinstance(error, MemoryError) and error.rank == 3
    assert str(error).startswith("worker 3: ran out of memory (MemoryError) under the cap of 3,072 MiB")
    assert "raise MemoryError()" in error.log_tail
    again = pickle.loads(pickle.dumps(error))  # as it crosses from a task to the driver
    assert type(again) is WorkerOutOfMemory and str(again) == str(error) and again.rank == 3
    other = task_error(worker_failure(1, ValueError("bad labels")))
    assert type(other) is WorkerError and str(other).startswith("worker 1: ValueError: bad labels")


def test_a_crashed_python_worker_is_named_with_its_stacks_and_under_a_cap_is_out_of_memory():
    plain = worker_crash(CRASH)
    assert type(plain) is WorkerError and plain.rank == 2
    assert str(plain).startswith("worker 2: its Python worker crashed (Fatal Python error: Aborted)")
    assert "forward_backward" in plain.log_tail and "PythonRunner.scala" not in plain.log_tail
    capped = worker_crash(CRASH, "3g")
    assert type(capped) is WorkerOutOfMemory and capped.rank == 2
    assert str(capped).startswith("worker 2: ran out of memory, most likely: its Python worker crashed (Fatal Python "
                                  "error: Aborted) under the cap of 3,072 MiB that spark.executor.pyspark.memory")
    # a task of an ordinary stage (the rounds engine's), and a job that failed otherwise
    lost = worker_crash("Lost task 1.0 in stage 3.0 (TID 7) (host executor driver): org.apache.spark.SparkException: "
                        "Python worker exited unexpectedly (crashed)")
    assert lost.rank == 1 and str(lost) == "worker 1: its Python worker crashed (no Python traceback)"
    assert task_error(CRASH).rank == 2
    assert worker_crash("Job aborted due to stage failure: Task 0 in stage 1.0 failed") is None


@pytest.mark.parametrize("dist, report, says", [
    ({"engine": "barrier"}, "ran out of memory (MemoryError) under the cap of 3,072 MiB",
     "Each process holds the whole replica, 1 MiB of weights, beside its solver state and the round's copies of them: "
     "--procs-per-worker G --shard-replica splits the weights and the solver state over a worker's G processes "
     "(FSDP2); or raise the cap (spark.executor.pyspark.memory), or train with a smaller --batch-size"),
    ({"engine": "rounds"}, "ran out of memory (MemoryError)",
     ": --engine barrier --procs-per-worker G --shard-replica"),
    ({"engine": "rounds"}, "ran out of memory (MemoryError)", "; or give each process more memory, or"),
    ({"engine": "barrier", "procs_per_worker": 2, "shard_replica": True},
     "ran out of memory (MemoryError) under the cap of 3,072 MiB",
     "Each of a worker's 2 processes holds 1/2 of the replica's 1 MiB of weights and of its solver state: more "
     "processes a worker (--procs-per-worker) hold less each"),
    ({"engine": "barrier"}, "ran out of memory on its GPU (OutOfMemoryError: CUDA out of memory)",
     "Train with a smaller --batch-size or with --precision bf16, or on a GPU with more memory"),
])
def test_the_fit_says_how_each_process_can_hold_less(dist, report, says):
    trainer = SparkTrainer(zoo.mlp(input_shape=[6], hidden=[8], num_classes=3),
                           dist=DistributedConfig(workers=2, tau=3, rounds=1, **dist))
    assert says in trainer._holding_less(2**20, WorkerOutOfMemory(report, rank=0))


def test_a_rounds_task_out_of_memory_is_its_rounds_result_and_the_driver_raises_it(capped):
    """A rounds-engine task that runs out of memory returns a report of it (Spark retries no task that succeeded);
    the driver raises it as soon as the round's results are in, the first worker's by partition."""
    from sparknet.spark.rounds.driver import _fatal
    from sparknet.spark.rounds.executor import Partial, WorkerReport, WorkerStatus, combine, fold

    def oom(index):
        report = WorkerReport(index, status=WorkerStatus.OUT_OF_MEMORY,
                              error=str(worker_failure(index, MemoryError())))
        return fold(None, (report, None, None))

    trained = fold(None, (WorkerReport(0, samples=4, steps=1, loss=0.5), np.ones(3, np.float32), None))
    assert _fatal(trained) is trained and _fatal(None) is None
    acc = combine(combine(trained, oom(3)), oom(1))
    assert isinstance(acc, Partial) and acc.samples == 4  # the failed rounds add no samples
    with pytest.raises(WorkerOutOfMemory, match=r"^worker 1: ran out of memory \(MemoryError\) under the cap of "
                                                r"3,072 MiB") as caught:
        _fatal(acc)
    assert caught.value.rank == 1
