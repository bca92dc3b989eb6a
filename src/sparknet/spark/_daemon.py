"""The Python worker daemon of the Spark sessions sparknet starts: pyspark's own, with torch loaded first.

Spark starts one daemon per executor (``python -m <spark.python.daemon.module> pyspark.worker``)
and the daemon forks a Python worker for each task slot that needs one. pyspark's daemon imports
nothing heavy, so every worker it forks imports torch and sparknet's executor code itself: about
three CPU-seconds each time, paid again by every worker a failed task, a new executor or a fresh
session starts. This module imports them once, in the daemon, and then runs pyspark's daemon:
the workers it forks find them loaded (shared copy-on-write pages). torch runs nothing here, so
no thread pool exists before the fork (torch's own fork handlers reset it in the child anyway).

:func:`sparknet.spark.session.get_session` sets ``spark.python.daemon.module`` to this module
for the sessions it starts; a user's own session can set it too (``sparknet`` must be importable
on the executors, as it is for training anyway).
"""

import gc

from pyspark import daemon

try:  # loaded before the daemon forks its workers; a worker that cannot load them says why itself
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (what a torch optimizer imports when the first one is made: about 1 s)

    import sparknet.spark.barrier.executor  # noqa: F401  (the executor side of both engines, with the data path)
    import sparknet.spark.rounds.executor  # noqa: F401
    from sparknet._malloc import keep_freed_memory
except ImportError:  # pragma: no cover - an executor without torch or sparknet
    def keep_freed_memory():
        return False

# pyspark's daemon runs gc.collect() in a reused worker after every task; with torch loaded that is a scan of
# some 300,000 objects (0.1-0.4 s a task, any task of the session). Frozen here, before the fork, what the
# imports made is out of every worker's scans (and their pages stay shared).
gc.collect()
gc.freeze()
keep_freed_memory()  # the workers' steps reuse their heap instead of mapping fresh pages (sparknet._malloc)

_worker = daemon.worker


def _quiet_worker(sock, authenticated):
    """pyspark's ``worker``, except that a worker whose socket the executor closed (idle for a minute) ends without
    the two tracebacks of its last flush's ``BrokenPipeError``: it is gone either way. Any other error is pyspark's.
    """
    try:
        return _worker(sock, authenticated)
    except BrokenPipeError:
        return 1


daemon.worker = _quiet_worker  # manager() calls the module's own name

if __name__ == "__main__":
    daemon.manager()
