"""The parameter server's wire format: header layout, tags, structural checks."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest

from sparknet.ps import wire
from sparknet.ps.wire import Header, JobCredentials, Kind, Reason, WireError, decode, encode, verify

CREDS = JobCredentials(b"j" * 16, b"s" * 32)


def _push(count=5, step=1, dtype=1, job=CREDS.job_id):
    return Header(Kind.PUSH, dtype, job, 3, 1, step, 7, count)


def test_header_is_68_bytes_and_round_trips():
    assert wire.HEADER_SIZE == 68
    h = Header(Kind.REPLY, 1, CREDS.job_id, 2**32 - 1, 9, 2**63, 12, 5, 1, wire.FLAG_SEND_DELTA, 0.25)
    frames = encode(h, np.arange(5, dtype=np.float32), CREDS.secret)
    msg = decode(frames)
    assert msg.header == h
    assert verify(CREDS.secret, msg)
    np.testing.assert_array_equal(msg.array(), np.arange(5, dtype=np.float32))
    assert frames[0][:4] == b"SNPS" and struct.unpack_from("<H", frames[0], 4)[0] == wire.FORMAT_VERSION


def test_tag_is_hmac_sha256_of_header_and_payload():
    import hashlib
    import hmac

    payload = np.ones(5, np.float32)
    hb, data, tag = encode(_push(), payload, CREDS.secret)
    assert tag == hmac.new(CREDS.secret, hb + payload.tobytes(), hashlib.sha256).digest()


@pytest.mark.parametrize("mutate", ["header", "payload", "key"])
def test_any_change_fails_verification(mutate):
    hb, data, tag = encode(_push(), np.ones(5, np.float32), CREDS.secret)
    hb, data = bytearray(hb), bytearray(data)
    secret = CREDS.secret
    if mutate == "header":
        hb[30] ^= 1  # a bit of the step
    elif mutate == "payload":
        data[0] ^= 1
    else:
        secret = b"t" * 32
    assert not verify(secret, decode([bytes(hb), bytes(data), tag]))


@pytest.mark.parametrize("frames, reason", [
    (lambda f: f[:2], Reason.MALFORMED),                                   # a frame missing
    (lambda f: [f[0][:40], f[1], f[2]], Reason.MALFORMED),                 # truncated header
    (lambda f: [b"XXXX" + f[0][4:], f[1], f[2]], Reason.MALFORMED),        # bad magic
    (lambda f: [f[0][:4] + b"\x09\x00" + f[0][6:], f[1], f[2]], Reason.MALFORMED),  # other format version
    (lambda f: [f[0][:6] + b"\x09" + f[0][7:], f[1], f[2]], Reason.MALFORMED),      # unknown kind
    (lambda f: [f[0][:7] + b"\x07" + f[0][8:], f[1], f[2]], Reason.WRONG_DTYPE),    # unknown dtype
    (lambda f: [f[0], bytes(f[1])[:-4], f[2]], Reason.MALFORMED),          # truncated payload
    (lambda f: [f[0], f[1], f[2][:16]], Reason.MALFORMED),                 # short tag
])
def test_decode_rejects_bad_structure(frames, reason):
    good = encode(_push(), np.ones(5, np.float32), CREDS.secret)
    with pytest.raises(WireError) as e:
        decode(frames(good))
    assert e.value.reason is reason


def test_pickle_payload_is_read_as_numbers_never_unpickled(tmp_path):
    import os

    marker = tmp_path / "pwned"
    blob = pickle.dumps(type("X", (), {"__reduce__": lambda self: (os.mkdir, (str(marker),))})())
    blob += b"\0" * (-len(blob) % 4)
    h = _push(count=len(blob) // 4)
    msg = decode(encode(h, blob, CREDS.secret))
    assert msg.array().dtype == np.float32 and msg.array().size == len(blob) // 4
    assert not marker.exists()


def test_credentials_are_random_and_hide_the_secret():
    a, b = JobCredentials.new(), JobCredentials.new()
    assert a.job_id != b.job_id and a.secret != b.secret and len(a.secret) == 32
    assert a.secret.hex() not in repr(a) and str(a.secret) not in repr(a)
    with pytest.raises(ValueError):
        JobCredentials(b"short", b"s" * 32)


def test_dtype_codes():
    assert wire.dtype_code(np.float32) == 1 and wire.dtype_code(">f4") == 1
    with pytest.raises(ValueError, match="float32"):
        wire.dtype_code(np.int64)


def test_wire_error_pickles():
    e = pickle.loads(pickle.dumps(WireError(Reason.REPLAY, "again")))
    assert e.reason is Reason.REPLAY and str(e) == "again"


def test_transport_keys_never_show_a_secret_key():
    from sparknet._transport import ServerKeys
    from sparknet.ps._worker import TaskSpec

    keys = ServerKeys.new()
    assert keys.client.server_public == keys.public and keys.client.public != keys.public
    for text in (repr(keys), repr(keys.client), str(keys)):
        assert keys.secret.decode() not in text and keys.client.secret.decode() not in text
    spec = TaskSpec(endpoint="tcp://127.0.0.1:1", job_id=b"j" * 16, secret=b"s" * 32, net={}, solver={}, batch_size=8,
                    tau=1, seed=0, epoch=0, iteration=0, shuffle=True, sample_shape=None, timeout_s=60.0,
                    keys=keys.client)
    assert keys.client.secret.decode() not in repr(spec)
    with pytest.raises(ValueError, match="40 bytes"):
        type(keys.client)(keys.public, keys.public, b"short")


def test_transport_limits_check_themselves():
    from sparknet._transport import Limits

    assert Limits.for_frame(100 * 10**6).dead_after_s == pytest.approx(40.0)
    with pytest.raises(ValueError, match="handshake_s"):
        Limits(handshake_s=0)
    with pytest.raises(ValueError, match="at least heartbeat_s"):
        Limits(heartbeat_s=10.0, dead_after_s=5.0)
