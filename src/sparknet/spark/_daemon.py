"""The Python worker daemon of the Spark sessions sparknet starts: pyspark's own, with torch loaded first.

Spark starts one daemon per executor (``python -m <spark.python.daemon.module> pyspark.worker``)
and the daemon forks a Python worker for each task slot that needs one. pyspark's daemon imports
nothing heavy, so every worker it forks imports torch and sparknet's executor code itself: about
three CPU-seconds each time, paid again by every worker a failed task, a new executor or a fresh
session starts. This module imports them once, in the daemon, and then runs pyspark's daemon:
the workers it forks find them loaded (shared copy-on-write pages). torch runs nothing here, so
no thread pool exists before the fork (torch's own fork handlers reset it in the child anyway).

**Loaded ahead.** Spark starts the daemon at the session's first Python task, and its three seconds of imports
then stand between the session and the fit's first job. ``sparknet train`` on a local master starts one more
process as it begins (:func:`start_ahead`, ``python -m sparknet.spark._daemon --ahead PATH``), which loads the same
modules while the driver loads torch and its JVM starts, and then waits on a Unix socket at ``PATH`` (named to the
JVM in :data:`AHEAD_ENV`). The daemon Spark launches hands its standard streams, arguments and environment to it
(:func:`_hand_over`, one message with the three descriptors); it forks a child that takes them and runs pyspark's
daemon, loaded. The launched process stays as the JVM's handle on that child: it passes on a termination and ends
when the child does. Where the two interpreters differ (another Python, packages from elsewhere, another hash seed
or network namespace, as on an executor of another host or container), or the socket is not there, the launched
daemon loads the modules itself, as without it.

:func:`sparknet.spark.session.get_session` sets ``spark.python.daemon.module`` to this module
for the sessions it starts; a user's own session can set it too (``sparknet`` must be importable
on the executors, as it is for training anyway).
"""

import json
import os
import signal
import socket
import sys

AHEAD_ENV = "SPARKNET_DAEMON_AHEAD"
"""The environment variable that names the socket of the process that loaded the daemon's modules ahead."""

HAND_OVER_TIMEOUT_S = 60.0
"""Longest wait for the process loaded ahead to answer a launched daemon: at once once loaded, else when loaded
(a process that fails to load closes the socket, and the launched daemon loads for itself)."""

_MESSAGE_BYTES = 1 << 20


def _load() -> None:
    """The daemon's imports; then what they made frozen out of the collector's scans, and freed memory kept."""
    import gc

    try:  # loaded before the daemon forks its workers; a worker that cannot load them says why itself
        import torch  # noqa: F401
        import torch._dynamo  # noqa: F401  (what a torch optimizer imports when the first one is made: about 1 s)

        import sparknet.spark.barrier.executor  # noqa: F401  (the executor side of both engines, with the data path)
        import sparknet.spark.rounds.executor  # noqa: F401
        import sparknet.spark.scoring  # noqa: F401  (what a scoring task of SparkNetModel.transform runs)
        from sparknet._malloc import keep_freed_memory
    except ImportError:  # pragma: no cover - an executor without torch or sparknet
        def keep_freed_memory():
            return False
    try:  # what a task that converts rows imports: pyarrow, and pandas, which pyarrow loads at its first array or
        # table (some 300 modules: 0.2-0.5 s of every fresh worker's first stage task)
        import pandas  # noqa: F401
        import pyarrow.compute  # noqa: F401
    except ImportError:  # pragma: no cover - a task that needs them says so itself
        pass
    # pyspark's daemon and the worker module its workers import after the fork, from pyspark.zip: 0.5-0.6 s before a
    # daemon answers and every fresh worker's first task starts. They start no thread.
    import pyspark.daemon  # noqa: F401
    import pyspark.worker  # noqa: F401

    # pyspark's daemon runs gc.collect() in a reused worker after every task; with torch loaded that is a scan of
    # some 300,000 objects (0.1-0.4 s a task, any task of the session). Frozen here, before the fork, what the
    # imports made is out of every worker's scans (and their pages stay shared).
    gc.collect()
    gc.freeze()
    keep_freed_memory()  # the workers' steps reuse their heap instead of mapping fresh pages (sparknet._malloc)


def _run_daemon() -> None:
    """pyspark's daemon, whose workers end without the tracebacks of a socket the executor closed."""
    from pyspark import daemon

    try:
        from sparknet.spark.session import FILES_ENV
    except ImportError:  # pragma: no cover - an executor without torch: its workers say so themselves
        FILES_ENV = None
    files = os.environ.get(FILES_ENV) if FILES_ENV else None
    if files and files not in sys.path:  # where pyspark's worker_util.add_path puts it
        sys.path.insert(1, files)
    worker = daemon.worker

    def quiet_worker(sock, authenticated):
        """pyspark's ``worker``, except that a worker whose socket the executor closed (idle for a minute) ends
        without the two tracebacks of its last flush's ``BrokenPipeError``: it is gone either way. Any other error
        is pyspark's."""
        try:
            return worker(sock, authenticated)
        except BrokenPipeError:
            return 1

    daemon.worker = quiet_worker  # manager() calls the module's own name
    daemon.manager()


def identity() -> dict:
    """What must be the same in a launched daemon and the process loaded ahead for the one to stand in for the
    other: the interpreter, where its packages come from, its string hash seed, its user and network namespace."""
    from importlib.util import find_spec

    def origin(name: str):
        spec = find_spec(name)
        return None if spec is None else spec.origin

    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = None
    return {"executable": os.path.realpath(sys.executable), "hash_seed": os.environ.get("PYTHONHASHSEED"),
            "omp_threads": os.environ.get("OMP_NUM_THREADS"),
            "malloc": os.environ.get("GLIBC_TUNABLES"),  # sparknet._malloc.TUNABLES_ENV, not imported: the launched
            # daemon starts on the first job's path with nothing but the standard library
            "uid": os.getuid(), "netns": netns,
            "packages": {name: origin(name) for name in ("pyspark", "py4j", "sparknet", "torch")}}


def start_ahead(env: dict | None = None):
    """Start the process that loads the daemon's modules ahead (``env``: its environment, default this one's), and
    name its socket in this process's environment for the JVM it will start. Returns the ``Popen`` (the process
    ends when its standard input, held by the ``Popen``, closes: keep it for as long as this process runs), or
    ``None`` where it could not start (the launched daemon then loads for itself)."""
    import shutil
    import subprocess
    import tempfile

    folder = tempfile.mkdtemp(prefix="sparknet-daemon-")
    path = os.path.join(folder, "ahead.sock")
    env = dict(os.environ if env is None else env)
    env.pop(AHEAD_ENV, None)
    # what Spark gives its Python workers as they start, unless set: string hashes seeded 0, one OpenMP thread
    # (spark.task.cpus), read as the interpreter and torch load
    env.setdefault("PYTHONHASHSEED", "0")
    env.setdefault("OMP_NUM_THREADS", "1")
    from sparknet._malloc import TUNABLES_ENV, with_huge_pages

    env[TUNABLES_ENV] = with_huge_pages(env.get(TUNABLES_ENV))  # as sparknet's sessions give their Python workers
    env["PYTHONPATH"] = os.pathsep.join(_spark_python_path() + [p for p in [env.get("PYTHONPATH")] if p])
    try:
        process = subprocess.Popen([sys.executable, "-m", "sparknet.spark._daemon", "--ahead", path],
                                   stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   env=env, close_fds=True)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        return None
    os.environ[AHEAD_ENV] = path
    return process


def _spark_python_path() -> list[str]:
    """What Spark puts first on its Python workers' path (its ``PythonUtils.sparkPythonPath``): pyspark and py4j as
    the archives under Spark's home, which the workers import instead of the driver's copies."""
    import glob

    try:
        from pyspark.find_spark_home import _find_spark_home

        home = os.environ.get("SPARK_HOME") or _find_spark_home()
    except (ImportError, SystemExit):  # no pyspark, or no Spark home: the launched daemon loads for itself
        return []
    lib = os.path.join(home, "python", "lib")
    return ([os.path.join(lib, "pyspark.zip")] + sorted(glob.glob(os.path.join(lib, "py4j-*-src.zip")))[-1:]
            + sorted(glob.glob(os.path.join(home, "jars", "spark-core_*.jar")))[-1:])


def _serve_ahead(path: str) -> None:
    """The process loaded ahead: listen at ``path``, load, then fork a loaded daemon for each launched one that asks
    (one that asks while this loads waits for it), until this process's standard input closes (its starter ended).
    Removes the socket and its folder at the end."""
    import select
    import shutil

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old_mask = os.umask(0o077)
        try:
            listener.bind(path)
        finally:
            os.umask(old_mask)
        listener.listen(16)
        _load()
        mine = identity()
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # forked daemons are reaped as they end
        poller = select.poll()
        poller.register(0, select.POLLIN)
        poller.register(listener, select.POLLIN)
        while True:
            events = dict(poller.poll(1000))
            if 0 in events and not os.read(0, 4096):  # the starter ended
                return
            if listener.fileno() in events:
                conn, _ = listener.accept()
                with conn:
                    _fork_daemon(conn, listener, mine)
    finally:
        listener.close()
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _fork_daemon(conn: socket.socket, listener: socket.socket, mine: dict) -> None:
    """Answer one launched daemon: refuse it (it loads for itself), or fork a child that takes its streams and runs
    pyspark's daemon; the child's pid goes back to the launched process."""
    conn.settimeout(HAND_OVER_TIMEOUT_S)
    fds: list[int] = []
    pid = None
    try:
        message, fds, _, _ = socket.recv_fds(conn, _MESSAGE_BYTES, 3)
        asked = json.loads(message)
        if asked.get("identity") != mine or len(fds) != 3:
            conn.sendall(b"{}")
            return
        pid = os.fork()
    except (OSError, ValueError):
        return
    finally:
        if pid != 0:  # this process: the descriptors are the child's (or nobody's)
            for fd in fds:
                os.close(fd)
    if pid:
        return
    code = 1
    try:  # the child: the launched daemon's streams, place and environment, then pyspark's daemon
        listener.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(asked["cwd"])
        os.environ.clear()
        os.environ.update(asked["env"])
        sys.argv = asked["argv"]
        sys.path[:] = asked["path"]
        sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))  # read as an interpreter starts
        if os.environ.get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
        conn.sendall(json.dumps({"pid": os.getpid()}).encode())
        conn.close()
        _run_daemon()
        code = 0
    except SystemExit as exc:  # pyspark's daemon ends with sys.exit
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os._exit(code)


def _hand_over(path: str) -> None:
    """In a daemon Spark launched: have the process loaded ahead at ``path`` fork the daemon with this process's
    streams, pass a termination on to it, and end when it does. Returns where it cannot (the caller loads).

    A SIGTERM or SIGINT is caught from the start: the forked daemon may tell Spark its port before it tells this
    process its pid, and a termination then (Spark's ``Process.destroy()``) is passed on once the pid is in."""
    daemon: dict = {"pid": None, "pending": []}

    def pass_on(signum, frame):
        if daemon["pid"] is None:
            daemon["pending"].append(signum)
            return
        try:
            os.kill(daemon["pid"], signum)
        except ProcessLookupError:
            pass

    before = {s: signal.signal(s, pass_on) for s in (signal.SIGTERM, signal.SIGINT)}
    pid = None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(HAND_OVER_TIMEOUT_S)
            conn.connect(path)
            message = {"identity": identity(), "cwd": os.getcwd(), "env": dict(os.environ), "argv": sys.argv,
                       "path": sys.path}
            socket.send_fds(conn, [json.dumps(message).encode()], [0, 1, 2])
            conn.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := conn.recv(4096):
                answer += chunk
        pid = json.loads(answer or b"{}").get("pid")
    except (OSError, ValueError):  # no process loaded ahead there, or it refused or died: this one loads
        pass
    if not pid:
        for s, handler in before.items():
            signal.signal(s, handler)
        for signum in daemon["pending"][:1]:  # terminated while asking: as it would have been
            os.kill(os.getpid(), signum)
        return
    daemon["pid"] = pid
    for signum in daemon["pending"]:
        pass_on(signum, None)
    _follow(pid)


def _follow(pid: int) -> None:
    """Stand in for daemon ``pid`` (a SIGTERM or SIGINT here is sent on to it: :func:`_hand_over`); exit when it
    ends."""
    import select

    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as pyspark's daemon: its stdin closing is what ends it
    try:
        handle = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (an old kernel): ask every 0.2 s
        handle = None
    while True:
        if handle is not None:
            if select.select([handle], [], [], 1.0)[0]:
                break
        else:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            select.select([], [], [], 0.2)
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--ahead":
        _serve_ahead(sys.argv[2])
        sys.exit(0)
    if os.environ.get(AHEAD_ENV):
        _hand_over(os.environ[AHEAD_ENV])  # ends this process once handed over
    _load()
    _run_daemon()
