"""A worker's GPU-speed options on the CPU: bf16 autocast, torch.compile and channels-last memory train LeNet to
the accuracy float32 reaches; the default stays bit-identical to a net built without them."""

import pytest
import torch

from sparknet import zoo
from sparknet.datasets import mnist_small
from sparknet.net import Compute, Net, Precision
from sparknet.solvers import SolverConfig

STEPS = 120


@pytest.fixture(scope="module")
def digits():
    return mnist_small()


def _lenet(data, compute=None, steps=STEPS) -> Net:
    torch.set_num_threads(1)
    net = Net(zoo.lenet(), SolverConfig(base_lr=0.01, momentum=0.9, weight_decay=5e-4), batch_size=64, seed=0,
              compute=compute)
    net.set_training_data(data.train)
    net.set_validation_data(data.test)
    net.train(steps)
    return net


@pytest.fixture(scope="module")
def float32_accuracy(digits):
    return _lenet(digits).test()


def test_the_default_is_float32_eager_and_bit_identical_to_a_net_without_it(digits):
    plain = _lenet(digits, None, steps=10)
    explicit = _lenet(digits, Compute(precision="float32"), steps=10)
    assert torch.equal(plain.get_flat(), explicit.get_flat())


@pytest.mark.parametrize("compute", [Compute(precision=Precision.BF16), Compute(compile=True),
                                     Compute(channels_last=True)], ids=["bf16", "compile", "channels_last"])
def test_each_option_trains_lenet_to_float32_s_accuracy(digits, float32_accuracy, compute):
    net = _lenet(digits, compute)
    accuracy = net.test()
    assert float32_accuracy > 0.85
    assert abs(accuracy - float32_accuracy) <= 0.03, (compute, accuracy, float32_accuracy)
    assert all(p.dtype == torch.float32 for p in net.module.parameters())  # the weights stay float32
    prediction = net.predict(torch.as_tensor(digits.test.x[:5]).reshape(5, 1, 28, 28))
    assert prediction.dtype == torch.float32 and prediction.shape == (5, 10)


def test_channels_last_keeps_the_convolutions_in_that_order_and_the_flat_weights_in_the_logical_one(digits):
    net = Net(zoo.lenet(), batch_size=8, seed=0, compute=Compute(channels_last=True))
    conv = [p for p in net.module.parameters() if p.dim() == 4]
    assert conv and all(p.is_contiguous(memory_format=torch.channels_last) for p in conv)
    reference = Net(zoo.lenet(), batch_size=8, seed=0)
    assert torch.equal(net.get_flat(), reference.get_flat())
    net.set_flat(reference.get_flat() + 1)
    assert torch.equal(net.get_flat(), reference.get_flat() + 1)


def test_an_unknown_precision_is_a_clear_error():
    with pytest.raises(ValueError, match="fp8"):
        Compute(precision="fp8")
