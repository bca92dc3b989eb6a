"""Strategies, compression and automatic tau: the formulas, checked against references."""

import numpy as np
import pytest
import torch

from sparknet import SolverConfig, zoo
from sparknet.datasets import synthetic
from sparknet.step import worker_seed
from sparknet.net import Net
from sparknet.simulate import simulate
from sparknet.strategies import (
    EASGD,
    Average,
    AutoTau,
    DiLoCo,
    Downlink,
    Int8Compression,
    WorkerState,
    make_compressor,
    make_strategy,
)


def test_average_adds_the_mean_delta():
    g = torch.tensor([1.0, 2.0])
    assert torch.equal(Average().apply(g, torch.tensor([0.5, -1.0]), 2), torch.tensor([1.5, 1.0]))


def test_diloco_without_momentum_and_unit_lr_is_averaging():
    g, d = torch.randn(10), torch.randn(10)
    assert torch.allclose(DiLoCo(outer_lr=1.0, outer_momentum=0.0).apply(g, d, 4), g + d)


def test_diloco_matches_torch_nesterov_sgd():
    torch.manual_seed(0)
    g = torch.randn(20)
    ref = torch.nn.Parameter(g.clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    s = DiLoCo()
    for _ in range(5):
        d = torch.randn(20) * 0.1
        g = s.apply(g, d, 4)
        ref.grad = -d
        opt.step()
    assert torch.allclose(g, ref.detach(), atol=1e-6)
    restored = DiLoCo()
    restored.load_state_dict(s.state_dict())
    assert torch.equal(restored.velocity, s.velocity)


class _FlatNet:
    """Just enough of a Net for worker hooks: a flat buffer."""

    def __init__(self, flat):
        self.flat = flat.clone()

    def get_flat(self):
        return self.flat.clone()

    def set_flat(self, buf):
        self.flat = buf.clone()


def test_easgd_elastic_updates():
    s = EASGD(num_workers=2, beta=0.9)
    assert s.alpha == pytest.approx(0.45)
    center = torch.zeros(3)
    states = [WorkerState(), WorkerState()]
    nets = [_FlatNet(torch.zeros(3)), _FlatNet(torch.zeros(3))]
    for st, n in zip(states, nets):
        s.worker_begin(st, n, center)
    nets[0].flat, nets[1].flat = torch.full((3,), 2.0), torch.full((3,), 4.0)  # after local training
    deltas = [s.worker_delta(st, n, center) for st, n in zip(states, nets)]
    new_center = s.apply(center, (deltas[0] + deltas[1]) / 2, 2)
    assert torch.allclose(new_center, torch.full((3,), 0.45 * (2 + 4)))         # c + alpha * sum(x_i - c)
    assert torch.allclose(states[0].local_flat, torch.full((3,), 2 - 0.45 * 2))  # x_i - alpha (x_i - c)
    s.worker_begin(states[1], nets[1], new_center)                               # keeps its own weights
    assert torch.allclose(nets[1].flat, torch.full((3,), 4 - 0.45 * 4))
    with pytest.raises(ValueError):
        EASGD(num_workers=2, alpha=0.9)


def test_unknown_strategy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown strategy"):
        make_strategy("gossip")


@pytest.mark.parametrize("kind, ratio", [("none", 1.0), ("fp16", 0.5), ("bf16", 0.5), ("int8", 0.2503)])
def test_compression_sizes(kind, ratio):
    c = make_compressor(kind)
    d = torch.randn(100_000)
    enc = c.compress(d, WorkerState())
    assert enc.nbytes == pytest.approx(ratio * d.numel() * 4, rel=1e-3)
    bound = {"none": 0.0, "fp16": 2**-10, "bf16": 2**-7, "int8": 1 / 127}[kind] * d.abs().max()
    assert (c.decompress(enc) - d).abs().max() <= bound


def test_int8_error_feedback_loses_nothing_over_rounds():
    c, st = Int8Compression(chunk=256), WorkerState()
    torch.manual_seed(1)
    deltas = [torch.randn(1000) * 10 ** -k for k in range(6)]
    sent = sum(c.decompress(c.compress(d, st)) for d in deltas)
    assert torch.allclose(sent + st.extra["residual"], sum(deltas), atol=1e-5)


@pytest.mark.parametrize("kind", ["none", "fp16", "bf16", "int8"])
def test_wire_messages_round_trip_and_have_the_announced_size(kind):
    c = make_compressor(kind)
    d = torch.randn(10_001)
    reference = c.decompress(c.compress(d, WorkerState()))
    buf = c.encode(d, WorkerState())
    assert buf.dtype is torch.uint8 and buf.numel() == c.wire_nbytes(d.numel())
    assert torch.equal(c.decode(buf, d.numel()), reference)
    with pytest.raises(ValueError, match="same compression"):
        c.decode(buf[:-1], d.numel())


def test_int8_runs_chunk_on_their_own_so_a_weight_two_processes_hold_whole_is_quantized_alike():
    # two processes of a split worker: each its own half of a split weight (different values), then the same whole
    # weight; chunked as one run, the whole weight shares a chunk, and its scale, with each process's own half
    torch.manual_seed(2)
    whole, halves = torch.randn(300), (torch.randn(200) * 5, torch.randn(200) * 0.1)
    for sizes, alike in ((None, False), ([200, 300], True)):
        c = Int8Compression(chunk=256, sizes=sizes)
        states = [WorkerState(), WorkerState()]
        sent = [c.decompress(c.compress(torch.cat([h, whole]), st)) for h, st in zip(halves, states)]
        assert torch.equal(sent[0][200:], sent[1][200:]) is alike
        assert torch.equal(states[0].extra["residual"][200:], states[1].extra["residual"][200:]) is alike
    buf = c.encode(torch.cat([halves[0], whole]), WorkerState())
    assert buf.numel() == c.wire_nbytes(500) == 500 + 4 * (1 + 2)  # a scale a chunk of each run
    assert torch.equal(c.decode(buf, 500), sent[0])
    with pytest.raises(ValueError, match="not made of runs of 500"):
        c.wire_nbytes(499)
    assert make_compressor("int8", [200, 300]).wire_nbytes(500) == 500 + 4 * 2  # 4096 values a chunk


def test_downlink_error_feeds_back_through_what_the_workers_hold():
    torch.manual_seed(0)
    down = Downlink(Int8Compression(chunk=64), 1000)
    target = torch.randn(1000)
    worker = torch.zeros(1000)
    for _ in range(4):  # the same global weights sent again: the gap shrinks to nothing quickly
        worker = down.receive(worker, down.message(target))
        assert torch.equal(worker, down.seen)  # the worker holds exactly what the sender thinks it holds
    assert (worker - target).abs().max() < 1e-6 * target.abs().max() * 1000
    exact = Downlink(make_compressor("none"), 1000)
    assert torch.equal(exact.receive(None, exact.message(target)), target)


def test_link_all_gather_delay():
    from sparknet.link import LinkModel

    link = LinkModel(0.01, 8e6)
    assert link.allgather_delay(1000, 1) == 0.0
    assert link.allgather_delay(1000, 4) == pytest.approx(3 * (0.01 + 1000 * 8 / 8e6))


def test_auto_tau_rule_and_bounds():
    a = AutoTau(target_fraction=0.1, min_tau=1, max_tau=500, every=2, initial=10)
    assert a.choose(step_s=0.025, sync_s=0.2) == 72        # 0.2 * 0.9 / (0.1 * 0.025)
    assert a.choose(step_s=0.025, sync_s=0.0) == 1
    assert a.choose(step_s=1e-6, sync_s=10.0) == 500
    assert a.observe(10, 0.25, 0.2) == 10                   # not re-chosen until `every` rounds
    assert a.observe(10, 0.25, 0.2) == 72
    frac = 0.2 / (0.2 + 72 * 0.025)
    assert frac <= 0.1


def _data():
    train = synthetic(800, shape=(8,), num_classes=4, seed=0)
    test = synthetic(400, shape=(8,), num_classes=4, seed=1)
    return train, test


def test_one_logical_worker_is_plain_training():
    train, test = _data()
    net_params = zoo.mlp(input_shape=(8,), hidden=(16,), num_classes=4, batch_size=16)
    solver = SolverConfig(base_lr=0.05)
    r = simulate(net_params, train, test, workers=1, tau=7, solver=solver, batch_size=16, steps=35, seed=3)
    ref = Net(net_params, solver, batch_size=16, seed=3)
    ref2 = Net(net_params, solver, batch_size=16, seed=worker_seed(3, 0))  # worker 0's data order
    ref2.set_flat(ref.get_flat())  # from the run's initial weights
    ref2.set_training_data(train.shard(0, 1))
    ref2.train(35)
    ref.set_flat(ref2.get_flat())
    ref.set_validation_data(test)
    assert r.steps_per_worker == 35 and r.rounds == 5 and r.bytes == 0
    assert r.accuracy == pytest.approx(ref.test())


@pytest.mark.parametrize("strategy", ["average", "diloco", "easgd", "sync"])
def test_every_strategy_learns_with_four_workers(strategy):
    train, test = _data()
    net_params = zoo.mlp(input_shape=(8,), hidden=(16,), num_classes=4, batch_size=16)
    r = simulate(net_params, train, test, workers=4, tau=5, strategy=strategy, solver=SolverConfig(base_lr=0.05),
                 batch_size=16, target_accuracy=0.9, steps=400)
    assert r.reached, r.history[-3:]
    assert np.isfinite(r.accuracy)
