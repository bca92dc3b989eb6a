""".caffemodel read/write: exact round trips, Caffe's wire format, legacy blobs, shape errors."""

from __future__ import annotations

import struct
from collections import OrderedDict

import numpy as np
import pytest
import torch

from _protobuf_wire import varint
from sparknet.caffe.caffemodel import (
    describe_caffemodel,
    load_caffemodel_into,
    read_binaryproto,
    read_caffemodel,
    read_caffemodel_layers,
    write_caffemodel,
)
from sparknet.errors import GraphError


# --- an independent encoder of Caffe's wire format (field numbers from caffe.proto) -------------
def _field(number: int, payload: bytes) -> bytes:  # length-delimited
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def _vfield(number: int, value: int) -> bytes:  # varint
    return varint(number << 3) + varint(value)


def _blob(array: np.ndarray, legacy: bool = False) -> bytes:
    if legacy:  # num=1 channels=2 height=3 width=4, unpacked-era 4-D shape
        dims = [1] * (4 - array.ndim) + list(array.shape)
        head = b"".join(_vfield(i + 1, d) for i, d in enumerate(dims))
    else:  # shape=7 { dim=1 packed }
        head = _field(7, _field(1, b"".join(varint(d) for d in array.shape)))
    if array.dtype == np.float64:
        values = _field(8, struct.pack(f"<{array.size}d", *array.ravel()))
    else:
        values = _field(5, struct.pack(f"<{array.size}f", *array.ravel()))
    # Caffe (C++ protobuf) writes fields in number order: num..width 1-4, data 5, shape 7, double_data 8
    if legacy:
        return head + values
    return values + head if array.dtype == np.float32 else head + values


def _layer(name: str, kind: str, blobs: list[bytes]) -> bytes:  # LayerParameter: name=1 type=2 blobs=7
    return _field(1, name.encode()) + _field(2, kind.encode()) + b"".join(_field(7, b) for b in blobs)


def _v1_layer(name: str, kind: int, blobs: list[bytes]) -> bytes:  # V1: name=4 type=5 blobs=6
    return _field(4, name.encode()) + _vfield(5, kind) + b"".join(_field(6, b) for b in blobs)


RNG = np.random.default_rng(7)
CONV_W = RNG.standard_normal((4, 3, 2, 2)).astype(np.float32)
CONV_B = RNG.standard_normal(4).astype(np.float32)
IP_W = RNG.standard_normal((5, 16)).astype(np.float32)
IP_B = RNG.standard_normal(5).astype(np.float32)


def test_reads_hand_encoded_caffe_bytes(tmp_path):
    net = _field(1, b"tiny")  # NetParameter.name = 1; layer = 100
    net += _field(100, _layer("data", "Input", []))
    net += _field(100, _layer("conv1", "Convolution", [_blob(CONV_W), _blob(CONV_B)]))
    net += _field(100, _layer("ip", "InnerProduct", [_blob(IP_W), _blob(IP_B.astype(np.float64))]))
    path = tmp_path / "tiny.caffemodel"
    path.write_bytes(net)
    weights = read_caffemodel(path)
    assert list(weights) == ["conv1", "ip"]
    assert weights["conv1"][0].dtype == np.float32 and weights["conv1"][0].tobytes() == CONV_W.tobytes()
    assert weights["conv1"][1].tobytes() == CONV_B.tobytes()
    assert weights["ip"][1].dtype == np.float64 and np.array_equal(weights["ip"][1], IP_B.astype(np.float64))
    layers = read_caffemodel_layers(path)
    assert [(l.name, l.type) for l in layers] == [("data", "Input"), ("conv1", "Convolution"), ("ip", "InnerProduct")]


def test_reads_v1_layers_and_legacy_4d_blobs(tmp_path):
    net = _field(1, b"old")
    net += _field(2, _v1_layer("conv1", 4, [_blob(CONV_W, legacy=True), _blob(CONV_B, legacy=True)]))
    net += _field(2, _v1_layer("ip", 14, [_blob(IP_W, legacy=True), _blob(IP_B, legacy=True)]))
    net += _field(2, _v1_layer("relu", 18, []))
    path = tmp_path / "v1.caffemodel"
    path.write_bytes(net)
    layers = read_caffemodel_layers(path)
    assert [(l.name, l.type) for l in layers] == [("conv1", "Convolution"), ("ip", "InnerProduct"), ("relu", "ReLU")]
    weights = read_caffemodel(path)
    assert weights["ip"][0].shape == (1, 1, 5, 16) and weights["ip"][1].shape == (1, 1, 1, 5)
    # loading into a net reshapes legacy blobs whose shapes differ only by leading 1s
    target = OrderedDict(conv1=[torch.zeros(4, 3, 2, 2), torch.zeros(4)], ip=[torch.zeros(5, 16), torch.zeros(5)])
    assert load_caffemodel_into(target, path) == ["conv1", "ip"]
    assert np.array_equal(target["ip"][0].numpy(), IP_W) and np.array_equal(target["ip"][1].numpy(), IP_B)
    assert np.array_equal(target["conv1"][0].numpy(), CONV_W)


def test_write_matches_caffe_wire_format(tmp_path):
    path = write_caffemodel(tmp_path / "w.caffemodel", {"ip": [IP_W, IP_B]}, name="n")
    expected = _field(1, b"n") + _field(100, _field(1, b"ip") + b"".join(_field(7, _blob(b)) for b in (IP_W, IP_B)))
    assert path.read_bytes() == expected


def test_round_trip_is_exact(tmp_path):
    weights = OrderedDict(
        conv=[torch.randn(8, 3, 5, 5), torch.randn(8)],
        bn=[torch.randn(8), torch.rand(8), torch.ones(1)],
        ip=[torch.randn(10, 32, dtype=torch.float64), torch.randn(10, dtype=torch.float64)],
        scalar=[torch.tensor(2.5)],
        special=[torch.tensor([np.inf, -np.inf, np.nan, -0.0, 1e-45], dtype=torch.float32)],
    )
    path = write_caffemodel(tmp_path / "rt.caffemodel", weights)
    back = read_caffemodel(path)
    assert list(back) == list(weights)
    for name, tensors in weights.items():
        assert len(back[name]) == len(tensors)
        for t, a in zip(tensors, back[name]):
            assert a.shape == tuple(t.shape) and a.dtype == t.numpy().dtype
            assert a.tobytes() == t.numpy().tobytes()
    # and again through a second write: same bytes on disk
    again = write_caffemodel(tmp_path / "rt2.caffemodel", back)
    assert again.read_bytes() == path.read_bytes()


def test_shape_mismatch_names_the_layer(tmp_path):
    path = write_caffemodel(tmp_path / "m.caffemodel", {"conv1": [CONV_W, CONV_B], "ip": [IP_W, IP_B]})
    target = OrderedDict(conv1=[torch.zeros(4, 3, 2, 2), torch.zeros(4)], ip=[torch.zeros(6, 16), torch.zeros(6)])
    with pytest.raises(GraphError, match=r"'ip'.*\[5, 16\].*\[6, 16\]") as info:
        load_caffemodel_into(target, path)
    assert info.value.layer == "ip"
    too_many = OrderedDict(conv1=[torch.zeros(4, 3, 2, 2)])
    with pytest.raises(GraphError, match="conv1.*2 blobs"):
        load_caffemodel_into(too_many, path)
    # layers only in the file are skipped; strict demands every net layer be present
    extra = OrderedDict(conv1=[torch.zeros(4, 3, 2, 2), torch.zeros(4)], other=[torch.zeros(3)])
    assert load_caffemodel_into(extra, path) == ["conv1"]
    with pytest.raises(GraphError, match="other"):
        load_caffemodel_into(extra, path, strict=True)


def test_describe_and_binaryproto(tmp_path):
    path = write_caffemodel(tmp_path / "d.caffemodel", {"conv1": [CONV_W, CONV_B], "ip": [IP_W, IP_B]})
    text = describe_caffemodel(path)
    assert "conv1" in text and "4x3x2x2, 4" in text and "5x16, 5" in text
    assert f"{CONV_W.size + CONV_B.size + IP_W.size + IP_B.size:,} parameters" in text
    mean = RNG.random((1, 3, 4, 4)).astype(np.float32)
    (tmp_path / "mean.binaryproto").write_bytes(_blob(mean, legacy=True))
    assert np.array_equal(read_binaryproto(tmp_path / "mean.binaryproto"), mean)
    (tmp_path / "junk.caffemodel").write_bytes(b"\xff\xff\xff")
    with pytest.raises(ValueError, match="junk"):
        read_caffemodel(tmp_path / "junk.caffemodel")
