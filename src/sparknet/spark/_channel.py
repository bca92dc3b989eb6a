"""A small authenticated metrics channel from a barrier task to the driver (pyzmq PUSH -> PULL).

The driver binds a PULL socket and hands the endpoint, a random per-fit secret and the socket's
CurveZMQ client keys to the tasks in their closure. Rank 0 PUSHes JSON records as two frames
``[body, mac]`` where ``mac = HMAC-SHA256(secret, body)``. The driver checks the MAC before it
parses anything and drops what does not verify; bodies are JSON, never pickles, so a stranger
who reaches the port can neither run code on the driver nor inject records. The socket is bound
to the driver's Spark address (never every interface) with the bounds of
:mod:`sparknet._transport`. A message of more than three frames or more bytes than the model can
need is dropped unread; log lines about dropped messages are throttled.

A record may carry one binary payload (three frames ``[body, payload, mac]``, the MAC over
both): the barrier engine sends the global weights and strategy state this way every round,
and each rank its solver state on checkpoint rounds, so the driver can restart a failed stage
and write checkpoints. Payloads are :func:`sparknet._tensortree.pack_tree` bytes, read back by
:func:`~sparknet._tensortree.unpack_tree` without unpickling anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import time

import zmq

from sparknet._transport import ClientKeys, Dialer, Limits, Listener, LogThrottle, ServerKeys, bracketed

__all__ = ["MetricsReceiver", "MetricsSender", "new_secret"]

log = logging.getLogger(__name__)


def new_secret() -> bytes:
    """A fresh 32-byte key for one fit."""
    return secrets.token_bytes(32)


def _mac(secret: bytes, body: bytes, payload: bytes | None = None) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    if payload is not None:  # the body's length first, so no split of the bytes verifies twice
        mac.update(len(body).to_bytes(8, "little"))
    mac.update(body)
    if payload is not None:  # read where it lies: a state is the size of the weights
        mac.update(payload)
    return mac.digest()


class MetricsReceiver(contextlib.AbstractContextManager):
    """Driver side: a PULL socket bound to ``bind_host`` on a free port.

    Parameters
    ----------
    bind_host : str
        The address to bind: the driver's Spark address (``spark.driver.host``) on a cluster,
        ``127.0.0.1`` in local mode; never a wildcard.
    advertise_host : str
        The address executors connect to.
    secret : bytes
        The per-fit HMAC key.
    max_bytes : int
        The largest message accepted, all frames together (the caller sizes it from the model).
        ZeroMQ disconnects a peer that announces a bigger frame before reading it; a message of
        more frames or bytes than allowed is drained and dropped unread.
    limits : Limits, optional
        How long a peer may take to finish its handshake and stay silent (default: from ``max_bytes``).

    A sender connects with :attr:`client_keys` (they travel with the per-fit secret). The handshakes
    are checked by the thread that calls :meth:`recv`, while it waits.
    """

    def __init__(self, bind_host: str, advertise_host: str, secret: bytes, *, max_bytes: int = 1 << 28,
                 limits: Limits | None = None):
        keys = ServerKeys.new()
        self._listener = Listener(zmq.PULL, keys, bind_host, max_frame=int(max_bytes),
                                  limits=limits or Limits.for_frame(int(max_bytes)), logger=log, rcvhwm=10_000)
        self.client_keys: ClientKeys = keys.client
        self.endpoint = f"tcp://{bracketed(advertise_host)}:{self._listener.endpoint.rsplit(':', 1)[1]}"
        self._secret = secret
        self._max_bytes = int(max_bytes)
        self._throttle = LogThrottle(log, "metrics messages dropped")
        self.rejected = 0

    @property
    def refused(self) -> int:
        """Connections refused at the handshake for a key other than :attr:`client_keys`."""
        return self._listener.refused

    def recv(self, timeout_s: float) -> dict | None:
        """The next verified record, or ``None`` when none arrives within ``timeout_s`` (or it is dropped).

        A record sent with a payload holds it under ``"payload"``: a writable view of the message's own bytes, not
        a copy (a state is the size of the weights, every round).
        """
        sock = self._listener.socket
        deadline = time.monotonic() + timeout_s
        frame = None
        while frame is None:  # answer handshakes while waiting for a message
            if sock in self._listener.poll(max(0, round((deadline - time.monotonic()) * 1000))):
                try:
                    frame = sock.recv(zmq.NOBLOCK, copy=False)
                    continue
                except zmq.Again:  # its sender's connection went (a host lost) between the poll and the read
                    pass
            if time.monotonic() >= deadline:
                return None
        frames, count, size = [], 0, 0
        while True:  # every part of the message (libzmq delivers them together), keeping three and max_bytes
            count, size, more = count + 1, size + len(frame), frame.more
            if count <= 3 and size <= self._max_bytes:
                frames.append(frame)
            if not more:
                break
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        if count not in (2, 3) or size > self._max_bytes:
            self.rejected += 1
            self._throttle("shape", "dropped a metrics message of %d frames and %d bytes", count, size)
            return None
        body, payload, mac = frames[0].bytes, frames[1].buffer if count == 3 else None, frames[-1].bytes
        if not hmac.compare_digest(_mac(self._secret, body, payload), mac):
            self.rejected += 1
            self._throttle("hmac", "dropped a metrics message that failed authentication")
            return None
        try:
            record = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            self.rejected += 1
            return None
        if not isinstance(record, dict):
            return None
        if payload is not None:
            record["payload"] = payload
        return record

    def close(self) -> None:
        """Close the socket, then its gate, then the context (idempotent)."""
        self._listener.close()

    def __exit__(self, *exc):
        self.close()


class MetricsSender:
    """Executor side (rank 0): PUSH JSON records to the driver; never blocks a round for long.

    ``keys`` are the receiver's :attr:`MetricsReceiver.client_keys`.
    """

    LINGER_MS, LINGER_BYTES_PER_MS = 2000, 10_000
    """At close, the last records get two seconds to leave, and a millisecond more for every 10 kB of the largest
    payload sent (a net's final weights: 25 s for 244 MB)."""

    def __init__(self, endpoint: str, secret: bytes, keys: ClientKeys, send_timeout_ms: int = 5000):
        self._dialer = Dialer(zmq.PUSH, endpoint, keys, linger_ms=self.LINGER_MS, send_timeout_ms=send_timeout_ms)
        self._secret = secret
        self._linger_ms = self.LINGER_MS

    def send(self, record: dict, payload: bytes | None = None) -> bool:
        """Push one record (and an optional binary payload); ``False`` when it could not be sent in time."""
        body = json.dumps(record, default=_jsonable).encode("utf-8")
        frames = [body] if payload is None else [body, payload]
        frames.append(_mac(self._secret, body, payload))
        try:
            # not copied into the message (pyzmq copies the small frames anyway): a state is the size of the weights
            self._dialer.socket.send_multipart(frames, copy=False)
            if payload is not None and (linger := self.LINGER_MS + len(payload) // self.LINGER_BYTES_PER_MS) > \
                    self._linger_ms:
                self._linger_ms = linger
                self._dialer.socket.setsockopt(zmq.LINGER, linger)
            return True
        except zmq.Again:
            log.warning("metrics channel to the driver is full or gone; dropped a %s record", record.get("event"))
            return False

    def close(self) -> None:
        self._dialer.close()


def _jsonable(obj):
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)
