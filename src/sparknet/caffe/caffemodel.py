"""``.caffemodel`` weights in and out (a binary ``NetParameter`` whose layers carry blobs).

>>> weights = read_caffemodel("lenet_iter_10000.caffemodel")        # doctest: +SKIP
>>> [w.shape for w in weights["conv1"]]                               # doctest: +SKIP
[(20, 1, 5, 5), (20,)]
>>> load_caffemodel_into(net, "lenet_iter_10000.caffemodel")         # doctest: +SKIP
>>> write_caffemodel("out.caffemodel", net.module.layer_weights(), caffe_net)  # doctest: +SKIP
>>> print(describe_caffemodel("out.caffemodel"))                      # doctest: +SKIP

Caffe's blob order per layer is sparknet's ``GraphModule.layer_weights()`` order: weight,
then bias, then running statistics. A Caffe ``BatchNorm`` has a third blob, the factor its
stored mean and variance are multiplied by; reading divides it out and writing adds a 1.
Both the current ``layer`` and the legacy V1 ``layers`` field are read; a blob's shape is
its ``shape`` or, in old files, the 4-D ``num/channels/height/width``. Values are ``data``
(float32) or ``double_data`` (float64), and writing keeps each tensor's bits in the same two.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import dropwhile
from pathlib import Path
from typing import Any

import numpy as np

from sparknet.caffe import _schema
from sparknet.errors import GraphError

logger = logging.getLogger(__name__)

__all__ = ["CaffeModelLayer", "read_caffemodel", "read_caffemodel_layers", "load_caffemodel_into", "write_caffemodel",
           "describe_caffemodel", "read_binaryproto"]


def v1_type_name(number: int) -> str:
    """Caffe's current type string for a V1 ``LayerType`` enum number (``4`` -> ``"Convolution"``)."""
    return _schema.V1_TYPE_NAMES.get(number, f"V1:{number}")


@dataclass(frozen=True)
class CaffeModelLayer:
    """One layer of a ``.caffemodel``: its name, Caffe type and blobs."""

    name: str
    type: str
    blobs: tuple[np.ndarray, ...]
    legacy_shapes: tuple[bool, ...] = ()
    """Per blob: True when its shape came from the old num/channels/height/width fields."""

    @property
    def num_params(self) -> int:
        return int(sum(b.size for b in self.blobs))


def _blob_to_array(blob: Any) -> tuple[np.ndarray, bool]:
    if blob.HasField("shape"):
        shape, legacy = tuple(int(d) for d in blob.shape.dim), False
    else:
        shape, legacy = (int(blob.num), int(blob.channels), int(blob.height), int(blob.width)), True
    if len(blob.double_data) > 0:
        values = np.asarray(blob.double_data, dtype=np.float64)
    else:
        values = np.asarray(blob.data, dtype=np.float32)
    expected = int(np.prod(shape)) if shape else 1
    if values.size != expected:
        raise ValueError(f"blob of shape {list(shape)} holds {values.size} values, not {expected}")
    return values.reshape(shape), legacy


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


# Wire tags of BlobProto's packed ``data`` (field 5) and ``double_data`` (field 8).
_DATA_TAG = bytes([5 << 3 | 2])
_DOUBLE_DATA_TAG = bytes([8 << 3 | 2])


def _array_to_blob(array: np.ndarray, blob: Any) -> None:
    """Fill ``blob`` with ``array``'s shape and values, keeping every bit.

    The values are encoded straight into the packed wire form and merged in, which is
    two orders of magnitude faster than adding 60 million Python floats one by one.
    """
    blob.shape.SetInParent()  # a scalar blob has a shape with no dims, not a legacy 4-D one
    blob.shape.dim.extend(int(d) for d in array.shape)
    if array.size == 0:
        return
    if array.dtype == np.float64:
        tag, raw = _DOUBLE_DATA_TAG, np.ascontiguousarray(array, dtype="<f8").tobytes()
    else:
        tag, raw = _DATA_TAG, np.ascontiguousarray(array, dtype="<f4").tobytes()
    blob.MergeFromString(tag + _varint(len(raw)) + raw)


def _parse(path: str | os.PathLike, msg: Any, what: str) -> Any:
    """``msg`` read from the binary file ``path``; a ValueError saying the file is not ``what``."""
    try:
        msg.ParseFromString(Path(path).read_bytes())
    except Exception as exc:  # protobuf's DecodeError
        raise ValueError(f"{path}: not a Caffe {what}: {exc}") from None
    return msg


def read_caffemodel_layers(path: str | os.PathLike) -> list[CaffeModelLayer]:
    """Every layer of a ``.caffemodel`` in file order, with blobs or without.

    Reads the ``layer`` field and the legacy V1 ``layers`` field (and the blobs of very old
    V0 layers nested in V1 ``layer``).

    Raises
    ------
    ValueError
        Naming the file, when it is not a binary ``NetParameter`` (cut short, bytes changed) or a
        layer's name is not text.
    GraphError
        Naming the file and the layer, when a blob holds another number of values than its shape.
    """
    msg = _parse(Path(path), _schema.NetParameter(), ".caffemodel (binary NetParameter)")
    out: list[CaffeModelLayer] = []
    for i, layer in enumerate(msg.layer):
        out.append(_layer_of(_text(layer.name, i, path), _text(layer.type, i, path), layer.blobs, path))
    for i, layer in enumerate(msg.layers, start=len(msg.layer)):
        blobs = layer.blobs if len(layer.blobs) else layer.layer.blobs
        name = _text(layer.name or layer.layer.name, i, path)
        kind = v1_type_name(layer.type) if layer.HasField("type") else _text(layer.layer.type, i, path)
        out.append(_layer_of(name, kind, blobs, path))
    return out


def _text(value: str | bytes, index: int, path: Any) -> str:
    """A layer's name or type; protobuf gives the bytes of one that is not UTF-8, which no net's layer matches."""
    if isinstance(value, bytes):
        raise ValueError(f"{path}: layer {index} has a name or type that is not UTF-8 text ({value[:40]!r}); "
                         "the file is corrupt")
    return value


def _layer_of(name: str, kind: str, blobs: Sequence[Any], path: Any) -> CaffeModelLayer:
    arrays, legacy = [], []
    for i, blob in enumerate(blobs):
        try:
            array, is_legacy = _blob_to_array(blob)
        except ValueError as exc:
            raise GraphError(f"{path}: layer {name!r} blob {i}: {exc}", layer=name) from None
        arrays.append(array)
        legacy.append(is_legacy)
    return CaffeModelLayer(name, kind, tuple(arrays), tuple(legacy))


def read_caffemodel(path: str | os.PathLike) -> OrderedDict[str, list[np.ndarray]]:
    """Read the weights of a ``.caffemodel``.

    Returns
    -------
    OrderedDict[str, list[numpy.ndarray]]
        Layer name to its blobs (float32 from ``data``, float64 from ``double_data``), in
        file order; layers without blobs are left out. When two layers share a name (Caffe
        allows it), the later one with blobs wins, as in Caffe's ``CopyTrainedLayersFrom``.

    Raises
    ------
    ValueError, GraphError
        As :func:`read_caffemodel_layers`.
    """
    out: OrderedDict[str, list[np.ndarray]] = OrderedDict()
    for layer in read_caffemodel_layers(path):
        if layer.blobs:
            out[layer.name] = list(layer.blobs)
    return out


def _target_weights(target: Any) -> Mapping[str, Sequence[Any]]:
    if isinstance(target, Mapping):
        return target
    for obj in (target, getattr(target, "module", None)):
        fn = getattr(obj, "layer_weights", None)
        if callable(fn):
            return fn()
    raise TypeError(f"cannot load Caffe weights into a {type(target).__name__}: pass a GraphModule, a Net, or a "
                    "mapping of layer name to tensors")


def _fit(array: np.ndarray, shape: tuple[int, ...], legacy: bool) -> np.ndarray | None:
    """``array`` in ``shape``, or None. Legacy 4-D blobs match when only leading 1s differ."""
    if array.shape == shape:
        return array
    if legacy and array.size == int(np.prod(shape)):
        def strip(s: tuple[int, ...]) -> list[int]:
            return list(dropwhile(lambda d: d == 1, s))

        if strip(array.shape) == strip(shape):
            return array.reshape(shape)
    return None


def _from_caffe_batch_norm(layer: CaffeModelLayer, wanted: int) -> list[np.ndarray]:
    """A Caffe BatchNorm's blobs (mean * s, variance * s, [s]) as (mean, variance) when the net wants two."""
    blobs = list(layer.blobs)
    if layer.type == "BatchNorm" and len(blobs) == 3 and wanted == 2 and blobs[2].size == 1:
        factor = float(blobs[2].reshape(-1)[0])
        inverse = 0.0 if factor == 0 else 1.0 / factor
        return [(blobs[0] * inverse).astype(blobs[0].dtype), (blobs[1] * inverse).astype(blobs[1].dtype)]
    return blobs


def load_caffemodel_into(target: Any, path: str | os.PathLike, *, strict: bool = False) -> list[str]:
    """Copy a ``.caffemodel``'s weights into a sparknet net, layer by layer, in place.

    Parameters
    ----------
    target : GraphModule, Net, or mapping of layer name to list of tensors
        Anything with ``layer_weights()`` (or a ``.module`` that has it).
    path : str or path
        The ``.caffemodel``.
    strict : bool
        When True, every layer of the net that has weights must be in the file.
        Layers in the file that the net lacks are always skipped with a log line, as
        Caffe does when fine-tuning.

    Returns
    -------
    list[str]
        The layers that were loaded.

    Raises
    ------
    GraphError
        Naming the layer, when its blob count or a blob's shape differs from the net's.
    ValueError
        Naming the file, when it is not a ``.caffemodel`` (see :func:`read_caffemodel_layers`).
    """
    import torch

    layers = _target_weights(target)
    source = read_caffemodel_layers(path)
    loaded: list[str] = []
    with torch.no_grad():
        for layer in source:
            if not layer.blobs:
                continue
            if layer.name not in layers:
                logger.info("%s: ignoring layer %r (%s): not in the net", path, layer.name, layer.type)
                continue
            tensors = list(layers[layer.name])
            blobs = _from_caffe_batch_norm(layer, len(tensors))
            if len(blobs) > len(tensors):
                raise GraphError(f"{path}: layer {layer.name!r} has {len(blobs)} blobs in the file but "
                                 f"{len(tensors)} tensors in the net", layer=layer.name)
            if len(blobs) < len(tensors):
                logger.info("%s: layer %r has %d blobs for %d tensors; the rest keep their values", path, layer.name,
                            len(blobs), len(tensors))
            fitted = []
            legacy = layer.legacy_shapes or (False,) * len(blobs)
            for i, (blob, tensor, old) in enumerate(zip(blobs, tensors, legacy)):
                shape = tuple(int(d) for d in tensor.shape)
                array = _fit(blob, shape, old)
                if array is None:
                    raise GraphError(f"{path}: layer {layer.name!r} blob {i} has shape {list(blob.shape)} in the file "
                                     f"but {list(shape)} in the net", layer=layer.name)
                fitted.append(array)
            for array, tensor in zip(fitted, tensors):
                tensor.copy_(torch.from_numpy(np.ascontiguousarray(array)).to(tensor.dtype))
            loaded.append(layer.name)
    if strict:
        missing = [n for n, t in layers.items() if len(t) and n not in loaded]
        if missing:
            raise GraphError(f"{path}: no weights for layers {missing}", layer=missing[0])
    logger.info("%s: loaded %d layers", path, len(loaded))
    return loaded


def _to_numpy(tensor: Any) -> np.ndarray:
    if not hasattr(tensor, "detach"):
        array = np.asarray(tensor)
    else:  # a torch tensor
        import torch

        t = tensor.detach().cpu()
        if t.dtype in (torch.float16, torch.bfloat16):
            t = t.float()
        array = t.numpy()
    if array.dtype in (np.float32, np.float64):
        return array
    if np.issubdtype(array.dtype, np.floating):
        return array.astype(np.float32)
    if np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
        if array.size and np.abs(array.astype(np.float64)).max() >= 2**53:
            raise ValueError("integer tensor too large to store exactly in a Caffe blob")
        return array.astype(np.float64)
    raise ValueError(f"cannot store a {array.dtype} tensor in a Caffe blob")


def _layer_structure(net: Any) -> tuple[str | None, dict[str, Any]]:
    """Net name and layer name -> a LayerParameter to fill (type, bottoms, tops)."""
    if net is None:
        return None, {}
    proto = getattr(net, "proto", None)
    if proto is not None and hasattr(proto, "layer"):  # a CaffeNet: keep the full definition
        layers = {}
        for layer in proto.layer:
            layers.setdefault(layer.name, layer)
        return proto.name or None, layers
    layers = {}
    for layer in getattr(net, "layers", net):
        name = getattr(layer, "name", None)
        if name is None:
            continue
        msg = _schema.LayerParameter(name=name, type=_dsl_type(layer))
        msg.bottom.extend(getattr(layer, "bottoms", None) or [])
        msg.top.extend(getattr(layer, "tops", None) or [name])
        if msg.type == "Input" and getattr(layer, "shape", None):
            msg.input_param.shape.add().dim.extend(int(d) for d in layer.shape)
        layers[name] = msg
    return None, layers


_DSL_TYPES = {
    "RDDLayer": "Input", "ConvLayer": "Convolution", "PoolLayer": "Pooling", "LinearLayer": "InnerProduct",
    "DropoutLayer": "Dropout", "BatchNormLayer": "BatchNorm", "ScaleLayer": "Scale",
    "LRNLayer": "LRN", "ConcatLayer": "Concat", "EltwiseLayer": "Eltwise", "SliceLayer": "Slice",
    "SplitLayer": "Split", "SilenceLayer": "Silence", "FlattenLayer": "Flatten",
    "ReshapeLayer": "Reshape", "SoftmaxLayer": "Softmax", "SoftmaxWithLoss": "SoftmaxWithLoss",
    "EuclideanLoss": "EuclideanLoss", "SigmoidCrossEntropyLoss": "SigmoidCrossEntropyLoss",
    "ContrastiveLoss": "ContrastiveLoss", "AccuracyLayer": "Accuracy", "EmbeddingLayer": "Embed",
}
"""A sparknet DSL layer's class name -> Caffe's type (an ``ActivationLayer``'s is by its activation)."""
_ACTIVATION_TYPES = {
    "relu": "ReLU", "leaky_relu": "ReLU", "prelu": "PReLU", "sigmoid": "Sigmoid", "tanh": "TanH",
    "elu": "ELU", "softplus": "BNLL", "abs": "AbsVal", "power": "Power", "swish": "Swish",
}


def _dsl_type(layer: Any) -> str:
    """Caffe's type string for a sparknet DSL layer (its class name, mapped)."""
    kind = type(layer).__name__
    if kind == "ActivationLayer":
        fn = str(getattr(layer, "activation", "relu")).lower().split(".")[-1]
        return _ACTIVATION_TYPES.get(fn, fn)
    return _DSL_TYPES.get(kind, kind.removesuffix("Layer"))


def write_caffemodel(path: str | os.PathLike, weights: Mapping[str, Sequence[Any]], net_params: Any = None, *,
                     name: str | None = None) -> Path:
    """Write weights as a ``.caffemodel`` Caffe can load.

    Parameters
    ----------
    path : str or path
        Where to write.
    weights : mapping of layer name to list of tensors or arrays
        ``GraphModule.layer_weights()``, a ``WeightCollection`` or ``read_caffemodel()``'s
        result. float32 (and float16/bfloat16, widened) is stored in ``data``, float64 in
        ``double_data``, so reading back gives the same bits.
    net_params : CaffeNet or NetParams, optional
        The net the weights belong to. With a ``CaffeNet`` every layer's full definition
        is written (as Caffe's own snapshots do); with ``NetParams`` each layer's name,
        type, bottoms and tops. Without it, layers carry only name and blobs.
    name : str, optional
        The net's name in the file.

    Returns
    -------
    pathlib.Path
    """
    path = Path(path)
    net_name, structure = _layer_structure(net_params)
    msg = _schema.NetParameter()
    if name or net_name:
        msg.name = name or net_name
    for layer_name in [*structure, *(n for n in weights if n not in structure)]:
        layer = msg.layer.add()
        if layer_name in structure:
            layer.CopyFrom(structure[layer_name])
            del layer.blobs[:]
        else:
            layer.name = layer_name
        arrays = [_to_numpy(tensor) for tensor in weights.get(layer_name, ())]
        if layer.type == "BatchNorm" and len(arrays) == 2:
            arrays.append(np.ones(1, dtype=arrays[0].dtype))  # Caffe's scale factor: the stats are final
        for array in arrays:
            _array_to_blob(array, layer.blobs.add())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(msg.SerializeToString())
    os.replace(tmp, path)
    logger.info("wrote %s (%d layers with weights)", path, sum(1 for n in weights if weights[n]))
    return path


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape) if shape else "scalar"


def _table(rows: list[tuple[str, ...]], right: tuple[int, ...] = ()) -> list[str]:
    """Rows as aligned text columns, a rule under the first (the header); columns in ``right`` flush right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def describe_caffemodel(path: str | os.PathLike) -> str:
    """A table of a ``.caffemodel``'s layers: name, type, blob shapes and parameter count.

    What ``sparknet caffe inspect`` prints.
    """
    layers = read_caffemodel_layers(path)
    rows = [("layer", "type", "blobs", "params")]
    rows += [(layer.name, layer.type or "?", ", ".join(_shape_text(b.shape) for b in layer.blobs) or "-",
              f"{layer.num_params:,}") for layer in layers]
    total = sum(layer.num_params for layer in layers)
    with_blobs = sum(1 for layer in layers if layer.blobs)
    footer = f"{len(layers)} layers, {with_blobs} with weights, {total:,} parameters"
    return "\n".join([*_table(rows, right=(3,)), footer])


def read_binaryproto(path: str | os.PathLike) -> np.ndarray:
    """Read a Caffe ``.binaryproto`` blob (a mean image such as ``mean.binaryproto``).

    Returns the blob's array (``[1, C, H, W]`` for mean files).
    """
    array, _ = _blob_to_array(_parse(path, _schema.BlobProto(), "BlobProto"))
    return array
