"""Getting a SparkSession for a master URL, with quiet logs (driver side)."""

from __future__ import annotations

import logging
import os
import re
import sys

__all__ = ["get_session", "is_local_master", "local_slots"]

log = logging.getLogger(__name__)

_LOCAL = re.compile(r"^local(\[(\*|\d+)(,\s*\d+)?\])?$")
_LOCAL_CLUSTER = re.compile(r"^local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]$")


def is_local_master(master: str | None) -> bool:
    """Whether every executor of ``master`` runs on this machine (``local[...]`` or ``local-cluster[...]``)."""
    master = (master or "").strip()
    return bool(_LOCAL.match(master) or _LOCAL_CLUSTER.match(master))


def local_slots(master: str | None) -> int | None:
    """Task slots of a local master (``local[4]`` -> 4, ``local-cluster[2,2,1024]`` -> 4), else ``None``."""
    master = (master or "").strip()
    m = _LOCAL.match(master)
    if m:
        if m.group(2) is None:
            return 1
        return (os.cpu_count() or 1) if m.group(2) == "*" else int(m.group(2))
    m = _LOCAL_CLUSTER.match(master)
    if m:
        return int(m.group(1)) * int(m.group(2))
    return None


def get_session(master: str | None = None, *, app_name: str = "sparknet", conf: dict | None = None,
                log_level: str = "WARN"):
    """The active SparkSession, or a new one for ``master``.

    A session that is already running is returned as it is (Spark allows one per process);
    when its master differs from the one asked for, that is logged. A new session gets
    ``PYSPARK_PYTHON`` set to this interpreter (so executors import the same sparknet and
    torch), Python worker reuse on, and Spark's own logging at ``log_level``.

    Parameters
    ----------
    master : str, optional
        ``local[K]``, ``local-cluster[N,C,MB]``, ``spark://host:port``, ``yarn``, ``k8s://...``
        (default ``local[*]``).
    app_name : str
        The application name a new session gets.
    conf : dict, optional
        Extra Spark settings for a new session.
    log_level : str
        Spark's log level (``WARN``, ``ERROR``...).
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        running = active.sparkContext.master
        if master and master != running:
            log.warning("a SparkSession is already running on %s; using it instead of %s", running, master)
        return active
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.master(master or "local[*]").appName(app_name)
    settings = {
        "spark.python.worker.reuse": "true",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
    }
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, str(value))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level)
    log.info("started Spark %s on %s", spark.version, spark.sparkContext.master)
    return spark
