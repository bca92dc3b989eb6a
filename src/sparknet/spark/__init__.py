"""Training on Apache Spark: the rounds and barrier engines behind :class:`SparkTrainer`.

>>> from sparknet.spark import SparkTrainer
>>> trainer = SparkTrainer(zoo.lenet(), WorkerConfig(solver=SolverConfig(base_lr=0.05)),      # doctest: +SKIP
...                        DistributedConfig(workers=2, tau=50, rounds=20))
>>> result = trainer.fit(df)                                                              # doctest: +SKIP

The engines import pyspark only where they run Spark jobs; the rest of sparknet never needs it.
"""

from sparknet.spark.data import frame_from_arrays
from sparknet.spark.session import get_session, is_local_master
from sparknet.spark.trainer import EngineOptions, SparkTrainer, TrainResult

__all__ = ["SparkTrainer", "TrainResult", "EngineOptions", "get_session", "frame_from_arrays", "is_local_master"]


def __getattr__(name):
    # The Spark ML classes live in sparknet.spark.ml; import them on first use only.
    if name in ("SparkNetEstimator", "SparkNetModel"):
        from sparknet.spark import ml

        return getattr(ml, name)
    raise AttributeError(f"module 'sparknet.spark' has no attribute {name!r}")
