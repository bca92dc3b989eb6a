"""Shared pieces of the multi-host tests: the rig's module and a SparkSession on it."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "netns_cluster", Path(__file__).resolve().parents[2] / "scripts" / "netns_cluster.py")
netns_cluster = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(netns_cluster)


@contextmanager
def rig_session(cluster, name: str, **conf: str):
    """A SparkSession whose driver is on the rig's bridge (``conf``: more Spark settings), stopped on exit."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    from sparknet.spark.session import SPREAD_SETTINGS

    builder = SparkSession.builder.master(cluster.master).appName(name)
    for key, value in {**cluster.driver_conf(), **SPREAD_SETTINGS, "spark.ui.enabled": "false",
                       "spark.python.worker.reuse": "true",
                       "spark.python.unix.domain.socket.enabled": "true",
                       "spark.ui.showConsoleProgress": "false", "spark.task.maxFailures": "4",
                       # as get_session does: the first session of the test process starts its JVM, and MNIST
                       # shipped from the driver (frame_from_arrays) outgrows Spark's default 1 GiB heap
                       "spark.driver.memory": "2g", **conf}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        jvm = session.sparkContext._jvm
        session.stop()
        # Spark leaves the driver's address in the JVM's system properties, where the next session
        # in this process (a later test module's local one) would try to bind to the rig's gone bridge.
        for key in ("spark.driver.host", "spark.driver.bindAddress"):
            jvm.System.clearProperty(key)


def started_rig(**kwargs):
    """A fixture's body: the rig (``NetnsCluster(workers=2, **kwargs)``) started, yielded, stopped. Needs root;
    under CI (``CI=true``) a rig that cannot start fails the run instead of skipping it."""
    import pytest

    why = netns_cluster.rig_unavailable()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the multi-host rig cannot start under CI: {why}")
        pytest.skip(why)
    rig = netns_cluster.NetnsCluster(workers=2, **kwargs)
    rig.start()
    try:
        yield rig
    finally:
        rig.stop()


@contextmanager
def host_lost_after_round(cluster, sc, slots: int, after: int = 2, host: int = 1, back_after_s: float = 3.0):
    """An ``on_round`` callback that kills ``host`` the first time round ``after`` is recorded (a round redone after a
    restart kills nothing) and starts it again ``back_after_s`` later; on exit the host is up again whatever happened,
    the application has its ``slots`` task slots back and the host takes tasks, for the next test."""
    revive = threading.Timer(back_after_s, cluster.start_host, args=(host,))

    def on_round(record):
        if record["round"] == after and revive.ident is None:  # not started yet
            cluster.kill_host(host)
            revive.start()

    try:
        yield on_round
    finally:
        if revive.ident is not None:  # started (a fit that failed before the round never did)
            revive.join(timeout=120)
        if not cluster.host_up(host):
            cluster.start_host(host)
        wait_for_tasks_on(sc, cluster.hostname(host))
        wait_for_slots(sc, slots)


def wait_for_slots(sc, n: int, timeout_s: float = 120.0) -> None:
    """Until the application has ``n`` task slots (an executor lost is no longer counted, one started is)."""
    import time

    from sparknet.spark.backend import task_slots

    deadline = time.monotonic() + timeout_s
    while task_slots(sc) != n:
        assert time.monotonic() < deadline, f"the cluster did not come to {n} task slots within {timeout_s:g} s"
        time.sleep(0.5)


def wait_for_tasks_on(sc, hostname: str, timeout_s: float = 120.0) -> None:
    """Until a task runs on ``hostname``: an executor counts as a slot when it registers, but takes tasks only once
    it has started, a moment later."""
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while hostname not in sc.parallelize(range(2), 2).map(lambda _: socket.gethostname()).collect():
        assert time.monotonic() < deadline, f"no task ran on {hostname} within {timeout_s:g} s"
        time.sleep(0.5)


LOSS_NOTICED = {"spark.network.timeout": "30s", "spark.network.timeoutInterval": "5s",
                "spark.executor.heartbeatInterval": "3s"}
"""A rig session's settings where a host is lost for good: a host killed with its link taken down closes no
connection, and Spark notices it only when its heartbeats stop for ``spark.network.timeout`` (120 s by default);
until then the driver counts its task slots as free."""


@contextmanager
def host_lost_for_good(cluster, sc, slots: int, after: int = 2, host: int = 1):
    """An ``on_round`` callback that kills ``host`` once round ``after`` is recorded; on exit the host is started
    again, the application has its ``slots`` task slots back and the host takes tasks, for the next test."""

    def on_round(record):
        if record["round"] == after and cluster.host_up(host):
            cluster.kill_host(host)

    try:
        yield on_round
    finally:
        if not cluster.host_up(host):
            cluster.start_host(host)
        wait_for_tasks_on(sc, cluster.hostname(host))
        wait_for_slots(sc, slots)


def finished_on_fewer_workers(result, rounds: int, workers: int, accuracy: float = 0.8) -> dict:
    """What a fit that lost a host for good after round 2 shows: every round recorded once, a net that learned, and
    its last restart (one, or more where Spark still counted the lost host's slots at first) going on with
    ``workers`` workers. Returns the summary."""
    s = result.summary
    assert 1 <= s["restarts"] <= 3 and s["restart_log"][0]["after_round"] >= 2, s["restart_log"]
    assert s["restart_log"][-1]["workers"] == s["elastic_workers"] == workers, s["restart_log"]
    assert [r["round"] for r in result.history if r.get("event") == "round"] == list(range(1, rounds + 1))
    assert s["test_accuracy"] > accuracy
    return s


def finished_after_one_restart(result, rounds: int, accuracy: float = 0.8) -> dict:
    """What a fit that lost a host after round 2 and got it back shows: one restart from round 2 or later, every
    round recorded once, and a net that learned. Returns the summary."""
    s = result.summary
    assert s["restarts"] == 1 and s["restart_log"][0]["after_round"] >= 2
    assert [r["round"] for r in result.history if r.get("event") == "round"] == list(range(1, rounds + 1))
    assert s["test_accuracy"] > accuracy
    return s
