"""``python -m sparknet``: the ``sparknet`` command (:func:`sparknet.cli.main`).

A ``sparknet train`` whose flags say plainly that it runs on Spark (:func:`runs_on_spark`) starts Spark's driver JVM
first (:func:`sparknet.spark.session.start_driver_jvm`), and the JVM starts while Python loads torch and the rest of
sparknet, on a machine with cores to spare for it (on two cores, no sooner to a session: the command already starts
it while it reads its data). ``import sparknet`` loads no torch, so nothing before this point does.

On a local master it also starts, before the JVM, the process that loads the Python daemon's modules ahead
(:func:`sparknet.spark._daemon.start_ahead`): the daemon Spark launches at the first Python task is then forked from
it, loaded, instead of spending seconds importing torch and sparknet after the session is up.
"""

import argparse
import gc
import sys


def spark_flags(argv: list[str]) -> argparse.Namespace | None:
    """The flags of ``sparknet *argv`` that say it surely starts a Spark session (``--workers``, ``--engine``,
    ``--master``...): ``train`` with more than one worker, the barrier engine or a master, and none of the flags that
    may take it elsewhere or nowhere (help, ``--print-config``, a ``--config`` file, Caffe files, the parameter
    server's ``--strategy async``) or set the JVM's log level as it is read (``--verbose``). ``None`` for a command
    it cannot tell about, which starts as always; a flag given in a shortened form is not read here."""
    if not argv or argv[0] != "train" or {"-h", "--help", "--verbose"} & set(argv):  # --verbose: Spark's own level
        return None
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--workers", "--engine", "--master", "--config", "--prototxt", "--solver",
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
    except ValueError:
        return None
    return flags if workers > 1 or flags.engine == "barrier" or flags.master else None


def runs_on_spark(argv: list[str]) -> bool:
    """Whether ``sparknet *argv`` surely starts a Spark session (:func:`spark_flags`)."""
    return spark_flags(argv) is not None


_AHEAD = []
"""The process that loads the Python daemon's modules ahead, kept for this process's life (it ends with it)."""


def on_one_machine(argv: list[str]) -> bool:
    """Whether ``sparknet *argv`` surely starts a Spark session (:func:`spark_flags`) whose executors run on this
    machine: no ``--master``, or a ``local`` one."""
    flags = spark_flags(argv)
    return flags is not None and (flags.master is None or flags.master.startswith("local"))


def main() -> int:
    if runs_on_spark(sys.argv[1:]):
        from sparknet.spark.session import forks_sparknet_daemon, start_driver_jvm

        # the Python daemon's imports while the JVM starts (before it: their socket is named in the environment the
        # JVM inherits)
        if on_one_machine(sys.argv[1:]) and forks_sparknet_daemon():
            from sparknet.spark._daemon import start_ahead

            _AHEAD.append(start_ahead())  # None where it could not start
        start_driver_jvm()
    from sparknet.cli import main as command

    code = command()
    # what is alive now lives until the process ends: frozen, the collector leaves it alone as the interpreter ends
    # (its last collections walked torch's, pyspark's and pandas' objects for some 0.4 s after the result was out)
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())
