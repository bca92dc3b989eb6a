"""Metrics of a training run: a JSON-lines file and one live progress line on the driver.

Records are plain dicts with an ``"event"`` key:

- ``{"event": "eval", "step", "samples", "wall_s", "loss", "test_accuracy"}``
- ``{"event": "round", "round", "steps", "samples", "wall_s", "compute_s", "comm_s", "loss", "bytes", ...}``
- ``{"event": "summary", "test_accuracy", "wall_s", "samples", "samples_per_s", ...}`` (last)
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

__all__ = ["MetricsLogger", "in_notebook", "round_reporter", "rounds_total", "read_metrics", "json_safe",
           "rounds_summary", "LoadSampler", "process_age_s"]

log = logging.getLogger(__name__)


def json_safe(value, *, finite: bool = True):
    """JSON-safe values: NaN and infinity become None (unless not ``finite``), numpy and torch scalars become
    Python numbers (other arrays their text), enums their values, mappings dicts with string keys."""
    if isinstance(value, float):
        return value if not finite or math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v, finite=finite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, finite=finite) for v in value]
    if isinstance(value, enum.Enum) or hasattr(value, "value") and type(value).__module__.startswith("sparknet"):
        return value.value
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (str, bytes)):
        try:
            return json_safe(value.item(), finite=finite)
        except (TypeError, ValueError):  # an array of several elements
            return str(value)
    return value


class MetricsLogger(contextlib.AbstractContextManager):
    """Writes metric records to a JSON-lines file and drives the progress line.

    Parameters
    ----------
    path : str or Path, optional
        JSON-lines file (parent folders are created). ``None`` keeps records in memory only.
    progress : bool
        Show the run's progress: a live line rewritten in place on a terminal; a notebook's bar in a
        Jupyter kernel (``tqdm.auto``); one plain line per advance (a round, an evaluation interval) on
        standard error with the same fields, the time elapsed and an estimate of the time left when it
        goes to a file, a pipe or a log collector.
    total : int, optional
        Total units (steps) for the progress line.
    early_stop : bool
        The run may stop before ``total`` (at a target accuracy or loss): ``total`` is its limit, and the time left
        is shown as at most so much.
    sinks : iterable of callables, optional
        Extra receivers of every record (TensorBoard, MLflow...).
    """

    def __init__(self, path: str | os.PathLike | None = None, *, progress: bool = True, total: int | None = None,
                 unit: str = "step", sinks: Iterable[Callable[[dict], None]] = (), early_stop: bool = False):
        self.path = Path(path) if path else None
        self.records: list[dict] = []
        self._sinks = list(sinks)
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")
        self._bar = None
        notebook = in_notebook()
        self._plain = progress and not notebook and not sys.stderr.isatty()  # a log: plain lines, nothing redrawn
        self._total, self._unit, self._done, self._fields = total, unit, 0, {}
        self._left = "at most" if early_stop else "about"
        self._redirect = contextlib.ExitStack()
        if progress and not self._plain:
            from tqdm.contrib.logging import logging_redirect_tqdm

            if notebook:  # a notebook's own bar (a widget where ipywidgets is installed)
                from tqdm.auto import tqdm
            else:
                from tqdm import tqdm
            # tqdm's own format, but for the time left where the run may stop sooner
            form = ("{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, at most {remaining} left, {rate_fmt}{postfix}]"
                    if early_stop else None)
            self._bar = tqdm(total=total, unit=unit, dynamic_ncols=True, leave=True, file=sys.stderr, bar_format=form)
            # Log records print above the line instead of breaking it.
            self._redirect.enter_context(logging_redirect_tqdm(tqdm_class=tqdm))
        self._t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def write(self, record: dict) -> None:
        """Record one event (written and flushed at once)."""
        record = json_safe(record)
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        for sink in self._sinks:
            try:
                sink(record)
            except Exception:  # a broken sink must not stop training; it is reported once per record
                log.exception("metrics sink %r failed on a %s record", sink, record.get("event"))

    def progress(self, advance: int = 0, **fields) -> None:
        """Advance the progress line and show ``fields`` on it (in a log: a line for each advance)."""
        if self._plain:
            self._done += advance
            self._fields.update({k: v for k, v in fields.items() if v is not None})
            if advance:
                print(self._line(), file=sys.stderr, flush=True)
            return
        if self._bar is None:
            return
        if advance:
            self._bar.update(advance)
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in fields.items() if v is not None}
        self._bar.set_postfix(shown, refresh=True)

    def _line(self) -> str:
        done, total, elapsed = self._done, self._total, self.elapsed()
        head = f"{done:,}/{total:,} {self._unit}s ({100 * done / total:.0f}%)" if total else f"{done:,} {self._unit}s"
        shown = "".join(f" {k}={_number(v)}" for k, v in self._fields.items())
        left = f", {self._left} {_clock(elapsed / done * (total - done))} left" if total and 0 < done < total else ""
        return f"[sparknet] {head}{shown} | {_clock(elapsed)} elapsed{left}"

    def close(self) -> None:
        if self._bar is not None:
            self._redirect.close()
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __exit__(self, *exc) -> None:
        self.close()


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (IPython's ZMQ shell): a progress bar is then drawn in the notebook."""
    shell = sys.modules.get("IPython")
    if shell is None or "ipykernel" not in sys.modules:
        return False
    try:
        ip = shell.get_ipython()
    except Exception:  # noqa: BLE001 - an IPython without a running shell
        return False
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def rounds_total(steps: int | None, dist) -> int | None:
    """The steps a fit's progress line counts to: ``steps`` (the run's budget per worker), or fewer when
    ``dist.rounds`` of ``dist.tau`` steps end it sooner (automatic tau changes a round's steps: then ``steps``)."""
    if dist.rounds is None or dist.auto_tau:
        return steps
    bound = dist.rounds * (dist.tau or 1)
    return bound if steps is None else min(steps, bound)


def round_reporter(metrics: MetricsLogger) -> Callable[[dict], None]:
    """An ``on_round`` for a Spark fit: writes each round record to ``metrics`` (its file and sinks) and advances
    its progress line by the round's steps, showing the round, loss, validation accuracy (R-squared of a regression),
    tau and samples/s."""

    def on_round(record: dict) -> None:
        metrics.write(record)
        metrics.progress(record.get("steps", 0), round=record.get("round"), loss=record.get("loss"),
                         acc=record.get("val_accuracy"), r2=record.get("val_r2"), tau=record.get("tau"),
                         **{"samples/s": record["samples"] / record["round_s"] if record.get("round_s") else None})

    return on_round


def _number(value) -> str:
    """A field as a log line shows it: four significant digits, never an exponent above 1,000."""
    if not isinstance(value, float):
        return str(value)
    return f"{value:.0f}" if 1e4 <= abs(value) < 1e15 else f"{value:.4g}"


def _clock(seconds: float) -> str:
    """``42s``, ``3m05s`` or ``1h02m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Read a JSON-lines metrics file back into a list of records."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON record ({e.msg})") from None
    return out


def returned_scores(rounds: list[dict], averaged: bool) -> tuple[dict, float] | None:
    """``(metrics, loss)`` of the weights a fit returns on its validation data, as its last round's record has them:
    its ``val_`` fields, or its ``val_ema_`` ones where the fit returns the moving average (``averaged``), or, where
    the fit stopped early and returns its best weights, its ``best_scores``. A fit's last round is scored on the
    whole validation set (:func:`sparknet.loop.run_rounds`), as is every round early stopping judges, so they are
    what a test pass of those weights gives (its loss to rounding, where a screen's rows and the rest were scored
    apart). ``None`` where the record has no such fields (no validation data, or no round)."""
    last = rounds[-1] if rounds else {}
    if last.get("best_scores") is not None:
        best = dict(last["best_scores"])
        return best, best.pop("loss")
    prefix = "val_ema_" if averaged else "val_"
    if f"{prefix}loss" not in last:
        return None
    metrics = {k.removeprefix(prefix): v for k, v in last.items()
               if k.startswith(prefix) and k != f"{prefix}loss" and (averaged or not k.startswith("val_ema_"))}
    return metrics, last[f"{prefix}loss"]


def rounds_summary(rounds: list[dict], test: tuple[dict, float] | None, *, t_fit: float, t_train: float,
                   train_s: float) -> dict:
    """The summary fields every round-based fit reports, from its round records.

    ``test`` is the returned weights' ``(metrics, loss)`` on the validation data (:func:`returned_scores`) or
    ``None``; ``t_fit`` and ``t_train`` are ``time.perf_counter()`` at the fit's start and when training began.
    """
    samples = sum(h["samples"] for h in rounds)
    round_time = sum(h["round_s"] for h in rounds)
    last = rounds[-1] if rounds else {}
    # what the rounds' time went to: the slowest worker's steps (a round waits for it), the workers' mean steps
    computes = [[w["compute_s"] for w in h.get("per_worker") or () if w.get("compute_s") is not None] for h in rounds]
    computes = [c for c in computes if c]
    # each worker's steps over the whole fit: one far above the others is the same straggler every round (its core,
    # its host), all alike is a different one each round (the spread of the rounds themselves)
    by_worker: dict[int, float] = {}
    for h in rounds:
        for i, w in enumerate(h.get("per_worker") or ()):
            if w.get("compute_s") is not None:
                who = int(w.get("index", w.get("rank", i)))
                by_worker[who] = by_worker.get(who, 0.0) + w["compute_s"]
    return {
        "rounds": len(rounds), "total_steps": last.get("total_steps", 0), "samples": samples,
        "bytes_communicated": sum(h["bytes"] for h in rounds), "wall_s": time.perf_counter() - t_fit,
        "train_s": train_s, "setup_s": t_train - t_fit,
        # the evaluations between (or, overlapped, beside) the rounds, within train_s; the test scores are the last's
        "eval_s": sum(h.get("eval_s", 0.0) for h in rounds),
        "samples_per_s": samples / round_time if round_time > 0 else None,
        "rounds_s": round_time,
        **({"slowest_compute_s": sum(max(c) for c in computes),
            "mean_compute_s": sum(sum(c) / len(c) for c in computes),
            "compute_s_by_worker": [round(by_worker[w], 3) for w in sorted(by_worker)]} if computes else {}),
        "loss": last.get("loss"),
        "test_accuracy": test[0].get("accuracy") if test is not None else None,
        **({f"test_{k}": v for k, v in test[0].items()} if test is not None else {}),
        "test_loss": test[1] if test is not None else None,
        "stop_reason": last.get("stop_reason"),
    }


# -- what a figure was measured beside ----------------------------------------------------------------

def _load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):  # not on every platform
        return None


class LoadSampler:
    """The machine's load average before a measurement and every ``every_s`` seconds during it.

    A time is only worth what the machine was doing beside it: ``load_average_before`` is the
    (1, 5, 15)-minute triple when :meth:`start` is called, ``load_average_during`` the
    1-minute figure sampled every ``every_s`` seconds until :meth:`stop` (a context manager
    does both).
    """

    def __init__(self, every_s: float = 5.0):
        self.every_s = every_s
        self.before: list[float] | None = None
        self.during: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparknet-load-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            now = _load_average()
            if now is not None:
                self.during.append(now[0])

    def start(self) -> LoadSampler:
        self.before = _load_average()
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stop sampling; returns :meth:`to_dict`."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.every_s + 5)
        return self.to_dict()

    def to_dict(self) -> dict:
        return {"load_average_before": self.before, "load_average_during": list(self.during)}

    def __enter__(self) -> LoadSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def process_age_s() -> float | None:
    """Seconds since this process started, its interpreter's start and imports included.

    For a command (``sparknet train``, ``sparknet experiment``) this is what its user has
    waited so far. Read from ``/proc`` (10 ms resolution); ``None`` where there is none.
    """
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return round(uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"), 2)  # field 22: start time in ticks
    except (OSError, ValueError, IndexError):
        return None

