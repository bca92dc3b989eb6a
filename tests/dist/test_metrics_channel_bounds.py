"""The barrier engine's metrics channel bounds every peer before it trusts a byte (issue #18's probes), on loopback.

A frame claiming 4 GiB once cost the driver 65 MB before any authentication. Now a peer without the channel's
client keys does not get past the handshake (so it sends no frame, finished or not), a frame over the cap
disconnects its sender before it is buffered, an unfinished handshake is closed after ``handshake_s``, a silent
peer after ``dead_after_s``, and a flood of malformed records costs a bounded number of log lines.
"""

from __future__ import annotations

import logging
import os
import socket

import pytest
import zmq
from _zmq_peers import (KIB, MIB, SilentProxy, closed_by_server, fd_count, greeting, long_frame, null_handshake,
                        port_of, stream)

from sparknet._transport import ClientKeys, Limits, ServerKeys
from sparknet.spark._channel import MetricsReceiver, MetricsSender

CAP = 1 * MIB  # the channel's max_bytes in these tests
FAST = Limits(handshake_s=1.0, heartbeat_s=0.2, dead_after_s=1.0)


@pytest.fixture
def rx():
    with MetricsReceiver("127.0.0.1", "127.0.0.1", max_bytes=CAP, limits=FAST) as receiver:
        yield receiver


def _honest_record_arrives(rx, endpoint: str | None = None) -> None:
    sender = MetricsSender(endpoint or rx.endpoint, rx.client_keys)
    try:
        assert sender.send({"event": "round", "round": 1})
        assert rx.recv(5.0) == {"event": "round", "round": 1}
    finally:
        sender.close()


def test_a_sender_holds_back_a_record_over_the_receivers_cap_and_says_so():
    """A state larger than the channel takes would be dropped unread by the driver, and its sender would not know:
    told the cap, the sender keeps it back and answers ``False``, so the rank can say the state was lost."""
    with MetricsReceiver("127.0.0.1", "127.0.0.1", max_bytes=CAP, limits=FAST) as rx:
        sender = MetricsSender(rx.endpoint, rx.client_keys, max_bytes=CAP)
        try:
            assert not sender.send({"event": "state", "round": 1}, bytes(CAP))  # the body makes it one frame too many
            assert sender.send({"event": "state_lost", "round": 1}, bytes(CAP // 2))
            got = rx.recv(5.0)
            assert got["event"] == "state_lost" and len(got["payload"]) == CAP // 2
            assert rx.recv(0.2) is None and rx.rejected == 0  # the large one never reached the driver
        finally:
            sender.close()


@pytest.mark.parametrize("mechanism", ["NULL", "CURVE"])
def test_a_stranger_claiming_a_4_gib_frame_is_closed_before_anything_is_buffered(rx, mechanism):
    """The frame header announces 4 GiB and 64 MB follow. A NULL greeting is refused at the greeting (the channel
    speaks only CurveZMQ); a CurveZMQ greeting whose first command claims 4 GiB is over the frame cap. Either
    way the channel hangs up having taken a few socket buffers, not the 64 MB."""
    head = greeting(mechanism.encode()) + long_frame(4 << 30, command=True)
    sent, hung_up = stream(port_of(rx.endpoint), head, [bytes(MIB)] * 64)
    assert hung_up and sent < 16 * MIB, (sent, hung_up)
    assert rx.recv(0.2) is None and rx.rejected == 0
    _honest_record_arrives(rx)


def test_a_strangers_unfinished_multipart_message_is_refused(rx):
    """480 frames of 64 KiB marked "more" and never finished (libzmq would buffer them all): a peer without keys
    does not get that far."""
    frames = [long_frame(64 * KIB, more=True) + bytes(64 * KIB)] * 480
    sent, hung_up = stream(port_of(rx.endpoint), null_handshake(b"PUSH"), frames, handshake=True)
    assert hung_up and sent < 480 * 64 * KIB // 2, (sent, hung_up)
    _honest_record_arrives(rx)


def test_a_sender_with_another_client_key_is_refused_at_the_handshake(rx):
    """The channel's public key is not enough: a sender with another client key never delivers a record."""
    other = ServerKeys.new().client
    forged = MetricsSender(rx.endpoint, ClientKeys(rx.client_keys.server_public, other.public, other.secret))
    try:
        forged._dialer.socket.setsockopt(zmq.LINGER, 0)
        assert forged.send({"event": "round", "round": 99})
        assert rx.recv(1.0) is None
    finally:
        forged.close()
    assert rx.refused >= 1 and rx.rejected == 0
    _honest_record_arrives(rx)


def test_idle_and_garbage_connections_are_closed_within_the_handshake_time(rx):
    """Hundreds of connections that send nothing or garbage: the garbage ones are closed at once, the idle ones
    when the handshake time runs out; an honest record arrives meanwhile and the driver's descriptors come back."""
    peers: list[socket.socket] = []
    before = fd_count()
    try:
        for i in range(200):
            peer = socket.create_connection(("127.0.0.1", port_of(rx.endpoint)), timeout=5)
            peers.append(peer)
            if i % 2:
                peer.sendall(os.urandom(300))
        _honest_record_arrives(rx)
        assert all(closed_by_server(peer, FAST.handshake_s + 5.0) for peer in peers)
        assert fd_count() <= before + len(peers) + 8  # the channel's ends of them are closed
    finally:
        for peer in peers:
            peer.close()


def test_a_sender_that_answers_no_heartbeat_is_dropped_and_a_quiet_live_one_is_kept(rx):
    """A sender's host that died without closing its connection: the channel pings, hears nothing, and closes its
    end after dead_after_s. While the sender lives it answers the pings (libzmq does) and keeps its connection."""
    proxy = SilentProxy(port_of(rx.endpoint))
    sender = MetricsSender(proxy.endpoint, rx.client_keys)
    try:
        assert sender.send({"event": "round", "round": 1}) and rx.recv(5.0)["round"] == 1
        assert not proxy.server_hung_up.wait(3 * FAST.dead_after_s)  # quiet, but it answers the pings
        assert sender.send({"event": "round", "round": 2}) and rx.recv(5.0)["round"] == 2
        assert proxy.accepted == 1  # the same connection
        proxy.freeze()
        assert proxy.server_hung_up.wait(FAST.dead_after_s + 5.0)
    finally:
        sender._dialer.socket.setsockopt(zmq.LINGER, 0)
        sender.close()
        proxy.close()


def test_a_flood_of_malformed_records_logs_a_bounded_number_of_lines(rx, caplog):
    """1,000 messages that are not records (JSON, but not an object), from a sender with the transport keys: every
    one is dropped and counted; the log gets the first ten and a count, never a line per record or a traceback."""
    forged = MetricsSender(rx.endpoint, rx.client_keys)
    try:
        with caplog.at_level(logging.DEBUG, logger="sparknet.spark._channel"):
            for i in range(1000):
                forged._dialer.socket.send(b"[%d]" % i)
            for _ in range(2000):  # each recv takes one message (a dropped one returns None)
                if rx.recv(1.0) is None and rx.rejected >= 1000:
                    break
    finally:
        forged.close()
    assert rx.rejected == 1000
    lines = [r for r in caplog.records if r.name == "sparknet.spark._channel"]
    assert 10 <= len(lines) <= 12, len(lines)
    assert "Traceback" not in caplog.text and not any(r.exc_info for r in caplog.records)
