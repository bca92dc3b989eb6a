"""The metrics sinks moved to :mod:`sparknet.sinks` (library code beside the metrics they receive).

This name stays so existing ``from sparknet.tools.sinks import ...`` lines keep working.
"""

from sparknet.sinks import (DEFAULT_MLFLOW_DIR, MLflowSink, TensorBoardSink, close_sinks, make_sinks, record_scalars,
                            resolve_tracking_uri)

__all__ = ["TensorBoardSink", "MLflowSink", "make_sinks", "close_sinks", "record_scalars", "resolve_tracking_uri",
           "DEFAULT_MLFLOW_DIR"]
