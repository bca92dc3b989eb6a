"""Solvers: every type builds and learns; Caffe's learning-rate formulas; lr_mult groups."""

import math

import pytest
import torch

from sparknet.optimizers import build_optimizer
from sparknet.solvers import LRPolicy, SolverConfig, SolverType, lr_multiplier


def _problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return x, x @ w


@pytest.mark.parametrize("solver_type", list(SolverType))
def test_every_solver_reduces_the_loss(solver_type):
    torch.manual_seed(0)
    x, y = _problem()
    model = torch.nn.Linear(8, 1)
    lr = {SolverType.ADADELTA: 1.0, SolverType.ADAGRAD: 0.1}.get(solver_type, 0.01)
    delta = 1e-3 if solver_type is SolverType.ADADELTA else 1e-8  # AdaDelta starts with steps of sqrt(delta)
    opt, sched = build_optimizer(model, SolverConfig(type=solver_type, base_lr=lr, momentum=0.9, delta=delta))
    first = None

    def closure():  # every solver takes one (cg and lbfgs need it: their line search evaluates the loss again)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(200):
        loss = opt.step(closure)
        first = first if first is not None else loss.item()
        sched.step()
    loss = torch.nn.functional.mse_loss(model(x), y)
    assert loss.item() < 0.5 * first


def test_caffe_policies():
    c = SolverConfig(lr_policy="inv", gamma=1e-4, power=0.75)
    assert lr_multiplier(c, 1000) == pytest.approx((1 + 0.1) ** -0.75)
    c = SolverConfig(lr_policy="step", gamma=0.1, stepsize=100)
    assert lr_multiplier(c, 99) == 1.0 and lr_multiplier(c, 250) == pytest.approx(0.01)
    c = SolverConfig(lr_policy="multistep", gamma=0.5, stepvalues=(10, 20))
    assert [lr_multiplier(c, i) for i in (0, 10, 25)] == [1.0, 0.5, 0.25]
    c = SolverConfig(lr_policy="exp", gamma=0.99)
    assert lr_multiplier(c, 10) == pytest.approx(0.99**10)
    c = SolverConfig(lr_policy="poly", power=2.0, max_iter=100)
    assert lr_multiplier(c, 50) == pytest.approx(0.25) and lr_multiplier(c, 100) == 0.0
    c = SolverConfig(lr_policy="sigmoid", gamma=0.1, stepsize=50)
    assert lr_multiplier(c, 50) == pytest.approx(0.5)
    c = SolverConfig(lr_policy="cosine", max_iter=100)
    assert lr_multiplier(c, 50) == pytest.approx(0.5) and lr_multiplier(c, 0) == 1.0


def test_scheduler_follows_the_policy_and_lr_mult():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    groups = [{"params": [a], "lr_mult": 1.0}, {"params": [b], "lr_mult": 2.0, "decay_mult": 0.0}]
    opt, sched = build_optimizer(groups, SolverConfig(base_lr=0.1, lr_policy="step", gamma=0.5, stepsize=2, weight_decay=0.01))
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    for _ in range(2):
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.05, 0.1])


def test_l1_regularization_adds_the_sign():
    p = torch.nn.Parameter(torch.tensor([2.0, -3.0]))
    opt, _ = build_optimizer([p], SolverConfig(base_lr=1.0, momentum=0.0, weight_decay=0.1, regularization="L1"))
    p.grad = torch.zeros(2)
    opt.step()
    assert p.detach().tolist() == pytest.approx([1.9, -2.9])


@pytest.mark.parametrize("bad", [
    {"base_lr": -0.1}, {"base_lr": float("nan")}, {"momentum": 1.0}, {"weight_decay": -1},
    {"regularization": "L3"}, {"type": "newton"}, {"lr_policy": "cyclic"}, {"iter_size": 0},
    {"lr_policy": "step", "stepsize": 0}, {"stepvalues": (5, 3)}, {"type": "nesterov", "momentum": 0.0},
])
def test_bad_settings_are_clear_errors(bad):
    with pytest.raises(ValueError):
        SolverConfig(**bad)


def test_round_trip_to_dict():
    c = SolverConfig(type="Adam", lr_policy="multistep", stepvalues=[3, 7])
    assert SolverConfig.from_dict(c.to_dict()) == c
    assert c.type is SolverType.ADAM and c.lr_policy is LRPolicy.MULTISTEP
    assert math.isclose(c.base_lr, 0.01)


def test_clip_gradients_clips_the_summed_gradient_of_iter_size_minibatches_as_caffe():
    # sgd_solver.cpp ApplyUpdate: ClipGradients() on the accumulated diff, then Normalize (/ iter_size),
    # then Regularize (+ decay * w), then the update
    import torch

    from sparknet.net import Net

    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    x = torch.randn(8, 4)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    start = [p.detach().clone() for p in module.parameters()]
    grads = []
    for half in (slice(0, 4), slice(4, 8)):
        module.zero_grad()
        torch.nn.functional.cross_entropy(module(x[half]), y[half]).backward()
        grads.append([p.grad.clone() for p in module.parameters()])
    summed = [a + b for a, b in zip(*grads)]
    norm = float(torch.sqrt(sum((g * g).sum() for g in summed)))
    clip = 0.75 * norm  # clips the sum; the mean (half the norm) would pass unclipped
    lr, decay = 0.1, 0.01
    want = [w - lr * (g * clip / norm / 2 + decay * w) for w, g in zip(start, summed)]
    for p, w in zip(module.parameters(), start):
        p.data.copy_(w)
    net = Net(module, SolverConfig(base_lr=lr, momentum=0.0, weight_decay=decay, iter_size=2, clip_gradients=clip),
              batch_size=4)
    net.set_training_data((x.numpy(), y.numpy()), shuffle=False)
    net.train(1)
    for got, w in zip(module.parameters(), want):
        torch.testing.assert_close(got.detach(), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [float("-inf"), float("nan"), 1.5, "x", None])
def test_stepvalues_that_are_not_whole_numbers_are_refused_clearly(bad):
    assert SolverConfig(lr_policy="multistep", stepvalues=[100, 200.0]).stepvalues == (100, 200)  # JSON's 200.0
    with pytest.raises(ValueError, match="stepvalues must hold whole numbers of iterations"):
        SolverConfig(lr_policy="multistep", stepvalues=[100, bad])


def test_a_linear_warm_up_rises_to_the_policy_and_cosine_falls_to_its_floor():
    c = SolverConfig(base_lr=0.1, lr_policy="cosine", max_iter=100, lr_warmup=10, min_lr=0.01)
    # (t + 1) / W of the policy's rate for t < W, then the policy's: cosine from base_lr to min_lr over max_iter
    assert [lr_multiplier(c, t) for t in (0, 4, 9)] == pytest.approx([0.1 * (0.1 + 0.9 * 0.5 * (1 + math.cos(
        math.pi * t / 100))) / 0.1 * (t + 1) / 10 for t in (0, 4, 9)])
    assert lr_multiplier(c, 10) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.1)))
    assert lr_multiplier(c, 100) == pytest.approx(0.1) and lr_multiplier(c, 500) == pytest.approx(0.1)
    fixed = SolverConfig(lr_policy="fixed", lr_warmup=4)
    assert [lr_multiplier(fixed, t) for t in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    plain = SolverConfig(lr_policy="inv", gamma=1e-4, power=0.75)  # no warm-up, no floor: Caffe's formula exactly
    assert lr_multiplier(plain, 1000) == (1.0 + 1e-4 * 1000) ** -0.75


def test_the_scheduler_warms_up_the_optimizer_and_so_does_a_net():
    from sparknet import zoo
    from sparknet.net import Net

    p = torch.nn.Parameter(torch.zeros(2))
    opt, sched = build_optimizer([p], SolverConfig(base_lr=0.1, lr_policy="fixed", lr_warmup=2))
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1])
    net = Net(zoo.mlp(input_shape=[4], hidden=[4], num_classes=2, batch_size=4),
              SolverConfig(base_lr=0.2, lr_policy="fixed", lr_warmup=4))
    net.set_training_data((torch.randn(16, 4), torch.randint(0, 2, (16,))))
    net.train(1)
    assert net.learning_rate == pytest.approx(0.1)  # the rate of the step that follows: 2 / 4 of 0.2


@pytest.mark.parametrize("settings, refusal", [
    ({"lr_warmup": -1}, "lr_warmup must be 0 or more"),
    ({"min_lr": 0.01}, "min_lr is the cosine policy's floor"),
    ({"lr_policy": "cosine", "min_lr": -0.1}, "min_lr must be in"),
    ({"lr_policy": "cosine", "base_lr": 0.01, "min_lr": 0.1}, "min_lr must be in"),
])
def test_warm_up_and_floor_settings_are_checked(settings, refusal):
    with pytest.raises(ValueError, match=refusal):
        SolverConfig(**settings)


def test_the_command_line_and_a_caffe_run_take_the_warm_up_the_floor_beta2_and_clipping():
    from sparknet._fields import from_args
    from sparknet.caffe.cli import _SOLVER_SETTINGS
    from sparknet.cli import parse_args
    from sparknet.config import RunConfig

    args = parse_args(["train", "--lr", "0.1", "--lr-policy", "cosine", "--lr-warmup", "50", "--min-lr", "0.001",
                       "--steps", "500", "--solver-type", "adamw", "--momentum2", "0.99", "--clip-gradients", "1"])
    solver = from_args(RunConfig, args).solver()
    assert (solver.lr_warmup, solver.min_lr, solver.max_iter) == (50, 0.001, 500)
    assert (solver.momentum2, solver.clip_gradients) == (0.99, 1.0)
    assert {"lr_warmup", "min_lr", "momentum2", "clip_gradients"} <= set(_SOLVER_SETTINGS)  # over a Caffe solver file
    with pytest.raises(ValueError, match="min_lr is the cosine policy's floor"):
        from_args(RunConfig, parse_args(["train", "--min-lr", "0.001"]))
