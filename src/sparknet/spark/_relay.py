"""The rounds engine's weights and updates, out of Spark's job: an authenticated socket on the driver.

A Spark job per round is the rounds engine's synchronisation, but the model need not ride in it. Sent through Spark,
the weights are a broadcast created and destroyed every round and each task's update is a task result that crosses the
JVM twice (the executor's, then the driver's) before Python sees it. Here the job carries only the round's small
records; the bytes go beside it:

- the driver publishes the round's message (the weights, or a compressed downlink message) in a :class:`RoundRelay`
  before it starts the round's job;
- each task fetches it (:class:`RelayClient`, a DEALER socket its Python worker keeps for the fit), trains, and puts
  its update back before it returns; the update is stored under (round, partition, Spark's task attempt id), and the
  task's result names that attempt, so an update of an attempt that failed after sending it is never counted;
- the driver reads each partition's update by the attempt its result names, in partition order, and sums exactly as
  it sums task results (the final weights are bit-identical to Spark's path).

The socket has the bounds of :mod:`sparknet._transport` (CurveZMQ with one client key per fit); on a local master it
is a Unix socket instead (:class:`RoundRelay`'s ``local``). Frames are JSON and raw array bytes, never pickles. A task
that cannot reach the driver (a firewall between executors and the driver) says so in its result and the driver goes
back to Spark's broadcasts and task results for the rest of the fit."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from sparknet._transport import SLOWEST_LINK, ClientKeys, Dialer, Limits, Listener, LogThrottle, ServerKeys

__all__ = ["RelayAddress", "RoundRelay", "RelayClient", "RelayUnreachable", "relay_client"]

log = logging.getLogger(__name__)

_DTYPES = frozenset({"<f4", "<f2", "<f8", "|u1", "|i1", "<i4"})
"""What a published array may hold (a dtype read from the wire is one of these strings, nothing else)."""

_MOST_PARKED = 4096
"""Most gets of the next round waiting at once (a Python worker parks one after each task)."""

class RelayUnreachable(ConnectionError):
    """A task could not reach the driver's relay: nothing of the round was done."""


@dataclass(frozen=True)
class RelayAddress:
    """Where a task finds the relay: its endpoint and the fit's client keys (pickled with the worker spec)."""

    endpoint: str
    keys: ClientKeys | None = field(repr=False)
    reach_s: float = 10.0
    state_bytes: int | None = None
    """The largest encoded worker state the relay takes (a bigger one travels in the task's result)."""


class RoundRelay(contextlib.AbstractContextManager):
    """Driver side: a ROUTER socket bound to ``bind_host`` on a free port, served by a thread of its own.

    With ``local`` (every executor on this machine: a local master) it listens instead on a Unix socket in a folder of
    its own that only this user can open, without CurveZMQ: the file system keeps other users out, and the weights are
    not encrypted and decrypted twice a round on cores the workers train on.

    ``max_bytes`` is the largest update a task may send (the model's weights as float32 plus a little);
    ``update_bytes`` the exact size of an uncompressed update (``None``: compressed updates, of any size up to
    ``max_bytes``); ``state_bytes`` the largest worker state (:func:`~sparknet._tensortree.pack_tree` bytes of its
    solver and strategy state; ``None``: states do not travel here)."""

    def __init__(self, bind_host: str, advertise_host: str, *, max_bytes: int, update_bytes: int | None,
                 state_bytes: int | None = None, limits: Limits | None = None, reach_s: float = 10.0,
                 local: bool = False):
        keys = None if local else ServerKeys.new()
        self._listener = self._thread = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._round: int | None = None
        self._blobs: dict[str, tuple[memoryview, str]] = {}
        self._updates: dict[tuple[str, int, int], object] = {}  # (kind, index, attempt): the payload frame
        self._parked: list[tuple[object, int, int, str]] = []  # gets of the next round: (ident, nonce, round, name)
        self._wake_in = self._wake_out = None
        self._max_bytes, self._update_bytes = int(max_bytes), update_bytes
        self._state_bytes = None if state_bytes is None else int(state_bytes)
        frame = max(self._max_bytes, self._state_bytes or 0)
        self._throttle = LogThrottle(log, "relay requests refused")
        self.served = self.received = self.refused_requests = 0
        try:
            self._listener = Listener(zmq.ROUTER, keys, "relay" if local else bind_host, max_frame=frame + 4096,
                                      limits=limits or Limits.for_frame(frame), logger=log)
            self.address = RelayAddress(self._listener.reached_at(advertise_host), None if local else keys.client,
                                        reach_s, self._state_bytes)
            pipe = f"inproc://sparknet-relay-wake-{id(self)}"
            self._wake_in = self._listener.ctx.socket(zmq.PAIR)  # the serving thread's end
            self._wake_in.bind(pipe)
            self._wake_out = self._listener.ctx.socket(zmq.PAIR)  # publish's end (the caller's thread)
            self._wake_out.connect(pipe)
            self._listener.poller.register(self._wake_in, zmq.POLLIN)
            self._thread = threading.Thread(target=self._serve, name="sparknet-relay", daemon=True)
            self._thread.start()
        except BaseException:
            self.close()
            raise

    @property
    def refused(self) -> int:
        """Connections refused at the handshake (a key other than this fit's)."""
        return self._listener.refused if self._listener is not None else 0

    def publish(self, round_index: int, **blobs: np.ndarray) -> None:
        """Make ``blobs`` (``message=``, and ``full=`` for workers that lost their weights) the round's; updates
        of earlier rounds are dropped."""
        with self._lock:
            if self._round != round_index:
                self._updates.clear()
            self._round = round_index
            for name, arr in blobs.items():
                arr = np.ascontiguousarray(arr)
                if arr.dtype.str not in _DTYPES:
                    raise TypeError(f"the relay sends arrays of {sorted(_DTYPES)}, not {arr.dtype}")
                self._blobs[name] = (memoryview(arr).cast("B"), arr.dtype.str)
        self._wake_out.send(b"", zmq.NOBLOCK)  # the serving thread answers the gets parked for this round

    def take(self, round_index: int, index: int, attempt: int, samples: int, *, scale: bool) -> np.ndarray:
        """The update partition ``index``'s attempt ``attempt`` put for the round: ``delta * float32(samples)``
        with ``scale`` (float32, the task-result path's product), else its bytes (a compressed update)."""
        arr = np.frombuffer(self._pop("update", round_index, index, attempt), dtype=np.float32 if scale else np.uint8)
        return arr * np.float32(samples) if scale else arr

    def take_state(self, round_index: int, index: int, attempt: int) -> memoryview:
        """The worker state (encoded) partition ``index``'s attempt ``attempt`` put for the round."""
        return self._pop("state", round_index, index, attempt)

    def _pop(self, kind: str, round_index: int, index: int, attempt: int) -> memoryview:
        with self._lock:
            got = self._updates.pop((kind, index, attempt), None) if self._round == round_index else None
        if got is None:
            raise RuntimeError(f"round {round_index + 1}: the {kind} of partition {index} (task attempt {attempt}) "
                               "never reached the driver's relay although its task finished")
        return got.buffer

    def _serve(self) -> None:
        while not self._stop.is_set():
            ready = self._listener.poll(100)
            if self._wake_in in ready:
                while self._wake_in.poll(0):
                    self._wake_in.recv()
                self._answer_parked()
            if self._listener.socket not in ready:
                continue
            for frames in self._listener.requests(64):
                try:
                    self._answer(frames)
                except zmq.ZMQError as exc:  # the peer went between its request and the answer
                    log.debug("relay: could not answer a request: %s", exc)

    def _answer_parked(self) -> None:
        with self._lock:
            parked, self._parked = self._parked, []
            for ident, nonce, rnd, name in parked:
                if rnd == self._round:
                    self._send_blob(ident, nonce, name)
                elif self._round is not None and rnd == self._round + 1:
                    self._parked.append((ident, nonce, rnd, name))
                else:
                    self._refuse(ident, nonce, f"round: round {rnd + 1} waited for, the driver is at {self._round + 1}")

    def _send_blob(self, ident, nonce: int, name: str) -> None:
        blob = self._blobs.get(name)
        if blob is None:
            return self._refuse(ident, nonce, f"name: no {name!r} published this round")
        self.served += 1
        head = {"ok": True, "nonce": nonce, "dtype": blob[1]}
        self._listener.socket.send_multipart([ident, json.dumps(head).encode(), blob[0]], copy=False)

    def _refuse(self, ident, nonce, why: str) -> None:
        self.refused_requests += 1
        self._throttle(why.split(":")[0], "relay: refused a request: %s", why)
        self._listener.socket.send_multipart([ident, json.dumps({"ok": False, "nonce": nonce, "why": why}).encode()])

    def _answer(self, frames) -> None:
        ident = frames[0]
        if len(frames) not in (2, 3) or len(frames[1]) > 4096:
            return self._refuse(ident, None, f"shape: a request of {len(frames) - 1} frames")
        try:
            req = json.loads(frames[1].bytes.decode("utf-8"))
            op, rnd, nonce = req["op"], int(req["round"]), int(req["nonce"])
        except (UnicodeDecodeError, ValueError, KeyError, TypeError):
            return self._refuse(ident, None, "shape: a request that is not the relay's JSON")
        with self._lock:
            current = self._round
            if (op == "get" and len(frames) == 2 and current is not None and rnd == current + 1
                    and req.get("name") == "message" and len(self._parked) < _MOST_PARKED):
                self._parked.append((ident, nonce, rnd, "message"))  # a prefetch: answered when it is published
                return
            if rnd != current:
                return self._refuse(ident, nonce, f"round: round {rnd + 1} asked for, the driver is at "
                                                  f"{'none' if current is None else current + 1}")
            if op == "get" and len(frames) == 2:
                return self._send_blob(ident, nonce, str(req.get("name")))
            if op == "put" and len(frames) == 3:
                payload = frames[2]
                size = len(payload)
                try:
                    index, attempt, kind = int(req["index"]), int(req["attempt"]), req.get("kind", "update")
                except (KeyError, TypeError, ValueError):
                    return self._refuse(ident, nonce, "shape: a put without its partition and attempt")
                if kind == "state":
                    if self._state_bytes is None or size > self._state_bytes:
                        return self._refuse(ident, nonce, f"size: a worker state of {size} bytes")
                elif kind != "update":
                    return self._refuse(ident, nonce, f"shape: a put of {str(kind)[:40]!r}")
                elif (self._update_bytes is not None and size != self._update_bytes) or size > self._max_bytes:
                    return self._refuse(ident, nonce, f"size: an update of {size} bytes")
                self._updates[(kind, index, attempt)] = payload
                self.received += 1
                self._listener.socket.send_multipart([ident, json.dumps({"ok": True, "nonce": nonce}).encode()])
                return
        return self._refuse(ident, nonce, f"shape: op {op!r} with {len(frames) - 1} frames")

    def close(self) -> None:
        """Stop the thread, close the socket, its gate, then the context (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        for pipe in (self._wake_in, self._wake_out):
            if pipe is not None:
                pipe.close(linger=0)
        self._wake_in = self._wake_out = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            self._parked.clear()
            self._updates.clear()
            self._blobs.clear()

    def __exit__(self, *exc):
        self.close()


class RelayClient:
    """Executor side: one DEALER socket to the relay, kept by a Python worker for the fit."""

    def __init__(self, address: RelayAddress):
        self.address = address
        self._nonce = 0
        self._reached = False
        self._prefetch: tuple[int, int] | None = None  # (round, nonce) of the get sent ahead
        self._dialer = Dialer(zmq.DEALER, address.endpoint, address.keys)  # keys None: RoundRelay's ``local``

    def _send(self, frames: list) -> tuple[int, list | None]:
        """Send a request (a new nonce in its head); returns the nonce and the frames if they wait to be sent."""
        self._nonce += 1
        frames[0] = json.dumps({**frames[0], "nonce": self._nonce}).encode()
        try:
            self._dialer.socket.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            return self._nonce, frames  # not connected yet: the caller's wait sends them
        return self._nonce, None

    def _request(self, frames: list | None, nbytes: int, nonce: int | None = None):
        deadline_s = 60.0 + nbytes / SLOWEST_LINK
        if not self._reached:
            deadline_s = min(deadline_s, self.address.reach_s)
        end = time.monotonic() + deadline_s
        if nonce is None:
            nonce, frames = self._send(frames)
        # else: sent ahead under that nonce (``frames``: what is still to be sent, or None)

        def accept(reply):
            try:
                head = json.loads(reply[0].bytes.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                head = {}
            if head.get("nonce") != nonce:
                return None  # an answer to an earlier request that timed out
            self._reached = True
            if not head.get("ok"):
                raise RuntimeError(f"the driver's relay refused the request: {head.get('why')}")
            return reply, head

        got = self._dialer.reply(end, accept, frames)
        if got is not None:
            return got
        self._prefetch = None
        self._dialer.reopen()  # a fresh socket: no half-sent request or late answer survives
        if not self._reached:
            raise RelayUnreachable(f"could not reach the driver's relay at {self.address.endpoint} within "
                                   f"{deadline_s:g} s")
        raise TimeoutError(f"the driver's relay at {self.address.endpoint} did not answer within {deadline_s:g} s")

    def get(self, round_index: int, name: str = "message") -> np.ndarray:
        """The round's published ``name`` (a read-only array over the received frame)."""
        ahead, self._prefetch = self._prefetch, None
        if ahead is not None and ahead[0] == round_index and name == "message":
            reply, head = self._request(None, 0, nonce=ahead[1])  # sent when this process's last task ended
        else:
            reply, head = self._request([{"op": "get", "round": round_index, "name": name}], 0)
        if len(reply) != 2 or head.get("dtype") not in _DTYPES:
            raise RuntimeError(f"the driver's relay answered a get with {len(reply)} frames of {head.get('dtype')!r}")
        return np.frombuffer(reply[1].buffer, dtype=np.dtype(head["dtype"]))

    def put(self, round_index: int, index: int, attempt: int, update, kind: str = "update"):
        """Send partition ``index``'s update of the round (an array's raw bytes), or with ``kind="state"`` its
        encoded worker state; returns a function that waits until the driver holds it (call it before the task
        ends; the bytes travel while the task finishes its round)."""
        data = np.ascontiguousarray(update) if isinstance(update, np.ndarray) else np.frombuffer(update, np.uint8)
        nonce, unsent = self._send([{"op": "put", "round": round_index, "index": index, "attempt": attempt,
                                     "kind": kind}, memoryview(data)])
        return lambda: self._request(unsent, data.nbytes, nonce=nonce)  # unsent: None, or what is left to send

    def prefetch(self, round_index: int) -> None:
        """Ask now for round ``round_index``'s message: the driver answers when it publishes it, while Spark starts
        that round's job, and the next task of this process finds the weights here already."""
        if self._reached and self._prefetch is None:
            nonce, unsent = self._send([{"op": "get", "round": round_index, "name": "message"}])
            if unsent is None:
                self._prefetch = (round_index, nonce)

    def close(self, *, forked: bool = False) -> None:
        """Close the socket and context (``forked``: see :meth:`~sparknet._transport.Dialer.close`)."""
        self._dialer.close(forked=forked)


_CLIENTS: dict[str, RelayClient] = {}


def relay_client(address: RelayAddress) -> RelayClient:
    """This Python worker's client of ``address`` (one per fit; a forked process opens its own)."""
    key = f"{os.getpid()}:{address.endpoint}"
    client = _CLIENTS.get(key)
    if client is None or client.address.keys != address.keys:
        for old in list(_CLIENTS):  # an earlier fit's (its relay is closed), or one inherited by a fork: not ours
            _CLIENTS.pop(old).close(forked=not old.startswith(f"{os.getpid()}:"))
        client = _CLIENTS[key] = RelayClient(address)
    return client

