"""The Python daemon loaded ahead (``sparknet.spark._daemon``): a daemon Spark launches is forked, loaded, by the
process ``sparknet train`` started as it began, or loads for itself where that process cannot stand in for it.

The daemons here are launched as Spark launches them (``python -m sparknet.spark._daemon pyspark.worker``, the
environment Spark gives, the port read from standard output); the last test runs a real session in a process of its
own, whose JVM inherits the socket's name.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparknet._malloc import TUNABLES_ENV, with_huge_pages
from sparknet.spark._daemon import AHEAD_ENV, _spark_python_path, start_ahead

DEADLINE_S = 60.0


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # ended meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _wait_for(check, what: str, timeout_s: float = DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout_s:.0f} s")


@pytest.fixture
def ahead(monkeypatch):
    """A process loaded ahead, its socket named in this process's environment; ended and checked gone after."""
    monkeypatch.delenv(AHEAD_ENV, raising=False)
    process = start_ahead()
    assert process is not None
    path = os.environ.pop(AHEAD_ENV)
    try:
        _wait_for(lambda: os.path.exists(path), "socket")
        yield process, path
    finally:
        process.stdin.close()  # the starter ends: so does the process loaded ahead
        try:
            process.wait(DEADLINE_S)
        finally:
            if process.poll() is None:
                process.kill()
    assert not os.path.exists(os.path.dirname(path))  # its folder removed


def _launch(path: str, **env_over):
    """A daemon launched as Spark launches one, and the port it reported."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", AHEAD_ENV: path,
           TUNABLES_ENV: with_huge_pages(os.environ.get(TUNABLES_ENV)),  # what a sparknet session gives its workers
           "PYTHONPATH": os.pathsep.join(_spark_python_path() + [p for p in [os.environ.get("PYTHONPATH")] if p]),
           **env_over}
    daemon = subprocess.Popen([sys.executable, "-m", "sparknet.spark._daemon", "pyspark.worker"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        port = struct.unpack("!i", daemon.stdout.read(4))[0]  # what the JVM reads first
    except BaseException:
        daemon.kill()
        raise
    return daemon, port


def _end(daemon) -> int:
    try:
        return daemon.wait(DEADLINE_S)
    finally:
        if daemon.poll() is None:
            daemon.kill()


def test_a_launched_daemon_is_forked_loaded_and_ends_when_spark_closes_its_input(ahead):
    process, path = ahead
    daemon, port = _launch(path)
    try:
        assert port > 0
        forked = _children(process.pid)
        assert len(forked) == 1 and forked[0] != daemon.pid  # the daemon is the loaded process's child
        assert _children(daemon.pid) == []
        daemon.stdin.close()  # how Spark ends a daemon
        assert _end(daemon) == 0
        _wait_for(lambda: not _children(process.pid), "end of the forked daemon")
    finally:
        _end(daemon)


@pytest.mark.parametrize("at_once", [True, False], ids=["as-its-port-arrives", "once-forked"])
def test_a_termination_of_the_launched_daemon_is_passed_on(ahead, at_once):
    # as soon as the forked daemon told its port (the launched process may not have its pid yet), or later
    process, path = ahead
    daemon, _ = _launch(path)
    try:
        if not at_once:
            _wait_for(lambda: _children(process.pid), "forked daemon")
        daemon.send_signal(signal.SIGTERM)  # Process.destroy()
        assert _end(daemon) == 0
        _wait_for(lambda: not _children(process.pid), "end of the forked daemon")
    finally:
        _end(daemon)


def test_a_daemon_the_loaded_process_cannot_stand_in_for_loads_for_itself(ahead):
    """Another string hash seed (as another Spark setting would give): the launched daemon runs pyspark's daemon
    itself, as without the process loaded ahead."""
    process, path = ahead
    daemon, port = _launch(path, PYTHONHASHSEED="7")
    try:
        assert port > 0 and _children(process.pid) == []
        daemon.stdin.close()
        _end(daemon)  # ends (pyspark's daemon says 1 as it ends so)
        assert daemon.returncode is not None
    finally:
        _end(daemon)


def test_a_session_started_after_it_runs_its_python_tasks_in_workers_of_the_loaded_process(tmp_path):
    """A real session (``local[2]``) whose JVM starts after the process loaded ahead: the workers of its RDD and
    SQL (``mapInArrow``) jobs are forked by a daemon that is that process's child, and compute what they should."""
    script = tmp_path / "session.py"
    script.write_text('''
import json, os
from sparknet.spark._daemon import start_ahead
ahead = start_ahead()
from sparknet.spark.session import get_session

def lineage(_=None):
    import os
    daemon = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[1])
    loaded = int(open(f"/proc/{daemon}/stat").read().rsplit(")", 1)[1].split()[1])
    return [daemon, loaded]

spark = get_session("local[2]")
try:
    squares = spark.sparkContext.parallelize(range(8), 2).map(lambda v: v * v).collect()
    rdd = spark.sparkContext.parallelize([0, 1], 2).map(lineage).collect()

    def arrow(batches):
        import pyarrow as pa
        for _ in batches:
            yield pa.RecordBatch.from_pydict({"d": [lineage()[0]], "l": [lineage()[1]]})

    sql = [[r.d, r.l] for r in spark.range(0, 2, numPartitions=2).mapInArrow(arrow, "d long, l long").collect()]
    from pyspark import SparkFiles

    def files(_):
        import os, sys
        return [os.environ.get("SPARKNET_SPARK_FILES"), sys.path.index(os.environ["SPARKNET_SPARK_FILES"]),
                os.environ.get("GLIBC_TUNABLES")]

    seen_files = spark.sparkContext.parallelize([0, 1], 2).map(files).collect()
    with open(os.path.join(os.path.dirname(__file__), "shipped_later.py"), "w") as f:  # after the workers started
        f.write("ANSWER = 42\\n")
    spark.sparkContext.addPyFile(os.path.join(os.path.dirname(__file__), "shipped_later.py"))
    shipped = spark.sparkContext.parallelize([0, 1], 2).map(lambda _: __import__("shipped_later").ANSWER).collect()
    print(json.dumps({"ahead": ahead.pid, "squares": squares, "rdd": rdd, "sql": sql,
                      "root": SparkFiles.getRootDirectory(), "files": seen_files, "shipped": shipped}))
finally:
    spark.stop()
''')
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != AHEAD_ENV})
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["squares"] == [v * v for v in range(8)]
    daemons = {d for d, _ in seen["rdd"] + seen["sql"]}
    assert len(daemons) == 1  # one daemon forks the workers of both kinds of job
    assert {loaded for _, loaded in seen["rdd"] + seen["sql"]} == {seen["ahead"]}
    # the session's files are on the workers' path from the daemon on, where pyspark's worker puts them; a module
    # shipped once the workers run is still found (they see the folder's new files as a reused worker does)
    assert seen["files"] == [[seen["root"], 1, with_huge_pages(os.environ.get(TUNABLES_ENV))]] * 2
    assert seen["shipped"] == [42, 42]


def test_a_worker_whose_daemon_put_the_session_files_on_its_path_keeps_its_import_caches(tmp_path, monkeypatch):
    """What the daemon's ``SPARKNET_SPARK_FILES`` relies on in pyspark: its worker's ``setup_spark_files`` calls
    ``importlib.invalidate_caches()`` (0.4 s with pyspark.zip imported) only when it adds the session's folder to
    ``sys.path``, which a worker forked by sparknet's daemon finds there already."""
    import importlib

    from pyspark.worker_util import setup_spark_files

    calls = []
    monkeypatch.setattr(importlib, "invalidate_caches", lambda: calls.append(1))
    monkeypatch.setattr(sys, "path", list(sys.path))
    setup_spark_files(str(tmp_path), [])  # a stock worker's first task
    assert calls == [1] and sys.path[1] == str(tmp_path)
    setup_spark_files(str(tmp_path), [])  # the folder there already: as the daemon leaves it
    assert calls == [1]
