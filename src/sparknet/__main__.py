"""``python -m sparknet``: the ``sparknet`` command (:mod:`sparknet.cli`).

The command line is parsed first, before torch is loaded (:func:`sparknet.cli.parse_args` loads none): ``--help``
and a mistyped flag are answered at once. A command that starts a Spark session (:func:`sparknet.cli.session_master`
says on which master: ``train`` on the Spark engines' road, ``predict``, ``data``) then starts it in a thread while
Python loads torch and the rest of sparknet: on a machine with cores to spare the whole session
(:func:`sparknet.spark.session.start_session_ahead`: the driver JVM and the SparkContext, which the command's
``get_session`` then finds made), else its driver JVM alone (:func:`sparknet.spark.session.start_driver_jvm`;
:func:`sparknet.spark.session.starts_session_ahead` chooses).

On a local master it also starts, before the JVM, the process that loads the Python daemon's modules ahead
(:func:`sparknet.spark._daemon.start_ahead`): the daemon Spark launches at the first Python task is then forked from
it, loaded, instead of spending seconds importing torch and sparknet after the session is up.
"""

import gc
import sys
import warnings

from sparknet import cli
from sparknet.spark.session import (PANDAS_NOTICE, forks_sparknet_daemon, start_driver_jvm, start_session_ahead,
                                    starts_session_ahead)

_AHEAD = []
"""The process that loads the Python daemon's modules ahead, kept for this process's life (it ends with it)."""


def on_one_machine(master: str) -> bool:
    """Whether a session on ``master`` runs its executors on this machine (a ``local`` or ``local-cluster`` one)."""
    return master.startswith("local")


def main() -> int:
    args = cli.parse_args()
    cli.prepare(args)  # the logs first: a --verbose run's JVM reads Spark's level as it starts
    master = cli.session_master(args)
    if master is not None and not master.startswith("sc://"):  # Spark Connect: the server's JVM, none here
        # a session started in a thread loads pyspark's testing helpers there, outside the command's own filter of
        # their notice (sparknet.cli.run): hidden for the process (the filters are the process's, not a thread's)
        warnings.filterwarnings("ignore", message=PANDAS_NOTICE, category=FutureWarning)

        # the Python daemon's imports while the JVM starts (before it: their socket is named in the environment the
        # JVM inherits)
        if on_one_machine(master) and forks_sparknet_daemon():
            from sparknet.spark._daemon import start_ahead

            _AHEAD.append(start_ahead())  # None where it could not start
        if starts_session_ahead():  # the JVM and the SparkContext (on cores the loading leaves spare)
            from sparknet.spark.backend import start_python_workers

            # then, on this machine, the session's Python workers, while the command still loads
            start_session_ahead(master, then=start_python_workers if on_one_machine(master) else None,
                                app_name=cli.session_app_name(args))
        else:  # the JVM alone: the SparkContext is made once the command asks for it
            start_driver_jvm()
    code = cli.run(args)
    # what is alive now lives until the process ends: frozen, the collector leaves it alone as the interpreter ends
    # (its last collections walked torch's, pyspark's and pandas' objects for some 0.4 s after the result was out)
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())
