"""Metrics sinks: TensorBoard and MLflow, fed by :class:`sparknet.metrics.MetricsLogger`.

A sink is a callable that takes each metric record (see :mod:`sparknet.metrics`) and has a
``close()``. Both sinks here turn round and eval records into the same scalars, all against
the training step (a round record's ``total_steps``; an eval record's ``step``):

========================== ====================================================
``train/loss``             training loss of the round (sample-weighted over workers)
``validation/loss``        validation loss (rounds that evaluated)
``validation/accuracy``    validation accuracy (rounds that evaluated)
``test/loss``              test loss (eval records, one process)
``test/accuracy``          test accuracy (eval records)
``throughput/samples_per_s`` samples of the round over its wall time (eval: since the last eval)
``round/tau``              local steps of the round
``round/bytes``            bytes moved by the round
``round/compute_s``        slowest worker's compute time in the round
``round/comm_s``           the rest of the round's time (synchronization)
``worker/<k>/loss``        each worker's own training loss (``per_worker``)
``summary/<name>``         numbers of the final summary record (at the last step)
========================== ====================================================

Usage::

    sinks = make_sinks(tensorboard_dir="runs/tb", mlflow_uri="mlflow.db", params=config.to_dict(),
                       model_dir="out/model")
    try:
        with MetricsLogger("m.jsonl", sinks=sinks) as metrics:
            ...train, metrics.write(record)...
    finally:
        close_sinks(sinks)          # MLflow: logs the model as an MLflow model, ends the run it started

TensorBoard needs the ``tensorboard`` package (``pip install 'sparknet[tensorboard]'``); MLflow needs ``mlflow``
or ``mlflow-skinny``, and SQLAlchemy for its default SQLite store (``pip install 'sparknet[mlflow]'``). Each is
imported only when its sink is made.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["TensorBoardSink", "MLflowSink", "make_sinks", "close_sinks", "wants_model", "record_scalars",
           "resolve_tracking_uri", "DEFAULT_MLFLOW_DB"]

log = logging.getLogger(__name__)

DEFAULT_MLFLOW_DB = "mlflow.db"
"""The SQLite file of the MLflow tracking store used when no tracking URI is given (in the working directory):
a store current MLflow accepts as it is (its file store now needs an opt-in)."""

_ROUND_FIELDS = {"loss": "train/loss", "val_loss": "validation/loss", "val_accuracy": "validation/accuracy",
                 "tau": "round/tau", "bytes": "round/bytes", "compute_s": "round/compute_s", "comm_s": "round/comm_s"}
_EVAL_FIELDS = {"loss": "test/loss", "test_accuracy": "test/accuracy"}


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _finite(pairs: Iterable[tuple[str, Any]]) -> dict[str, float]:
    return {name: v for name, v in ((name, _number(value)) for name, value in pairs) if v is not None}


class _StepTracker:
    """Turns a stream of records into (step, scalars) pairs; keeps what throughput needs."""

    def __init__(self) -> None:
        self.step = 0
        self._last_eval: tuple[float, float] | None = None  # (wall_s, samples)

    def scalars(self, record: Mapping[str, Any]) -> tuple[int, dict[str, float]] | None:
        event = record.get("event")
        if event == "round":
            if record.get("total_steps") is not None:
                self.step = int(record["total_steps"])
            else:
                self.step += int(record.get("steps") or 0)
            out = _finite((name, record.get(key)) for key, name in _ROUND_FIELDS.items())
            seconds = _number(record.get("round_s"))
            if seconds is None:
                parts = [p for k in ("compute_s", "comm_s") if (p := _number(record.get(k))) is not None]
                seconds = sum(parts) if parts else None
            samples = _number(record.get("samples"))
            if seconds and samples is not None:
                out["throughput/samples_per_s"] = samples / seconds
            out.update(_finite((f"worker/{w.get('rank', w.get('index', i))}/loss", w.get("loss"))
                               for i, w in enumerate(record.get("per_worker") or ())))
            return self.step, out
        if event == "eval":
            if record.get("step") is not None:
                self.step = int(record["step"])
            out = _finite((name, record.get(key)) for key, name in _EVAL_FIELDS.items())
            wall, samples = _number(record.get("wall_s")), _number(record.get("samples"))
            if wall is not None and samples is not None:
                w0, s0 = self._last_eval or (0.0, 0.0)
                if wall > w0:
                    out["throughput/samples_per_s"] = (samples - s0) / (wall - w0)
                self._last_eval = (wall, samples)
            return self.step, out
        if event == "summary":
            out = _finite((f"summary/{key}", value) for key, value in record.items())
            if record.get("steps") is not None and _number(record["steps"]) is not None:
                self.step = max(self.step, int(record["steps"]))
            return self.step, out
        return None


def record_scalars(records: Iterable[Mapping[str, Any]]) -> list[tuple[int, dict[str, float]]]:
    """The ``(step, {name: value})`` pairs the sinks write for a sequence of records."""
    tracker = _StepTracker()
    return [item for item in (tracker.scalars(r) for r in records) if item is not None]


class _Sink(contextlib.AbstractContextManager):
    """What both sinks do with a record: refuse it once closed, turn it into scalars, hand them to ``_write``."""

    _closed = False

    def __call__(self, record: Mapping[str, Any]) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")
        item = self._tracker.scalars(record)
        if item is not None:
            self._write(*item, record)


# -- TensorBoard ----------------------------------------------------------------------------------
class TensorBoardSink(_Sink):
    """Writes each round's and evaluation's scalars to TensorBoard event files.

    Parameters
    ----------
    logdir : path
        The run's folder (``tensorboard --logdir`` its parent to compare runs).
    flush_secs : int
        Most seconds between writes to disk (every round record is also flushed at once).

    Notes
    -----
    Uses :class:`torch.utils.tensorboard.SummaryWriter`, which needs the ``tensorboard``
    package. The final summary record is also written as text (``summary``).
    """

    def __init__(self, logdir: str | os.PathLike, *, flush_secs: int = 10) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch raises ImportError naming tensorboard
            raise ImportError("the TensorBoard sink needs the tensorboard package: "
                              "pip install 'sparknet[tensorboard]'") from e
        self.logdir = Path(logdir)
        self._writer = SummaryWriter(log_dir=str(self.logdir), flush_secs=flush_secs)
        self._tracker = _StepTracker()
        log.info("TensorBoard events go to %s", self.logdir)

    def _write(self, step: int, scalars: dict[str, float], record: Mapping[str, Any]) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, global_step=step)
        if record.get("event") == "summary":
            self._writer.add_text("summary", "```\n" + json.dumps(dict(record), indent=1, default=str) + "\n```",
                                  global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        if not self._closed:
            self._closed = True
            self._writer.close()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TensorBoardSink({str(self.logdir)!r})"


# -- MLflow -----------------------------------------------------------------------------------------
def resolve_tracking_uri(tracking_uri: str | os.PathLike | None) -> str:
    """A tracking URI: ``None`` gives ``$MLFLOW_TRACKING_URI`` or the SQLite store ``./mlflow.db``; a plain path
    ending in ``.db`` or ``.sqlite`` gives a SQLite store there, any other plain path the file store there (as an
    absolute ``file:`` URI)."""
    if tracking_uri is None:
        tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_MLFLOW_DB
    uri = os.fspath(tracking_uri)
    if "://" in uri or uri.startswith(("file:", "databricks")):
        return uri  # a URI: sqlite:///..., http://..., file:///..., databricks
    path = Path(uri).expanduser().resolve()
    if path.suffix in (".db", ".sqlite"):
        return f"sqlite:///{path}"
    return path.as_uri()


@contextlib.contextmanager
def _file_store_allowed(uri: str) -> Iterator[None]:
    """MLflow 3 refuses its file store unless ``MLFLOW_ALLOW_FILE_STORE`` is true: opt in around sparknet's own
    MLflow calls only, unless the user set it."""
    if not uri.startswith("file:") or "MLFLOW_ALLOW_FILE_STORE" in os.environ:
        yield
        return
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            value = getattr(value, "value", value)  # enums
            out[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


class MLflowSink(_Sink):
    """Logs a training run to MLflow: its parameters, per-round metrics by step, the model as an MLflow model.

    Parameters
    ----------
    tracking_uri : str or path, optional
        Where runs go. Default: the run active in this process (``mlflow.start_run()`` in the user's
        notebook), which the sink joins; else ``$MLFLOW_TRACKING_URI``; else a SQLite store in
        ``./mlflow.db`` (no server needed; ``mlflow ui --backend-store-uri sqlite:///mlflow.db`` shows
        it). A plain path is a SQLite store when it ends in ``.db``, else a file store there.
    experiment : str
        Experiment name (made when missing).
    run_name : str, optional
        The run's name in the UI.
    params : mapping, optional
        The run configuration (nested mappings are flattened to ``run.lr``-style names),
        logged at once. More can follow with :meth:`log_params`.
    tags : mapping, optional
        Run tags.
    model_dir : path, optional
        A model folder logged at :meth:`close` (when it exists then) as the MLflow model ``model``
        (the pyfunc flavour with an input signature, :mod:`sparknet.mlflow_model`):
        ``mlflow.pyfunc.load_model(f"runs:/{run_id}/model").predict(pandas_df)`` scores with it, and
        ``mlflow.register_model`` registers it.
    nested : bool
        With a run active in this process: start a child run of it instead of joining it.

    Notes
    -----
    Uses :class:`mlflow.tracking.MlflowClient`: no global state of MLflow's is set, so it lives beside
    the user's own MLflow use. A joined run is the user's: the sink logs to it and leaves it open.
    Metrics are logged as each record arrives; the summary record's numbers under ``summary/``.
    """

    def __init__(self, tracking_uri: str | os.PathLike | None = None, *, experiment: str = "sparknet",
                 run_name: str | None = None, params: Mapping[str, Any] | None = None,
                 tags: Mapping[str, str] | None = None, model_dir: str | os.PathLike | None = None,
                 nested: bool = False) -> None:
        try:
            import mlflow
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ImportError("the MLflow sink needs mlflow (or mlflow-skinny): pip install 'sparknet[mlflow]'") from e
        active = mlflow.active_run()
        if active is not None and tracking_uri is not None and resolve_tracking_uri(tracking_uri) != \
                mlflow.get_tracking_uri():
            active = None  # the user names another store: a run of its own there
        self.tracking_uri = mlflow.get_tracking_uri() if active is not None else resolve_tracking_uri(tracking_uri)
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self._tracker = _StepTracker()
        self.owns_run = active is None or nested  # a joined run is left open at close
        with _file_store_allowed(self.tracking_uri):
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
            if active is not None and not nested:
                self.experiment_id, self.run_id = active.info.experiment_id, active.info.run_id
                self.client.set_tag(self.run_id, "sparknet", "true")
            else:
                if active is not None:
                    self.experiment_id = active.info.experiment_id
                    tags = {"mlflow.parentRunId": active.info.run_id, **dict(tags or {})}
                else:
                    found = self.client.get_experiment_by_name(experiment)
                    self.experiment_id = (found.experiment_id if found is not None
                                          else self.client.create_experiment(experiment))
                run = self.client.create_run(self.experiment_id, run_name=run_name,
                                             tags={"mlflow.source.name": "sparknet", **dict(tags or {})})
                self.run_id = run.info.run_id
        how = "joined the active" if not self.owns_run else "nested" if active is not None else "started"
        log.info("MLflow: %s run %s at %s", how, self.run_id, self.tracking_uri)
        if params:
            self.log_params(params)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log parameters (nested mappings flattened with dots; values as strings)."""
        from mlflow.entities import Param

        flat = [Param(k, v[:6000]) for k, v in _flatten(params).items()]
        with _file_store_allowed(self.tracking_uri):
            for start in range(0, len(flat), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=flat[start:start + 100])

    def _write(self, step: int, scalars: dict[str, float], record: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        if not scalars:
            return
        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, step) for name, value in scalars.items()]
        with _file_store_allowed(self.tracking_uri):
            self.client.log_batch(self.run_id, metrics=metrics)

    def log_model(self, model_dir: str | os.PathLike, artifact_path: str = "model") -> None:
        """Log a model folder as the run's MLflow model ``artifact_path`` (pyfunc, with a signature)."""
        from sparknet.mlflow_model import log_pyfunc_model

        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"no model folder at {model_dir}")
        with _file_store_allowed(self.tracking_uri):
            log_pyfunc_model(self.client, self.run_id, model_dir, artifact_path)
        log.info("logged %s to MLflow run %s as the model %r (runs:/%s/%s)", model_dir, self.run_id, artifact_path,
                 self.run_id, artifact_path)

    def close(self, status: str = "FINISHED") -> None:
        """Log the model folder (when given and present) and end the run (idempotent).

        Parameters
        ----------
        status : str
            ``FINISHED``, ``FAILED`` or ``KILLED``.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self.model_dir is not None and status == "FINISHED":
                if self.model_dir.is_dir():
                    self.log_model(self.model_dir)
                else:
                    log.warning("model folder %s does not exist; not logged to MLflow", self.model_dir)
        finally:
            if self.owns_run:
                with _file_store_allowed(self.tracking_uri):
                    self.client.set_terminated(self.run_id, status=status)

    def __exit__(self, exc_type, *exc) -> None:
        self.close("FINISHED" if exc_type is None else ("KILLED" if exc_type is KeyboardInterrupt else "FAILED"))

    def __repr__(self) -> str:
        return f"MLflowSink(run_id={self.run_id!r}, tracking_uri={self.tracking_uri!r})"


# -- wiring -----------------------------------------------------------------------------------------
def make_sinks(tensorboard_dir: str | os.PathLike | None = None, mlflow_uri: str | os.PathLike | None = None, *,
               experiment: str = "sparknet", run_name: str | None = None, params: Mapping[str, Any] | None = None,
               model_dir: str | os.PathLike | None = None) -> list[Callable[[dict], None]]:
    """The sinks a run asked for, ready for ``MetricsLogger(..., sinks=...)``: a :class:`TensorBoardSink` writing to
    ``tensorboard_dir``, an :class:`MLflowSink` tracking at ``mlflow_uri`` (``""``: its default, the active run or
    ``./mlflow.db``) with the other arguments. Close them with :func:`close_sinks` in a ``finally``."""
    sinks: list[Callable[[dict], None]] = []
    try:
        if tensorboard_dir is not None:
            sinks.append(TensorBoardSink(tensorboard_dir))
        if mlflow_uri is not None:
            sinks.append(MLflowSink(mlflow_uri or None, experiment=experiment, run_name=run_name, params=params,
                                    model_dir=model_dir))
    except BaseException:
        close_sinks(sinks, failed=True)
        raise
    return sinks


def _wants_model(sink) -> bool:
    """Whether ``sink`` would log the trained model but has no model folder of its own."""
    return isinstance(sink, MLflowSink) and sink.model_dir is None


def wants_model(sinks: Iterable[Any]) -> bool:
    """Whether a sink would log the trained model but has no model folder of its own (what
    :func:`close_sinks` writes for it)."""
    return any(map(_wants_model, sinks))


def close_sinks(sinks: Iterable[Any], *, failed: bool = False,
                write_model: Callable[[str], Any] | None = None) -> None:
    """Close every sink that has a ``close`` (each even when another fails; the first error is raised).

    ``write_model(path)`` writes the trained model as a folder at ``path`` (and returns it): when the run did not
    fail, an MLflow sink given no model folder of its own logs one written so, into a scratch folder removed
    once the sinks are closed."""
    sinks = list(sinks)
    wanting = [s for s in sinks if _wants_model(s)]
    scratch = None
    try:
        if wanting and not failed and write_model is not None:
            scratch = tempfile.mkdtemp(prefix="sparknet-model-")
            folder = Path(write_model(os.path.join(scratch, "model")))
            for sink in wanting:
                sink.model_dir = folder
    finally:
        try:
            _close_each(sinks, failed)
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)


def _close_each(sinks: list, failed: bool) -> None:
    first: BaseException | None = None
    for sink in sinks:
        close = getattr(sink, "close", None)
        if close is None:
            continue
        status = ("FAILED" if failed else "FINISHED",) if isinstance(sink, MLflowSink) else ()
        try:
            close(*status)
        except Exception as e:  # noqa: BLE001 - keep closing the others, report the first
            log.warning("closing %r failed: %s", sink, e)
            first = first or e
    if first is not None:
        raise first
