"""Caffe compatibility: net and solver prototxt in, ``.caffemodel`` weights in and out.

No pyspark here; the Spark engines and the CLI call these functions.
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
from sparknet.caffe.prototxt import PrototxtError
from sparknet.caffe.solver import CaffeSolver, NetStateSpec, load_solver_prototxt, resolve_net_path

__all__ = [
    "PrototxtError",
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
