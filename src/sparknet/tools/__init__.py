"""What users expect around a training run: plots, export, batch prediction and a cluster doctor.

Each module here is also a ``sparknet`` subcommand (``plot``, ``export``, ``predict``,
``doctor``); :mod:`sparknet.cli` lists them. Every heavy or optional dependency (pyspark,
onnx, matplotlib) is imported inside the function that needs it, so ``sparknet --help``
stays fast and works without the optional extras. The metrics sinks are in :mod:`sparknet.sinks`.
"""

from sparknet.tools.doctor import CheckResult, Status, format_table, run_doctor
from sparknet.tools.export import ExportFormat, export_model, export_onnx, export_torchscript, verify_onnx
from sparknet.tools.plot import extract_curves, plot_metrics
from sparknet.tools.predict import PredictResult
from sparknet.tools.predict import predict as predict_parquet

__all__ = ["plot_metrics", "extract_curves", "ExportFormat", "export_onnx", "export_torchscript", "export_model",
           "verify_onnx", "run_doctor", "CheckResult", "Status", "format_table", "predict_parquet", "PredictResult"]
