"""A sharded replica made from its shapes: two real gloo ranks build a net on the meta device, cut it with FSDP2 and
make only their parts, each loaded from the part the driver cut. They hold what the whole net cut by FSDP2 holds,
train as it does, and gather into the driver's whole weights."""

import pytest
import torch

from _two_ranks import run_two_ranks
from sparknet import zoo
from sparknet.net import Net
from sparknet.parallel.mesh import cut_shard
from sparknet.solvers import SolverConfig

SOLVER = SolverConfig(base_lr=0.1, momentum=0.9)


def _params():
    return zoo.mlp(input_shape=[6], hidden=[7, 5], num_classes=3)  # odd rows: the second part is the smaller


def _data():
    g = torch.Generator().manual_seed(2)
    return torch.randn(32, 6, generator=g).numpy(), torch.randint(0, 3, (32,), generator=g).numpy()


def _rank(rank, out, meta):
    from torch.distributed.device_mesh import init_device_mesh

    whole = Net(_params(), SOLVER, seed=4)
    start = whole.get_flat()
    layout = whole.cut_layouts(shard=2)[rank]
    net = Net(_params(), SOLVER, seed=4, device="meta" if meta else "cpu")
    assert next(net.module.parameters()).device.type == ("meta" if meta else "cpu")
    mesh = init_device_mesh("cpu", (2,))
    if meta:
        net.shard(mesh, "cpu")
        net.set_flat(cut_shard(start, layout))
    else:
        net.set_flat(start)
        net.shard(mesh)
    net.set_training_data(_data(), shuffle=False)
    out[rank] = {"layout": net.shard_layout(), "planned": layout, "device": str(next(net.module.parameters()).device),
                 "part": net.get_flat().numel()}
    net.train(4)
    out[f"trained{rank}"] = net.get_flat()
    out[f"gathered{rank}"] = net.full_weights().to_flat(torch.float32)


@pytest.mark.timeout(120)
def test_a_net_made_from_its_shapes_holds_and_trains_as_the_whole_one_cut():
    made, cut = run_two_ranks(_rank, True), run_two_ranks(_rank, False)
    whole = Net(_params(), SOLVER, seed=4).get_flat().numel()
    for rank in (0, 1):
        assert made[rank]["layout"] == made[rank]["planned"] == cut[rank]["layout"]
        assert made[rank]["device"] == "cpu" and made[rank]["part"] == cut[rank]["part"] < whole
        assert torch.equal(made[f"trained{rank}"], cut[f"trained{rank}"])
    assert made[0]["part"] + made[1]["part"] == whole
    assert torch.equal(made["gathered0"], cut["gathered0"]) and torch.equal(made["gathered0"], made["gathered1"])


def _score_then_train(rank, out, score):
    from torch.distributed.device_mesh import init_device_mesh

    net = Net(_params(), SOLVER, seed=4)
    net.shard(init_device_mesh("cpu", (2,)))
    net.set_training_data(_data(), shuffle=False)
    net.train(2)
    own = net.get_flat()
    if score:  # as a streamed exchange scores the global weights, then puts its own back
        net.set_flat(own * 0.5)
        net.evaluate(_data())
        net.set_flat(own)
    net.train(2)
    out[rank] = net.get_flat()


@pytest.mark.timeout(120)
def test_a_sharded_net_that_scored_other_weights_trains_from_the_ones_set_since():
    # FSDP2 keeps a root unit's weights gathered after a forward, for its backward: after an evaluation the next
    # step ran on the scored weights until set_flat let them go
    scored, plain = run_two_ranks(_score_then_train, True), run_two_ranks(_score_then_train, False)
    assert torch.equal(scored[0], plain[0]) and torch.equal(scored[1], plain[1])
