"""Executor side of the barrier engine: one barrier stage, a gloo group, one allreduce per round.

Every task of the stage runs :func:`run_barrier`:

1. reads its partition's chunks into a :class:`~sparknet.net.Net` (once for the whole fit);
2. joins the stage's gloo group (:func:`rendezvous`: rank 0's ``TCPStore`` on a port the OS picks, its address
   shared by ``BarrierTaskContext.allGather``; a timeout on every collective);
3. runs the round loop (:func:`sparknet.loop.run_rounds`) with a :class:`~sparknet.collective.CollectiveExchange`:
   each round local steps, then ONE ``all_reduce`` of one flat buffer, so every rank forms the same mean, applies
   the same strategy step and sees the same evaluation;
4. rank 0 pushes a record per round to the driver over :mod:`sparknet.spark._channel`, and every
   ``state_every_rounds`` rounds the global weights and the strategy's state (what a restart starts from); on
   checkpoint rounds every rank sends its own state. Rank 0 returns the final weights and the history.

A stage starts at round 0 or where its start (a :class:`~sparknet.loop.ResumeState`) says (a restart or a resumed fit);
torch's global generator is reseeded every round from (seed, rank, round), as in the rounds
engine, so a resumed fit repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import gc
import ipaddress
import json
import logging
import contextlib
import os
import pickle
import socket
import struct
import time
from dataclasses import field, dataclass, replace
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from sparknet._malloc import large_blocks_mapped
from sparknet._transport import ClientKeys
from sparknet.collective import CollectiveExchange, FIELDS
from sparknet.config import Streaming
from sparknet.errors import NonFiniteUpdate, WorkerOutOfMemory
from sparknet.loop import FitPlan, ResumeState, WeightAverage, run_rounds
from sparknet.parallel.mesh import SharedStream, cut_state, init_layout, leave_process_group, share_data_over_mp
from sparknet.parallel.tensor import local_weight_bytes
from sparknet.weights import local_view
from sparknet.spark.backend import Held, task_error
from sparknet._tensortree import pack_tree
from sparknet.spark._channel import MetricsSender, _jsonable
from sparknet.rowfile import RowFile
from sparknet.spark.data import frame_chunks, write_chunks
from sparknet.spark.rounds.executor import (WorkerSpec, build_worker_net, export_worker_state, fault_hook, fit_dir,
                                           freeze_heap, give_rows, import_worker_state, peak_rss_mb, reset_peak_rss,
                                           round_seed, staged_here, task_device, worker_failure)
from sparknet.step import WorkerRanks, worker_seed
from sparknet.strategies import WorkerState

__all__ = ["run_barrier", "run_barrier_frame", "RESULT_SCHEMA", "rendezvous", "gloo_interface", "interface_for_address",
           "GroupPlan", "StagePlan", "FIELDS", "worker_order"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupPlan:
    """How the tasks of a barrier stage form their gloo group (the barrier engine's and model parallelism's)."""

    workers: int
    """The group's size: one rank per task."""
    local: bool
    """The tasks run on this machine (``local[...]``): the group stays on loopback."""
    rendezvous_timeout_s: float
    """Longest wait for every rank to join."""
    collective_timeout_s: float
    """Longest wait of one collective."""
    procs_per_worker: int = 1
    """G: consecutive ranks that make one worker (``workers`` counts ranks, G of them a worker)."""
    shard_replica: bool = False
    """A worker's weights and solver state are sharded over its G ranks (FSDP2)."""
    split: dict | None = None
    """A worker's layers are split over M of its ranks by this plan (layer name to ``column`` or ``row``: tensor
    parallelism, ``--model-parallel M``), the M ranks of a copy running every step on the copy's rows together."""
    model_parallel: int = 1
    """M, with ``split``: each worker's G ranks are G / M copies of its layers, each split over M consecutive ranks
    (the copies average their gradients every step)."""
    store: str | None = None
    """``host:port`` of the TCPStore the driver holds for the stage on a local master, every rank its client.
    ``None`` (a cluster, or a Spark Connect client): rank 0 holds it and tells the others its port with Spark's
    ``allGather``, which took 1.0 s where the ranks called it within 10 ms of each other (two cores, local[2])."""

    @property
    def parted(self) -> bool:
        """Each rank of a worker holds a part of its weights (a sharded or split replica), not the whole."""
        return self.shard_replica or self.split is not None

    @property
    def parts(self) -> int:
        """The ranks one copy of a worker's weights is cut over: a split copy's M, a sharded replica's G (split too,
        or not)."""
        return self.model_parallel if self.split is not None and not self.shard_replica else self.procs_per_worker


@dataclass(frozen=True)
class StagePlan:
    """What every task of a barrier-engine stage gets from the driver, besides the weights and the data."""

    group: GroupPlan
    fit: FitPlan
    """The fit's rules (each rank follows its own copy; a restart's counters and states come in its start)."""
    endpoint: str | None = None
    """The driver's metrics channel (``None``: no channel)."""
    channel_bytes: int | None = None
    """The most bytes of one message the channel takes (a larger state is not sent: the rank says so instead)."""
    keys: ClientKeys | None = field(default=None, repr=False)
    """The channel's CurveZMQ client keys, made for this fit (its socket lets in no other peer); ``None`` on a local
    master, whose channel is a Unix socket only this user can open."""
    restart: int = 0
    """How many times the stage was started again (0 for the first attempt)."""
    state_every_rounds: int = 1
    """Rounds between the global weights and strategy state sent to the driver."""
    checkpoint_every: int | None = None
    """Rounds between checkpoints (every rank then sends its own state), or ``None``."""
    streaming: Streaming | None = None
    """Whether the round's exchange overlaps the next round's steps, or moves a fragment at a time."""
    staged: bool = False
    """The stage runs over the stage job's records, each partition's rows already in files on the machine that
    converted them (:func:`~sparknet.spark.rounds.executor.stage_frame`), not over its chunks."""
    parts: tuple = ()
    """A sharded replica's starting state, one broadcast a part of the worker (``{"global", "strategy", "average"}``,
    each cut by :meth:`~sparknet.net.Net.cut_layouts`): a rank reads its own part only, and builds its net on the
    meta device, so no rank ever holds the whole replica. Empty: every rank cuts the whole (a Spark Connect stage)."""

    def state_due(self, r: int, last: bool) -> bool:
        """Whether round ``r``'s global weights and strategy state go to the driver (``last``: the fit's last)."""
        every = self.checkpoint_every
        return last or r % self.state_every_rounds == 0 or bool(every and r % every == 0)


def run_barrier(payload_bc, params: StagePlan, val_bc=None):
    """The barrier stage's task function (``rdd.barrier().mapPartitionsWithIndex``)."""
    return lambda index, chunks: _guarded(payload_bc, params, val_bc, chunks)


STATE_PARTS = 16
"""The most tensors of the state rank 0 sends every round that go as frames of their own, each read where it lies
(a state with more is packed into one buffer): the driver's channel takes messages of this many frames and one."""

RESULT_SCHEMA = "kind string, rank long, payload binary, info string"
"""The rows of a barrier stage: a ``worker`` row per rank (its facts in ``info``), and rank 0's ``result`` (the
final weights as float32 bytes in ``payload``, empty where they went over the channel as a ``final`` record; the round
records in ``info``); as JSON in :func:`run_barrier_frame`'s stage."""


def run_barrier_frame(payload: Held, params: StagePlan, val: Held | None, float_labels: bool):
    """The barrier stage's task as a ``mapInArrow(..., barrier=True)`` function over :func:`~sparknet.spark.data.
    chunk_frame`'s DataFrame: the stage a Spark Connect session runs. Results come back as rows
    (:data:`RESULT_SCHEMA`), JSON and raw float32: nothing the client reads is unpickled."""

    def task(batches):
        import pyarrow as pa

        for kind, rank, body, info in _guarded(payload, params, val, frame_chunks(batches, float_labels)):
            yield pa.RecordBatch.from_arrays(
                [pa.array([kind]), pa.array([rank], pa.int64()), pa.array([body], pa.binary()),
                 pa.array([json.dumps(info, default=_jsonable)])], names=["kind", "rank", "payload", "info"])

    return task


def _guarded(payload_bc, params: StagePlan, val_bc, chunks):
    """One rank's stage (:func:`_run`), its failure told to the driver and raised as a worker's failure."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    rank = ctx.partitionId()
    try:
        yield from _run(ctx, rank, payload_bc, params, val_bc, chunks)
    except StuckPeers as exc:  # this rank is fine; the error names the rank it waited for
        failure = worker_failure(exc.ranks[0], exc)
        _report_failure(params, exc.ranks[0], exc, str(failure), collective=False)
        raise failure from None
    except Exception as exc:
        failure = worker_failure(rank, exc)
        _report_failure(params, rank, exc, str(failure), collective=_is_collective_failure(exc))
        if not params.endpoint and _is_collective_failure(exc):
            # no channel to tell the driver which rank failed first (a Spark Connect stage): a rank whose
            # collective broke because a peer failed waits a moment, so that Spark fails the stage with the
            # peer's own error (this task is killed meanwhile)
            time.sleep(PEER_FAILURE_GRACE_S)
        raise failure from None


PEER_FAILURE_GRACE_S = 5.0
"""Without a channel to the driver: how long a rank whose collective broke waits before it fails, so the rank
whose own failure broke it is the one Spark reports."""


class StuckPeers(RuntimeError):
    """A collective timed out because other ranks never reached it: they are the ones to name."""

    def __init__(self, ranks: list[int], waiter: int, round_index: int, timeout_s: float, cause: BaseException):
        self.ranks = ranks
        who = ", ".join(str(r) for r in ranks)
        super().__init__(f"rank {who} did not reach round {round_index + 1}'s exchange within collective_timeout_s="
                         f"{timeout_s:g} s (stuck in its local steps, or its process died); rank {waiter} waited for "
                         f"it ({type(cause).__name__}). Look at that task's executor log, or raise "
                         "EngineOptions.collective_timeout_s if its rounds are legitimately that long")


def _report_failure(params: StagePlan, rank: int, exc: BaseException, text: str, *, collective: bool) -> None:
    """Tell the driver which rank failed first, and why, before Spark fails the stage.

    When one rank raises, its peers soon fail too (their collectives lose the connection), and
    Spark reports whichever task failure it handles first; the driver uses these reports to
    name the rank that started it.
    """
    if not params.endpoint:
        return
    try:
        sender = MetricsSender(params.endpoint, params.keys, send_timeout_ms=2000, max_bytes=params.channel_bytes)
        try:
            sender.send({"event": "error", "rank": rank, "type": type(exc).__name__, "text": text[-8000:],
                         "collective": collective,
                         "time": time.time(),
                         # a restart would diverge, or run out of memory, the same way
                         "fatal": isinstance(exc, NonFiniteUpdate) or isinstance(task_error(text), WorkerOutOfMemory)})
        finally:
            sender.close()
    except Exception:  # pragma: no cover - the task fails anyway
        log.debug("could not report the failure of rank %d to the driver", rank, exc_info=True)


def _is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a consequence of a peer's failure (a broken or timed-out collective)."""
    text = f"{type(exc).__name__}: {exc}"
    return any(s in text for s in ("gloo", "Connection closed by peer", "Connection reset", "Broken pipe",
                                   "DistBackendError", "DistNetworkError", "timed out", "Timed out"))


def _loopback_ifname() -> str | None:
    try:
        return next((name for _, name in socket.if_nameindex() if name in ("lo", "lo0")), None)
    except OSError:  # pragma: no cover
        return None


def _interface_addresses() -> list[tuple[str, str]]:
    """(interface, address) pairs of this host: IPv4 by ``SIOCGIFADDR``, IPv6 from ``/proc/net/if_inet6`` (Linux)."""
    pairs = []
    with contextlib.suppress(ImportError, OSError):  # not Linux
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():  # struct ifreq: the name, then a sockaddr_in (its address at byte 20)
                with contextlib.suppress(OSError):  # the interface has no IPv4 address
                    reply = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                    pairs.append((name, socket.inet_ntoa(reply[20:24])))
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/net/if_inet6") as f:
        pairs += [(cols[5], str(ipaddress.ip_address(bytes.fromhex(cols[0])))) for cols in map(str.split, f)]
    return pairs


def interface_for_address(address: str) -> str | None:
    """The name of this host's network interface that holds ``address`` (IPv4 or IPv6), or ``None``.

    ``address`` must be an IP literal (brackets and a ``%zone`` are ignored); a name, or an address
    no interface holds, gives ``None``.
    """
    try:
        ip = ipaddress.ip_address(address.strip().strip("[]").split("%")[0])
    except ValueError:
        return None
    return next((name for name, a in _interface_addresses() if ipaddress.ip_address(a) == ip), None)


def _host_addresses(host: str) -> list[str]:
    """``host``'s IP addresses: itself when it is one, else what it resolves to (nothing when it does not)."""
    try:
        return list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)))
    except (OSError, UnicodeError):
        return []


def _route_source(host: str) -> str | None:
    """The source address this host uses to reach ``host`` (a UDP ``connect`` sends nothing)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except (OSError, UnicodeError, IndexError):
        return None


def gloo_interface(group: GroupPlan, spark_host: str, master_host: str) -> tuple[str | None, str]:
    """The interface gloo should use on this executor (``None``: leave gloo to its default), and why.

    On a cluster it is the interface holding this executor's Spark address (a name is resolved), else
    ``SPARK_LOCAL_IP``'s, else the one the route to rank 0 leaves by. Gloo's own default resolves the
    host's name, which many hosts map to 127.0.1.1: then ranks on different hosts cannot connect.
    """
    if group.local:
        name = _loopback_ifname()
        return name, ("local mode: every rank is on this machine" if name else
                      "local mode, but no loopback interface was found; gloo uses its default")
    candidates = [(spark_host, "this executor's Spark address"),
                  (os.environ.get("SPARK_LOCAL_IP", ""), "SPARK_LOCAL_IP"),
                  (_route_source(master_host) or "", f"the route to rank 0 at {master_host}")]
    for host, why in candidates:
        for address in _host_addresses(host) if host else []:
            name = interface_for_address(address)
            if name:
                return name, f"it holds {address}, {why}"
    return None, (f"no interface holds this executor's Spark address {spark_host!r}, SPARK_LOCAL_IP or the route "
                  "to rank 0; gloo falls back to the address of this host's name (set GLOO_SOCKET_IFNAME on the "
                  "executors if ranks on different hosts cannot connect)")


def worker_order(hosts: list[str], procs_per_worker: int) -> list[int]:
    """The tasks of a barrier stage in the order of their process-group ranks (rank r is task ``order[r]``).

    Worker w is ranks ``w*G .. w*G+G-1``. With one process a worker the order is the tasks' own; with G, the
    tasks are taken host by host (``hosts[i]``: task i's host; a host's tasks in their own order), so that the G
    ranks of a worker, whose gradients meet at every step, share a host wherever the hosts' task counts allow.
    """
    if procs_per_worker == 1:
        return list(range(len(hosts)))
    return sorted(range(len(hosts)), key=lambda i: (hosts[i], i))


def _task_hosts(ctx) -> list[str]:
    return [info.address.rsplit(":", 1)[0].strip("[]") for info in ctx.getTaskInfos()]


def rendezvous(ctx, rank: int, group: GroupPlan, order: list[int] | None = None):
    """Join the gloo process group of a barrier stage's tasks as ``rank``; returns the TCPStore (keep it alive).

    ``order[r]`` is the task that joins as rank r (:func:`worker_order`; default: task r).
    The store is the driver's (``group.store``), else rank 0's, reached at rank 0's Spark address (torch's store
    listens on every interface);
    gloo's interface is :func:`gloo_interface`'s unless ``GLOO_SOCKET_IFNAME`` is set already (the
    user's ``TP_SOCKET_IFNAME`` and ``GLOO_DEVICE_TRANSPORT`` are left alone too).
    """
    world = group.workers
    order = order or list(range(world))
    timeout = timedelta(seconds=group.rendezvous_timeout_s)
    task = order[rank]
    host = "127.0.0.1" if group.local else ctx.getTaskInfos()[task].address.rsplit(":", 1)[0].strip("[]")
    if group.store is not None:  # the driver's (a local master: every rank on this machine)
        store_host, store_port = group.store.rsplit(":", 1)
        store = dist.TCPStore(store_host, int(store_port), world, False, timeout=timeout)
        master_host = host
    else:
        store = dist.TCPStore(host, 0, world, True, timeout=timeout, wait_for_workers=False) if rank == 0 else None
        master_host, master_port = ctx.allGather(f"{host}:{store.port}" if rank == 0 else "")[order[0]].rsplit(":", 1)
        if rank != 0:
            store = dist.TCPStore(master_host, int(master_port), world, False, timeout=timeout)
    ifname = None
    if "GLOO_SOCKET_IFNAME" in os.environ:  # the user's choice wins
        log.info("rank %d: gloo uses GLOO_SOCKET_IFNAME=%s, as set", rank, os.environ["GLOO_SOCKET_IFNAME"])
    else:
        ifname, why = gloo_interface(group, host, master_host)
        if ifname:
            log.info("rank %d: gloo uses interface %s (%s)", rank, ifname, why)
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        else:
            log.warning("rank %d: %s", rank, why)
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=group.collective_timeout_s))
    finally:  # gloo read it when the group was made; the worker process may run other tasks
        if ifname:
            del os.environ["GLOO_SOCKET_IFNAME"]
    return store


def _run(ctx, rank: int, payload_bc, params: StagePlan, val_bc, chunks):
    # a sharded replica's rank: FSDP2's gathered layers go back to the OS as they are freed (sparknet._malloc)
    with large_blocks_mapped() if params.group.shard_replica else contextlib.nullcontext():
        yield from _rank(ctx, rank, payload_bc, params, val_bc, chunks)


def _rank(ctx, rank: int, payload_bc, params: StagePlan, val_bc, chunks):
    t_start = time.perf_counter()
    rss_start = reset_peak_rss()  # this task's peak, not an earlier one's in a reused worker
    packed, init_flat, start = payload_bc.value
    spec: WorkerSpec = pickle.loads(packed[1])
    world, G = params.group.workers, params.group.procs_per_worker
    torch.set_num_threads(spec.worker.threads)
    if params.staged:  # the stage job's files, mapped into memory or streamed, as the rounds engine does
        data = staged_rows(chunks, rank)
    else:  # written to this machine's disk chunk by chunk first
        data, _ = write_chunks(os.path.join(fit_dir(spec), f"rank{rank}"), chunks)
    device, device_info = task_device(spec.worker.device, rank)
    order = worker_order(_task_hosts(ctx), G)
    group_rank = order.index(rank)  # a worker's ranks consecutive, on one host where they can be
    # a split copy's ranks draw the same batches (and dropout masks): they seed as their copy, not as their task
    seed_index = group_rank // params.group.model_parallel if params.group.split is not None else rank
    # a sharded or split replica's rank makes its net once it is cut, its part only
    net = build_worker_net(spec, seed_index, data, "meta" if params.group.parted else device)
    del chunks
    freeze_heap()  # no full garbage collection of torch's modules in the middle of a round
    val, val_rows = None, None
    if val_bc is not None:
        # (x, y) or (x, y, w): a sharded replica's or a split copy's ranks score their share together; otherwise
        # each rank its own
        parts = params.group.parts
        share = slice(group_rank // parts, None, world // parts) if params.group.parted else slice(rank, None, world)
        val, val_rows = tuple(a[share] for a in val_bc.value), len(val_bc.value[0])
    sender = store = None
    history: list[dict] = []
    try:
        state_parts = params.group.parted and group_rank < params.group.parts
        if params.endpoint and (group_rank == 0 or params.checkpoint_every or state_parts):
            sender = MetricsSender(params.endpoint, params.keys, max_bytes=params.channel_bytes)
        store = rendezvous(ctx, group_rank, params.group, order)
        if sender is not None and group_rank == 0:
            sender.send({"event": "ready", "fit": spec.fit_id, "setup_s": time.perf_counter() - t_start})
        final, info = _round_loop(net, spec, rank, group_rank, init_flat, data, device, val, val_rows, params, sender,
                                  history, start, store, seed_index)
        yield ("worker", rank, b"", {"host": socket.gethostname(), "pid": os.getpid(), **device_info,
                                     "attempt": ctx.attemptNumber(), "rows": 0 if data is None else data.rows,
                                     "rss_start_mb": rss_start,
                                     "peak_rss_mb": None if rss_start is None else peak_rss_mb(), **info})
        if group_rank == 0 and final is None:  # a sharded or split replica's last state is the final weights: the
            yield ("result", 0, b"", history)  # driver joins them from its parts
        elif group_rank == 0:
            # over the channel where there is one: as a task result, a large net's weights would pass through the
            # JVM heaps of the executor and the driver in several copies (AlexNet's 244 MB filled a 2 GiB driver);
            # sent from where they lie (nothing writes into them now)
            weights = np.ascontiguousarray(final.numpy(), dtype=np.float32)
            sent = sender is not None and sender.send({"event": "final", "bytes": weights.nbytes}, weights)
            yield ("result", 0, b"" if sent else weights.tobytes(), history)
    finally:
        gc.unfreeze()
        if isinstance(data, RowFile) and not params.staged:  # staged files stay for a restart; the fit's end
            # removes them
            data.remove()
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(data.stem))
        leave_process_group()  # and the meshes made on it: Spark may reuse this process for another stage
        del store
        if sender is not None:
            sender.close()


class StagedRowsMissing(RuntimeError):
    """A partition's staged files are not on the machine Spark ran its barrier task on: the driver starts the stage
    again over the chunks (:func:`~sparknet.spark.barrier.driver.run_barrier_engine`)."""


def staged_rows(records, index: int) -> RowFile | None:
    """Partition ``index``'s rows from its stage-job record (``None``: it has none); :class:`StagedRowsMissing` where
    they were staged on another machine or are gone."""
    record = None
    for record in records:  # one record; read it all
        pass
    if record is None or record["rows"] == 0:
        return None
    rows = staged_here(record, index)
    if rows is None:
        raise StagedRowsMissing(f"partition {index}'s rows were staged on {record.get('host')} and are not on "
                                f"{socket.gethostname()}")
    return rows


class _BarrierExchange(CollectiveExchange):
    """The barrier engine's exchange: names a stuck peer at the collective's deadline, and reports every round to the
    driver (every rank: its own solver state on checkpoint rounds; group rank 0: when due, the global weights and
    strategy state, then the round's record, last on the same socket, so that a host lost once the driver has the
    record loses nothing sent with it). Each task marks in the stage's TCPStore which collective it reached: when one
    times out, the tasks without a mark are the stuck (or dead) ones. ``task``: this task's index (a worker of several
    processes is several tasks); ``reports``: it sends the round records (group rank 0)."""

    def __init__(self, *args, params: StagePlan, fit: FitPlan, sender, history: list, store, task: int,
                 reports: bool, state_part: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.params, self.fit, self.sender, self.history, self.store = params, fit, sender, history, store
        self.task, self.reports = task, reports
        # who sends the global weights and strategy state: rank 0, or each rank of a sharded or split replica's first
        # worker its part (``{"part": j, "parts": G, "layout": ...}``: the driver joins them)
        self.state_part = state_part
        self.holds_state = reports if state_part is None else bool(state_part)

    def _start(self, buf, n, plan, sent):
        self.store.set(f"arrived/{self.params.restart}/{plan.round}/{self.task}", "1")
        return super()._start(buf, n, plan, sent)

    def _missing(self, r: int) -> list[int]:
        try:
            return [i for i in range(self.params.group.workers) if i != self.task
                    and not self.store.check([f"arrived/{self.params.restart}/{r}/{i}"])]
        except Exception:  # the store's host is gone too: nothing to tell
            return []

    def _finish(self, flight):
        t_comm = time.perf_counter()
        try:
            return super()._finish(flight)
        except RuntimeError as exc:
            # only a wait that ran to the deadline points at a stuck peer; a peer that failed on its own
            # breaks the collective at once and reports its own error
            timeout_s, r = self.params.group.collective_timeout_s, flight.sent["round"]
            timed_out = time.perf_counter() - t_comm >= 0.9 * timeout_s
            stuck = self._missing(r) if timed_out else []
            if stuck:
                raise StuckPeers(stuck, self.task, r, timeout_s, exc) from exc
            raise

    def round_done(self, record, global_flat, progress):
        params, fit, sender, r = self.params, self.fit, self.sender, progress.round
        reason = record.get("stop_reason")
        if self.link is not None:
            record["link_s"] = record.get("link_s", 0.0) + self.eval_link_s  # none yet: an overlapped first round
        if params.restart:
            record["restarts"] = params.restart
        ckpt_every = params.checkpoint_every
        if sender is not None and self.holds_state and params.state_due(r, reason is not None):
            head = {"event": "state", **vars(progress), "iteration": self.net.iteration, **(self.state_part or {}),
                    **({} if fit.early_stop is None else {"early_stop": fit.early_stop.counters()})}
            # sent from where its tensors lie: nothing writes into a global buffer (each round makes a new one), the
            # strategy's state is a copy, and the average (updated in place every round) is copied here
            sent = sender.send(head,
                               pack_tree({"global": global_flat, "strategy": self.strategy.state_dict(),
                                          "auto_tau": None if fit.auto is None else fit.auto.state_dict(),
                                          **({} if fit.average is None else {"average": fit.average.flat.clone()})},
                                         parts=STATE_PARTS))
            if not sent:  # the channel full, or the state over its size: the driver records the rounds held behind it
                sender.send({"event": "state_lost", "round": r, "rank": self.task})
        if sender is not None and ckpt_every and self.has_data and (r % ckpt_every == 0 or reason is not None):
            sender.send({"event": "worker_state", "round": r, "rank": self.task},  # packed at once: one copy
                        pack_tree(export_worker_state(self.net, self.state, copy_tensors=False,
                                                      stream=self.stream_state())))
        if self.reports:  # last, on the same socket: the driver that has a round's record has the state sent with it
            self.history.append(record)
            if sender is not None:
                sender.send(record)


def _round_loop(net, spec: WorkerSpec, rank: int, group_rank: int, init_flat, data, device, val, val_rows,
                params: StagePlan, sender, history: list, start: ResumeState, store,
                seed_index: int) -> tuple[torch.Tensor | None, dict]:
    """Train round after round until the stop rule says so; returns the final global weights (``None`` where a
    sharded or split replica's ranks sent them in parts, as the last round's state) and this rank's place.

    ``rank``: this task's index (its partition); ``group_rank``: its rank in the stage's process group;
    ``seed_index``: the index its data order and its rounds' generator are seeded by. A worker of G processes is G
    consecutive group ranks, C = G / M copies of M (:func:`~sparknet.parallel.mesh.init_layout`; M = 1 unless the
    layers split): a copy's gradients meet its other copies' every step, and the round's exchange runs in each
    column, between the ranks of every worker that hold the same place (each column forms the same global weights
    from identical inputs)."""
    strategy = spec.strategy
    state = WorkerState()
    G, workers, sharded = params.group.procs_per_worker, params.group.workers, params.group.shard_replica
    split, M = params.group.split, params.group.model_parallel if params.group.split is not None else 1
    # the starting weights as the broadcast brought them (float32, this process's own copy: nothing writes into a
    # global buffer, each round makes a new one), not copied again
    global_flat = None if params.parts else torch.from_numpy(_own_float32(init_flat))
    average, best = start.average, start.best
    place: dict = {}
    outer = {"rank": group_rank, "world": workers}
    layout, state_part, strategy_state = None, None, start.strategy
    if G > 1:
        layout = init_layout(M, copies=G // M)  # the workers, each of G // M copies split in M parts
        # a sharded replica's parts are scored by the workers' ranks in each place, a split one's by every copy's
        scoring = (layout.dp_group if sharded else layout.part_group) if params.group.parted else None
        outer = {"rank": layout.dp_rank, "world": layout.data_parallel, "group": layout.dp_group,
                 "ranks": WorkerRanks(layout.inner_group, procs=G, sharded=sharded, split=split is not None),
                 "everyone": dist.group.WORLD, "scoring": scoring}
        place = {"worker": layout.dp_rank, "proc": layout.worker_rank, "group_rank": group_rank,
                 **({"copy": layout.inner_rank} if 1 < M < G else {})}
    if split is not None and spec.stream:  # a copy's ranks draw each batch together, each from its own partition
        data = SharedStream(data.stream(seed=worker_seed(spec.worker.seed, rank), sample_shape=spec.sample_shape,
                                        buffer_bytes=spec.stream_buffer_bytes), layout)
    elif split is not None:  # the copy's ranks run every step together, on the rows of all its partitions
        data = share_data_over_mp(*(data.arrays() if data is not None else (None, None)), layout)
        data = None if data[0] is None else data
    has_data = data is not None
    if params.group.parted:  # the net is cut and made, this rank's part only; the exchange runs on the parts
        if split is not None:  # on the meta device still where FSDP2 cuts its parts again
            net.split(layout.mp_mesh, split, "meta" if sharded else device)
        if sharded:
            net.shard(layout.inner_mesh, device)
        give_rows(net, spec, seed_index, data)
        parts, part = net.shard_layout(), layout.worker_rank if sharded else layout.mp_rank
        if params.parts:  # the driver cut the starting state: this rank reads its own part only
            mine = params.parts[part].value
            if parts != mine["layout"]:
                raise RuntimeError(f"{'FSDP2' if sharded else 'the split'} gave rank {group_rank} the parts {parts} of "
                                   f"the weights, where the driver cut them as {mine['layout']}")
            global_flat, strategy_state, average, best = mine["global"], mine["strategy"], mine["average"], mine["best"]
        else:  # a Spark Connect stage's ranks get the whole state in the stage's plan, and cut it
            whole = global_flat.numel()
            average, best = (None if flat is None else torch.as_tensor(np.asarray(flat, dtype=np.float32))
                             for flat in (average, best))
            global_flat, average, best = cut_state({"global": global_flat, "average": average, "best": best}, whole,
                                                   parts).values()
            if strategy_state is not None:
                strategy_state = cut_state(strategy_state, whole, parts)
        net.set_flat(global_flat)
        # the first copy of the first worker sends its parts of the state
        first = layout.dp_rank == 0 and layout.worker_rank < params.group.parts
        state_part = {"part": part, "parts": params.group.parts, "layout": parts} if first else {}
        place["weight_bytes"] = local_weight_bytes(net)
    if strategy_state is not None:
        strategy.load_state_dict(strategy_state)
    saved = start.workers.get(rank)
    if saved is not None and has_data:
        state = import_worker_state(net, saved)
    elif start.iteration is not None:
        net.set_iteration(start.iteration)  # a restart without solver state: momentum starts afresh
    fit = replace(params.fit, strategy=strategy, progress=start.progress())
    if fit.auto is not None and start.auto_tau:
        fit.auto.load_state_dict(start.auto_tau)
    if fit.weight_ema is not None:  # a restarted stage continues the average rank 0 last sent
        fit.average = WeightAverage(fit.weight_ema, global_flat if average is None else
                                    torch.from_numpy(np.array(average, dtype=np.float32, copy=True)))
    if fit.early_stop is not None and best is not None:  # and early stopping, from the best weights rank 0 last sent
        fit.early_stop.restore(start.early_stop, torch.from_numpy(np.array(best, dtype=np.float32, copy=True)))
    exchange = _BarrierExchange(net, strategy, **outer, state=state, has_data=has_data,
                                validation=val, validation_rows=val_rows,
                                compression=spec.compression, link=spec.link,
                                seed_for_round=lambda r: round_seed(spec.worker.seed, seed_index, r),
                                after_train=fault_hook(spec.faults, rank, params.restart),
                                params=params, fit=fit, sender=sender, history=history, store=store,
                                streaming=params.streaming, task=rank, reports=group_rank == 0,
                                state_part=state_part, profile=spec.worker.profile, name=f"rank-{rank}",
                                outputs=spec.outputs)
    if saved is not None and has_data and saved.get("stream") is not None:  # a streamed worker's own weights
        exchange.load_stream_state(saved["stream"])
    final = run_rounds(exchange, fit, global_flat)
    if params.group.parted:
        place["solver_state_bytes"] = _solver_state_bytes(net)
    if params.group.parted and (params.parts or layout.dp_rank != 0):  # the driver joins the last state's parts
        final = None
    elif params.group.parted:  # no driver to join them (a Spark Connect stage): the first worker's ranks gather the
        net.set_flat(final)
        final = net.full_weights().to_flat(torch.float32)
    return final, place


def _own_float32(array) -> np.ndarray:
    """``array`` as a writable float32 array: itself where it is one, else a copy."""
    array = np.asarray(array)
    return array if array.dtype == np.float32 and array.flags.writeable else np.array(array, dtype=np.float32)


def _solver_state_bytes(net) -> int:
    """Bytes of solver state (momentum, Adam's moments) this rank holds."""
    return sum(local_view(v).nbytes for state in net.optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))
