"""Unit tests of the NetParams layer DSL and GraphModule (pure torch, no Spark)."""

from __future__ import annotations

import copy
import io
import json
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

from sparknet.errors import GraphError
from sparknet.layers import (
    AccuracyLayer,
    Activation,
    ActivationLayer,
    BatchNormLayer,
    ConcatLayer,
    ContrastiveLoss,
    ConvLayer,
    DropoutLayer,
    EltwiseLayer,
    EmbeddingLayer,
    EuclideanLoss,
    Filler,
    FlattenLayer,
    GraphModule,
    InputLayer,
    LAYER_TYPES,
    LinearLayer,
    LRNLayer,
    LSTMLayer,
    NetParams,
    Pool,
    PoolLayer,
    RDDLayer,
    ReshapeLayer,
    RNNLayer,
    ScaleLayer,
    SigmoidCrossEntropyLoss,
    SilenceLayer,
    SliceLayer,
    SoftmaxLayer,
    SoftmaxWithLoss,
    SplitLayer,
)

torch.set_num_threads(1)


def data(shape=(2, 3, 8, 8), name="data", **kw):
    return RDDLayer(name, shape=list(shape), **kw)


def one(layer, shape=(2, 3, 8, 8)):
    """A net of one input and one layer; returns its top's inferred shape."""
    net = NetParams(data(shape), layer)
    return net.infer_shapes()[layer.tops[0]]


def run_all(net: NetParams, seed: int = 0) -> dict[str, torch.Tensor]:
    """Run every layer on random inputs and check each blob's shape against infer_shapes()."""
    module = net.build(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    inputs = {}
    for layer in net.inputs:
        if layer.dtype == "int64":
            inputs[layer.name] = torch.randint(0, 3, layer.shape, generator=gen)
        else:
            inputs[layer.name] = torch.randn(layer.shape, generator=gen)
    blobs = module.run(inputs)
    for name, shape in net.infer_shapes().items():
        assert tuple(blobs[name].shape) == shape, name
    return blobs


def assert_graph_error(match_layer: str, fn, *args, **kwargs) -> GraphError:
    with pytest.raises(GraphError) as info:
        fn(*args, **kwargs)
    assert info.value.layer == match_layer
    assert repr(match_layer) in str(info.value) or match_layer in str(info.value)
    return info.value


def caffe_pool(x: torch.Tensor, k: int, s: int, p: int, method: str) -> torch.Tensor:
    """Caffe's pooling_layer.cpp forward, written out with loops (one square window size)."""
    n, c, h, w = x.shape
    oh = math.ceil((h + 2 * p - k) / s) + 1
    ow = math.ceil((w + 2 * p - k) / s) + 1
    if p and (oh - 1) * s >= h + p:
        oh -= 1
    if p and (ow - 1) * s >= w + p:
        ow -= 1
    out = torch.empty(n, c, oh, ow)
    for i in range(oh):
        for j in range(ow):
            hs, ws = i * s - p, j * s - p
            he, we = min(hs + k, h + p), min(ws + k, w + p)
            size = (he - hs) * (we - ws)
            hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
            window = x[:, :, hs:he, ws:we]
            if method == "max":
                out[:, :, i, j] = window.amax(dim=(2, 3))
            else:
                out[:, :, i, j] = window.sum(dim=(2, 3)) / size
    return out


# --------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("size,kernel,stride,pad,expected", [
    (13, 3, 2, 0, 6),    # Caffe: ceil(10/2)+1 = 6
    (55, 3, 2, 0, 27),   # AlexNet pool1
    (32, 3, 2, 0, 16),   # cifar10_quick pool1: ceil(29/2)+1 = 16 (floor would give 15)
    (24, 2, 2, 0, 12),   # LeNet
    (7, 3, 2, 1, 4),
    (5, 2, 4, 1, 2),     # ceil gives 3, but the 3rd window would start in the padding
    (6, 3, 3, 0, 2),
])
def test_pool_output_size_is_caffes(size, kernel, stride, pad, expected):
    for method in ("max", "ave"):
        layer = PoolLayer("pool", ["data"], pool=method, kernel=kernel, stride=stride, pad=pad)
        net = NetParams(data((2, 3, size, size)), layer)
        assert net.infer_shapes()["pool"] == (2, 3, expected, expected)
        x = torch.randn(2, 3, size, size)
        got = net.build().run({"data": x})["pool"]
        torch.testing.assert_close(got, caffe_pool(x, kernel, stride, pad, method))


def test_pool_rectangular_and_global():
    layer = PoolLayer("pool", ["data"], pool=Pool.AVE, kernel=(3, 2), stride=(2, 1))
    assert one(layer, (2, 3, 9, 8)) == (2, 3, 4, 7)
    glob = PoolLayer("gp", ["data"], pool="max", global_pooling=True)
    blobs = run_all(NetParams(data(), glob))
    torch.testing.assert_close(blobs["gp"][:, :, 0, 0], blobs["data"].amax(dim=(2, 3)))


def test_pool_stride_beyond_kernel_without_pad_is_rejected():
    # Caffe would start the last window outside a 6-wide input (undefined output).
    assert_graph_error("pool", NetParams, data((1, 1, 6, 6)),
                       PoolLayer("pool", ["data"], kernel=2, stride=3))


@pytest.mark.parametrize("kw,expected", [
    (dict(kernel=5, num_filters=20), (2, 20, 4, 4)),
    (dict(kernel=3, num_filters=4, stride=2, pad=1), (2, 4, 4, 4)),
    (dict(kernel=(3, 1), num_filters=6, pad=(1, 0), groups=3), (2, 6, 8, 8)),
    (dict(kernel=3, num_filters=2, dilation=2), (2, 2, 4, 4)),
])
def test_conv_shapes(kw, expected):
    net = NetParams(data(), ConvLayer("conv", ["data"], **kw))
    assert net.infer_shapes()["conv"] == expected
    run_all(net)


def test_linear_flattens_from_axis_like_inner_product():
    assert one(LinearLayer("ip", ["data"], num_outputs=7)) == (2, 7)
    net = NetParams(data((2, 5, 4)), LinearLayer("ip", ["data"], num_outputs=3, axis=2))
    assert net.infer_shapes()["ip"] == (2, 5, 3)
    blobs = run_all(net)
    module = net.build(seed=0)
    # time-distributed: the same weight at every step
    x = blobs["data"]
    expected = x @ module.layer_module("ip").weight.T + module.layer_module("ip").bias
    torch.testing.assert_close(module.run({"data": x})["ip"], expected)
    assert module.layer_module("ip").weight.shape == (3, 4)


def test_element_wise_and_plumbing_shapes():
    net = NetParams(
        data((2, 6, 4, 4)),
        ActivationLayer("act", ["data"], activation="tanh"),
        DropoutLayer("drop", ["act"], ratio=0.3),
        BatchNormLayer("bn", ["drop"]),
        ScaleLayer("scale", ["bn"], bias_term=True),
        LRNLayer("lrn", ["scale"], local_size=3),
        SoftmaxLayer("prob", ["lrn"]),
        FlattenLayer("flat", ["prob"], axis=2),
        ReshapeLayer("re", ["flat"], shape=[0, -1, 4]),
        SliceLayer("slice", ["re"], axis=1, slice_points=[2, 5], tops=["s1", "s2", "s3"]),
        SplitLayer("split", ["s1"], tops=["c1", "c2"]),
        ConcatLayer("cat", ["c1", "c2", "s3"], axis=1),
        EltwiseLayer("sum", ["c1", "c2"], operation="max"),
        SilenceLayer("silence", ["s2"]),
    )
    shapes = net.infer_shapes()
    assert shapes["flat"] == (2, 6, 16)
    assert shapes["re"] == (2, 24, 4)
    assert (shapes["s1"], shapes["s2"], shapes["s3"]) == ((2, 2, 4), (2, 3, 4), (2, 19, 4))
    assert shapes["cat"] == (2, 23, 4)
    assert shapes["sum"] == (2, 2, 4)
    assert "silence" not in shapes
    blobs = run_all(net)
    torch.testing.assert_close(blobs["prob"].sum(dim=1), torch.ones(2, 4, 4))
    torch.testing.assert_close(torch.cat([blobs["s1"], blobs["s2"], blobs["s3"]], 1), blobs["re"])
    assert blobs["c1"] is blobs["c2"] is blobs["s1"]


def test_slice_evenly_without_points():
    net = NetParams(data((2, 6)), SliceLayer("sl", ["data"], tops=["a", "b", "c"]))
    assert [net.infer_shapes()[t] for t in "abc"] == [(2, 2)] * 3


def test_embedding_and_recurrent_shapes():
    net = NetParams(
        RDDLayer("ids", shape=[3, 7], dtype="int64"),
        EmbeddingLayer("embed", ["ids"], num_embeddings=11, num_outputs=5),
        RNNLayer("rnn", ["embed"], num_outputs=6, nonlinearity="relu"),
        LSTMLayer("lstm", ["rnn"], num_outputs=4, num_layers=2, dropout=0.1),
        LinearLayer("out", ["lstm"], num_outputs=11, axis=2),
    )
    shapes = net.infer_shapes()
    assert shapes["embed"] == (3, 7, 5)
    assert shapes["rnn"] == (3, 7, 6)
    assert shapes["lstm"] == (3, 7, 4)
    assert shapes["out"] == (3, 7, 11)
    blobs = run_all(net)
    module = net.build(seed=0)
    torch.testing.assert_close(blobs["embed"][0, 0], module.layer_module("embed").weight[blobs["ids"][0, 0]])
    lstm = module.layer_module("lstm")
    assert isinstance(lstm, torch.nn.LSTM) and lstm.num_layers == 2 and lstm.batch_first
    # any sequence length runs
    out = module.run({"ids": torch.randint(0, 11, (2, 3))})["out"]
    assert out.shape == (2, 3, 11)


def test_in_place_relu_rewrites_the_blob():
    net = NetParams(
        data((2, 4)),
        LinearLayer("ip", ["data"], num_outputs=5),
        ActivationLayer("relu", ["ip"], tops=["ip"]),
        LinearLayer("ip2", ["ip"], num_outputs=3),
    )
    module = net.build(seed=0)
    x = torch.randn(2, 4)
    ip = module.layer_module("ip")
    blobs = module.run({"data": x})
    torch.testing.assert_close(blobs["ip"], F.relu(ip(x)))
    ip2 = module.layer_module("ip2")
    torch.testing.assert_close(blobs["ip2"], ip2(F.relu(ip(x))))
    assert module.prediction_blob == "ip2"


def test_dag_with_concat_and_eltwise():
    net = NetParams(
        data((2, 3, 8, 8)),
        ConvLayer("branch1", ["data"], kernel=1, num_filters=4),
        ConvLayer("branch3", ["data"], kernel=3, pad=1, num_filters=4),
        PoolLayer("branchp", ["data"], kernel=3, stride=1, pad=1),
        ConcatLayer("mixed", ["branch1", "branch3", "branchp"]),
        EltwiseLayer("res", ["branch1", "branch3"], coeffs=[1.0, -0.5]),
        PoolLayer("gap", ["mixed"], pool="ave", global_pooling=True),
        LinearLayer("fc", ["gap"], num_outputs=2),
    )
    shapes = net.infer_shapes()
    assert shapes["mixed"] == (2, 11, 8, 8)
    blobs = run_all(net)
    torch.testing.assert_close(blobs["res"], blobs["branch1"] - 0.5 * blobs["branch3"])
    torch.testing.assert_close(blobs["mixed"][:, 4:8], blobs["branch3"])


@pytest.mark.parametrize("region", ["across_channels", "within_channel"])
def test_lrn_matches_caffe_formula(region):
    size, alpha, beta, k = 3, 0.3, 0.75, 2.0 if region == "across_channels" else 1.0  # within: Caffe adds 1
    net = NetParams(data((1, 5, 4, 4)), LRNLayer("lrn", ["data"], local_size=size, alpha=alpha,
                                                 beta=beta, k=k, norm_region=region))
    x = torch.randn(1, 5, 4, 4, dtype=torch.float64).float()
    got = net.build().run({"data": x})["lrn"]
    expected = torch.empty_like(x)
    half = size // 2
    for c in range(5):
        for i in range(4):
            for j in range(4):
                if region == "across_channels":
                    window = x[0, max(c - half, 0):c + half + 1, i, j]
                    n = size
                else:
                    window = x[0, c, max(i - half, 0):i + half + 1, max(j - half, 0):j + half + 1]
                    n = size * size
                scale = k + alpha / n * (window ** 2).sum()
                expected[0, c, i, j] = x[0, c, i, j] * scale ** -beta
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation,fn", [
    ("relu", F.relu), ("sigmoid", torch.sigmoid), ("tanh", torch.tanh), ("elu", F.elu),
    ("gelu", F.gelu), ("softplus", F.softplus), ("abs", torch.abs), ("swish", F.silu),
    ("leaky_relu", lambda x: F.leaky_relu(x, 0.01)), ("BNLL", F.softplus), ("AbsVal", torch.abs),
    ("identity", lambda x: x),
])
def test_activations(activation, fn):
    blobs = run_all(NetParams(data(), ActivationLayer("act", ["data"], activation=activation)))
    torch.testing.assert_close(blobs["act"], fn(blobs["data"]))


def test_activation_options():
    x = torch.rand(2, 3, 8, 8) + 0.5
    net = NetParams(data(),
                    ActivationLayer("pow", ["data"], activation=Activation.POWER, power=2.0, scale=3.0,
                                    shift=1.0),
                    ActivationLayer("leak", ["data"], activation="relu", negative_slope=0.2),
                    ActivationLayer("prelu", ["data"], activation="prelu"))
    module = net.build()
    blobs = module.run({"data": x - 1})
    torch.testing.assert_close(blobs["pow"], (1 + 3 * (x - 1)) ** 2)
    torch.testing.assert_close(blobs["leak"], F.leaky_relu(x - 1, 0.2))
    assert module.layer_weights()["prelu"][0].shape == (3,)


# --------------------------------------------------------------------------- losses


def test_softmax_with_loss_on_sequences_and_ignore_label():
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[0, 4, 2], [1, -1, 3]])
    net = NetParams(data((2, 3, 5)), RDDLayer("label", shape=[2, 3], dtype="int64"),
                    SoftmaxWithLoss("loss", ["data", "label"], axis=2, ignore_label=-1))
    module = net.build()
    loss, pred = module.loss(logits, labels)
    keep = labels.reshape(-1) != -1
    expected = F.cross_entropy(logits.reshape(-1, 5)[keep], labels.reshape(-1)[keep])
    torch.testing.assert_close(loss, expected)
    assert pred is logits


def test_softmax_with_loss_class_axis_1_with_spatial_labels():
    net = NetParams(data((2, 4, 3, 3)), RDDLayer("label", shape=[2, 3, 3], dtype="int64"),
                    SoftmaxWithLoss("loss", ["data", "label"], normalization="batch_size"))
    x, y = torch.randn(2, 4, 3, 3), torch.randint(0, 4, (2, 3, 3))
    loss, _ = net.build().loss(x, y)
    torch.testing.assert_close(loss, F.cross_entropy(x, y, reduction="sum") / 2)


def test_label_with_trailing_one_is_squeezed():
    net = NetParams(data((4, 6)), RDDLayer("label", shape=[4, 1]),
                    SoftmaxWithLoss("loss", ["data", "label"]))
    x, y = torch.randn(4, 6), torch.randint(0, 6, (4,))
    loss, _ = net.build().loss(x, y.reshape(4, 1).float())
    torch.testing.assert_close(loss, F.cross_entropy(x, y))


def test_regression_losses_follow_caffe():
    a, targets = torch.randn(4, 3), torch.rand(4, 3)
    sim = torch.tensor([1.0, 0.0, 1.0, 0.0])
    net = NetParams(
        data((4, 3), "a"), data((4, 3), "b"), data((4,), "sim"),
        EuclideanLoss("euclid", ["a", "b"], loss_weight=2.0),
        SigmoidCrossEntropyLoss("sigmoid", ["a", "b"]),
        ContrastiveLoss("contrast", ["a", "b", "sim"], margin=2.0),
        ContrastiveLoss("legacy", ["a", "b", "sim"], margin=2.0, legacy_version=True),
    )
    module = net.build()
    blobs = module.run({"a": a, "b": targets, "sim": sim})
    torch.testing.assert_close(blobs["euclid"], ((a - targets) ** 2).sum() / 8)
    torch.testing.assert_close(blobs["sigmoid"],
                               F.binary_cross_entropy_with_logits(a, targets, reduction="sum") / 4)
    d2 = ((a - targets) ** 2).sum(1)
    contrast = (sim * d2 + (1 - sim) * (2.0 - d2.sqrt()).clamp_min(0) ** 2).sum() / 8
    legacy = (sim * d2 + (1 - sim) * (2.0 - d2).clamp_min(0)).sum() / 8
    torch.testing.assert_close(blobs["contrast"], contrast)
    torch.testing.assert_close(blobs["legacy"], legacy)
    assert module.loss_blobs == {"euclid": 2.0, "sigmoid": 1.0, "contrast": 1.0, "legacy": 1.0}


def test_accuracy_top_k_and_total_loss_weights():
    net = NetParams(
        data((4, 5)), RDDLayer("label", shape=[4], dtype="int64"),
        AccuracyLayer("top1", ["data", "label"]),
        AccuracyLayer("top2", ["data", "label"], top_k=2),
        SoftmaxWithLoss("loss", ["data", "label"], loss_weight=0.5),
    )
    x = torch.tensor([[5.0, 4, 0, 0, 0], [0, 5, 4, 0, 0], [0, 0, 5, 4, 0], [0, 0, 0, 5, 4]])
    y = torch.tensor([0, 2, 0, 3])
    module = net.build()
    blobs = module.run({"data": x, "label": y})
    assert blobs["top1"].item() == pytest.approx(0.5)
    assert blobs["top2"].item() == pytest.approx(0.75)
    total, _ = module.loss(x, y)
    torch.testing.assert_close(total, 0.5 * F.cross_entropy(x, y))
    assert module.loss_blobs == {"loss": 0.5}


_COUNTS = torch.tensor([2.0, 0.0, 1.0, 3.0, 1.0, 1.0])


@pytest.mark.parametrize("layers, x, y", [
    ([SoftmaxWithLoss("loss", ["data", "label"])], torch.randn(6, 5), torch.randint(0, 5, (6,))),
    ([SoftmaxWithLoss("loss", ["data", "label"], axis=2, ignore_label=-1)], torch.randn(6, 3, 5),
     torch.tensor([[0, 4, 2], [1, -1, 3], [-1, -1, 0], [2, 2, -1], [4, 0, 1], [3, -1, -1]])),
    *[([SoftmaxWithLoss("loss", ["data", "label"], normalization=norm)], torch.randn(6, 4, 3, 3),
       torch.randint(0, 4, (6, 3, 3))) for norm in ("valid", "full", "batch_size", "none")],
    ([EuclideanLoss("loss", ["data", "label"], loss_weight=2.0)], torch.randn(6, 3), torch.randn(6, 3)),
    ([SigmoidCrossEntropyLoss("loss", ["data", "label"])], torch.randn(6, 3), torch.rand(6, 3)),
    ([SoftmaxWithLoss("ce", ["data", "label"]), SigmoidCrossEntropyLoss("bce", ["data", "target"])],
     torch.randn(6, 4), torch.randint(0, 4, (6,))),
], ids=["softmax", "sequence-ignore", "valid", "full", "batch_size", "none", "euclidean", "sigmoid", "two-losses"])
def test_sample_weights_count_each_row_that_many_times(layers, x, y):
    shape = [6, *y.shape[1:]]
    inputs = [data(x.shape), RDDLayer("label", shape=shape, dtype="int64" if not y.is_floating_point() else "float32")]
    if any("target" in layer.bottoms for layer in layers):  # a second loss, on a blob of the features
        inputs.append(ReshapeLayer("target", ["data"], shape=[0, -1]))
    module = NetParams(*inputs, *layers).build()
    rows = torch.arange(6).repeat_interleave(_COUNTS.long())  # each row as many times as its weight
    weighted, _ = module.loss(x, y, _COUNTS)
    repeated, _ = module.loss(x[rows], y[rows])
    torch.testing.assert_close(weighted, repeated)
    ones, _ = module.loss(x, y, torch.ones(6))
    torch.testing.assert_close(ones, module.loss(x, y)[0])
    nothing, _ = module.loss(x, y, torch.zeros(6))  # no weight at all: no loss, and a gradient of zeros
    assert nothing.item() == 0.0


def test_contrastive_loss_weighs_pairs():
    a, b, sim = torch.randn(6, 3), torch.randn(6, 3), torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    for legacy in (False, True):
        loss = NetParams(data((6, 3), "a"), data((6, 3), "b"), data((6,), "sim"),
                         ContrastiveLoss("contrast", ["a", "b", "sim"], margin=2.0, legacy_version=legacy)
                         ).build().layer_module("contrast")
        rows = torch.arange(6).repeat_interleave(_COUNTS.long())
        torch.testing.assert_close(loss(a, b, sim, weight=_COUNTS), loss(a[rows], b[rows], sim[rows]))


# --------------------------------------------------------------------------- GraphModule


def small_net(**bn) -> NetParams:
    return NetParams(
        data((4, 3, 6, 6)),
        RDDLayer("label", shape=[4], dtype="int64"),
        ConvLayer("conv/1", ["data"], kernel=3, num_filters=4, lr_mult=(1, 2), decay_mult=(1, 0)),
        BatchNormLayer("bn", ["conv/1"], tops=["conv/1"], **bn),
        ActivationLayer("relu", ["conv/1"], tops=["conv/1"]),
        DropoutLayer("drop", ["conv/1"], tops=["conv/1"], ratio=0.5),
        LinearLayer("ip", ["conv/1"], num_outputs=3),
        LinearLayer("side", ["conv/1"], num_outputs=2),  # not needed for the prediction
        AccuracyLayer("accuracy", ["ip", "label"]),
        SoftmaxWithLoss("loss", ["ip", "label"]),
    )


def test_roles_names_and_state_dict_keys():
    module = small_net().build(seed=0)
    assert module.feature_input == "data"
    assert module.label_input == "label"
    assert module.prediction_blob == "ip"
    assert module.loss_blobs == {"loss": 1.0}
    assert module.module_names["conv/1"] == "conv_1"
    assert module.module_names["loss"] != "loss"  # does not shadow GraphModule.loss
    assert set(module.state_dict()) >= {"conv_1.weight", "conv_1.bias", "bn.running_mean",
                                        "bn.running_var", "ip.weight", "side.bias"}


def test_forward_runs_only_what_the_prediction_needs():
    module = small_net().build(seed=0)
    calls = []
    for name in ("side", "accuracy", "loss", "ip"):
        module.layer_module(name).register_forward_hook(lambda m, i, o, n=name: calls.append(n))
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 3, (4,))
    assert module(x).shape == (4, 3)
    assert calls == ["ip"]
    calls.clear()
    module.loss(x, y)
    assert calls == ["ip", "loss"]
    calls.clear()
    module.run({"data": x, "label": y})
    assert calls == ["ip", "side", "accuracy", "loss"]
    with pytest.raises(ValueError, match="label"):
        module.loss(x, None)  # type: ignore[arg-type]


def test_layer_weights_are_live_tensors_in_caffe_order():
    module = small_net().build(seed=0)
    weights = module.layer_weights()
    assert list(weights) == ["conv/1", "bn", "ip", "side"]
    conv = module.layer_module("conv/1")
    assert weights["conv/1"][0] is conv.weight and weights["conv/1"][1] is conv.bias
    bn = module.layer_module("bn")
    assert weights["bn"][0] is bn.running_mean and weights["bn"][1] is bn.running_var
    assert len(weights["bn"]) == 2  # no affine part, integer counter left out
    assert len(small_net(affine=True).build().layer_weights()["bn"]) == 4


def test_param_groups_follow_lr_and_decay_mult():
    module = small_net().build(seed=0)
    groups = {(g["lr_mult"], g["decay_mult"]): g["params"] for g in module.param_groups()}
    conv = module.layer_module("conv/1")
    assert groups[(1.0, 1.0)][0] is conv.weight
    assert groups[(2.0, 0.0)] == [conv.bias]
    total = sum(p.numel() for g in groups.values() for p in g)
    assert total == sum(p.numel() for p in module.parameters())
    optimizer = torch.optim.SGD([{"params": g["params"], "lr": 0.1 * g["lr_mult"]}
                                 for g in module.param_groups()])
    assert len(optimizer.param_groups) == 2


def test_train_and_eval_modes_for_dropout_and_batchnorm():
    module = small_net().build(seed=0)
    x = torch.randn(4, 3, 6, 6) * 3 + 1
    module.train()
    first, second = module(x), module(x)
    assert not torch.equal(first, second)  # dropout
    bn = module.layer_module("bn")
    assert not torch.equal(bn.running_mean, torch.zeros(4))  # updated in train mode
    module.eval()
    stats = bn.running_mean.clone()
    torch.testing.assert_close(module(x), module(x))
    assert torch.equal(bn.running_mean, stats)
    frozen = small_net(use_global_stats=True).build(seed=0).train()
    frozen(x)
    assert torch.equal(frozen.layer_module("bn").running_mean, torch.zeros(4))


def test_batchnorm_normalises_each_channel_in_train_mode():
    blobs = run_all(NetParams(data((8, 3, 4, 4)), BatchNormLayer("bn", ["data"], momentum=None)))
    out = blobs["bn"]
    torch.testing.assert_close(out.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.var(dim=(0, 2, 3), unbiased=False), torch.ones(3), atol=1e-3, rtol=0)


def test_seed_makes_weights_reproducible_and_keeps_global_rng():
    state = torch.random.get_rng_state()
    a, b = small_net().build(seed=3), small_net().build(seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
    c = small_net().build(seed=4)
    assert not torch.equal(a.layer_module("ip").weight, c.layer_module("ip").weight)


def test_fillers_follow_caffe():
    net = NetParams(
        data((2, 10)),
        LinearLayer("const", ["data"], num_outputs=4, weight_filler=Filler("constant", value=0.5),
                    bias_filler={"type": "constant", "value": -1.0}),
        LinearLayer("xavier", ["data"], num_outputs=400, weight_filler="xavier"),
        LinearLayer("msra", ["data"], num_outputs=2000,
                    weight_filler=Filler("msra", variance_norm="fan_out")),
        LinearLayer("ball", ["data"], num_outputs=3, weight_filler="positive_unitball"),
        LinearLayer("uniform", ["data"], num_outputs=3, weight_filler=Filler("uniform", min=2, max=3)),
    )
    w = net.build(seed=0).layer_weights()
    assert torch.all(w["const"][0] == 0.5) and torch.all(w["const"][1] == -1.0)
    bound = math.sqrt(3 / 10)  # fan_in = numel / shape[0] = 10
    assert w["xavier"][0].abs().max() <= bound and w["xavier"][0].abs().max() > 0.9 * bound
    assert w["msra"][0].std().item() == pytest.approx(math.sqrt(2 / 2000), rel=0.05)  # fan_out
    torch.testing.assert_close(w["ball"][0].sum(dim=1), torch.ones(3))
    assert w["ball"][0].min() >= 0
    assert 2 <= w["uniform"][0].min() and w["uniform"][0].max() <= 3


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit is deprecated in torch 2.13
def test_pickle_deepcopy_and_trace():
    module = small_net().build(seed=0).eval()
    x = torch.randn(2, 3, 6, 6)
    expected = module(x)
    for clone in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module)):
        assert isinstance(clone, GraphModule)
        torch.testing.assert_close(clone(x), expected)
        clone.layer_module("ip").weight.data.zero_()  # the plan uses the clone's own modules
        assert torch.all(clone(x) == clone.layer_module("ip").bias)
        assert not torch.all(module(x) == module.layer_module("ip").bias)
    traced = torch.jit.trace(module, (x,))
    torch.testing.assert_close(traced(torch.randn(2, 3, 6, 6) * 0 + x), expected)
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.jit.load(buffer)(x), expected)


def test_cloudpickle():
    try:
        import cloudpickle
    except ImportError:  # pyspark ships its own copy; importing it starts no Spark
        cloudpickle = pytest.importorskip("pyspark.cloudpickle")
    module = small_net().build(seed=0).eval()
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(cloudpickle.loads(cloudpickle.dumps(module))(x), module(x))


def test_any_batch_size_runs():
    module = small_net().build(seed=0)
    for batch in (1, 7):
        loss, pred = module.loss(torch.randn(batch, 3, 6, 6), torch.randint(0, 3, (batch,)))
        assert pred.shape == (batch, 3) and loss.dim() == 0


def test_backward_reaches_every_parameter_on_the_loss_path():
    module = small_net().build(seed=0)
    loss, _ = module.loss(torch.randn(4, 3, 6, 6), torch.randint(0, 3, (4,)))
    loss.backward()
    for name, param in module.named_parameters():
        assert (param.grad is None) == name.startswith("side."), name


def test_net_without_loss_predicts_last_top():
    net = NetParams(data((2, 4)), LinearLayer("ip", ["data"], num_outputs=3),
                    SoftmaxLayer("prob", ["ip"]))
    module = net.build()
    assert module.prediction_blob == "prob" and module.label_input is None
    assert module(torch.randn(2, 4)).shape == (2, 3)
    with pytest.raises(ValueError, match="no loss"):
        module.loss(torch.randn(2, 4), torch.zeros(2))


# --------------------------------------------------------------------------- NetParams


def test_dict_round_trip_through_json():
    net = NetParams(
        data((2, 3, 8, 8)), RDDLayer("label", shape=[2], dtype="int64"),
        ConvLayer("conv", ["data"], kernel=3, num_filters=4, weight_filler=Filler("xavier"),
                  lr_mult=(1, 2)),
        PoolLayer("pool", ["conv"], pool="ave", kernel=2, stride=2),
        SliceLayer("slice", ["pool"], slice_points=[1], tops=["a", "b"]),
        EltwiseLayer("sum", ["a", "a"], coeffs=[1, 2]),
        ReshapeLayer("flat", ["b"], shape=[0, -1]),
        LinearLayer("ip", ["flat"], num_outputs=2, parallel="column"),
        SilenceLayer("quiet", ["sum"]),
        SoftmaxWithLoss("loss", ["ip", "label"]),
        name="round",
    )
    text = json.dumps(net.to_dict())
    again = NetParams.from_dict(json.loads(text))
    assert again == net
    assert again.to_dict() == net.to_dict()
    assert again.name == "round" and len(again) == len(net)
    assert set(LAYER_TYPES) >= {d["type"] for d in net.to_dict()["layers"]}


def test_net_params_container_api():
    net = small_net()
    assert [layer.name for layer in net] == [layer.name for layer in net.layers]
    assert net["ip"].num_outputs == 3 and net[0].name == "data"
    assert "LinearLayer(name='ip'" in repr(net)
    assert InputLayer is RDDLayer
    assert NetParams(list(net.layers)) == NetParams(*net.layers)


# --------------------------------------------------------------------------- bad graphs


def test_unknown_bottom():
    err = assert_graph_error("ip", NetParams, data(), LinearLayer("ip", ["nope"], num_outputs=2))
    assert "nope" in str(err)


def test_duplicate_layer_name():
    assert_graph_error("ip", NetParams, data(), LinearLayer("ip", ["data"], num_outputs=2),
                       LinearLayer("ip", ["data"], num_outputs=3, tops=["other"]))


def test_cycle_or_bottom_produced_only_later():
    err = assert_graph_error(
        "a", NetParams, data((2, 4)),
        LinearLayer("a", ["b"], num_outputs=4),
        LinearLayer("b", ["a"], num_outputs=4))
    assert "later" in str(err)


def test_blob_with_two_producers():
    assert_graph_error("ip2", NetParams, data((2, 4)), LinearLayer("ip", ["data"], num_outputs=2),
                       LinearLayer("ip2", ["data"], num_outputs=2, tops=["ip"]))


@pytest.mark.parametrize("layers,culprit", [
    ([ConvLayer("c1", ["data"], kernel=3, num_filters=2), ConvLayer("c2", ["data"], kernel=3, num_filters=3),
      EltwiseLayer("bad", ["c1", "c2"])], "bad"),
    ([PoolLayer("p", ["data"], kernel=2, stride=2), ConcatLayer("bad", ["data", "p"])], "bad"),
    ([ConvLayer("bad", ["data"], kernel=9, num_filters=2)], "bad"),
    ([ConvLayer("bad", ["data"], kernel=11, pad=1, num_filters=2)], "bad"),
    ([ConvLayer("bad", ["data"], kernel=5, dilation=2, num_filters=2)], "bad"),
    ([PoolLayer("bad", ["data"], kernel=9)], "bad"),
    ([LinearLayer("bad", ["data"], num_outputs=2, num_inputs=100)], "bad"),
    ([ConvLayer("bad", ["data"], kernel=1, num_filters=4, groups=2)], "bad"),
    ([FlattenLayer("f", ["data"]), LRNLayer("bad", ["f"])], "bad"),
    ([ReshapeLayer("bad", ["data"], shape=[0, 7, -1])], "bad"),
    ([SliceLayer("bad", ["data"], slice_points=[1, 3], tops=["x", "y", "z"])], "bad"),
    ([RDDLayer("label", shape=[5]), SoftmaxWithLoss("bad", ["data", "label"])], "bad"),
    ([LinearLayer("ip", ["data"], num_outputs=3), RDDLayer("label", shape=[2]),
      AccuracyLayer("bad", ["ip", "label"], top_k=4)], "bad"),
    ([LSTMLayer("bad", ["data"], num_outputs=4)], "bad"),
])
def test_shape_mismatch_names_the_layer(layers, culprit):
    assert_graph_error(culprit, NetParams, data((2, 3, 8, 8)), *layers)


def test_sequence_loss_without_axis_hints_at_it():
    err = assert_graph_error("loss", NetParams, data((2, 3, 5)), RDDLayer("label", shape=[2, 3]),
                             SoftmaxWithLoss("loss", ["data", "label"]))
    assert "axis=2" in str(err)


@pytest.mark.parametrize("make,culprit", [
    (lambda: ActivationLayer("act", ["x"], activation="swoosh"), "act"),
    (lambda: ConvLayer("conv", ["x"], kernel=0), "conv"),
    (lambda: ConvLayer("conv", ["x"], kernel=(3, 3, 3)), "conv"),
    (lambda: ConvLayer("conv", ["x"], stride=-1), "conv"),
    (lambda: ConvLayer("conv", ["x"], num_filters=5, groups=2), "conv"),
    (lambda: PoolLayer("pool", ["x"]), "pool"),
    (lambda: PoolLayer("pool", ["x"], kernel=3, pad=2), "pool"),
    (lambda: PoolLayer("pool", ["x"], pool="median", kernel=2), "pool"),
    (lambda: LinearLayer("ip", ["x"], num_outputs=0), "ip"),
    (lambda: LinearLayer("ip", ["x"], num_outputs=2, parallel="diagonal"), "ip"),
    (lambda: LinearLayer("ip", ["x"], num_outputs=2, lr_mult=(-1,)), "ip"),
    (lambda: LinearLayer("ip", ["x", "y"], num_outputs=2), "ip"),
    (lambda: DropoutLayer("drop", ["x"], ratio=1.0), "drop"),
    (lambda: LRNLayer("lrn", ["x"], local_size=4), "lrn"),
    (lambda: EltwiseLayer("elt", ["x", "y"], operation="prod", coeffs=[1, 2]), "elt"),
    (lambda: EltwiseLayer("elt", ["x"]), "elt"),
    (lambda: SplitLayer("split", ["x"]), "split"),
    (lambda: SliceLayer("slice", ["x"], tops=["a", "b"], slice_points=[3, 2]), "slice"),
    (lambda: SilenceLayer("quiet", ["x"], tops=["y"]), "quiet"),
    (lambda: ReshapeLayer("re", ["x"], shape=[-1, -1]), "re"),
    (lambda: RDDLayer("data", ["x"], shape=[1]), "data"),
    (lambda: RDDLayer("data", shape=[0, 3]), "data"),
    (lambda: RDDLayer("data", shape=[2], dtype="complex"), "data"),
    (lambda: SoftmaxWithLoss("loss", ["x"]), "loss"),
    (lambda: SoftmaxWithLoss("loss", ["x", "y"], normalization="sometimes"), "loss"),
    (lambda: LinearLayer("ip", ["x"], num_outputs=2, weight_filler="bogus"), "ip"),
    (lambda: RNNLayer("rnn", ["x"], num_outputs=2, nonlinearity="sigmoid"), "rnn"),
    (lambda: ActivationLayer("act", ["x"], tops=["a", "b"]), "act"),
])
def test_bad_options_name_the_layer(make, culprit):
    err = assert_graph_error(culprit, make)
    assert isinstance(err, ValueError)


def test_base_classes_are_not_layers():
    from sparknet.layers import Layer, LossLayer

    for base in (Layer, LossLayer):
        with pytest.raises(TypeError, match="base class"):
            base("x", ["y"])


def test_net_needs_an_input_and_layers():
    with pytest.raises(GraphError, match="RDDLayer"):
        NetParams()
    assert_graph_error("ip", NetParams, LinearLayer("ip", ["x"], num_outputs=2, tops=["x"]))
    with pytest.raises(TypeError):
        NetParams(data(), "conv1")  # type: ignore[arg-type]


def test_graph_error_survives_pickling():
    err = assert_graph_error("ip", NetParams, data(), LinearLayer("ip", ["nope"], num_outputs=2))
    again = pickle.loads(pickle.dumps(err))
    assert again.layer == "ip" and str(again) == str(err)
