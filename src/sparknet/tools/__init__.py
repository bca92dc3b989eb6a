"""What users expect around a training run: plots, export, metrics sinks, a doctor, batch prediction.

Importing this package registers the ``sparknet plot``, ``export``, ``doctor`` and ``predict``
subcommands (:func:`sparknet.cli._load_plugins` imports it). Every heavy or optional
dependency (pyspark, onnx, tensorboard, mlflow) is imported inside the function that needs it,
so ``sparknet --help`` stays fast and works without the optional extras.
"""

from sparknet.tools import doctor, export, plot, predict  # noqa: F401  (each registers its subcommand)
from sparknet.tools.doctor import CheckResult, Status, format_table, run_doctor
from sparknet.tools.export import ExportFormat, export_model, export_onnx, export_torchscript, verify_onnx
from sparknet.tools.plot import extract_curves, plot_metrics
from sparknet.tools.predict import PredictResult
from sparknet.tools.predict import predict as predict_parquet
from sparknet.tools.sinks import MLflowSink, TensorBoardSink, close_sinks, make_sinks

__all__ = ["plot_metrics", "extract_curves", "ExportFormat", "export_onnx", "export_torchscript", "export_model",
           "verify_onnx", "TensorBoardSink", "MLflowSink", "make_sinks", "close_sinks", "run_doctor", "CheckResult",
           "Status", "format_table", "predict_parquet", "PredictResult"]
