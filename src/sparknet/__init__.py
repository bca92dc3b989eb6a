"""sparknet: deep-network training on Apache Spark, with PyTorch as the compute engine.

The SparkNet API (Moritz et al., Listings 1 and 2)::

    from sparknet import Net, NetParams, RDDLayer, ConvLayer, PoolLayer, LinearLayer, ActivationLayer, SoftmaxWithLoss

    net = Net(NetParams(RDDLayer("data", shape=[64, 1, 28, 28]), RDDLayer("label", shape=[64]), ...))
    net.set_training_data(data)
    net.train(500)
    accuracy = net.test()

Training across a Spark cluster lives in :mod:`sparknet.spark` (imported on demand, so the
core never needs pyspark).
"""

from sparknet import datasets, zoo
from sparknet.config import DistributedConfig, Engine, RunConfig, Strategy, TrainConfig, WorkerConfig
from sparknet.errors import DatasetError, DeadlineExceeded, EngineError, GraphError, SparkNetError, WorkerError
from sparknet.layers import (
    AccuracyLayer,
    ActivationLayer,
    BatchNormLayer,
    ConcatLayer,
    ConvLayer,
    DropoutLayer,
    EltwiseLayer,
    EmbeddingLayer,
    Filler,
    FlattenLayer,
    GraphModule,
    InputLayer,
    LinearLayer,
    LRNLayer,
    LSTMLayer,
    NetParams,
    PoolLayer,
    RDDLayer,
    ReshapeLayer,
    RNNLayer,
    SoftmaxWithLoss,
)
from sparknet.net import EvalResult, Net, TrainStats
from sparknet.solvers import LRPolicy, SolverConfig, SolverType
from sparknet.strategies import TrainingStrategy, make_strategy
from sparknet.weights import WeightCollection

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # Listing 1
    "Net", "TrainStats", "EvalResult", "WeightCollection",
    # Listing 2
    "NetParams", "GraphModule", "RDDLayer", "InputLayer", "ConvLayer", "PoolLayer", "LinearLayer", "ActivationLayer",
    "DropoutLayer", "BatchNormLayer", "LRNLayer", "ConcatLayer", "EltwiseLayer", "FlattenLayer", "ReshapeLayer",
    "EmbeddingLayer", "RNNLayer", "LSTMLayer", "AccuracyLayer", "SoftmaxWithLoss", "Filler",
    # solvers and configuration
    "SolverConfig", "SolverType", "LRPolicy", "WorkerConfig", "RunConfig", "DistributedConfig", "TrainConfig", "Engine",
    "Strategy", "TrainingStrategy", "make_strategy",
    # errors
    "SparkNetError", "GraphError", "DatasetError", "EngineError", "WorkerError", "DeadlineExceeded",
    # modules
    "datasets", "zoo",
]
