"""The rounds engine (SparkNet's own scheme): one Spark job per round.

:mod:`~sparknet.spark.rounds.driver` is the driver's side (the round loop's exchange, the relay, elastic rounds);
:mod:`~sparknet.spark.rounds.executor` is what the tasks run (staging, a worker's round, the aggregation), and what
both engines' tasks share (the worker spec, the worker's net, its device).
"""
