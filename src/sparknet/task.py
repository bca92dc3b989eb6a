"""What a net learns — class ids, numbers or a set of labels — and so how its labels are checked and
its weights scored.

The task follows from the loss: a regression loss (``torch.nn.MSELoss``, ``L1Loss``, ``HuberLoss``,
``SmoothL1Loss``, or a ``EuclideanLoss`` layer) learns numbers; ``BCEWithLogitsLoss`` or
``MultiLabelSoftMarginLoss`` a 0/1 for each output (multi-label, or binary with one output); anything
else class ids. Given explicitly it overrides that.

A task scores a net by sums that add up over batches, ranks and partitions, so a validation set
split across workers gives the same metrics as one pass over all of it:

- classification: accuracy (``correct / labels``), the score a target is set on;
- regression: R² (``1 - SSE / SST`` over every label value, the score), RMSE and MAE;
- unlabelled: the loss alone (no target can be set on it);
- multi-label: accuracy over every label value (the score; an output above 0 is a 1) and F1, the
  mean over the labels of each one's F1 (labels never true nor predicted left out).
"""

from __future__ import annotations

import enum
import math

import torch

__all__ = ["Task", "infer_task", "parse_task"]


class Task(str, enum.Enum):
    CLASSIFICATION = "classification"
    """Labels are class ids 0..C-1 (one per row, or one per position of a sequence)."""
    REGRESSION = "regression"
    """Labels are real numbers (one per row, or a vector per row)."""
    MULTILABEL = "multilabel"
    """Labels are a 0 or 1 for each output (a vector per row; one number for one output)."""
    UNLABELLED = "unlabelled"
    """No labels: the loss takes the input (an autoencoder); scored by its loss alone."""

    @property
    def float_labels(self) -> bool:
        """Whether the labels are float numbers (not int64 class ids)."""
        return self in (Task.REGRESSION, Task.MULTILABEL)


_REGRESSION_LOSSES = (torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.HuberLoss, torch.nn.SmoothL1Loss)
_REGRESSION_LAYERS = ("EuclideanLoss",)
_MULTILABEL_LOSSES = (torch.nn.BCEWithLogitsLoss, torch.nn.MultiLabelSoftMarginLoss)


def parse_task(value) -> Task | None:
    if value is None or isinstance(value, Task):
        return value
    try:
        return Task(str(value).lower())
    except ValueError:
        raise ValueError(f"task must be one of {[t.value for t in Task]}, got {value!r}") from None


def infer_task(loss=None, net_params=None, task=None) -> Task:
    """``task`` when given, else regression for a regression loss (function or layer), else classification."""
    given = parse_task(task)
    if given is not None:
        return given
    if isinstance(loss, _REGRESSION_LOSSES):
        return Task.REGRESSION
    if isinstance(loss, _MULTILABEL_LOSSES):
        return Task.MULTILABEL
    layers = getattr(net_params, "layers", None) or ()
    if any(type(layer).__name__ in _REGRESSION_LAYERS for layer in layers):
        return Task.REGRESSION
    return Task.CLASSIFICATION


def regression_sums(pred: torch.Tensor, y: torch.Tensor) -> list[float]:
    """``[SSE, SAE, Σy, Σy², values]`` of one batch (float64)."""
    p, t = pred.detach().reshape(-1).double(), y.detach().reshape(-1).double()
    if p.numel() != t.numel():
        raise ValueError(f"cannot compare predictions of shape {tuple(pred.shape)} with labels of shape "
                         f"{tuple(y.shape)}")
    err = p - t
    return [float((err * err).sum()), float(err.abs().sum()), float(t.sum()), float((t * t).sum()), float(t.numel())]


def regression_metrics(sums) -> dict[str, float]:
    """R², RMSE and MAE from summed :func:`regression_sums`."""
    sse, sae, sy, syy, m = (float(v) for v in sums)
    if m <= 0:
        return {"r2": math.nan, "rmse": math.nan, "mae": math.nan}
    sst = syy - sy * sy / m
    return {"r2": 1.0 - sse / sst if sst > 0 else math.nan, "rmse": math.sqrt(max(sse, 0.0) / m), "mae": sae / m}


def multilabel_sums(pred: torch.Tensor, y: torch.Tensor) -> list[float]:
    """``[right, values, TP_1..TP_L, FP_1..FP_L, FN_1..FN_L]`` of one batch: an output above 0 is a 1."""
    p = pred.detach().reshape(len(pred), -1) > 0
    t = y.detach().reshape(len(y), -1) > 0.5
    if p.shape != t.shape:
        raise ValueError(f"cannot compare predictions of shape {tuple(pred.shape)} with labels of shape "
                         f"{tuple(y.shape)}")
    tp, fp, fn = (p & t).sum(0), (p & ~t).sum(0), (~p & t).sum(0)
    return [float((p == t).sum()), float(t.numel()), *tp.double().tolist(), *fp.double().tolist(),
            *fn.double().tolist()]


def multilabel_metrics(sums) -> dict[str, float]:
    """Accuracy and mean per-label F1 from summed :func:`multilabel_sums`."""
    sums = [float(v) for v in sums]
    right, values, rest = sums[0], sums[1], sums[2:]
    n = len(rest) // 3
    tp, fp, fn = rest[:n], rest[n:2 * n], rest[2 * n:]
    f1 = [2 * a / (2 * a + b + c) for a, b, c in zip(tp, fp, fn) if 2 * a + b + c > 0]
    return {"accuracy": right / values if values else math.nan, "f1": sum(f1) / len(f1) if f1 else math.nan}


def task_sums(task: Task, pred: torch.Tensor, y: torch.Tensor) -> list[float]:
    """The additive sums a batch adds to a float-label task's metrics."""
    return regression_sums(pred, y) if task is Task.REGRESSION else multilabel_sums(pred, y)


def task_metrics(task: Task, sums) -> dict[str, float]:
    return regression_metrics(sums) if task is Task.REGRESSION else multilabel_metrics(sums)
