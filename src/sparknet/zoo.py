"""Ready-made networks, each a :class:`~sparknet.layers.NetParams`.

>>> from sparknet.zoo import get_model
>>> net = get_model("lenet", batch_size=32)
>>> module = net.build(seed=0)

``MODELS`` maps each name the command line accepts to its function.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from .layers import (
    AccuracyLayer,
    ActivationLayer,
    ConvLayer,
    DropoutLayer,
    EmbeddingLayer,
    EuclideanLoss,
    Filler,
    LayerNormLayer,
    LinearLayer,
    LRNLayer,
    LSTMLayer,
    NetParams,
    PoolLayer,
    PositionEmbeddingLayer,
    RDDLayer,
    SigmoidCrossEntropyLoss,
    SoftmaxWithLoss,
    TransformerBlockLayer,
)

__all__ = ["lenet", "mlp", "cifar_cnn", "alexnet", "char_lstm", "gpt_char", "MODELS", "get_model"]

logger = logging.getLogger(__name__)

# Caffe's usual multipliers for learnable layers: the bias learns twice as fast.
_CAFFE_LR = (1.0, 2.0)
_CAFFE_DECAY = (1.0, 0.0)


def lenet(batch_size: int = 64) -> NetParams:
    """LeNet exactly as Listing 2 of the SparkNet paper (431,080 parameters).

    conv1 (20 5x5) - pool1 (max 2x2/2) - conv2 (50 5x5) - pool2 (max 2x2/2) - ip1 (500) -
    relu1 - ip2 (10) - SoftmaxWithLoss. There is no ReLU after the convolutions, and the
    weights start from PyTorch's default initialisation.

    Parameters
    ----------
    batch_size : int
        Declared batch size of the ``data`` ([B, 1, 28, 28] float32) and ``label``
        ([B] int64) inputs.
    """
    return NetParams(
        RDDLayer("data", shape=[batch_size, 1, 28, 28]),
        RDDLayer("label", shape=[batch_size], dtype="int64"),
        ConvLayer("conv1", ["data"], kernel=(5, 5), num_filters=20),
        PoolLayer("pool1", ["conv1"], pool="max", kernel=(2, 2), stride=(2, 2)),
        ConvLayer("conv2", ["pool1"], kernel=(5, 5), num_filters=50),
        PoolLayer("pool2", ["conv2"], pool="max", kernel=(2, 2), stride=(2, 2)),
        LinearLayer("ip1", ["pool2"], num_outputs=500),
        ActivationLayer("relu1", ["ip1"], activation="relu"),
        LinearLayer("ip2", ["relu1"], num_outputs=10),
        SoftmaxWithLoss("loss", ["ip2", "label"]),
        name="lenet",
    )


def mlp(input_shape: Sequence[int] = (1, 28, 28), hidden: Sequence[int] = (512, 256),
        num_classes: int = 10, batch_size: int = 64, task: str = "classification") -> NetParams:
    """A fully connected net: ``ip1 .. ipN`` with in-place ReLUs, then a loss for ``task``.

    Parameters
    ----------
    input_shape : sequence of int
        Shape of one sample (flattened by the first layer).
    hidden : sequence of int
        Widths of the hidden layers (``ip1``, ``ip2``, ...), each followed by a ReLU.
    num_classes : int
        Outputs of the last layer: the classes, or the numbers (or labels) of one row.
    batch_size : int
        Declared batch size.
    task : str
        ``classification`` (class ids, SoftmaxWithLoss), ``regression`` (numbers, EuclideanLoss) or
        ``multilabel`` (a 0 or 1 for each output, SigmoidCrossEntropyLoss).
    """
    losses = {"classification": SoftmaxWithLoss, "regression": EuclideanLoss, "multilabel": SigmoidCrossEntropyLoss}
    if task not in losses:
        raise ValueError(f"an mlp's task is one of {', '.join(losses)}, got {task!r}")
    classes = task == "classification"
    layers: list[Any] = [
        RDDLayer("data", shape=[batch_size, *input_shape]),
        RDDLayer("label", shape=[batch_size] if classes else [batch_size, num_classes],
                 dtype="int64" if classes else "float32"),
    ]
    bottom = "data"
    for i, width in enumerate(hidden, start=1):
        layers.append(LinearLayer(f"ip{i}", [bottom], num_outputs=width))
        layers.append(ActivationLayer(f"relu{i}", [f"ip{i}"], tops=[f"ip{i}"]))
        bottom = f"ip{i}"
    last = f"ip{len(hidden) + 1}"
    layers.append(LinearLayer(last, [bottom], num_outputs=num_classes))
    layers.append(losses[task]("loss", [last, "label"]))
    return NetParams(*layers, name="mlp")


def _caffe(cls: type[ConvLayer | LinearLayer], name: str, bottom: str, std: float, bias_value: float = 0.0,
           decay: Sequence[float] = (1.0, 1.0), **kw: Any) -> ConvLayer | LinearLayer:
    """A Caffe-style convolution or inner product: gaussian weights, constant bias, bias at twice the rate."""
    return cls(name, [bottom], lr_mult=_CAFFE_LR, decay_mult=tuple(decay), weight_filler=Filler("gaussian", std=std),
               bias_filler=Filler("constant", value=bias_value), **kw)


def cifar_cnn(batch_size: int = 100) -> NetParams:
    """Caffe's ``cifar10_quick`` for 32x32 RGB images, 10 classes (145,578 parameters).

    conv1 (32 5x5 pad 2) - pool1 (max 3x3/2) - relu1 - conv2 (32 5x5 pad 2) - relu2 -
    pool2 (ave 3x3/2) - conv3 (64 5x5 pad 2) - relu3 - pool3 (ave 3x3/2) - ip1 (64) -
    ip2 (10) - SoftmaxWithLoss, with an accuracy layer; Caffe's fillers and learning-rate
    multipliers (biases at twice the rate). Pooling rounds up as in Caffe: 32 -> 16 -> 8 -> 4.

    Parameters
    ----------
    batch_size : int
        Declared batch size of ``data`` ([B, 3, 32, 32]) and ``label`` ([B]).
    """
    return NetParams(
        RDDLayer("data", shape=[batch_size, 3, 32, 32]),
        RDDLayer("label", shape=[batch_size], dtype="int64"),
        _caffe(ConvLayer, "conv1", "data", 0.0001, num_filters=32, kernel=5, pad=2),
        PoolLayer("pool1", ["conv1"], pool="max", kernel=3, stride=2),
        ActivationLayer("relu1", ["pool1"], tops=["pool1"]),
        _caffe(ConvLayer, "conv2", "pool1", 0.01, num_filters=32, kernel=5, pad=2),
        ActivationLayer("relu2", ["conv2"], tops=["conv2"]),
        PoolLayer("pool2", ["conv2"], pool="ave", kernel=3, stride=2),
        _caffe(ConvLayer, "conv3", "pool2", 0.01, num_filters=64, kernel=5, pad=2),
        ActivationLayer("relu3", ["conv3"], tops=["conv3"]),
        PoolLayer("pool3", ["conv3"], pool="ave", kernel=3, stride=2),
        _caffe(LinearLayer, "ip1", "pool3", 0.1, num_outputs=64),
        _caffe(LinearLayer, "ip2", "ip1", 0.1, num_outputs=10),
        AccuracyLayer("accuracy", ["ip2", "label"]),
        SoftmaxWithLoss("loss", ["ip2", "label"]),
        name="cifar10_quick",
    )


def alexnet(batch_size: int = 256, num_classes: int = 1000) -> NetParams:
    """BVLC AlexNet (``models/bvlc_alexnet/train_val.prototxt``) on 227x227 RGB input.

    conv1 (96 11x11/4) - relu - norm1 (LRN 5) - pool1 (max 3x3/2) - conv2 (256 5x5 pad 2,
    2 groups) - relu - norm2 - pool2 - conv3 (384 3x3) - conv4 (384 3x3, 2 groups) -
    conv5 (256 3x3, 2 groups) - pool5 - fc6 (4096) - relu - drop6 - fc7 (4096) - relu -
    drop7 - fc8 - SoftmaxWithLoss, with an accuracy layer; BVLC's fillers and multipliers.
    Spatial sizes: 227 -> 55 -> 27 -> 13 -> 6 (60,965,224 parameters with 1000 classes).

    Parameters
    ----------
    batch_size : int
        Declared batch size (BVLC trains with 256).
    num_classes : int
        Outputs of fc8.
    """
    def relu(name: str, blob: str) -> ActivationLayer:
        return ActivationLayer(name, [blob], tops=[blob])

    return NetParams(
        RDDLayer("data", shape=[batch_size, 3, 227, 227]),
        RDDLayer("label", shape=[batch_size], dtype="int64"),
        _caffe(ConvLayer, "conv1", "data", 0.01, 0.0, _CAFFE_DECAY, num_filters=96, kernel=11, stride=4),
        relu("relu1", "conv1"),
        LRNLayer("norm1", ["conv1"], local_size=5, alpha=1e-4, beta=0.75),
        PoolLayer("pool1", ["norm1"], pool="max", kernel=3, stride=2),
        _caffe(ConvLayer, "conv2", "pool1", 0.01, 0.1, _CAFFE_DECAY, num_filters=256, kernel=5, pad=2, groups=2),
        relu("relu2", "conv2"),
        LRNLayer("norm2", ["conv2"], local_size=5, alpha=1e-4, beta=0.75),
        PoolLayer("pool2", ["norm2"], pool="max", kernel=3, stride=2),
        _caffe(ConvLayer, "conv3", "pool2", 0.01, 0.0, _CAFFE_DECAY, num_filters=384, kernel=3, pad=1),
        relu("relu3", "conv3"),
        _caffe(ConvLayer, "conv4", "conv3", 0.01, 0.1, _CAFFE_DECAY, num_filters=384, kernel=3, pad=1, groups=2),
        relu("relu4", "conv4"),
        _caffe(ConvLayer, "conv5", "conv4", 0.01, 0.1, _CAFFE_DECAY, num_filters=256, kernel=3, pad=1, groups=2),
        relu("relu5", "conv5"),
        PoolLayer("pool5", ["conv5"], pool="max", kernel=3, stride=2),
        _caffe(LinearLayer, "fc6", "pool5", 0.005, 0.1, _CAFFE_DECAY, num_outputs=4096),
        relu("relu6", "fc6"),
        DropoutLayer("drop6", ["fc6"], tops=["fc6"], ratio=0.5),
        _caffe(LinearLayer, "fc7", "fc6", 0.005, 0.1, _CAFFE_DECAY, num_outputs=4096),
        relu("relu7", "fc7"),
        DropoutLayer("drop7", ["fc7"], tops=["fc7"], ratio=0.5),
        _caffe(LinearLayer, "fc8", "fc7", 0.01, 0.0, _CAFFE_DECAY, num_outputs=num_classes),
        AccuracyLayer("accuracy", ["fc8", "label"]),
        SoftmaxWithLoss("loss", ["fc8", "label"]),
        name="alexnet",
    )


def char_lstm(vocab_size: int, seq_len: int = 100, hidden: int = 256, num_layers: int = 2,
              batch_size: int = 32, embed_dim: int | None = None, dropout: float = 0.0) -> NetParams:
    """A character-level language model: Embedding - LSTM - time-distributed Linear - softmax.

    ``data`` holds ``[B, T]`` character ids and ``label`` the next character at every step
    (``[B, T]``); the prediction ``logits`` is ``[B, T, vocab_size]`` and the loss is
    SoftmaxWithLoss over axis 2 (the mean over every position).

    Parameters
    ----------
    vocab_size : int
        Number of distinct characters.
    seq_len : int
        Declared sequence length ``T`` (any length runs).
    hidden : int
        LSTM hidden size.
    num_layers : int
        Stacked LSTM layers.
    batch_size : int
        Declared batch size.
    embed_dim : int, optional
        Embedding width; ``hidden`` when not given.
    dropout : float
        Dropout between stacked LSTM layers.
    """
    return NetParams(
        RDDLayer("data", shape=[batch_size, seq_len], dtype="int64"),
        RDDLayer("label", shape=[batch_size, seq_len], dtype="int64"),
        EmbeddingLayer("embed", ["data"], num_embeddings=vocab_size, num_outputs=embed_dim or hidden),
        LSTMLayer("lstm", ["embed"], num_outputs=hidden, num_layers=num_layers, dropout=dropout),
        LinearLayer("logits", ["lstm"], num_outputs=vocab_size, axis=2),
        SoftmaxWithLoss("loss", ["logits", "label"], axis=2),
        name="char_lstm",
    )


def gpt_char(vocab_size: int, seq_len: int = 256, width: int = 384, num_layers: int = 6, num_heads: int = 6,
             dropout: float = 0.2, batch_size: int = 64) -> NetParams:
    """A GPT-style character language model: token and position embeddings, pre-norm transformer blocks, a final
    norm and a linear map to the vocabulary (nanoGPT's ``shakespeare_char``: 6 layers, 6 heads, width 384,
    context 256, dropout 0.2, about 10.8M weights for 65 characters).

    ``data`` holds ``[B, T]`` character ids and ``label`` the next character at every position; the loss is
    SoftmaxWithLoss over axis 2 (the mean over every position), as for :func:`char_lstm`.

    Parameters
    ----------
    vocab_size : int
        Number of distinct characters.
    seq_len : int
        Context length ``T`` (the positions learned; a longer sequence is refused).
    width : int
        Embedding width ``C``.
    num_layers : int
        Transformer blocks.
    num_heads : int
        Attention heads per block (they divide ``width``).
    dropout : float
        Dropout after the embeddings, on the attention weights and on every residual branch.
    batch_size : int
        Declared batch size.
    """
    gpt_init = Filler(type="gaussian", std=0.02)
    blocks, bottom = [], "position"
    for i in range(num_layers):
        blocks.append(TransformerBlockLayer(f"block{i + 1}", [bottom], num_heads=num_heads, dropout=dropout,
                                            depth=num_layers))
        bottom = f"block{i + 1}"
    return NetParams(
        RDDLayer("data", shape=[batch_size, seq_len], dtype="int64"),
        RDDLayer("label", shape=[batch_size, seq_len], dtype="int64"),
        EmbeddingLayer("token", ["data"], num_embeddings=vocab_size, num_outputs=width, weight_filler=gpt_init),
        PositionEmbeddingLayer("position", ["token"], max_length=seq_len, dropout=dropout),
        *blocks,
        LayerNormLayer("norm", [bottom]),
        LinearLayer("logits", ["norm"], num_outputs=vocab_size, axis=2, bias=False, weight_filler=gpt_init),
        SoftmaxWithLoss("loss", ["logits", "label"], axis=2),
        name="gpt_char",
    )


MODELS: dict[str, Callable[..., NetParams]] = {f.__name__: f for f in (lenet, mlp, cifar_cnn, alexnet, char_lstm,
                                                                       gpt_char)}
"""Model name to the function that makes it (the command line's choices)."""


def get_model(name: str, **kwargs: Any) -> NetParams:
    """Make the zoo model ``name`` with the given keyword arguments.

    Parameters
    ----------
    name : str
        One of :data:`MODELS` (``-`` is read as ``_``).
    **kwargs
        Passed to the model's function (``char_lstm`` needs ``vocab_size``).

    Raises
    ------
    ValueError
        For an unknown name.
    """
    key = name.strip().lower().replace("-", "_")
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    logger.debug("making model %s with %s", key, kwargs)
    return MODELS[key](**kwargs)
