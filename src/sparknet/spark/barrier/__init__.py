"""The barrier engine: one barrier stage per fit, a gloo group, one collective per round.

:mod:`~sparknet.spark.barrier.driver` supervises the stage from the driver (records, restarts, checkpoints, the
Spark Connect road); :mod:`~sparknet.spark.barrier.executor` is what every task of the stage runs.
"""
