"""Overlapped and streamed exchanges over two real gloo ranks: the same weights as the in-process exchange, the
link's wait hidden behind the next round's steps, and a fragment's bytes per exchange."""

import numpy as np
import pytest
import torch

from _two_ranks import run_two_ranks
from sparknet import zoo
from sparknet.collective import FIELDS, CollectiveExchange
from sparknet.config import Streaming
from sparknet.link import LinkModel
from sparknet.loop import FitPlan, InProcessExchange, StopRule, run_rounds
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.strategies import Average, DiLoCo

_ROUNDS, _TAU = 5, 3


def _net(rank: int) -> Net:
    rng = np.random.default_rng(rank + 1)
    n = 40 if rank == 0 else 24  # the ranks process different numbers of samples: the mean is weighted
    y = rng.integers(0, 3, n)
    x = (np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]], dtype=np.float32)[y] + rng.normal(0, 0.6, (n, 2)))
    batch = 8 if rank == 0 else 4
    net = Net(zoo.mlp(input_shape=(2,), hidden=(8,), num_classes=3, batch_size=batch),
              SolverConfig(base_lr=0.1, momentum=0.9, weight_decay=0.0), batch_size=batch, seed=0)
    net.set_training_data((x.astype(np.float32), y.astype(np.int64)), shuffle=False)
    return net


def _strategy(name: str):
    return Average() if name == "average" else DiLoCo()


_CASES = [("average", True, 1, 0.0), ("average", False, 3, 0.0), ("diloco", True, 2, 0.0),
          ("average", False, 2, 0.3), ("average", True, 1, 0.3)]
"""(strategy, overlap, fragments, link latency): one pair of processes runs them all, one after another."""


def _rank(rank, out):
    for case in _CASES:
        name, overlap, fragments, latency_s = case
        net = _net(rank)
        start = _net(0).get_flat()
        link = LinkModel(latency_s=latency_s) if latency_s else None
        exchange = CollectiveExchange(net, _strategy(name), rank=rank, world=2, link=link,
                                      streaming=Streaming(overlap=overlap, fragments=fragments))
        records = []
        final = run_rounds(exchange, FitPlan(strategy=exchange.strategy, stop=StopRule(rounds=_ROUNDS, tau=_TAU)),
                           start.clone(), on_record=records.append)
        out[(rank, case)] = (final.numpy().tobytes(),
                             [(r["bytes"], r.get("link_s"), r["steps"]) for r in records])


@pytest.fixture(scope="module")
def ranks():
    return run_two_ranks(_rank)


def _in_process(name, overlap, fragments) -> torch.Tensor:
    nets = [_net(0), _net(1)]
    start = nets[0].get_flat()
    nets[1].set_flat(start)
    strategy = _strategy(name)
    return run_rounds(InProcessExchange(nets, strategy, streaming=Streaming(overlap=overlap, fragments=fragments)),
                      FitPlan(strategy=strategy, stop=StopRule(rounds=_ROUNDS, tau=_TAU)), start.clone())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", _CASES[:3], ids=lambda c: f"{c[0]}-overlap{c[1]}-fragments{c[2]}")
def test_two_ranks_train_the_weights_the_in_process_exchange_trains(ranks, case):
    name, overlap, fragments, _ = case
    assert ranks[(0, case)][0] == ranks[(1, case)][0]  # every rank holds the same global weights
    got = torch.from_numpy(np.frombuffer(ranks[(0, case)][0], dtype=np.float32).copy())
    assert torch.allclose(got, _in_process(name, overlap, fragments), atol=1e-5)
    P = got.numel()
    per_round = [b for b, _, _ in ranks[(0, case)][1]]
    if fragments > 1:  # a fragment's weights and the ranks' rows, a ring allreduce of two: twice the buffer
        sizes = [Streaming(fragments=fragments).part(r, P) for r in range(_ROUNDS - 1)]
        assert per_round[:-1] == [2 * 4 * (s.stop - s.start + 2 * FIELDS) for s in sizes]
        assert per_round[-1] == 2 * 4 * (P + 2 * FIELDS)
    assert [s for _, _, s in ranks[(0, case)][1]] == [_TAU] * _ROUNDS


@pytest.mark.timeout(180)
def test_an_overlapped_exchange_waits_for_the_link_behind_the_next_rounds_steps(ranks):
    # a 0.3 s latency: a ring allreduce of two ranks is two messages, 0.6 s a round; a synchronous round waits
    # all of it, an overlapped one what is left of it after the next round's steps
    sync = [link for _, link, _ in ranks[(0, _CASES[3])][1]]
    assert all(w == pytest.approx(0.6, abs=0.01) for w in sync)
    over = [link for _, link, _ in ranks[(0, _CASES[4])][1]]
    assert over[0] is None  # round 1 waits for nothing: its exchange travels behind round 2
    assert all(0.0 < link < 0.6 for link in over[1:-1])
    assert sum(over[1:-1]) < sum(sync[1:-1])
