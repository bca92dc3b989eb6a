"""Caffe's rules of layer state, scaling and solver updates, one test per rule, each against Caffe's formula.

Every rule whose state or scaling could differ from Caffe's, and where its test is:

  rule                                                          test
  BatchNorm: decayed sums over a scale factor s = λs + 1        test_caffe_prototxt.py::test_batch_norm_statistics_follow_caffe_s_rule_of_decayed_sums_and_a_scale_factor
  BatchNorm: the three blobs in a .caffemodel                   test_caffe_prototxt.py::test_batch_norm_caffemodel_round_trip
  LRN across channels: k + alpha/n * sum, ** -beta              test_layers.py::test_lrn_matches_caffe_formula
  LRN within a channel: alpha/n², n² counting padded cells      test_layers.py::test_lrn_matches_caffe_formula
  LRN within a channel: 1 + ..., never k                        here: test_lrn_within_channel_adds_one_where_across_channels_adds_k
  Dropout: x / (1 - p) at train time, identity at test          here: test_dropout_scales_kept_units_by_the_inverse_keep_rate_in_training_only
  Pooling: ceil rounding, padding, the last window clipped,     test_layers.py::test_pool_output_size_is_caffes (against a loop copy
    MAX and AVE, AVE's divisor counting padded cells              of pooling_layer.cpp's forward), test_pool_stride_beyond_kernel_without_pad_is_rejected
  InnerProduct: flattening from axis                            test_layers.py::test_linear_flattens_from_axis_like_inner_product
  InnerProduct: transpose (weight kept as [K, N])               here: test_inner_product_transpose_keeps_caffe_s_weight_layout
  In-place ReLU                                                 test_layers.py::test_in_place_relu_rewrites_the_blob
  In-place ReLU + Dropout, readers before and after             here: test_in_place_layers_rewrite_the_blob_for_the_layers_after_them
  lr_mult / decay_mult into parameter groups                    test_layers.py::test_param_groups_follow_lr_and_decay_mult,
                                                                test_caffe_prototxt.py::test_lr_and_decay_mult_reach_param_groups,
                                                                test_solvers.py::test_scheduler_follows_the_policy_and_lr_mult
  lr_mult / decay_mult in each blob's update                    here: test_lr_and_decay_mult_scale_each_blob_s_update
  iter_size: the mean of the minibatches' gradients, one        here: test_iter_size_averages_the_minibatch_gradients_and_the_policy_counts_updates
    policy iteration per update
  clip_gradients: the summed gradient, before Normalize         test_solvers.py::test_clip_gradients_clips_the_summed_gradient_of_iter_size_minibatches_as_caffe
  Regularization L1: decay * sign(w)                            test_solvers.py::test_l1_regularization_adds_the_sign
  lr policies: the multiplier at chosen iterations              test_solvers.py::test_caffe_policies
  lr policies: the rate each update applies (update k uses      here: test_each_lr_policy_sets_the_rate_of_each_update_by_caffe_s_formula
    iteration k's rate)
  SGD: decay before momentum; Caffe's history holds the rate    here: test_sgd_matches_caffe_while_the_rate_is_constant_and_differs_after_it_changes
    (PyTorch's rule by default; Caffe's with caffe_history,     here: test_caffe_history_follows_caffe_through_every_change_of_rate,
    which a Caffe solver file sets)                             test_a_caffe_solver_file_gets_caffe_s_momentum_history_and_sparknet_s_own_default_keeps_pytorch_s
  Nesterov: step back, then over-step                           here: test_nesterov_matches_caffe_at_a_constant_rate,
                                                                test_caffe_history_follows_caffe_through_every_change_of_rate
  AdaGrad                                                       here: test_adagrad_matches_caffe
  RMSProp                                                       here: test_rmsprop_matches_caffe
  AdaDelta (momentum as the decay, the rate applied last)       here: test_adadelta_matches_caffe
  Adam: delta outside the bias correction (a documented         here: test_adam_differs_from_caffe_only_in_where_delta_enters
    difference)

The Caffe side of every test here is the rule written out with plain tensor operations (from
caffe.proto's documentation and the layers' and solvers' sources: lrn_layer.cpp,
dropout_layer.cpp, inner_product_layer.cpp, sgd_solver.cpp, nesterov_solver.cpp,
adagrad_solver.cpp, rmsprop_solver.cpp, adadelta_solver.cpp, adam_solver.cpp).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sparknet.caffe import load_caffemodel_into, load_net_prototxt, net_to_prototxt, write_caffemodel
from sparknet.errors import GraphError
from sparknet.layers import LinearLayer, LRNLayer, NetParams, RDDLayer
from sparknet.net import Net
from sparknet.optimizers import build_optimizer
from sparknet.solvers import SolverConfig, lr_multiplier

torch.set_num_threads(1)

Update = Callable[[dict, torch.Tensor, float, int], torch.Tensor]


# --------------------------------------------------------------------------- a fixed problem for the solvers


def _problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    a = torch.randn(32, 6, generator=g, dtype=torch.float64)
    b = torch.randn(32, generator=g, dtype=torch.float64)
    w0 = torch.randn(6, generator=g, dtype=torch.float64)
    return a, b, w0


def _grad(w: torch.Tensor) -> torch.Tensor:
    """The gradient of a fixed least-squares loss at ``w`` (the same problem for every solver)."""
    a, b, _ = _problem()
    w = w.detach().clone().requires_grad_(True)
    (0.5 * ((a @ w - b) ** 2).mean()).backward()
    return w.grad


def _sparknet_path(config: SolverConfig, steps: int) -> list[torch.Tensor]:
    """The weights after each of ``steps`` updates by sparknet's optimizer and schedule for ``config``."""
    w = torch.nn.Parameter(_problem()[2].clone())
    opt, sched = build_optimizer([w], config)
    path = []
    for _ in range(steps):
        w.grad = _grad(w)
        opt.step()
        sched.step()
        path.append(w.detach().clone())
    return path


def _caffe_path(config: SolverConfig, steps: int, update: Update, rate: Callable[[int], float]) -> list[torch.Tensor]:
    """The weights after each update by Caffe's ApplyUpdate: diff = gradient + decay * w (Regularize), then
    ``update(state, diff, rate(iter), iter)`` is the solver's ComputeUpdateValue, subtracted from w."""
    w = _problem()[2].clone()
    state: dict = {}
    path = []
    for it in range(steps):
        diff = _grad(w) + config.weight_decay * w
        w = w - update(state, diff, rate(it), it)
        path.append(w.clone())
    return path


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- layers


LRN_NET = """
input: "data"
input_shape {{ dim: 1 dim: 4 dim: 5 dim: 5 }}
layer {{ name: "lrn" type: "LRN" bottom: "data" top: "lrn"
        lrn_param {{ local_size: 3 alpha: 0.5 beta: 0.75 k: 2 norm_region: {region} }} }}
"""


def test_lrn_within_channel_adds_one_where_across_channels_adds_k(caplog):
    # lrn_layer.cpp: ACROSS_CHANNELS scales by (k + alpha/n * sum over n channels) ** -beta; WITHIN_CHANNEL is
    # built from an AVE pooling (sum / n²) and a Power layer with shift 1: its denominator adds 1 and k plays no part
    x = torch.randn(1, 4, 5, 5, generator=torch.Generator().manual_seed(0))
    padded = F.pad(x * x, (1, 1, 1, 1))
    window_sum = sum(padded[:, :, i:i + 5, j:j + 5] for i in range(3) for j in range(3))
    with caplog.at_level(logging.WARNING, logger="sparknet.caffe.prototxt"):
        within = load_net_prototxt(LRN_NET.format(region="WITHIN_CHANNEL")).build(seed=0)
    assert "k=2.0 is ignored" in caplog.text
    torch.testing.assert_close(within.run({"data": x})["lrn"], x * (1 + 0.5 / 9 * window_sum) ** -0.75)
    across = load_net_prototxt(LRN_NET.format(region="ACROSS_CHANNELS")).build(seed=0)
    channel_sum = sum(F.pad(x * x, (0, 0, 0, 0, 1, 1))[:, c:c + 4] for c in range(3))
    torch.testing.assert_close(across.run({"data": x})["lrn"], x * (2 + 0.5 / 3 * channel_sum) ** -0.75)
    # in the DSL a k that Caffe would ignore is refused, naming the layer
    with pytest.raises(GraphError, match="within_channel LRN has no k") as info:
        LRNLayer("norm", ["data"], norm_region="within_channel", k=2.0)
    assert info.value.layer == "norm"


DROPOUT_NET = """
input: "data"
input_shape { dim: 100 dim: 200 }
layer { name: "drop" type: "Dropout" bottom: "data" top: "out" dropout_param { dropout_ratio: 0.3 } }
"""


def test_dropout_scales_kept_units_by_the_inverse_keep_rate_in_training_only():
    # dropout_layer.cpp: TRAIN: top = bottom * mask * 1/(1 - ratio), mask ~ Bernoulli(1 - ratio), and the
    # gradient through it is mask * 1/(1 - ratio); TEST: top = bottom
    module = load_net_prototxt(DROPOUT_NET).build(seed=0)
    x = (torch.rand(100, 200, generator=torch.Generator().manual_seed(1)) + 0.5).requires_grad_(True)
    torch.manual_seed(2)
    module.train()
    out = module.run({"data": x})["out"]
    kept = out != 0
    torch.testing.assert_close(out[kept], x[kept] / 0.7)
    assert abs(1 - kept.float().mean().item() - 0.3) < 0.02  # 20,000 draws: 0.3 within 7 standard errors
    out.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() / 0.7)
    module.eval()
    assert torch.equal(module.run({"data": x})["out"], x)


INNER_PRODUCT_T = """
input: "data"
input_shape { dim: 2 dim: 3 dim: 4 }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 5 transpose: true weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "constant" value: 0.25 } } }
"""


def test_inner_product_transpose_keeps_caffe_s_weight_layout(tmp_path):
    # inner_product_layer.cpp: with transpose the weight blob is [K, N] and top = bottom (M x K) * W (K x N);
    # without it the blob is [N, K] and top = bottom * W^T. Flattening from axis 1: K = 3 * 4.
    net = load_net_prototxt(INNER_PRODUCT_T)
    module = net.build(seed=0)
    weight, bias = module.layer_weights()["ip"]
    assert weight.shape == (12, 5) and torch.equal(bias, torch.full((5,), 0.25))
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(module.run({"data": x})["ip"], x.reshape(2, 12) @ weight + bias)
    # the flag goes back to a prototxt, and a .caffemodel of the [K, N] blob loads into a fresh net
    assert "transpose: true" in net_to_prototxt(net)
    path = write_caffemodel(tmp_path / "t.caffemodel", module.layer_weights(), net)
    other = net.build(seed=1)
    assert not torch.equal(other.layer_weights()["ip"][0], weight)
    load_caffemodel_into(other, path)
    torch.testing.assert_close(other.run({"data": x})["ip"], module.run({"data": x})["ip"])
    # a transposed weight is not split for model parallelism
    with pytest.raises(GraphError, match="transpose"):
        LinearLayer("ip", ["data"], num_outputs=5, transpose=True, parallel="column")


IN_PLACE_NET = """
input: "data"
input_shape { dim: 64 dim: 6 }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1" inner_product_param { num_output: 8 } }
layer { name: "before" type: "InnerProduct" bottom: "ip1" top: "before" inner_product_param { num_output: 2 } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "drop1" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.5 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2" inner_product_param { num_output: 3 } }
"""


def test_in_place_layers_rewrite_the_blob_for_the_layers_after_them():
    # net.cpp runs layers in order on shared blobs: an in-place layer (top == bottom) rewrites the blob, so a layer
    # listed before it reads the old value (Caffe splits the blob for it) and every layer after it the new one;
    # gradients flow back through each rewrite
    module = load_net_prototxt(IN_PLACE_NET).build(seed=0)
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(4))
    ip1, before, ip2 = (module.layer_module(name) for name in ("ip1", "before", "ip2"))
    torch.manual_seed(5)
    module.train()
    blobs = module.run({"data": x})
    pre = ip1(x)
    torch.testing.assert_close(blobs["before"], before(pre))
    kept = blobs["ip1"] != 0
    assert 0 < kept.sum() < (pre > 0).sum()  # ReLU zeroed the negatives, Dropout about half the rest
    assert bool((pre[kept] > 0).all())
    torch.testing.assert_close(blobs["ip1"], torch.where(kept, pre / 0.5, torch.zeros_like(pre)))
    torch.testing.assert_close(blobs["ip2"], ip2(blobs["ip1"]))
    blobs["ip2"].sum().backward()
    want = (ip2.weight.detach().sum(0) * kept / 0.5).T @ x  # d(sum ip2)/d(W1) through the mask and the ReLU
    torch.testing.assert_close(ip1.weight.grad, want)
    module.eval()
    torch.testing.assert_close(module.run({"data": x})["ip2"], ip2(F.relu(pre)))


MULT_NET = """
input: "data"
input: "label"
input_shape { dim: 16 dim: 5 }
input_shape { dim: 16 }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        inner_product_param { num_output: 4 bias_filler { type: "constant" value: 0.5 } } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        param { lr_mult: 0.5 decay_mult: 3 } param { lr_mult: 0 decay_mult: 1 }
        inner_product_param { num_output: 3 bias_filler { type: "constant" value: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def test_lr_and_decay_mult_scale_each_blob_s_update():
    # sgd_solver.cpp: each blob's local_decay = weight_decay * decay_mult (Regularize) and local_rate = rate * lr_mult
    # (ComputeUpdateValue): w <- w - local_rate * (gradient + local_decay * w), momentum 0
    module = load_net_prototxt(MULT_NET).build(seed=0)
    lr, decay = 0.1, 0.05
    opt, _ = build_optimizer(module, SolverConfig(base_lr=lr, momentum=0.0, weight_decay=decay))
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(6))
    y = torch.arange(16) % 3
    blobs = [t for name in ("ip1", "ip2") for t in module.layer_weights()[name]]
    before = [t.detach().clone() for t in blobs]
    module.loss(x, y)[0].backward()
    grads = [t.grad.clone() for t in blobs]
    opt.step()
    multipliers = [(1, 1), (2, 0), (0.5, 3), (0, 1)]  # (lr_mult, decay_mult): ip1 weight, bias; ip2 weight, bias
    for t, w, g, (lr_mult, decay_mult) in zip(blobs, before, grads, multipliers):
        torch.testing.assert_close(t.detach(), w - lr * lr_mult * (g + decay * decay_mult * w))
    assert torch.equal(blobs[3].detach(), before[3])  # lr_mult 0: the blob does not move


def test_iter_size_averages_the_minibatch_gradients_and_the_policy_counts_updates():
    # solver.cpp Step: iter_size forward/backward passes accumulate the diffs, Normalize divides them by iter_size,
    # then one ApplyUpdate at the rate of iteration iter_, which counts updates, not minibatches
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    y = torch.arange(16) % 3
    start = [p.detach().clone() for p in module.parameters()]
    lr, decay, iter_size, batch = 0.2, 0.01, 2, 4
    want = [w.clone() for w in start]
    reference = torch.nn.Linear(4, 3)
    for it in range(2):  # two updates over four minibatches, in order
        rate = lr * 0.5 ** it  # step policy, stepsize 1, gamma 0.5
        summed = [torch.zeros_like(w) for w in want]
        for b in range(iter_size):
            rows = slice((it * iter_size + b) * batch, (it * iter_size + b + 1) * batch)
            with torch.no_grad():
                for p, w in zip(reference.parameters(), want):
                    p.copy_(w)
            reference.zero_grad()
            F.cross_entropy(reference(x[rows]), y[rows]).backward()
            summed = [s + p.grad for s, p in zip(summed, reference.parameters())]
        want = [w - rate * (s / iter_size + decay * w) for w, s in zip(want, summed)]
    config = SolverConfig(base_lr=lr, momentum=0.0, weight_decay=decay, iter_size=iter_size, lr_policy="step",
                          stepsize=1, gamma=0.5)
    net = Net(module, config, batch_size=batch)
    net.set_training_data((x.numpy(), y.numpy()), shuffle=False)
    net.train(2)
    assert net.iteration == 2 and net.learning_rate == pytest.approx(lr * 0.25)
    for got, w in zip(module.parameters(), want):
        torch.testing.assert_close(got.detach(), w)


# --------------------------------------------------------------------------- learning-rate policies


BASE_LR = 0.1
POLICIES = {  # sparknet's settings -> Caffe's formula for the rate at iteration it (sgd_solver.cpp GetLearningRate)
    "fixed": ({}, lambda it: BASE_LR),
    "step": ({"gamma": 0.5, "stepsize": 3}, lambda it: BASE_LR * 0.5 ** math.floor(it / 3)),
    "multistep": ({"gamma": 0.5, "stepvalues": (2, 5, 9)},
                  lambda it: BASE_LR * 0.5 ** sum(1 for v in (2, 5, 9) if it >= v)),
    "exp": ({"gamma": 0.9}, lambda it: BASE_LR * 0.9 ** it),
    "inv": ({"gamma": 0.1, "power": 0.75}, lambda it: BASE_LR * (1 + 0.1 * it) ** -0.75),
    "poly": ({"power": 2.0, "max_iter": 12}, lambda it: BASE_LR * (1 - it / 12) ** 2.0),
    "sigmoid": ({"gamma": -0.5, "stepsize": 6}, lambda it: BASE_LR / (1 + math.exp(0.5 * (it - 6)))),
}


def _rates(config: SolverConfig, updates: int = 12) -> list[float]:
    """The rate of each update: with diff = 1 and no momentum, each update's size is the rate itself."""
    w = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt, sched = build_optimizer([w], config)
    rates = []
    for _ in range(updates):
        with torch.no_grad():
            w.zero_()
        w.grad = torch.ones(1, dtype=torch.float64)
        opt.step()
        sched.step()
        rates.append(-float(w.detach()))
    return rates


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_each_lr_policy_sets_the_rate_of_each_update_by_caffe_s_formula(policy):
    # Caffe's Step: ApplyUpdate uses GetLearningRate() at iter_ and only then ++iter_, so update k (from 0) moves
    # the weights by rate(k) * diff. With diff = 1 and no momentum, each update's size is the rate itself.
    settings, caffe_rate = POLICIES[policy]
    rates = _rates(SolverConfig(base_lr=BASE_LR, momentum=0.0, lr_policy=policy, **settings))
    want = [caffe_rate(it) for it in range(12)]
    assert rates == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert (len(set(want)) == 1) == (policy == "fixed")  # every other policy moves the rate within 12 updates


def test_multistep_moves_past_one_step_value_an_iteration_as_caffe_does():
    values = (2, 2, 2, 7, 7)

    def caffe_rate(it: int) -> float:  # sgd_solver.cpp: current_step_ advances at most once per iteration
        step = 0
        for i in range(it + 1):
            if step < len(values) and i >= values[step]:
                step += 1
        return BASE_LR * 0.5**step

    rates = _rates(SolverConfig(base_lr=BASE_LR, momentum=0.0, lr_policy="multistep", gamma=0.5, stepvalues=values))
    want = [caffe_rate(it) for it in range(12)]
    assert rates == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert want[2:5] == [BASE_LR / 2, BASE_LR / 4, BASE_LR / 8]  # the repeated 2 takes iterations 2, 3 and 4


@pytest.mark.parametrize("solver", ["AdaGrad", "RMSProp"])
def test_a_caffe_adagrad_or_rmsprop_solver_with_momentum_is_refused_as_caffe_refuses_it(solver):
    from sparknet.caffe.prototxt import PrototxtError
    from sparknet.caffe.solver import load_solver_prototxt

    text = f'net: "n.prototxt"\ntype: "{solver}"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 10\n'
    assert load_solver_prototxt(text + "momentum: 0\n").config.momentum == 0
    with pytest.raises(PrototxtError, match=f"momentum cannot be used with {solver}"):
        load_solver_prototxt(text + "momentum: 0.9\n")
    if solver == "RMSProp":
        with pytest.raises(PrototxtError, match="rms_decay should lie between 0 and 1"):
            load_solver_prototxt(text + "rms_decay: 1.0\n")


# --------------------------------------------------------------------------- solvers


def _caffe_sgd(momentum: float) -> Update:
    def update(state: dict, diff: torch.Tensor, rate: float, it: int) -> torch.Tensor:
        # history <- momentum * history + local_rate * diff; the update is the history
        state["h"] = momentum * state.get("h", torch.zeros_like(diff)) + rate * diff
        return state["h"]
    return update


def test_sgd_matches_caffe_while_the_rate_is_constant_and_differs_after_it_changes():
    """A documented difference: Caffe's SGD history holds rate-scaled steps, PyTorch's holds gradients.

    Both add the weight decay to the gradient before the momentum (Regularize, then ComputeUpdateValue). Caffe
    keeps ``v <- m v + rate_t d_t`` and steps by ``v``; PyTorch keeps ``b <- m b + d_t`` and steps by
    ``rate_t b``. While the rate is constant ``v = rate b`` and the two are the same; at the first update after
    the rate changes (here iteration 5 of a step policy) PyTorch's step is smaller by exactly
    ``m * v * (1 - rate_5 / rate_4)``, the old history rescaled to the new rate at once where Caffe lets it decay.
    Making sparknet's own solvers follow Caffe here would move the final weights of existing seeded runs (their
    float rounding changes even at a constant rate), so ``SolverConfig`` keeps PyTorch's rule by default; a Caffe
    solver file gets Caffe's (``caffe_history``: the next tests).
    """
    m, gamma = 0.9, 0.1
    config = SolverConfig(base_lr=0.05, momentum=m, weight_decay=0.01, lr_policy="step", stepsize=5, gamma=gamma)
    ours = _sparknet_path(config, 8)
    caffe = _caffe_path(config, 8, _caffe_sgd(m), lambda it: 0.05 * gamma ** (it // 5))
    assert all(_close(a, b) for a, b in zip(ours[:5], caffe[:5]))
    history = ours[3] - ours[4]  # v_4: the step of update 4, the last at the first rate
    torch.testing.assert_close(ours[5] - caffe[5], m * history * (1 - gamma), rtol=1e-9, atol=1e-15)
    assert not torch.allclose(ours[5], caffe[5], rtol=1e-6, atol=0)
    assert not torch.allclose(ours[7], caffe[7], rtol=1e-6, atol=0)


def test_nesterov_matches_caffe_at_a_constant_rate():
    # nesterov_solver.cpp: h_prev = h; h <- m h + rate * diff; the step is (1 + m) h - m h_prev. (Like SGD's,
    # its history holds rate-scaled steps, so it too parts from PyTorch's when the rate changes.)
    m = 0.9

    def update(state: dict, diff: torch.Tensor, rate: float, it: int) -> torch.Tensor:
        previous = state.get("h", torch.zeros_like(diff))
        state["h"] = m * previous + rate * diff
        return (1 + m) * state["h"] - m * previous

    config = SolverConfig(type="nesterov", base_lr=0.05, momentum=m, weight_decay=0.01)
    ours, caffe = _sparknet_path(config, 10), _caffe_path(config, 10, update, lambda it: 0.05)
    assert all(_close(a, b) for a, b in zip(ours, caffe))
    assert not _close(ours[-1], _caffe_path(config, 10, _caffe_sgd(m), lambda it: 0.05)[-1])  # not plain momentum


def _caffe_nesterov(momentum: float) -> Update:
    def update(state: dict, diff: torch.Tensor, rate: float, it: int) -> torch.Tensor:
        previous = state.get("h", torch.zeros_like(diff))
        state["h"] = momentum * previous + rate * diff
        return (1 + momentum) * state["h"] - momentum * previous
    return update


@pytest.mark.parametrize("solver", ["sgd", "nesterov"])
@pytest.mark.parametrize("policy", [{"lr_policy": "step", "stepsize": 5, "gamma": 0.1},
                                    {"lr_policy": "multistep", "stepvalues": (2, 3, 6), "gamma": 0.3},
                                    {"lr_policy": "inv", "gamma": 0.5, "power": 0.75}],
                         ids=["step", "multistep", "inv"])
def test_caffe_history_follows_caffe_through_every_change_of_rate(solver, policy):
    """With ``caffe_history`` (what a Caffe solver file sets) the history is Caffe's, the step itself: the weights
    follow sgd_solver.cpp / nesterov_solver.cpp through every change of rate, where PyTorch's rule parts from them
    at the first change."""
    m = 0.9
    config = SolverConfig(type=solver, base_lr=0.05, momentum=m, weight_decay=0.01, caffe_history=True, **policy)
    update = _caffe_sgd(m) if solver == "sgd" else _caffe_nesterov(m)
    ours = _sparknet_path(config, 10)
    caffe = _caffe_path(config, 10, update, lambda it: 0.05 * lr_multiplier(config, it))
    assert all(_close(a, b) for a, b in zip(ours, caffe)), [float((a - b).abs().max()) for a, b in zip(ours, caffe)]
    pytorch = _sparknet_path(config.replace(caffe_history=False), 10)
    assert not torch.allclose(pytorch[-1], caffe[-1], rtol=1e-6, atol=0)  # the test tells the two rules apart


def test_a_caffe_solver_file_gets_caffe_s_momentum_history_and_sparknet_s_own_default_keeps_pytorch_s():
    from sparknet.caffe.solver import load_solver_prototxt

    base = 'base_lr: 0.01\nlr_policy: "step"\nstepsize: 100\ngamma: 0.1\nmax_iter: 1000\nmomentum: 0.9\n'
    assert load_solver_prototxt(base).config.caffe_history
    assert load_solver_prototxt(base + 'type: "Nesterov"\n').config.caffe_history
    adam = load_solver_prototxt(base + 'type: "Adam"\nmomentum2: 0.999\n').config
    assert not adam.caffe_history and adam.caffe_delta  # Adam's own Caffe rule instead
    assert not load_solver_prototxt(base).config.caffe_delta
    assert not SolverConfig().caffe_history  # seeded runs of sparknet's own solvers keep their weights
    with pytest.raises(ValueError, match="caffe_history"):
        SolverConfig(type="adam", caffe_history=True)
    assert not SolverConfig(type="adam").caffe_delta
    with pytest.raises(ValueError, match="caffe_delta is a rule of the adam solver, not of adamw"):
        SolverConfig(type="adamw", caffe_delta=True)


def test_caffe_history_state_round_trips_through_the_optimizer_state():
    """A checkpoint keeps Caffe's history as it keeps PyTorch's (``momentum_buffer``), so a resumed run goes on
    exactly."""
    config = SolverConfig(base_lr=0.05, momentum=0.9, weight_decay=0.01, caffe_history=True, lr_policy="step",
                          stepsize=3, gamma=0.5)
    assert torch.equal(_resumed_path(config, 4, 4), _sparknet_path(config, 8)[-1])


def _resumed_path(config: SolverConfig, before: int, after: int) -> torch.Tensor:
    """The weights after ``before`` updates, the optimizer and schedule saved and loaded into a fresh pair, and
    ``after`` more."""
    w = torch.nn.Parameter(_problem()[2].clone())
    opt, sched = build_optimizer([w], config)
    for _ in range(before):
        w.grad = _grad(w)
        opt.step()
        sched.step()
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2, sched2 = build_optimizer([w2], config)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    for _ in range(after):
        w2.grad = _grad(w2)
        opt2.step()
        sched2.step()
    return w2.detach()


STEP_RATE = {"lr_policy": "step", "stepsize": 4, "gamma": 0.5}  # the adaptive rules agree even as the rate changes


def _step_rate(base_lr: float) -> Callable[[int], float]:
    return lambda it: base_lr * 0.5 ** (it // 4)


def test_adagrad_matches_caffe():
    # adagrad_solver.cpp: h <- h + diff²; the step is rate * diff / (sqrt(h) + delta)
    def update(state: dict, diff: torch.Tensor, rate: float, it: int) -> torch.Tensor:
        state["h"] = state.get("h", torch.zeros_like(diff)) + diff * diff
        return rate * diff / (state["h"].sqrt() + 1e-3)

    config = SolverConfig(type="adagrad", base_lr=0.3, weight_decay=0.01, delta=1e-3, **STEP_RATE)
    ours, caffe = _sparknet_path(config, 10), _caffe_path(config, 10, update, _step_rate(0.3))
    assert all(_close(a, b) for a, b in zip(ours, caffe))


def test_rmsprop_matches_caffe():
    # rmsprop_solver.cpp: h <- rms_decay h + (1 - rms_decay) diff²; the step is rate * diff / (sqrt(h) + delta)
    def update(state: dict, diff: torch.Tensor, rate: float, it: int) -> torch.Tensor:
        state["h"] = 0.9 * state.get("h", torch.zeros_like(diff)) + 0.1 * diff * diff
        return rate * diff / (state["h"].sqrt() + 1e-3)

    config = SolverConfig(type="rmsprop", base_lr=0.02, weight_decay=0.01, rms_decay=0.9, delta=1e-3, **STEP_RATE)
    ours, caffe = _sparknet_path(config, 10), _caffe_path(config, 10, update, _step_rate(0.02))
    assert all(_close(a, b) for a, b in zip(ours, caffe))


def test_adadelta_matches_caffe():
    # adadelta_solver.cpp, momentum as the decay: h <- m h + (1 - m) diff²;
    # u = diff * sqrt((h_u + delta) / (h + delta)); h_u <- m h_u + (1 - m) u²; the step is rate * u
    m, delta = 0.95, 1e-4

    def update(state: dict, diff: torch.Tensor, rate: float, it: int) -> torch.Tensor:
        zero = torch.zeros_like(diff)
        state["h"] = m * state.get("h", zero) + (1 - m) * diff * diff
        u = diff * ((state.get("u", zero) + delta) / (state["h"] + delta)).sqrt()
        state["u"] = m * state.get("u", zero) + (1 - m) * u * u
        return rate * u

    config = SolverConfig(type="adadelta", base_lr=1.0, momentum=m, weight_decay=0.01, delta=delta, **STEP_RATE)
    ours, caffe = _sparknet_path(config, 10), _caffe_path(config, 10, update, _step_rate(1.0))
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-13) for a, b in zip(ours, caffe))


def _caffe_adam(beta1: float, beta2: float, delta: Callable[[int], float]) -> Update:
    def update(state: dict, diff: torch.Tensor, rate: float, it: int) -> torch.Tensor:
        # adam_solver.cpp, t = iter + 1: m <- b1 m + (1 - b1) diff; v <- b2 v + (1 - b2) diff²;
        # the step is rate * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + delta)
        t = it + 1
        state["m"] = beta1 * state.get("m", torch.zeros_like(diff)) + (1 - beta1) * diff
        state["v"] = beta2 * state.get("v", torch.zeros_like(diff)) + (1 - beta2) * diff * diff
        correction = math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        return rate * correction * state["m"] / (state["v"].sqrt() + delta(t))
    return update


def test_adam_differs_from_caffe_only_in_where_delta_enters():
    """sparknet's own Adam (not a Caffe solver file's): PyTorch's adds delta after the bias correction, Caffe's
    before it.

    Caffe steps by ``rate * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + delta)``; PyTorch by
    ``rate / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + delta)``, which is Caffe's step with delta
    replaced by ``delta * sqrt(1 - b2^t)``. Everything else (moments, bias corrections, t = iteration + 1,
    decay added to the gradient, the rate applied last) is Caffe's. With Caffe's default delta of 1e-8 the
    two differ by about delta / sqrt(v), far below float32 rounding for any gradient above 1e-6; with a large
    delta they part visibly, as here.
    """
    b1, b2, delta = 0.9, 0.999, 0.05
    config = SolverConfig(type="adam", base_lr=0.01, momentum=b1, momentum2=b2, weight_decay=0.01, delta=delta,
                          **STEP_RATE)
    ours = _sparknet_path(config, 10)
    shifted = _caffe_path(config, 10, _caffe_adam(b1, b2, lambda t: delta * math.sqrt(1 - b2 ** t)), _step_rate(0.01))
    assert all(_close(a, b) for a, b in zip(ours, shifted))
    caffe = _caffe_path(config, 10, _caffe_adam(b1, b2, lambda t: delta), _step_rate(0.01))
    moved = (ours[-1] - _problem()[2]).abs()
    assert float(((ours[-1] - caffe[-1]).abs() / moved).max()) > 0.05  # Caffe's delta slows its small steps more


def test_a_caffe_adam_adds_delta_where_caffe_does_and_resumes_exactly():
    """``caffe_delta`` (a Caffe solver file's Adam) follows adam_solver.cpp with the large delta that tells the
    two placements apart, through a change of rate; a saved optimizer state resumes on the same path."""
    b1, b2, delta = 0.9, 0.999, 0.05
    config = SolverConfig(type="adam", base_lr=0.01, momentum=b1, momentum2=b2, weight_decay=0.01, delta=delta,
                          caffe_delta=True, **STEP_RATE)
    ours = _sparknet_path(config, 10)
    caffe = _caffe_path(config, 10, _caffe_adam(b1, b2, lambda t: delta), _step_rate(0.01))
    assert all(_close(a, b) for a, b in zip(ours, caffe)), [float((a - b).abs().max()) for a, b in zip(ours, caffe)]
    pytorch = _sparknet_path(config.replace(caffe_delta=False), 10)
    assert not torch.allclose(pytorch[-1], caffe[-1], rtol=1e-6, atol=0)
    assert torch.equal(_resumed_path(config, 6, 4), ours[-1])  # saved after six updates: the same ten
