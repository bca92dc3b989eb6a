"""Peers that misbehave toward a driver socket, on loopback: raw TCP, raw ZMTP 3.0, and a proxy that goes silent.

Every socket here has a timeout and is closed by its owner in ``finally``; every wait has a deadline.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time

KIB = 1024
MIB = 1024 * KIB


def fd_count() -> int:
    """File descriptors this process holds now."""
    return len(os.listdir("/proc/self/fd"))


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def greeting(mechanism: bytes) -> bytes:
    """A ZMTP 3.0 greeting (64 bytes) offering ``mechanism`` (``b"NULL"`` or ``b"CURVE"``), as a client."""
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + b"\x00" + bytes(31)


def null_handshake(socket_type: bytes) -> bytes:
    """A NULL-mechanism greeting and READY command of a ``socket_type`` peer (what a peer without keys sends)."""
    ready = b"\x05READY" + b"\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    return greeting(b"NULL") + b"\x04" + bytes([len(ready)]) + ready


def long_frame(size: int, *, more: bool = False, command: bool = False) -> bytes:
    """The header of a ZMTP frame announcing ``size`` bytes (the bytes themselves not included)."""
    return bytes([0x02 | (0x01 if more else 0) | (0x04 if command else 0)]) + size.to_bytes(8, "big")


def stream(port: int, head: bytes, chunks, *, handshake: bool = False, deadline_s: float = 10.0) -> tuple[int, bool]:
    """Connect, send ``head`` then each of ``chunks``; (bytes the server took, whether it hung up).

    With ``handshake``, wait for the server's greeting and READY after ``head`` (as a real peer does before its
    first frame). Stops at the first chunk the server refuses (reset or closed), or when the server stops
    reading (a send that cannot finish within what is left of ``deadline_s``)."""
    end = time.monotonic() + deadline_s
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=deadline_s) as peer:
        try:
            peer.sendall(head)
            sent += len(head)
            if handshake and not _server_ready(peer, end):
                return sent, True
            for chunk in chunks:
                peer.settimeout(max(0.05, end - time.monotonic()))
                peer.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return sent, True
        except socket.timeout:
            return sent, False
        return sent, closed_by_server(peer, end - time.monotonic())


def _server_ready(peer: socket.socket, end: float) -> bool:
    """Read the server's greeting and its READY command; False when it hangs up first."""
    try:
        if _read(peer, 64, end) is None:
            return False
        head = _read(peer, 2, end)
        return head is not None and _read(peer, head[1], end) is not None
    except ConnectionResetError:
        return False


def _read(peer: socket.socket, n: int, end: float) -> bytes | None:
    data = b""
    while len(data) < n:
        peer.settimeout(max(0.05, end - time.monotonic()))
        chunk = peer.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def closed_by_server(peer: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``peer`` within ``within_s`` seconds (what it sends before is read and dropped)."""
    end = time.monotonic() + within_s
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return False
        peer.settimeout(left)
        try:
            if not peer.recv(4096):
                return True
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False


class SilentProxy:
    """Forwards one TCP connection to ``127.0.0.1:target`` until :meth:`freeze`; after that it forwards nothing
    and answers nothing, but keeps both sockets open: a peer whose host died without closing its connection.

    :attr:`server_hung_up` is set when the server closes its side. Stop it with :meth:`close`.
    """

    def __init__(self, target: int):
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.accepted = 0
        self.frozen = threading.Event()
        self.server_hung_up = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="silent-proxy", daemon=True)
        self._thread.start()

    def freeze(self) -> None:
        self.frozen.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._listener.close()

    def _run(self) -> None:
        client = upstream = None
        try:
            while client is None and not self._stop.is_set():
                try:
                    client, _ = self._listener.accept()
                except socket.timeout:
                    continue
            if client is None:
                return
            self.accepted += 1
            upstream = socket.create_connection(("127.0.0.1", self._target), timeout=5)
            while not self._stop.is_set():
                frozen = self.frozen.is_set()  # from now on the client side is never read: as if its host died
                readable, _, _ = select.select([upstream] if frozen else [client, upstream], [], [], 0.05)
                for src in readable:
                    try:
                        data = src.recv(65536)
                    except ConnectionResetError:
                        data = b""
                    if src is upstream and not data:
                        self.server_hung_up.set()
                        return
                    if src is client and not data:
                        return
                    if not frozen:
                        (upstream if src is client else client).sendall(data)
        finally:
            for s in (client, upstream):
                if s is not None:
                    s.close()
