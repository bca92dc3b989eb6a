"""The parameter server's wire format: a fixed binary header, raw tensor bytes, an HMAC tag.

Every message, in either direction, is three ZeroMQ frames (a ROUTER socket adds the peer's identity in front, and a
REQ socket an empty delimiter, which the server handles)::

    frame 0  header    HEADER_SIZE (68) bytes, struct format "<4sHBB16sIIQQQHHd"
    frame 1  payload   ``count`` elements of ``dtype`` as raw little-endian bytes
                       (empty for a pull and for an error)
    frame 2  tag       HMAC-SHA256(secret, header || payload), 32 bytes

The header's fields, in order (little-endian, no padding):

=========  ======  ========================================================================
field      type    meaning
=========  ======  ========================================================================
magic      4s      ``b"SNPS"``
format     u16     format version, :data:`FORMAT_VERSION`
kind       u8      1 push, 2 pull, 3 reply, 4 error (:class:`Kind`)
dtype      u8      0 none (empty payload), 1 float32, 2 float64, 3 float16 (:data:`DTYPES`)
job_id     16s     random id of the training job (one Spark job: one epoch)
worker     u32     worker id (the Spark partition index)
attempt    u32     the task attempt: Spark's task attempt id (its low 32 bits), unique to each
                   attempt, also in a stage Spark submits again
step       u64     the worker's local step the message is sent at; strictly increasing
                   within one worker attempt (the pull that starts a task is step 0)
version    u64     push or pull: the server version the worker last pulled;
                   reply: the server version of the weights in the payload
count      u64     number of elements in the payload
status     u16     reply: :class:`Status` (applied, duplicate, pulled);
                   error: the :class:`Reason` code the request was rejected for
flags      u16     reply: bit 0 (:data:`FLAG_SEND_DELTA`) asks the worker to push its change
                   since its last pull instead of its weights
mix        f64     reply: the fraction by which the worker moves from its own weights toward
                   the payload (1.0: take the server's copy; elastic averaging: alpha)
=========  ======  ========================================================================

The secret is 32 random bytes (``secrets.token_bytes(32)``) made per job on the driver; it reaches the tasks inside
the job's closure and never crosses the server's socket. The tag is checked with :func:`hmac.compare_digest`. Nothing
here, or anywhere in the parameter server, unpickles network bytes: a payload is only ever read as an array of numbers
of the dtype the header names, and only after the header's fields are checked.

:func:`decode` does the structural checks (frame count, sizes, magic, format, kind, dtype, payload length against
``count``) and raises :class:`WireError` with a :class:`Reason`; :func:`verify` checks the tag. The server checks the
rest (job, dtype and size against its model, replay) and counts every rejection by its reason."""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = [
    "MAGIC", "FORMAT_VERSION", "HEADER", "HEADER_SIZE", "TAG_SIZE", "DTYPES", "FLAG_SEND_DELTA",
    "Kind", "Status", "Reason", "Header", "Message", "JobCredentials", "WireError",
    "dtype_code", "encode", "decode", "verify", "sign",
]

MAGIC = b"SNPS"
"""The first four bytes of every header."""
FORMAT_VERSION = 1
"""The wire format version this code speaks."""
HEADER = struct.Struct("<4sHBB16sIIQQQHHd")
"""The header's layout (see the module docstring)."""
HEADER_SIZE = HEADER.size
"""Bytes in a header (68)."""
TAG_SIZE = 32
"""Bytes in an HMAC-SHA256 tag."""
JOB_ID_SIZE = 16
"""Bytes in a job id."""
SECRET_SIZE = 32
"""Bytes in a job secret."""
FLAG_SEND_DELTA = 1
"""Reply flag: push ``weights - last pulled weights`` rather than the weights."""

DTYPES: dict[int, np.dtype] = {1: np.dtype("<f4"), 2: np.dtype("<f8"), 3: np.dtype("<f2")}
"""Dtype codes of the header's ``dtype`` field (0 is "no payload")."""


class Kind(enum.IntEnum):
    """What a message is."""

    PUSH = 1
    """Worker to server: weights (or a delta) to combine; the reply carries the new copy."""
    PULL = 2
    """Worker to server: ask for the current copy."""
    REPLY = 3
    """Server to worker: the answer to a push or a pull."""
    ERROR = 4
    """Server to worker: the request was rejected; ``status`` holds the :class:`Reason`."""


class Status(enum.IntEnum):
    """What the server did with a request (a reply's ``status``)."""

    APPLIED = 0
    """The push was combined into the server's copy."""
    DUPLICATE = 1
    """The push's step was already applied for this worker by an earlier attempt of its task
    (a Spark retry): acknowledged, not applied again; the reply still carries the current copy."""
    PULLED = 2
    """A pull: the reply carries the current copy."""


class Reason(enum.IntEnum):
    """Why the server rejected a message (the key of its reject counters, by ``name.lower()``)."""

    MALFORMED = 1
    """Wrong number of frames, truncated or bad header, payload length not ``count`` elements."""
    BAD_HMAC = 2
    """The tag does not authenticate the message under the job's secret."""
    OVERSIZED = 3
    """More elements than the model has."""
    WRONG_DTYPE = 4
    """A dtype other than the server's."""
    WRONG_COUNT = 5
    """Fewer elements than the model has (or a pull with a payload)."""
    WRONG_JOB = 6
    """A job id other than the job being served (an old epoch's straggler, another job)."""
    REPLAY = 7
    """A step not greater than the last one accepted from that worker attempt."""
    BAD_KIND = 8
    """A kind a worker may not send (reply, error)."""
    BAD_VERSION = 9
    """A base version newer than the server's own."""
    INTERNAL = 10
    """The server failed while handling an otherwise valid message (a bug; logged with a trace)."""
    NONFINITE = 11
    """An authenticated push holding NaN or infinite values (a worker that diverged): never combined."""

    @property
    def label(self) -> str:
        return self.name.lower()


class WireError(ValueError):
    """A message failed a structural check; ``reason`` says which."""

    def __init__(self, reason: Reason, message: str):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):
        return (type(self), (self.reason, self.args[0]))


class Header(NamedTuple):
    """The decoded header fields (see the module docstring)."""

    kind: int
    dtype: int
    job_id: bytes
    worker: int
    attempt: int
    step: int
    version: int
    count: int
    status: int = 0
    flags: int = 0
    mix: float = 1.0

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, FORMAT_VERSION, *self)


@dataclass(frozen=True)
class JobCredentials:
    """A job's id and HMAC secret. The ``repr`` never shows the secret."""

    job_id: bytes
    secret: bytes

    def __post_init__(self):
        if not isinstance(self.job_id, bytes) or len(self.job_id) != JOB_ID_SIZE:
            raise ValueError(f"a job id is {JOB_ID_SIZE} bytes")
        if not isinstance(self.secret, bytes) or len(self.secret) < 16:
            raise ValueError("a job secret is at least 16 bytes")

    @classmethod
    def new(cls) -> JobCredentials:
        """Fresh random credentials (``secrets.token_bytes``)."""
        return cls(secrets.token_bytes(JOB_ID_SIZE), secrets.token_bytes(SECRET_SIZE))

    def __repr__(self) -> str:
        return f"JobCredentials(job_id={self.job_id.hex()}, secret=<{len(self.secret)} bytes>)"


@dataclass(frozen=True)
class Message:
    """A structurally valid message: its header, the header's raw bytes, payload bytes and tag."""

    header: Header
    header_bytes: bytes
    payload: memoryview
    tag: bytes

    def array(self) -> np.ndarray:
        """The payload as a read-only 1-D array of the header's dtype (no copy, never unpickled)."""
        if self.header.dtype == 0:
            return np.empty(0, dtype=np.float32)
        return np.frombuffer(self.payload, dtype=DTYPES[self.header.dtype], count=self.header.count)


def dtype_code(dtype) -> int:
    """The header code of a numpy dtype; ``ValueError`` for one the format lacks."""
    dt = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    for code, d in DTYPES.items():
        if d == dt:
            return code
    raise ValueError(f"the wire format carries float32, float64 and float16 only, not {np.dtype(dtype)}")


def sign(secret: bytes, header_bytes: bytes, payload) -> bytes:
    """HMAC-SHA256 of header then payload under ``secret``."""
    mac = hmac.new(secret, header_bytes, hashlib.sha256)
    if len(payload):
        mac.update(payload)
    return mac.digest()


def verify(secret: bytes, message: Message) -> bool:
    """Whether ``message``'s tag authenticates it under ``secret`` (constant-time comparison)."""
    return hmac.compare_digest(sign(secret, message.header_bytes, message.payload), message.tag)


def encode(header: Header, payload, secret: bytes) -> list:
    """The three frames of a message: packed header, payload bytes, tag under the job's ``secret``. ``payload``
    (a contiguous 1-D array, bytes, or None for none) is what the header's ``count`` and ``dtype`` describe."""
    if isinstance(payload, np.ndarray) and (payload.ndim != 1 or not payload.flags.c_contiguous):
        raise ValueError("a payload array must be 1-D and contiguous")
    data = memoryview(b"" if payload is None else payload).cast("B")
    hb = header.pack()
    return [hb, data, sign(secret, hb, data)]


def _buffer(frame) -> memoryview:
    """A frame's bytes as a memoryview (zmq.Frame, bytes or memoryview)."""
    buf = getattr(frame, "buffer", frame)
    return memoryview(buf).cast("B") if not isinstance(buf, memoryview) or buf.format != "B" else buf


def decode(frames: Sequence) -> Message:
    """Check a message's structure and return it; :class:`WireError` names what is wrong. The tag itself is
    checked by :func:`verify`."""
    if len(frames) != 3:
        raise WireError(Reason.MALFORMED, f"expected 3 frames (header, payload, tag), got {len(frames)}")
    hb, payload, tag = (_buffer(f) for f in frames)
    if len(hb) != HEADER_SIZE:
        raise WireError(Reason.MALFORMED, f"header is {len(hb)} bytes, not {HEADER_SIZE}")
    header_bytes = hb.tobytes()
    magic, fmt, *fields = HEADER.unpack(header_bytes)
    header = Header(*fields)
    kind, dtype, count = header.kind, header.dtype, header.count
    if magic != MAGIC:
        raise WireError(Reason.MALFORMED, f"bad magic {magic!r}")
    if fmt != FORMAT_VERSION:
        raise WireError(Reason.MALFORMED, f"wire format version {fmt}; this server speaks {FORMAT_VERSION}")
    if kind not in Kind._value2member_map_:
        raise WireError(Reason.MALFORMED, f"unknown message kind {kind}")
    if dtype != 0 and dtype not in DTYPES:
        raise WireError(Reason.WRONG_DTYPE, f"unknown dtype code {dtype}")
    itemsize = DTYPES[dtype].itemsize if dtype else 0
    if dtype == 0 and count:
        raise WireError(Reason.MALFORMED, f"dtype code 0 (no payload) with count {count}")
    if len(payload) != count * itemsize:
        raise WireError(Reason.MALFORMED, f"payload is {len(payload)} bytes but the header says {count} elements "
                                          f"of {itemsize} bytes")
    if len(tag) != TAG_SIZE:
        raise WireError(Reason.MALFORMED, f"tag is {len(tag)} bytes, not {TAG_SIZE}")
    return Message(header, header_bytes, payload, tag.tobytes())
