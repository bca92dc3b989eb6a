"""A small authenticated metrics channel from a barrier task to the driver (pyzmq PUSH -> PULL).

The driver binds a PULL socket and hands the endpoint and a random per-fit secret to the
tasks in their closure. Rank 0 PUSHes JSON records as two frames ``[body, mac]`` where
``mac = HMAC-SHA256(secret, body)``. The driver checks the MAC before it parses anything and
drops what does not verify; bodies are JSON, never pickles, so a stranger who reaches the
port can neither run code on the driver nor inject records.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets

__all__ = ["MetricsReceiver", "MetricsSender", "new_secret"]

log = logging.getLogger(__name__)


def new_secret() -> bytes:
    """A fresh 32-byte key for one fit."""
    return secrets.token_bytes(32)


def _mac(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).digest()


class MetricsReceiver:
    """Driver side: a PULL socket bound to ``bind_host`` on a free port.

    Parameters
    ----------
    bind_host : str
        Interface to bind (``127.0.0.1`` in local mode, ``*`` on a cluster).
    advertise_host : str
        The address executors connect to.
    secret : bytes
        The per-fit HMAC key.
    """

    def __init__(self, bind_host: str, advertise_host: str, secret: bytes):
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 10_000)
        port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        self.endpoint = f"tcp://{advertise_host}:{port}"
        self._secret = secret
        self.rejected = 0

    def recv(self, timeout_s: float) -> dict | None:
        """The next verified record, or ``None`` when none arrives within ``timeout_s``."""
        zmq = self._zmq
        if not self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        frames = self._sock.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 2 or not hmac.compare_digest(_mac(self._secret, frames[0]), frames[1]):
            self.rejected += 1
            log.warning("dropped a metrics message that failed authentication (%d so far)", self.rejected)
            return None
        try:
            record = json.loads(frames[0].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            self.rejected += 1
            return None
        return record if isinstance(record, dict) else None

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class MetricsSender:
    """Executor side (rank 0): PUSH JSON records to the driver; never blocks a round for long."""

    def __init__(self, endpoint: str, secret: bytes, send_timeout_ms: int = 5000):
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
        self._sock.setsockopt(zmq.IMMEDIATE, 0)
        self._sock.connect(endpoint)
        self._secret = secret
        self.dropped = 0

    def send(self, record: dict) -> bool:
        body = json.dumps(record, default=_jsonable).encode("utf-8")
        try:
            self._sock.send_multipart([body, _mac(self._secret, body)])
            return True
        except self._zmq.Again:
            self.dropped += 1
            log.warning("metrics channel to the driver is full or gone; dropped a %s record", record.get("event"))
            return False

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


def _jsonable(obj):
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)
