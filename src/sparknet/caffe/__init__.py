"""Caffe compatibility: net and solver prototxt in, ``.caffemodel`` weights in and out.

>>> from sparknet.caffe import load_solver_prototxt, load_caffemodel_into
>>> solver = load_solver_prototxt("lenet_solver.prototxt")       # doctest: +SKIP
>>> train_net = solver.load_net("TRAIN")       # CaffeNet: NetParams + data binding + transform
>>> module = train_net.build(seed=0)           # GraphModule                # doctest: +SKIP
>>> optimizer, scheduler = build_optimizer(module, solver.config)         # doctest: +SKIP

The core of this package never imports pyspark; the Spark engines and the CLI call it.
"""

from sparknet.caffe import caffemodel, prototxt
from sparknet.caffe.caffemodel import *  # noqa: F403 (the names of its __all__)
from sparknet.caffe.prototxt import *  # noqa: F403
from sparknet.caffe.solver import CaffeSolver, NetStateSpec, load_solver_prototxt

__all__ = [*prototxt.__all__, "CaffeSolver", "NetStateSpec", "load_solver_prototxt", *caffemodel.__all__]
