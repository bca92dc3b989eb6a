"""Validation split across two real gloo ranks scores exactly as one pass over all of it, for every task; so does a
screen joined with the rows it left out."""

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


def _rank(rank, out, task):
    net, x, y = _case(task)
    rows = slice(0, _SPLIT) if rank == 0 else slice(_SPLIT, None)
    res = evaluate_shards(net, net.get_flat(), (x[rows], y[rows]))
    # a screen of 25 rows a rank (all 20 of rank 1's), then the rows it left out: joined, the whole set again
    screen = evaluate_shards(net, net.get_flat(), (x[rows], y[rows]), sample=25)
    rest = evaluate_shards(net, net.get_flat(), (x[rows], y[rows]), rest_of=25)
    joined = screen.joined(rest)
    out[rank] = (res.loss, res.samples, dict(res.metrics), (screen.samples, rest.samples),
                 (joined.loss, joined.samples, dict(joined.metrics)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("task,metrics", [("classification", {"accuracy", "top5_accuracy"}),
                                          ("multilabel", {"accuracy", "f1", "auc"}),
                                          ("regression", {"r2", "rmse", "mae"})])
def test_two_ranks_score_as_one_pass(task, metrics):
    out = run_two_ranks(_rank, task)
    assert out[0] == out[1]  # every rank gets the same numbers
    loss, samples, got, parts, joined = out[0]
    net, x, y = _case(task)
    whole = net.evaluate((x, y))
    assert parts == (25 + 20, 105)  # rank 1's 20 rows are all in its screen
    for loss, samples, got in ((loss, samples, got), joined):
        assert samples == whole.samples == 150 and set(got) == metrics == set(whole.metrics)
        assert math.isclose(loss, whole.loss, rel_tol=1e-6)
        for name in metrics:
            assert got[name] == pytest.approx(whole.metrics[name], rel=1e-9, abs=1e-12), name
        assert all(np.isfinite(v) for v in got.values())
