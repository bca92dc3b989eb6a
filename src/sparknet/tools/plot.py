"""Learning curves from a metrics file: ``sparknet plot METRICS.jsonl``.

One PNG with a 2×2 grid: loss (top) and accuracy (bottom), against wall time (left) and
against training samples (right). Round records (the Spark engines) give the training loss
and the validation accuracy, and each worker's own loss where the record carries
``per_worker``; eval records (one process) give the test loss and test accuracy.

Drawn with matplotlib's Agg renderer on a bare ``Figure`` (no pyplot, no display, no global
state), so it works on a headless driver and inside a running program.

Examples
--------
>>> plot_metrics("runs/lenet.jsonl", "runs/lenet.png")     # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sparknet.metrics import read_metrics

__all__ = ["Curves", "extract_curves", "plot_metrics"]

log = logging.getLogger(__name__)


@dataclass
class _Series:
    wall_s: list[float] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)
    value: list[float] = field(default_factory=list)

    def add(self, wall_s, samples, value) -> None:
        if value is None or wall_s is None or samples is None:
            return
        self.wall_s.append(float(wall_s))
        self.samples.append(float(samples))
        self.value.append(float(value))

    def __len__(self) -> int:
        return len(self.value)


@dataclass
class Curves:
    """The series a metrics file holds, each with wall-time and cumulative-sample coordinates."""

    loss: dict[str, _Series] = field(default_factory=dict)
    """``"train"`` (round records), ``"test"`` (eval records), ``"validation"`` (rounds with ``val_loss``)."""
    accuracy: dict[str, _Series] = field(default_factory=dict)
    """``"validation"`` (rounds) and ``"test"`` (eval records)."""
    worker_loss: dict[str, _Series] = field(default_factory=dict)
    """Training loss of each worker (``per_worker`` entries), keyed by the worker's rank or index."""

    @property
    def empty(self) -> bool:
        return not any(len(s) for t in (self.loss, self.accuracy, self.worker_loss) for s in t.values())


def extract_curves(records: Iterable[dict]) -> Curves:
    """Collect the plotted series from metric records (see :mod:`sparknet.metrics`).

    The samples axis is cumulative: a round record's ``total_samples`` where present, else
    the running sum of its ``samples``; an eval record's ``samples`` is already cumulative.
    A worker's loss is placed at its round's coordinates, so the workers' curves line up
    with the run's.
    """
    curves = Curves()
    round_samples = 0.0
    for rec in records:
        event = rec.get("event")
        wall = rec.get("wall_s")
        if event == "round":
            round_samples += float(rec.get("samples") or 0)
            samples = rec.get("total_samples", round_samples)
            curves.loss.setdefault("train", _Series()).add(wall, samples, rec.get("loss"))
            curves.loss.setdefault("validation", _Series()).add(wall, samples, rec.get("val_loss"))
            curves.accuracy.setdefault("validation", _Series()).add(wall, samples, rec.get("val_accuracy"))
            for i, w in enumerate(rec.get("per_worker") or ()):
                key = str(w.get("rank", w.get("index", i)))
                curves.worker_loss.setdefault(key, _Series()).add(wall, samples, w.get("loss"))
        elif event == "eval":
            samples = rec.get("samples")
            curves.loss.setdefault("test", _Series()).add(wall, samples, rec.get("loss"))
            curves.accuracy.setdefault("test", _Series()).add(wall, samples, rec.get("test_accuracy"))
    for table in (curves.loss, curves.accuracy, curves.worker_loss):
        for key in [k for k, s in table.items() if not len(s)]:
            del table[key]
    return curves


def plot_metrics(metrics: str | os.PathLike | Sequence[dict], out: str | os.PathLike | None = None, *,
                 title: str | None = None, dpi: int = 100) -> Path:
    """Draw the learning curves of a run to a PNG file; return the PNG written.

    Parameters
    ----------
    metrics : path or list of dict
        A JSON-lines metrics file (``--metrics-out``) or its records.
    out : path, optional
        The PNG to write (parent folders are created). Default: the metrics file with a
        ``.png`` suffix; required when ``metrics`` is a list of records.
    title : str, optional
        Figure title (default: the metrics file's name and the run's summary, when present).
    dpi : int
        Resolution; the figure is 12×8 inches.

    Raises
    ------
    ValueError
        When the records hold nothing to plot, or ``out`` is missing for a list of records.
    """
    try:
        from matplotlib.figure import Figure  # matplotlib loads only when a figure is drawn
    except ImportError as e:
        raise ImportError("sparknet plot needs matplotlib: pip install 'sparknet[plot]'") from e

    if isinstance(metrics, (str, os.PathLike)):
        source = Path(metrics)
        records = read_metrics(source)
        if out is None:
            out = source.with_suffix(".png")
        default_title = source.name
    else:
        records = list(metrics)
        if out is None:
            raise ValueError("give the PNG path to write (out=...) when plotting records")
        default_title = "sparknet run"
    curves = extract_curves(records)
    if curves.empty:
        raise ValueError("the metrics hold no round or eval records with a loss or an accuracy to plot")
    summary = next((r for r in reversed(records) if r.get("event") == "summary"), None)
    if title is None:
        title = default_title
        if summary:
            facts = [f"{k}={summary[k]}" for k in ("model", "engine", "workers") if summary.get(k) is not None]
            if summary.get("test_accuracy") is not None:
                facts.append(f"test accuracy {summary['test_accuracy']:.4f}")
            if facts:
                title += " — " + ", ".join(facts)

    fig = Figure(figsize=(12, 8), dpi=dpi, layout="constrained")
    axes = fig.subplots(2, 2, squeeze=False)
    styles = {"train": "-", "validation": "--", "test": "-o"}
    for col, (xattr, xlabel) in enumerate((("wall_s", "wall time (s)"), ("samples", "training samples"))):
        ax = axes[0][col]
        for key in sorted(curves.worker_loss, key=lambda k: (0, int(k)) if k.isdigit() else (1, k)):
            s = curves.worker_loss[key]
            ax.plot(getattr(s, xattr), s.value, lw=0.8, alpha=0.45, label=f"worker {key}")
        for key, s in curves.loss.items():
            ax.plot(getattr(s, xattr), s.value, styles.get(key, "-"), lw=1.8, ms=3, label=f"{key} loss")
        ax.set_ylabel("loss")
        ax = axes[1][col]
        for key, s in curves.accuracy.items():
            ax.plot(getattr(s, xattr), s.value, styles.get(key, "-"), lw=1.8, ms=3, label=f"{key} accuracy")
        ax.set_ylabel("accuracy")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel(xlabel)
            ax.grid(True, alpha=0.3)
            handles, _ = ax.get_legend_handles_labels()
            if handles:
                ax.legend(fontsize="small", ncols=2 if len(handles) > 6 else 1)
            else:
                ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.suptitle(title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    log.info("wrote learning curves to %s", out)
    return out


def configure_command(p: argparse.ArgumentParser) -> None:
    """The arguments of ``sparknet plot`` (``sparknet.cli`` lists the command)."""
    p.add_argument("metrics", help="JSON-lines metrics file written by 'sparknet train --metrics-out'")
    p.add_argument("--out", default=None, help="PNG to write (default: the metrics file with .png)")
    p.add_argument("--title", default=None, help="figure title")
    p.add_argument("--dpi", type=int, default=100, help="resolution (default 100)")
    p.set_defaults(_run=_run)


def _run(args: argparse.Namespace) -> int:
    if not Path(args.metrics).exists():
        raise FileNotFoundError(f"no metrics file at {args.metrics}")
    path = plot_metrics(args.metrics, args.out, title=args.title, dpi=args.dpi)
    print(path)
    return 0
