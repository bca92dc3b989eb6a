"""``python -m sparknet``: the ``sparknet`` command (:func:`sparknet.cli.main`).

A ``sparknet train`` whose flags say plainly that it runs on Spark, and on which master (:func:`session_master`),
starts its Spark session first (:func:`sparknet.spark.session.start_session_ahead`), in a thread: the JVM and the
SparkContext start while Python loads torch and the rest of sparknet, and the command's ``get_session`` finds the
session made. ``import sparknet`` loads no torch, so nothing before this point does.

On a local master it also starts, before the JVM, the process that loads the Python daemon's modules ahead
(:func:`sparknet.spark._daemon.start_ahead`): the daemon Spark launches at the first Python task is then forked from
it, loaded, instead of spending seconds importing torch and sparknet after the session is up.
"""

import argparse
import sys


def session_master(argv: list[str]) -> str | None:
    """The master of the Spark session ``sparknet *argv`` surely starts: ``train`` with more than one worker, the
    barrier engine or a master, and none of the flags that may take it elsewhere or nowhere (help,
    ``--print-config``, a ``--config`` file, Caffe files, the parameter server's ``--strategy async``) or set the
    JVM's log level as it is read (``--verbose``); ``--master``, else ``local[K]`` for K workers of G processes (the
    configuration's ``resolved_master``). ``None`` for a command it cannot tell about, which starts as always; a flag
    given in a shortened form is not read here."""
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


def runs_on_spark(argv: list[str]) -> bool:
    """Whether ``sparknet *argv`` surely starts a Spark session (:func:`session_master`)."""
    return session_master(argv) is not None


_AHEAD = []
"""The process that loads the Python daemon's modules ahead, kept for this process's life (it ends with it)."""


def on_one_machine(master: str) -> bool:
    """Whether a session on ``master`` runs its executors on this machine (a ``local`` master)."""
    return master.startswith("local")


def main() -> int:
    master = session_master(sys.argv[1:])
    if master is not None and not master.startswith("sc://"):  # Spark Connect: no JVM here
        from sparknet.spark.session import start_session_ahead

        if on_one_machine(master):  # the Python daemon's imports while the JVM starts (before it: it names their
            from sparknet.spark._daemon import start_ahead  # socket in the environment the JVM inherits)

            _AHEAD.append(start_ahead())  # None where it could not start
        start_session_ahead(master)
    from sparknet.cli import main as command

    return command()


if __name__ == "__main__":
    sys.exit(main())
