"""The parameter server with several clients on loopback (no Spark).

Every kind of bad message is sent by a raw socket while a well-behaved worker keeps
pushing and pulling; each is rejected and counted under its reason, and the good worker's
pushes all land exactly.
"""

from __future__ import annotations

import os
import pickle
import threading
import time

import numpy as np
import pytest
import zmq

from sparknet.errors import DeadlineExceeded
from sparknet.ps import ParameterServer, PSClient, RejectedError, Status
from sparknet.ps.wire import Header, JobCredentials, Kind, Reason, decode, encode, verify

N = 1000  # model size
STEP = np.float32(2.0 ** -10)  # deltas of this size add exactly in float32


@pytest.fixture
def server():
    ps = ParameterServer(np.zeros(N, np.float32), "delta", num_workers=2).start()
    try:
        yield ps
    finally:
        ps.stop()
    assert not ps.alive


class Raw:
    """A raw DEALER socket: sends whatever frames it is given, reads the server's answer."""

    def __init__(self, endpoint):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, frames, timeout=5.0):
        self.sock.send_multipart(frames)
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return decode(self.sock.recv_multipart())

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


def _good_worker(ps, creds, worker, stop, out):
    """Pushes constant deltas and pulls, alternately, until told to stop (at least 5 pushes)."""
    sent = step = 0
    with PSClient(ps.endpoint, creds.job_id, creds.secret, worker=worker, timeout=10) as c:
        r = c.pull(step)
        while not stop.is_set() or sent < 5:
            r = c.push(step + 1, np.full(N, STEP, np.float32), r.version)
            assert r.status is Status.APPLIED
            sent += 1
            pulled = c.pull(step + 2)
            assert pulled.version >= r.version
            step += 2
    out["sent"] = sent


def test_every_bad_message_is_rejected_and_counted_while_a_good_worker_trains(server, tmp_path):
    creds = server.new_job()
    stop, out = threading.Event(), {}
    good = threading.Thread(target=_good_worker, args=(server, creds, 0, stop, out))
    good.start()
    raw = Raw(server.endpoint)
    marker = tmp_path / "unpickled"
    try:
        payload = np.ones(N, np.float32)

        def msg(kind=Kind.PUSH, dtype=1, job=creds.job_id, worker=1, attempt=0, step=1, count=N, data=payload,
                secret=creds.secret):
            return encode(Header(kind, dtype, job, worker, attempt, step, 0, count), data, secret)

        blob = pickle.dumps(type("Evil", (), {"__reduce__": lambda self: (os.mkdir, (str(marker),))})())
        blob += b"\0" * (-len(blob) % 4)
        pickle_frames = encode(Header(Kind.PUSH, 1, creds.job_id, 1, 0, 1, 0, len(blob) // 4), blob, b"?" * 32)
        other = JobCredentials.new()
        cases = {
            "malformed": [b"garbage"],
            "truncated": [msg()[0][:30], msg()[1], msg()[2]],
            "bad_hmac": msg(secret=b"x" * 32),
            "oversized": msg(count=N + 1, data=np.ones(N + 1, np.float32)),
            "wrong_dtype": msg(dtype=2, data=np.ones(N, np.float64)),
            "wrong_count": msg(count=N - 1, data=np.ones(N - 1, np.float32)),
            "wrong_job": msg(job=other.job_id, secret=other.secret),
            "pickle": pickle_frames,
            "bad_kind": msg(kind=Kind.REPLY),
        }
        expected = {"malformed": 2, "bad_hmac": 2, "oversized": 1, "wrong_dtype": 1, "wrong_count": 1,
                    "wrong_job": 1, "bad_kind": 1}
        unauthenticated = {"malformed", "truncated", "bad_hmac", "wrong_job", "pickle"}  # no key signs them
        for name, frames in cases.items():
            answer = raw.send(frames, timeout=0.5 if name in unauthenticated else 5.0)
            if name in unauthenticated:
                assert answer is None, name  # nothing: no signed text of the sender's choosing
            else:
                assert answer is not None and answer.header.kind == Kind.ERROR, name
                assert verify(creds.secret, answer)  # the refusal of an authenticated message is signed
        # A replay: a valid push (as if captured on the wire) sent twice, then an older step.
        valid = msg(worker=1, step=5, data=np.zeros(N, np.float32))
        assert raw.send(valid).header.status == Status.APPLIED
        again = raw.send(valid)
        assert again.header.kind == Kind.ERROR and again.header.status == Reason.REPLAY
        older = raw.send(msg(worker=1, step=3, data=np.zeros(N, np.float32)))
        assert older.header.status == Reason.REPLAY
        expected["replay"] = 2
        time.sleep(0.2)
    finally:
        stop.set()
        good.join(30)
        raw.close()
    assert not good.is_alive() and out["sent"] >= 5
    stats = server.stats()
    assert stats["rejected"] == expected, stats["rejected"]
    assert stats["rejected_total"] == sum(expected.values())
    assert not marker.exists()  # nothing was unpickled
    # Every good push was applied exactly once (worker 1's pushed zeros applied once).
    assert stats["applied_by_worker"][0] == out["sent"]
    assert stats["pushes_applied"] == out["sent"] + 1
    np.testing.assert_array_equal(server.weights(), np.full(N, STEP * out["sent"], np.float32))


def test_several_clients_nothing_lost_nothing_twice(server):
    creds = server.new_job()
    pushes = 30
    errors = []

    def worker(w):
        try:
            with PSClient(server.endpoint, creds.job_id, creds.secret, worker=w, timeout=10) as c:
                r = c.pull(0)
                for s in range(1, pushes + 1):
                    r = c.push(s, np.full(N, STEP * (w + 1), np.float32), r.version)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    stats = server.stats()
    assert stats["pushes_applied"] == 4 * pushes and stats["version"] == 4 * pushes
    assert stats["applied_by_worker"] == {w: pushes for w in range(4)}
    np.testing.assert_array_equal(server.weights(), np.full(N, STEP * pushes * (1 + 2 + 3 + 4), np.float32))
    assert sum(stats["staleness_histogram"].values()) == 4 * pushes
    assert 0 <= stats["staleness_mean"] <= stats["staleness_max"] <= 3 * pushes


def test_retried_attempt_does_not_apply_its_pushes_twice(server):
    creds = server.new_job()
    delta = np.full(N, STEP, np.float32)
    with PSClient(server.endpoint, creds.job_id, creds.secret, worker=0, attempt=0) as a0:
        r = a0.pull(0)
        for s in (5, 10):
            r = a0.push(s, delta, r.version)
    with PSClient(server.endpoint, creds.job_id, creds.secret, worker=0, attempt=1) as a1:
        r = a1.pull(0)
        assert r.version == 2
        statuses = []
        for s in (5, 10, 15):
            r = a1.push(s, delta, r.version)
            statuses.append(r.status)
    assert statuses == [Status.DUPLICATE, Status.DUPLICATE, Status.APPLIED]
    stats = server.stats()
    assert stats["pushes_applied"] == 3 and stats["duplicate_pushes"] == 2 and stats["pushes_received"] == 5
    np.testing.assert_array_equal(server.weights(), np.full(N, 3 * STEP, np.float32))


def test_new_job_rejects_the_old_jobs_messages(server):
    old = server.new_job()
    with PSClient(server.endpoint, old.job_id, old.secret, worker=0) as c:
        c.pull(0)
        server.new_job()
        with pytest.raises(RejectedError, match="wrong_job") as e:
            c.push(1, np.zeros(N, np.float32), 0)
        assert e.value.reason == Reason.WRONG_JOB and e.value.worker == 0
    assert server.stats()["rejected"] == {"wrong_job": 1}


def test_elastic_reply_carries_the_old_center_and_alpha():
    with ParameterServer(np.zeros(4, np.float32), "elastic", num_workers=2) as ps:
        creds = ps.new_job()
        with PSClient(ps.endpoint, creds.job_id, creds.secret, worker=0) as c:
            c.pull(0)
            r = c.push(1, np.full(4, 8, np.float32), 0)
        assert r.mix == pytest.approx(0.45) and not r.send_delta
        np.testing.assert_array_equal(r.weights, np.zeros(4, np.float32))  # center before the move
        np.testing.assert_allclose(ps.weights(), np.full(4, 8 * 0.45, np.float32))


def test_mean_combiner_via_push_and_stale_version_rejected():
    with ParameterServer(np.full(4, 2, np.float32), "mean") as ps:
        creds = ps.new_job()
        with PSClient(ps.endpoint, creds.job_id, creds.secret, worker=0) as c:
            r = c.push(1, np.zeros(4, np.float32), 0)
            np.testing.assert_array_equal(r.weights, np.ones(4, np.float32))
            with pytest.raises(RejectedError, match="bad_version"):
                c.push(2, np.zeros(4, np.float32), 99)


def test_request_timeout_names_the_worker():
    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)  # accepts connections, never answers
    try:
        mute.setsockopt(zmq.LINGER, 0)
        port = mute.bind_to_random_port("tcp://127.0.0.1")
        creds = JobCredentials.new()
        with PSClient(f"tcp://127.0.0.1:{port}", creds.job_id, creds.secret, worker=7, attempt=2, timeout=0.3) as c:
            t0 = time.perf_counter()
            with pytest.raises(DeadlineExceeded, match=r"worker 7 \(attempt 2\)"):
                c.pull(0)
            assert time.perf_counter() - t0 < 3
    finally:
        mute.close(linger=0)
        ctx.term()


def test_binds_loopback_by_an_os_port_and_refuses_all_interfaces():
    with pytest.raises(ValueError, match="every interface"):
        ParameterServer(np.zeros(2, np.float32), host="0.0.0.0")
    a = ParameterServer(np.zeros(2, np.float32)).start()
    b = ParameterServer(np.zeros(2, np.float32)).start()
    try:
        assert a.endpoint.startswith("tcp://127.0.0.1:") and a.endpoint != b.endpoint
    finally:
        a.stop()
        b.stop()
    assert not a.alive and not b.alive


def test_no_job_no_answer():
    with ParameterServer(np.zeros(2, np.float32)) as ps:
        creds = JobCredentials.new()
        with PSClient(ps.endpoint, creds.job_id, creds.secret, worker=0, timeout=0.3) as c:
            with pytest.raises(DeadlineExceeded):
                c.pull(0)
        assert ps.stats()["rejected"] == {"wrong_job": 1}


def test_a_failing_combiner_is_counted_and_serving_goes_on():
    from sparknet.ps import Combiner

    class Broken(Combiner):
        def combine(self, server, pushed, *, staleness, num_workers):
            if pushed[0] < 0:
                raise ArithmeticError("negative")
            server += pushed

    with ParameterServer(np.zeros(3, np.float32), Broken()) as ps:
        creds = ps.new_job()
        with PSClient(ps.endpoint, creds.job_id, creds.secret, worker=0) as c:
            with pytest.raises(RejectedError, match="internal"):
                c.push(1, np.full(3, -1, np.float32), 0)
            r = c.push(2, np.ones(3, np.float32), 0)
            np.testing.assert_array_equal(r.weights, np.ones(3, np.float32))
        assert ps.stats()["rejected"] == {"internal": 1}


def test_a_req_socket_client_is_served_too(server):
    creds = server.new_job()
    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    try:
        req.setsockopt(zmq.LINGER, 0)
        req.connect(server.endpoint)
        req.send_multipart(encode(Header(Kind.PULL, 0, creds.job_id, 4, 0, 0, 0, 0), None, creds.secret))
        assert req.poll(5000)
        answer = decode(req.recv_multipart())
    finally:
        req.close(linger=0)
        ctx.term()
    assert verify(creds.secret, answer)
    assert answer.header.kind == Kind.REPLY and answer.header.status == Status.PULLED
    np.testing.assert_array_equal(answer.array(), np.zeros(N, np.float32))


def test_last_heard_moves_on_authenticated_messages_only(server):
    creds = server.new_job()
    t0 = server.last_heard
    raw = Raw(server.endpoint)
    try:
        time.sleep(0.05)
        raw.send(encode(Header(Kind.PULL, 0, creds.job_id, 0, 0, 0, 0, 0), None, b"x" * 32))  # bad tag
        assert server.last_heard == t0
        with PSClient(server.endpoint, creds.job_id, creds.secret, worker=0) as c:
            c.pull(0)
        assert server.last_heard > t0
    finally:
        raw.close()


def test_a_signed_push_of_nan_or_inf_is_refused_counted_and_told(server):
    """A worker that diverged: its correctly signed push holds NaN (or Inf). It never reaches the weights; the
    server counts it under its reason and tells the worker, whose client raises; good pushes go on landing."""
    creds = server.new_job()
    with PSClient(server.endpoint, creds.job_id, creds.secret, worker=0, timeout=10) as c:
        r = c.push(1, np.full(N, STEP, np.float32), 0)
        assert r.status is Status.APPLIED
        for step, bad in ((2, np.nan), (3, np.inf)):
            delta = np.full(N, STEP, np.float32)
            delta[7] = bad
            with pytest.raises(RejectedError, match="nonfinite") as info:
                c.push(step, delta, r.version)
            assert info.value.reason == Reason.NONFINITE
        np.testing.assert_array_equal(server.weights(), np.full(N, STEP, np.float32))  # untouched
        assert c.push(4, np.full(N, STEP, np.float32), r.version).status is Status.APPLIED
    stats = server.stats()
    assert stats["rejected"] == {"nonfinite": 2} and stats["pushes_applied"] == 2
    assert np.isfinite(server.weights()).all()


def test_an_unsigned_push_with_no_dtype_is_refused_quietly(server, caplog):
    """An unsigned PUSH claiming dtype 0 once raised a KeyError inside the server (a traceback per message) and an
    unsigned PULL got an ERROR signed with the job's secret echoing the fields it chose. Both now get nothing, and
    the log holds no traceback."""
    creds = server.new_job()
    raw = Raw(server.endpoint)
    try:
        with caplog.at_level("DEBUG", logger="sparknet.ps.server"):
            for i in range(5):
                frames = encode(Header(Kind.PUSH, 0, creds.job_id, 3, 0, 10 + i, 0, 0), None, b"k" * 32)
                assert raw.send(frames, timeout=0.3) is None
            pull = encode(Header(Kind.PULL, 0, creds.job_id, 7, 1, 99, 0, 0), None, b"k" * 32)
            assert raw.send(pull, timeout=0.3) is None
    finally:
        raw.close()
    assert server.stats()["rejected"] == {"bad_hmac": 6}
    assert "Traceback" not in caplog.text and not any(r.exc_info for r in caplog.records)
