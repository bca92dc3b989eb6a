"""Net (Listing 1) with plain torch modules: data handling, training, weights, state."""

import numpy as np
import pytest
import torch

from sparknet.net import Net
from sparknet.solvers import SolverConfig


def blobs(n=600, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]], dtype=np.float32)
    x = centers[y] + rng.normal(0, 0.6, (n, 2)).astype(np.float32)
    return x.astype(np.float32), y.astype(np.int64)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def test_listing1_api_learns():
    x, y = blobs()
    net = Net(model(), SolverConfig(base_lr=0.1), batch_size=32, seed=0)
    net.set_training_data((x, y))
    net.set_validation_data(blobs(300, seed=1))
    before = net.test()
    stats = net.train(300)
    assert stats.steps == 300 and stats.samples == 300 * 32 and stats.finite
    assert net.test() > 0.9 > before


def test_samples_batches_and_arrays_give_the_same_tensors():
    x, y = blobs(64)
    nets = [Net(model(), batch_size=16, seed=3) for _ in range(3)]
    nets[0].set_training_data((x, y))
    nets[1].set_training_data(list(zip(x, y)))                                # samples
    nets[2].set_training_data([(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)])  # batches
    for n in nets:
        n.train(10)
    w0 = nets[0].get_weights()
    assert nets[1].get_weights().allclose(w0) and nets[2].get_weights().allclose(w0)


def test_epochs_cycle_and_reshuffle():
    x, y = blobs(100)
    net = Net(model(), batch_size=30, seed=0)
    net.set_training_data((x, y))
    net.train(3)
    assert net.epoch == 0
    net.train(1)  # 90 used, 30 more do not fit: a new epoch starts
    assert net.epoch == 1


def test_partition_smaller_than_a_batch_trains():
    x, y = blobs(5)
    net = Net(model(), batch_size=64)
    net.set_training_data((x, y))
    assert net.train(3).samples == 15


def test_time_budget_stops_early_but_runs_one_step():
    x, y = blobs()
    net = Net(model(), batch_size=32)
    net.set_training_data((x, y))
    stats = net.train(10**9, max_seconds=0.2)
    assert 1 <= stats.steps < 10**9 and stats.wall_s < 5
    assert net.train(5, max_seconds=0.0).steps == 1


def test_weights_round_trip_and_set_keeps_layout():
    x, y = blobs()
    a, b = Net(model(), seed=0), Net(model(), seed=0)
    a.set_training_data((x, y))
    a.train(20)
    b.set_weights(a.get_weights())
    assert b.get_weights().allclose(a.get_weights())
    assert torch.equal(a.get_flat(), b.get_flat())
    assert list(a.get_weights()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    with pytest.raises(ValueError):
        b.set_weights(Net(torch.nn.Linear(2, 3)).get_weights())


def test_get_weights_is_a_copy():
    net = Net(model())
    w = net.get_weights()
    w["0.weight"][0].zero_()
    assert net.get_weights()["0.weight"][0].abs().sum() > 0


def test_solver_state_resume_is_exact():
    x, y = blobs()
    a = Net(model(), SolverConfig(base_lr=0.05, lr_policy="step", stepsize=7, gamma=0.5), batch_size=16, seed=1)
    a.set_training_data((x, y))
    a.train(13)
    w, state, again = a.get_weights(), a.solver_state(), a.solver_state()
    a.train(11)
    b = Net(model(), SolverConfig(base_lr=0.05, lr_policy="step", stepsize=7, gamma=0.5), batch_size=16, seed=99)
    b.set_training_data((x, y))
    b.set_weights(w)
    b.load_solver_state(state)
    b.train(11)
    assert b.get_weights().max_abs_diff(a.get_weights()) == 0.0
    assert b.learning_rate == a.learning_rate
    # the data order's generator state read back as another integer type (a file's, or onto a GPU: see
    # scripts/gpu_check.py) is the CPU byte tensor the generator takes
    c = Net(model(), SolverConfig(base_lr=0.05, lr_policy="step", stepsize=7, gamma=0.5), batch_size=16, seed=99)
    c.set_training_data((x, y))
    c.set_weights(w)
    c.load_solver_state({**again, "generator": again["generator"].to(torch.int64)})
    c.train(11)
    assert c.get_weights().max_abs_diff(a.get_weights()) == 0.0


def test_nan_loss_is_reported_not_hidden():
    x, y = blobs()
    x[:] = np.nan
    net = Net(model(), batch_size=8)
    net.set_training_data((x, y))
    assert not net.train(2).finite


def test_bad_data_is_a_clear_error():
    net = Net(model())
    with pytest.raises(ValueError, match="no training data"):
        net.train(1)
    with pytest.raises(ValueError, match="empty"):
        net.set_training_data([])
    with pytest.raises(ValueError, match="rows"):
        net.set_training_data((np.zeros((3, 2), np.float32), np.zeros(4, np.int64)))
    with pytest.raises(ValueError, match=r"\(x, y\) pairs"):
        net.set_training_data([1, 2, 3])
    with pytest.raises(ValueError, match="no validation data"):
        net.test()
    with pytest.raises(TypeError):
        Net("lenet")


def test_custom_loss_for_regression():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [2.0], [-1.0]], dtype=np.float32))
    net = Net(torch.nn.Linear(3, 1), SolverConfig(base_lr=0.05, momentum=0.0), loss=torch.nn.functional.mse_loss, batch_size=20)
    net.set_training_data((x, y))
    first = net.train(1).loss
    assert net.train(200).last_loss < 0.01 * first


class _ByName(torch.nn.Module):
    """Takes {"xy": [n, 2], "t": [n]}."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.xy = torch.nn.Linear(2, 8)
        self.t = torch.nn.Linear(1, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, columns):
        return self.head(self.norm(self.xy(columns["xy"]) + self.t(columns["t"][:, None])))


def test_feature_dict_cuts_flat_rows_into_named_columns_and_keeps_the_module_s_names():
    import copy
    import pickle

    from sparknet.net import FeatureDict

    inner = _ByName()
    net = FeatureDict(inner, [("xy", (2,)), ("t", ())])
    flat = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    parts = net.split(flat)
    assert torch.equal(parts["xy"], flat[:, :2]) and torch.equal(parts["t"], flat[:, 2])
    inner.eval()
    net.eval()
    assert torch.equal(net(flat), inner({"xy": flat[:, :2], "t": flat[:, 2]}))
    # the module's own weight names; one state dict loads into either
    assert [n for n, _ in net.named_parameters()] == [n for n, _ in inner.named_parameters()]
    assert list(net.state_dict()) == list(inner.state_dict())
    _ByName().load_state_dict(net.state_dict())
    # train/eval reach the module itself; copies and pickles keep the weights shared
    net.train()
    assert inner.training and inner.norm.training
    for twin in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert twin.head.weight is twin.wrapped.head.weight
        with torch.no_grad():
            twin.head.weight.add_(1.0)
        assert torch.equal(twin.wrapped.head.weight, inner.head.weight + 1.0)
    with pytest.raises(ValueError, match=r"each row holds 4 feature values, but the columns \['xy', 't'\] hold 3"):
        net(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="distinct column names"):
        FeatureDict(inner, [("xy", (2,)), ("xy", ())])


def test_a_net_that_takes_a_dict_trains_through_net():
    from sparknet.net import FeatureDict

    x, y = blobs()
    rows = np.concatenate([x, (x[:, :1] * 0.5)], axis=1)  # a third column the net reads as "t"
    net = Net(FeatureDict(_ByName(), [("xy", (2,)), ("t", ())]), SolverConfig(base_lr=0.1, momentum=0.9),
              batch_size=32, seed=0)
    net.set_training_data((rows, y))
    net.set_validation_data((rows, y))
    net.train(150)
    assert net.test() > 0.95
    assert list(net.get_weights())[:2] == ["xy.weight", "xy.bias"]


def test_a_layer_net_made_on_the_meta_device_never_holds_its_weights():
    # a sharded or split replica's rank builds its net from its shapes and makes only its parts: 2**19 x 2**20 float32
    # weights are 2 TiB, which no allocator here gives, so a build of the whole weights first would fail
    from sparknet import zoo

    made = Net(zoo.mlp(input_shape=[2**19], hidden=[2**20], num_classes=2), device="meta")
    assert {p.device.type for p in made.module.parameters()} == {"meta"}
    assert made.module.layer_module("ip1").weight.shape == (2**20, 2**19)
