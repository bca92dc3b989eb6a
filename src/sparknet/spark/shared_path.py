"""Refusing, before any work, a path on this machine only that Spark's executors would read or write.

A plain path (or ``file:`` URI) given to a job on a cluster is read or written by the
executors on their own hosts: data only the driver has is "not found" there, and output
lands scattered over the hosts' disks. :func:`check_shared_path` asks every executor first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import urllib.parse
import uuid

from sparknet.spark.backend import run_with_deadline
from sparknet.spark.session import is_connect, is_local_master, session_master

__all__ = ["SHARED_PATH_FIX", "check_shared_path"]

log = logging.getLogger(__name__)

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
SHARED_PATH_TIMEOUT_S = 120.0
"""Longest wait for the Spark job of :func:`check_shared_path`."""
SHARED_PATH_FIX = ("put it where every host can read it: hdfs://..., s3a://... (see docs/RELIABILITY.md), "
                   "or a folder every host mounts at the same path")
"""What to do about a path only this machine sees (the end of :func:`check_shared_path`'s error)."""


def _local_file_path(path: str | os.PathLike) -> str | None:
    """The absolute local path a plain path or ``file:`` URI names; ``None`` for any other scheme."""
    text = os.fspath(path)
    m = _SCHEME.match(text)
    if m is None:
        return os.path.abspath(text)
    return urllib.parse.urlparse(text).path if m.group(1).lower() == "file" else None


def check_shared_path(spark, path: str | os.PathLike, *, what: str, write: bool = False,
                      timeout_s: float = SHARED_PATH_TIMEOUT_S) -> None:
    """Refuse a local path the executors of ``spark`` cannot see, before any work reads or writes it.

    Nothing is checked on a local master (every executor runs on this machine) or for a URI of
    another scheme than ``file`` (``hdfs://``, ``s3a://``...). Otherwise one small Spark job
    (two tasks per executor) asks every executor whether it sees ``path``; with ``write``,
    whether it sees, and may write, a marker this function puts in the nearest folder of
    ``path`` that exists here (removed afterwards). A folder every host mounts at the same
    path passes.

    Raises
    ------
    ValueError
        Some host cannot see ``path`` (the message names them and what to do), or, with
        ``write``, this machine cannot write beside it.
    DeadlineExceeded
        The job did not finish within ``timeout_s``.
    """
    local = _local_file_path(path)
    if is_connect(spark):
        # a Spark Connect client's own disk is not where the server and its executors read and write: a local
        # master's executors share the server's disk; on a cluster there is no job to ask the executors with
        # that sees this machine's files, so the path is the user's to choose
        if local is not None and not is_local_master(session_master(spark)):
            log.info("%s %s is a local path, read and written by the Spark Connect server's executors; it must be "
                     "on every host of the cluster", what, path)
        return
    sc = spark.sparkContext
    if local is None or is_local_master(sc.master):
        return
    marker = None
    if write:
        folder = local
        while not os.path.exists(folder):
            folder = os.path.dirname(folder)
        marker = os.path.join(folder, f".sparknet-shared-check-{uuid.uuid4().hex[:12]}")
        try:
            open(marker, "x").close()
        except OSError as e:
            raise ValueError(f"{what} {path}: cannot write in {folder} on this machine ({e})") from None
    try:
        tasks = 2 * max(1, sc._jsc.sc().getExecutorMemoryStatus().size() - 1)
        seen_path = marker or local  # the task body below captures plain values only

        def probe(_rows):  # (hostname, whether this host sees the path, and with write: may write beside it)
            ok = os.path.exists(seen_path) and (not write or os.access(os.path.dirname(seen_path), os.W_OK | os.X_OK))
            yield socket.gethostname(), ok

        seen = run_with_deadline(sc, f"sparknet-shared-path-{uuid.uuid4().hex[:8]}", f"sparknet: can every host "
                                 f"see {path}?", lambda: sc.parallelize(range(tasks), tasks).mapPartitions(probe)
                                 .collect(), timeout_s=timeout_s, what=f"checking that every host sees {path}")
    finally:
        if marker is not None:
            with contextlib.suppress(OSError):
                os.remove(marker)
    blind = sorted({host for host, ok in seen if not ok})
    if blind:
        verb = "write" if write else "read"
        raise ValueError(f"{what} {path} is not on every host: {', '.join(blind)} cannot {verb} it, and "
                         f"Spark's executors {verb} it there; {SHARED_PATH_FIX}")
