"""Conjugate gradient against SGD and L-BFGS: the fully connected net of the data- and model-parallel Spark paper.

    python benchmarks/optimizers.py                # about 6 minutes on two cores
    python benchmarks/optimizers.py --quick        # a smoke run: 4 seconds per optimizer

The 2017 paper that trained deep networks data- and model-parallel on Apache Spark found nonlinear
conjugate gradient the fastest optimizer for its three-layer fully connected net. This trains that
net (``sparknet.zoo.mlp``: 784-512-256-10, ReLU) on MNIST in one process with large minibatches
(2,000 samples by default) and three solvers, side by side in one run:

* ``sgd``: momentum 0.9 at rate 0.4, the best of 0.1, 0.2, 0.4 and 0.8 at this batch size in a scan
  (0.8 diverges);
* ``cg``: nonlinear conjugate gradient (Polak-Ribiere+, strong-Wolfe line search), first trial step
  SGD's step at rate 0.1;
* ``lbfgs``: ``torch.optim.LBFGS`` with its strong-Wolfe line search, first trial step 1, memory 10.

No weight decay, fixed rates. Each solver trains for ``--budget`` seconds of training time; every
``--eval-seconds`` of it the whole validation split (10,000 images) is scored, and the time those
evaluations take is not counted. Reported per solver: the training time, steps and loss evaluations
(forward and backward passes) to reach each ``--targets`` validation accuracy, the accuracy after a
quarter, half and all of the budget, and the test accuracy at the end. Then the rounds of averaging
SparkNet runs (``sparknet.simulate``: 2 workers, tau 10, one process) with cg and with sgd as the
workers' local solver, each up to ``--round-steps`` local steps per worker. The 1-minute load average
is sampled before and during. Prints a table and saves JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from sparknet import Net, SolverConfig, zoo
from sparknet.datasets import mnist
from sparknet.simulate import simulate

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler, save_json  # noqa: E402

SOLVERS = {
    "sgd": {"type": "sgd", "base_lr": 0.4, "momentum": 0.9, "weight_decay": 0.0},
    "cg": {"type": "cg", "base_lr": 0.1, "weight_decay": 0.0},
    "lbfgs": {"type": "lbfgs", "base_lr": 1.0, "weight_decay": 0.0},
}


def loss_evaluations(net: Net, steps: int) -> int:
    """Forward and backward passes so far: a line-search solver counts its own, a gradient solver makes one a step."""
    if not net.solver.type.needs_closure:
        return steps * net.solver.iter_size
    return int(net.optimizer.state[next(net.module.parameters())].get("func_evals", 0))


def train_for(name: str, data, *, batch: int, budget_s: float, eval_s: float, targets: list[float]) -> dict:
    """Train one solver for ``budget_s`` seconds of training time, scoring the validation split every ``eval_s``."""
    solver = SolverConfig(**SOLVERS[name])
    net = Net(zoo.mlp(batch_size=batch), solver, seed=0)
    net.set_training_data(data.train)
    net.set_validation_data(data.validation)
    curve, reached = [], {}
    train_s = eval_time = 0.0
    steps = 0
    while train_s < budget_s:
        stats = net.train(10**6, max_seconds=min(eval_s, budget_s - train_s))
        train_s += stats.wall_s
        steps += stats.steps
        t0 = time.perf_counter()
        accuracy = net.test()
        eval_time += time.perf_counter() - t0
        point = {"train_s": round(train_s, 2), "steps": steps, "loss_evaluations": loss_evaluations(net, steps),
                 "val_accuracy": accuracy, "train_loss": stats.loss}
        curve.append(point)
        for target in targets:
            if accuracy >= target and str(target) not in reached:
                reached[str(target)] = point
    net.set_validation_data(data.test)
    return {
        "solver": name, "settings": solver.to_dict(), "batch_size": batch, "budget_s": budget_s,
        "time_to_target": {str(t): reached.get(str(t)) for t in targets},
        "accuracy_at": {f"{f:g}": _accuracy_at(curve, f * budget_s) for f in (0.25, 0.5, 1.0)},
        "test_accuracy": net.test(), "steps": steps, "steps_per_s": steps / train_s,
        "loss_evaluations_per_step": loss_evaluations(net, steps) / max(steps, 1),
        "evaluation_s": round(eval_time, 1), "curve": curve,
    }


def _accuracy_at(curve: list[dict], seconds: float) -> float:
    """The validation accuracy of the last evaluation at or before ``seconds`` of training."""
    before = [p["val_accuracy"] for p in curve if p["train_s"] <= seconds + 1e-6]
    return before[-1] if before else float("nan")


def averaging_rounds(name: str, data, *, batch: int, steps: int, targets: list[float]) -> dict:
    """SparkNet's averaging rounds, 2 workers and tau 10 in one process, ``name`` as the workers' local solver."""
    solver = SolverConfig(**SOLVERS[name])
    result = simulate(zoo.mlp(batch_size=batch), data.train, data.validation, workers=2, tau=10, strategy="average",
                      solver=solver, batch_size=batch, target_accuracy=max(targets), steps=steps, seed=0)
    first = {str(t): next((h for h in result.history if h["accuracy"] >= t), None) for t in targets}
    return {"solver": name, "workers": 2, "tau": 10, "batch_size": batch, "steps_per_worker": result.steps_per_worker,
            "rounds": result.rounds, "accuracy": result.accuracy, "wall_s": round(result.wall_s, 1),
            "first_round_at_target": first, "history": result.history}


def _row(r: dict, targets: list[float]) -> str:
    cells = []
    for t in targets:
        p = r["time_to_target"][str(t)]
        cells.append("-" if p is None else f"{p['train_s']:.1f} s / {p['steps']} / {p['loss_evaluations']}")
    at = " ".join(f"{r['accuracy_at'][k]:.4f}" for k in ("0.25", "0.5", "1"))
    return (f"{r['solver']:6s} {r['steps_per_s']:6.1f} {r['loss_evaluations_per_step']:5.2f}  " + "  ".join(
        f"{c:>22s}" for c in cells) + f"   {at}   {r['test_accuracy']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2000, help="minibatch size of every solver")
    parser.add_argument("--budget", type=float, default=60.0, help="training seconds per solver")
    parser.add_argument("--eval-seconds", type=float, default=1.0, help="training seconds between evaluations")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.95, 0.97], help="validation accuracies")
    parser.add_argument("--round-steps", type=int, default=150, help="local steps per worker in averaging rounds")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 s per solver, 20 steps of rounds")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "optimizers.json"))
    args = parser.parse_args()
    if args.quick:
        args.budget, args.round_steps = 4.0, 20
    torch.set_num_threads(args.threads)
    data = mnist()
    for name in SOLVERS:  # warm-up: the first passes of each solver, untimed
        train_for(name, data, batch=args.batch, budget_s=0.5, eval_s=0.5, targets=[])
    t0 = time.perf_counter()
    with LoadSampler() as load:
        runs = [train_for(name, data, batch=args.batch, budget_s=args.budget, eval_s=args.eval_seconds,
                          targets=args.targets) for name in SOLVERS]
        rounds = [averaging_rounds(name, data, batch=args.batch, steps=args.round_steps, targets=args.targets)
                  for name in ("cg", "sgd")]
    result = {"benchmark": "optimizers", "command": " ".join(["python", "benchmarks/optimizers.py", *sys.argv[1:]]),
              "model": "zoo.mlp (784-512-256-10)", "dataset": "mnist (50k train, 10k validation, 10k test)",
              "torch": torch.__version__, "threads": args.threads, "machine": platform.machine(),
              "processor": platform.processor(), "targets": args.targets, "wall_s": round(time.perf_counter() - t0, 1),
              "runs": runs, "averaging_rounds": rounds, **load.to_dict()}
    path = save_json(result, args.out)
    header = "  ".join(f"{'to ' + format(t, '.0%') + ' (s/steps/evals)':>22s}" for t in args.targets)
    print(f"batch {args.batch}, {args.budget:g} s of training each, {args.threads} threads")
    print(f"solver steps/s evals  {header}   acc at 1/4, 1/2, all   test")
    for r in runs:
        print(_row(r, args.targets))
    for r in rounds:
        reached = ", ".join(f"{t}: " + ("-" if h is None else f"round {h['round']} ({h['steps']} steps)")
                            for t, h in r["first_round_at_target"].items())
        print(f"averaging rounds, {r['solver']} locally: {reached}; accuracy {r['accuracy']:.4f} after "
              f"{r['rounds']} rounds, {r['wall_s']} s")
    print(json.dumps({"load_average_before": load.before, "load_average_during": load.during}))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
