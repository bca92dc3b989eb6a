"""Does one seed rule for every engine move the simulator's results? Steps to a target, old rule against new.

    python benchmarks/seed_rule.py                 # MLP on MNIST to 96.5%, K=4, tau=10, average and diloco, 5 seeds
    python benchmarks/seed_rule.py --seeds 3 --quick   # a small MLP on the 5k subset to 90%

The simulator seeded worker i's data order with ``seed + 1000 * i``; every engine now uses
``sparknet.step.worker_seed(seed, i)`` (the Spark engines' rule). A different seed is a
different data order, so single runs move; what must not move is the distribution. For each
strategy this runs the simulator with both rules over several base seeds and reports, per
rule, the local steps per worker to reach the target (evaluated every ``--eval-every`` steps) and the final
accuracy: the new rule's mean should sit within the old rule's run-to-run spread. Iterations
are counted, not seconds, so the figures do not depend on the machine's load. Saves JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler  # noqa: E402

from sparknet import SolverConfig, zoo
from sparknet.datasets import mnist, mnist_small
from sparknet.step import worker_seed

SOLVERS = {"average": {"type": "sgd", "base_lr": 0.05, "momentum": 0.9},
           "diloco": {"type": "adamw", "base_lr": 1e-3, "momentum": 0.9, "weight_decay": 1e-4}}
RULES = {"old: seed + 1000 i": lambda seed, i: int(seed) + 1000 * int(i), "new: worker_seed": worker_seed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5, help="base seeds per rule and strategy")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--tau", type=int, default=10)
    p.add_argument("--target", type=float, default=None, help="default 0.965 (full MNIST) or 0.9 (--quick)")
    p.add_argument("--eval-every", type=int, default=50, help="local steps between evaluations")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--quick", action="store_true", help="the 5,000-image MNIST subset and the small MLP")
    p.add_argument("--out", default="benchmarks/results/seed_rule.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sim = importlib.import_module("sparknet.simulate")  # the module (the package exports its function by that name)

    data = mnist_small() if args.quick else mnist()
    target = args.target or (0.9 if args.quick else 0.965)
    net = zoo.mlp(input_shape=(1, 28, 28), hidden=(128,) if args.quick else (512, 256), num_classes=10, batch_size=64)
    load = LoadSampler().start()
    t0 = time.perf_counter()
    rows = []
    original = sim.worker_seed
    try:
        for strategy, solver in SOLVERS.items():
            for rule, fn in RULES.items():
                sim.worker_seed = fn
                for seed in range(args.seeds):
                    r = sim.simulate(net, data.train, data.test, workers=args.workers, tau=args.tau, strategy=strategy,
                                     solver=SolverConfig(**solver), batch_size=64, target_accuracy=target,
                                     steps=args.steps, eval_every_steps=args.eval_every, seed=seed)
                    rows.append({"strategy": strategy, "rule": rule, "seed": seed, "reached": r.reached,
                                 "steps_per_worker": r.steps_per_worker, "accuracy": r.accuracy})
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        sim.worker_seed = original
        load.stop()
    summary = []
    for strategy in SOLVERS:
        for rule in RULES:
            mine = [r for r in rows if r["strategy"] == strategy and r["rule"] == rule]
            steps = [r["steps_per_worker"] for r in mine]
            summary.append({"strategy": strategy, "rule": rule, "reached": sum(r["reached"] for r in mine),
                            "runs": len(mine), "steps_mean": statistics.mean(steps),
                            "steps_min": min(steps), "steps_max": max(steps),
                            "steps_stdev": statistics.stdev(steps) if len(steps) > 1 else 0.0})
    print(f"\nsteps per worker to {target:.3f} (K={args.workers}, tau={args.tau}, {args.seeds} seeds):")
    for s in summary:
        print(f"  {s['strategy']:8s} {s['rule']:20s} reached {s['reached']}/{s['runs']}  mean {s['steps_mean']:7.1f}  "
              f"min {s['steps_min']:5d}  max {s['steps_max']:5d}  stdev {s['steps_stdev']:6.1f}")
    report = {"benchmark": "seed_rule", "args": vars(args), "target": target, "summary": summary, "runs": rows,
              **load.to_dict(),
              "wall_s": time.perf_counter() - t0}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
