"""Net.train throughput against a bare PyTorch loop, side by side in one run.

    python benchmarks/net_vs_bare.py --threads 1 --steps 300 --repeats 5

Both train LeNet (Listing 2 of the SparkNet paper) with SGD (momentum 0.9, weight decay
5e-4, Caffe's inv policy) on the same in-memory MNIST-shaped tensors, batch 64. The bare
loop is a hand-written ``nn.Sequential`` with the same layers; sparknet's is built from the
layer DSL and driven by ``Net.train``. The two alternate, after a warm-up, so both see the
same machine; the median of the repeats is reported. Prints and saves JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from sparknet import Net, SolverConfig, zoo

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler  # noqa: E402


def bare_lenet() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 20, 5), torch.nn.MaxPool2d(2, 2, ceil_mode=True),
        torch.nn.Conv2d(20, 50, 5), torch.nn.MaxPool2d(2, 2, ceil_mode=True),
        torch.nn.Flatten(), torch.nn.Linear(800, 500), torch.nn.ReLU(), torch.nn.Linear(500, 10),
    )


def solver() -> SolverConfig:
    return SolverConfig(base_lr=0.01, momentum=0.9, weight_decay=5e-4, lr_policy="inv", gamma=1e-4, power=0.75)


def make_data(n: int, real: bool):
    if real:
        from sparknet.datasets import mnist

        train = mnist().train
        return torch.from_numpy(train.x[:n]), torch.from_numpy(train.y[:n])
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


class BareLoop:
    """The loop a PyTorch user writes by hand: shuffle, slice, forward, backward, step."""

    def __init__(self, x, y, batch_size: int, seed: int = 0):
        torch.manual_seed(seed)
        self.model = bare_lenet()
        cfg = solver()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg.base_lr, momentum=cfg.momentum,
                                   weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda it: (1 + cfg.gamma * it) ** -cfg.power)
        self.x, self.y, self.b = x, y, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.perm, self.pos = torch.randperm(len(x), generator=self.gen), 0
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def train(self, steps: int) -> float:
        self.model.train()
        last = 0.0
        for _ in range(steps):
            if self.pos + self.b > len(self.x):
                self.perm, self.pos = torch.randperm(len(self.x), generator=self.gen), 0
            idx = self.perm[self.pos:self.pos + self.b]
            self.pos += self.b
            xb, yb = self.x.index_select(0, idx), self.y.index_select(0, idx)
            loss = self.loss_fn(self.model(xb), yb)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.sched.step()
            last = loss.item()
        return last


def timed(fn, steps: int) -> float:
    t0 = time.perf_counter()
    fn(steps)
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=300, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--synthetic", action="store_true", help="random MNIST-shaped data instead of MNIST")
    p.add_argument("--out", default="benchmarks/results/net_vs_bare.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = LoadSampler().start()
    x, y = make_data(args.samples, real=not args.synthetic)

    bare = BareLoop(x, y, args.batch_size)
    net = Net(zoo.lenet(batch_size=args.batch_size), solver(), seed=0)
    net.set_training_data((x, y))
    runs = {"bare": lambda s: bare.train(s), "sparknet": lambda s: net.train(s)}
    for fn in runs.values():  # warm-up
        fn(20)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(args.repeats):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for k in order:
            times[k].append(timed(runs[k], args.steps))
    per_s = {k: [args.steps * args.batch_size / t for t in v] for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in per_s.items()}
    result = {
        "benchmark": "net_vs_bare", "model": "lenet", "batch_size": args.batch_size, "threads": args.threads,
        "steps_per_repeat": args.steps, "repeats": args.repeats, "data": "synthetic" if args.synthetic else "mnist",
        "samples_per_s": med, "all_samples_per_s": per_s, "ratio": med["sparknet"] / med["bare"],
        "torch": torch.__version__, "python": platform.python_version(), "cpus": torch.get_num_threads(),
        **load.stop(),
    }
    print(json.dumps({k: result[k] for k in ("threads", "samples_per_s", "ratio")}, indent=None))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
