"""``sparknet doctor``: check a Spark cluster before training on it, and say what to fix.

Checks, on the driver and on every executor (small Spark jobs, each with a timeout):

- ``executors``: how many task slots and executors answered (a probe task per slot).
- ``versions``: Python, Java, Spark (pyspark), torch and sparknet on each executor agree with the
  driver's. A different Python minor version, torch or sparknet is a FAIL (pickled functions and
  weights would not load, or would load differently); a different Java or Python patch level is a WARN.
- ``pickle``: the model and a training function pickle with cloudpickle (as Spark pickles closures)
  on the driver, and load on every executor (which proves sparknet and torch import there).
- ``memory``: the estimated memory of one training task (:func:`estimate_training_memory`) against
  the smallest budget one task has (:func:`task_memory_budget`); for a worker of several processes, one
  process's part (``procs_per_worker`` with ``shard_replica``, ``model_parallel``), and its rows as
  ``data_mode`` holds them.
- ``barrier``: a barrier stage with one task per slot meets at ``allGather`` (the barrier engine's
  rendezvous), and every task opens a TCP connection to a port the first task listens on (as
  torch.distributed's store does).
- ``skew``: rows per partition of the given data set: max/mean above a ratio is a WARN.

Each check gives :class:`CheckResult` rows; every FAIL names a concrete fix. :func:`run_doctor`
returns the rows; ``sparknet doctor`` prints them as a table and exits 1 on any FAIL.

Examples
--------
>>> results = run_doctor("local[2]", model="lenet")            # doctest: +SKIP
>>> print(format_table(results))                               # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import enum
import itertools
import json
import logging
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from sparknet.solvers import SolverType
from sparknet.spark.backend import run_with_deadline
from sparknet.spark.session import executor_slots, java_executable, parse_memory
from sparknet.spark.shared_path import SHARED_PATH_FIX, check_shared_path
from sparknet.tools.predict import _no_active_session

__all__ = ["Status", "CheckResult", "MemoryEstimate", "estimate_training_memory", "task_memory_budget",
           "parse_memory", "format_bytes", "run_doctor", "format_table", "configure_command",
           "OPTIMIZER_STATE_COPIES", "COMMUNICATION_COPIES", "MEMORY_HEADROOM"]

log = logging.getLogger(__name__)

OPTIMIZER_STATE_COPIES = {"sgd": 1, "nesterov": 1, "rmsprop": 1, "adagrad": 1, "adam": 2, "adamw": 2, "adadelta": 2}
"""Copies of the weights each update rule keeps as state (SGD: its momentum buffer)."""
COMMUNICATION_COPIES = 3
"""Copies of the weights a worker holds to synchronize: the weights it received, its flat
delta, and that delta's serialized bytes (one flat buffer per communication)."""
MEMORY_HEADROOM = 0.8
"""An estimate above this fraction of the budget is a WARN (above the budget: a FAIL)."""
_MB = 1 << 20


class Status(str, enum.Enum):
    """Outcome of one check."""

    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class CheckResult:
    """One row of the doctor's table."""

    check: str
    """``spark``, ``executors``, ``versions``, ``pickle``, ``memory``, ``barrier``, ``skew`` or ``data``."""
    where: str
    """``driver``, ``cluster``, an executor (``executor HOST/PID``) or the data path."""
    status: Status
    detail: str
    """What was found."""
    fix: str = ""
    """What to do (every FAIL has one; a WARN may)."""

    def to_dict(self) -> dict:
        return {**asdict(self), "status": self.status.value}


# -- memory ---------------------------------------------------------------------------------------
def format_bytes(n: float) -> str:
    """``1536 MiB`` style, for messages."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _spark_size(n_bytes: float) -> str:
    """A Spark memory setting at least ``n_bytes``, rounded up to a whole 512 MiB (``2g``, ``1536m``)."""
    mb = max(512, int(math.ceil(n_bytes / _MB / 512.0)) * 512)
    return f"{mb // 1024}g" if mb % 1024 == 0 else f"{mb}m"


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated memory of one training task, in bytes, part by part.

    ``total = runtime + weights + gradients + optimizer + communication + activations + data``.
    """

    weights: int
    """Parameters and buffers."""
    gradients: int
    """One gradient per trainable parameter."""
    optimizer: int
    """Update-rule state: :data:`OPTIMIZER_STATE_COPIES` x the trainable parameters."""
    communication: int
    """:data:`COMMUNICATION_COPIES` x the weights (received weights, flat delta, its bytes)."""
    activations: int
    """Every blob of one minibatch, forward values and their gradients (2 x 4 bytes per value)."""
    data: int = 0
    """The worker's partition of the training data, held in memory for the whole run."""
    runtime: int = 0
    """The Python worker itself with torch imported (measured on the executors)."""

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def describe(self) -> str:
        parts = {"runtime": 0, **asdict(self)}  # the runtime first, then the fields in order
        return " + ".join(f"{name} {format_bytes(v)}" for name, v in parts.items() if v)


def estimate_training_memory(net, *, batch_size: int | None = None, solver_type: str = "sgd",
                             module=None, model_parallel: int = 1, shard: int = 1) -> MemoryEstimate:
    """Estimate what one worker's process needs to train ``net``, without running it: weights, gradients and
    update-rule state at their element sizes, activations at 4 bytes a value.

    With ``model_parallel`` M (the layers split over M processes) or ``shard`` G (a replica sharded over G
    processes, FSDP2), the weights, gradients, update-rule state and communication are one process's part of
    them (:func:`~sparknet.parallel.tensor.weight_bytes_per_rank`: the first process's, which holds the largest);
    a sharded process also holds its largest unit's weights whole while that unit computes (a layer of a layer-DSL
    net, any other module whole: :func:`~sparknet.net.shard_units`). The activations are
    counted whole either way (a split layer's are partly cut: an upper bound).

    Parameters
    ----------
    net : NetParams or torch.nn.Module
        The model. A NetParams gives activation sizes from its shape inference; for a plain
        module the activations are not counted (zero).
    batch_size : int, optional
        Minibatch size (default: the net's input layer's).
    solver_type : str
        Update rule (``sgd``, ``adam``...): how many state copies it keeps.
    module : torch.nn.Module, optional
        The built module, when already at hand (built from ``net`` otherwise).
    """
    if module is None:
        module = net.build(seed=0) if hasattr(net, "build") else net
    trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    weights = sum(t.numel() * t.element_size() for t in itertools.chain(module.parameters(), module.buffers()))
    copies = OPTIMIZER_STATE_COPIES.get(str(getattr(solver_type, "value", solver_type)).lower(), 2)
    gathered = 0
    if (model_parallel > 1 or shard > 1) and weights:
        if hasattr(net, "layers"):
            from sparknet.parallel.runner import effective_plan
            from sparknet.parallel.tensor import weight_bytes_per_rank

            plan = effective_plan(net, model_parallel, None) if model_parallel > 1 else None  # the fit's default
            held = weight_bytes_per_rank(net, model_parallel, plan, shard=shard)
        else:  # a plain module: sharded only (model parallelism takes a NetParams), about 1/G of each weight
            held = -(-weights // shard)
        share = held / weights
        weights, trainable = held, round(trainable * share)
        if shard > 1:  # the largest unit FSDP2 gathers (whole, where it is split too: an upper bound)
            from sparknet.net import shard_units

            gathered = max(sum(p.numel() * p.element_size() for p in unit.parameters())
                           for unit in shard_units(module))
    activations = 0
    if hasattr(net, "infer_shapes"):
        shapes = net.infer_shapes()
        first = next(iter(shapes.values()), None)
        declared = first[0] if first else 1
        per_sample = sum(math.prod(s[1:]) if len(s) > 1 else 1 for s in shapes.values())
        activations = 2 * 4 * per_sample * (batch_size or declared)
    return MemoryEstimate(weights=weights + gathered, gradients=trainable, optimizer=copies * trainable,
                          communication=COMMUNICATION_COPIES * weights, activations=activations)


@dataclass(frozen=True)
class _Budget:
    bytes: int
    source: str
    fix: str


def task_memory_budget(*, declared_executor_memory: int | None = None, executor_cores: int | None = None,
                       pyspark_worker_mb: int | None = None, host_available: int | None = None,
                       tasks_on_host: int = 1, local: bool = False) -> list[_Budget]:
    """The memory limits one training task runs under, smallest first.

    - the declared executor memory (``spark.executor.memory``) shared by the executor's
      task slots: sparknet counts it as what one executor may use in all, JVM and Python
      workers together, as container-based cluster managers (YARN, Kubernetes) enforce
      roughly. In local mode Spark does not enforce it; the doctor still holds a declared
      value to it, so it answers as the cluster will;
    - ``spark.executor.pyspark.memory`` per Python worker (Spark caps each worker's address
      space with it), as the worker reports it;
    - the memory available on the task's host (or its cgroup's limit) shared by the task
      slots on that host.
    """
    out = []
    if declared_executor_memory:
        cores = max(1, executor_cores or 1)
        where = " (declared; local mode does not enforce it)" if local else ""
        out.append(_Budget(declared_executor_memory // cores,
                           f"spark.executor.memory {format_bytes(declared_executor_memory)} / {cores} slots{where}",
                           "spark.executor.memory"))
    if pyspark_worker_mb:
        out.append(_Budget(pyspark_worker_mb * _MB, f"spark.executor.pyspark.memory share {pyspark_worker_mb} MiB",
                           "spark.executor.pyspark.memory"))
    if host_available:
        n = max(1, tasks_on_host)
        out.append(_Budget(host_available // n, f"available on the host {format_bytes(host_available)} / {n} tasks",
                           "host"))
    return sorted(out, key=lambda b: b.bytes)


# -- the executor probe (runs in Spark tasks) -------------------------------------------------------
def _java_version(java: str | None = None, timeout: float = 10.0) -> str | None:
    """The version ``java -version`` reports (``17.0.15``), or None."""
    java = java if java and os.path.exists(java) else java_executable()
    if not java:
        return None
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r'version "([^"]+)"', out.stderr + out.stdout)
    return m.group(1) if m else None


def _proc_bytes(path: str, key: str) -> int | None:
    """The ``key:`` line of a ``/proc`` file (in kB) as bytes; ``None`` when the file cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":")), None)
    except OSError:
        return None


def _host_available_bytes() -> int | None:
    """Memory available to new allocations on this host: MemAvailable, capped by a cgroup limit."""
    avail = _proc_bytes("/proc/meminfo", "MemAvailable")
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = None
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            raw = Path(limit_file).read_text(encoding="ascii").strip()
            if not raw.isdigit() or int(raw) >= 1 << 60:
                continue
            free = int(raw) - int(Path(usage_file).read_text(encoding="ascii"))
            avail = free if avail is None else min(avail, free)
            break
        except (OSError, ValueError):
            continue
    return avail


def _rss_bytes() -> int | None:
    rss = _proc_bytes("/proc/self/status", "VmRSS")
    if rss is not None:
        return rss
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except (ImportError, OSError):
        return None


def _local_versions() -> dict[str, Any]:
    import pyspark
    import torch

    import sparknet

    return {"python": platform.python_version(), "torch": torch.__version__, "pyspark": pyspark.__version__,
            "sparknet": sparknet.__version__}


def _probe(payload: bytes | None, hold_s: float):
    """Spark task body: facts about this executor's Python worker as one JSON-able dict."""

    def run(index, _rows):
        t0 = time.perf_counter()
        info: dict[str, Any] = {"task": index, "host": socket.gethostname(), "pid": os.getpid(),
                                "executor_pid": os.getppid()}
        try:
            info.update(_local_versions())
        except Exception as e:  # noqa: BLE001 - reported as a FAIL row
            info["import_error"] = f"{type(e).__name__}: {e}"
        info.update(java=_java_version(), rss=_rss_bytes(), host_available=_host_available_bytes())
        mb = os.environ.get("PYSPARK_EXECUTOR_MEMORY_MB")
        info["pyspark_worker_mb"] = int(mb) if mb and mb.lstrip("-").isdigit() and int(mb) > 0 else None
        if payload is not None:
            try:
                from pyspark import cloudpickle

                cloudpickle.loads(payload)
                info["unpickle"] = None
            except Exception as e:  # noqa: BLE001 - reported as a FAIL row
                info["unpickle"] = f"{type(e).__name__}: {e}"
        # Hold the slot a moment so the other probe tasks land on the other slots.
        time.sleep(max(0.0, hold_s - (time.perf_counter() - t0)))
        yield json.dumps(info)

    return run


def _barrier_probe(local: bool, connect_timeout: float):
    """Barrier task body: meet at allGather, then connect to a port the first task listens on."""

    def run(_rows):
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        server = None
        try:
            if rank == 0:
                host = "127.0.0.1" if local else ctx.getTaskInfos()[0].address.rsplit(":", 1)[0]
                server = socket.create_server((host if local else "", 0))
                server.listen(len(ctx.getTaskInfos()))
                addresses = ctx.allGather(f"{host}:{server.getsockname()[1]}")
            else:
                addresses = ctx.allGather("")
            host, port = addresses[0].rsplit(":", 1)
            error = ""
            try:
                with socket.create_connection((host, int(port)), timeout=connect_timeout):
                    pass
            except OSError as e:
                error = f"{socket.gethostname()} could not connect to {host}:{port}: {e}"
            results = ctx.allGather(error)
        finally:
            if server is not None:
                server.close()
        yield json.dumps({"rank": rank, "world": len(addresses), "errors": [e for e in results if e]})

    return run


# -- helpers on the driver --------------------------------------------------------------------------
def _run_job(sc, description: str, fn: Callable[[], Any], timeout_s: float):
    """Run ``fn`` (which starts Spark jobs) under its own job group, waited for at most ``timeout_s``.

    Returns ``(value, error)``: a finding, not a failure of the doctor. On timeout the job group is
    cancelled and the error is a :class:`~sparknet.errors.DeadlineExceeded` (a ``TimeoutError``);
    otherwise it is Spark's own error, whose text the checks read for their advice.
    """
    try:
        return run_with_deadline(sc, f"sparknet-doctor-{uuid.uuid4().hex[:8]}", f"sparknet doctor: {description}", fn,
                                 timeout_s=timeout_s, what=description), None
    except Exception as e:  # noqa: BLE001 - handed to the caller as a finding
        return None, e.__cause__ if isinstance(e.__cause__, Exception) else e


def _error_text(e: BaseException, limit: int = 300) -> str:
    # Py4J and Spark wrap Python errors in long traces: keep the last meaningful line.
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = next((ln for ln in reversed(lines) if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln)),
                lines[0] if lines else type(e).__name__)
    return text[:limit]


def _major(version: str | None) -> str | None:
    if not version:
        return None
    head = version.split(".")
    return head[1] if head[0] == "1" and len(head) > 1 else head[0]  # 1.8 -> 8


def _resolve_net(model: Any, batch_size: int | None):
    """(name, NetParams or module) for a zoo name, a model folder, a NetParams or a module."""
    import inspect

    from sparknet import zoo

    if isinstance(model, str):
        if os.path.isdir(model):
            from sparknet import model_io

            saved = model_io.load_model(model)
            return os.path.basename(os.path.normpath(model)), (saved.net_params or saved.module)
        key = model.strip().lower().replace("-", "_")
        if key not in zoo.MODELS:
            raise ValueError(f"unknown model {model!r}: give a zoo name ({sorted(zoo.MODELS)}) or a model folder")
        takes = inspect.signature(zoo.MODELS[key]).parameters
        kwargs: dict[str, Any] = {}
        if "batch_size" in takes and batch_size:
            kwargs["batch_size"] = batch_size
        if "vocab_size" in takes:
            kwargs["vocab_size"] = 128
        return key, zoo.get_model(key, **kwargs)
    return type(model).__name__, model


def _training_function(net_def, solver_dict: dict | None, batch_size: int):
    """A training function like the engines ship to executors: builds the net, trains some steps."""

    def train(x, y, steps: int = 1):
        from sparknet.datasets import ArrayDataset
        from sparknet.net import Net
        from sparknet.solvers import SolverConfig

        solver = SolverConfig.from_dict(solver_dict) if solver_dict else None
        net = Net(net_def, solver, batch_size=batch_size, seed=0)
        net.set_training_data(ArrayDataset(x, y))
        return net.train(steps)

    return train


# -- the checks -----------------------------------------------------------------------------------------
def run_doctor(master: str | None = None, *, model: Any = "lenet", data: str | None = None,
               batch_size: int = 64, solver_type: str = "sgd", workers: int | None = None,
               executor_memory: str | int | None = None, conf: dict[str, str] | None = None, spark=None,
               train_fn: Callable | None = None, skew_ratio: float = 2.0, timeout_s: float = 120.0,
               barrier: bool = True, features_col: str = "features", procs_per_worker: int = 1,
               model_parallel: int = 1, shard_replica: bool = False, data_mode: str = "auto") -> list[CheckResult]:
    """Check a cluster (or ``local[K]``) for training ``model``; return one row per finding, in the order
    checked: any ``Status.FAIL`` means training would fail as things are.

    Parameters
    ----------
    master : str, optional
        Spark master URL for a new session (default ``local[*]``); ignored when a session
        is given or already running.
    model : str, NetParams or torch.nn.Module
        A zoo name (``lenet``, ``alexnet``...), a model folder, or the net itself.
    data : str, optional
        A Parquet file or folder of training data: rows per partition (skew) and the
        partition's memory.
    batch_size : int
        Minibatch size of each worker.
    solver_type : str
        Update rule (its state counts towards memory).
    workers : int, optional
        Workers K the run will use (default: the session's default parallelism).
    executor_memory : str or int, optional
        The executors' memory (``2g``; an int is MiB). Set as ``spark.executor.memory`` on a
        new session, and held against the model in any case.
    conf : dict, optional
        More Spark settings for a new session.
    spark : SparkSession, optional
        The session to use (left running).
    train_fn : callable, optional
        Your training function, to check that it pickles (default: one like sparknet's own).
    skew_ratio : float
        Largest over mean rows per partition above which the data is called skewed.
    timeout_s : float
        Limit of each Spark job the doctor runs.
    barrier : bool
        Run the barrier-stage check.
    features_col : str
        The data's features column (its width counts towards memory).
    procs_per_worker, model_parallel, shard_replica : int, int, bool
        The worker's processes, as ``sparknet train`` takes them: each is one task, and holds its part of the
        weights and solver state (split M ways, sharded over the worker's copies). ``model_parallel`` alone is a
        worker of M processes.
    data_mode : str
        ``memory``, ``stream`` or ``auto``, as ``sparknet train --data-mode``: held in memory, a process holds its
        partition (a split copy's process, the copy's M partitions); streamed, one window of it; ``auto`` streams
        where the rows would take more than half of a task's budget, as training does.
    """
    import torch

    from sparknet.spark.session import get_session, is_local_master

    results: list[CheckResult] = []
    add = results.append
    t0 = time.perf_counter()

    M = max(1, model_parallel)
    G = max(procs_per_worker, M)
    if G % M:
        raise ValueError(f"--model-parallel {M} must divide --procs-per-worker {G}")
    from sparknet._enums import parse_enum
    from sparknet.spark.data import DataMode

    rows = _Rows(parse_enum(DataMode, data_mode, "data mode"), split=M)
    name, net = _resolve_net(model, batch_size)
    module = net.build(seed=0) if hasattr(net, "build") else net
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"model must be a zoo name, a model folder, a NetParams or a torch.nn.Module, got {type(net)}")
    estimate = estimate_training_memory(net, batch_size=batch_size, solver_type=solver_type, module=module,
                                        model_parallel=M, shard=G // M if shard_replica else 1)
    payload = _check_pickle_on_driver(add, name, net, module, train_fn, batch_size)

    own_session = spark is None and _no_active_session()
    settings = dict(conf or {})
    if executor_memory is not None:
        settings["spark.executor.memory"] = (f"{executor_memory}m" if isinstance(executor_memory, int)
                                             else str(executor_memory))
    if spark is None:
        try:
            spark = get_session(master, app_name="sparknet-doctor", conf=settings)
        except Exception as e:  # noqa: BLE001 - the finding: Spark would not start for training either
            add(_session_failure(e, master, settings))
            _check_memory(add, estimate, [], {}, declared=settings.get("spark.executor.memory"),
                          cores=_executor_cores(settings.get("spark.executor.cores"), master or "local[*]", {}),
                          local=is_local_master(master or "local[*]"), rows=rows)
            return results
    try:
        sc = spark.sparkContext
        running_master = sc.master
        local = is_local_master(running_master)
        slots = sc.defaultParallelism
        K = workers * G if workers else slots  # tasks: each of a worker's processes is one, on its own partition
        driver = _check_driver_versions(add, spark)

        probes, error = _run_job(sc, "probe executors",
                                 lambda: [json.loads(s) for s in sc.parallelize(range(slots), slots)
                                          .mapPartitionsWithIndex(_probe(payload, 0.3)).collect()], timeout_s)
        if error is not None:
            add(_probe_failure(error, timeout_s))
            probes = []
        executors = _group_executors(probes, local)
        if probes:
            add(CheckResult("executors", "cluster", Status.OK,
                            f"{len(probes)} task slots answered on {len(executors)} executor(s), "
                            f"{len({p['host'] for p in probes})} host(s) ({running_master})"))
        for where, tasks in executors.items():
            _check_executor_versions(add, where, tasks[0], driver)
            _check_unpickle(add, where, tasks)

        # Data first: the partition a worker holds counts towards its memory.
        if data is not None:
            rows = replace(rows, partition=_check_data(add, spark, data, K, skew_ratio, features_col, timeout_s))
        declared = settings.get("spark.executor.memory") or sc.getConf().get("spark.executor.memory", None)
        cores = _executor_cores(sc.getConf().get("spark.executor.cores", None), running_master, executors)
        _check_memory(add, estimate, probes, executors, declared=declared, cores=cores, local=local, rows=rows)
        if barrier:
            _check_barrier(add, sc, slots, local, timeout_s)
    finally:
        if own_session:
            spark.stop()
    log.info("doctor finished in %.1f s: %d checks, %d FAIL", time.perf_counter() - t0, len(results),
             sum(r.status is Status.FAIL for r in results))
    return results


def _check_driver_versions(add, spark) -> dict[str, Any]:
    """The driver's versions row; returns the versions (Java's included) the executors are held to."""
    try:
        java = spark.sparkContext._jvm.System.getProperty("java.version")
    except Exception:  # noqa: BLE001 - Spark Connect has no JVM handle here
        java = _java_version()
    v = {**_local_versions(), "java": java}
    detail = (f"Python {v['python']}, Java {java or '?'}, Spark {spark.version} (pyspark {v['pyspark']}), "
              f"torch {v['torch']}, sparknet {v['sparknet']}")
    java_major = _major(java)
    too_old = java_major is not None and java_major.isdigit() and int(java_major) < 17
    add(CheckResult("versions", "driver", Status.FAIL if too_old else Status.OK, detail,
                    "Spark 4 needs Java 17 or newer: set JAVA_HOME to a Java 17+ installation" if too_old else ""))
    return v


def _check_pickle_on_driver(add, name: str, net, module, train_fn, batch_size: int) -> bytes | None:
    """Pickle the net definition, the module and the training function; the bytes executors load."""
    import pickle

    from pyspark import cloudpickle

    from sparknet.config import RunConfig

    fn = train_fn if train_fn is not None else _training_function(
        net, RunConfig(batch_size=batch_size).solver().to_dict() if hasattr(net, "build") else None, batch_size)
    what = "your training function" if train_fn is not None else "a training function"
    try:
        t = time.perf_counter()
        module_bytes = cloudpickle.dumps(module)
        cloudpickle.loads(module_bytes)
        payload = cloudpickle.dumps((net, fn))
        pickle.loads(payload)
        add(CheckResult("pickle", "driver", Status.OK,
                        f"model {name} ({format_bytes(len(module_bytes))} pickled) and {what} "
                        f"({format_bytes(len(payload))} with the net definition) pickle with cloudpickle "
                        f"in {time.perf_counter() - t:.2f} s"))
        return payload
    except Exception as e:  # noqa: BLE001 - the finding
        add(CheckResult("pickle", "driver", Status.FAIL, f"cloudpickle failed: {_error_text(e)}",
                        "a closure sent to executors must capture plain values only: move open files, locks, "
                        "sessions and sockets out of it (build them inside the function)"))
        return None


def _probe_failure(error: BaseException, timeout_s: float) -> CheckResult:
    text = _error_text(error)
    if isinstance(error, TimeoutError):
        fix = ("no executor ran the probe in time: check that executors are registered (Spark UI) and that the "
               f"cluster has free cores, or raise --timeout (now {timeout_s:.0f} s)")
    elif "No module named 'sparknet'" in text or "No module named 'torch'" in text:
        fix = ("install sparknet and torch on every node, or ship them: spark-submit --archives env.tar.gz#env "
               "with spark.pyspark.python=./env/bin/python (a packed virtualenv or conda env)")
    elif "different version" in text or "PYTHON_VERSION_MISMATCH" in text:
        fix = ("executors run another Python than the driver: set spark.pyspark.python (and PYSPARK_PYTHON) to "
               "the same Python version on every node")
    else:
        fix = "read the executor logs for the first failed task; rerun with --verbose"
    return CheckResult("executors", "cluster", Status.FAIL, f"the probe job failed: {text}", fix)


def _group_executors(probes: Sequence[dict], local: bool) -> dict[str, list[dict]]:
    """Probe results grouped by executor (host and the Python daemon's parent, the executor JVM), keyed by the
    table's ``where``: ``executor HOST/PID``, or ``local executor`` for the one executor of a local master."""
    out: dict[str, list[dict]] = {}
    for p in sorted(probes, key=lambda p: p["task"]):
        out.setdefault(f"{p['host']}/{p['executor_pid']}", []).append(p)
    return {("local executor" if local and len(out) == 1 else f"executor {key}"): tasks for key, tasks in out.items()}


def _check_executor_versions(add, where: str, probe: dict, driver: dict) -> None:
    if probe.get("import_error"):
        add(CheckResult("versions", where, Status.FAIL, f"cannot import on the executor: {probe['import_error']}",
                        "install sparknet and torch on every node, or ship a packed environment with "
                        "spark-submit --archives env.tar.gz#env and spark.pyspark.python=./env/bin/python"))
        return
    fails, warns = [], []
    if probe["python"] != driver["python"]:  # another minor version fails, another patch level warns
        same_minor = probe["python"].split(".")[:2] == driver["python"].split(".")[:2]
        (warns if same_minor else fails).append(f"Python {probe['python']} (driver {driver['python']})")
    for key in ("torch", "sparknet", "pyspark"):
        if probe.get(key) != driver.get(key):
            fails.append(f"{key} {probe.get(key)} (driver {driver.get(key)})")
    java = probe.get("java")
    if java is None:
        warns.append("could not run java -version on the executor")
    elif _major(java) != _major(driver.get("java")):
        warns.append(f"Java {java} (driver {driver.get('java')})")
    detail = (f"Python {probe['python']}, Java {java or '?'}, pyspark {probe['pyspark']}, torch {probe['torch']}, "
              f"sparknet {probe['sparknet']}")
    if fails:
        add(CheckResult("versions", where, Status.FAIL, "differs from the driver: " + "; ".join(fails + warns),
                        "use one environment everywhere: pip install the driver's versions on every node "
                        f"(torch=={driver['torch']}, sparknet=={driver['sparknet']}, pyspark=={driver['pyspark']}), "
                        "or ship the driver's packed environment with spark-submit --archives"))
    elif warns:
        add(CheckResult("versions", where, Status.WARN, detail + "; " + "; ".join(warns),
                        "the same Java and Python patch level everywhere avoids surprises"))
    else:
        add(CheckResult("versions", where, Status.OK, detail + " (as on the driver)"))


def _check_unpickle(add, where: str, tasks: list[dict]) -> None:
    errors = [t["unpickle"] for t in tasks if t.get("unpickle")]
    if "unpickle" not in tasks[0]:
        return  # nothing was sent (the driver-side pickle failed and says so)
    if errors:
        add(CheckResult("pickle", where, Status.FAIL, f"the model and training function do not load: {errors[0]}",
                        "the executors must import every module the function uses: install it there or ship it "
                        "with spark-submit --py-files / --archives"))
    else:
        add(CheckResult("pickle", where, Status.OK, f"the model and training function load in {len(tasks)} task(s)"))


def _session_failure(error: BaseException, master: str | None, settings: dict) -> CheckResult:
    text = _error_text(error)
    if re.search(r"INVALID_EXECUTOR_MEMORY|Executor memory \d+ must be at least \d+", str(error)):
        least = re.search(r"must be at least (\d+)", str(error))
        floor = int(least.group(1)) if least else 450 * _MB
        fix = (f"set --conf spark.executor.memory={_spark_size(floor)} or more (Spark's own minimum is "
               f"{format_bytes(floor)}; the memory row below says what the model needs)")
        text = f"Spark refuses spark.executor.memory={settings.get('spark.executor.memory')}: " + text
    elif "JAVA_HOME" in str(error) or "Java gateway" in str(error):
        fix = "install Java 17 or newer and set JAVA_HOME to it"
    else:
        fix = f"check the master URL ({master or 'local[*]'}) and the --conf settings; rerun with --verbose"
    return CheckResult("spark", "driver", Status.FAIL, f"could not start Spark: {text}", fix)


def _executor_cores(value: str | None, master: str, executors: dict[str, list[dict]]) -> int:
    if value:
        return int(value)
    slots = executor_slots(master)
    return slots if slots is not None else max((len(t) for t in executors.values()), default=1)


@dataclass(frozen=True)
class _Rows:
    """How a process will hold its training rows: ``data_mode``, the bytes of one partition's rows, and M (a split
    copy's process holds the copy's M partitions in memory)."""

    mode: Any
    split: int = 1
    partition: int = 0

    def held(self, budget: int | None) -> tuple[int, str]:
        """The bytes of rows a process holds under a task budget of ``budget`` (``None``: not known), and how."""
        from sparknet.config import DistributedConfig
        from sparknet.spark.data import STREAM_FRACTION, DataMode

        whole = self.partition * self.split
        streams = self.mode is DataMode.STREAM or (self.mode is DataMode.AUTO and budget is not None
                                                   and whole > STREAM_FRACTION * budget)
        if not streams:
            return whole, "in memory" + (f", the {self.split} partitions of its split copy" if self.split > 1 else "")
        window = DistributedConfig.stream_buffer_mb << 20
        return min(self.partition, window), "streamed through one window"


def _check_memory(add, estimate: MemoryEstimate, probes: list[dict], executors: dict[str, list[dict]], *,
                  declared: str | None, cores: int, local: bool, rows: _Rows) -> None:
    """Hold the estimate (with each executor's measured runtime, and the rows as each process holds them) against
    each executor's budget."""
    declared = parse_memory(declared) if declared else None
    tasks_per_host = Counter(p["host"] for p in probes)
    for where, tasks in (executors.items() if probes else [("cluster", [{}])]):  # no probes: the declared only
        probe = tasks[0]
        budgets = task_memory_budget(declared_executor_memory=declared, executor_cores=cores,
                                     pyspark_worker_mb=probe.get("pyspark_worker_mb"),
                                     host_available=probe.get("host_available"),
                                     tasks_on_host=tasks_per_host[probe.get("host")], local=local)
        data, how = rows.held(budgets[0].bytes if budgets else None)
        est = replace(estimate, runtime=max((t.get("rss") or 0) for t in tasks), data=data)
        _memory_row(add, where, est, budgets, cores, rows=how if data else None)


def _memory_row(add, where: str, est: MemoryEstimate, budgets: list, cores: int, rows: str | None = None) -> None:
    need = est.total
    detail = f"one task needs about {format_bytes(need)} ({est.describe()}{'; rows ' + rows if rows else ''})"
    if not budgets:
        add(CheckResult("memory", where, Status.WARN, detail + "; no memory limit known",
                        "set spark.executor.memory so the doctor can check it"))
        return
    tight = budgets[0]
    detail += f"; budget {format_bytes(tight.bytes)} per task ({tight.source})"
    if need <= MEMORY_HEADROOM * tight.bytes:
        add(CheckResult("memory", where, Status.OK, detail))
        return
    status = Status.FAIL if need > tight.bytes else Status.WARN
    want = need / MEMORY_HEADROOM
    if tight.fix == "spark.executor.memory":
        fix = (f"set --conf spark.executor.memory={_spark_size(want * max(1, cores))} "
               f"(or fewer cores per executor, or a smaller --batch-size)")
    elif tight.fix == "spark.executor.pyspark.memory":
        fix = f"set --conf spark.executor.pyspark.memory={_spark_size(want * max(1, cores))} (or unset it)"
    else:
        fix = ("run fewer tasks per host (spark.executor.cores, local[K]) or a smaller --batch-size; "
               f"each task needs {format_bytes(want)}")
    if est.activations > est.total / 2:
        fix += f"; activations dominate: halving --batch-size saves {format_bytes(est.activations / 2)}"
    if est.weights + est.gradients + est.optimizer + est.communication > est.total / 2:
        fix += ("; the weights and solver state dominate: the processes of a worker with --shard-replica "
                "(--procs-per-worker G) each hold 1/G of them")
    if rows is not None and rows.startswith("in memory") and est.data > est.total / 2:
        fix += "; the rows dominate: --data-mode stream holds one window of them"
    add(CheckResult("memory", where, status, detail, fix))


def _check_data(add, spark, path: str, K: int, skew_ratio: float, features_col: str, timeout_s: float) -> int:
    """Rows per partition of a Parquet data set; returns the bytes one worker holds (estimate)."""
    from pyspark.sql import functions as F

    sc = spark.sparkContext

    def count():
        df = spark.read.parquet(path)
        parts = df.rdd.getNumPartitions()
        rows = {r["p"]: r["n"] for r in df.groupBy(F.spark_partition_id().alias("p")).count()
                .withColumnRenamed("count", "n").collect()}
        first = df.select(features_col).first() if features_col in df.columns else None
        width = None
        if first is not None:
            width = len(first[0].toArray() if hasattr(first[0], "toArray") else first[0])
        return parts, [int(rows.get(i, 0)) for i in range(parts)], width

    if not os.path.exists(path) and "://" not in path:
        add(CheckResult("data", path, Status.FAIL, "no such file or folder", "give the Parquet data's path"))
        return 0
    try:
        check_shared_path(spark, path, what="the data", timeout_s=timeout_s)
    except ValueError as e:
        add(CheckResult("data", path, Status.FAIL, str(e).removesuffix(f"; {SHARED_PATH_FIX}"), SHARED_PATH_FIX))
        return 0
    except Exception as e:  # noqa: BLE001 - a finding: the executors could not be asked
        add(CheckResult("data", path, Status.FAIL, f"could not ask the executors about it: {_error_text(e)}",
                        "check that the executors run (the executors row above); rerun with --verbose"))
        return 0
    result, error = _run_job(sc, "count rows per partition", count, timeout_s)
    if error is not None:
        add(CheckResult("data", path, Status.FAIL, f"could not read it as Parquet: {_error_text(error)}",
                        "give a Parquet file or folder with 'features' and 'label' columns"))
        return 0
    parts, rows, width = result
    total = sum(rows)
    if total == 0:
        add(CheckResult("data", path, Status.FAIL, f"no rows in {parts} partition(s)", "give non-empty data"))
        return 0
    mean = total / len(rows)
    ratio = max(rows) / mean
    empty = sum(1 for r in rows if r == 0)
    detail = (f"{total} rows in {parts} partitions: {min(rows)} to {max(rows)} rows, max/mean {ratio:.2f}"
              + (f", {empty} empty" if empty else ""))
    if parts != K:  # the engines repartition to K partitions (balanced) when the counts differ
        add(CheckResult("skew", path, Status.OK, detail + f"; training repartitions it into {K} even partitions"))
    elif ratio > skew_ratio or empty:
        add(CheckResult("skew", path, Status.WARN, detail + f" (above {skew_ratio:g})",
                        f"repartition before training: df.repartition({K}) (the slowest partition sets each "
                        "epoch's pace and small partitions are cycled more often)"))
    else:
        add(CheckResult("skew", path, Status.OK, detail))
    worker_rows = math.ceil(total / K) if parts != K else max(rows)
    return int(worker_rows * (4 * (width or 0) + 8))


def _check_barrier(add, sc, slots: int, local: bool, timeout_s: float) -> None:
    def run():
        rdd = sc.parallelize(range(slots), slots).barrier().mapPartitions(_barrier_probe(local, 10.0))
        return [json.loads(s) for s in rdd.collect()]

    t = time.perf_counter()
    result, error = _run_job(sc, "barrier rendezvous", run, timeout_s)
    if error is not None:
        text = _error_text(error)
        if isinstance(error, TimeoutError) or "slots" in text.lower() or "concurrent" in text.lower():
            fix = (f"a barrier stage needs all {slots} slots at once: free the cluster or train with fewer workers "
                   "(--workers), or use --engine rounds, which needs no barrier")
        elif "dynamic allocation" in text.lower():
            fix = "set --conf spark.dynamicAllocation.enabled=false for the barrier engine, or use --engine rounds"
        else:
            fix = "use --engine rounds (no barrier stage), and read the executor logs for the failed task"
        add(CheckResult("barrier", "cluster", Status.FAIL, f"the barrier stage failed: {text}", fix))
        return
    errors = [e for r in result for e in r["errors"]]
    if errors or len(result) != slots:
        add(CheckResult("barrier", "cluster", Status.FAIL,
                        f"{len(result)} of {slots} tasks met; {errors[0] if errors else ''}".strip("; "),
                        "open the ports between executors (the barrier engine's tasks connect to each other on "
                        "ephemeral ports), or use --engine rounds"))
        return
    add(CheckResult("barrier", "cluster", Status.OK,
                    f"{slots} barrier tasks met at allGather and reached the first task's port "
                    f"in {time.perf_counter() - t:.1f} s"))


# -- the table ----------------------------------------------------------------------------------------
def format_table(results: Iterable[CheckResult], *, width: int = 110) -> str:
    """The rows as a plain-text table: check, where, status, detail; each fix on its own line below."""
    results = list(results)
    if not results:
        return "(no checks ran)"
    w_check = max(5, *(len(r.check) for r in results))
    w_where = min(28, max(5, *(len(r.where) for r in results)))
    w_status = 8
    w_detail = max(30, width - w_check - w_where - w_status - 6)
    lines = [f"{'check':<{w_check}}  {'where':<{w_where}}  {'status':<{w_status}}detail",
             f"{'-' * w_check}  {'-' * w_where}  {'-' * (w_status - 2)}  {'-' * min(w_detail, 40)}"]
    indent = " " * (w_check + w_where + w_status + 4)
    for r in results:
        where = r.where if len(r.where) <= w_where else "…" + r.where[-(w_where - 1):]
        detail = textwrap.wrap(r.detail, w_detail) or [""]
        lines.append(f"{r.check:<{w_check}}  {where:<{w_where}}  {r.status.value:<{w_status}}{detail[0]}")
        lines.extend(indent + d for d in detail[1:])
        if r.fix:
            lines.extend(indent + f for f in textwrap.wrap("fix: " + r.fix, w_detail))
    counts = {s: sum(r.status is s for r in results) for s in Status}
    lines += ["", f"{counts[Status.OK]} OK, {counts[Status.WARN]} WARN, {counts[Status.FAIL]} FAIL"]
    return "\n".join(lines)


def configure_command(p: argparse.ArgumentParser) -> None:
    """The arguments of ``sparknet doctor`` (``sparknet.cli`` lists the command)."""
    p.add_argument("--master", default=None, help="Spark master URL (default local[*])")
    p.add_argument("--model", default="lenet", help="zoo model name or model folder (default lenet)")
    p.add_argument("--data", default=None, help="Parquet training data: partition skew and memory")
    p.add_argument("--batch-size", type=int, default=64, help="minibatch size of each worker (default 64)")
    p.add_argument("--solver-type", default="sgd", choices=[t.value for t in SolverType],
                   help="update rule: its state counts towards memory")
    p.add_argument("--workers", type=int, default=None, help="workers K (default: the cluster's task slots)")
    p.add_argument("--procs-per-worker", type=int, default=1, help="processes G of each worker")
    p.add_argument("--model-parallel", type=int, default=1, help="processes M a copy's layers are split over")
    p.add_argument("--shard-replica", action="store_true", help="each worker's copies sharded over its processes")
    p.add_argument("--data-mode", default="auto", choices=("auto", "memory", "stream"),
                   help="how each process holds its rows, as for sparknet train")
    p.add_argument("--executor-memory", default=None,
                   help="executor memory to check against (e.g. 2g); also set as spark.executor.memory")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="more Spark settings")
    p.add_argument("--skew-ratio", type=float, default=2.0, help="max/mean rows per partition to warn above")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds each check's Spark job may take")
    p.add_argument("--no-barrier", action="store_true", help="skip the barrier-stage check")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.add_argument("--verbose", action="store_true", help="debug logging, Spark's included")
    p.set_defaults(_run=_run)


def _run(args: argparse.Namespace) -> int:
    conf = {}
    for item in args.conf:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--conf takes KEY=VALUE, got {item!r}")
        conf[key.strip()] = value.strip()
    if args.executor_memory is not None:
        parse_memory(args.executor_memory)  # a clear error before Spark starts
    results = run_doctor(args.master, model=args.model, data=args.data, batch_size=args.batch_size,
                         solver_type=args.solver_type, workers=args.workers, executor_memory=args.executor_memory,
                         conf=conf, skew_ratio=args.skew_ratio, timeout_s=args.timeout, barrier=not args.no_barrier,
                         procs_per_worker=args.procs_per_worker, model_parallel=args.model_parallel,
                         shard_replica=args.shard_replica, data_mode=args.data_mode)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
    else:
        print(format_table(results, width=max(80, shutil.get_terminal_size((120, 24)).columns)))
    return 1 if any(r.status is Status.FAIL for r in results) else 0
