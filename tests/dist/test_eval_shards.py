"""Validation split across two real gloo ranks scores exactly as one pass over all of it, for every task, with and
without sample weights; so does a screen joined with the rows it left out."""

import math

import numpy as np
import pytest
import torch

from _two_ranks import run_two_ranks
from sparknet.collective import evaluate_shards
from sparknet.net import Net
from sparknet.solvers import SolverConfig

# rank 0 scores the first 130 rows, rank 1 the other 20: an unweighted mean of the ranks' metrics would differ
_SPLIT = 130


def _case(task: str):
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(0)  # the same weights in every process
    x = torch.randn(150, 6, generator=g)
    if task == "classification":
        module, loss, y = torch.nn.Linear(6, 12), None, torch.randint(0, 12, (150,), generator=g)
    elif task == "multilabel":
        module, loss = torch.nn.Linear(6, 3), torch.nn.BCEWithLogitsLoss()
        y = (x[:, :3] + 0.5 * torch.randn(150, 3, generator=g) > 0).float()
    else:
        module, loss, y = torch.nn.Linear(6, 2), torch.nn.MSELoss(), x[:, :2] * 2.0 + 0.3
    torch.nn.init.normal_(module.weight, std=0.5)
    return Net(module, SolverConfig(base_lr=0.1), loss=loss), x.numpy(), y.numpy()


def _weights(weighted: bool):
    """Each row's sample weight (whole numbers 0 to 3, a quarter of the rows weighing nothing), or ``None``."""
    return (np.arange(150) % 4).astype(np.float64) if weighted else None


def _rank(rank, out, task, weighted):
    net, x, y = _case(task)
    w = _weights(weighted)
    rows = slice(0, _SPLIT) if rank == 0 else slice(_SPLIT, None)
    share = (x[rows], y[rows]) if w is None else (x[rows], y[rows], w[rows])
    outputs = net.predict(x[:1]).shape[-1]  # a classifier's classes: its F1 by class sums too
    res = evaluate_shards(net, net.get_flat(), share, outputs=outputs)
    # a screen of 25 rows a rank (all 20 of rank 1's), then the rows it left out: joined, the whole set again
    screen = evaluate_shards(net, net.get_flat(), share, sample=25, outputs=outputs)
    rest = evaluate_shards(net, net.get_flat(), share, rest_of=25, outputs=outputs)
    joined = screen.joined(rest)
    out[rank] = (res.loss, res.samples, res.weight, dict(res.metrics), (screen.samples, rest.samples),
                 (joined.loss, joined.samples, joined.weight, dict(joined.metrics)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("task,metrics", [("classification", {"accuracy", "top5_accuracy", "f1", "weighted_precision",
                                                                             "macro_f1"}),
                                          ("multilabel", {"accuracy", "f1", "auc"}),
                                          ("regression", {"r2", "rmse", "mae"})])
def test_two_ranks_score_as_one_pass(task, metrics, weighted):
    out = run_two_ranks(_rank, task, weighted)
    assert out[0] == out[1]  # every rank gets the same numbers
    loss, samples, weight, got, parts, joined = out[0]
    net, x, y = _case(task)
    w = _weights(weighted)
    whole = net.evaluate((x, y), weights=w)
    assert parts == (25 + 20, 105)  # rank 1's 20 rows are all in its screen
    assert whole.weight == (None if w is None else w.sum())
    for loss, samples, weight, got in ((loss, samples, weight, got), joined):
        assert samples == whole.samples == 150 and set(got) == metrics == set(whole.metrics)
        assert weight == whole.weight
        assert math.isclose(loss, whole.loss, rel_tol=1e-6)
        for name in metrics:
            assert got[name] == pytest.approx(whole.metrics[name], rel=1e-9, abs=1e-12), name
        assert all(np.isfinite(v) for v in got.values())
    if weighted:  # and the weights counted: the unweighted scores differ
        assert not math.isclose(net.evaluate((x, y)).loss, whole.loss, rel_tol=1e-3)
