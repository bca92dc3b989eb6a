"""What a net learns — class ids or numbers — and so how its labels are checked and its weights scored.

The task follows from the loss: a regression loss (``torch.nn.MSELoss``, ``L1Loss``, ``HuberLoss``,
``SmoothL1Loss``, or a ``EuclideanLoss`` layer) learns numbers, anything else class ids. Given
explicitly it overrides that.

A task scores a net by sums that add up over batches, ranks and partitions, so a validation set
split across workers gives the same metrics as one pass over all of it:

- classification: accuracy (``correct / labels``), the score a target is set on;
- regression: R² (``1 - SSE / SST`` over every label value, the score), RMSE and MAE.
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

    @property
    def score(self) -> str:
        """The metric a target is set on (higher is better)."""
        return "accuracy" if self is Task.CLASSIFICATION else "r2"


_REGRESSION_LOSSES = (torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.HuberLoss, torch.nn.SmoothL1Loss)
_REGRESSION_LAYERS = ("EuclideanLoss",)


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
