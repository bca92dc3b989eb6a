"""Getting a SparkSession for a master URL, with quiet logs (driver side).

Spark's JVMs log through log4j2 from the moment they start, before ``setLogLevel`` can be
called, so a session started here points the driver (and executors on this machine) at the
``log4j2.properties`` shipped in this package: errors only, or the level in
``$SPARKNET_SPARK_LOG_LEVEL`` (``sparknet --verbose`` sets it to INFO). A log4j2
configuration of the user's own is left in place.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

__all__ = ["get_session", "is_connect", "session_master", "session_parallelism", "is_local_master", "local_slots",
           "executor_slots", "parse_memory", "quiet_log_settings", "spark_log_level", "LOG_LEVEL_ENV"]

log = logging.getLogger(__name__)

_LOCAL = re.compile(r"^local(\[(\*|\d+)(,\s*\d+)?\])?$")
_LOCAL_CLUSTER = re.compile(r"^local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]$")


def is_local_master(master: str | None) -> bool:
    """Whether every executor of ``master`` runs on this machine (``local[...]`` or ``local-cluster[...]``)."""
    master = (master or "").strip()
    return bool(_LOCAL.match(master) or _LOCAL_CLUSTER.match(master))


PYSPARK_MISSING = ("training on Spark needs pyspark, which sparknet leaves to the machine: pip install "
                   "'sparknet[spark]' (or 'sparknet[local]' for one machine), or use the cluster's own pyspark")


def is_connect(obj) -> bool:
    """Whether ``obj`` (a SparkSession or a DataFrame) belongs to a Spark Connect session.

    Such a session has no SparkContext, RDDs or broadcasts: only what the Connect protocol carries
    (DataFrame operations, ``mapInArrow`` with ``barrier=True``, tags to cancel jobs by)."""
    return type(obj).__module__.startswith("pyspark.sql.connect")


def _context(spark):
    """A classic session's SparkContext (``spark`` itself when it is one)."""
    return spark if hasattr(spark, "defaultParallelism") else spark.sparkContext


def spark_setting(sc, key: str) -> str | None:
    """A Spark setting of a SparkContext, or of a (Spark Connect) session's runtime configuration; ``None`` where
    it is not set."""
    value = sc.conf.get(key, None) if is_connect(sc) else sc.getConf().get(key, None)
    return value if value not in (None, "") else None


def session_master(spark) -> str:
    """The master URL of a session (or its SparkContext), classic or Spark Connect (the server's ``spark.master``)."""
    if is_connect(spark):
        return spark.conf.get("spark.master", "") or ""
    return _context(spark).master or ""


def session_parallelism(spark) -> int:
    """The default number of workers for a session (or its SparkContext): its task slots (``local[4]`` -> 4); over
    Spark Connect, where the SparkContext's count cannot be asked, ``spark.default.parallelism`` when set, else 2."""
    if not is_connect(spark):
        return _context(spark).defaultParallelism
    slots = local_slots(session_master(spark))
    return slots if slots is not None else int(spark.conf.get("spark.default.parallelism", "2") or 2)


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


def executor_slots(master: str | None) -> int | None:
    """Task slots of one executor of a local master (``local[4]`` -> 4, ``local-cluster[2,3,1024]`` -> 3, its
    executors' cores), else ``None``."""
    m = _LOCAL_CLUSTER.match((master or "").strip())
    return int(m.group(2)) if m else local_slots(master)


_MEMORY = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([bkmgtp]?)(?:i?b)?\s*", re.IGNORECASE)


def parse_memory(value: str | int) -> int:
    """Bytes of a Spark memory setting (``512m``, ``2g``, ``1.5g``, ``1024``; a bare number is MiB, as Spark
    reads it)."""
    if isinstance(value, int):
        return value << 20
    m = _MEMORY.fullmatch(str(value))
    if not m:
        raise ValueError(f"not a memory size: {value!r} (use e.g. 512m or 2g)")
    return int(float(m.group(1)) * 1024 ** "bkmgtp".index((m.group(2) or "m").lower()))


LOG_LEVEL_ENV = "SPARKNET_SPARK_LOG_LEVEL"
"""Environment variable with Spark's log level for sessions sparknet starts (default ERROR)."""

_LEVELS = ("OFF", "FATAL", "ERROR", "WARN", "INFO", "DEBUG", "TRACE", "ALL")
_JAVA_OPTIONS = {"driver": "spark.driver.extraJavaOptions", "executor": "spark.executor.extraJavaOptions"}


def spark_log_level(level: str | None = None) -> str:
    """Spark's log level: ``level``, else ``$SPARKNET_SPARK_LOG_LEVEL``, else ``ERROR``."""
    chosen = (level or os.environ.get(LOG_LEVEL_ENV) or "ERROR").strip().upper()
    if chosen not in _LEVELS:
        source = "log_level" if level else LOG_LEVEL_ENV
        raise ValueError(f"Spark log level {chosen!r} (from {source}) is not one of {', '.join(_LEVELS)}; "
                         f"use one of these, e.g. ERROR or WARN")
    return chosen


def _log4j_file() -> Path:
    """This package's log4j2 properties as a file on disk (copied out when the package is zipped)."""
    source = resources.files("sparknet.spark").joinpath("log4j2.properties")
    path = Path(str(source))
    if path.is_file():
        return path
    import hashlib
    import tempfile

    text = source.read_text(encoding="utf-8")
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"sparknet-log4j2-{digest}.properties"
    if not path.is_file():
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return path


def _spark_defaults() -> dict[str, str]:
    """``spark-defaults.conf`` of the Spark installation pyspark launches, if there is one."""
    conf_dir = _spark_conf_dir()
    out: dict[str, str] = {}
    if conf_dir is None or not (conf_dir / "spark-defaults.conf").is_file():
        return out
    for line in (conf_dir / "spark-defaults.conf").read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = re.sub(r"\s+", " ", line, count=1).partition(" ")
            out[key] = value.strip()
    return out


def _spark_conf_dir() -> Path | None:
    if os.environ.get("SPARK_CONF_DIR"):
        return Path(os.environ["SPARK_CONF_DIR"])
    if os.environ.get("SPARK_HOME"):
        return Path(os.environ["SPARK_HOME"]) / "conf"
    try:
        import pyspark
    except ImportError:
        return None
    return Path(pyspark.__file__).parent / "conf"


def _java_options_set_elsewhere() -> bool:
    """Whether the driver JVM's options are not the session's to add to: it already runs (``spark-submit``, an earlier
    session), or ``PYSPARK_SUBMIT_ARGS`` sets them."""
    submit_args = os.environ.get("PYSPARK_SUBMIT_ARGS", "")
    return _jvm_running() or "JavaOptions" in submit_args or "java-options" in submit_args


def _jvm_running() -> bool:
    """Whether this Python process already talks to a driver JVM (``spark-submit``, or an earlier session)."""
    if os.environ.get("PYSPARK_GATEWAY_PORT"):
        return True
    context = sys.modules.get("pyspark.core.context") or sys.modules.get("pyspark.context")
    spark_context = getattr(context, "SparkContext", None)
    return getattr(spark_context, "_gateway", None) is not None


def quiet_log_settings(master: str | None, settings: dict[str, str], level: str) -> dict[str, str]:
    """The ``spark.{driver,executor}.extraJavaOptions`` that point new Spark JVMs at this package's log4j2 file at
    ``level``: the user's own options (from ``settings`` or ``spark-defaults.conf``) with ours appended.

    Nothing for a JVM whose options already name a log4j configuration, nor at all when ``SPARK_CONF_DIR`` holds a
    ``log4j2.properties``, ``PYSPARK_SUBMIT_ARGS`` sets Java options, or the driver's JVM already runs (under
    ``spark-submit``, whose options rule). Executors get the file only on a local master: remote executors log to
    their cluster's files, not to this terminal.
    """
    if _java_options_set_elsewhere() or "log4j" in os.environ.get("PYSPARK_SUBMIT_ARGS", ""):
        return {}
    conf_dir = _spark_conf_dir()
    if conf_dir is not None and any((conf_dir / name).is_file() for name in ("log4j2.properties", "log4j2.xml")):
        return {}
    # (a property named -Dspark... would be refused in executor options: Spark reserves the prefix)
    ours = f"-Dlog4j2.configurationFile={_log4j_file().as_uri()} -DSPARKNET_SPARK_LOG_LEVEL={level}"
    defaults = _spark_defaults()
    out = {}
    for role, key in _JAVA_OPTIONS.items():
        if role == "executor" and not is_local_master(master or "local[*]"):
            continue
        current = str(settings.get(key, defaults.get(key, ""))).strip()
        if "log4j2.configurationFile" in current or "log4j.configurationFile" in current:
            continue
        out[key] = f"{current} {ours}".strip()
    return out


def java_executable() -> str | None:
    """The ``java`` Spark starts: ``$JAVA_HOME/bin/java`` where it exists, else the first on ``PATH`` (``None``:
    neither)."""
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else None
    return java if java and os.path.exists(java) else shutil.which("java")


LATE_OPTIMIZER = ("-XX:Tier4InvocationThreshold=200000 -XX:Tier4MinInvocationThreshold=100000 "
                  "-XX:Tier4CompileThreshold=250000 -XX:Tier4BackEdgeThreshold=2000000")
"""Java options that leave the driver JVM's optimizing compiler (C2) to far hotter code than Java's defaults do (its
four thresholds 17 to 167 times Java 17's defaults; the calls before C2 compiles a method, 40 times): a starting
session runs thousands of methods a few thousand times each, and C2 compiled them on the cores Python was loading
torch on. On two cores a session alone was ready in 2.85 s instead of 3.41 (medians), its JVM
using 3.3 CPU seconds instead of 5.1, and the first round of ``sparknet train`` began 1.2 s sooner; the hot loops of
Spark's jobs (a Parquet scan into Arrow, an aggregation over 30 million rows) still reach C2 within their first run
and run as fast as with the defaults (``benchmarks/driver_jvm.py``). Not added where the user sets the JVM's
tiers."""

CLASS_ARCHIVE_ENV = "SPARKNET_JVM_CLASS_ARCHIVE"
"""Set to ``0`` to keep the driver JVMs of the sessions sparknet starts off :func:`class_archive_options`."""


BASE_ARCHIVE_TIMEOUT_S = 120.0
"""Longest wait for Java to write the base class archive of a Java that has none (about 1 s)."""


def _base_archive(java: str, folder: Path, key: str, mib: int) -> Path | None:
    """The base class archive sparknet keeps for a Java that ships none (a jlink image), written once with Java's own
    class list (``-Xshare:dump``): Java 17 maps an archive of an application's classes only on top of a base one. It
    is written for the driver's heap (``mib``), because a JVM whose heap changes its object pointers (past 32 GiB)
    cannot map it, and a JVM asked to add to an archive it cannot map refuses to start. ``None``: Java could not write
    it (logged)."""
    base = folder / f"base-{key}-{mib}m.jsa"
    if base.is_file():
        return base
    folder.mkdir(parents=True, exist_ok=True)
    part = base.with_name(f"{base.name}.{os.getpid()}.part")
    try:
        done = subprocess.run([java, "-Xshare:dump", f"-Xmx{mib}m", f"-XX:SharedArchiveFile={part}", "-Xlog:cds=off"],
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=BASE_ARCHIVE_TIMEOUT_S)
        if done.returncode != 0 or not part.is_file():
            log.info("no class archive: %s could not write a base archive (%s)", java,
                     (done.stdout + done.stderr).decode(errors="replace").strip()[-300:])
            return None
        os.replace(part, base)  # whole, or not there
        return base
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.info("no class archive: %s could not write a base archive (%s)", java, exc)
        return None
    finally:
        part.unlink(missing_ok=True)


def class_archive_options(folder: Path | None = None, heap: str | None = None) -> str:
    """Java options that let a new driver JVM map the classes an earlier session loaded from an archive (Java's
    AppCDS): a Spark session starts about 2 s sooner on two cores (8.0-8.8 s to 6.2-6.3 s, its JVM loading some
    20,000 classes). The first session without an archive writes one as its JVM exits (about 170 MB under the
    sparknet cache's ``jvm`` folder); a later one takes a dump older than a minute, which is whole, as the archive.
    An archive is per Java and Spark install: one that no longer matches is ignored by the JVM, which then loads the
    classes as usual. ``""`` where :data:`CLASS_ARCHIVE_ENV` is ``0``, or where Spark's configuration folder holds
    files (Java archives no class path with such a folder in it).

    Java 17 adds an application's classes only on top of a base archive, which the JDK ships
    (``lib/server/classes.jsa`` and ``classes_nocoops.jsa``) and a Java trimmed with jlink lacks: for such a Java,
    given the driver's ``heap`` (``spark.driver.memory``), sparknet writes a base archive of its own first
    (:func:`_base_archive`); without ``heap``, or where Java cannot write one, ``""``, since such a Java refuses to
    start when asked to add to an archive it does not have."""
    if os.environ.get(CLASS_ARCHIVE_ENV, "1") == "0":
        return ""
    conf_dir = _spark_conf_dir()  # Spark puts it on the class path, and Java archives no class path that holds
    if conf_dir is not None and conf_dir.is_dir() and any(conf_dir.iterdir()):  # a folder with files in it
        return ""
    import pyspark

    from sparknet.datasets.cache import cache_root

    java = java_executable()
    if java is None:
        return ""
    java = os.path.realpath(java)
    stamp = f"{java}:{os.stat(java).st_mtime_ns}:{pyspark.__file__}:{pyspark.__version__}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    folder = Path(folder) if folder is not None else cache_root() / "jvm"
    server = Path(java).parent.parent / "lib" / "server"
    base = None  # the JDK's own base archive
    if not all((server / name).is_file() for name in ("classes.jsa", "classes_nocoops.jsa")):
        try:
            mib = None if heap is None else max(1, parse_memory(heap) >> 20)
        except ValueError:  # Spark will say what is wrong with it
            mib = None
        if mib is None or (base := _base_archive(java, folder, key, mib)) is None:
            return ""
        key = f"{key}-{mib}m"  # what is added is per base
    archive, quiet = folder / f"spark-{key}.jsa", "-Xlog:cds=off,cds+dynamic=off"
    # dumps earlier JVMs wrote as they exited, whole once a minute old
    done = [d for d in sorted(folder.glob(f"spark-{key}.*.jsa")) if time.time() - d.stat().st_mtime > 60]
    if done and not archive.is_file():
        with contextlib.suppress(OSError):
            os.replace(done.pop(0), archive)
    mapped = "" if base is None else f"{base}:"
    if archive.is_file():
        for stale in done:  # other sessions' dumps, not needed
            stale.unlink(missing_ok=True)
        return f"-XX:SharedArchiveFile={mapped}{archive} {quiet}"
    folder.mkdir(parents=True, exist_ok=True)
    dump = f"-XX:ArchiveClassesAtExit={folder / f'spark-{key}.{os.getpid()}.jsa'}"
    return f"-XX:SharedArchiveFile={base} {dump} {quiet}" if base is not None else f"{dump} {quiet}"


FILES_ENV = "SPARKNET_SPARK_FILES"
"""The environment variable that names the directory of the session's files on a local master (``SparkFiles``'
root, one for the driver and its executor). The daemon (:mod:`sparknet.spark._daemon`) puts it on its ``sys.path``
before it forks a worker, as pyspark's worker does with it at its first task, which then finds it there and does not
call ``importlib.invalidate_caches()``: with pyspark and py4j imported from their zip files that rereads the zips'
directories, 0.4 s in every fresh worker. A fresh worker then does what a reused one does at every task after its
first (a task's own zip or egg files still invalidate the caches)."""

DAEMON_MODULE_KEY, DAEMON_MODULE = "spark.python.daemon.module", "sparknet.spark._daemon"
"""The Python daemon of a session sparknet starts (:mod:`sparknet.spark._daemon`), unless the user names one."""


def forks_sparknet_daemon() -> bool:
    """Whether the Python workers of a session sparknet starts come from sparknet's daemon (:data:`DAEMON_MODULE`)
    run by this interpreter: ``spark-defaults.conf`` names no other daemon module, and ``PYSPARK_PYTHON``, if set,
    is this interpreter. Only then can a daemon loaded ahead stand in for the one Spark launches."""
    python = os.environ.get("PYSPARK_PYTHON")
    found = shutil.which(python) if python else sys.executable
    return (DAEMON_MODULE_KEY not in _spark_defaults() and found is not None
            and os.path.realpath(found) == os.path.realpath(sys.executable))


MAX_DIRECT_RESULT_KEY, MAX_DIRECT_RESULT = "spark.task.maxDirectResultSize", "64m"
"""The largest task result a session sparknet starts sends with the task's status (Spark's default: 1 MiB)."""

SIMPLIFIED_TRACEBACK_KEY = "spark.executorEnv.SPARK_SIMPLIFIED_TRACEBACK"
"""What makes the Python workers of RDD and SQL jobs one daemon's (pyspark's short tracebacks, in both)."""

def driver_memory() -> str:
    """The JVM heap the driver of a session sparknet starts gets, unless the user sets ``spark.driver.memory``: a
    quarter of this machine's memory, 2 to 16 GiB (Spark's default, 1 GiB, runs out: on a local master the one JVM
    holds every task's cached rows, and an ImageNet-shaped partition is most of a gigabyte)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no such figure on this system
        return "2g"
    return f"{min(16, max(2, (total // 4) >> 30))}g"


SPREAD_KEY = "spark.shuffle.reduceLocality.enabled"
SPREAD_SETTINGS = {SPREAD_KEY: "false"}
"""What spreads a fit's workers over the hosts: a shuffle's reduce tasks would prefer the hosts that hold most of its
map output, so a table read by few tasks and dealt into K partitions (``repartition(K)``) would be staged on those
few hosts, and each worker's rounds run where its rows are staged. Seen on two hosts with a table of one file: both
partitions on one host in 6 jobs of 6; on both hosts in 6 of 6 with this set. Sparknet deals rows out to spread them,
and reads none of its shuffles' outputs twice: nothing is lost."""


_SPREAD_WARNED: set[str] = set()


def spread_warning(master: str, reduce_locality: str | None) -> str | None:
    """What to tell a user whose session on a cluster ``master`` places a shuffle's reduce tasks by its map output
    (``spark.shuffle.reduceLocality.enabled`` not ``false``: :data:`SPREAD_SETTINGS`); ``None`` where nothing."""
    if is_local_master(master) or str(reduce_locality).strip().lower() == "false":
        return None
    return ("spark.shuffle.reduceLocality.enabled is not false in this session: Spark may stage the workers' rows on "
            "the few hosts that read the table, and the workers train where their rows are staged; start the "
            "session with it set to false (sessions sparknet starts do) to spread them over the hosts")


def warn_unspread(spark) -> None:
    """Log :func:`spread_warning` once per master and process, where it applies to ``spark`` (a session or
    SparkContext)."""
    master = session_master(spark)
    if master in _SPREAD_WARNED:
        return
    message = spread_warning(master, spark_setting(spark if is_connect(spark) else _context(spark), SPREAD_KEY))
    if message is not None:
        _SPREAD_WARNED.add(master)
        log.warning("%s", message)


def _user_sets_driver_memory(conf: dict | None) -> bool:
    return ("spark.driver.memory" in (conf or {}) or "spark.driver.memory" in _spark_defaults()
            or "--driver-memory" in os.environ.get("PYSPARK_SUBMIT_ARGS", ""))


def session_settings(master: str | None, conf: dict | None = None, level: str | None = None) -> dict[str, str]:
    """The settings of a new session :func:`get_session` starts on ``master``: sparknet's own, the user's ``conf``
    over them, Spark's logs at ``level`` (default :func:`spark_log_level`'s) and the driver JVM's class archive."""
    level = spark_log_level(level)
    settings = {
        "spark.python.worker.reuse": "true",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        # the executor JVM talks to its Python workers over Unix sockets, not loopback TCP: a Python task's
        # round trip costs about 30 ms instead of 70 (the rounds engine runs one job per round)
        "spark.python.unix.domain.socket.enabled": "true",
        # a rounds-engine task returns its update (the model's size) as its result: past 1 MiB Spark would
        # park it in the block manager for the driver to fetch (about 20 ms more a round for LeNet's 1.7 MB);
        # sent directly with the task's status instead, up to half the RPC message cap
        MAX_DIRECT_RESULT_KEY: MAX_DIRECT_RESULT,
        # the weights broadcast every round are float32 that LZ4 barely shrinks: compressing them costs the
        # driver about 4 ms a round for nothing
        "spark.broadcast.compress": "false",
        # Spark keys its Python daemons by the workers' environment, and its SQL runners (mapInArrow) add this
        # variable where its RDD runner does not: with it set for both, one daemon forks the workers of both,
        # and the staging job does not wait for a second one to import torch and sparknet (seconds a session)
        SIMPLIFIED_TRACEBACK_KEY: "1",
    }
    if not _user_sets_driver_memory(conf):
        # Spark's default 1 GiB heap runs out: in local mode every task's rows pass through the one JVM
        # (four tasks converting MNIST at once); on a cluster, local arrays shipped through Spark
        # (frame_from_arrays) live in the driver's heap, and each task that carries a piece is serialized there.
        settings["spark.driver.memory"] = driver_memory()
    if DAEMON_MODULE_KEY not in _spark_defaults():
        settings[DAEMON_MODULE_KEY] = DAEMON_MODULE  # workers forked with torch and sparknet already loaded
    settings.update({key: value for key, value in SPREAD_SETTINGS.items() if key not in _spark_defaults()})
    settings.update({key: str(value) for key, value in (conf or {}).items()})
    settings.update(quiet_log_settings(master, settings, level))
    driver_options = str(settings.get(_JAVA_OPTIONS["driver"], _spark_defaults().get(_JAVA_OPTIONS["driver"], "")))
    if not _java_options_set_elsewhere():
        added = [] if "Tier4" in driver_options or "Tiered" in driver_options else [LATE_OPTIMIZER]
        if "Archive" not in driver_options and "Xshare" not in driver_options:
            added.append(class_archive_options(heap=settings.get("spark.driver.memory")))
        settings[_JAVA_OPTIONS["driver"]] = " ".join([driver_options, *added]).strip()
    return {key: str(value) for key, value in settings.items()}


def _python_of_this_process() -> None:
    """Spark's Python workers run this interpreter (so executors import the same sparknet and torch), unless the
    user names another."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


DRIVER_JVM_SETTINGS = ("spark.driver.memory", "spark.driver.extraJavaOptions")
"""The settings of a session sparknet starts that its driver JVM takes as it starts; the rest it takes with the
SparkContext."""


def start_driver_jvm() -> threading.Thread | None:
    """Start the driver JVM of the session this process is about to ask :func:`get_session` for, in a thread, while
    the process goes on loading (torch: seconds of it); ``None`` where a JVM is up or pyspark is missing.

    What a JVM takes at its start (:data:`DRIVER_JVM_SETTINGS`: its heap, its Java options, Spark's log level in
    them) is the same for every master, so this fits whichever master the session gets; the SparkContext, which
    takes the master, waits for the JVM. A failed start is left for :func:`get_session` to meet again and report. A
    process that never asks for a session leaves the JVM idle: it ends when the process does (it stops when its
    standard input closes)."""
    try:
        from pyspark import SparkConf, SparkContext
    except ImportError:
        return None
    if SparkContext._gateway is not None:
        return None
    settings = session_settings(None)
    _python_of_this_process()
    conf = SparkConf(loadDefaults=False).setAll([(k, v) for k, v in settings.items() if k in DRIVER_JVM_SETTINGS])

    def start() -> None:
        try:
            SparkContext._ensure_initialized(conf=conf)
        except Exception as exc:  # Java missing or broken: get_session starts it again and says why
            log.debug("starting the driver JVM ahead: %s", exc)

    thread = threading.Thread(target=start, name="sparknet-driver-jvm", daemon=True)
    thread.start()
    return thread


SESSION_AHEAD_ENV = "SPARKNET_SESSION_AHEAD"
"""``1`` or ``0``: whether ``sparknet train`` starts its whole session ahead (:func:`start_session_ahead`) or its
driver JVM alone (:func:`start_driver_jvm`); unset, :func:`starts_session_ahead` decides by the cores."""

SESSION_AHEAD_CORES = 4
"""The cores from which ``sparknet train`` starts its whole session ahead: one for the command's own imports, one for
the Python daemon's loaded ahead (on a local master), the rest for the JVM's threads."""


def starts_session_ahead() -> bool:
    """Whether ``sparknet train`` starts its whole session while it loads torch (:func:`start_session_ahead`), not its
    driver JVM alone (:func:`start_driver_jvm`): ``$SPARKNET_SESSION_AHEAD`` where it is ``1`` or ``0``, else whether
    this process may run on :data:`SESSION_AHEAD_CORES` cores or more. On two cores the SparkContext made beside the
    imports was ready no sooner, nor the first round (the three loaders already fill both cores); with cores to spare
    it is made while torch loads instead of after."""
    setting = os.environ.get(SESSION_AHEAD_ENV, "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    return len(os.sched_getaffinity(0)) >= SESSION_AHEAD_CORES


PANDAS_NOTICE = "PySpark does not yet fully support pandas"
"""How a ``FutureWarning`` of pyspark's begins that its testing helpers give as they load with pandas 3 (the
session's first Java call with arguments loads them): nothing a sparknet user can act on, and the command hides it."""

_AHEAD: dict = {}
"""The session :func:`start_session_ahead` is starting: its ``master``, the event set once it is ``made`` (or failed),
and the ``box`` it leaves the session in."""


def start_session_ahead(master: str, then: Callable | None = None,
                        app_name: str = "sparknet") -> threading.Thread | None:
    """Start, in a thread, the session ``get_session(master, app_name=app_name)`` is about to be asked for (Spark's UI
    and event logs show the name), while this process goes on loading (torch: seconds of it), and then call
    ``then(sc)`` there with its SparkContext (``python -m sparknet`` starts the session's Python workers so,
    :func:`sparknet.spark.backend.start_python_workers`); the thread, or ``None`` where a session is up or starting, or
    pyspark is missing.

    :func:`get_session` then waits for it and returns it if it asks for the same master (else it stops it and starts
    the one asked for). A start that failed is left for :func:`get_session` to meet again and report. A process that
    never asks for the session leaves it idle: its JVM ends when the process does (it stops when its standard input
    closes)."""
    try:
        from pyspark import SparkContext
    except ImportError:
        return None
    if SparkContext._active_spark_context is not None or _AHEAD:
        return None
    box: dict = {}
    made = threading.Event()

    def start() -> None:
        try:
            box["session"] = _start_session(master, None, None, app_name)
        except Exception as exc:  # Java missing or broken: get_session starts it again and says why
            log.debug("starting the session ahead: %s", exc)
        finally:
            made.set()
        if "session" in box and then is not None:
            then(box["session"].sparkContext)

    thread = threading.Thread(target=start, name="sparknet-session", daemon=True)
    _AHEAD.update(master=master, made=made, box=box)
    thread.start()
    return thread


def _session_ahead(master: str | None):
    """The session :func:`start_session_ahead` started, once it has, if it runs on ``master`` (``None``: any), made
    this thread's active session; else ``None`` (one on another master stopped)."""
    if not _AHEAD:
        return None
    ahead = dict(_AHEAD)
    ahead["made"].wait()  # as long as a session takes to start, as getOrCreate would wait
    _AHEAD.clear()
    session = ahead["box"].get("session")
    if session is None:
        return None
    if master and master != ahead["master"]:
        log.info("the session started ahead runs on %s, not %s: starting another", ahead["master"], master)
        session.stop()
        return None
    from pyspark.sql import SparkSession

    SparkSession._activeSession = session  # this thread's session too, as if it had started it
    session._jvm.SparkSession.setActiveSession(session._jsparkSession)
    return _started(session)


def get_session(master: str | None = None, *, app_name: str = "sparknet", conf: dict | None = None,
                log_level: str | None = None):
    """The active SparkSession (Spark allows one per process; a different ``master`` is logged), or a new one.

    A new session gets ``PYSPARK_PYTHON`` set to this interpreter (so executors import the same sparknet and
    torch), Python worker reuse on, a Python daemon that forks its workers with torch and sparknet already loaded
    (:data:`DAEMON_MODULE`), and Spark's own logging at ``log_level`` from the moment its JVMs start
    (:func:`quiet_log_settings`).

    Parameters
    ----------
    master : str, optional
        ``local[K]``, ``local-cluster[N,C,MB]``, ``spark://host:port``, ``yarn``, ``k8s://...``
        (default ``local[*]``).
    app_name : str
        The application name a new session gets.
    conf : dict, optional
        Extra Spark settings for a new session.
    log_level : str, optional
        Spark's log level (``ERROR``, ``WARN``, ``INFO``...); default ``$SPARKNET_SPARK_LOG_LEVEL``,
        else ``ERROR``.
    """
    try:
        from pyspark.sql import SparkSession
    except ImportError as e:  # sparknet does not install pyspark
        raise ImportError(PYSPARK_MISSING) from e
    if (ahead := _session_ahead(master)) is not None:
        return ahead
    active = SparkSession.getActiveSession()
    if active is not None:
        running = session_master(active)
        if master and master != running:
            log.warning("a SparkSession is already running on %s; using it instead of %s", running, master)
        return active
    return _started(_start_session(master, conf, log_level, app_name))


def _started(spark):
    """``spark``, a session sparknet started, logged (where this thread's logging is set up: a session started ahead
    is logged when it is handed over)."""
    log.info("started Spark %s on %s", spark.version, spark.sparkContext.master)
    return spark


def _start_session(master: str | None, conf: dict | None, log_level: str | None, app_name: str = "sparknet"):
    """A new session on ``master`` (:func:`get_session`'s)."""
    from pyspark.sql import SparkSession

    level = spark_log_level(log_level)
    _python_of_this_process()
    builder = SparkSession.builder.master(master or "local[*]").appName(app_name)
    for key, value in session_settings(master, conf, level).items():
        builder = builder.config(key, str(value))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(level)
    from sparknet._malloc import TUNABLES_ENV, with_huge_pages

    # huge pages for what the Python workers' malloc maps: a sharded replica's gathered layers (sparknet._malloc)
    spark.sparkContext.environment[TUNABLES_ENV] = with_huge_pages(os.environ.get(TUNABLES_ENV))
    if _LOCAL.match(spark.sparkContext.master):  # one JVM: the driver's SparkFiles root is its executor's
        from pyspark import SparkFiles

        # before the first Python job, so that every job's workers come from one daemon (sparknet.spark._daemon)
        spark.sparkContext.environment[FILES_ENV] = SparkFiles.getRootDirectory()
    return spark
