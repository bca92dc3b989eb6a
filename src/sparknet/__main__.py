"""``python -m sparknet``: the ``sparknet`` command (:func:`sparknet.cli.main`).

A ``sparknet train`` whose flags say plainly that it runs on Spark, and on which master (:func:`session_master`),
starts its Spark session first, in a thread, while Python loads torch and the rest of sparknet: on a machine with
cores to spare the whole session (:func:`sparknet.spark.session.start_session_ahead`: the driver JVM and the
SparkContext, which the command's ``get_session`` then finds made), else its driver JVM alone
(:func:`sparknet.spark.session.start_driver_jvm`; :func:`sparknet.spark.session.starts_session_ahead` chooses).
``import sparknet`` loads no torch, so nothing before this point does.

On a local master it also starts, before the JVM, the process that loads the Python daemon's modules ahead
(:func:`sparknet.spark._daemon.start_ahead`): the daemon Spark launches at the first Python task is then forked from
it, loaded, instead of spending seconds importing torch and sparknet after the session is up.
"""

import argparse
import gc
import sys
import warnings


def session_master(argv: list[str]) -> str | None:
    """The master of the Spark session ``sparknet *argv`` surely starts: ``train`` with more than one worker, the
    barrier engine or a master, and none of the flags that may take it elsewhere or nowhere (help,
    ``--print-config``, a ``--config`` file, Caffe files, the parameter server's ``--strategy async``) or set the
    JVM's log level as it is read (``--verbose``); ``--master``, else ``local[K]`` for K workers of G processes each
    (the configuration's ``resolved_master``). ``None`` for a command it cannot tell about, which starts as always; a
    flag given in a shortened form is not read here."""
    if not argv or argv[0] != "train" or {"-h", "--help", "--verbose"} & set(argv):  # --verbose: Spark's own level
        return None
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--workers", "--procs-per-worker", "--engine", "--master", "--config", "--prototxt", "--solver",
                 "--strategy"):
        p.add_argument(flag, default=None)
    p.add_argument("--print-config", action="store_true")
    try:
        flags, _ = p.parse_known_args(argv[1:])
    except SystemExit:  # a flag without its value: the real parser says so
        return None
    if flags.print_config or flags.config or flags.prototxt or flags.solver or flags.strategy == "async":
        return None
    try:
        workers = int(flags.workers) if flags.workers is not None else 1
        procs = int(flags.procs_per_worker) if flags.procs_per_worker is not None else 1
    except ValueError:
        return None
    if not (workers > 1 or flags.engine == "barrier" or flags.master):
        return None
    return flags.master or f"local[{workers * procs}]"


_AHEAD = []
"""The process that loads the Python daemon's modules ahead, kept for this process's life (it ends with it)."""


def on_one_machine(master: str) -> bool:
    """Whether a session on ``master`` runs its executors on this machine (a ``local`` or ``local-cluster`` one)."""
    return master.startswith("local")


def main() -> int:
    master = session_master(sys.argv[1:])
    if master is not None and not master.startswith("sc://"):  # Spark Connect: the server's JVM, none here
        from sparknet.spark.session import (PANDAS_NOTICE, forks_sparknet_daemon, start_driver_jvm,
                                            start_session_ahead, starts_session_ahead)

        # a session started in a thread loads pyspark's testing helpers there, outside the command's own filter of
        # their notice (sparknet.cli.main): hidden for the process (the filters are the process's, not a thread's)
        warnings.filterwarnings("ignore", message=PANDAS_NOTICE, category=FutureWarning)

        # the Python daemon's imports while the JVM starts (before it: their socket is named in the environment the
        # JVM inherits)
        if on_one_machine(master) and forks_sparknet_daemon():
            from sparknet.spark._daemon import start_ahead

            _AHEAD.append(start_ahead())  # None where it could not start
        if starts_session_ahead():  # the JVM and the SparkContext (on cores the loading leaves spare)
            from sparknet.spark.backend import start_python_workers

            # then, on this machine, the session's Python workers, while the command still loads
            start_session_ahead(master, then=start_python_workers if on_one_machine(master) else None)
        else:  # the JVM alone: the SparkContext is made once the command asks for it
            start_driver_jvm()
    from sparknet.cli import main as command

    code = command()
    # what is alive now lives until the process ends: frozen, the collector leaves it alone as the interpreter ends
    # (its last collections walked torch's, pyspark's and pandas' objects for some 0.4 s after the result was out)
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())
