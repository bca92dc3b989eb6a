"""Networking as on a real cluster, on loopback (no Spark).

Gloo's interface is the one holding the executor's Spark address; the driver's metrics channel
binds the address it is given and drops oversize, over-long and unsigned messages; the
parameter server refuses every spelling of a wildcard address.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import sys
from types import SimpleNamespace

import pytest
import torch.distributed as dist
import zmq

from sparknet.ps import ParameterServer
from sparknet.spark.barrier import executor as _barrier
from sparknet.spark.barrier.executor import GroupPlan, gloo_interface, interface_for_address, rendezvous
from sparknet.spark._channel import MetricsReceiver, MetricsSender

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="interface addresses are read the Linux way")
CLUSTER = GroupPlan(workers=1, local=False, rendezvous_timeout_s=10, collective_timeout_s=10)
NOWHERE = "203.0.113.77"  # TEST-NET-3: no interface holds it


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


# -- gloo's interface ------------------------------------------------------------------------

@linux
def test_interface_for_a_loopback_address_is_lo():
    assert interface_for_address("127.0.0.1") == "lo"
    if _has_ipv6_loopback():
        assert interface_for_address("::1") == "lo"
        assert interface_for_address("[::1]") == "lo"


def test_an_address_no_interface_holds_has_no_interface():
    assert interface_for_address(NOWHERE) is None
    assert interface_for_address("not-an-address") is None


@linux
def test_gloo_interface_from_the_executors_spark_address_then_spark_local_ip(monkeypatch):
    monkeypatch.delenv("SPARK_LOCAL_IP", raising=False)
    name, why = gloo_interface(CLUSTER, "127.0.0.1", "127.0.0.1")
    assert name == "lo" and "Spark address" in why
    monkeypatch.setattr(_barrier, "_route_source", lambda host: None)
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    name, why = gloo_interface(CLUSTER, NOWHERE, NOWHERE)
    assert name == "lo" and "SPARK_LOCAL_IP" in why


def test_gloo_interface_falls_back_to_gloos_default_and_says_what_to_set(monkeypatch):
    monkeypatch.delenv("SPARK_LOCAL_IP", raising=False)
    monkeypatch.setattr(_barrier, "_route_source", lambda host: None)
    name, why = gloo_interface(CLUSTER, NOWHERE, NOWHERE)
    assert name is None
    assert NOWHERE in why and "GLOO_SOCKET_IFNAME" in why


class _Ctx:
    """A barrier task's context with one task at ``address``."""

    def __init__(self, address: str):
        self.address = address

    def getTaskInfos(self):
        return [SimpleNamespace(address=self.address)]

    def allGather(self, message):
        return [message]


@pytest.fixture
def fake_dist(monkeypatch):
    """torch.distributed without a network: records the store's host and GLOO_SOCKET_IFNAME at init."""
    seen = {}

    class Store:
        def __init__(self, host, port, world, is_master, **kwargs):
            seen["store_host"], self.port = host, port or 29999

    def init(backend, **kwargs):
        seen["ifname"] = os.environ.get("GLOO_SOCKET_IFNAME")

    monkeypatch.setattr(dist, "TCPStore", Store)
    monkeypatch.setattr(dist, "init_process_group", init)
    return seen


@linux
def test_rendezvous_sets_the_interface_for_the_group_only(fake_dist, monkeypatch, caplog):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with caplog.at_level(logging.INFO, logger="sparknet.spark.barrier.executor"):
        rendezvous(_Ctx("127.0.0.1:7077"), 0, CLUSTER)
    assert fake_dist == {"store_host": "127.0.0.1", "ifname": "lo"}
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # restored once the group is made
    assert "gloo uses interface lo" in caplog.text


def test_rendezvous_keeps_the_users_interface(fake_dist, monkeypatch, caplog):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    with caplog.at_level(logging.INFO, logger="sparknet.spark.barrier.executor"):
        rendezvous(_Ctx("[::1]:7077"), 0, CLUSTER)
    assert fake_dist == {"store_host": "::1", "ifname": "eth7"}
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    assert "GLOO_SOCKET_IFNAME=eth7, as set" in caplog.text


# -- the metrics channel ---------------------------------------------------------------------

@pytest.fixture
def rx():
    with MetricsReceiver("127.0.0.1", "127.0.0.1", max_bytes=4096) as receiver:
        yield receiver


def _honest_record_arrives(rx) -> None:
    sender = MetricsSender(rx.endpoint, rx.client_keys)
    try:
        assert sender.send({"event": "round", "round": 1})
        assert rx.recv(5.0) == {"event": "round", "round": 1}
    finally:
        sender.close()


def _push(rx, frames, timeout_s: float = 5.0):
    """Send raw frames with the channel's keys; what the receiver makes of them (None: dropped or nothing)."""
    sender = MetricsSender(rx.endpoint, rx.client_keys)
    try:
        sender._dialer.socket.send_multipart(frames)
        return rx.recv(timeout_s)  # the receiver checks the sender's key while it waits
    finally:
        sender._dialer.socket.setsockopt(zmq.LINGER, 0)
        sender.close()


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "unix"])
@pytest.mark.parametrize("parts", [0, 4], ids=["whole", "in-parts"])
def test_a_payload_arrives_as_a_view_of_the_message_and_a_state_reads_back_from_it(local, parts):
    import torch

    from sparknet._tensortree import pack_tree, unpack_tree

    state = {"global": torch.randn(100_000), "strategy": {"velocity": torch.randn(100_000)}, "round": 2}
    with MetricsReceiver("127.0.0.1", "127.0.0.1", max_bytes=4 << 20, max_frames=1 + parts, local=local) as receiver:
        sender = MetricsSender(receiver.endpoint, receiver.client_keys)
        try:
            assert sender.send({"event": "state", "round": 2}, pack_tree(state, parts=parts))
            message = receiver.recv(5.0)
        finally:
            sender.close()
    payload = message.pop("payload")
    assert message == {"event": "state", "round": 2}
    # the received bytes themselves (no copy of a state the size of the weights), writable, as torch reads them
    views = payload if parts else [payload]
    assert len(views) == (3 if parts else 1)
    assert all(isinstance(v, memoryview) and not v.readonly for v in views)
    if not parts:
        assert bytes(payload) == bytes(pack_tree(state))
    tree = unpack_tree(payload, copy=False)
    assert tree["round"] == 2 and torch.equal(tree["global"], state["global"])
    assert torch.equal(tree["strategy"]["velocity"], state["strategy"]["velocity"])


def test_a_message_of_more_parts_than_the_receiver_takes_is_dropped():
    with MetricsReceiver("127.0.0.1", "127.0.0.1", max_bytes=4096, max_frames=3) as receiver:
        assert _push(receiver, [b"{}", b"a", b"b", b"c"]) is None and receiver.rejected == 1
        assert _push(receiver, [b"{}", b"a", b"b"]) == {"payload": [memoryview(b"a"), memoryview(b"b")]}


def test_on_a_local_master_the_channel_is_a_unix_socket_only_this_user_can_open_removed_at_close():
    """Every executor on the driver's machine: no CurveZMQ (a large net's state is not encrypted and decrypted
    every round on the cores the workers train on); the folder's mode keeps other users out, and it goes at close."""
    receiver = MetricsReceiver("127.0.0.1", "127.0.0.1", max_bytes=4096, local=True)
    try:
        assert receiver.client_keys is None and receiver.endpoint.startswith("ipc://")
        folder = os.path.dirname(receiver.endpoint[len("ipc://"):])
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and os.stat(folder).st_uid == os.getuid()
        _honest_record_arrives(receiver)
        assert _push(receiver, [b"[1, 2]"], timeout_s=2.0) is None and receiver.rejected == 1  # JSON, not a record
    finally:
        receiver.close()
    assert not os.path.exists(folder)
    receiver.close()  # again: nothing left to do


def test_the_receiver_binds_the_given_host_not_every_interface(rx):
    bound = rx._listener.socket.getsockopt_string(zmq.LAST_ENDPOINT)
    assert bound.startswith("tcp://127.0.0.1:") and bound == rx.endpoint


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback")
def test_the_receiver_binds_an_ipv6_address():
    with MetricsReceiver("::1", "::1") as receiver:
        assert receiver._listener.socket.getsockopt_string(zmq.LAST_ENDPOINT) == receiver.endpoint
        assert receiver.endpoint.startswith("tcp://[::1]:")
        _honest_record_arrives(receiver)


def test_a_frame_claiming_more_than_the_cap_disconnects_its_peer_unread(rx):
    # a raw ZMTP 3.0 PUSH peer with no keys: greeting, READY, then a frame header announcing 1 GiB (without the
    # bounds ZeroMQ would allocate it and wait for the bytes); the receiver speaks only CurveZMQ, so it hangs up
    # after its greeting, before any frame (a 5 s timeout fails the test)
    port = int(rx.endpoint.rsplit(":", 1)[1])
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + bytes(31)
    ready = b"\x05READY" + b"\x0bSocket-Type" + (4).to_bytes(4, "big") + b"PUSH"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as peer:
        try:
            peer.sendall(greeting + b"\x04" + bytes([len(ready)]) + ready)
            peer.sendall(b"\x02" + (1 << 30).to_bytes(8, "big") + b"x" * 1024)
            while peer.recv(4096):  # the receiver's greeting, then nothing: it hung up
                pass
        except (BrokenPipeError, ConnectionResetError):
            pass  # it hung up with these bytes unread
    assert rx.recv(0.2) is None
    _honest_record_arrives(rx)


def test_a_frame_bigger_than_the_cap_is_dropped(rx):
    assert _push(rx, [b"x" * 5000, b"p"], timeout_s=0.5) is None and rx.rejected == 0  # never read
    _honest_record_arrives(rx)


def test_frames_together_bigger_than_the_cap_are_dropped(rx):
    assert _push(rx, [b"x" * 2000, b"y" * 2000, b"z" * 2000]) is None and rx.rejected == 1
    _honest_record_arrives(rx)


def test_a_message_of_three_frames_is_dropped_unparsed(rx):
    assert _push(rx, [b'{"event": "round", "round": 9}', b"p", b"q"]) is None and rx.rejected == 1
    _honest_record_arrives(rx)


def test_a_body_that_is_not_a_json_object_is_dropped(rx):
    assert _push(rx, [b'\xff{"event"']) is None and rx.rejected == 1  # not UTF-8
    assert _push(rx, [b'{"event": "round"']) is None and rx.rejected == 2  # not JSON
    assert _push(rx, [b'["round", 9]', b"p"]) is None and rx.rejected == 3  # JSON, not an object
    _honest_record_arrives(rx)


# -- the parameter server's address -----------------------------------------------------------

WILDCARDS = ["0.0.0.0", "*", "::", "", "0", "::0", "0:0:0:0:0:0:0:0", "0.0.0.0 ", " :: ", "[::]", "0.0"]


@pytest.mark.parametrize("host", WILDCARDS)
def test_the_parameter_server_refuses_every_spelling_of_every_interface(host):
    with pytest.raises(ValueError, match="every interface"):
        ParameterServer([0.0, 1.0], host=host)
    ParameterServer([0.0, 1.0], host=host, allow_all_interfaces=True)  # asked for: allowed


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "driver-host", "10.0.0.1"])
def test_the_parameter_server_takes_an_address_or_a_name(host):
    assert ParameterServer([0.0, 1.0], host=host).host == host
