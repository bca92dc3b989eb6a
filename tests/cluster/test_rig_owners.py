"""The rig removes what an earlier rig left behind when its maker was killed before it could clean up: the
namespaces, ``/etc/netns`` entries and bridge of a rig whose maker is gone and inside which nothing runs. A rig whose
maker still runs, or inside which a process still runs, is left alone. Needs root (``ip netns``); under CI a machine
that cannot run the rig fails the run."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from _rig import netns_cluster as rig


@pytest.fixture
def made():
    """Rig-like leftovers this test makes (namespaces and bridges under fresh tags), removed whatever happens."""
    why = rig.rig_unavailable()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the multi-host rig cannot run under CI: {why}")
        pytest.skip(why)
    tags, procs = [], []

    def make(owner_pid: int, owner_started: str | None, *, busy: bool = False) -> str:
        tag = "t" + secrets.token_hex(2)
        tags.append(tag)
        rig._run("ip", "link", "add", f"snb{tag}", "type", "bridge")
        rig._run("ip", "netns", "add", f"sn{tag}w1")
        (Path("/etc/netns") / f"sn{tag}w1").mkdir(parents=True, exist_ok=True)
        rig.OWNERS.mkdir(parents=True, exist_ok=True)
        (rig.OWNERS / tag).write_text(f"{owner_pid} {owner_started}\n")
        if busy:  # a process inside, which this test started and ends by pid
            procs.append(subprocess.Popen(["ip", "netns", "exec", f"sn{tag}w1", "sleep", "60"]))
            deadline = time.monotonic() + 10
            while not rig._run("ip", "netns", "pids", f"sn{tag}w1", check=False).stdout.split():
                assert time.monotonic() < deadline, "the process did not start inside the namespace"
                time.sleep(0.05)
        return tag

    try:
        yield make
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
        for tag in tags:
            rig._run("ip", "netns", "del", f"sn{tag}w1", check=False)
            rig._run("ip", "link", "del", f"snb{tag}", check=False)
            (rig.OWNERS / tag).unlink(missing_ok=True)
            shutil.rmtree(Path("/etc/netns") / f"sn{tag}w1", ignore_errors=True)


def _exists(tag: str) -> bool:
    names = rig._run("ip", "netns", "list", check=False).stdout
    bridge = rig._run("ip", "link", "show", f"snb{tag}", check=False).returncode == 0
    return f"sn{tag}w1" in names or bridge or (rig.OWNERS / tag).exists()


def test_a_rig_whose_maker_is_gone_is_removed_and_one_in_use_is_not(made):
    gone = subprocess.Popen(["true"])
    gone.wait(timeout=10)
    stale = made(gone.pid, "1")  # its maker exited (a start time no process has now)
    mine = made(os.getpid(), rig._start_time(os.getpid()))  # its maker runs: this test
    busy = made(gone.pid, "1", busy=True)  # its maker is gone, but a process runs inside
    removed = rig.remove_stale_rigs()
    assert stale in removed and not _exists(stale)
    assert not (Path("/etc/netns") / f"sn{stale}w1").exists()
    assert mine not in removed and _exists(mine)
    assert busy not in removed and _exists(busy)
