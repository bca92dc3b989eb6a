"""A small metrics channel from a barrier task to the driver (pyzmq PUSH -> PULL).

The driver binds a PULL socket and hands the endpoint and the socket's CurveZMQ client keys (made for this fit
alone) to the tasks in their closure; the socket lets in no other peer, and CurveZMQ authenticates and encrypts
every frame, so a record that arrives came from this fit's tasks, whole. Rank 0 PUSHes JSON records, one frame
each; bodies are JSON, never pickles, so nothing a peer sends can run code on the driver. The socket is bound to
the driver's Spark address (never every interface) with the bounds of :mod:`sparknet._transport`. A message of more
frames or bytes than the model can need is dropped unread; log lines about dropped messages are throttled.

On a local master (every executor on the driver's machine) the channel is a Unix socket in a folder of its own that
only this user can open, without CurveZMQ, as the rounds engine's relay is: the file system keeps other users out,
and a large net's state is not encrypted and decrypted every round on the cores the workers train on (240 MiB took
0.81-0.90 s from send to receipt through CurveZMQ on loopback, two cores, and 0.21-0.65 s through the Unix socket).

A record may carry one binary payload (``[body, payload]``), or one in parts (``[body, part, ...]``): the barrier
engine sends the global weights and strategy state this way every round, each tensor a part of its own, sent from where
it lies, and each rank its solver state on checkpoint rounds, so the driver can restart a failed stage and write
checkpoints. Payloads are :func:`sparknet._tensortree.pack_tree` bytes or parts, read back by
:func:`~sparknet._tensortree.unpack_tree` without unpickling anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time

import zmq

from sparknet._transport import ClientKeys, Dialer, Limits, Listener, LogThrottle, ServerKeys

__all__ = ["MetricsReceiver", "MetricsSender"]

log = logging.getLogger(__name__)


class MetricsReceiver(contextlib.AbstractContextManager):
    """Driver side: a PULL socket bound to ``bind_host`` on a free port.

    Parameters
    ----------
    bind_host : str
        The address to bind: the driver's Spark address (``spark.driver.host``) on a cluster,
        ``127.0.0.1`` in local mode; never a wildcard.
    advertise_host : str
        The address executors connect to.
    max_bytes : int
        The largest message accepted, all frames together (the caller sizes it from the model).
        ZeroMQ disconnects a peer that announces a bigger frame before reading it; a message of
        more frames or bytes than allowed is drained and dropped unread.
    max_frames : int
        The most frames of one message: the body and its payload's parts.
    limits : Limits, optional
        How long a peer may take to finish its handshake and stay silent (default: from ``max_bytes``).
    local : bool
        Every executor runs on this machine: listen on a Unix socket in a folder only this user can open, without
        CurveZMQ (:attr:`client_keys` is then ``None``).

    A sender connects with :attr:`client_keys`. The handshakes are checked by the thread that calls :meth:`recv`,
    while it waits.
    """

    def __init__(self, bind_host: str, advertise_host: str, *, max_bytes: int = 1 << 28, max_frames: int = 2,
                 limits: Limits | None = None, local: bool = False):
        keys = None if local else ServerKeys.new()
        self._listener = Listener(zmq.PULL, keys, "channel" if local else bind_host, max_frame=int(max_bytes),
                                  limits=limits or Limits.for_frame(int(max_bytes)), logger=log, rcvhwm=10_000)
        self.client_keys: ClientKeys | None = None if local else keys.client
        self.endpoint = self._listener.reached_at(advertise_host)
        self._max_bytes, self._max_frames = int(max_bytes), max(2, int(max_frames))
        self._throttle = LogThrottle(log, "metrics messages dropped")
        self.rejected = 0

    @property
    def refused(self) -> int:
        """Connections refused at the handshake for a key other than :attr:`client_keys`."""
        return self._listener.refused

    def recv(self, timeout_s: float) -> dict | None:
        """The next record, or ``None`` when none arrives within ``timeout_s`` (or it is dropped).

        A record sent with a payload holds it under ``"payload"``: a writable view of the message's own bytes, not
        a copy (a state is the size of the weights, every round), or a list of them for a payload sent in parts.
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
        while True:  # every part of the message (libzmq delivers them together), keeping max_frames and max_bytes
            count, size, more = count + 1, size + len(frame), frame.more
            if count <= self._max_frames and size <= self._max_bytes:
                frames.append(frame)
            if not more:
                break
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        if count > self._max_frames or size > self._max_bytes:
            self.rejected += 1
            self._throttle("shape", "dropped a metrics message of %d frames and %d bytes", count, size)
            return None
        try:
            record = json.loads(frames[0].bytes.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            record = None
        if not isinstance(record, dict):
            self.rejected += 1
            self._throttle("json", "dropped a metrics message that is not a JSON object")
            return None
        if count == 2:
            record["payload"] = frames[1].buffer
        elif count > 2:
            record["payload"] = [frame.buffer for frame in frames[1:]]
        return record

    def close(self) -> None:
        """Close the socket, then its gate, then the context, and remove a Unix socket's folder (idempotent)."""
        self._listener.close()

    def __exit__(self, *exc):
        self.close()


class MetricsSender:
    """Executor side (rank 0): PUSH JSON records to the driver; never blocks a round for long.

    ``keys`` are the receiver's :attr:`MetricsReceiver.client_keys` (``None``: its Unix socket). ``max_bytes``: the
    receiver's :attr:`MetricsReceiver` cap, all frames together; a larger message is not sent (the receiver would drop
    it unread, and the sender would not know).
    """

    LINGER_MS, LINGER_BYTES_PER_MS = 2000, 10_000
    """At close, the last records get two seconds to leave, and a millisecond more for every 10 kB of the largest
    payload sent (a net's final weights: 25 s for 244 MB)."""

    def __init__(self, endpoint: str, keys: ClientKeys | None, send_timeout_ms: int = 5000,
                 max_bytes: int | None = None):
        self._dialer = Dialer(zmq.PUSH, endpoint, keys, linger_ms=self.LINGER_MS, send_timeout_ms=send_timeout_ms)
        self._linger_ms = self.LINGER_MS
        self._max_bytes = max_bytes

    def send(self, record: dict, payload=None) -> bool:
        """Push one record (and an optional binary payload, or a list of its parts); ``False`` when it could not be
        sent in time, or is larger than the receiver takes."""
        body = json.dumps(record, default=_jsonable).encode("utf-8")
        frames = [body, *(payload if isinstance(payload, list) else () if payload is None else (payload,))]
        size = sum(memoryview(frame).nbytes for frame in frames[1:])
        if self._max_bytes is not None and len(body) + size > self._max_bytes:
            log.warning("a %s record of %d bytes is over the %d the driver takes; not sent", record.get("event"),
                        len(body) + size, self._max_bytes)
            return False
        try:
            # not copied into the message (pyzmq copies the small frames anyway): a state is the size of the weights
            self._dialer.socket.send_multipart(frames, copy=False)
            if (linger := self.LINGER_MS + size // self.LINGER_BYTES_PER_MS) > self._linger_ms:
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
