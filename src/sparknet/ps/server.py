"""The parameter server: one thread on the driver serving pushes and pulls over ZeroMQ.

>>> with ParameterServer(initial_flat, "delta") as ps:        # doctest: +SKIP
...     creds = ps.new_job()                                  # per Spark job (epoch)
...     run_workers(ps.endpoint, creds)                       # they push and pull
...     final = ps.weights()

The server owns a ROUTER socket (:class:`~sparknet._transport.Listener`: only a peer holding
:attr:`ParameterServer.client_keys` finishes the handshake) bound to loopback by default, never every
interface unless asked for, and a thread that polls it with a short timeout, so
:meth:`ParameterServer.stop` always returns. Each request is answered at once: a push is checked,
combined into the server's copy by the :class:`~sparknet.ps.combiners.Combiner`, and answered with the
new copy, so a worker pushes and pulls in one round trip and never waits for another worker.

Every message goes through the same checks (see :mod:`sparknet.ps.wire`): structure, job id, dtype, element count
against the model, HMAC, kind, base version, replay. A message that fails one is rejected: counted under its reason in
:meth:`ParameterServer.stats`, logged (the first few per reason at WARNING, then a count at most once a minute, never
a traceback), answered with an error message naming the reason if a job's key signs it (nothing otherwise), and the
server goes on serving everyone else.

Idempotence under Spark retries: the server remembers, per worker (partition), the highest step whose push it applied
in the current job. A push from another attempt of the same partition for a step already applied is acknowledged with
status ``DUPLICATE`` and the current copy, and not applied again."""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import zmq

from sparknet._transport import ClientKeys, Limits, Listener, LogThrottle, ServerKeys
from sparknet.errors import EngineError
from sparknet.ps.combiners import Combiner, make_combiner
from sparknet.ps.wire import (DTYPES, FLAG_SEND_DELTA, HEADER_SIZE, TAG_SIZE, Header, JobCredentials, Kind,
                              Message, Reason, Status, WireError, decode, dtype_code, encode, verify)

__all__ = ["ParameterServer", "staleness_bucket"]

log = logging.getLogger(__name__)

_POLL_MS = 50
_RETIRED_JOBS = 8  # earlier jobs whose stragglers get a signed "wrong_job" answer


def staleness_bucket(s: int) -> str:
    """The histogram bucket of a staleness value: ``"0"``, ``"1"``, ``"2-3"``, ``"4-7"``, ..."""
    if s <= 1:
        return str(max(s, 0))
    lo = 1 << (s.bit_length() - 1)
    return f"{lo}-{2 * lo - 1}"


@dataclass
class _JobState:
    creds: JobCredentials
    last_step: dict[tuple[int, int], int] = field(default_factory=dict)   # (worker, attempt) -> last accepted step
    applied_step: dict[int, int] = field(default_factory=dict)            # worker -> highest applied push step


def _is_wildcard(host: str) -> bool:
    """Whether binding ``host`` listens on every interface (a name that is not an IP literal is not)."""
    host = host.strip().strip("[]")
    if host in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        pass
    try:  # the short forms the resolver accepts too: "0", "0.0", "0x0"...
        return socket.inet_aton(host) == bytes(4)
    except OSError:
        return False


class ParameterServer:
    """Asynchronous parameter server on the driver.

    Parameters
    ----------
    initial : array-like
        The model's flat weights (a 1-D float buffer, e.g. ``Net.get_flat()``); copied.
    combiner : str or Combiner
        How pushes merge (a name of :data:`~sparknet.ps.combiners.COMBINERS` or an instance).
    host : str
        Address to bind to: the driver's address on a cluster, loopback (the default) in local mode. A
        wildcard (``"*"``, ``""`` or any spelling of an unspecified address: ``"0.0.0.0"``, ``"0"``, ``"::"``...)
        binds every interface and is refused unless ``allow_all_interfaces`` is set.
    port : int
        0 lets the OS pick a free port (see :attr:`endpoint`).
    num_workers : int
        Workers expected (passed to the combiner).
    dtype : numpy dtype
        The dtype of the server's copy and of every payload (float32).
    limits : Limits, optional
        How long a peer may take to finish its handshake and stay silent (default: 10 s, and 30 s plus the time
        the biggest message takes at 10 MB/s).
    """

    def __init__(self, initial, combiner: str | Combiner = "delta", *, host: str = "127.0.0.1", port: int = 0,
                 num_workers: int = 1, dtype=np.float32, allow_all_interfaces: bool = False,
                 limits: Limits | None = None):
        if _is_wildcard(host) and not allow_all_interfaces:
            raise ValueError(f"refusing to bind the parameter server to every interface ({host!r}); give the "
                             "driver's address, or pass allow_all_interfaces=True if the network is trusted")
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self._dtype = np.dtype(dtype)
        self._dtype_code = dtype_code(self._dtype)
        flat = np.array(np.asarray(initial).reshape(-1), dtype=self._dtype, copy=True)
        if flat.size == 0:
            raise ValueError("the model has no weights to serve")
        self._flat = flat
        self._numel = int(flat.size)
        # the largest frame: a push of the whole model (twice: room for a bigger dtype), header and tag
        self._max_frame = 2 * self._numel * self._dtype.itemsize + HEADER_SIZE + TAG_SIZE + (1 << 20)
        self._limits = limits or Limits.for_frame(self._max_frame)
        self._keys = ServerKeys.new()
        self.combiner = make_combiner(combiner)
        self.num_workers = int(num_workers)
        self.host = host.strip()
        self._port = int(port)
        self._version = 0
        self._lock = threading.Lock()
        self._job: _JobState | None = None
        self._retired: dict[bytes, JobCredentials] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listener: Listener | None = None
        self._endpoint: str | None = None
        self._failure: BaseException | None = None
        self._last_heard = time.monotonic()
        # statistics
        self._rejects: Counter[str] = Counter()
        self._throttle = LogThrottle(log, "parameter server: messages rejected")  # 10 per reason, then a count
        self._counts: Counter[str] = Counter(busy_s=0.0)  # by the names stats() gives them, and staleness_sum
        self._stale_hist: Counter[str] = Counter()
        self._applied_by_worker: Counter[int] = Counter()

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` the workers connect to (after :meth:`start`)."""
        if self._endpoint is None:
            raise RuntimeError("the parameter server is not started")
        return self._endpoint

    @property
    def client_keys(self) -> ClientKeys:
        """The keys a worker connects with (:class:`~sparknet.ps.client.PSClient`'s ``keys``): hand them to the
        workers as the job's secret is, never in a log line."""
        return self._keys.client

    def start(self) -> ParameterServer:
        """Bind the socket and start the serving thread; returns self."""
        if self._thread is not None:
            raise RuntimeError("the parameter server is already started")
        self._listener = Listener(zmq.ROUTER, self._keys, self.host, max_frame=self._max_frame, limits=self._limits,
                                  logger=log, port=self._port)
        self._endpoint = self._listener.endpoint
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, name="sparknet-ps", daemon=True)
        self._thread.start()
        log.info("parameter server on %s: %d weights, %r, %d workers", self._endpoint, self._numel,
                 self.combiner, self.num_workers)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving: signal the thread, join it (with ``timeout``), close the sockets and the context."""
        thread = self._thread
        self._stop.set()
        try:
            if thread is not None:
                thread.join(timeout)
                if thread.is_alive():
                    log.error("the parameter server thread did not stop within %.1f s", timeout)
        finally:
            if self._listener is not None and (thread is None or not thread.is_alive()):
                self._listener.close()  # kept: its count of refused connections stays in stats()
            self._thread = None
            log.debug("parameter server on %s stopped", self._endpoint)

    def __enter__(self) -> ParameterServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        """Whether the serving thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def check_alive(self) -> None:
        """Raise ``EngineError`` if the serving thread died."""
        if self._failure is not None or (self._thread is not None and not self._thread.is_alive()):
            raise EngineError(f"the parameter server on {self._endpoint} stopped unexpectedly: {self._failure!r}")

    # -- jobs and state --------------------------------------------------------------------
    def new_job(self, creds: JobCredentials | None = None) -> JobCredentials:
        """Start serving a new job (one Spark job) under fresh (or given) credentials.

        Messages of the previous job are rejected from now on (``wrong_job``); the replay and idempotence tables start
        empty. The server's copy and version carry on."""
        creds = creds or JobCredentials.new()
        with self._lock:
            if self._job is not None:
                # Kept only to sign the "wrong_job" answer a straggler of that job gets.
                self._retired[self._job.creds.job_id] = self._job.creds
                while len(self._retired) > _RETIRED_JOBS:
                    self._retired.pop(next(iter(self._retired)))
            self._job = _JobState(creds)
            self._last_heard = time.monotonic()
        log.debug("parameter server job %s", creds.job_id.hex())
        return creds

    @property
    def last_heard(self) -> float:
        """``time.monotonic()`` of the last authenticated message of the current job (or of :meth:`new_job`)."""
        return self._last_heard

    def weights(self) -> np.ndarray:
        """A copy of the server's flat weights."""
        with self._lock:
            return self._flat.copy()

    def stats(self) -> dict:
        """Counters: pushes, pulls, duplicates, rejects by reason, staleness (mean, max, histogram)."""
        with self._lock:
            n = self._counts
            return {
                "version": self._version,
                **{k: n[k] for k in ("pushes_received", "pushes_applied", "duplicate_pushes", "pulls")},
                "rejected": dict(self._rejects),
                "rejected_total": sum(self._rejects.values()),
                "staleness_mean": n["staleness_sum"] / n["pushes_applied"] if n["pushes_applied"] else 0.0,
                "staleness_max": n["staleness_max"],
                "staleness_histogram": dict(sorted(self._stale_hist.items(), key=lambda kv: int(kv[0].split("-")[0]))),
                "applied_by_worker": {int(k): v for k, v in sorted(self._applied_by_worker.items())},
                **{k: n[k] for k in ("bytes_in", "bytes_out", "busy_s")},
                "connections_refused": self._listener.refused if self._listener is not None else 0,
            }

    # -- serving ---------------------------------------------------------------------------
    def _serve(self) -> None:
        listener = self._listener
        try:
            while not self._stop.is_set():
                if not listener.poll(_POLL_MS):  # handshakes waiting for the key check are answered too
                    continue
                for frames in listener.requests(256):  # drain what is queued, then look at the stop flag again
                    t0 = time.perf_counter()
                    out = self._handle(frames)
                    if out is not None:
                        listener.socket.send_multipart(out, copy=True)
                    self._counts["busy_s"] += time.perf_counter() - t0
        except zmq.ContextTerminated:
            pass
        except BaseException as e:  # the thread's own failure: recorded, logged, surfaced by check_alive()
            self._failure = e
            log.exception("the parameter server thread failed")

    def _reject(self, reason: Reason, detail: str, envelope: list, header: Header | None,
                creds: JobCredentials | None = None) -> list | None:
        """Count and log a refusal (:class:`~sparknet._transport.LogThrottle`: a flood costs a few lines); the
        answer, signed with ``creds``, goes only to a message that authenticated under them: an unauthenticated
        peer gets nothing (no signed text of its choosing, no oracle)."""
        label = reason.label
        with self._lock:
            self._rejects[label] += 1
        who = "" if header is None else (f" (claiming worker {header.worker} attempt {header.attempt} "
                                         f"step {header.step})")
        self._throttle(label, "parameter server rejected a message%s: %s, %s", who, label, detail)
        if creds is None or header is None:
            return None  # not authenticated: the sender's request times out
        h = Header(Kind.ERROR, 0, creds.job_id, header.worker, header.attempt, header.step, self._version, 0,
                   int(reason))
        return envelope + encode(h, None, creds.secret)

    def _handle(self, frames: list) -> list | None:
        # ROUTER: [identity, frames...]; a REQ peer adds an empty delimiter after the identity.
        if len(frames) >= 2 and len(frames[1].buffer) == 0 and len(frames) == 5:
            envelope, body = [frames[0].bytes, b""], frames[2:]
        else:
            envelope, body = [frames[0].bytes], frames[1:]
        self._counts["bytes_in"] += sum(len(f.buffer) for f in body)
        header = None
        creds = None  # the credentials the message authenticated under, once it has
        try:
            msg = decode(body)
            header = msg.header
            creds = self._authenticate(msg)
            reply = self._process(msg, envelope)
        except WireError as e:
            return self._reject(e.reason, str(e), envelope, header, creds)
        except Exception as e:  # a bug in a combiner or here: counted, the first few traced, serving goes on
            if self._throttle.counts[Reason.INTERNAL.label] < self._throttle.loud:
                log.exception("parameter server failed on a message")
            return self._reject(Reason.INTERNAL, f"{type(e).__name__}: {e}", envelope, header, creds)
        self._counts["bytes_out"] += sum(len(f) for f in reply[len(envelope):])
        return reply

    def _authenticate(self, msg: Message) -> JobCredentials:
        """The credentials ``msg`` is signed with: the job served now, or one retired (whose stragglers are told
        so). ``WireError`` for a message no known key signs: it is answered with nothing."""
        h = msg.header
        job = self._job
        creds = job.creds if job is not None and h.job_id == job.creds.job_id else self._retired.get(h.job_id)
        if creds is None:
            raise WireError(Reason.WRONG_JOB, f"job id {h.job_id.hex()} is not one this server knows")
        if not verify(creds.secret, msg):
            raise WireError(Reason.BAD_HMAC, "the tag does not authenticate the message")
        return creds

    def _process(self, msg: Message, envelope: list) -> list:
        """Serve an authenticated message (:meth:`_authenticate`)."""
        h = msg.header
        job = self._job
        if job is None or h.job_id != job.creds.job_id:
            raise WireError(Reason.WRONG_JOB, f"job id {h.job_id.hex()} is not the job being served")
        if h.kind not in (Kind.PUSH, Kind.PULL):
            raise WireError(Reason.BAD_KIND, f"a worker may not send {Kind(h.kind).name}")
        if h.kind == Kind.PUSH:
            if h.dtype != self._dtype_code:
                raise WireError(Reason.WRONG_DTYPE, f"payload dtype code {h.dtype} "
                                                    f"({DTYPES[h.dtype] if h.dtype in DTYPES else 'none'}) is not "
                                                    f"the server's {self._dtype}")
            if h.count > self._numel:
                raise WireError(Reason.OVERSIZED, f"{h.count} elements for a model of {self._numel}")
            if h.count != self._numel:
                raise WireError(Reason.WRONG_COUNT, f"{h.count} elements for a model of {self._numel}")
        elif h.count:
            raise WireError(Reason.WRONG_COUNT, f"a pull carries no payload, got {h.count} elements")
        self._last_heard = time.monotonic()
        key = (h.worker, h.attempt)
        with self._lock:
            last = job.last_step.get(key)
            if last is not None and h.step <= last:
                raise WireError(Reason.REPLAY, f"step {h.step} is not after step {last}, the last accepted")
            if h.version > self._version:
                raise WireError(Reason.BAD_VERSION,
                                f"base version {h.version} is newer than the server's {self._version}")
            job.last_step[key] = h.step
            if h.kind == Kind.PULL:
                self._counts["pulls"] += 1
                status, mix, payload = Status.PULLED, 1.0, self._flat
            else:
                self._counts["pushes_received"] += 1
                if not np.isfinite(msg.array()).all():  # a diverged worker's push never reaches the weights
                    bad = int((~np.isfinite(msg.array())).sum())
                    raise WireError(Reason.NONFINITE, f"{bad} of {h.count} values are NaN or infinite; the "
                                                      "worker diverged (lower its learning rate)")
                applied_to = job.applied_step.get(h.worker, -1)
                if h.step <= applied_to:
                    # Another attempt of this partition already pushed this step: acknowledge only.
                    self._counts["duplicate_pushes"] += 1
                    status, mix, payload = Status.DUPLICATE, 1.0, self._flat
                    log.info("worker %d attempt %d: push of step %d was applied by an earlier attempt; not "
                             "applied again", h.worker, h.attempt, h.step)
                else:
                    status = Status.APPLIED
                    mix = float(self.combiner.reply_mix(num_workers=self.num_workers))
                    payload = self._apply(msg, h)
                    job.applied_step[h.worker] = h.step
            reply = Header(Kind.REPLY, self._dtype_code, job.creds.job_id, h.worker, h.attempt, h.step, self._version,
                           self._numel, int(status), FLAG_SEND_DELTA if self.combiner.sends_delta else 0, mix)
            return envelope + encode(reply, payload, job.creds.secret)

    def _apply(self, msg: Message, h: Header) -> np.ndarray:
        """Combine one push (lock held); returns the buffer the reply carries."""
        staleness = self._version - h.version
        before = self._flat.copy() if self.combiner.reply_before_combine else None
        out = self.combiner.combine(self._flat, msg.array(), staleness=staleness, num_workers=self.num_workers)
        if out is not None:
            out = np.asarray(out, dtype=self._dtype).reshape(-1)
            if out.size != self._numel:
                raise ValueError(f"{self.combiner!r} returned {out.size} weights for a model of {self._numel}")
            self._flat = out if out.flags.c_contiguous and out.flags.writeable else out.copy()
        self._version += 1
        self._counts.update(pushes_applied=1, staleness_sum=staleness)
        self._counts["staleness_max"] = max(self._counts["staleness_max"], staleness)
        self._applied_by_worker[h.worker] += 1
        self._stale_hist[staleness_bucket(staleness)] += 1
        return before if before is not None else self._flat
