"""The sync strategy's gradient allreduce, in two real gloo processes on loopback."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.strategies import Sync


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)


def _worker(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=__import__("datetime").timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        x, y = _data()
        net = Net(_model(), SolverConfig(base_lr=0.1, momentum=0.0), batch_size=16)
        net.set_training_data((x[rank * 32:(rank + 1) * 32], y[rank * 32:(rank + 1) * 32]), shuffle=False)
        strategy = Sync()
        net.train(2, after_backward=strategy.after_backward)
        out[rank] = net.get_flat()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_sync_equals_one_large_batch_step():
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_worker, args=(_free_port(), out), nprocs=2, join=True)
    assert torch.equal(out[0], out[1])  # every rank holds the same weights
    x, y = _data()
    ref = Net(_model(), SolverConfig(base_lr=0.1, momentum=0.0), batch_size=32)
    # Step k of the pair used rows [16k, 16k+16) of each half: the same 32 rows in one batch.
    order = torch.cat([torch.arange(0, 16), torch.arange(32, 48), torch.arange(16, 32), torch.arange(48, 64)])
    ref.set_training_data((x[order], y[order]), shuffle=False)
    ref.train(2)
    assert torch.allclose(out[0], ref.get_flat(), atol=1e-6)
