"""What a net learns — class ids, numbers or a set of labels — and so how its labels are checked and
its weights scored.

The task follows from the loss: a regression loss (``torch.nn.MSELoss``, ``L1Loss``, ``HuberLoss``,
``SmoothL1Loss``, or a ``EuclideanLoss`` layer) learns numbers; ``BCEWithLogitsLoss``,
``MultiLabelSoftMarginLoss`` or a ``SigmoidCrossEntropyLoss`` layer a 0/1 for each output (multi-label, or
binary with one output); anything else class ids. Given explicitly it overrides that.

A task scores a net by sums that add up over batches, ranks and partitions, so a validation set
split across workers gives the same metrics as one pass over all of it:

- classification: accuracy (``correct / labels``), the score a target is set on, and with more than
  :data:`TOP_K` classes the top-k accuracy (the label among the k highest outputs);
- regression: R² (``1 - SSE / SST`` over every label value, the score), RMSE and MAE;
- unlabelled: the loss alone (no target can be set on it);
- multi-label: accuracy over every label value (the score; an output above 0 is a 1); F1, the
  mean over the labels of each one's F1 (labels never true nor predicted left out); and AUC, the
  mean over the labels of each one's area under the ROC curve (labels whose rows are all one
  value left out). The AUC is read off a histogram of the outputs' sigmoids in :data:`AUC_BINS`
  equal bins, each label's positives and negatives counted apart (additive, as Keras' ``AUC``
  with its 200 thresholds); outputs in the same bin count as ties.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sparknet._enums import Task

__all__ = ["Task", "infer_task", "parse_task", "score_columns", "TOP_K", "AUC_BINS"]

TOP_K = 5
"""k of the top-k accuracy of a classifier (reported when it has more than k classes)."""
AUC_BINS = 200
"""Equal bins of the sigmoid of a multi-label output that its AUC is read from."""


_REGRESSION_LOSSES = (torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.HuberLoss, torch.nn.SmoothL1Loss)
_REGRESSION_LAYERS = ("EuclideanLoss",)
_MULTILABEL_LAYERS = ("SigmoidCrossEntropyLoss",)
_MULTILABEL_LOSSES = (torch.nn.BCEWithLogitsLoss, torch.nn.MultiLabelSoftMarginLoss)


def parse_task(value) -> Task | None:
    if value is None or isinstance(value, Task):
        return value
    try:
        return Task(str(value).lower())
    except ValueError:
        raise ValueError(f"task must be one of {[t.value for t in Task]}, got {value!r}") from None


def infer_task(loss=None, net_params=None, task=None) -> Task:
    """``task`` when given, else regression for a regression loss (function or layer), multi-label for a
    multi-label one (``BCEWithLogitsLoss``, ``MultiLabelSoftMarginLoss``, a ``SigmoidCrossEntropyLoss`` layer), else
    classification."""
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
    if any(type(layer).__name__ in _MULTILABEL_LAYERS for layer in layers):
        return Task.MULTILABEL
    return Task.CLASSIFICATION


def bad_weights(weights: np.ndarray) -> int:
    """How many sample weights are NaN (null), infinite or negative."""
    return int(len(weights) - (np.isfinite(weights) & (weights >= 0)).sum())


def _per_value(weight: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """Each row's sample weight (``[n]``) for each of the row's label values, as float64 of ``y``'s shape; no weights:
    a weight of 1 each (the plain counts and sums, exactly: a product by 1.0 is exact, as are sums of 1.0s)."""
    if weight is None:
        return torch.ones((), dtype=torch.float64, device=y.device).expand(y.shape)
    w = torch.as_tensor(weight).detach().to(y.device, torch.float64).reshape(-1)
    if len(w) != len(y):
        raise ValueError(f"{len(w)} sample weights for {len(y)} rows of labels")
    return w.reshape(len(w), *[1] * (y.dim() - 1)).expand(y.shape)


def regression_sums(pred: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> list[float]:
    """``[SSE, SAE, Σy, Σy², values]`` of one batch (float64); with each row's sample ``weight`` (``[n]``), each sum
    weighs a row's values by it, and ``values`` is their total weight (the weighted R², RMSE and MAE)."""
    w = _per_value(weight, y).reshape(-1)
    p, t = pred.detach().reshape(-1).double(), y.detach().reshape(-1).double()
    if p.numel() != t.numel():
        raise ValueError(f"cannot compare predictions of shape {tuple(pred.shape)} with labels of shape "
                         f"{tuple(y.shape)}")
    err = p - t
    return [float((w * err * err).sum()), float((w * err.abs()).sum()), float((w * t).sum()),
            float((w * t * t).sum()), float(w.sum())]


def regression_metrics(sums) -> dict[str, float]:
    """R², RMSE and MAE from summed :func:`regression_sums`."""
    sse, sae, sy, syy, m = (float(v) for v in sums)
    if m <= 0:
        return {"r2": math.nan, "rmse": math.nan, "mae": math.nan}
    sst = syy - sy * sy / m
    return {"r2": 1.0 - sse / sst if sst > 0 else math.nan, "rmse": math.sqrt(max(sse, 0.0) / m), "mae": sae / m}


def multilabel_sums(pred: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> list[float]:
    """``[right, values, TP_1..TP_L, FP_1..FP_L, FN_1..FN_L, POS_1..POS_L, NEG_1..NEG_L]`` of one batch: an
    output above 0 is a 1; ``POS_l``/``NEG_l`` are label l's :data:`AUC_BINS` counts of the sigmoids of the
    outputs of its positive and negative rows. With each row's sample ``weight`` (``[n]``) a row counts that many
    times in every count."""
    logits = pred.detach().reshape(len(pred), -1)
    p = logits > 0
    t = y.detach().reshape(len(y), -1) > 0.5
    if p.shape != t.shape:
        raise ValueError(f"cannot compare predictions of shape {tuple(pred.shape)} with labels of shape "
                         f"{tuple(y.shape)}")
    labels = p.shape[1]
    bins = (torch.sigmoid(logits.double()) * AUC_BINS).long().clamp_(0, AUC_BINS - 1)
    slot = bins + AUC_BINS * torch.arange(labels).unsqueeze(0)  # label l's bins at l * AUC_BINS ...
    w = _per_value(weight, t)
    tp, fp, fn = (w * (p & t)).sum(0), (w * (p & ~t)).sum(0), (w * (~p & t)).sum(0)
    hist = [torch.bincount(slot[m], w[m], minlength=labels * AUC_BINS).double() for m in (t, ~t)]
    return [float((w * (p == t)).sum()), float(w.sum()), *tp.tolist(), *fp.tolist(), *fn.tolist(),
            *hist[0].tolist(), *hist[1].tolist()]


def _auc(pos: list[float], neg: list[float]) -> float | None:
    """Area under the ROC curve from histograms of the positives' and negatives' scores (ties count half)."""
    n_pos, n_neg = sum(pos), sum(neg)
    if n_pos <= 0 or n_neg <= 0:
        return None
    below = wins = 0.0
    for p, n in zip(pos, neg):  # bins in increasing score
        wins += p * (below + 0.5 * n)
        below += n
    return wins / (n_pos * n_neg)


def multilabel_metrics(sums) -> dict[str, float]:
    """Accuracy, mean per-label F1 and mean per-label AUC from summed :func:`multilabel_sums`."""
    sums = [float(v) for v in sums]
    right, values, rest = sums[0], sums[1], sums[2:]
    n = len(rest) // (3 + 2 * AUC_BINS)
    tp, fp, fn = rest[:n], rest[n:2 * n], rest[2 * n:3 * n]
    f1 = [2 * a / (2 * a + b + c) for a, b, c in zip(tp, fp, fn) if 2 * a + b + c > 0]
    pos, neg, B = rest[3 * n:3 * n + n * AUC_BINS], rest[3 * n + n * AUC_BINS:], AUC_BINS
    aucs = [a for a in (_auc(pos[i * B:(i + 1) * B], neg[i * B:(i + 1) * B]) for i in range(n)) if a is not None]
    return {"accuracy": right / values if values else math.nan, "f1": sum(f1) / len(f1) if f1 else math.nan,
            "auc": sum(aucs) / len(aucs) if aucs else math.nan}


def classification_sums(pred: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> list[float]:
    """``[right, labels, top-k right, wide]`` of one batch: the arg-max and the :data:`TOP_K` highest outputs
    against the class ids (class axis last, or axis 1 as in Caffe); ``wide`` is 1 when there are more than
    :data:`TOP_K` classes (0 for one output a label, an output above 0 being class 1). One class id a row adds each
    class's rows predicted right, rows predicted and rows labelled (``C`` of each: the outputs, or 2 for one output a
    label), what :func:`classification_metrics` weighs F1 and precision by class from, as Spark's evaluators do.
    With each row's sample ``weight`` (``[n]``) a row's labels count that many times (the weighted metrics)."""
    w = _per_value(weight, y)

    def count(hits: torch.Tensor) -> float:
        return float((w * hits).sum())

    labels = float(w.sum())
    if pred.dim() == y.dim() and pred.shape == y.shape:  # binary outputs
        predicted = (pred > 0).long()
        right = count(predicted == y.long())
        return [right, labels, right, 0.0, *_by_class(predicted, y, w, 2)]
    if pred.dim() != y.dim() + 1:
        raise ValueError(f"cannot compare predictions of shape {tuple(pred.shape)} with labels of shape "
                         f"{tuple(y.shape)}")
    scores = pred if pred.shape[:-1] == y.shape else pred.movedim(1, -1)
    predicted = scores.argmax(-1)
    right = count(predicted == y)
    by_class = _by_class(predicted, y, w, max(scores.shape[-1], 2))
    if scores.shape[-1] <= TOP_K:
        return [right, labels, right, 0.0, *by_class]
    top = scores.topk(TOP_K, dim=-1).indices
    return [right, labels, count((top == y.unsqueeze(-1)).any(-1)), 1.0, *by_class]


def _by_class(predicted: torch.Tensor, y: torch.Tensor, w: torch.Tensor, classes: int) -> list[float]:
    """Each of ``classes`` classes' weight of rows predicted right, of rows predicted and of rows labelled (one class
    id a row; none for a label a position, a sequence's). A label no output stands for (an ignored index, -100)
    is no class's."""
    if y.dim() != 1:
        return []
    y = y.long()
    known = (y >= 0) & (y < classes)
    hit = known & (predicted == y)
    counts = [torch.bincount(ids, weights=weights, minlength=classes)
              for ids, weights in ((y[hit], w[hit]), (predicted, w.contiguous()), (y[known], w[known]))]
    return torch.cat(counts).tolist()


def classification_metrics(sums) -> dict[str, float]:
    """Accuracy, top-k accuracy for more than :data:`TOP_K` classes and, for one class id a row, Spark's ``f1`` and
    ``weighted_precision`` (each class's F1 and precision weighed by its share of the labels; a class never
    predicted has a precision of 0) and ``macro_f1`` (the mean F1 of the classes labelled or predicted, every class
    alike, as scikit-learn's macro average), from summed :func:`classification_sums`."""
    right, labels, top, wide = (float(v) for v in sums[:4])
    out = {"accuracy": right / labels if labels else math.nan}
    if wide > 0:
        out[f"top{TOP_K}_accuracy"] = top / labels if labels else math.nan
    if len(sums) > 4:
        tp, predicted, actual = np.asarray(sums[4:], dtype=np.float64).reshape(3, -1)
        share = actual / labels if labels else np.full_like(actual, math.nan)
        precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
        recall = np.divide(tp, actual, out=np.zeros_like(tp), where=actual > 0)
        f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros_like(tp),
                       where=precision + recall > 0)
        seen = (actual > 0) | (predicted > 0)
        out.update(f1=float(share @ f1), weighted_precision=float(share @ precision),
                   macro_f1=float(f1[seen].mean()) if seen.any() else math.nan)
    return out


def task_sums(task: Task, pred: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> list[float]:
    """The additive sums a batch adds to a labelled task's metrics; with each row's sample ``weight`` (``[n]``), of
    the weighted metrics (a row of weight w counts as w rows)."""
    if task is Task.REGRESSION:
        return regression_sums(pred, y, weight)
    sums = multilabel_sums if task is Task.MULTILABEL else classification_sums
    return sums(pred, y, weight)


def task_width(task: Task, label_shape: tuple[int, ...], outputs: int | None = None) -> int:
    """How many numbers :func:`task_sums` gives for labels of ``label_shape`` (one row's) and a net of ``outputs``
    outputs (a classifier's: its classes, or 1 for one output a label; ``None``: the first four, its accuracies'
    sums, alone)."""
    if task is Task.REGRESSION:
        return 5
    if task is Task.MULTILABEL:
        return 2 + math.prod(label_shape) * (3 + 2 * AUC_BINS)
    if label_shape or outputs is None:  # a class id a position; or the accuracies' sums alone
        return 4
    return 4 + 3 * max(outputs, 2)


def task_metrics(task: Task, sums) -> dict[str, float]:
    if task is Task.REGRESSION:
        return regression_metrics(sums)
    return multilabel_metrics(sums) if task is Task.MULTILABEL else classification_metrics(sums)


def score_columns(logits: torch.Tensor, task: Task) -> dict:
    """What a scored batch gets from its net's outputs, by task (the Spark model's and the MLflow model's one rule):
    a regressor's outputs as ``prediction`` (a number, or a list of them); a classifier's arg-max class (a double)
    as ``prediction``, its softmax as ``probability`` and its logits as ``raw``; a multi-label net's labels whose
    sigmoid is above one half as ``prediction``, each label's sigmoid as ``probability`` and its logits as ``raw``."""
    logits = logits.double()
    if task is Task.REGRESSION:
        out = logits.reshape(len(logits), -1).cpu().numpy()
        return {"prediction": out[:, 0] if out.shape[1:] == (1,) else list(out)}
    if logits.dim() != 2:
        raise ValueError(f"the net's output has shape {tuple(logits.shape)}; scoring needs [batch, classes] logits")
    if task is Task.MULTILABEL:
        p = torch.sigmoid(logits).cpu().numpy()
        prediction = [np.flatnonzero(row > 0.5).astype(np.float64) for row in p]
    else:
        p = torch.softmax(logits, dim=1).cpu().numpy()
        prediction = p.argmax(axis=1).astype(np.float64)
    return {"prediction": prediction, "probability": list(p), "raw": list(logits.cpu().numpy())}
