"""The sync strategy's gradient allreduce, in two real gloo processes on loopback."""

import pytest
import torch

from _two_ranks import run_two_ranks
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.strategies import Sync


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)


def _worker(rank, out):
    x, y = _data()
    net = Net(_model(), SolverConfig(base_lr=0.1, momentum=0.0), batch_size=16)
    net.set_training_data((x[rank * 32:(rank + 1) * 32], y[rank * 32:(rank + 1) * 32]), shuffle=False)
    strategy = Sync()
    net.train(2, after_backward=strategy.after_backward)
    out[rank] = net.get_flat()


@pytest.mark.timeout(120)
def test_sync_equals_one_large_batch_step():
    out = run_two_ranks(_worker)
    assert torch.equal(out[0], out[1])  # every rank holds the same weights
    x, y = _data()
    ref = Net(_model(), SolverConfig(base_lr=0.1, momentum=0.0), batch_size=32)
    # Step k of the pair used rows [16k, 16k+16) of each half: the same 32 rows in one batch.
    order = torch.cat([torch.arange(0, 16), torch.arange(32, 48), torch.arange(16, 32), torch.arange(48, 64)])
    ref.set_training_data((x[order], y[order]), shuffle=False)
    ref.train(2)
    assert torch.allclose(out[0], ref.get_flat(), atol=1e-6)
