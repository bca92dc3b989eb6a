"""The bounds a ZeroMQ socket listening on the driver puts on its peers before it reads a byte of theirs.

Three driver sockets face the cluster network: the parameter server's ROUTER (:mod:`sparknet.ps.server`), the barrier
engine's metrics PULL (:mod:`sparknet.spark._channel`) and the rounds engine's relay ROUTER
(:mod:`sparknet.spark._relay`). All are set up here, the same way (:func:`listen`, :class:`Listener`; workers
connect with :class:`Dialer`):

- **CurveZMQ** (X25519 key exchange, then XSalsa20-Poly1305 on every frame). The driver makes a server keypair and one
  client keypair per server; the workers get the client keypair and the server's public key in their job's closure.
  A ZAP handler (:class:`Gate`) lets in that one client key and nothing else. A peer without the client's secret key
  cannot finish the handshake, so it cannot send a single frame: this matters because libzmq buffers the parts of an
  unfinished multi-part message with no limit (its high-water mark counts whole messages), so who may send parts at
  all has to be settled before any part is read. On a local master the relay and the channel listen instead on a
  Unix socket in a folder only the driver's user can open (``keys=None``): no CurveZMQ, whose encryption of a large
  net's weights every round would take the cores the workers train on.
- **ZMQ_MAXMSGSIZE**: a frame announcing more bytes than the model can need disconnects its sender before anything is
  allocated for it, during the handshake too.
- **ZMQ_HANDSHAKE_IVL**: a connection that has not finished its handshake within :attr:`Limits.handshake_s` is closed.
  One that sends anything but a CurveZMQ greeting, or a HELLO that the server's key does not open, is closed at once.
- **Heartbeats** (ZMQ_HEARTBEAT_IVL, _TIMEOUT, _TTL): the driver pings every peer; one that answers nothing for
  :attr:`Limits.dead_after_s` (a host that died without closing its connections) is closed. libzmq answers pings in
  its own I/O thread, so a busy worker stays.

The parameter server's messages carry an HMAC too (its wire format): one server outlives many jobs, and the HMAC says
which job a message belongs to. The barrier engine's channel and the rounds engine's relay are made for one fit, so
their keys say that already.

Log lines about what peers send are bounded by :class:`LogThrottle`.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

__all__ = ["ClientKeys", "ServerKeys", "Limits", "Gate", "LogThrottle", "Listener", "Dialer", "connect_keys", "listen",
           "bracketed"]

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq asks a context's ZAP handler about each handshake (RFC 27)."""
ZAP_DOMAIN = b"sparknet"

SLOWEST_LINK = 10e6
"""Bytes a second of the slowest link a frame must cross before its peer is declared dead (libzmq counts only
whole frames as traffic from a peer, so the time to move the biggest one must fit in the heartbeat timeout), and
a worker's transfer before its deadline passes."""


@dataclass(frozen=True)
class ClientKeys:
    """What a worker needs to connect to a driver socket: the server's public key and the client keypair (the
    Z85 text of :func:`zmq.curve_keypair`). The ``repr`` never shows the secret key."""

    server_public: bytes
    public: bytes
    secret: bytes = field(repr=False)

    def __post_init__(self):
        for name in ("server_public", "public", "secret"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != 40:
                raise ValueError(f"a CurveZMQ key is 40 bytes of Z85 text; {name} is not")


@dataclass(frozen=True)
class ServerKeys:
    """A driver socket's keypair and the one client keypair it lets in. The ``repr`` never shows a secret key."""

    public: bytes
    secret: bytes = field(repr=False)
    client: ClientKeys = field(repr=False)

    @classmethod
    def new(cls) -> ServerKeys:
        """A fresh server keypair and client keypair."""
        if not zmq.has("curve"):
            raise RuntimeError(f"this pyzmq (libzmq {zmq.zmq_version()}) was built without CurveZMQ, which sparknet "
                               "needs for its driver sockets; install pyzmq's own wheel (pip install --force-reinstall "
                               "pyzmq)")
        public, secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(public, secret, ClientKeys(public, client_public, client_secret))


@dataclass(frozen=True, kw_only=True)
class Limits:
    """How long a peer may take, in seconds."""

    handshake_s: float = 10.0
    """To finish its handshake once connected (a stranger's idle connection lives this long at most)."""
    heartbeat_s: float = 5.0
    """Between the driver's pings."""
    dead_after_s: float = 60.0
    """Silence after a ping that closes the connection (also sent as the pings' time-to-live)."""

    def __post_init__(self):
        for name in ("handshake_s", "heartbeat_s", "dead_after_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.1):
                raise ValueError(f"{name} must be a number of seconds of at least 0.1, got {value!r}")
        if self.dead_after_s < self.heartbeat_s:
            raise ValueError(f"dead_after_s ({self.dead_after_s}) must be at least heartbeat_s ({self.heartbeat_s})")

    @classmethod
    def for_frame(cls, max_frame: int) -> Limits:
        """The defaults, with a peer declared dead only after the biggest frame could cross a slow link."""
        return cls(dead_after_s=30.0 + max_frame / SLOWEST_LINK)


def listen(ctx: zmq.Context, kind: int, keys: ServerKeys | None, host: str, *, max_frame: int, limits: Limits,
           logger: logging.Logger, port: int = 0, rcvhwm: int | None = None) -> tuple[zmq.Socket, Gate | None, int]:
    """A socket of ``kind`` with every bound above, bound to ``host`` on ``port`` (0: one the OS picks), and the
    :class:`Gate` bound before it. With ``keys=None``, ``host`` is an ``ipc://`` endpoint in a folder only this
    machine's user can open (the file system says who may connect): no CurveZMQ, no gate, port 0.
    Returns ``(socket, gate, port)``; on failure both are closed."""
    gate = None if keys is None else Gate(ctx, keys, logger)
    sock = None
    try:
        sock = ctx.socket(kind)
        options = {zmq.LINGER: 0, zmq.MAXMSGSIZE: int(max_frame), zmq.HANDSHAKE_IVL: round(limits.handshake_s * 1000),
                   zmq.HEARTBEAT_IVL: round(limits.heartbeat_s * 1000),
                   zmq.HEARTBEAT_TIMEOUT: round(limits.dead_after_s * 1000),
                   zmq.HEARTBEAT_TTL: min(round(limits.dead_after_s * 1000), 6_553_500)}  # the wire's most
        if rcvhwm is not None:
            options[zmq.RCVHWM] = rcvhwm
        if keys is not None:  # ZAP_ENFORCE_DOMAIN: with no ZAP handler in the context, every handshake fails
            options.update({zmq.CURVE_SERVER: 1, zmq.CURVE_SECRETKEY: keys.secret, zmq.CURVE_PUBLICKEY: keys.public,
                            zmq.ZAP_DOMAIN: ZAP_DOMAIN, zmq.ZAP_ENFORCE_DOMAIN: 1, zmq.IPV6: int(":" in host)})
        for option, value in options.items():
            sock.setsockopt(option, value)
        sock.bind(host if keys is None else f"tcp://{bracketed(host)}:{port or '*'}")
    except BaseException:
        if sock is not None:
            sock.close(linger=0)
        if gate is not None:
            gate.close()
        raise
    return sock, gate, 0 if keys is None else int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])


class Listener:
    """A driver socket of :func:`listen` in a context of its own. :meth:`poll` answers waiting handshakes each time
    it waits; :meth:`close` closes the socket, then its gate, then the context.

    With ``keys=None`` (every peer on this machine: a local master) ``host`` names a Unix socket in a folder made for
    it that only this user can open (mode 0700), removed at :meth:`close`."""

    def __init__(self, kind: int, keys: ServerKeys | None, host: str, **bounds):
        self.ctx = zmq.Context()
        self.socket = self.gate = self.folder = None
        try:
            if keys is None:
                self.folder = tempfile.mkdtemp(prefix=f"sparknet-{host}-")
                host = f"ipc://{self.folder}/{host}"
            self.socket, self.gate, _ = listen(self.ctx, kind, keys, host, **bounds)
        except BaseException:
            self.close()
            raise
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.poller = zmq.Poller()
        for sock in (self.socket, self.gate and self.gate.socket):
            if sock is not None:
                self.poller.register(sock, zmq.POLLIN)

    def reached_at(self, advertise_host: str) -> str:
        """The endpoint peers connect to: the Unix socket, or ``advertise_host`` at the port bound."""
        if self.folder is not None:
            return self.endpoint
        return f"tcp://{bracketed(advertise_host)}:{self.endpoint.rsplit(':', 1)[1]}"

    @property
    def refused(self) -> int:
        """Connections refused at the handshake (a key other than the workers'); kept after :meth:`close`."""
        return self.gate.refused if self.gate is not None else 0

    def poll(self, timeout_ms: int) -> dict:
        """The sockets of :attr:`poller` ready within ``timeout_ms``."""
        ready = dict(self.poller.poll(timeout_ms))
        if self.gate is not None:
            self.gate.serve()
        return ready

    def requests(self, most: int):
        """Up to ``most`` messages waiting on the socket (frames not copied), without blocking."""
        for _ in range(most):
            try:
                yield self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return

    def close(self) -> None:
        """Idempotent."""
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None
        if self.gate is not None:  # after the socket it guards
            self.gate.close()
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


class Dialer:
    """A worker's socket of ``kind`` to ``endpoint`` in a context of its own, with no linger (or ``linger_ms`` at
    :meth:`close`) and sends that wait ``send_timeout_ms`` at most (-1: no limit): a CurveZMQ client of ``keys``
    (``None``: an ``ipc://`` endpoint of :func:`listen`)."""

    def __init__(self, kind: int, endpoint: str, keys: ClientKeys | None, *, linger_ms: int = 0,
                 send_timeout_ms: int = -1):
        self.kind, self.endpoint, self.keys = kind, endpoint, keys
        self.options = {zmq.LINGER: linger_ms, zmq.SNDTIMEO: send_timeout_ms}
        self.ctx = zmq.Context()
        self.socket = None
        try:
            self.reopen()
        except BaseException:
            self.close()
            raise

    def reopen(self) -> None:
        """A fresh socket: nothing half-sent on the old one, and no late answer to it, survives."""
        if self.socket is not None:
            self.socket.close(linger=0)
        self.socket = self.ctx.socket(self.kind)
        for option, value in self.options.items():
            self.socket.setsockopt(option, value)
        self.socket.setsockopt(zmq.IPV6, 1)  # the driver's address may be IPv6
        if self.keys is not None:
            connect_keys(self.socket, self.keys)
        self.socket.connect(self.endpoint)

    def reply(self, deadline: float, accept: Callable[[list], object], unsent: list | None = None, *,
              copy: bool = False):
        """Send ``unsent`` (if a request waits to be sent), then the first answer ``accept`` makes of the messages
        received (``None``: not an answer to this request); ``None`` once ``deadline`` (:func:`time.monotonic`)
        passes. A DEALER holds a request until a connection is ready: one whose handshake never ends must not
        block."""
        def ready(event: int) -> bool:
            return bool(self.socket.poll(max(0, math.ceil((deadline - time.monotonic()) * 1000)), event))

        if unsent is not None:
            if not ready(zmq.POLLOUT):
                return None
            try:
                self.socket.send_multipart(unsent, flags=zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                return None
        while ready(zmq.POLLIN):
            got = accept(self.socket.recv_multipart(copy=False))
            if got is not None:
                return got
        return None

    def close(self, *, forked: bool = False) -> None:
        """Close the socket and the context (idempotent; ``forked``: this process is a fork of the one that opened
        them, whose sockets it must not touch: they are dropped)."""
        if not forked and self.socket is not None:
            self.socket.close()
        if not forked and self.ctx is not None:
            self.ctx.term()
        self.socket = self.ctx = None


def bracketed(host: str) -> str:
    """``host`` as it goes in an endpoint (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def connect_keys(sock: zmq.Socket, keys: ClientKeys) -> None:
    """Make ``sock`` a CurveZMQ client of the server ``keys`` name (before it connects)."""
    if not isinstance(keys, ClientKeys):
        raise TypeError(f"expected the server's ClientKeys, got {type(keys).__name__}")
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


class LogThrottle:
    """Bounded log lines about what peers send: per key (a reason), the first ``loud`` at WARNING, then one line
    at most every ``every_s`` seconds with the count since the last; never a traceback."""

    def __init__(self, logger: logging.Logger, what: str, *, loud: int = 10, every_s: float = 60.0):
        self._log = logger
        self._what = what
        self.loud = int(loud)
        self.every_s = float(every_s)
        self.counts: Counter[str] = Counter()
        self._quiet: Counter[str] = Counter()
        self._last = -math.inf

    def __call__(self, key: str, msg: str, *args) -> None:
        """Count one event under ``key``; log ``msg % args`` if it is among the first ``loud``, else maybe a count."""
        self.counts[key] += 1
        n = self.counts[key]
        if n <= self.loud:
            more = "; later ones are counted" if n == self.loud else ""
            self._log.warning(f"{msg} (%d so far{more})", *args, n)
            return
        self._quiet[key] += 1
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._log.warning("%s: %d more since the last line (%s); logged at most every %g s", self._what,
                              sum(self._quiet.values()), ", ".join(f"{k}: {v}" for k, v in sorted(self._quiet.items())),
                              self.every_s)
            self._quiet.clear()
            self._last = now


class Gate:
    """The ZAP handler of one context: lets in CurveZMQ clients holding ``keys.client``'s key, nothing else.

    It binds the context's ZAP endpoint, so it must exist before the socket it guards binds, and close after that
    socket. It has no thread of its own: the thread that serves the guarded socket polls :attr:`socket` too and calls
    :meth:`serve`, which answers what is waiting without blocking."""

    def __init__(self, ctx: zmq.Context, keys: ServerKeys, logger: logging.Logger):
        self._allowed = z85.decode(keys.client.public)
        self.refused = 0
        self._throttle = LogThrottle(logger, "connections refused at the handshake")
        self.socket = ctx.socket(zmq.REP)
        try:
            self.socket.setsockopt(zmq.LINGER, 0)
            self.socket.bind(ZAP_ENDPOINT)
        except BaseException:
            self.socket.close(linger=0)
            raise

    def serve(self, most: int = 64) -> None:
        """Answer up to ``most`` waiting handshakes; returns when none waits."""
        for _ in range(most):
            try:
                request = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.socket.send_multipart(self._answer(request))

    def _answer(self, request: list[bytes]) -> list[bytes]:
        # RFC 27: version, request id, domain, address, identity, mechanism, credentials...
        request_id = request[1] if len(request) > 1 else b""
        if len(request) == 7 and request[0] == b"1.0" and request[5] == b"CURVE" and request[6] == self._allowed:
            return [b"1.0", request_id, b"200", b"OK", b"worker", b""]
        self.refused += 1
        address = request[3].decode("ascii", "replace") if len(request) > 3 else "?"
        self._throttle("key", "refused a connection from %s: its key is not the one given to this job's workers",
                       address)
        return [b"1.0", request_id, b"400", b"unknown key", b"", b""]

    def close(self) -> None:
        self.socket.close(linger=0)
