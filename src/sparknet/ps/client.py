"""The worker side of the parameter server: one DEALER socket, one request at a time.

>>> with PSClient(endpoint, creds.job_id, creds.secret, keys=server.client_keys, worker=3) as c:  # doctest: +SKIP
...     first = c.pull(step=0)                      # the server's copy, its version
...     reply = c.push(step=10, payload=delta, base_version=first.version)

The connection is a CurveZMQ client of the server's keys, and every request waits for its reply at most ``timeout``
seconds, then raises :class:`~sparknet.errors.DeadlineExceeded` naming the worker. A reply is accepted only if it
authenticates under the job's secret and answers this request (same job, worker, attempt and step); anything else on
the socket is logged and dropped. A rejection by the server raises :class:`RejectedError` with the server's reason.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import zmq

from sparknet._transport import ClientKeys, Dialer
from sparknet.errors import DeadlineExceeded, EngineError
from sparknet.ps.wire import (FLAG_SEND_DELTA, Header, Kind, Reason, Status, WireError, decode, dtype_code,
                              encode, verify)

__all__ = ["PSClient", "Reply", "RejectedError"]

log = logging.getLogger(__name__)


class RejectedError(EngineError):
    """The parameter server rejected a request; ``reason`` is the server's :class:`Reason`."""

    def __init__(self, message: str, reason: int | None = None, worker: int | None = None):
        super().__init__(message)
        self.reason = reason
        self.worker = worker

    def __reduce__(self):
        return (type(self), (self.args[0], self.reason, self.worker))


@dataclass(frozen=True)
class Reply:
    """The server's answer to a push or a pull."""

    weights: np.ndarray
    """The server's copy (a writable array the caller owns)."""
    version: int
    """The server version of ``weights``."""
    status: Status
    """Applied, duplicate (a retried step, not applied again) or pulled."""
    mix: float
    """Move ``local += mix * (weights - local)``; 1 means take ``weights``."""
    send_delta: bool
    """The server wants the change since the last pull pushed, not the weights."""
    latency_s: float
    """Seconds from send to reply."""


class PSClient:
    """A worker's connection to the server at ``endpoint`` under the job's ``job_id`` and ``secret`` and the
    server's :attr:`~sparknet.ps.server.ParameterServer.client_keys` (all from the job's closure), as ``worker``
    (the Spark partition index) in task ``attempt``; ``timeout`` is the seconds to wait for each reply, ``dtype``
    the payload's (the server's, float32)."""

    def __init__(self, endpoint: str, job_id: bytes, secret: bytes, *, keys: ClientKeys, worker: int,
                 attempt: int = 0, timeout: float = 120.0, dtype=np.float32):
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if not isinstance(keys, ClientKeys):
            raise ValueError(f"keys must be the parameter server's client_keys, got {type(keys).__name__}")
        self.endpoint = endpoint
        self.job_id = bytes(job_id)
        self._secret = bytes(secret)
        self.worker = int(worker)
        self.attempt = int(attempt)
        self.timeout = float(timeout)
        self._dtype = np.dtype(dtype)
        self._dtype_code = dtype_code(self._dtype)
        self._last_step = -1
        self._dialer = Dialer(zmq.DEALER, endpoint, keys)

    def close(self) -> None:
        """Close the socket and the context (idempotent)."""
        self._dialer.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def pull(self, step: int, base_version: int = 0) -> Reply:
        """The server's current copy."""
        return self._request(Kind.PULL, step, None, base_version)

    def push(self, step: int, payload: np.ndarray, base_version: int) -> Reply:
        """Push weights (or a delta) taken at ``step``; the reply carries the server's new copy.

        ``base_version`` is the version of the copy this worker last pulled (the server measures staleness from it).
        """
        arr = np.ascontiguousarray(payload, dtype=self._dtype).reshape(-1)
        return self._request(Kind.PUSH, step, arr, base_version)

    def _request(self, kind: Kind, step: int, payload: np.ndarray | None, base_version: int) -> Reply:
        if self._dialer.socket is None:
            raise RuntimeError("the client is closed")
        if step <= self._last_step:
            raise ValueError(f"steps must increase: {step} after {self._last_step}")
        self._last_step = step
        count = 0 if payload is None else payload.size
        h = Header(int(kind), self._dtype_code if payload is not None else 0, self.job_id, self.worker, self.attempt,
                   int(step), int(base_version), count)
        t0 = time.perf_counter()
        what = f"{kind.name.lower()} of step {step}"
        reply = self._dialer.reply(time.monotonic() + self.timeout, lambda frames: self._accept(frames, step, what),
                                   encode(h, payload, self._secret), copy=True)
        if reply is None:
            raise DeadlineExceeded(f"worker {self.worker} (attempt {self.attempt}): no reply from the parameter server "
                                   f"at {self.endpoint} to its {what} within {self.timeout:g} s")
        weights, rh = reply
        return Reply(weights=weights, version=rh.version, status=Status(rh.status), mix=rh.mix,
                     send_delta=bool(rh.flags & FLAG_SEND_DELTA), latency_s=time.perf_counter() - t0)

    def _accept(self, frames, step: int, what: str):
        """(weights, header) if ``frames`` answer this request; raises on a rejection; None to keep waiting."""
        try:
            msg = decode(frames)
        except WireError as e:
            log.warning("worker %d: dropped a malformed message from the parameter server: %s", self.worker, e)
            return None
        h = msg.header
        if h.job_id != self.job_id or not verify(self._secret, msg):
            log.warning("worker %d: dropped a message that does not authenticate as this job's server", self.worker)
            return None
        if (h.worker, h.attempt, h.step) != (self.worker, self.attempt, step):
            log.debug("worker %d: dropped a late reply to step %d", self.worker, h.step)
            return None
        if h.kind == Kind.ERROR:
            try:
                reason = Reason(h.status).label
            except ValueError:
                reason = f"code {h.status}"
            raise RejectedError(f"worker {self.worker} (attempt {self.attempt}): the parameter server rejected its "
                                f"{what}: {reason}", reason=h.status, worker=self.worker)
        if h.kind != Kind.REPLY or h.dtype != self._dtype_code:
            log.warning("worker %d: dropped an unexpected %s message", self.worker, Kind(h.kind).name)
            return None
        return msg.array().copy(), h
