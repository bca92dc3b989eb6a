"""Executor side of the rounds engine (SparkNet's Listing 3), and what both engines share there.

One fit runs these Spark jobs (the driver side is :mod:`sparknet.spark.rounds.driver`):

1. **stage** — ``chunks.mapPartitionsWithIndex(stage_partition)``, persisted: each partition's chunks are written
   one at a time as a :class:`~sparknet.rowfile.RowFile` under the executor's local directory; the persisted RDD
   keeps one small record per partition, whose blocks stay on the executor that wrote the files, so Spark
   schedules every later round of that partition there.
2. **rounds** — ``staged.mapPartitionsWithIndex(run_round)``: a task fetches the round's weights from the driver's
   relay (:mod:`sparknet.spark._relay`), or a broadcast, trains, and puts its delta back there, or returns it already
   folded (:func:`fold`). Its :class:`Net` comes from a process-global cache keyed by (fit id, partition); on a miss
   (another Python worker of the machine, a restarted one) the row file is memory-mapped, so every process on the
   machine shares one copy of the data, or streamed (``WorkerSpec.stream``). A task on a machine without the files
   returns ``missing``, and the driver reruns that partition from the persisted chunks
   (:func:`run_round_from_chunks`), which writes the files there.
3. **cleanup** — removes the files and drops the cache entries.

Between rounds a worker keeps its solver state and its strategy's :class:`~sparknet.strategies.WorkerState`.
Python workers take partitions in no fixed order, so that state is also saved next to the data after every round
(``p{i}.r{round}.state``) and a process whose copy is older loads it: the result does not depend on which process
ran which round. A failed task leaves no trace: its cached net is dropped, and Spark's retry starts again from the
previous round's saved state, so the result is the one an unfailed run gets. Every round reseeds torch's global
generator from (seed, partition, round), so random layers draw the same numbers whichever process runs the round.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import gc
import json
import logging
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field, replace
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from sparknet._enums import CompressionKind
from sparknet._malloc import keep_freed_memory
from sparknet._tensortree import load_tree, pack_tree, save_tree
from sparknet.errors import WorkerOutOfMemory
from sparknet.faults import due_fault
from sparknet.loop import ResumeState, RoundPlan
from sparknet.net import Net
from sparknet.config import WorkerConfig
from sparknet.rowfile import DEFAULT_BUFFER_BYTES, RowFile
from sparknet.spark.data import write_chunks
from sparknet.spark._relay import RelayAddress, RelayUnreachable, relay_client
from sparknet.step import WorkerStep, round_seed, worker_seed
from sparknet.strategies import Downlink, TrainingStrategy, WorkerState, make_compressor
from sparknet.labels import Task

if TYPE_CHECKING:
    from sparknet.faults import Fault
    from sparknet.layers import NetParams
    from sparknet.link import LinkModel

__all__ = ["WorkerSpec", "RoundTask", "WorkerStatus", "WorkerReport", "Partial", "pack_spec", "unpack_spec",
           "worker_seed", "task_device", "build_worker_net", "fit_dir", "stage_partition", "run_round", "ROUND_TASK",
           "task_attempt", "run_round_from_chunks", "fold", "combine", "cleanup_partition", "freeze_heap", "fault_hook",
           "worker_failure", "export_worker_state", "import_worker_state", "round_seed", "decode_updates",
           "staged_stem", "staged_here"]

log = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """What every task of one fit needs; pickled once per fit (a broadcast or the barrier closure)."""

    fit_id: str
    net: NetParams | torch.nn.Module
    """NetParams or a torch.nn.Module (copied per partition)."""
    loss: Callable | None
    worker: WorkerConfig
    """Every worker's solver, minibatch, seed, threads and device (its ``steps`` rule stays on the driver)."""
    strategy: TrainingStrategy
    sample_shape: tuple[int, ...]
    start_iteration: int = 0
    """Solver iteration the workers start at (the driver's warm-up steps)."""
    staging_dir: str | None = None
    """Where executors keep each partition's rows and state (default: their Spark local directory)."""
    stream: bool = False
    """A worker streams its partition through a bounded shuffle buffer instead of holding it in memory."""
    stream_buffer_bytes: int = DEFAULT_BUFFER_BYTES
    """The shuffle buffer of a streamed partition."""
    faults: tuple[Fault, ...] = ()
    """Injected faults (:mod:`sparknet.faults`), for reliability tests."""
    resume: ResumeState | None = None
    """A resumed fit's round and workers' states (:func:`export_worker_state`)."""
    compression: CompressionKind = CompressionKind.NONE
    """Codec of the updates (:func:`sparknet.strategies.make_compressor`); not none: the rounds engine's
    weights go down as :class:`~sparknet.strategies.Downlink` messages too."""
    link: LinkModel | None = None
    """A :class:`sparknet.link.LinkModel` every exchange waits for (``None``: no simulated delay)."""
    task: Task = Task.CLASSIFICATION
    """What the net learns: class ids, or numbers (float labels)."""
    weighted: bool = False
    """The labels carry each row's sample weight last (a ``weight_col``)."""
    outputs: int | None = None
    """The net's outputs as the driver's probe found them (a classifier's classes): what the barrier's ranks sum
    the validation shares' scores over (:func:`sparknet.collective.evaluate_shards`)."""
    relay: RelayAddress | None = None
    """The rounds engine's :class:`~sparknet.spark._relay.RelayAddress`: where the tasks fetch the round's weights
    and put their updates (``None``: through Spark's broadcasts and task results)."""


@dataclass(frozen=True)
class RoundTask:
    """What every task of one round gets from the driver, besides the weights (a broadcast)."""

    plan: RoundPlan
    """The loop's plan: the round, its local steps and its seconds."""
    numel: int
    """Number of weights (what a compressed message decodes to)."""
    send_state: bool = False
    """Return the worker's state with the result (a checkpoint round)."""
    full: bool = False
    """The broadcast holds the whole weights, not the round's downlink message (a worker that lost its copy)."""
    held: bool = False
    """The driver holds every worker's state of the previous round: a task that finds no saved state on its
    machine (its partition moved to another host) asks for it instead of starting its solver afresh."""
    relayed: bool = False
    """The weights come from, and the update goes to, the driver's relay (``WorkerSpec.relay``), not the round's
    broadcast and the task's result."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RoundTask:
        fields = json.loads(text)
        return cls(**{**fields, "plan": RoundPlan(**fields["plan"])})


ROUND_TASK = "sparknet.round_task"
"""The Spark job property that carries a round's :class:`RoundTask` (as JSON) to the tasks of a fit's one relayed
round RDD, whose function stays the same from round to round."""


def _job_task() -> RoundTask:
    """This task's round, from its job's :data:`ROUND_TASK` property."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    text = ctx.getLocalProperty(ROUND_TASK) if ctx is not None else None
    if not text:
        raise RuntimeError(f"this round's Spark job carries no {ROUND_TASK} property")
    return RoundTask.from_json(text)


class WorkerStatus(str, enum.Enum):
    """How a partition's round went."""

    TRAINED = "trained"
    """It ran its local steps (its update may still be non-finite: see ``finite``)."""
    EMPTY = "empty"
    """The partition has no rows; it sends nothing."""
    MISSING = "missing"
    """Its staged files are not on the machine Spark ran it on: the driver reruns it from the chunks."""
    NEED_FULL = "need_full"
    """Its process lost the weights a compressed message is relative to: the driver resends them whole."""
    NEED_STATE = "need_state"
    """Its machine has not the worker's state of the previous round: the driver sends the one it holds."""
    UNREACHABLE = "unreachable"
    """Its task could not reach the driver's relay: the driver reruns it through Spark's broadcast."""
    OUT_OF_MEMORY = "out_of_memory"
    """Its process could not get the memory the round needs (:attr:`WorkerReport.error` says what it held). A retry
    would run out the same way, so the task reports it instead of failing, which Spark would retry
    (``spark.task.maxFailures``, four times on a cluster); the driver fails the fit with it."""


@dataclass(frozen=True)
class WorkerReport:
    """One partition's round, as its task reports it to the driver (its update travels beside it)."""

    index: int
    status: WorkerStatus = WorkerStatus.TRAINED
    samples: int = 0
    steps: int = 0
    loss: float = float("nan")
    compute_s: float = 0.0
    """Seconds of the local steps."""
    task_s: float | None = None
    """Seconds of the whole task (loading the net, the state, the steps, the encoding)."""
    attempt: int = 0
    """Spark's attempt number of this task (0: the first)."""
    finite: bool = True
    source: str | None = None
    """Where the net's data came from: cache, file or chunks."""
    host: str = ""
    pid: int = 0
    device: str | None = None
    gpu_addresses: tuple | None = None
    device_reason: str | None = None
    link_s: float | None = None
    """Seconds waited on the simulated link."""
    sent_bytes: int | None = None
    """Bytes of a compressed update."""
    peak_rss_mb: float | None = None
    """Peak resident memory of the Python worker that ran the task, in MiB (its whole life so far)."""
    worker_state: dict | None = field(default=None, repr=False)
    """The worker's state (:func:`export_worker_state`) on checkpoint rounds."""
    relay_attempt: int | None = None
    """Spark's task attempt id under which the update was put in the driver's relay (``None``: it travels in
    this result, or there is none)."""
    state_attempt: int | None = None
    """The same for the worker's state (``None``: it travels in :attr:`worker_state`, or is not sent)."""
    error: str | None = None
    """A failed round's report (:func:`worker_failure`'s text), with :attr:`WorkerStatus.OUT_OF_MEMORY`."""

    @property
    def trained(self) -> bool:
        return self.status is WorkerStatus.TRAINED

    def record(self) -> dict:
        """The round record's ``per_worker`` entry (what is known, without the worker's state), in field order."""
        unrecorded = ("status", "worker_state", "relay_attempt", "state_attempt")
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in unrecorded}
        out["gpu_addresses"] = None if self.gpu_addresses is None else list(self.gpu_addresses)
        if self.status is WorkerStatus.EMPTY:
            out["empty"] = True
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class Partial:
    """A partial aggregate of a round: what some workers sent, summed (``treeAggregate``'s value).

    Compressed updates are not summed on the way (that would decode them where they pass): their
    wire messages are listed, ``(index, samples, bytes)``, for the driver to decode in worker order.
    """

    wsum: np.ndarray | None
    """Σ samples · delta of the finite uncompressed updates (``None``: none yet)."""
    samples: int
    """Σ samples of the updates that count."""
    loss_sum: float
    """Σ samples · loss of those updates."""
    workers: tuple[WorkerReport, ...]
    encoded: tuple[tuple[int, int, np.ndarray], ...] = ()
    relayed: tuple[tuple[int, int, int], ...] = ()
    """``(index, samples, attempt)`` of updates waiting in the driver's relay (:meth:`resolved` fetches them)."""

    def resolved(self, take) -> Partial:
        """This one worker's aggregate with its relayed update fetched: ``take(index, attempt, samples)`` gives
        ``delta * float32(samples)`` (uncompressed) or the encoded bytes, as the task would have folded them."""
        if not self.relayed:
            return self
        (index, n, attempt), = self.relayed
        got = take(index, attempt, n)
        if got.dtype == np.float32:
            return replace(self, wsum=got, relayed=())
        return replace(self, encoded=((index, n, got),), relayed=())

    def without(self, status: WorkerStatus) -> Partial:
        """This aggregate less the reports of that status (they sent no update)."""
        return replace(self, workers=tuple(w for w in self.workers if w.status is not status))


def export_worker_state(net: Net, state: WorkerState, *, copy_tensors: bool = True,
                        stream: dict | None = None) -> dict:
    """What a worker carries from one round to the next (solver, data position, strategy state; a streamed
    exchange's ``stream``: the worker's own weights); with ``copy_tensors=False`` it shares the optimizer's live
    tensors (to be written out at once)."""
    return {"solver": net.solver_state(copy_tensors=copy_tensors), "local_flat": state.local_flat,
            "extra": dict(state.extra), **({} if stream is None else {"stream": stream})}


def import_worker_state(net: Net, saved: dict) -> WorkerState:
    """Load :func:`export_worker_state`'s dict into ``net``; returns the strategy's worker state."""
    net.load_solver_state(saved["solver"])
    local = saved.get("local_flat")
    return WorkerState(local_flat=None if local is None else torch.as_tensor(local).clone(),
                       extra=dict(saved.get("extra") or {}))


def task_device(requested: str, index: int = 0) -> tuple[str, dict]:
    """The device worker ``index``'s task trains on, and a record of the decision.

    When Spark assigns GPU addresses to the task (``--gpus-per-worker``, or ``spark.task.resource.gpu.amount``),
    ``auto`` or ``cuda`` uses the first of them; when it assigns none (local mode), worker ``index`` takes GPU
    ``index`` modulo the GPUs torch sees. When torch has no CUDA the task falls back to the CPU and says why
    (logged and returned).
    """
    keep_freed_memory()
    try:
        from pyspark import TaskContext

        gpu = TaskContext.get().resources().get("gpu")  # no TaskContext outside a task: AttributeError
        addresses = [] if gpu is None else list(gpu.addresses)
    except Exception:  # outside a Spark task
        addresses = []
    req = (requested or "cpu").lower()
    if req == "cpu":
        dev, reason = "cpu", "cpu requested"
    elif not torch.cuda.is_available():
        who = f"Spark assigned GPU {addresses} to this task" if addresses else f"device {req!r} was asked for"
        dev, reason = "cpu", f"{who}, but torch {torch.__version__} sees no CUDA device; training on the CPU"
        if addresses or req != "auto":
            log.warning(reason)
    elif addresses:
        idx = int(addresses[0]) if addresses[0].isdigit() and int(addresses[0]) < torch.cuda.device_count() else 0
        dev, reason = f"cuda:{idx}", f"Spark assigned GPU {addresses[0]}"
    else:
        dev = req if req.startswith("cuda:") else f"cuda:{index % torch.cuda.device_count()}"
        reason = f"no GPU assigned by Spark; worker {index} on {dev}"
    return dev, {"gpu_addresses": addresses, "requested_device": requested, "device": dev, "device_reason": reason}


def build_worker_net(spec: WorkerSpec, index: int, data, device: str) -> Net:
    """A worker's Net over its partition's data, built the same way in both engines.

    ``data``: the partition's :class:`~sparknet.rowfile.RowFile` (held in memory or streamed, as
    ``spec.stream`` says), its ``(x, y)`` arrays, or ``None`` (no rows). On the ``meta`` device (a sharded
    replica's rank, which allocates its parts only once it is cut) the net gets its rows from
    :func:`give_rows` after that.
    """
    net_def = copy.deepcopy(spec.net) if isinstance(spec.net, torch.nn.Module) else spec.net
    net = Net(net_def, spec.worker.solver, loss=spec.loss, batch_size=spec.worker.batch_size, device=device,
              task=spec.task, weighted=spec.weighted, seed=worker_seed(spec.worker.seed, index),
              compute=spec.worker.compute)
    if net.device.type != "meta":
        give_rows(net, spec, index, data)
    net.set_iteration(spec.start_iteration)
    return net


def give_rows(net: Net, spec: WorkerSpec, index: int, data) -> None:
    """Give worker ``index``'s net its partition's rows (:func:`build_worker_net`'s ``data``, or a stream made
    already: a split copy's :class:`~sparknet.parallel.mesh.SharedStream`)."""
    seed = worker_seed(spec.worker.seed, index)
    if hasattr(data, "next_batch"):
        net.set_training_data(data)
    elif isinstance(data, RowFile) and spec.stream:
        net.set_training_data(data.stream(seed=seed, buffer_bytes=spec.stream_buffer_bytes,
                                          sample_shape=spec.sample_shape))
    else:
        x, y = data.arrays() if isinstance(data, RowFile) else data if data is not None else (None, None)
        if x is not None and len(x):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only memory maps
                net.set_training_data((x.reshape(len(x), *spec.sample_shape), y))


def pack_spec(spec: WorkerSpec) -> tuple[str, bytes]:
    """The spec as it is broadcast: ``(fit_id, cloudpickle bytes)``.

    Spark's broadcasts use plain pickle, which cannot carry a model class defined in the
    user's script or notebook; cloudpickle can.
    """
    from pyspark import cloudpickle

    try:
        return spec.fit_id, cloudpickle.dumps(spec)
    except Exception as exc:
        raise ValueError(f"the model, loss or strategy cannot be pickled for the executors: "
                         f"{type(exc).__name__}: {exc}") from exc


_SPECS: dict[str, WorkerSpec] = {}


def unpack_spec(packed: tuple[str, bytes]) -> WorkerSpec:
    """The spec of a packed broadcast value, unpickled once per process and fit."""
    fit_id, blob = packed
    spec = _SPECS.get(fit_id)
    if spec is None:
        for old in [k for k in _SPECS if not any(key[0] == k for key in _CACHE)]:
            del _SPECS[old]
        spec = _SPECS[fit_id] = pickle.loads(blob)
    return spec


def worker_failure(rank: int, exc: BaseException) -> RuntimeError:
    """An exception whose text the driver turns back into a WorkerError with this rank (a
    :class:`~sparknet.errors.WorkerOutOfMemory` where the process could not get memory: :func:`out_of_memory`)."""
    tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-12:])
    head = out_of_memory(exc)
    if head is not None:  # what the failed frames held goes back before the report to the driver takes any (a
        traceback.clear_frames(exc.__traceback__)  # ZeroMQ context's thread that cannot start aborts the process)
        gc.collect()
    head = head or f"{type(exc).__name__}: {exc}"
    return RuntimeError(f"[sparknet-worker {rank}] {head}\n[sparknet-tail]\n{tail}[sparknet-end]")


def out_of_memory(exc: BaseException) -> str | None:
    """Where ``exc`` says this process could not get memory: that, with what it held then (``None`` otherwise).

    On the CPU, a Python worker's memory is capped where Spark sets ``spark.executor.pyspark.memory``: Spark limits
    the worker's address space to it (``RLIMIT_AS``), and an allocation past it fails as ``MemoryError`` (torch's:
    "can't allocate memory"; a thread's stack: "Resource temporarily unavailable"). The text names the cap and the
    process's peaks, mapped and resident; it begins with :data:`~sparknet.errors.WorkerOutOfMemory.MARK`."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    what = f"{type(exc).__name__}{': ' + first if first else ''}"
    if isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and "CUDA out of memory" in first):
        return f"{WorkerOutOfMemory.MARK} {WorkerOutOfMemory.ON_GPU} ({what})"
    cap = _address_space_cap()
    if not (isinstance(exc, MemoryError) or any(s in first for s in ("can't allocate memory", "bad_alloc"))
            or (cap is not None and "Resource temporarily unavailable" in first)):
        return None
    mapped, resident = _status_mb("VmPeak:"), peak_rss_mb()
    by = " that spark.executor.pyspark.memory puts" if os.environ.get("PYSPARK_EXECUTOR_MEMORY_MB") else ""
    where = "" if cap is None else f" {WorkerOutOfMemory.UNDER_CAP} {cap:,.0f} MiB{by} on its address space"
    peaks = [f"{v:,.0f} MiB {k}" for k, v in (("mapped", mapped), ("resident", resident)) if v is not None]
    return f"{WorkerOutOfMemory.MARK} ({what}){where}{'; at its peak ' + ', '.join(peaks) if peaks else ''}"


def _address_space_cap() -> float | None:
    """This process's address-space limit in MiB (``RLIMIT_AS``), or ``None`` where it has none."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft / 2**20


# -- the process-global cache -------------------------------------------------------------------
@dataclass
class _Entry:
    net: Net
    state: WorkerState
    version: int
    directory: str
    device_info: dict
    folder_id: tuple | None
    """The folder's device and inode when the entry was made: a folder removed and made again (its files lost, then
    a rerun's written) is another folder, and the entry is stale."""


def _folder_id(directory: str) -> tuple | None:
    try:
        info = os.stat(directory)
    except OSError:
        return None
    return info.st_dev, info.st_ino


_CACHE: dict[tuple[str, int], _Entry] = {}


def freeze_heap() -> None:
    """Keep PySpark's per-task garbage collection cheap in this Python worker.

    A reused Python worker runs ``gc.collect()`` after every task, before it takes the next
    one. With torch imported (and its optimizers pulling in ``torch._dynamo``) that is a scan of
    ~300k objects: 0.05-0.4 s on the critical path of every round. Freezing what is alive now
    (modules, the cached nets) takes it out of that scan; :func:`cleanup_partition` unfreezes.
    """
    gc.collect()
    gc.freeze()


def _evict_finished() -> None:
    """Drop cached nets of fits whose staging directory is gone (the fit ended, or the machine lost its files) or was
    made again (a rerun's files in it, not this entry's)."""
    for key in [k for k, e in _CACHE.items() if e.folder_id is None or _folder_id(e.directory) != e.folder_id]:
        del _CACHE[key]


def _fit_dir(staging_dir: str | None, fit_id: str) -> str:
    dirs = os.environ.get("SPARK_LOCAL_DIRS", "")
    root = staging_dir or (dirs.split(",")[0] if dirs else tempfile.gettempdir())
    return os.path.join(root, f"sparknet-{fit_id}")


def fit_dir(spec: WorkerSpec) -> str:
    """The folder on this machine where the fit's tasks keep their partitions' rows and state."""
    return _fit_dir(spec.staging_dir, spec.fit_id)


def staged_stem(directory: str, index: int) -> str:
    """Where partition ``index``'s rows are staged in the fit's folder ``directory``."""
    return os.path.join(directory, f"p{index}")


def staged_here(record: dict | None, index: int) -> RowFile | None:
    """Partition ``index``'s staged rows from its stage-job record, or ``None`` where they were staged on another
    machine or are gone from this one."""
    if record is None or record.get("host") != socket.gethostname():
        return None
    return RowFile.open(staged_stem(record["dir"], index))


def staged_head(quotas: list[int]):
    """Task function over the stage job's records: the first ``quotas[index]`` rows a partition staged, as one
    ``(x, y)`` (what :func:`~sparknet.spark.data.head_rows` takes from its chunks), or ``None`` where they were
    staged on another machine."""

    def take(index: int, records):
        for record in records:
            if not record["rows"] or not quotas[index]:
                continue
            rows = staged_here(record, index)
            if rows is None:
                yield None
                continue
            x, y = rows.arrays()
            yield np.array(x[:quotas[index]]), np.array(y[:quotas[index]])

    return take


# -- stage --------------------------------------------------------------------------------------
def stage_partition(fit_id: str, staging_dir: str | None = None):
    """Task function of the stage job: chunks -> files on this machine + one small record."""

    def stage(index: int, chunks):
        _evict_finished()
        directory = _fit_dir(staging_dir, fit_id)
        _, info = write_chunks(staged_stem(directory, index), chunks)
        info.update(index=index, host=socket.gethostname(), dir=directory)
        freeze_heap()
        yield info

    return stage


def stage_frame(fit_id: str, staging_dir: str | None, convert):
    """Task function of the stage job over a DataFrame (``mapInArrow``): its Arrow batches made into chunks by
    ``convert`` (:func:`~sparknet.spark.data.chunk_input`'s :class:`~sparknet.spark.data.ArrowChunks`) and written
    here as :func:`stage_partition` writes them, one row of JSON back. The chunks never go back to the JVM, nor
    into bytes: the rows cross from Spark into Python once, where reading them through an RDD of chunks moves them
    four more times (out of the conversion, into the RDD's map, into its cache, and out of it to the task that stages
    them)."""

    def stage(batches):
        import pyarrow as pa
        from pyspark import TaskContext

        index = TaskContext.get().partitionId()
        for info in stage_partition(fit_id, staging_dir)(index, convert.chunks(batches)):
            yield pa.RecordBatch.from_pydict({"info": [json.dumps(info)]})

    return stage


def stage_hands(fit_id: str, staging_dir: str | None, convert, hand):
    """Task function of the stage job over a dealt data set (an RDD of as many empty partitions): partition ``k``'s
    rows are ``hand(k)``'s Arrow batches, made into chunks by ``convert`` (an
    :class:`~sparknet.spark.data.ArrowChunks`) and written as :func:`stage_partition` writes them. No DataFrame is
    planned, and one Python worker a task reads, converts and stages."""

    def stage(index: int, _):
        return stage_partition(fit_id, staging_dir)(index, convert.chunks(hand(index)))

    return stage


def cleanup_partition(fit_id: str):
    """Task function of the cleanup job: remove this partition's files; forget the fit here."""

    def cleanup(index: int, records):
        removed = 0
        for rec in records:
            if rec.get("host") == socket.gethostname() and os.path.isdir(rec["dir"]):
                shutil.rmtree(rec["dir"], ignore_errors=True)
                removed += 1
        for key in [k for k in _CACHE if k[0] == fit_id]:
            del _CACHE[key]
        _SPECS.pop(fit_id, None)
        gc.unfreeze()  # what the fit froze may now be garbage
        yield removed

    return cleanup


# -- one round ----------------------------------------------------------------------------------
def _state_path(directory: str, index: int, version: int) -> str:
    return os.path.join(directory, f"p{index}.r{version}.state")


def _sync_state(entry: _Entry, index: int, round_index: int, resume: ResumeState | None = None, *,
                quiet: bool = False) -> bool:
    """Bring the cached net's solver and strategy state to the end of the previous round; whether it could.

    ``resume``: a checkpoint's workers' states, or those the driver holds (a :class:`~sparknet.loop.ResumeState`).
    ``quiet``: a state not found is the caller's to handle.
    """
    want = round_index - 1
    if entry.version == want or want < 0:
        return True
    path = _state_path(entry.directory, index, want)
    if os.path.exists(path):
        saved = load_tree(path, entry.net.device)["worker"]  # this fit's own tasks wrote it: tensors, numbers, dicts
    elif resume is not None and want == resume.round - 1 and index in resume.workers:
        saved = resume.workers[index]
    else:
        if not quiet:
            log.warning("partition %d: no saved solver state of round %d on %s; continuing from this process's "
                        "state (round %d)", index, want, socket.gethostname(), entry.version)
        return False
    entry.state = import_worker_state(entry.net, saved)
    entry.version = want
    return True


def _save_state(entry: _Entry, index: int, round_index: int) -> None:
    save_tree(_state_path(entry.directory, index, round_index),
              {"version": round_index, "worker": export_worker_state(entry.net, entry.state, copy_tensors=False)})
    with contextlib.suppress(OSError):
        os.remove(_state_path(entry.directory, index, round_index - 2))
    entry.version = round_index


def task_attempt(ctx=None) -> tuple[int, int]:
    """Spark's attempt number of this task (0: the first) and its attempt id (unique in the application);
    ``(0, 0)`` outside a task. ``ctx``: the task's ``TaskContext`` (default: looked up).

    The attempt number alone does not name an attempt: a stage that Spark submits again (an executor lost with
    the shuffle output it read) numbers its tasks' attempts from 0 again. The attempt id does."""
    if ctx is None:
        try:
            from pyspark import TaskContext
        except ImportError:  # pragma: no cover - pyspark is there wherever a task runs
            return 0, 0
        ctx = TaskContext.get()
    return (ctx.attemptNumber(), ctx.taskAttemptId()) if ctx is not None else (0, 0)


Update = tuple[WorkerReport, np.ndarray | None, np.ndarray | None]
"""What a task's round gives :func:`fold`: its report, its finite uncompressed delta, its encoded update."""


def _train_round(spec_bc, weights_bc, task: RoundTask, index: int, record: dict | None, chunks=None,
                 states_bc=None) -> Update:
    t_task = time.perf_counter()
    attempt, attempt_id = task_attempt()
    report = WorkerReport(index=index, host=socket.gethostname(), pid=os.getpid(), attempt=attempt)
    if record is not None and record["rows"] == 0:
        return replace(report, status=WorkerStatus.EMPTY), None, None
    spec = unpack_spec(spec_bc.value)  # once per Python worker and fit
    torch.set_num_threads(spec.worker.threads)
    key = (spec.fit_id, index)
    entry = _CACHE.get(key)
    source = "cache"
    if entry is None:
        if chunks is not None:
            directory = fit_dir(spec)
            rows, _ = write_chunks(staged_stem(directory, index), chunks)
            if rows is None:
                return replace(report, status=WorkerStatus.EMPTY), None, None
            source = "chunks"
        else:
            rows = staged_here(record, index)
            if rows is None:
                return replace(report, status=WorkerStatus.MISSING), None, None
            directory = record["dir"]
            source = "file"
        device, device_info = task_device(spec.worker.device, index)
        net = build_worker_net(spec, index, rows, device)
        entry = _Entry(net=net, state=WorkerState(), version=-1, directory=directory, device_info=device_info,
                       folder_id=_folder_id(directory))
        _CACHE[key] = entry
        freeze_heap()
    elif chunks is not None:
        for _ in chunks:  # the data is here already; drain the input so the worker can be reused
            pass
    round_index = task.plan.round
    compressed = spec.compression is not CompressionKind.NONE
    link_s = 0.0
    try:
        held = states_bc.value if states_bc is not None else spec.resume
        if not _sync_state(entry, index, round_index, held, quiet=task.held) and task.held:
            return replace(report, status=WorkerStatus.NEED_STATE, task_s=time.perf_counter() - t_task), None, None
        if compressed and not task.full and entry.state.extra.get("seen_round", -1) != round_index - 1:
            # this process has not the weights the round's message is relative to (its state was lost)
            return replace(report, status=WorkerStatus.NEED_FULL, task_s=time.perf_counter() - t_task), None, None
        client = None
        if task.relayed:  # the round's weights from the driver's socket, before anything of the round is done
            client = relay_client(spec.relay)
            try:
                message = client.get(round_index, "full" if task.full else "message")
            except RelayUnreachable as exc:
                log.warning("partition %d: %s; the driver sends the weights through Spark instead", index, exc)
                return replace(report, status=WorkerStatus.UNREACHABLE,
                               task_s=time.perf_counter() - t_task), None, None
        else:
            message = np.asarray(weights_bc.value)
        entry.version = -2  # in the middle of a round: a retry in this process must reload the saved state
        net = entry.net
        if spec.link is not None:  # the broadcast weights (or the round's message), down
            link_s += spec.link.wait(message.nbytes)
        global_flat = _receive(spec, entry.state, message, task) if compressed else torch.from_numpy(message)
        step = WorkerStep(net, spec.strategy, state=entry.state, compression=spec.compression,
                          seed=lambda r: round_seed(spec.worker.seed, index, r),
                          after_train=fault_hook(spec.faults, index, report.attempt), profile=spec.worker.profile,
                          name=f"worker-{index}")
        result = step.run(task.plan.steps, global_flat, round=round_index, seconds=task.plan.seconds)
        stats, finite, sends = result.stats, result.finite, result.counts
        encoded = None if result.message is None else result.message.numpy()
        if client is not None and sends:  # the update to the driver's socket; the result names this attempt
            received = client.put(round_index, index, attempt_id, encoded if compressed else result.delta.numpy())
        state_put = None
        if client is not None and task.send_state:  # the driver holds it, or writes it in a checkpoint
            state = pack_tree(export_worker_state(net, entry.state, copy_tensors=False))
            if spec.relay.state_bytes is not None and len(state) <= spec.relay.state_bytes:
                state_put = client.put(round_index, index, attempt_id, state, kind="state")
        _save_state(entry, index, round_index)  # while the update travels
        if client is not None and sends:
            received()
        if state_put is not None:
            state_put()
        if client is not None and not task.plan.last:
            client.prefetch(round_index + 1)
    except BaseException:
        _CACHE.pop(key, None)  # half a round of solver state must not leak into the retry
        raise
    if spec.link is not None:  # the update, up (only the small record when it is not finite)
        link_s += spec.link.wait(result.nbytes if sends else 0)
    info = entry.device_info
    gpus = info.get("gpu_addresses")
    report = replace(report, samples=stats.samples, steps=stats.steps, loss=stats.loss, compute_s=stats.wall_s,
                     finite=finite, source=source, device=info.get("device"),
                     gpu_addresses=None if gpus is None else tuple(gpus), device_reason=info.get("device_reason"),
                     link_s=link_s if spec.link is not None else None,
                     sent_bytes=None if encoded is None else int(encoded.nbytes), peak_rss_mb=peak_rss_mb(),
                     worker_state=export_worker_state(net, entry.state) if task.send_state and state_put is None
                     else None,
                     relay_attempt=attempt_id if client is not None and sends else None,
                     state_attempt=attempt_id if state_put is not None else None, task_s=time.perf_counter() - t_task)
    if not finite:
        log.warning("partition %d: loss or weights became NaN/Inf in round %d; left out of the average",
                    index, round_index)
    if client is not None:
        return report, None, None
    return report, result.delta.numpy() if sends and not compressed else None, encoded


def fault_hook(faults, index: int, attempt: int):
    """``after_train(net, round)`` of worker ``index``: fires the injected fault due after that round's steps for
    this attempt (a rounds-engine task's attempt, a barrier stage's restart); both engines' tasks use it."""

    def fire(net, round_index: int) -> None:
        fault = due_fault(faults, index, round_index + 1, attempt)
        if fault is not None:
            fault.fire(net)

    return fire


def reset_peak_rss() -> float | None:
    """Start this process's peak resident memory afresh (Linux: ``/proc/self/clear_refs``), so that
    :func:`peak_rss_mb` measures from here: a reused Python worker's peak would otherwise be that of an
    earlier task. Its resident memory now, in MiB; ``None`` where it could not."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_mb("VmRSS:")
    except OSError:
        return None


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def peak_rss_mb() -> float | None:
    """This process's peak resident memory in MiB (since :func:`reset_peak_rss`, where it could), or ``None``."""
    peak = _status_mb("VmHWM:")
    if peak is not None:
        return peak
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def _receive(spec: WorkerSpec, state: WorkerState, message: np.ndarray, task: RoundTask):
    """The worker's weights for this round from a compressed-downlink message (or the full weights)."""
    if task.full:
        seen = torch.from_numpy(np.array(message, dtype=np.float32))
    else:
        down = Downlink(make_compressor(spec.compression), task.numel)
        prev = state.extra.get("seen")
        seen = down.receive(down.seen if prev is None else torch.as_tensor(prev), torch.from_numpy(message))
    state.extra["seen"] = seen
    state.extra["seen_round"] = task.plan.round
    return seen


def run_round(spec_bc, weights_bc, task: RoundTask | None, states_bc=None):
    """Task function of a round: train from the broadcast weights; yields one partial aggregate.

    ``task=None``: each job says its round in its :data:`ROUND_TASK` property, so one RDD serves every relayed
    round. ``states_bc``: the workers' states the driver holds, for workers that sat out rounds (elastic rounds).
    """

    def run(index: int, records):
        record = None
        for record in records:  # one small record; read it all so the Python worker is reused
            pass
        _evict_finished()
        yield _folded(spec_bc, weights_bc, task, index, record, states_bc=states_bc)

    return run


def run_round_from_chunks(spec_bc, weights_bc, task: RoundTask, states_bc=None):
    """Task function of a round run from the persisted chunks (a partition missing on its machine, or one
    that needs the workers' states the driver holds, ``states_bc``)."""

    def run(index: int, chunks):
        _evict_finished()  # a net cached in this worker whose folder vanished starts afresh from the chunks
        return [_folded(spec_bc, weights_bc, task, index, None, chunks=chunks, states_bc=states_bc)]

    return run


def _folded(spec_bc, weights_bc, task: RoundTask | None, index: int, record: dict | None, **kwargs) -> Partial:
    """A task's round (``task=None``: its job's :data:`ROUND_TASK`) as its partial aggregate; a failure is raised as
    worker ``index``'s (:func:`worker_failure`)."""
    try:
        return fold(None, _train_round(spec_bc, weights_bc, task or _job_task(), index, record, **kwargs))
    except Exception as exc:
        if out_of_memory(exc) is None:
            raise worker_failure(index, exc) from None
        # a retry would run out the same way: the round's result says so, and Spark retries no task that succeeded
        report = WorkerReport(index, status=WorkerStatus.OUT_OF_MEMORY, error=str(worker_failure(index, exc)))
    return fold(None, (report, None, None))


# -- aggregation --------------------------------------------------------------------------------
def _partial(update: Update) -> Partial:
    report, delta, encoded = update
    relayed = report.relay_attempt is not None
    n = report.samples if delta is not None or encoded is not None or relayed else 0
    return Partial(wsum=None if delta is None or n == 0 else delta * np.float32(n), samples=n,
                   loss_sum=report.loss * n if n else 0.0, workers=(report,),
                   encoded=((report.index, n, encoded),) if encoded is not None and n else (),
                   relayed=((report.index, n, report.relay_attempt),) if relayed and n else ())


def combine(a: Partial | None, b: Partial | None) -> Partial | None:
    """Sum two partial aggregates (sample-weighted delta sums, samples, losses, worker reports)."""
    if a is None:
        return b
    if b is None:
        return a
    if a.wsum is None:
        wsum = b.wsum
    elif b.wsum is None:
        wsum = a.wsum
    else:
        wsum = a.wsum.astype(np.float64) + b.wsum
    return Partial(wsum=wsum, samples=a.samples + b.samples, loss_sum=a.loss_sum + b.loss_sum,
                   workers=a.workers + b.workers, encoded=a.encoded + b.encoded, relayed=a.relayed + b.relayed)


def decode_updates(encs: list, compression: str, numel: int) -> np.ndarray:
    """The sample-weighted sum of the workers' compressed updates, decoded in worker order (float64).

    The order is fixed so a resumed or retried fit sums exactly as an uninterrupted one.
    """
    codec = make_compressor(compression)
    total = np.zeros(numel, dtype=np.float64)
    for _, n, buf in sorted(encs, key=lambda e: e[0]):
        total += codec.decode(torch.from_numpy(np.array(buf, dtype=np.uint8)), numel).numpy() * np.float32(n)
    return total


def fold(acc: Partial | None, update: Update) -> Partial:
    """treeAggregate's seqOp: add one worker's update."""
    return combine(acc, _partial(update))
