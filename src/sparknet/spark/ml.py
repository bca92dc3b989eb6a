"""The Spark ML face of sparknet: :class:`SparkNetEstimator` and :class:`SparkNetModel`.

>>> from pyspark.ml import Pipeline
>>> from pyspark.ml.feature import VectorAssembler
>>> from sparknet import zoo
>>> est = SparkNetEstimator(zoo.mlp(input_shape=[20], hidden=[32], num_classes=3),
...                         workers=2, tau=20, rounds=10, lr=0.05)       # doctest: +SKIP
>>> pipe = Pipeline(stages=[VectorAssembler(inputCols=cols, outputCol="features"), est])
>>> model = pipe.fit(train_df)                                            # doctest: +SKIP
>>> model.transform(test_df).select("label", "prediction", "probability")  # doctest: +SKIP

The estimator's training ``Param``\\ s are generated from the fields of
:class:`~sparknet.config.RunConfig` and :class:`~sparknet.config.DistributedConfig` (same
names in camelCase, the field docstrings as their docs, the dataclasses' own checks); ``fit``
runs :class:`~sparknet.spark.SparkTrainer` on the DataFrame's session.

The model scores through an Arrow-batched pandas UDF. Its weights reach the executors as one
broadcast of the model's files (net JSON and safetensors bytes, see
:mod:`sparknet.model_io`) — never a pickled torch object — and each Python worker process
builds the net once and keeps it in a process-level cache keyed by the model's content
hash. Both classes save and load with Spark ML's ``MLWritable``/``MLReadable``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import json
import logging
import math
import os
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import (HasFeaturesCol, HasLabelCol, HasPredictionCol, HasProbabilityCol,
                                     HasRawPredictionCol, HasValidationIndicatorCol, HasWeightCol)
from pyspark.ml.util import (DefaultParamsReadable, DefaultParamsReader, DefaultParamsWritable,
                             DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter)

from sparknet import model_io, zoo
from sparknet._fields import base_type, field_docs
from sparknet.config import DistributedConfig, RunConfig, column_names
from sparknet.layers import NetParams
from sparknet.metrics import MetricsLogger, json_safe, round_reporter, rounds_total
from sparknet.sinks import close_sinks, make_sinks
from sparknet.spark.backend import Held, run_with_deadline
from sparknet.spark.session import is_connect, session_parallelism
from sparknet.spark.scoring import score_batches
from sparknet.spark.shared_path import check_shared_path
from sparknet.spark.trainer import EngineOptions, SparkTrainer, _copy_module
from sparknet.labels import Task, parse_task

__all__ = ["SparkNetEstimator", "SparkNetModel"]

log = logging.getLogger(__name__)

_RUN_FIELDS = ("model", "steps", "batch_size", "solver_type", "lr", "momentum", "momentum2", "weight_decay",
               "lr_policy", "gamma", "power", "lr_warmup", "min_lr", "clip_gradients", "seed", "threads", "device",
               "gpus_per_worker", "precision", "compile", "channels_last", "metrics_out", "quiet", "mlflow",
               "profile_dir", "profile_round")
"""RunConfig fields that become estimator Params."""
_DIST_FIELDS = ("workers", "engine", "strategy", "tau", "round_seconds", "warmup_steps", "rounds", "epochs",
                "weight_ema", "target_accuracy", "target_loss", "patience", "monitor", "min_delta", "data_mode",
                "stream_buffer_mb", "compression", "auto_tau", "auto_tau_target", "outer_lr", "outer_momentum",
                "easgd_beta", "overlap", "fragments", "eval_overlap", "eval_sharded", "procs_per_worker",
                "shard_replica", "model_parallel", "parallel_plan", "max_weight_bytes")
"""DistributedConfig fields that become estimator Params."""
_DOC_OVERRIDES = {
    "workers": "Number of workers K (default: the session's default parallelism).",
    "threads": "Torch threads per task (training and scoring; default 1).",
    "quiet": "No progress while fit runs (default: a bar on a terminal or in a notebook, one plain line per round "
             "on standard error when it goes to a log).",
    "device": "cpu, cuda or auto (where each task runs the net).",
    "metrics_out": "A JSON-lines file on the driver that fit writes every round record to.",
    "mlflow": "Log fit to MLflow at this tracking URI or path ('': the run active in this program, which fit joins, "
              "else ./mlflow.db): params, every round's metrics, and the model as an MLflow pyfunc model.",
}
_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineOptions) if f.name not in EngineOptions.CODE_ONLY)
"""EngineOptions fields that become estimator Params (all but those set in code only)."""
_NO_DEFAULT = {"workers"}  # resolved from the session at fit time


# -- Params generated from the config dataclasses ---------------------------------------------
def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _as_many_workers(fname: str, value) -> dict | None:
    """A model-parallel degree M above 2 beside M workers, which it divides (none for any other field)."""
    return {"engine": "barrier", "workers": value} if fname == "model_parallel" and isinstance(value, int) \
        and value > 2 else None


_NEIGHBOURS = {DistributedConfig: ({"engine": "barrier", "workers": 2, "procs_per_worker": 2},
                                   {"engine": "barrier", "workers": 2, "model_parallel": 2}, _as_many_workers,
                                   {"patience": 1}),
               RunConfig: ({"lr_policy": "cosine"}, {"profile_dir": "profiles"})}
"""Fields a param's value is checked beside when it cannot stand beside the defaults (each set in turn, or made from
the field and its value): --overlap, --fragments, --procs-per-worker and --model-parallel need the barrier engine and
more than one worker (--model-parallel M a multiple of M), --shard-replica several processes, --parallel-plan a
model-parallel degree, --monitor and --min-delta --patience, --min-lr the cosine policy, --profile-round a
--profile-dir, which other params of the same estimator set."""


def _beside_neighbours(cls, fname: str, value, alone: ValueError):
    """``value`` of field ``fname`` as ``cls`` checks it beside the first set of :data:`_NEIGHBOURS` it stands beside;
    the error of the last set tried where it stands beside none (``alone``'s where ``cls`` has none)."""
    error = alone
    for neighbours in _NEIGHBOURS.get(cls, ()):
        neighbours = neighbours(fname, value) if callable(neighbours) else neighbours
        if neighbours is None:
            continue
        try:
            return getattr(cls(**{**neighbours, fname: value}), fname)
        except ValueError as e:
            error = e
    raise error


def _field_converter(cls, fname: str, pname: str, base) -> Any:
    """A typeConverter that converts like the field's type and runs the dataclass's own check (which parses an
    enum field's value: the param keeps the member's value)."""
    is_enum = isinstance(base, type) and issubclass(base, enum.Enum)
    convert_type = {bool: TypeConverters.toBoolean, int: TypeConverters.toInt,
                    float: TypeConverters.toFloat}.get(base, TypeConverters.toString)

    def convert(value):
        try:
            value = convert_type(value)
            try:  # the field's own validation, every other at its default
                checked = getattr(cls(**{fname: value}), fname)
            except ValueError as alone:  # or beside the neighbours it may need (a rule between fields is checked at
                checked = _beside_neighbours(cls, fname, value, alone)  # fit time)
        except (TypeError, ValueError) as e:
            raise ValueError(f"invalid value for param {pname!r}: {e}") from None
        return checked.value if is_enum else value

    convert.__name__ = f"to_{pname}"
    return convert


def _config_params() -> tuple[dict[str, Param], dict[str, tuple[type, str, bool]], dict[str, Any]]:
    """Params for the chosen config fields: (param name -> Param, param name -> (class, field, whether it may be
    None), param name -> default)."""
    params: dict[str, Param] = {}
    origin: dict[str, tuple[type, str, bool]] = {}
    defaults: dict[str, Any] = {}
    for cls, names in ((RunConfig, _RUN_FIELDS), (DistributedConfig, _DIST_FIELDS), (EngineOptions, _ENGINE_FIELDS)):
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        defaults_of = {f.name: f.default for f in dataclasses.fields(cls)}
        for fname in names:
            pname = _camel(fname)
            base, is_opt = base_type(hints[fname])
            doc = _DOC_OVERRIDES.get(fname) or docs.get(fname) or fname.replace("_", " ")
            params[pname] = Param(Params._dummy(), pname, doc,
                                  typeConverter=_field_converter(cls, fname, pname, base))
            origin[pname] = (cls, fname, is_opt)
            default = defaults_of[fname]
            if fname not in _NO_DEFAULT and default is not dataclasses.MISSING and default is not None:
                defaults[pname] = default.value if isinstance(default, enum.Enum) else default
    return params, origin, defaults


def _to_net_dict(value) -> dict:
    """typeConverter of ``net``: a NetParams (stored as its dict) or such a dict."""
    if isinstance(value, Mapping):
        d = dict(value)
        if not isinstance(d.get("layers"), list):
            raise TypeError("a net dict needs a 'layers' list (NetParams.to_dict())")
        return d
    if hasattr(value, "to_dict") and hasattr(value, "build"):
        return value.to_dict()
    raise TypeError(f"net must be a sparknet NetParams (or its to_dict()), got {type(value).__name__}; "
                    "a plain torch.nn.Module is not a Param: give it as SparkNetEstimator(module, loss=...)")


def _to_columns(pname: str):
    """typeConverter of a Param of distinct, non-empty column names (``featuresCols``, ``labelCols``)."""

    def convert(value) -> list[str]:
        names = TypeConverters.toListString(value)
        if not names or not all(n.strip() for n in names) or len(set(names)) != len(names):
            raise ValueError(f"{pname} names one or more distinct columns, got {value!r}")
        return names

    return convert


def _to_fraction(value) -> float:
    """typeConverter of ``validationFraction``: a share strictly between 0 and 1."""
    share = TypeConverters.toFloat(value)
    if not 0.0 < share < 1.0:
        raise ValueError(f"validationFraction is a share of the rows strictly between 0 and 1, got {value!r}")
    return share


def _to_shape(value) -> list[int]:
    shape = TypeConverters.toListInt(value)
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"imageShape must be a non-empty list of positive ints, got {value!r}")
    return shape


def _add_accessors(cls) -> None:
    """``getX``/``setX`` methods for the params of ``cls`` that lack them (generated, not restated)."""
    for pname in [name for name in dir(cls) if isinstance(getattr(cls, name), Param)]:
        cap = pname[:1].upper() + pname[1:]
        if not hasattr(cls, f"get{cap}"):
            def getter(self, _p=pname):
                return self.getOrDefault(getattr(self, _p))
            getter.__name__, getter.__doc__ = f"get{cap}", f"Gets the value of {pname} or its default value."
            setattr(cls, f"get{cap}", getter)
        if not hasattr(cls, f"set{cap}"):
            def setter(self, value, _p=pname):
                return self._set(**{_p: value})
            setter.__name__, setter.__doc__ = f"set{cap}", f"Sets the value of {pname}."
            setattr(cls, f"set{cap}", setter)


_CONFIG_PARAMS, _PARAM_ORIGIN, _CONFIG_DEFAULTS = _config_params()


class _ScoringParams(HasFeaturesCol, HasPredictionCol, HasProbabilityCol, HasRawPredictionCol):
    """Params the model uses to score (shared with the estimator)."""

    imageShape: Param[list[int]] = Param(
        Params._dummy(), "imageShape",
        "Shape of one sample without the batch dimension (e.g. [1, 28, 28]); flat features are reshaped "
        "to it (default: the net's input shape).", typeConverter=_to_shape)
    featuresCols: Param[list[str]] = Param(
        Params._dummy(), "featuresCols",
        "Several feature columns (numbers, arrays or ML vectors), joined in this order into each row's features, "
        "instead of featuresCol: a model fit on them keeps their names (trainedColumns) and its transform joins the "
        "same columns of the data it scores.", typeConverter=_to_columns("featuresCols"))
    threads: Param[int] = _CONFIG_PARAMS["threads"]
    device: Param[str] = _CONFIG_PARAMS["device"]
    scoreBatchSize: Param[int] = Param(Params._dummy(), "scoreBatchSize",
                                       "Rows per forward pass when scoring.", typeConverter=TypeConverters.toInt)
    task: Param[str] = Param(Params._dummy(), "task",
                             "classification, regression or multilabel (default: regression for a net whose "
                             "loss is a regression loss, such as a EuclideanLoss layer). A regressor's prediction "
                             "is its output (a double, or an ML vector for several outputs) and it has no "
                             "probability; a multi-label model's prediction is the array of the indices of the "
                             "labels it predicts (what MultilabelClassificationEvaluator reads), its probability "
                             "each label's sigmoid.",
                             typeConverter=lambda v: parse_task(v).value)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(device="cpu", scoreBatchSize=1024)

    def _named_columns(self) -> list[str] | None:
        """``featuresCols`` where it is set (``None`` where not)."""
        if not (self.isDefined(self.featuresCols) and self.getFeaturesCols()):
            return None
        if self.isSet(self.featuresCol):
            raise ValueError("set featuresCol (one column) or featuresCols (several columns), not both")
        return self.getFeaturesCols()


class _EstimatorParams(_ScoringParams, HasLabelCol, HasValidationIndicatorCol, HasWeightCol):
    """Training params: one per chosen config field, plus ``net``, ``labelCols`` and Spark ML's ``weightCol``."""

    net: Param[dict] = Param(Params._dummy(), "net",
                             "The network: a sparknet NetParams (kept as NetParams.to_dict()). When unset, "
                             "the zoo model named by 'model' is made to fit the data.",
                             typeConverter=_to_net_dict)
    validationFraction: Param[float] = Param(
        Params._dummy(), "validationFraction",
        "A share of the rows (between 0 and 1) held out and evaluated on, not trained on, instead of "
        "validationIndicatorCol's: the rows a hash of their feature and label values, seeded by seed, picks (the "
        "same rows on every fit of the same data and seed, however it is partitioned).", typeConverter=_to_fraction)
    labelCols: Param[list[str]] = Param(
        Params._dummy(), "labelCols",
        "Several label columns of numbers (task regression) or of 0s and 1s (task multilabel), joined in this order "
        "into one array a row, instead of labelCol.", typeConverter=_to_columns("labelCols"))

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(**_CONFIG_DEFAULTS)


for _name, _param in _CONFIG_PARAMS.items():
    setattr(_EstimatorParams, _name, _param)
_add_accessors(_ScoringParams)
_add_accessors(_EstimatorParams)


def _set_params(instance: Params, params: Mapping[str, Any]) -> None:
    """Set params given by camelCase or snake_case name; unknown names are a clear error."""
    resolved = {}
    for key, value in params.items():
        name = key if instance.hasParam(key) else _camel(key)
        if not instance.hasParam(name):
            known = sorted(p.name for p in instance.params)
            raise ValueError(f"{type(instance).__name__} has no parameter {key!r}; known: {known}")
        resolved[name] = value
    instance._set(**resolved)


# -- column handling ------------------------------------------------------------------------------
def _features_of(dataset, columns: str | Sequence[str]):
    """The kind (``"array"`` or ``"binary"``) and Column of the features of ``dataset``: one column (numbers in an
    array or an ML vector, or bytes), or a list of a table's columns (numbers, arrays or ML vectors: ``featuresCols``,
    or the columns a model trained on) joined in order into one array (:func:`sparknet.spark.data.feature_column`)."""
    from sparknet.spark.data import feature_column

    expr, kind = feature_column(dataset, columns if isinstance(columns, str) else list(columns))
    if kind == "image":
        raise ValueError(f"feature column {columns!r} holds Spark's images; the estimator and its model read an "
                         "array of numbers, an ML vector or binary with imageShape: select the image's data bytes")
    return kind, expr


class _Persisted(MLReadable, MLWritable):
    """Spark ML's ``write()`` and ``read()`` of the estimator and the model."""

    def write(self) -> MLWriter:
        """Spark ML writer: the params as metadata (and a model's files as one Parquet table under ``data``).

        The executors write the folder, so ``save(path)`` takes a path or URI every host can reach;
        on a cluster a path on this machine only is refused before anything is written."""
        return _Writer(self)

    @classmethod
    def read(cls) -> MLReader:
        return _Reader(cls)


# -- the estimator --------------------------------------------------------------------------------
class SparkNetEstimator(Estimator, _EstimatorParams, _Persisted, DefaultParamsReadable, DefaultParamsWritable):
    """Trains a sparknet net on a DataFrame with :class:`~sparknet.spark.SparkTrainer`.

    Parameters
    ----------
    net : NetParams or torch.nn.Module, optional
        The network: a NetParams (kept as its ``to_dict()``, a Param), or any plain ``torch.nn.Module`` whose
        ``forward(x)`` returns predictions (kept as :attr:`module`; each fit trains a copy of it, as Horovod's
        ``TorchEstimator`` does). Default: the zoo model named by ``model``, sized to the data (input shape from
        the features, classes from the labels).
    loss : callable, optional
        A plain module's ``loss(prediction, y)`` (default: cross entropy; a regression loss such as
        ``torch.nn.MSELoss()`` makes the model a regressor). A NetParams net carries its own loss layers.
    callbacks : callable or sequence of callables, optional
        Each is called with every round record of ``fit`` (the records ``metricsOut`` writes and the
        model's ``history`` keeps: ``round``, ``loss``, ``val_accuracy``, ``samples``, ``wall_s``...), as
        the round ends (from a Spark Connect session: when the fit's stage ends). A callback that raises
        is logged and training goes on. Not saved with the estimator.
    **params
        Any Param by its camelCase name (``featuresCol``, ``imageShape``, ``validationIndicatorCol`` — rows
        where it is true are held out and evaluated on, not trained on — ...) or a training setting by its
        :class:`~sparknet.config.RunConfig` or :class:`~sparknet.config.DistributedConfig` field name in
        camelCase or snake_case (``batchSize``, ``tau``...). ``explainParams()`` lists them with their docs.

    Raises
    ------
    ValueError
        An unknown parameter or a bad value (unknown engine or strategy, ``tau=0``), at once;
        settings that clash with each other, when ``fit`` starts and before any training.

    Notes
    -----
    An estimator of a plain module is not saved (``write``, a Pipeline's ``save``): its Params are JSON and the module
    would be a pickle. Its fitted :class:`SparkNetModel` is, and loads with ``allow_pickle=True``.
    """

    def __init__(self, net=None, *, loss=None, callbacks=None, **params: Any) -> None:
        import torch

        super().__init__()
        self.module = net if isinstance(net, torch.nn.Module) else None
        """The plain ``torch.nn.Module`` this estimator trains a copy of (``None``: a NetParams net or the zoo's)."""
        if loss is not None and (self.module is None or not callable(loss)):
            raise ValueError("loss= is a plain torch.nn.Module's loss, a callable loss(prediction, y); a NetParams "
                             "net carries its own loss layers")
        self.loss = loss
        if net is not None and self.module is None:
            params["net"] = net
        self.callbacks = [] if callbacks is None else [callbacks] if callable(callbacks) else list(callbacks)
        if not all(callable(c) for c in self.callbacks):
            raise ValueError("callbacks must be callables taking a round record (a dict), or a list of them")
        _set_params(self, params)

    def setParams(self, **params: Any) -> SparkNetEstimator:
        """Set several params at once (camelCase or snake_case names)."""
        _set_params(self, params)
        return self

    def write(self) -> MLWriter:
        """Spark ML writer of the params (refused for a plain module: see the class's notes)."""
        if self.module is not None:
            raise ValueError("an estimator of a plain torch.nn.Module is not saved: its Params are JSON and the module "
                             "would be a pickle; save the fitted SparkNetModel (SparkNetModel.load(path, "
                             "allow_pickle=True) reads it), or give the net as NetParams")
        return super().write()

    def getNet(self):
        """The NetParams, or None when a plain module (:attr:`module`) or the zoo model named by ``model`` is used."""
        if not self.isDefined(self.net) or self.getOrDefault(self.net) is None:
            return None
        return NetParams.from_dict(self.getOrDefault(self.net))

    # -- configuration --------------------------------------------------------------------------
    def _config_kwargs(self, cls) -> dict[str, Any]:
        out = {}
        for pname, (owner, fname, optional) in _PARAM_ORIGIN.items():
            if owner is not cls or not self.isDefined(getattr(self, pname)):
                continue
            value = self.getOrDefault(getattr(self, pname))
            if value is None and not optional:
                raise ValueError(f"param {pname!r} cannot be None")
            out[fname] = value
        return out

    def configs(self, default_workers: int | None = None) -> tuple[RunConfig, DistributedConfig]:
        """The :class:`RunConfig` and :class:`DistributedConfig` these params describe (validated).

        Parameters
        ----------
        default_workers : int, optional
            Task slots when ``workers`` is unset (``fit`` passes the session's default parallelism): one worker
            per ``procsPerWorker`` of them.
        """
        return (RunConfig(**self._config_kwargs(RunConfig)),
                DistributedConfig(**{"workers": max(1, (default_workers or 1) // self.getOrDefault("procsPerWorker")),
                                     **self._config_kwargs(DistributedConfig)}))

    def engineOptions(self) -> EngineOptions:
        """The :class:`~sparknet.spark.EngineOptions` these params describe."""
        return EngineOptions(**self._config_kwargs(EngineOptions))

    def _zoo_net(self, dataset, run: RunConfig, shape, kind: str):
        """The zoo model named by ``model``, sized to the data where its function takes sizes."""
        from pyspark.sql import functions as F

        from pyspark.sql.types import ArrayType

        key = run.model  # a zoo name: RunConfig checks it
        takes = inspect.signature(zoo.MODELS[key]).parameters
        kwargs: dict[str, Any] = {}
        if "batch_size" in takes:
            kwargs["batch_size"] = run.batch_size
        task = parse_task(self.getTask()) if self.isDefined(self.task) and self.getTask() else None
        numbers = task is not None and task.float_labels  # the last layer as wide as a label, the task's loss
        if numbers:
            if "task" not in takes:
                raise ValueError(f"the zoo model {key!r} is a classifier; task {task.value!r} takes model 'mlp'")
            kwargs["task"] = task.value
        need_shape = "input_shape" in takes and shape is None
        if need_shape and kind == "binary":
            raise ValueError("binary features need imageShape to size the model")
        if need_shape or "num_classes" in takes:
            _, feats = _features_of(dataset, self._feature_columns())
            labels = self._label_columns()
            label = F.col(labels[0])
            if numbers:  # how many numbers a row's label holds
                top = F.max(F.size(label)) if len(labels) == 1 and isinstance(dataset.schema[labels[0]].dataType,
                                                                              ArrayType) else F.max(F.lit(len(labels)))
            elif len(labels) > 1:
                raise ValueError("labelCols are the numbers of task 'regression' or the 0s and 1s of task "
                                 "'multilabel'; class ids are one column (labelCol)")
            else:
                top = F.max(label)
            sizes = dataset.agg(top.alias("top"), F.max(F.size(feats)).alias("width"))
            row = _bounded(dataset.sparkSession, "sparknet: size the model to the training data", sizes.first,
                           "sizing the model to the training data (the largest label and feature width)")
            if row is None or row["top"] is None:
                raise ValueError("the training DataFrame is empty")
            if "num_classes" in takes:
                kwargs["num_classes"] = int(row["top"]) + (not numbers)
            if need_shape:
                kwargs["input_shape"] = [int(row["width"])]
        if shape is not None and "input_shape" in takes:
            kwargs["input_shape"] = list(shape)
        log.info("using zoo model %s(%s)", key, kwargs)
        return zoo.get_model(key, **kwargs)

    def _feature_columns(self) -> str | list[str]:
        """What the net trains on: ``featuresCols`` where set, else ``featuresCol``."""
        return self._named_columns() or self.getFeaturesCol()

    def _label_columns(self) -> list[str]:
        """The columns the net learns: ``labelCols`` where set, else ``labelCol``."""
        if not (self.isDefined(self.labelCols) and self.getLabelCols()):
            return [self.getLabelCol()]
        if self.isSet(self.labelCol):
            raise ValueError("set labelCol (one column) or labelCols (several columns), not both")
        return self.getLabelCols()

    # -- fit --------------------------------------------------------------------------------------
    def _fit(self, dataset) -> SparkNetModel:
        from pyspark.sql import functions as F

        from sparknet.spark.data import held_out, spark_feature_column

        spark = dataset.sparkSession
        run, dist = self.configs(default_workers=session_parallelism(spark))
        columns, labels = self._feature_columns(), self._label_columns()
        names = [columns] if isinstance(columns, str) else columns
        label_col = labels[0] if len(labels) == 1 else labels
        weight_col = self.getWeightCol() if self.isDefined(self.weightCol) and self.getWeightCol() else None
        kind, _ = _features_of(dataset, columns)
        for what, col in (*(("label", c) for c in labels), ("weight", weight_col)):
            if col is not None and col not in dataset.schema.fieldNames():
                raise ValueError(f"{what} column {col!r} not found; the DataFrame has {dataset.schema.fieldNames()}")
        named = [*names, *labels, *([weight_col] if weight_col else [])]
        if len(set(named)) != len(named):
            raise ValueError(f"the features {columns}, the labels {labels} and the weight {weight_col!r} name a "
                             "column twice; each column is a feature, a label or the weight")
        train, validation = dataset, None
        fraction = self.getOrDefault(self.validationFraction) if self.isDefined(self.validationFraction) else None
        held = None
        if self.isDefined(self.validationIndicatorCol) and self.getValidationIndicatorCol():
            ind = self.getValidationIndicatorCol()
            if ind not in dataset.schema.fieldNames():
                raise ValueError(f"validation indicator column {ind!r} not found")
            if fraction:
                raise ValueError("set validationIndicatorCol (the rows it marks) or validationFraction (a share of "
                                 "the rows), not both")
            held = F.coalesce(F.col(ind).cast("boolean"), F.lit(False))
        elif fraction:  # a seeded share, by a hash of what each row holds
            held = held_out(run.seed, [*names, *labels], fraction)
        if held is not None:
            train, validation = dataset.filter(~held), dataset.filter(held)
        for param in ("targetAccuracy", "targetLoss", "patience"):
            if getattr(dist, _PARAM_ORIGIN[param][1]) is not None and validation is None:
                raise ValueError(f"{param} needs validation rows: set validationIndicatorCol or validationFraction")
        image_shape = self.getImageShape() if self.isDefined(self.imageShape) else None
        net_params = self.getNet()
        if net_params is None and self.module is None:
            net_params = self._zoo_net(train, run, image_shape, kind)
        shape = tuple(image_shape) if image_shape is not None else model_io.input_shape_of(net_params)
        if kind == "binary" and image_shape is None:
            if shape is None:
                raise ValueError("binary features need imageShape")
            image_shape = list(shape)

        solver = run.solver()
        task = self.getTask() if self.isDefined(self.task) else None
        config = {"run": _plain(run), "dist": _plain(dist)}
        sinks = make_sinks(mlflow_uri=run.mlflow, run_name=f"{run.model}-estimator", params=config)
        if sinks and self.module is not None:
            log.warning("MLflow gets this fit's params and metrics, not its model: a plain module's model would be "
                        "a pickle (SparkNetModel.save keeps it)")
        failed = True
        try:
            with MetricsLogger(run.metrics_out, progress=not run.quiet, total=rounds_total(run.steps, dist),
                               sinks=[*sinks, *map(_rounds_only, getattr(self, "callbacks", ()))],
                               early_stop=dist.toward_target) as metrics:
                # a plain module: this fit's own copy (a CrossValidator fits one estimator many times)
                net = net_params if self.module is None else _copy_module(self.module)
                trainer = SparkTrainer.from_config(net, run, dist, spark=spark, task=task, loss=self.loss,
                                                   on_round=round_reporter(metrics), options=self.engineOptions())
                result = trainer.fit(train, validation, features_col=columns,
                                     label_col=label_col, weight_col=weight_col, image_shape=image_shape)
                summary = _plain(result.summary)
                metrics.write({"event": "summary", **summary})
            features = [] if kind == "binary" else [spark_feature_column(c, dataset.schema[c].dataType)
                                                    for c in names]  # MLflow's input, and what transform joins
            shape = shape or tuple(result.summary["sample_shape"])  # a plain module's: the data's
            files = model_io.pack_model(result.net.module if net_params is None else net_params, result.weights,
                                        solver=solver, config=config, input_shape=shape,
                                        metadata={"summary": summary, "features": features, "labels": labels,
                                                  "task": trainer.task.value})
            failed = False
        finally:  # the MLflow model is made from the model's folder
            close_sinks(sinks, failed=failed, write_model=None if self.module is not None else
                        lambda path: model_io.write_model_files(path, files))
        model = SparkNetModel._from_files(files, allow_pickle=self.module is not None)  # made here: trusted
        self._copyValues(model)
        if shape is not None and not model.isSet(model.imageShape):
            model._set(imageShape=list(shape))
        model._set(task=trainer.task.value)
        model.history = list(result.history)
        model.summary = summary
        return model


def _bounded(spark, description: str, action, what: str):
    """One Spark action of the Estimator's own (not the fit's), waited for at most the engines' data deadline."""
    import uuid

    sc = spark if is_connect(spark) else spark.sparkContext
    return run_with_deadline(sc, f"sparknet-ml-{uuid.uuid4().hex[:12]}", description, action,
                             timeout_s=EngineOptions.data_timeout_s, what=what)


def _rounds_only(callback):
    """A user's callback, given the round records alone (the fit's summary goes to metricsOut and MLflow)."""

    def call(record: dict) -> None:
        if record.get("event") == "round":
            callback(record)

    call.__qualname__ = f"rounds_only({getattr(callback, '__qualname__', callback)!s})"
    return call


def _plain(obj):
    """JSON-able copy (enums to values, dataclasses to dicts); non-JSON leaves become strings."""
    def leaf(value):
        is_instance = dataclasses.is_dataclass(value) and not isinstance(value, type)
        return json_safe(dataclasses.asdict(value)) if is_instance else str(value)

    return json.loads(json.dumps(json_safe(obj), default=leaf))


# -- the model ------------------------------------------------------------------------------------
class SparkNetModel(Model, _ScoringParams, _Persisted):
    """A trained net that scores a DataFrame: adds ``prediction``, ``probability`` and ``rawPrediction``.

    ``prediction`` is the arg-max class as a double, ``probability`` an ML ``DenseVector`` of
    the softmax of the logits, ``rawPrediction`` the logits (what Spark's
    ``BinaryClassificationEvaluator`` reads). A regressor (``task`` regression) adds only
    ``prediction``, its output. Set ``predictionCol``, ``probabilityCol`` or ``rawPredictionCol``
    to ``""`` to leave that column out. Made by :meth:`SparkNetEstimator.fit`, by :meth:`from_net` (any trained
    :class:`~sparknet.net.Net` or module), by :meth:`fromModelFolder`, or by ``load``.

    Attributes
    ----------
    history : list
        Per-round records of the training run (not saved).
    summary : object
        The trainer's summary (kept in the saved manifest's metadata as JSON).
    """

    def __init__(self, **params: Any) -> None:
        super().__init__()
        self._files: dict[str, bytes] | None = None
        self._model_id: str | None = None
        self._allow_pickle = False
        self._saved: model_io.SavedModel | None = None
        self._bc = None
        self._bc_owner = None
        self.history: list = []
        self.summary = None
        _set_params(self, params)

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def _from_files(cls, files: Mapping[str, bytes], *, allow_pickle: bool) -> SparkNetModel:
        saved = model_io.unpack_model(files, allow_pickle=allow_pickle)  # checks the files now, on the driver
        model = cls()
        model._files = dict(files)
        model._model_id = model_io.model_id(files)
        model._allow_pickle = allow_pickle
        model._saved = saved
        if saved.input_shape is not None:
            model._set(imageShape=list(saved.input_shape))
        meta = saved.manifest.get("metadata") or {}
        model.summary = meta.get("summary")
        return model

    @classmethod
    def from_net(cls, net, weights=None, *, input_shape: Sequence[int] | None = None, **params: Any) -> SparkNetModel:
        """A model from a trained :class:`~sparknet.net.Net`, NetParams plus weights, or module.

        A plain ``torch.nn.Module`` travels to the executors pickled inside the model files;
        this process made them, so they are trusted here. Saved and loaded again, such a model
        needs ``SparkNetModel.load(path, allow_pickle=True)``.
        """
        files = model_io.pack_model(net, weights, input_shape=input_shape)
        model = cls._from_files(files, allow_pickle=True)
        _set_params(model, params)
        return model

    @classmethod
    def fromModelFolder(cls, path: str, *, allow_pickle: bool = False, **params: Any) -> SparkNetModel:
        """A model from a sparknet model folder (:func:`sparknet.model_io.save_model`): a local path
        or a URI (``s3://``...) this process can read; the executors get the files by broadcast."""
        model = cls._from_files(model_io.read_model_files(path), allow_pickle=allow_pickle)
        _set_params(model, params)
        return model

    def saveModelFolder(self, path: str, *, overwrite: bool = False) -> str:
        """Write the model as a plain sparknet model folder (a local path or a URI, written by this
        process), as ``sparknet predict`` reads."""
        return str(model_io.write_model_files(path, self._require_files(), overwrite=overwrite))

    def _require_files(self) -> dict[str, bytes]:
        if self._files is None:
            raise ValueError("this SparkNetModel holds no trained net; make it with SparkNetEstimator.fit, "
                             "SparkNetModel.from_net or SparkNetModel.load")
        return self._files

    # -- the trained net --------------------------------------------------------------------------
    @property
    def modelId(self) -> str:
        """A content hash of the net and its weights (the executors' cache key)."""
        self._require_files()
        return self._model_id

    @property
    def net(self):
        """The trained :class:`~sparknet.net.Net` on the driver."""
        return self._loaded().net

    @property
    def weights(self):
        """The trained weights (a :class:`~sparknet.weights.WeightCollection`)."""
        return self._loaded().weights

    @property
    def config(self) -> dict | None:
        """The run configuration the model folder holds (``sparknet train``'s settings), or ``None``."""
        return self._loaded().config

    @property
    def trainedColumns(self) -> list[str] | None:
        """The feature columns of the table the model trained on, in order, as its folder says (``None`` where it
        does not: a model made by hand)."""
        columns = model_io.input_columns(self._loaded())
        return None if columns is None else [c["name"] for c in columns]

    def _loaded(self) -> model_io.SavedModel:
        if self._saved is None:
            self._saved = model_io.unpack_model(self._require_files(), allow_pickle=self._allow_pickle)
        return self._saved

    # -- scoring ----------------------------------------------------------------------------------
    def resolvedTask(self) -> Task:
        """The ``task`` Param when set, else the task the model was fit for (an estimator's model folder says it: a
        plain module's files hold no loss), else what the net's loss says."""
        if self.isDefined(self.task) and self.getTask():
            return parse_task(self.getTask())
        fit_for = (self._loaded().manifest.get("metadata") or {}).get("task")
        return parse_task(fit_for) if fit_for else self.net.task

    def _outputs(self, shape) -> int:
        """Output values per row (a probe on the driver)."""
        return int(self._probe(shape).numel())

    def _probe(self, shape):
        """The net's output for one row of zeros of ``shape`` (default: the model's own sample shape)."""
        import torch

        shape = tuple(shape) if shape else self._loaded().input_shape
        if shape is None:
            raise ValueError("set imageShape: the model does not know the shape of one sample")
        with torch.no_grad():  # reshaped to the net's own input, as the model's predict does
            return self._loaded().predict(torch.zeros(1, *shape))

    def evaluate(self, dataset, labelCol: str | Sequence[str] | None = None, *, weightCol: str | None = None,
                 timeout_s: float | None = 24 * 3600.0) -> dict:
        """The model's loss and its task's metrics on the labelled rows of ``dataset``, scored where they live: each
        partition's task adds up what the metrics are made of, and the driver joins the sums (the metrics a fit
        reports as ``test_*``: accuracy, and top-5 accuracy past five classes; R², RMSE and MAE; a multi-label net's
        accuracy, F1 and AUC).

        Parameters
        ----------
        dataset : DataFrame
            The features as :meth:`transform` reads them, and the labels.
        labelCol : str or list of str, optional
            The label column, or several number columns joined in order (default: what the model's folder says it
            trained on, else ``label``).
        weightCol : str, optional
            A column of sample weights (numbers >= 0): the loss and every metric weigh each row by it, a row of
            weight w counting as w rows (the weighted metrics of Spark's evaluators with their ``weightCol``).
            Default: each row counts once.
        timeout_s : float or None
            Longest wait for the job (default a day); past it the job is cancelled.

        Returns
        -------
        dict
            ``rows`` scored (and their total ``weight`` with ``weightCol``), ``loss`` (the net's loss layers';
            ``None`` for a plain module, whose loss its files do not hold) and each metric by name. Rows a fit would
            refuse (null or NaN labels or weights, class ids the net does not have...) are a ``ValueError`` that says
            how many and why.
        """
        import uuid

        from sparknet.labels import Task
        from sparknet.net import EvalResult
        from sparknet.spark import data as spark_data
        from sparknet.spark.scoring import evaluation_sums

        self._require_files()
        task = self.resolvedTask()
        if task is Task.UNLABELLED:
            raise ValueError("a net trained without labels has no metrics to evaluate; its loss is its score")
        trained = self._loaded().manifest.get("metadata") or {}  # the estimator's labels, or sparknet train's flag
        labels = labelCol or trained.get("labels") or ((self.config or {}).get("run") or {}).get("label_col") or "label"
        labels = list(column_names(labels)) if isinstance(labels, str) else list(labels)
        kind, feats = self._scored_input(dataset)
        shape = self.getImageShape() if self.isDefined(self.imageShape) else self._loaded().input_shape
        if shape is None:
            raise ValueError("set imageShape: the model does not know the shape of one sample")
        classes = int(self._probe(shape).shape[-1]) if task is Task.CLASSIFICATION else None
        label = spark_data._label_expr(dataset, labels[0] if len(labels) == 1 else labels)
        session = dataset.sparkSession
        bc = Held(self._require_files()) if is_connect(session) else self._broadcast(session.sparkContext)
        threads = self.getThreads() if self.isDefined(self.threads) and self.getThreads() else 1
        sums = functools.partial(evaluation_sums, key=self.modelId, files_bc=bc, kind=kind, shape=list(shape),
                                 threads=int(threads), chunk=int(self.getScoreBatchSize()), device=self.getDevice(),
                                 allow_pickle=self._allow_pickle, task=task.value, label_col=", ".join(labels),
                                 num_classes=classes, weighted=weightCol is not None)
        weight = [] if weightCol is None else [spark_data.weight_expr(dataset, weightCol).alias("weight")]
        frame = dataset.select(feats.alias("features"), label.alias("label"), *weight).mapInArrow(
            sums, "info string, result string")
        rows = run_with_deadline(session if is_connect(session) else session.sparkContext,
                                 f"sparknet-evaluate-{uuid.uuid4().hex[:12]}", "sparknet: evaluate the model",
                                 frame.collect, timeout_s=timeout_s, what="the evaluation job")
        stats = [json.loads(r["info"]) for r in rows]
        if not sum(stat["rows"] for stat in stats):
            raise ValueError("the data evaluated on holds no rows")
        spark_data.check_stats(stats, what="the data evaluated on",
                               expected_len=None if kind in ("binary", "image") else int(math.prod(shape)),
                               num_classes=classes, sample_shape=tuple(shape), task=task)
        parts = [json.loads(r["result"]) for r in rows]
        result = functools.reduce(EvalResult.joined, [EvalResult.of(task, p["samples"], p["loss_sum"], p["sums"],
                                                                    p["weight"]) for p in parts if p["samples"]])
        loss = None if math.isnan(result.loss) else result.loss
        weight = {} if result.weight is None else {"weight": result.weight}
        return {"rows": result.samples, **weight, "loss": loss, **result.metrics}

    def _broadcast(self, sc):
        """One broadcast of the model files per SparkContext (kept while this model lives)."""
        owner = id(sc._jsc) if sc._jsc is not None else None
        if self._bc is None or self._bc_owner != owner:
            self._bc = sc.broadcast(self._require_files())
            self._bc_owner = owner
        return self._bc

    def unpersist(self) -> None:
        """Drop the broadcast weights from the executors (a later transform broadcasts again)."""
        bc, self._bc, self._bc_owner = self._bc, None, None
        if bc is not None:
            try:
                bc.unpersist()
            except Exception as e:  # noqa: BLE001 - a stopped context has nothing left to drop
                log.debug("could not unpersist the model broadcast: %s", e)

    def _transform(self, dataset):
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql import functions as F
        from pyspark.sql.functions import pandas_udf
        from pyspark.sql.types import ArrayType, DoubleType, StructField, StructType

        self._require_files()
        kind, feats = self._scored_input(dataset)
        shape = self.getImageShape() if self.isDefined(self.imageShape) else None
        if kind == "binary" and shape is None:
            raise ValueError("binary features need imageShape")
        task = self.resolvedTask()
        regression = task is Task.REGRESSION
        pred_col, prob_col = self.getPredictionCol(), "" if regression else self.getProbabilityCol()
        raw_col = "" if regression else self.getRawPredictionCol()
        for col in (pred_col, prob_col, raw_col):
            if col and col in dataset.schema.fieldNames():
                raise ValueError(f"output column {col!r} already exists in the DataFrame")
        if not pred_col and not prob_col and not raw_col:
            log.warning("predictionCol, probabilityCol and rawPredictionCol are empty: transform() adds nothing")
            return dataset

        session = dataset.sparkSession
        # a Spark Connect session has no broadcasts: the model's files travel in the plan (a Python worker builds
        # the model once all the same, by its content hash)
        bc = Held(self._require_files()) if is_connect(session) else self._broadcast(session.sparkContext)
        threads = self.getThreads() if self.isDefined(self.threads) and self.getThreads() else 1
        score = functools.partial(score_batches, key=self.modelId, files_bc=bc, kind=kind,
                                  shape=list(shape) if shape else None, threads=int(threads),
                                  chunk=int(self.getScoreBatchSize()), device=self.getDevice(),
                                  allow_pickle=self._allow_pickle, task=task.value)

        import pandas as pd

        def score_udf(batches):
            return score(batches)

        # Real types, not the strings this module's ``annotations`` future would give: Spark
        # reads the hints to pick the iterator-of-Series UDF kind.
        score_udf.__annotations__ = {"batches": Iterator[pd.Series], "return": Iterator[pd.DataFrame]}

        one_output = regression and self._outputs(shape) == 1
        scalar = one_output or task is Task.CLASSIFICATION  # a multi-label prediction: the labels' indices
        out_type = StructType([StructField("prediction", DoubleType() if scalar else ArrayType(DoubleType()))]
                              + ([] if regression else [StructField("probability", ArrayType(DoubleType())),
                                                        StructField("raw", ArrayType(DoubleType()))]))
        udf = pandas_udf(score_udf, out_type)
        tmp = f"__sparknet_{self._model_id[:8]}"
        scored = dataset.withColumn(tmp, udf(feats))
        cols = [F.col(c) for c in dataset.columns]
        if pred_col:
            pred = F.col(f"{tmp}.prediction")
            cols.append((array_to_vector(pred) if regression and not one_output else pred).alias(pred_col))
        cols += [array_to_vector(F.col(f"{tmp}.{name}")).alias(col)
                 for col, name in ((prob_col, "probability"), (raw_col, "raw")) if col]
        return scored.select(*cols)

    def _scored_input(self, dataset):
        """The kind and Column of what :meth:`transform` scores: ``featuresCols`` where set, joined in order;
        ``featuresCol`` where it is set or the data has it; else the columns the model trained on
        (:attr:`trainedColumns`) where the data has them all, joined in order where they are several."""
        columns = self._named_columns()
        if columns is None:
            col = self.getFeaturesCol()
            trained = None if self.isSet(self.featuresCol) or col in dataset.columns else self.trainedColumns
            columns = trained if trained and set(trained) <= set(dataset.columns) else col
        return _features_of(dataset, columns)

    # -- persistence ------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str, allow_pickle: bool = False) -> SparkNetModel:
        """Load a model saved with ``save`` from a path or URI every host can reach; ``allow_pickle``
        is needed (and only safe for trusted files) when the model holds a pickled plain torch module."""
        return _Reader(cls, allow_pickle=allow_pickle).load(path)


class _Writer(DefaultParamsWriter):
    """Refuses a path the executors cannot write before writing (they write part of the folder); a model's files go
    to its ``data`` table."""

    def save(self, path: str) -> None:
        check_shared_path(self.sparkSession, path, what="the save path", write=True)
        super().save(path)

    def saveImpl(self, path: str) -> None:
        if not isinstance(self.instance, SparkNetModel):
            return super().saveImpl(path)
        files = self.instance._require_files()
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession,
                                         extraMetadata={"sparknetModelId": self.instance.modelId,
                                                        "sparknetFormatVersion": model_io.FORMAT_VERSION})
        rows = [(name, bytearray(data)) for name, data in sorted(files.items())]
        (self.sparkSession.createDataFrame(rows, "name string, content binary").coalesce(1)
         .write.parquet(os.path.join(path, "data")))


class _Reader(DefaultParamsReader):
    """Refuses a path the executors cannot read first; a model's files are read from its ``data`` table."""

    def __init__(self, cls, allow_pickle: bool = False):
        super().__init__(cls)
        self.allow_pickle = allow_pickle

    def load(self, path: str):
        estimator = not issubclass(self.cls, SparkNetModel)
        check_shared_path(self.sparkSession, path, what="the saved estimator" if estimator else "the saved model")
        if estimator:
            return super().load(path)
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        cls_name = f"{self.cls.__module__}.{self.cls.__name__}"
        if metadata.get("class") != cls_name:
            raise ValueError(f"{path} holds a {metadata.get('class')}, not a {cls_name}")
        frame = self.sparkSession.read.parquet(os.path.join(path, "data"))
        rows = _bounded(self.sparkSession, f"sparknet: read the model at {path}", frame.collect,
                        f"reading the model's files at {path}")
        files = {row["name"]: bytes(row["content"]) for row in rows}
        model = self.cls._from_files(files, allow_pickle=self.allow_pickle)
        model._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(model, metadata)
        return model
