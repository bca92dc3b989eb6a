"""Caffe compatibility: net and solver prototxt in, ``.caffemodel`` weights in and out.

>>> from sparknet.caffe import load_solver_prototxt, load_caffemodel_into
>>> solver = load_solver_prototxt("lenet_solver.prototxt")       # doctest: +SKIP
>>> train_net = solver.load_net("TRAIN")       # CaffeNet: NetParams + data binding + transform
>>> module = train_net.build(seed=0)           # GraphModule                # doctest: +SKIP
>>> optimizer, scheduler = build_optimizer(module, solver.config)         # doctest: +SKIP

The core of this package never imports pyspark; the Spark engines and the CLI call it.
"""

from sparknet.caffe.caffemodel import (
    CaffeModelLayer,
    describe_caffemodel,
    load_caffemodel_into,
    read_binaryproto,
    read_caffemodel,
    read_caffemodel_layers,
    write_caffemodel,
)
from sparknet.caffe.prototxt import (
    DEFAULT_SOURCES,
    SUPPORTED_LAYER_TYPES,
    CaffeNet,
    CaffeTransform,
    DataBinding,
    DataLayerSpec,
    PrototxtError,
    load_net_prototxt,
    net_to_prototxt,
    parse_net_prototxt,
    resolve_net_path,
)
from sparknet.caffe.solver import CaffeSolver, NetStateSpec, load_solver_prototxt

__all__ = [
    "PrototxtError",
    "CaffeNet",
    "CaffeTransform",
    "DataBinding",
    "DataLayerSpec",
    "DEFAULT_SOURCES",
    "SUPPORTED_LAYER_TYPES",
    "load_net_prototxt",
    "parse_net_prototxt",
    "net_to_prototxt",
    "CaffeSolver",
    "NetStateSpec",
    "load_solver_prototxt",
    "resolve_net_path",
    "CaffeModelLayer",
    "read_caffemodel",
    "read_caffemodel_layers",
    "load_caffemodel_into",
    "write_caffemodel",
    "describe_caffemodel",
    "read_binaryproto",
]
