"""Rounds, local steps and bytes to a target MNIST accuracy, for every strategy, K and tau.

    python benchmarks/strategies.py                      # K in {2,4,8}, tau in {1,10,50,200}, target 98.5%
    python benchmarks/strategies.py --quick              # a small grid on the 5k MNIST subset
    python benchmarks/strategies.py --compression int8   # the same with int8 + error feedback
    python benchmarks/strategies.py --workers 8 --taus 50 --strategies average diloco --target 0.99 \
        --solver train --diloco-inner sgd --diloco-outer-lr 1 --diloco-outer-momentum 0.5 0.7 --seeds 0 1
                                                         # averaging with slow momentum, as `sparknet train` trains

K logical workers run one after another in one process (iterations are what is counted),
through the same strategy code the Spark engines run (``sparknet.simulate``). Cells run in
parallel processes, one thread each. Prints a table and saves JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import time
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler  # noqa: E402

STRATEGY_SOLVERS = {
    # Each strategy with the inner solver it is used with: SparkNet averages SGD workers;
    # DiLoCo's paper uses AdamW inside and Nesterov SGD outside.
    "average": {"type": "sgd", "base_lr": 0.05, "momentum": 0.9},
    "easgd": {"type": "sgd", "base_lr": 0.05, "momentum": 0.9},
    "sync": {"type": "sgd", "base_lr": 0.05, "momentum": 0.9},
    "diloco": {"type": "adamw", "base_lr": 1e-3, "momentum": 0.9, "weight_decay": 1e-4},
}


def train_solver() -> dict:
    """``--solver train``: every SGD worker's rule as ``sparknet train --lr 0.05`` trains (the command's own defaults:
    its weight decay and Caffe's inv policy), and DiLoCo's inside too with ``--diloco-inner sgd``: averaging with slow
    momentum (SlowMo, Wang et al. 2020, with Nesterov's form of the outer step). Plain values: a cell's JSON keeps
    them."""
    from sparknet.config import RunConfig

    run = RunConfig(lr=0.05)
    return {"type": run.solver_type.value, "base_lr": run.lr, "momentum": run.momentum,
            "weight_decay": run.weight_decay, "lr_policy": run.lr_policy.value, "gamma": run.gamma, "power": run.power}


def _key(r: dict) -> tuple:
    """A cell's identity: what the resumed file is matched on."""
    return (r["strategy"], r["workers"], r["tau"], r["seed"], json.dumps(r.get("options"), sort_keys=True))


def _cell(job: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    from sparknet import SolverConfig, zoo
    from sparknet.datasets import mnist, mnist_small
    from sparknet.errors import NonFiniteUpdate
    from sparknet.simulate import simulate

    data = mnist_small() if job["quick"] else mnist()
    train, test = data.train, data.test
    net = zoo.lenet(batch_size=job["batch_size"])
    solver = SolverConfig(**{**STRATEGY_SOLVERS[job.get("solver_of", job["strategy"])], **job.get("solver", {})})
    t0 = time.perf_counter()
    try:
        r = simulate(net, train, test, workers=job["workers"], tau=job["tau"], strategy=job["strategy"],
                     solver=solver, batch_size=job["batch_size"], target_accuracy=job["target"], steps=job["steps"],
                     eval_every_steps=job["eval_every"], compression=job["compression"], seed=job["seed"],
                     strategy_options=job.get("options"))
    except NonFiniteUpdate as e:  # every worker's weights diverged: a result of the cell, not a failure of the grid
        return {**job, "reached": False, "diverged": str(e), "rounds": 0, "steps_per_worker": 0, "bytes": 0,
                "accuracy": 0.0, "cell_s": time.perf_counter() - t0, "curve": []}
    out = {k: v for k, v in r.to_dict().items() if k != "history"}
    out.update(job)
    out["cell_s"] = time.perf_counter() - t0
    out["curve"] = r.history
    return out


def _save(out: Path, args, t0: float, results: list[dict], load: LoadSampler, *, complete: bool) -> None:
    out.write_text(json.dumps({"benchmark": "strategies", "args": vars(args), "complete": complete,
                               **load.to_dict(), "wall_s": time.perf_counter() - t0,
                               "results": results}, indent=1))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--taus", type=int, nargs="+", default=[1, 10, 50, 200])
    p.add_argument("--strategies", nargs="+", default=["average", "diloco", "easgd", "sync"])
    p.add_argument("--target", type=float, default=0.985)
    p.add_argument("--steps", type=int, default=3000, help="local steps per worker at most")
    p.add_argument("--eval-every", type=int, default=50, help="local steps between evaluations (whole rounds)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--compression", default="none")
    p.add_argument("--diloco-outer-lr", type=float, default=0.7)
    p.add_argument("--diloco-outer-momentum", type=float, nargs="+", default=[0.9],
                   help="one DiLoCo cell for each")
    p.add_argument("--diloco-inner", choices=("adamw", "sgd"), default="adamw",
                   help="DiLoCo's inner rule: the paper's AdamW, or the SGD workers' own (slow momentum)")
    p.add_argument("--solver", choices=("plain", "train"), default="plain",
                   help="plain: SGD lr 0.05, momentum 0.9; train: also sparknet train's weight decay and inv policy")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--quick", action="store_true", help="5k MNIST subset, K in {2,4}, tau in {1,10,50}, target 95%%")
    p.add_argument("--out", default=None)
    p.add_argument("--resume", action="store_true", help="keep the cells already saved in the output file, run the rest")
    args = p.parse_args(argv)
    if args.quick:
        args.workers, args.taus, args.target, args.steps = [2, 4], [1, 10, 50], 0.95, 1500
    jobs = []
    sgd = train_solver() if args.solver == "train" else {}
    for seed, k, tau, strategy in itertools.product(args.seeds, args.workers, args.taus, args.strategies):
        if strategy == "sync" and tau != 1:
            continue  # the naive scheme synchronizes every step
        job = {"strategy": strategy, "workers": k, "tau": tau, "target": args.target, "steps": args.steps,
               "eval_every": max(args.eval_every, tau), "batch_size": args.batch_size, "compression": args.compression,
               "seed": seed, "quick": args.quick}
        if strategy != "diloco":
            jobs.append({**job, "solver": sgd} if sgd else job)
            continue
        inner = {"solver_of": "average", "solver": sgd} if args.diloco_inner == "sgd" else {}
        jobs.extend({**job, **inner, "options": {"outer_lr": args.diloco_outer_lr, "outer_momentum": m}}
                    for m in args.diloco_outer_momentum)
    name = "strategies_quick" if args.quick else "strategies"
    if args.compression != "none":
        name += f"_{args.compression}"
    out = Path(args.out or f"benchmarks/results/{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    load = LoadSampler(every_s=30.0).start()
    results = []
    if args.resume and out.exists():
        wanted = {_key(j) for j in jobs}
        results = [r for r in json.loads(out.read_text())["results"]
                   if _key(r) in wanted and r["target"] == args.target]
        done = {_key(r) for r in results}
        jobs_left = [j for j in jobs if _key(j) not in done]
        print(f"resuming: {len(results)} cells saved, {len(jobs_left)} to run", flush=True)
    else:
        jobs_left = jobs
    with mp.get_context("spawn").Pool(args.processes) as pool:
        # Saved after every cell, so a long grid stopped part-way keeps what it measured.
        for r in pool.imap_unordered(_cell, jobs_left, chunksize=1):
            results.append(r)
            print(f"cell {len(results)}/{len(jobs)}: {r['strategy']} K={r['workers']} tau={r['tau']} "
                  f"reached={r['reached']} rounds={r['rounds']}", flush=True)
            _save(out, args, t0, results, load, complete=len(results) == len(jobs))
    order = {_key(j): i for i, j in enumerate(jobs)}
    results.sort(key=lambda r: order[_key(r)])
    print(f"{'strategy':9} {'outer m':>7} {'seed':>4} {'K':>3} {'tau':>4} {'reached':>7} {'rounds':>6} "
          f"{'steps/worker':>12} {'MB sent':>9} {'acc':>7}")
    for r in results:
        m = r.get("options", {}).get("outer_momentum", "")
        print(f"{r['strategy']:9} {m:>7} {r['seed']:>4} {r['workers']:>3} {r['tau']:>4} "
              f"{'diverged' if r.get('diverged') else str(r['reached']):>7} "
              f"{r['rounds']:>6} {r['steps_per_worker']:>12} {r['bytes'] / 1e6:>9.1f} {r['accuracy']:>7.4f}")
    load.stop()
    _save(out, args, t0, results, load, complete=True)
    print(f"saved {out}")
    return results


if __name__ == "__main__":
    main()
