"""What users expect around a training run: plots, export, batch prediction and a cluster doctor.

Each module here is also a ``sparknet`` subcommand (``plot``, ``export``, ``predict``,
``doctor``); :mod:`sparknet.cli` lists them. Every heavy or optional dependency (pyspark,
onnx, matplotlib) is imported inside the function that needs it, so ``sparknet --help``
stays fast and works without the optional extras. The metrics sinks are in :mod:`sparknet.sinks`.
"""

from sparknet._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("CheckResult", "Status", "format_table", "run_doctor"), "sparknet.tools.doctor"),
    **dict.fromkeys(("ExportFormat", "export_model", "export_onnx", "export_torchscript", "verify_onnx"),
                    "sparknet.tools.export"),
    **dict.fromkeys(("extract_curves", "plot_metrics"), "sparknet.tools.plot"),
    "PredictResult": "sparknet.tools.predict", "predict_parquet": "sparknet.tools.predict:predict",
}
"""Each name and the module that defines it, imported on first use: a subcommand's module loads alone (``plot``,
``predict``, ``doctor`` and ``data`` read their flags with no torch loaded)."""

__all__ = ["plot_metrics", "extract_curves", "ExportFormat", "export_onnx", "export_torchscript", "export_model",
           "verify_onnx", "run_doctor", "CheckResult", "Status", "format_table", "predict_parquet", "PredictResult"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
