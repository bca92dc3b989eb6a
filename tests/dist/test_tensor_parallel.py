"""Tensor (model) parallelism in two real gloo processes on loopback.

Each test spawns two processes (the machine has two cores); every process group is
destroyed in ``finally`` and every collective has a timeout.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _two_ranks import run_two_ranks
from sparknet.layers import (
    ActivationLayer,
    ConvLayer,
    LinearLayer,
    NetParams,
    PoolLayer,
    RDDLayer,
    SoftmaxWithLoss,
)
from sparknet.net import Net
from sparknet.parallel import (
    WeightBudgetError,
    build_parallel,
    check_weight_budget,
    gather_full_weights,
    init_layout,
    layout_coords,
    local_weight_bytes,
    parallelize,
    resolve_plan,
    share_data_over_mp,
    weight_bytes_per_rank,
)
from sparknet.collective import CollectiveExchange
from sparknet.loop import FitPlan, StopRule, run_rounds
from sparknet.solvers import SolverConfig
from sparknet.strategies import Average
from sparknet.weights import WeightCollection

TOL = 1e-5


# --------------------------------------------------------------------------- nets


def _mlp() -> NetParams:
    """whole -> column -> row (a pair: nothing between them) -> lone column (gathered) -> loss."""
    return NetParams(
        RDDLayer("data", shape=[5, 1, 4, 4]),
        RDDLayer("label", shape=[5], dtype="int64"),
        LinearLayer("ip0", ["data"], num_outputs=12),
        ActivationLayer("relu0", ["ip0"], tops=["ip0"]),
        LinearLayer("ip1", ["ip0"], num_outputs=8, parallel="column"),
        ActivationLayer("relu1", ["ip1"], tops=["ip1"]),
        LinearLayer("ip2", ["ip1"], num_outputs=6, parallel="row"),
        ActivationLayer("tanh2", ["ip2"], activation="tanh"),
        LinearLayer("ip3", ["tanh2"], num_outputs=4, parallel="column"),
        SoftmaxWithLoss("loss", ["ip3", "label"]),
        name="tp_mlp",
    )


def _cnn() -> NetParams:
    """A convolution split by output channels feeding a row-split Linear through pooling."""
    return NetParams(
        RDDLayer("data", shape=[3, 2, 8, 8]),
        RDDLayer("label", shape=[3], dtype="int64"),
        ConvLayer("conv1", ["data"], kernel=3, num_filters=4),
        ActivationLayer("relu1", ["conv1"], tops=["conv1"]),
        PoolLayer("pool1", ["conv1"], kernel=2, stride=2),
        LinearLayer("ip1", ["pool1"], num_outputs=5),
        SoftmaxWithLoss("loss", ["ip1", "label"]),
        name="tp_cnn",
    )


def _slice(full: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor:
    """The part of ``full`` that a shard shaped like ``local`` holds on ``rank`` (of 2)."""
    for dim in range(full.dim()):
        if full.shape[dim] != local.shape[dim]:
            return full.chunk(2, dim)[rank]
    return full


def _compare_grads(split_module, ref_module) -> float:
    worst = 0.0
    for (name, p), (_, q) in zip(split_module.module.named_parameters(), ref_module.named_parameters()):
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        worst = max(worst, float((local - _slice(q.grad, local, dist.get_rank())).abs().max()))
    return worst


# --------------------------------------------------------------------------- equivalence


def _counts(comm) -> dict[str, int]:
    return {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}


def _equivalence(rank, out):
    from torch.distributed.tensor.debug import CommDebugMode

    layout = init_layout(model_parallel=2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 1, 4, 4, generator=g), torch.randint(0, 4, (5,), generator=g)

    ref = _mlp().build(seed=0)
    split = parallelize(_mlp().build(seed=0), layout)
    out[f"plan{rank}"] = split.plan.describe()
    with CommDebugMode() as comm:
        loss, pred = split.loss(x, y)
        out[f"forward_comms{rank}"] = _counts(comm)
        loss.backward()
        out[f"all_comms{rank}"] = _counts(comm)
    ref_loss, ref_pred = ref.loss(x, y)
    ref_loss.backward()
    out[f"pred_diff{rank}"] = float((pred - ref_pred).detach().abs().max())
    out[f"loss_diff{rank}"] = float((loss - ref_loss).abs())
    out[f"grad_diff{rank}"] = _compare_grads(split, ref)
    out[f"shapes{rank}"] = {n: tuple(t.shape) for n, ts in split.layer_weights().items() for t in ts[:1]}

    # Gradient clipping over the whole model (torch's refuses mixed DTensor and plain gradients).
    norm = split.clip_grad_norm_(0.05)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    out[f"clip_norm_diff{rank}"] = float((norm - ref_norm).abs()) if ref_norm > 0.05 else 1.0  # it did clip
    out[f"clipped_grad_diff{rank}"] = _compare_grads(split, ref)

    # Training through Net: SGD with momentum on DTensor parameters, three steps, against the
    # unsplit net (RMSprop is exercised by the budget test: its 1/sqrt(v) scaling magnifies
    # rounding differences near zero gradients beyond an absolute 1e-5).
    solver = SolverConfig(base_lr=0.1, momentum=0.9)
    xs, ys = torch.randn(15, 1, 4, 4, generator=g), torch.randint(0, 4, (15,), generator=g)
    nets = []
    for module in (parallelize(_mlp().build(seed=0), layout), _mlp().build(seed=0)):
        net = Net(module, solver, batch_size=5, seed=3)
        net.set_training_data((xs, ys), shuffle=False)
        net.train(3)
        nets.append(net)
    full = gather_full_weights(nets[0])
    out[f"trained_diff{rank}"] = full.max_abs_diff(nets[1].get_weights())
    out[f"flat{rank}"] = nets[0].get_flat().numel()
    out[f"whole_flat{rank}"] = nets[1].get_flat().numel()

    # A convolution split by output channels, then pooled into a row-split Linear.
    cnn_ref = _cnn().build(seed=0)
    cnn = parallelize(_cnn().build(seed=0), layout, plan={"conv1": "column", "ip1": "row"})
    out[f"cnn_plan{rank}"] = cnn.plan.describe()
    xc, yc = torch.randn(3, 2, 8, 8, generator=g), torch.randint(0, 5, (3,), generator=g)
    with CommDebugMode() as comm:
        loss, pred = cnn.loss(xc, yc)
        out[f"cnn_comms{rank}"] = _counts(comm)
        loss.backward()
    ref_loss, ref_pred = cnn_ref.loss(xc, yc)
    ref_loss.backward()
    out[f"cnn_pred_diff{rank}"] = float((pred - ref_pred).detach().abs().max())
    out[f"cnn_grad_diff{rank}"] = _compare_grads(cnn, cnn_ref)

    # An engine's worker: the driver's whole weights in, split, pooled data, whole weights out.
    whole = Net(_mlp(), seed=5).get_flat()
    px, py = share_data_over_mp(xs.numpy()[rank::2], ys.numpy()[rank::2], layout)
    out[f"worker_rows{rank}"] = len(px)
    module = _mlp().build(seed=0)
    WeightCollection(module.layer_weights()).load_flat_(whole)
    split = Net(parallelize(module, layout))
    out[f"worker_roundtrip{rank}"] = float((gather_full_weights(split).to_flat(torch.float32) - whole).abs().max())


@pytest.mark.timeout(180)
def test_column_row_split_matches_unsplit_model():
    out = run_two_ranks(_equivalence)
    for rank in (0, 1):
        assert out[f"pred_diff{rank}"] < TOL
        assert out[f"loss_diff{rank}"] < TOL
        assert out[f"grad_diff{rank}"] < TOL
        assert out[f"clip_norm_diff{rank}"] < TOL and out[f"clipped_grad_diff{rank}"] < TOL
        assert out[f"trained_diff{rank}"] < TOL
        assert out[f"cnn_pred_diff{rank}"] < TOL
        assert out[f"cnn_grad_diff{rank}"] < TOL
    assert out["plan0"].splitlines() == ["ip1: column (output stays split)",
                                         "ip2: row (input arrives split on axis 1)",
                                         "ip3: column (output all-gathered)"]
    # Forward: the column-row pair costs one all-reduce (after the row layer) and nothing
    # between the two; the lone column layer costs one all-gather.
    assert out["forward_comms0"] == {"all_reduce": 1, "all_gather_into_tensor": 1}
    # Backward: the input gradients of the two column layers are all-reduced.
    assert out["all_comms0"] == {"all_reduce": 3, "all_gather_into_tensor": 1}
    assert out["cnn_comms0"] == {"all_reduce": 1}
    # Each rank holds half of every split weight.
    assert out["shapes0"] == {"ip0": (12, 16), "ip1": (4, 12), "ip2": (6, 4), "ip3": (2, 6)}
    whole = out["whole_flat0"]
    assert out["flat0"] == whole - (12 * 4 + 4 + 6 * 4 + 2 * 6 + 2)  # the other rank's halves
    assert out["worker_rows0"] == out["worker_rows1"] == 15  # the replica's two partitions, pooled
    assert out["worker_roundtrip0"] == out["worker_roundtrip1"] == 0.0


# --------------------------------------------------------------------------- memory budget


def _wide_mlp(width: int = 2048) -> NetParams:
    return NetParams(
        RDDLayer("data", shape=[16, 64]),
        RDDLayer("label", shape=[16], dtype="int64"),
        LinearLayer("ip1", ["data"], num_outputs=width, parallel="column"),
        ActivationLayer("relu1", ["ip1"], tops=["ip1"]),
        LinearLayer("ip2", ["ip1"], num_outputs=width, parallel="row"),
        ActivationLayer("relu2", ["ip2"], tops=["ip2"]),
        LinearLayer("ip3", ["ip2"], num_outputs=10),
        SoftmaxWithLoss("loss", ["ip3", "label"]),
        name="wide_mlp",
    )


BUDGET = 12_000_000  # bytes of weights one worker may hold; the whole net needs ~17.3 MB


def _budget(rank, out):
    layout = init_layout(model_parallel=2)
    module = build_parallel(_wide_mlp(), layout, seed=0, max_weight_bytes=BUDGET)
    net = Net(module, SolverConfig(type="rmsprop", base_lr=1e-3), batch_size=16, seed=7)
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(10, 64)).astype(np.float32)
    labels = rng.integers(0, 10, size=256)
    x = centers[labels] + 0.5 * rng.normal(size=(256, 64)).astype(np.float32)
    net.set_training_data((x, labels))
    before = net.evaluate((x, labels)).loss
    net.train(30)
    out[f"loss{rank}"] = (before, net.evaluate((x, labels)).loss)
    out[f"bytes{rank}"] = local_weight_bytes(net)
    out[f"grad_finite{rank}"] = all(torch.isfinite(t).all() for t in net.get_weights().state_dict().values())


@pytest.mark.timeout(180)
def test_mlp_over_one_workers_budget_trains_split_in_two():
    net = _wide_mlp()
    whole = weight_bytes_per_rank(net, 1)
    assert whole > BUDGET
    with pytest.raises(WeightBudgetError, match="model-parallel 2"):
        check_weight_budget(net, BUDGET, model_parallel=1)
    out = run_two_ranks(_budget)
    for rank in (0, 1):
        before, after = out[f"loss{rank}"]
        assert after < 0.5 * before
        assert out[f"grad_finite{rank}"]
        held = out[f"bytes{rank}"]
        assert held <= BUDGET
        assert held == weight_bytes_per_rank(net, 2)
        assert 0.49 < held / whole < 0.52  # about half: only ip3 and ip2's bias are held whole
    assert out["loss0"] == out["loss1"]  # the two halves compute one model


# --------------------------------------------------------------------------- the 2-D layout


def test_layout_coords_are_row_major():
    assert [layout_coords(r, 6, 2) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    with pytest.raises(ValueError, match="multiple of --model-parallel"):
        layout_coords(0, 6, 4)


def test_plan_overrides_and_errors():
    module = _mlp().build(seed=0)
    plan = resolve_plan(module, 2, {"ip3": None, "ip2": None})
    assert plan.modes == {"ip1": "column"} and plan.gather == {"ip1": True}
    with pytest.raises(ValueError, match="does not divide"):
        resolve_plan(module, 3)
    with pytest.raises(ValueError, match="does not have"):
        resolve_plan(module, 2, {"nope": "row"})
    with pytest.raises(ValueError, match="only LinearLayer"):
        resolve_plan(module, 2, {"relu0": "column"})


def _data_parallel(rank, out):
    layout = init_layout(model_parallel=1)  # D = 2 replicas of a whole model
    x = np.full((4, 1, 4, 4), float(rank), np.float32)
    y = np.full(4, rank, np.int64)
    shared = share_data_over_mp(x, y, layout)  # M = 1: each keeps its own
    out[f"shared{rank}"] = float(shared[0].mean())
    batch = 4 if rank == 0 else 2  # rank 0 processes 8 samples in its 2 steps, rank 1 only 4
    net = Net(_mlp(), SolverConfig(base_lr=0.1, momentum=0.0), batch_size=batch, seed=0)
    net.set_training_data((x, y), shuffle=False)
    start = net.get_flat()
    exchange = CollectiveExchange(net, Average(), rank=layout.dp_rank, world=layout.data_parallel,
                                  group=layout.dp_group)
    records = []
    out[f"global{rank}"] = run_rounds(exchange, FitPlan(strategy=Average(), stop=StopRule(rounds=1, tau=2)), start,
                                      on_record=records.append)
    out[f"samples{rank}"] = records[0]["samples"]
    alone = Net(_mlp(), SolverConfig(base_lr=0.1, momentum=0.0), batch_size=batch, seed=0)
    alone.set_training_data((x, y), shuffle=False)
    alone.train(2)
    out[f"alone{rank}"] = alone.get_flat()


@pytest.mark.timeout(180)
def test_the_round_loop_averages_over_the_data_parallel_group_by_samples():
    out = run_two_ranks(_data_parallel)
    assert out["shared0"] == 0.0 and out["shared1"] == 1.0
    assert torch.equal(out["global0"], out["global1"])
    assert out["samples0"] == 12
    weighted = (8 * out["alone0"] + 4 * out["alone1"]) / 12
    plain = (out["alone0"] + out["alone1"]) / 2
    assert torch.allclose(out["global0"], weighted, atol=1e-6)
    assert not torch.allclose(out["global0"], plain, atol=1e-4)  # an unweighted mean fails this test
