"""A sparknet model folder as an MLflow model: the ``pyfunc`` flavour, with an input signature.

What :class:`~sparknet.sinks.MLflowSink` logs at the end of a run, so that::

    model = mlflow.pyfunc.load_model(f"runs:/{run_id}/model")
    model.predict(pandas_df)          # the columns the model trained on: a "features" column of arrays, or the
                                      # table's own (``sparknet train --features-col rooms,area,age``)

works in any process with sparknet installed, and the model can be registered and served. The
folder itself (:func:`sparknet.model_io.save_model`: a JSON net, safetensors weights) is the MLflow
model's one artifact, and the model is built from code (MLflow's "models from code"): nothing in it is a
pickle.

Predictions follow the net's task: a classifier gives ``prediction`` (the arg-max class, a double) and
``probability`` (the softmax); a multi-label net the indices of labels above one half and each label's
sigmoid; a regressor its outputs as ``prediction``.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import numpy as np

__all__ = ["SparkNetPyfunc", "save_pyfunc_model", "log_pyfunc_model", "signature_of", "score_frame", "input_columns",
           "ARTIFACT", "FEATURES"]

ARTIFACT = "sparknet_model"
"""The name of the model folder among the MLflow model's artifacts."""

try:  # the flavour's base class; without MLflow this module only says what it needs
    from mlflow.pyfunc import PythonModel as _PythonModel
except ImportError:  # pragma: no cover - MLflow is an extra
    _PythonModel = object


class SparkNetPyfunc(_PythonModel):
    """The pyfunc wrapper: loads the sparknet folder once, scores pandas frames and arrays."""

    def load_context(self, context) -> None:
        from sparknet.model_io import load_model

        self.saved = load_model(context.artifacts[ARTIFACT])

    def predict(self, context, model_input, params=None):
        return score_frame(self.saved, model_input)


FEATURES = [{"name": "features", "kind": "array", "values": "double"}]
"""The input of a model that does not say which columns it trained on: one ``features`` column of arrays."""


def input_columns(saved) -> list[dict]:
    """The columns a model takes, in order, each a number or an array a row: those of the table it trained on
    (:func:`sparknet.model_io.input_columns`), else :data:`FEATURES`."""
    from sparknet.model_io import input_columns as trained_on

    return trained_on(saved) or FEATURES


def _features(saved, model_input) -> np.ndarray:
    """A pandas frame (the model's :func:`input_columns`, joined in order; a ``features`` column of arrays; or
    numeric columns) or an array -> float32 ``[n, ...]``."""
    import pandas as pd

    names = [c["name"] for c in input_columns(saved)]
    if isinstance(model_input, pd.DataFrame):
        if set(names) <= set(model_input.columns):
            import pyarrow as pa

            from sparknet._parquet import _joined

            x = _joined(pa.Table.from_pandas(model_input[names], preserve_index=False), names)
        elif "features" in model_input.columns:
            x = np.stack([np.asarray(v, dtype=np.float32).reshape(-1) for v in model_input["features"]])
        else:
            x = model_input.to_numpy(dtype=np.float32)
    else:
        x = np.asarray(model_input, dtype=np.float32)
    x = x.reshape(len(x), -1)  # SavedModel.predict gives each row the net's input shape
    if saved.input_shape is not None and x.shape[1] != int(np.prod(saved.input_shape)):
        raise ValueError(f"each row has {x.shape[1]} feature values but the model takes shape "
                         f"{tuple(saved.input_shape)}")
    return x


def score_frame(saved, model_input):
    """What :meth:`SparkNetPyfunc.predict` returns: a pandas frame of ``prediction`` (and ``probability``), as the
    Spark model scores (:func:`sparknet.labels.score_columns`, its logits left out)."""
    import pandas as pd
    import torch

    from sparknet.labels import score_columns

    columns = score_columns(saved.predict(torch.from_numpy(_features(saved, model_input))), saved.net.task)
    columns.pop("raw", None)
    return pd.DataFrame(columns)


def signature_of(saved):
    """The MLflow signature of a model: its :func:`input_columns` in (a number or an array a row, of the types the
    table it trained on had); ``prediction`` (and ``probability``) out, as :func:`score_frame` gives them for the
    net's task."""
    import torch
    from mlflow.models import ModelSignature
    from mlflow.types import DataType
    from mlflow.types.schema import Array, ColSpec, Schema

    from sparknet.labels import Task

    vector = Array(DataType.double)
    task = saved.net.task
    if task is Task.REGRESSION:
        with torch.no_grad():
            outputs = saved.predict(torch.zeros(1, *saved.input_shape)).numel()
        out = [ColSpec(DataType.double if outputs == 1 else vector, "prediction")]
    elif task is Task.MULTILABEL:
        out = [ColSpec(vector, "prediction"), ColSpec(vector, "probability")]
    else:
        out = [ColSpec(DataType.double, "prediction"), ColSpec(vector, "probability")]
    inputs = []
    for c in input_columns(saved):  # the table's own types: MLflow refuses what it cannot convert safely to them
        values = DataType[c.get("values", "double")]
        inputs.append(ColSpec(values if c["kind"] == "number" else Array(values), c["name"]))
    return ModelSignature(inputs=Schema(inputs), outputs=Schema(out))


def save_pyfunc_model(model_dir: str | os.PathLike, path: str | os.PathLike) -> str:
    """Write the sparknet folder ``model_dir`` as an MLflow pyfunc model at ``path`` (a new folder); returns it.

    The model is built from code (``sparknet/_mlflow_code.py``), not a pickle; its signature is
    :func:`signature_of`; its requirements are sparknet's and torch's versions as installed (named, not
    inferred: inferring them would load the model in a second process)."""
    import mlflow.pyfunc
    import pandas as pd
    import torch

    from sparknet import __version__
    from sparknet.model_io import load_model

    saved = load_model(model_dir)
    if saved.input_shape is None:
        raise ValueError(f"the model folder {model_dir} does not say its input shape; an MLflow signature needs it")
    columns = input_columns(saved)
    arrays = [c["name"] for c in columns if c["kind"] == "array"]
    width = int(np.prod(saved.input_shape)) - (len(columns) - len(arrays))  # of the one array, where there is one
    zero = {"long": 0, "boolean": False}  # a zero of each column's own type (else 0.0)
    example = None if len(arrays) > 1 else pd.DataFrame(  # the widths of several arrays are not kept
        {c["name"]: [zero.get(c.get("values"), 0.0) if c["kind"] == "number" else
                     [zero.get(c.get("values"), 0.0)] * width] for c in columns})
    with warnings.catch_warnings():  # MLflow's advice to type-hint predict: the signature is given in full
        warnings.filterwarnings("ignore", message=".*type hints.*", category=UserWarning)
        mlflow.pyfunc.save_model(path=str(path), python_model=str(Path(__file__).with_name("_mlflow_code.py")),
                                 artifacts={ARTIFACT: str(model_dir)}, signature=signature_of(saved),
                                 input_example=example,
                                 pip_requirements=[f"sparknet=={__version__}",
                                                   f"torch=={torch.__version__.split('+')[0]}"])
    return str(path)


def log_pyfunc_model(client, run_id: str, model_dir: str | os.PathLike, artifact_path: str = "model") -> None:
    """Log ``model_dir`` to ``run_id`` as an MLflow pyfunc model under ``artifact_path`` (``runs:/ID/model``)."""
    with tempfile.TemporaryDirectory(prefix="sparknet-mlflow-", ignore_cleanup_errors=True) as staging:
        save_pyfunc_model(model_dir, Path(staging, "model"))
        client.log_artifacts(run_id, str(Path(staging, "model")), artifact_path=artifact_path)
