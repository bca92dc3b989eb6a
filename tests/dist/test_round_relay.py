"""The rounds engine's relay (weights down, updates up, beside Spark's job) on loopback, with real ZeroMQ.

What the engine relies on: a task gets exactly the round's bytes and dtype, an update is held under the
(partition, task attempt) that sent it and read back scaled as the task-result path scales it, a get sent
ahead (a prefetch) is answered when the round is published, a request of another round or of the wrong
size is refused with a reason, a peer without the fit's key never gets past the handshake, and a driver that
cannot be reached is reported as such within the reach deadline.
"""

from __future__ import annotations

import os
import stat
import time

import numpy as np
import pytest
import zmq
from _zmq_peers import long_frame, null_handshake, port_of, stream

from sparknet._transport import ClientKeys, Limits, ServerKeys
from sparknet.spark._relay import RelayAddress, RelayClient, RelayUnreachable, RoundRelay

N = 1000  # weights in these tests
FAST = Limits(handshake_s=1.0, heartbeat_s=0.2, dead_after_s=1.0)


@pytest.fixture
def relay():
    with RoundRelay("127.0.0.1", "127.0.0.1", max_bytes=8 * N, update_bytes=4 * N, limits=FAST) as server:
        yield server


@pytest.fixture
def client(relay):
    c = RelayClient(relay.address)
    try:
        yield c
    finally:
        c.close()


def test_a_task_gets_the_rounds_weights_and_its_update_is_read_back_scaled(relay, client):
    weights = np.arange(N, dtype=np.float32) / 7
    relay.publish(0, message=weights)
    got = client.get(0)
    assert got.dtype == np.float32 and np.array_equal(got, weights)
    delta = (np.arange(N, dtype=np.float32) - 3) / 11
    client.put(0, 1, 4242, delta)()  # the returned function waits until the driver holds it
    scaled = relay.take(0, 1, 4242, 12, scale=True)
    assert np.array_equal(scaled, delta * np.float32(12))  # the product the task-result path folds, to the bit
    with pytest.raises(RuntimeError, match="partition 1 .*attempt 4242.* never reached"):
        relay.take(0, 1, 4242, 12, scale=True)  # taken once
    assert relay.served == 1 and relay.received == 1


def test_an_update_is_held_under_the_attempt_that_sent_it(relay, client):
    relay.publish(3, message=np.zeros(N, dtype=np.float32))
    client.put(3, 0, 10, np.full(N, 1.0, dtype=np.float32))()  # an attempt that failed after sending
    client.put(3, 0, 11, np.full(N, 2.0, dtype=np.float32))()  # Spark's retry, whose result the driver gets
    assert relay.take(3, 0, 11, 1, scale=True)[0] == 2.0
    assert relay.take(3, 0, 10, 1, scale=True)[0] == 1.0
    relay.publish(4, message=np.zeros(N, dtype=np.float32))  # a new round drops what is left of the last
    with pytest.raises(RuntimeError, match="never reached"):
        relay.take(3, 0, 11, 1, scale=True)


def test_compressed_messages_keep_their_dtype_and_updates_come_back_as_bytes():
    with RoundRelay("127.0.0.1", "127.0.0.1", max_bytes=8 * N, update_bytes=None, limits=FAST) as relay:
        c = RelayClient(relay.address)
        try:
            message = (np.arange(N) % 251).astype(np.uint8)
            relay.publish(0, message=message, full=np.ones(N, dtype=np.float32))
            got = c.get(0)
            assert got.dtype == np.uint8 and np.array_equal(got, message)
            assert c.get(0, "full").dtype == np.float32
            encoded = (np.arange(N // 2) % 7).astype(np.uint8)  # any size up to max_bytes
            c.put(0, 2, 5, encoded)()
            back = relay.take(0, 2, 5, 9, scale=False)
            assert back.dtype == np.uint8 and np.array_equal(back, encoded)
        finally:
            c.close()


def test_a_prefetch_is_answered_when_the_next_round_is_published(relay, client):
    relay.publish(0, message=np.zeros(N, dtype=np.float32))
    client.get(0)
    client.prefetch(1)
    time.sleep(0.1)
    assert relay.served == 1  # parked: round 1 is not published yet
    nxt = np.full(N, 5.0, dtype=np.float32)
    relay.publish(1, message=nxt)
    t = time.perf_counter()
    got = client.get(1)
    assert np.array_equal(got, nxt) and relay.served == 2
    assert time.perf_counter() - t < 2.0


def test_a_prefetch_for_a_round_this_process_does_not_run_is_skipped(relay, client):
    relay.publish(0, message=np.zeros(N, dtype=np.float32))
    client.get(0)
    client.prefetch(1)
    relay.publish(1, message=np.full(N, 1.0, dtype=np.float32))
    relay.publish(2, message=np.full(N, 2.0, dtype=np.float32))
    assert client.get(2)[0] == 2.0  # the answer for round 1 waiting in the socket is skipped by its nonce


@pytest.mark.parametrize("case", ["round", "size", "name"])
def test_requests_of_another_round_a_wrong_size_or_an_unknown_name_are_refused_with_a_reason(relay, client, case):
    relay.publish(2, message=np.zeros(N, dtype=np.float32))
    client.get(2)  # reached
    if case == "round":
        with pytest.raises(RuntimeError, match="refused.*round 1 asked for, the driver is at 3"):
            client.get(0)
    elif case == "size":
        with pytest.raises(RuntimeError, match="refused.*size: an update of 400 bytes"):
            client.put(2, 0, 1, np.zeros(100, dtype=np.float32))()
    else:
        with pytest.raises(RuntimeError, match="refused.*no 'full' published"):
            client.get(2, "full")
    assert relay.refused_requests == 1
    assert client.get(2).shape == (N,)  # the client goes on


def test_a_peer_without_the_fits_key_is_refused_at_the_handshake(relay):
    relay.publish(0, message=np.zeros(N, dtype=np.float32))
    other = ServerKeys.new().client  # another fit's client keypair, aimed at this relay's server key
    keys = ClientKeys(relay.address.keys.server_public, other.public, other.secret)
    stranger = RelayClient(RelayAddress(relay.address.endpoint, keys, reach_s=1.0))
    try:
        with pytest.raises(RelayUnreachable, match="could not reach"):
            stranger.get(0)
    finally:
        stranger.close()
    assert relay.refused >= 1 and relay.served == 0


def test_a_peer_speaking_without_curvezmq_is_hung_up_on(relay):
    relay.publish(0, message=np.zeros(N, dtype=np.float32))
    frames = [long_frame(1000) + bytes(1000)] * 16
    sent, hung_up = stream(port_of(relay.address.endpoint), null_handshake(b"DEALER"), frames, handshake=True)
    assert hung_up and relay.served == 0 and relay.received == 0


def test_a_relay_nobody_listens_on_is_reported_unreachable_within_the_reach_deadline():
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as sock:  # a free port, then closed: nothing listens
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        sock.unbind(f"tcp://127.0.0.1:{port}")
    keys = ServerKeys.new().client
    c = RelayClient(RelayAddress(f"tcp://127.0.0.1:{port}", keys, reach_s=0.5))
    try:
        t = time.perf_counter()
        with pytest.raises(RelayUnreachable, match="within 0.5 s"):
            c.get(0)
        assert time.perf_counter() - t < 3.0
    finally:
        c.close()


def test_a_local_relay_is_a_unix_socket_in_a_folder_only_its_user_can_open_removed_at_close():
    """A local master's executors share the driver's machine: the relay listens on a Unix socket in a folder of
    mode 0700 (the file system keeps other users out) and skips CurveZMQ's encryption."""
    with RoundRelay("127.0.0.1", "127.0.0.1", max_bytes=8 * N, update_bytes=4 * N, limits=FAST, local=True) as relay:
        assert relay.address.endpoint.startswith("ipc://") and relay.address.keys is None
        folder = os.path.dirname(relay.address.endpoint[len("ipc://"):])
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        c = RelayClient(relay.address)
        try:
            weights = np.arange(N, dtype=np.float32)
            relay.publish(0, message=weights)
            assert np.array_equal(c.get(0), weights)
            c.put(0, 0, 1, weights)()
            assert np.array_equal(relay.take(0, 0, 1, 3, scale=True), weights * np.float32(3))
        finally:
            c.close()
    assert not os.path.exists(folder)
