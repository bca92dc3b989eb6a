"""Unit tests of the model zoo: shapes, parameter counts, one training step each."""

from __future__ import annotations

import pytest
import torch

from sparknet.layers import GraphModule, NetParams
from sparknet.zoo import MODELS, alexnet, char_lstm, cifar_cnn, get_model, gpt_char, lenet, mlp

torch.set_num_threads(1)


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_lenet_is_listing_2():
    net = lenet()
    assert [layer.name for layer in net] == ["data", "label", "conv1", "pool1", "conv2", "pool2",
                                             "ip1", "relu1", "ip2", "loss"]
    assert [type(layer).__name__ for layer in net][2:] == [
        "ConvLayer", "PoolLayer", "ConvLayer", "PoolLayer", "LinearLayer", "ActivationLayer",
        "LinearLayer", "SoftmaxWithLoss"]
    shapes = net.infer_shapes()
    assert shapes["data"] == (64, 1, 28, 28) and shapes["label"] == (64,)
    assert shapes["conv1"] == (64, 20, 24, 24) and shapes["pool1"] == (64, 20, 12, 12)
    assert shapes["conv2"] == (64, 50, 8, 8) and shapes["pool2"] == (64, 50, 4, 4)
    assert shapes["ip1"] == (64, 500) and shapes["ip2"] == (64, 10)
    module = net.build(seed=0)
    assert n_params(module) == 431_080
    assert list(module.layer_weights()) == ["conv1", "conv2", "ip1", "ip2"]
    assert [tuple(t.shape) for t in module.layer_weights()["ip1"]] == [(500, 800), (500,)]
    assert module.prediction_blob == "ip2" and module.label_input == "label"
    assert lenet(batch_size=8).infer_shapes()["data"] == (8, 1, 28, 28)


@pytest.mark.parametrize("net,x,y,pred_shape", [
    (lenet(), torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,)), (4, 10)),
    (mlp(), torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,)), (4, 10)),
    (mlp(input_shape=(20,), hidden=(8,), num_classes=3), torch.randn(4, 20),
     torch.randint(0, 3, (4,)), (4, 3)),
    (cifar_cnn(), torch.randn(3, 3, 32, 32), torch.randint(0, 10, (3,)), (3, 10)),
    (char_lstm(vocab_size=17, seq_len=9, hidden=16), torch.randint(0, 17, (3, 9)),
     torch.randint(0, 17, (3, 9)), (3, 9, 17)),
    (gpt_char(vocab_size=17, seq_len=12, width=24, num_layers=2, num_heads=3), torch.randint(0, 17, (3, 9)),
     torch.randint(0, 17, (3, 9)), (3, 9, 17)),
], ids=["lenet", "mlp", "mlp-small", "cifar_cnn", "char_lstm", "gpt_char"])
def test_every_model_trains_one_step(net: NetParams, x, y, pred_shape):
    module = net.build(seed=0)
    assert isinstance(module, GraphModule)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    loss, pred = module.loss(x, y)
    assert pred.shape == pred_shape and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in module.parameters())
    optimizer.step()
    assert module(x).shape == pred_shape
    after, _ = module.loss(x, y)
    assert after.item() != loss.item()


def test_alexnet_shapes_and_a_step_on_two_images():
    net = alexnet(batch_size=2)
    shapes = net.infer_shapes()
    assert shapes["conv1"] == (2, 96, 55, 55)
    assert shapes["pool1"] == (2, 96, 27, 27)
    assert shapes["conv2"] == (2, 256, 27, 27) and shapes["pool2"] == (2, 256, 13, 13)
    assert shapes["conv5"] == (2, 256, 13, 13) and shapes["pool5"] == (2, 256, 6, 6)
    assert shapes["fc8"] == (2, 1000)
    module = net.build(seed=0)
    assert n_params(module) == 60_965_224
    groups = {(g["lr_mult"], g["decay_mult"]) for g in module.param_groups()}
    assert groups == {(1.0, 1.0), (2.0, 0.0)}
    loss, pred = module.loss(torch.randn(2, 3, 227, 227), torch.tensor([3, 999]))
    loss.backward()
    assert pred.shape == (2, 1000) and module.layer_module("conv1").weight.grad is not None
    assert module.layer_module("fc6").bias.detach().eq(0.1).all()  # BVLC filler


def test_cifar_cnn_is_cifar10_quick():
    net = cifar_cnn()
    shapes = net.infer_shapes()
    assert [shapes[f"pool{i}"][2] for i in (1, 2, 3)] == [16, 8, 4]  # Caffe rounds up
    module = net.build(seed=0)
    assert n_params(module) == 145_578
    assert module.prediction_blob == "ip2" and set(module.loss_blobs) == {"loss"}
    conv1 = module.layer_module("conv1").weight
    assert conv1.std().item() == pytest.approx(1e-4, rel=0.1)


def test_char_lstm_wiring():
    net = char_lstm(vocab_size=30, seq_len=100, hidden=64, num_layers=2, batch_size=32)
    shapes = net.infer_shapes()
    assert shapes["embed"] == (32, 100, 64) and shapes["lstm"] == (32, 100, 64)
    assert shapes["logits"] == (32, 100, 30)
    lstm = net.build(seed=0).layer_module("lstm")
    assert lstm.num_layers == 2 and lstm.hidden_size == 64


def test_gpt_char_is_nanogpt_s_shakespeare_char_model():
    net = gpt_char(vocab_size=65)
    shapes = net.infer_shapes()
    assert shapes["data"] == (64, 256) and shapes["token"] == (64, 256, 384) and shapes["logits"] == (64, 256, 65)
    module = net.build(seed=0)
    assert [name for name in module.layer_weights() if name.startswith("block")] == [f"block{i}" for i in range(1, 7)]
    assert 10.7e6 < n_params(module) < 10.9e6  # nanoGPT's 10.65M, with the position table and an untied head
    block = module.layer_module("block1")
    assert block.attention.heads == 6
    assert abs(float(block.attention.proj.weight.std()) - 0.02 / 12 ** 0.5) < 2e-4  # GPT-2's residual scale
    loss, _ = module.eval().loss(torch.randint(0, 65, (2, 256)), torch.randint(0, 65, (2, 256)))
    assert abs(loss.item() - torch.log(torch.tensor(65.0)).item()) < 0.3  # starts near a uniform guess


def test_gpt_char_predicts_each_position_from_the_ones_before_it_only():
    module = gpt_char(vocab_size=11, seq_len=16, width=32, num_layers=2, num_heads=4, dropout=0.0).build(seed=0)
    x = torch.randint(0, 11, (2, 16))
    changed = x.clone()
    changed[:, 9:] = (x[:, 9:] + 1) % 11
    before, after = module.eval()(x), module(changed)
    assert torch.allclose(before[:, :9], after[:, :9], atol=1e-6)
    assert not torch.allclose(before[:, 9:], after[:, 9:])
    with pytest.raises(Exception, match="max_length=16"):
        gpt_char(vocab_size=11, seq_len=16).build().loss(torch.zeros(1, 17, dtype=torch.long),
                                                          torch.zeros(1, 17, dtype=torch.long))


def test_get_model_and_registry():
    assert set(MODELS) == {"lenet", "mlp", "cifar_cnn", "alexnet", "char_lstm", "gpt_char"}
    assert get_model("lenet", batch_size=16).infer_shapes()["data"][0] == 16
    assert get_model("cifar-cnn").name == "cifar10_quick"
    assert get_model("char_lstm", vocab_size=5).infer_shapes()["logits"][-1] == 5
    with pytest.raises(ValueError, match="lenet"):
        get_model("resnet")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit is deprecated in torch 2.13
def test_lenet_traces():
    module = lenet().build(seed=0).eval()
    x = torch.randn(2, 1, 28, 28)
    traced = torch.jit.trace(module, (x,))
    torch.testing.assert_close(traced(torch.randn(5, 1, 28, 28) * 0 + x[:1]), module(x[:1]).expand(5, 10))


@pytest.mark.slow
def test_lenet_exports():
    module = lenet().build(seed=0).eval()
    x = torch.randn(2, 1, 28, 28)
    exported = torch.export.export(module, (x,))
    torch.testing.assert_close(exported.module()(x), module(x))
