"""Overlapped and streamed exchanges (config.Streaming, step.WorkerStream), against rounds worked by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparknet import zoo
from sparknet.config import DistributedConfig, Streaming
from sparknet.loop import FitPlan, InProcessExchange, StopRule, run_rounds
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.strategies import Average, DiLoCo, EASGD


def _blobs(n: int, seed: int):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]], dtype=np.float32)
    return (centers[y] + rng.normal(0, 0.6, (n, 2))).astype(np.float32), y.astype(np.int64)


def _net(data_seed: int) -> Net:
    net = Net(zoo.mlp(input_shape=(2,), hidden=(8,), num_classes=3, batch_size=4),
              SolverConfig(base_lr=0.1, momentum=0.0, weight_decay=0.0), batch_size=4, seed=0)
    net.set_training_data(_blobs(32, data_seed), shuffle=False)
    return net


def _pair():
    nets = [_net(1), _net(2)]
    start = nets[0].get_flat()
    nets[1].set_flat(start)
    return nets, start


def _train(net: Net, weights: torch.Tensor, steps: int) -> torch.Tensor:
    net.set_flat(weights)
    net.train(steps)
    return net.get_flat()


def test_an_overlapped_exchange_applies_each_average_one_round_late_and_the_last_round_returns_all_work():
    nets, g0 = _pair()
    records = []
    final = run_rounds(InProcessExchange(nets, Average(), streaming=Streaming(overlap=True)),
                       FitPlan(strategy=Average(), stop=StopRule(rounds=3, tau=2)), g0.clone(),
                       on_record=records.append)
    # by hand, with twins of the two workers (equal batches: the sample-weighted mean is the plain mean)
    twins, _ = _pair()
    x1 = [_train(t, g0, 2) for t in twins]                      # round 1 from g0; nothing comes back
    x2 = [_train(t, x, 2) for t, x in zip(twins, x1)]           # round 2 goes on from its own weights
    g1 = g0 + sum(x - g0 for x in x1) / 2                       # round 1's average arrives after round 2
    x3 = [_train(t, g1 + (x - xs), 2) for t, x, xs in zip(twins, x2, x1)]  # round 3: g1 + own progress since
    d2 = [x - xs for x, xs in zip(x2, x1)]
    d3 = [x - (g1 + x_ - xs) for x, x_, xs in zip(x3, x2, x1)]
    expected = g1 + sum(d2) / 2 + sum(d3) / 2                   # the last round waits for round 2's and its own
    assert torch.allclose(final, expected, atol=1e-6)
    sync_nets, _ = _pair()
    sync = run_rounds(InProcessExchange(sync_nets, Average()),
                      FitPlan(strategy=Average(), stop=StopRule(rounds=3, tau=2)), g0.clone())
    assert not torch.allclose(final, sync, atol=1e-4)  # the late averages made a different run
    assert [r["steps"] for r in records] == [2, 2, 2] and records[-1]["total_steps"] == 6
    assert np.isnan(records[0]["loss"]) and records[1]["samples"] == 16 and records[2]["samples"] == 32


def test_a_streamed_exchange_moves_one_fragment_a_round_and_the_last_round_moves_what_is_left():
    nets, g0 = _pair()
    P = g0.numel()
    exchange = InProcessExchange(nets, Average(), streaming=Streaming(fragments=2))
    records = []
    final = run_rounds(exchange, FitPlan(strategy=Average(), stop=StopRule(rounds=3, tau=2)), g0.clone(),
                       on_record=records.append)
    half = slice(0, P // 2), slice(P // 2, P)
    twins, _ = _pair()
    x1 = [_train(t, g0, 2) for t in twins]
    g1 = g0.clone()
    g1[half[0]] += sum(x[half[0]] - g0[half[0]] for x in x1) / 2    # round 1: the first half only
    starts = []
    for x in x1:
        s = x.clone()
        s[half[0]] = g1[half[0]]                                    # that half comes back; the other stays the worker's
        starts.append(s)
    x2 = [_train(t, s, 2) for t, s in zip(twins, starts)]
    g2 = g1.clone()
    g2[half[1]] += sum(x[half[1]] - g0[half[1]] for x in x2) / 2    # round 2: the second half, two rounds of work
    starts = []
    for x in x2:
        s = x.clone()
        s[half[1]] = g2[half[1]]
        starts.append(s)
    x3 = [_train(t, s, 2) for t, s in zip(twins, starts)]
    base = [torch.cat([g1[half[0]], g2[half[1]]]) for _ in x3]
    expected = g2 + sum(x - b for x, b in zip(x3, base)) / 2        # round 3 is the last: every part
    assert torch.allclose(final, expected, atol=1e-6)
    # up: each worker's part (4 bytes a weight); down: the new global weights to both workers every round
    assert [r["bytes"] - 2 * 4 * P for r in records] == [8 * (P // 2), 8 * (P - P // 2), 8 * P]


def test_diloco_takes_a_fragment_with_its_own_share_of_momentum():
    whole, parts = DiLoCo(), DiLoCo()
    g = torch.arange(6, dtype=torch.float32)
    mean = torch.tensor([1.0, -1.0, 0.5, 0.25, 2.0, -0.5])
    a = whole.apply(g, mean, 2)
    b = parts.apply(g, mean[:3], 2, part=slice(0, 3))
    b = parts.apply(b, mean[3:], 2, part=slice(3, 6))
    assert torch.allclose(a, b) and torch.allclose(whole.velocity, parts.velocity)
    once = DiLoCo()
    c = once.apply(g, mean[:3], 2, part=slice(0, 3))
    assert torch.equal(c[3:], g[3:]) and torch.equal(once.velocity[3:], torch.zeros(3))
    with pytest.raises(ValueError, match="average or diloco"):
        EASGD(num_workers=2).apply(g, mean[:3], 2, part=slice(0, 3))


def test_fragments_cover_the_weights_in_turn():
    s = Streaming(fragments=3)
    parts = [s.part(r, 10) for r in range(4)]
    assert parts == [slice(0, 3), slice(3, 6), slice(6, 10), slice(0, 3)]
    assert s.part(5, 10, last=True) == slice(0, 10)
    with pytest.raises(ValueError, match="at least 1"):
        Streaming(fragments=0)


@pytest.mark.parametrize("settings, message", [
    ({"overlap": True, "engine": "barrier", "strategy": "easgd"}, "average or diloco"),
    ({"overlap": True, "engine": "barrier", "strategy": "sync"}, "average or diloco"),
    ({"fragments": 2}, "barrier engine"),
    ({"overlap": True, "engine": "barrier", "round_seconds": 5.0}, "fixed tau"),
    ({"overlap": True, "engine": "barrier", "auto_tau": True}, "fixed tau"),
    ({"fragments": 2, "engine": "barrier", "compression": "int8"}, "compression"),
    ({"fragments": 0, "engine": "barrier"}, "at least 1"),
])
def test_the_configuration_refuses_what_an_overlapped_or_streamed_exchange_cannot_do(settings, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig(workers=2, **settings)
    with pytest.raises(ValueError, match="one worker"):
        DistributedConfig(workers=1, overlap=True)
    ok = DistributedConfig(workers=2, engine="barrier", strategy="diloco", overlap=True, fragments=4)
    assert ok.streaming() == Streaming(overlap=True, fragments=4)
    assert DistributedConfig(workers=2).streaming() is None
