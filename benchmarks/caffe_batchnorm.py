"""Test accuracy of a BatchNorm net under Caffe's running-statistics rule and under PyTorch's momentum rule.

    python benchmarks/caffe_batchnorm.py --iterations 1200 --seeds 0 1 2

A LeNet-shaped Caffe net with BatchNorm + Scale after each convolution and after ip1 (a
prototxt, read by :func:`sparknet.caffe.load_net_prototxt`; Caffe's default
``moving_average_fraction`` λ = 0.999) trains on MNIST for ``--iterations`` SGD updates (batch
64, LeNet's solver: lr 0.01, momentum 0.9, weight decay 5e-4, the inv policy), twice per seed:

- ``caffe_rule``: the net as sparknet builds it, whose statistics are Caffe's decayed sums
  divided by the scale factor ``s = λ·s + 1``;
- ``torch_momentum``: the same net with each BatchNorm swapped for ``torch.nn.BatchNorm2d``
  (``BatchNorm1d`` after ip1) with ``momentum = 1 - λ`` and no affine part: running statistics
  that start at 0 and 1 and keep a weight λ^t of them after t updates (the old mapping).

Both start from the same weights and see the same minibatches in the same order; training uses
batch statistics, so the two runs train to the very same weights (checked) and differ only in
the statistics used at test time. Each is scored on the 10,000 MNIST test images in eval mode
(running statistics). Prints and saves JSON with the load average before and during.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from sparknet import Net, NetParams, SolverConfig
from sparknet.caffe import load_net_prototxt
from sparknet.datasets import mnist
from sparknet.layers import BatchNormLayer

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler, save_json  # noqa: E402

_BN = """
layer {{ name: "{name}" type: "BatchNorm" bottom: "{bottom}" top: "{bottom}"
        param {{ lr_mult: 0 }} param {{ lr_mult: 0 }} param {{ lr_mult: 0 }} }}
layer {{ name: "{name}_scale" type: "Scale" bottom: "{bottom}" top: "{bottom}" scale_param {{ bias_term: true }} }}
layer {{ name: "{name}_relu" type: "ReLU" bottom: "{bottom}" top: "{bottom}" }}
"""

NET = """
name: "lenet_bn"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 64 dim: 1 dim: 28 dim: 28 } shape { dim: 64 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 20 kernel_size: 5 bias_term: false weight_filler { type: "xavier" } } }
""" + _BN.format(name="bn1", bottom="conv1") + """
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 50 kernel_size: 5 bias_term: false weight_filler { type: "xavier" } } }
""" + _BN.format(name="bn2", bottom="conv2") + """
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
        inner_product_param { num_output: 500 bias_term: false weight_filler { type: "xavier" } } }
""" + _BN.format(name="bn3", bottom="ip1") + """
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2" param { lr_mult: 1 } param { lr_mult: 2 }
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } bias_filler { type: "constant" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def solver() -> SolverConfig:
    """Caffe's lenet_solver.prototxt."""
    return SolverConfig(base_lr=0.01, momentum=0.9, weight_decay=5e-4, lr_policy="inv", gamma=1e-4, power=0.75)


class TorchMomentumBatchNorm(BatchNormLayer):
    """A BatchNorm layer built as ``torch.nn.BatchNorm1d/2d`` with ``momentum = 1 - λ``: the comparison's old rule."""

    def _build(self, shapes):
        cls = nn.BatchNorm2d if len(shapes[0]) == 4 else nn.BatchNorm1d
        return cls(shapes[0][1], eps=self.eps, momentum=1.0 - self.moving_average_fraction, affine=False)


def torch_momentum_net(net: NetParams) -> NetParams:
    """``net`` with every BatchNorm layer swapped for :class:`TorchMomentumBatchNorm` (same fields)."""
    layers = [TorchMomentumBatchNorm(**{f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)})
              if isinstance(layer, BatchNormLayer) else layer for layer in net.layers]
    return NetParams(*layers, name=net.name)


def train_and_score(net: NetParams, data, iterations: int, seed: int) -> tuple[dict, Net]:
    """Train ``net`` for ``iterations`` updates from ``seed``; its test accuracy in eval mode."""
    trainer = Net(net, solver(), seed=seed)
    trainer.set_training_data(data.train)
    trainer.set_validation_data(data.test)
    t0 = time.perf_counter()
    stats = trainer.train(iterations)
    wall = time.perf_counter() - t0
    result = trainer.evaluate()
    return {"test_accuracy": result.accuracy, "test_loss": result.loss, "last_train_loss": stats.last_loss,
            "train_wall_s": round(wall, 1)}, trainer


def _parameters(trainer: Net) -> list[torch.Tensor]:
    return [p.detach() for p in trainer.module.parameters()]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=1200)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/caffe_batchnorm.json")
    args = p.parse_args(argv)
    if args.iterations < 1 or not args.seeds:
        raise SystemExit("--iterations must be positive and --seeds non-empty")
    torch.set_num_threads(args.threads)
    load = LoadSampler().start()
    data = mnist()
    caffe_net = load_net_prototxt(NET, "TRAIN").net_params
    fraction = caffe_net["bn1"].moving_average_fraction
    old_net = torch_momentum_net(caffe_net)
    runs = []
    for seed in args.seeds:
        caffe, caffe_trainer = train_and_score(caffe_net, data, args.iterations, seed)
        old, old_trainer = train_and_score(old_net, data, args.iterations, seed)
        same = all(torch.equal(a, b) for a, b in zip(_parameters(caffe_trainer), _parameters(old_trainer)))
        runs.append({"seed": seed, "caffe_rule": caffe, "torch_momentum": old, "identical_trained_weights": same})
        print(json.dumps({"seed": seed, "caffe_rule": caffe["test_accuracy"],
                          "torch_momentum": old["test_accuracy"], "identical_trained_weights": same}), flush=True)
    mean = {rule: statistics.fmean(r[rule]["test_accuracy"] for r in runs) for rule in ("caffe_rule", "torch_momentum")}
    result = {
        "benchmark": "caffe_batchnorm", "command": " ".join(["python", "benchmarks/caffe_batchnorm.py", *sys.argv[1:]]),
        "net": "LeNet with BatchNorm + Scale + ReLU after conv1, conv2 and ip1 (prototxt in the script)",
        "dataset": "mnist (50,000 train, scored on the 10,000 test images)", "iterations": args.iterations,
        "batch_size": 64, "solver": solver().to_dict(), "moving_average_fraction": fraction,
        "initial_weight_left_in_torch_momentum_statistics": fraction ** args.iterations,
        "runs": runs, "mean_test_accuracy": mean,
        "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
        **load.stop(),
    }
    print(json.dumps({"mean_test_accuracy": mean}))
    save_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
