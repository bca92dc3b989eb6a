"""Caffe compatibility: net and solver prototxt in, ``.caffemodel`` weights in and out.

>>> from sparknet.caffe import load_solver_prototxt, load_caffemodel_into
>>> solver = load_solver_prototxt("lenet_solver.prototxt")       # doctest: +SKIP
>>> train_net = solver.load_net("TRAIN")       # CaffeNet: NetParams + data binding + transform
>>> module = train_net.build(seed=0)           # GraphModule                # doctest: +SKIP
>>> optimizer, scheduler = build_optimizer(module, solver.config)         # doctest: +SKIP

The core of this package never imports pyspark; the Spark engines and the CLI call it.
"""

from sparknet._lazy import lazy_exports

_PROTOTXT = ("PrototxtError", "CaffeNet", "CaffeTransform", "DataBinding", "DataLayerSpec", "DEFAULT_SOURCES",
             "SUPPORTED_LAYER_TYPES", "load_net_prototxt", "parse_net_prototxt", "net_to_prototxt", "resolve_net_path")
_CAFFEMODEL = ("CaffeModelLayer", "read_caffemodel", "read_caffemodel_layers", "load_caffemodel_into",
               "write_caffemodel", "describe_caffemodel", "read_binaryproto")
_EXPORTS = {**dict.fromkeys(_PROTOTXT, "sparknet.caffe.prototxt"),
            **dict.fromkeys(_CAFFEMODEL, "sparknet.caffe.caffemodel"),
            **dict.fromkeys(("CaffeSolver", "NetStateSpec", "load_solver_prototxt"), "sparknet.caffe.solver")}
"""Each name and the module that defines it, imported on first use (they load torch): ``sparknet caffe`` reads its
flags with none of them loaded."""

__all__ = [*_PROTOTXT, "CaffeSolver", "NetStateSpec", "load_solver_prototxt", *_CAFFEMODEL]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
