"""Caffe net prototxt -> CaffeNet: the BVLC nets build with Caffe's shapes; V1 syntax, phases,
data bindings, transforms, multipliers, fillers and the errors that name file, line and layer."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from sparknet.caffe import (
    CaffeNet,
    CaffeTransform,
    DataBinding,
    PrototxtError,
    load_caffemodel_into,
    load_net_prototxt,
    load_solver_prototxt,
    read_caffemodel,
    read_caffemodel_layers,
    write_caffemodel,
)
from sparknet.layers import ActivationLayer, ConvLayer, LinearLayer, RDDLayer

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "caffe-models"
needs_models = pytest.mark.skipif(not MODELS.is_dir(), reason=f"BVLC Caffe files not found at {MODELS}")

# (file, phase, stages) -> (blob to check, its shape as declared, batch used for the forward pass)
BVLC_NETS = {
    ("bvlc_alexnet/deploy.prototxt", "TEST", ()): ("fc8", (10, 1000), 1),
    ("bvlc_alexnet/train_val.prototxt", "TRAIN", ()): ("fc8", (256, 1000), 2),
    ("bvlc_alexnet/train_val.prototxt", "TEST", ()): ("fc8", (50, 1000), 2),
    ("bvlc_reference_caffenet/deploy.prototxt", "TEST", ()): ("prob", (10, 1000), 10),
    ("cifar10/cifar10_quick.prototxt", "TEST", ()): ("prob", (1, 10), 1),
    ("cifar10/cifar10_quick_train_test.prototxt", "TRAIN", ()): ("ip2", (100, 10), 4),
    ("cifar10/cifar10_quick_train_test.prototxt", "TEST", ()): ("ip2", (100, 10), 4),
    ("cifar10/cifar10_full_train_test.prototxt", "TRAIN", ()): ("ip1", (100, 10), 4),
    ("cifar10/cifar10_full_train_test.prototxt", "TEST", ()): ("ip1", (100, 10), 4),
    ("cifar10/cifar10_full_sigmoid_train_test_bn.prototxt", "TRAIN", ()): ("ip1", (100, 10), 4),
    ("cifar10/cifar10_full_sigmoid_train_test_bn.prototxt", "TEST", ()): ("ip1", (1000, 10), 4),
    ("mnist/lenet.prototxt", "TEST", ()): ("prob", (64, 10), 8),
    ("mnist/lenet_train_test.prototxt", "TRAIN", ()): ("ip2", (64, 10), 8),
    ("mnist/lenet_train_test.prototxt", "TEST", ()): ("ip2", (100, 10), 8),
    ("mnist/mnist_autoencoder.prototxt", "TRAIN", ()): ("decode1", (100, 784), 8),
    ("mnist/mnist_autoencoder.prototxt", "TEST", ("test-on-test",)): ("decode1", (100, 784), 8),
    ("mnist/mnist_autoencoder.prototxt", "TEST", ("test-on-train",)): ("decode1", (100, 784), 8),
    ("siamese/mnist_siamese.prototxt", "TEST", ()): ("feat", (10000, 2), 4),
}


@needs_models
def test_every_bvlc_net_is_listed():
    files = {p.relative_to(MODELS).as_posix() for p in MODELS.glob("*/*.prototxt") if "solver" not in p.name}
    assert files == {key[0] for key in BVLC_NETS}


@needs_models
@pytest.mark.parametrize("key", sorted(BVLC_NETS), ids=lambda k: f"{k[0]}-{k[1]}{'-' + k[2][0] if k[2] else ''}")
def test_bvlc_net_builds_with_caffe_shapes(key):
    name, phase, stages = key
    blob, shape, batch = BVLC_NETS[key]
    net = load_net_prototxt(MODELS / name, phase=phase, stages=stages)
    assert isinstance(net, CaffeNet) and net.phase == phase
    assert net.net_params.infer_shapes()[blob] == shape
    module = net.build(seed=0)
    inputs = {}
    for top, declared in net.inputs.items():
        n = batch if declared[0] > batch else declared[0]
        if top == getattr(module, "label_input", None):
            inputs[top] = torch.randint(0, 10, (n,) + declared[1:])
        else:
            inputs[top] = torch.rand((n,) + declared[1:])
    with torch.no_grad():
        blobs = module.run(inputs)
    assert tuple(blobs[blob].shape) == (batch,) + shape[1:]
    for top in module.loss_blobs:
        assert torch.isfinite(blobs[top]), top


@needs_models
def test_lenet_data_binding_and_transform():
    train = load_net_prototxt(MODELS / "mnist/lenet_train_test.prototxt", "TRAIN")
    test = load_net_prototxt(MODELS / "mnist/lenet_train_test.prototxt", "TEST")
    assert (train.batch_size, test.batch_size) == (64, 100)
    assert (train.data_binding.dataset, train.data_binding.split) == ("mnist", "train")
    assert (test.data_binding.dataset, test.data_binding.split) == ("mnist", "test")
    spec = train.data_layers[0]
    assert spec.layer == "mnist" and spec.tops == ("data", "label") and spec.source.endswith("mnist_train_lmdb")
    data, label = train.net_params["data"], train.net_params["label"]
    assert isinstance(data, RDDLayer) and data.shape == (64, 1, 28, 28) and data.dtype == "float32"
    assert label.shape == (64,) and label.dtype == "int64"
    assert "accuracy" not in [layer.name for layer in train.net_params]
    assert "accuracy" in [layer.name for layer in test.net_params]
    # Caffe scales raw 0-255 pixels by 1/256; sparknet's MNIST is already in [0, 1] (native scale 1/255)
    t = train.transform
    assert t.scale == 0.00390625 and t.native_scale == pytest.approx(1 / 255)
    pixels = np.array([0.0, 1.0, 128 / 255], dtype=np.float32).reshape(1, 1, 1, 3)
    np.testing.assert_allclose(t(pixels).ravel(), [0.0, 255 / 256, 128 / 256], rtol=1e-6)
    assert not t.is_identity
    auto = load_net_prototxt(MODELS / "mnist/mnist_autoencoder.prototxt", "TRAIN")
    assert auto.transform.is_identity  # scale 0.0039215684 = 1/255 undoes nothing on [0, 1] pixels


@needs_models
def test_alexnet_crop_mirror_and_mean_file():
    train = load_net_prototxt(MODELS / "bvlc_alexnet/train_val.prototxt", "TRAIN")
    test = load_net_prototxt(MODELS / "bvlc_alexnet/train_val.prototxt", "TEST")
    assert train.net_params["data"].shape == (256, 3, 227, 227)
    assert test.net_params["data"].shape == (50, 3, 227, 227)
    assert train.data_binding.dataset == "imagenet" and test.data_binding.split == "validation"
    t = train.transform
    assert t.mirror and t.crop_size == 227 and t.mean_file.endswith("imagenet_mean.binaryproto")
    batch = np.random.default_rng(0).random((2, 3, 256, 256), dtype=np.float32)
    with pytest.raises(ValueError, match="mean_file"):
        t(batch)
    mean = np.full((3, 256, 256), 100.0, dtype=np.float32)
    out = t.with_mean(mean)(batch, np.random.default_rng(1))
    assert out.shape == (2, 3, 227, 227)
    centre = test.transform.with_mean(mean)(batch)
    np.testing.assert_allclose(centre, batch[:, :, 14:241, 14:241] * 255 - 100, rtol=1e-5, atol=1e-3)


def test_transform_mean_values_crop_and_mirror():
    t = CaffeTransform(scale=0.5, mean_value=(1.0, 2.0), crop_size=2, mirror=True, train=False)
    x = np.arange(2 * 2 * 4 * 4, dtype=np.float32).reshape(2, 2, 4, 4)
    out = t(x, np.random.default_rng(3))
    assert out.shape == (2, 2, 2, 2)
    centre = (x[:, :, 1:3, 1:3] - np.array([1.0, 2.0], dtype=np.float32)[None, :, None, None]) * 0.5
    for i in range(2):
        assert np.array_equal(out[i], centre[i]) or np.array_equal(out[i], centre[i][..., ::-1])


V1_NET = """
name: "V1Net"
layers {
  name: "mnist"
  type: DATA
  top: "data"
  top: "label"
  data_param { source: "examples/mnist/mnist_train_lmdb" batch_size: 32 scale: 0.00390625 }
  include: { phase: TRAIN }
}
layers {
  name: "conv1"
  type: CONVOLUTION
  bottom: "data"
  top: "conv1"
  blobs_lr: 1
  blobs_lr: 2
  weight_decay: 1
  weight_decay: 0
  convolution_param {
    num_output: 4
    kernel_size: 5
    stride: 1
    weight_filler { type: "gaussian" std: 0.01 }
    bias_filler { type: "constant" value: 0.5 }
  }
}
layers { name: "relu1" type: RELU bottom: "conv1" top: "conv1" }
layers {
  name: "pool1"
  type: POOLING
  bottom: "conv1"
  top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 }
}
layers {
  name: "ip1"
  type: INNER_PRODUCT
  bottom: "pool1"
  top: "ip1"
  blobs_lr: 3
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } }
}
layers { name: "acc" type: ACCURACY bottom: "ip1" bottom: "label" top: "acc" include: { phase: TEST } }
layers { name: "loss" type: SOFTMAX_LOSS bottom: "ip1" bottom: "label" top: "loss" }
"""


def test_v1_layers_syntax():
    net = load_net_prototxt(V1_NET, "TRAIN")
    names = [layer.name for layer in net.net_params]
    assert names == ["data", "label", "conv1", "relu1", "pool1", "ip1", "loss"]
    conv = net.net_params["conv1"]
    assert isinstance(conv, ConvLayer) and conv.kernel == (5, 5) and conv.num_filters == 4
    assert conv.lr_mult == (1.0, 2.0) and conv.decay_mult == (1.0, 0.0)
    assert conv.weight_filler.type == "gaussian" and conv.weight_filler.std == 0.01
    assert conv.bias_filler.value == 0.5
    assert net.net_params["ip1"].lr_mult == (3.0, 1.0)
    assert isinstance(net.net_params["relu1"], ActivationLayer)
    assert net.transform.scale == 0.00390625  # moved from the V1 data_param, as Caffe's upgrade does
    assert net.layer_types["conv1"] == "Convolution" and net.layer_types["loss"] == "SoftmaxWithLoss"
    assert [layer.type for layer in net.proto.layer][:2] == ["Data", "Convolution"]
    module = net.build(seed=0)
    assert torch.all(module.layer_weights()["conv1"][1] == 0.5)
    loss, pred = module.loss(torch.rand(3, 1, 28, 28), torch.randint(0, 10, (3,)))
    assert pred.shape == (3, 10) and torch.isfinite(loss)
    # the TEST phase drops the data layer: nothing produces "data"
    with pytest.raises(PrototxtError, match="conv1.*'data'.*left out in phase TEST"):
        load_net_prototxt(V1_NET, "TEST")


LEGACY_INPUT = """
name: "legacy"
input: "data"
input_dim: 2
input_dim: 3
input_dim: 8
input_dim: 8
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 5 kernel_h: 3 kernel_w: 1 pad_h: 1 pad_w: 0 stride_h: 2 stride_w: 1 } }
layer { name: "flat" type: "Flatten" bottom: "conv" top: "flat" }
layer { name: "sm" type: "Softmax" bottom: "flat" top: "sm" }
"""


def test_legacy_input_fields_and_hw_options():
    net = load_net_prototxt(LEGACY_INPUT)
    assert net.inputs == {"data": (2, 3, 8, 8)}
    conv = net.net_params["conv"]
    assert (conv.kernel, conv.pad, conv.stride) == ((3, 1), (1, 0), (2, 1))
    assert net.net_params.infer_shapes()["sm"] == (2, 5 * 4 * 8)
    out = net.build(seed=0)(torch.rand(2, 3, 8, 8))
    assert out.shape == (2, 160)


STATE_NET = """
name: "states"
layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 2 dim: 6 } } }
layer { name: "train_only" type: "InnerProduct" bottom: "data" top: "a"
        inner_product_param { num_output: 3 } exclude { phase: TEST } }
layer { name: "test_only" type: "InnerProduct" bottom: "data" top: "a"
        inner_product_param { num_output: 4 } include { phase: TEST } }
layer { name: "staged" type: "TanH" bottom: "a" top: "a" include { stage: "deploy" } }
layer { name: "unstaged" type: "Sigmoid" bottom: "a" top: "a" include { not_stage: "deploy" } }
layer { name: "leveled" type: "ReLU" bottom: "a" top: "a" include { min_level: 2 } }
"""


def test_phase_stage_and_level_rules():
    def names(**kw):
        return [layer.name for layer in load_net_prototxt(STATE_NET, **kw).net_params]

    assert names(phase="TRAIN") == ["data", "train_only", "unstaged"]
    assert names(phase="TEST") == ["data", "test_only", "unstaged"]
    assert names(phase="TEST", stages=("deploy",)) == ["data", "test_only", "staged"]
    assert names(phase="TRAIN", level=3) == ["data", "train_only", "unstaged", "leveled"]
    assert load_net_prototxt(STATE_NET, "TEST").net_params.infer_shapes()["a"] == (2, 4)
    with pytest.raises(ValueError, match="phase"):
        load_net_prototxt(STATE_NET, "VALIDATE")


@needs_models
def test_lr_and_decay_mult_reach_param_groups():
    net = load_net_prototxt(MODELS / "mnist/lenet_train_test.prototxt", "TRAIN")
    module = net.build(seed=0)
    groups = {(g["lr_mult"], g["decay_mult"]): g["params"] for g in module.param_groups()}
    assert set(groups) == {(1.0, 1.0), (2.0, 1.0)}
    weights = module.layer_weights()
    biases = {id(weights[name][1]) for name in ("conv1", "conv2", "ip1", "ip2")}
    assert {id(p) for p in groups[(2.0, 1.0)]} == biases
    auto = load_net_prototxt(MODELS / "mnist/mnist_autoencoder.prototxt", "TRAIN").build(seed=0)
    groups = {(g["lr_mult"], g["decay_mult"]): len(g["params"]) for g in auto.param_groups()}
    assert groups == {(1.0, 1.0): 8, (1.0, 0.0): 8}


@needs_models
def test_autoencoder_loss_is_finite_and_sparse_filler_applied():
    net = load_net_prototxt(MODELS / "mnist/mnist_autoencoder.prototxt", "TRAIN")
    assert net.net_params["loss"].loss_weight == 1.0 and net.net_params["loss_1"].loss_weight == 0.0
    module = net.build(seed=1)
    w = module.layer_weights()["encode1"][0]
    assert w.shape == (1000, 784)
    assert 0.008 < float((w != 0).float().mean()) < 0.022  # Caffe's sparse: 15 of 1000 outputs kept
    x = torch.rand(8, 1, 28, 28)
    loss, pred = module.loss(x, None)
    assert torch.isfinite(loss) and pred.shape == (8, 784)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters())


@needs_models
def test_solver_loads_its_net_with_test_stages():
    solver = load_solver_prototxt(MODELS / "mnist/mnist_autoencoder_solver.prototxt")
    test_net = solver.load_net("TEST")
    assert test_net.stages == ("test-on-train",) and test_net.data_binding.split == "train"
    other = solver.load_net("TEST", stages=("test-on-test",))
    assert other.data_binding.split == "test"
    lenet = load_solver_prototxt(MODELS / "mnist/lenet_solver.prototxt").load_net("TRAIN")
    assert lenet.batch_size == 64


def test_custom_source_binding_and_unbound_source():
    text = V1_NET.replace("examples/mnist/mnist_train_lmdb", "/data/digits_lmdb")
    with pytest.raises(PrototxtError, match=r"layer 'mnist' \(Data\).*digits_lmdb.*DataBinding"):
        load_net_prototxt(text)
    bound = load_net_prototxt(text, sources={"/data/digits_lmdb": "mnist:test"})
    assert bound.data_binding == DataBinding("mnist", "test", (1, 28, 28), 1 / 255, 10)
    own = load_net_prototxt(text, sources={"digits_lmdb": DataBinding(None, sample_shape=(1, 32, 32))})
    assert own.net_params["data"].shape == (32, 1, 32, 32)


def test_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.prototxt"
    path.write_text('name: "x"\nlayer {\n  name: "a"\n  type: "ReLU"\n  botom: "b"\n}\n')
    with pytest.raises(PrototxtError) as info:
        load_net_prototxt(path)
    assert str(info.value).startswith(f"{path}:5:")
    assert info.value.line == 5 and info.value.path == str(path)
    assert "botom" in str(info.value)
    again = pickle.loads(pickle.dumps(info.value))
    assert again.line == 5 and str(again) == str(info.value)


def test_unknown_layer_type_names_layer_and_type(tmp_path):
    path = tmp_path / "unknown.prototxt"
    path.write_text(LEGACY_INPUT.replace('type: "Flatten"', 'type: "Deconvolution"'))
    with pytest.raises(PrototxtError, match=r"unknown\.prototxt:10: layer 'flat' has type 'Deconvolution'") as info:
        load_net_prototxt(path)
    assert info.value.layer == "flat"


def test_missing_bottom_and_bad_shape_name_the_layer(tmp_path):
    path = tmp_path / "missing.prototxt"
    path.write_text(LEGACY_INPUT.replace('bottom: "conv" top: "flat"', 'bottom: "convv" top: "flat"'))
    with pytest.raises(PrototxtError, match=r"missing\.prototxt:10: .*'flat'.*'convv'") as info:
        load_net_prototxt(path)
    assert info.value.layer == "flat"
    path = tmp_path / "shape.prototxt"
    path.write_text(LEGACY_INPUT.replace("kernel_h: 3 kernel_w: 1", "kernel_h: 30 kernel_w: 1"))
    with pytest.raises(PrototxtError, match=r"shape\.prototxt:8: .*'conv'") as info:
        load_net_prototxt(path)
    assert info.value.layer == "conv"


def test_more_layer_types_map():
    text = """
    name: "plumbing"
    layer { name: "in" type: "Input" top: "x" top: "y" top: "ids"
            input_param { shape { dim: 2 dim: 4 dim: 3 dim: 3 } shape { dim: 2 dim: 4 dim: 3 dim: 3 }
                          shape { dim: 2 dim: 5 } } }
    layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x" batch_norm_param { moving_average_fraction: 0.9 } }
    layer { name: "sc" type: "Scale" bottom: "x" top: "x" scale_param { bias_term: true } }
    layer { name: "lrn" type: "LRN" bottom: "x" top: "n" lrn_param { local_size: 3 alpha: 0.5 } }
    layer { name: "cat" type: "Concat" bottom: "n" bottom: "y" top: "cat" }
    layer { name: "sum" type: "Eltwise" bottom: "cat" bottom: "cat" top: "sum" eltwise_param { coeff: 1 coeff: -1 } }
    layer { name: "sl" type: "Slice" bottom: "sum" top: "a" top: "b" slice_param { slice_point: 3 } }
    layer { name: "sp" type: "Split" bottom: "b" top: "b1" top: "b2" }
    layer { name: "si" type: "Silence" bottom: "b2" }
    layer { name: "drop" type: "Dropout" bottom: "a" top: "a" dropout_param { dropout_ratio: 0.3 } }
    layer { name: "rs" type: "Reshape" bottom: "a" top: "r" reshape_param { shape { dim: 0 dim: -1 } } }
    layer { name: "emb" type: "Embed" bottom: "ids" top: "e" embed_param { num_output: 6 input_dim: 9 } }
    layer { name: "tanh" type: "TanH" bottom: "e" top: "e" }
    layer { name: "elu" type: "ELU" bottom: "r" top: "r" }
    layer { name: "loss" type: "ContrastiveLoss" bottom: "r" bottom: "r" bottom: "ids" top: "loss"
            contrastive_loss_param { margin: 2 } }
    """
    text = text.replace('bottom: "r" bottom: "r" bottom: "ids"', 'bottom: "r" bottom: "r2" bottom: "lab"')
    text = text.replace('layer { name: "loss"', 'layer { name: "r2" type: "Power" bottom: "r" top: "r2" '
                        'power_param { scale: 2 } }\n    layer { name: "lab" type: "Reduction" bottom: "ids" top: "lab" }\n'
                        '    layer { name: "loss"')
    with pytest.raises(PrototxtError, match="'lab' has type 'Reduction'"):
        load_net_prototxt(text)
    text = text.replace('layer { name: "lab" type: "Reduction" bottom: "ids" top: "lab" }',
                        'layer { name: "lab" type: "Slice" bottom: "ids" top: "lab" top: "rest" '
                        'slice_param { axis: 1 slice_point: 1 } }')
    net = load_net_prototxt(text)
    layers = net.net_params
    assert layers["bn"].momentum == pytest.approx(0.1) and layers["sc"].bias_term
    assert layers["lrn"].alpha == 0.5 and layers["sum"].coeffs == (1.0, -1.0)
    assert layers["drop"].ratio == pytest.approx(0.3) and layers["emb"].num_embeddings == 9
    assert layers["loss"].margin == 2.0
    shapes = layers.infer_shapes()
    assert shapes["cat"] == (2, 8, 3, 3) and shapes["a"] == (2, 3, 3, 3) and shapes["r"] == (2, 27)
    assert shapes["e"] == (2, 5, 6)
    module = net.build(seed=0)
    blobs = module.run({"x": torch.rand(2, 4, 3, 3), "y": torch.rand(2, 4, 3, 3), "ids": torch.randint(0, 9, (2, 5))})
    assert blobs["e"].shape == (2, 5, 6) and torch.isfinite(blobs["loss"])


@needs_models
def test_caffemodel_export_import_through_a_net(tmp_path):
    net = load_net_prototxt(MODELS / "mnist/lenet_train_test.prototxt", "TRAIN")
    source = net.build(seed=0)
    path = write_caffemodel(tmp_path / "lenet.caffemodel", source.layer_weights(), net)
    layers = {layer.name: layer for layer in read_caffemodel_layers(path)}
    assert layers["conv1"].type == "Convolution" and layers["ip2"].type == "InnerProduct"
    assert layers["mnist"].type == "Data" and not layers["mnist"].blobs
    assert [b.shape for b in layers["conv1"].blobs] == [(20, 1, 5, 5), (20,)]
    target = load_net_prototxt(MODELS / "mnist/lenet.prototxt", "TEST").build(seed=1)
    loaded = load_caffemodel_into(target, path)
    assert loaded == ["conv1", "conv2", "ip1", "ip2"]
    x = torch.rand(4, 1, 28, 28)
    with torch.no_grad():
        expected = torch.softmax(source(x), dim=1)
        np.testing.assert_allclose(target(x).numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
    # a net whose ip2 is 12 wide does not fit the file, and the error names the layer
    text = (MODELS / "mnist/lenet.prototxt").read_text().replace("num_output: 10", "num_output: 12")
    wrong = load_net_prototxt(text).build(seed=0)
    with pytest.raises(Exception, match=r"'ip2'.*\[10, 500\].*\[12, 500\]"):
        load_caffemodel_into(wrong, path)


@needs_models
def test_batch_norm_caffemodel_round_trip(tmp_path):
    net = load_net_prototxt(MODELS / "cifar10/cifar10_full_sigmoid_train_test_bn.prototxt", "TRAIN")
    source = net.build(seed=0)
    with torch.no_grad():
        source.loss(torch.rand(8, 3, 32, 32), torch.randint(0, 10, (8,)))  # moves the running stats
    path = write_caffemodel(tmp_path / "bn.caffemodel", source.layer_weights(), net)
    raw = read_caffemodel(path)
    assert [b.shape for b in raw["bn1"]] == [(32,), (32,), (1,)]  # Caffe's three BatchNorm blobs
    for a, b in zip(source.layer_weights()["bn1"], raw["bn1"]):
        assert a.numpy().tobytes() == b.tobytes()
    target = net.build(seed=5)
    load_caffemodel_into(target, path)
    for name, tensors in source.layer_weights().items():
        for a, b in zip(tensors, target.layer_weights()[name]):
            assert torch.equal(a, b), name
    # a Caffe file stores BatchNorm statistics multiplied by the factor in blob 3: the net keeps the three
    # blobs as Caffe does, and its statistics are the sums divided by the factor
    assert raw["bn1"][2].tolist() == [1.0]  # one training pass: s = 0 * λ + 1
    scaled = {"bn1": [raw["bn1"][0] * 4, raw["bn1"][1] * 4, np.array([4.0], dtype=np.float32)]}
    write_caffemodel(tmp_path / "scaled.caffemodel", scaled, net)
    load_caffemodel_into(target, tmp_path / "scaled.caffemodel")
    mean, _, factor = target.layer_weights()["bn1"]
    np.testing.assert_allclose((mean / factor).numpy(), raw["bn1"][0], rtol=1e-6)


def test_write_with_netparams_structure(tmp_path):
    net = load_net_prototxt(LEGACY_INPUT)
    module = net.build(seed=0)
    path = write_caffemodel(tmp_path / "n.caffemodel", module.layer_weights(), net.net_params, name="legacy")
    layers = read_caffemodel_layers(path)
    assert [(layer.name, layer.type) for layer in layers] == [
        ("data", "Input"), ("conv", "Convolution"), ("flat", "Flatten"), ("sm", "Softmax")]
    assert isinstance(net.net_params["conv"], ConvLayer) and not isinstance(net.net_params["conv"], LinearLayer)


@pytest.mark.parametrize("name", ["lenet", "cifar_cnn", "alexnet"])
def test_zoo_net_exports_to_prototxt_and_back(name, tmp_path):
    from sparknet import zoo

    from sparknet.caffe import net_to_prototxt

    original = getattr(zoo, name)()
    text = net_to_prototxt(original)
    back = load_net_prototxt(text, "TRAIN")
    assert back.net_params.infer_shapes() == original.infer_shapes()
    assert [type(layer) for layer in back.net_params] == [type(layer) for layer in original]
    assert back.net_params["label"].dtype == "int64"  # an Input read as class labels
    for layer in original:
        if hasattr(layer, "lr_mult"):
            mirrored = back.net_params[layer.name]
            assert mirrored.lr_mult == layer.lr_mult[:2] and mirrored.decay_mult == layer.decay_mult[:2]


@needs_models
def test_caffenet_prototxt_round_trip():
    from sparknet.caffe import net_to_prototxt

    net = load_net_prototxt(MODELS / "mnist/lenet_train_test.prototxt", "TEST")
    again = load_net_prototxt(net_to_prototxt(net), "TEST")
    assert again.net_params == net.net_params and again.batch_size == 100


BATCH_NORM = """
name: "bn"
input: "data"
input_shape { dim: 4 dim: 2 dim: 3 dim: 3 }
layer { name: "bn" type: "BatchNorm" bottom: "data" top: "out" batch_norm_param { moving_average_fraction: 0.9 } }
"""


def test_batch_norm_statistics_follow_caffe_s_rule_of_decayed_sums_and_a_scale_factor():
    # batch_norm_layer.cpp: s <- λs + 1, mean <- λ mean + batch mean, var <- λ var + m/(m-1) batch var, all from 0;
    # at test time the statistics are mean / s and var / s (no weight left on a starting 0 or 1)
    module = load_net_prototxt(BATCH_NORM).build(seed=0)
    batches = [torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(i)) * (i + 1) + i for i in range(3)]
    module.train()
    for b in batches:
        module.run({"data": b})
    lam, m = 0.9, 4 * 3 * 3
    weights = [lam ** (len(batches) - 1 - i) for i in range(len(batches))]
    s = sum(weights)
    mean = sum(w * b.mean((0, 2, 3)) for w, b in zip(weights, batches)) / s
    var = sum(w * b.var((0, 2, 3), unbiased=False) * m / (m - 1) for w, b in zip(weights, batches)) / s
    module.eval()
    x = torch.randn(4, 2, 3, 3)
    got = module.run({"data": x})["out"]
    want = (x - mean.view(1, 2, 1, 1)) / torch.sqrt(var.view(1, 2, 1, 1) + 1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert [t.tolist() for t in module.layer_weights()["bn"]][2] == pytest.approx([s])
