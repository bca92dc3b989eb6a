"""Training on Apache Spark: the rounds and barrier engines behind :class:`SparkTrainer`.

>>> from sparknet.spark import SparkTrainer
>>> trainer = SparkTrainer(zoo.lenet(), WorkerConfig(solver=SolverConfig(base_lr=0.05)),      # doctest: +SKIP
...                        DistributedConfig(workers=2, tau=50, rounds=20))
>>> result = trainer.fit(df)                                                              # doctest: +SKIP

The engines import pyspark only where they run Spark jobs; the rest of sparknet never needs it.
"""

from sparknet._lazy import lazy_exports

_EXPORTS = {"SparkTrainer": "sparknet.spark.trainer", "TrainResult": "sparknet.spark.trainer",
            "EngineOptions": "sparknet.config", "get_session": "sparknet.spark.session",
            "is_local_master": "sparknet.spark.session", "frame_from_arrays": "sparknet.spark.data",
            "SparkNetEstimator": "sparknet.spark.ml", "SparkNetModel": "sparknet.spark.ml"}
"""Each name and the module that defines it, imported on first use: :mod:`sparknet.spark.session` loads without
torch (the ``sparknet`` command starts Spark's JVM while torch loads)."""

__all__ = ["SparkTrainer", "TrainResult", "EngineOptions", "get_session", "frame_from_arrays", "is_local_master"]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
