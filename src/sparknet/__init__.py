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

from sparknet._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("DistributedConfig", "Engine", "RunConfig", "Strategy", "TrainConfig", "WorkerConfig"),
                    "sparknet.config"),
    **dict.fromkeys(("DatasetError", "DeadlineExceeded", "EngineError", "GraphError", "SparkNetError", "WorkerError",
                     "WorkerOutOfMemory"), "sparknet.errors"),
    **dict.fromkeys(("AccuracyLayer", "ActivationLayer", "BatchNormLayer", "ConcatLayer", "ConvLayer", "DropoutLayer",
                     "EltwiseLayer", "EmbeddingLayer", "Filler", "FlattenLayer", "GraphModule", "InputLayer",
                     "LinearLayer", "LRNLayer", "LSTMLayer", "NetParams", "PoolLayer", "RDDLayer", "ReshapeLayer",
                     "RNNLayer", "SoftmaxWithLoss"), "sparknet.layers"),
    **dict.fromkeys(("EvalResult", "Net", "TrainStats"), "sparknet.net"),
    **dict.fromkeys(("LRPolicy", "SolverConfig", "SolverType"), "sparknet.solvers"),
    **dict.fromkeys(("TrainingStrategy", "make_strategy"), "sparknet.strategies"),
    "WeightCollection": "sparknet.weights",
    "datasets": None, "zoo": None,  # the modules themselves
}
"""Each name of the API and the module that defines it, imported when the name is first asked for: ``import
sparknet`` loads no torch, so the ``sparknet`` command can start Spark's JVM while torch loads
(:mod:`sparknet.__main__`)."""


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

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
    "SparkNetError", "GraphError", "DatasetError", "EngineError", "WorkerError", "WorkerOutOfMemory",
    "DeadlineExceeded",
    # modules
    "datasets", "zoo",
]
