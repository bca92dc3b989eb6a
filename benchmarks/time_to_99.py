"""LeNet on MNIST to 99% test accuracy: K workers against one process and Spark's TorchDistributor.

    python benchmarks/time_to_99.py                 # each run once, in one script, K = 2
    python benchmarks/time_to_99.py --repeats 2     # twice, the order of the runs turned round the second time
    python benchmarks/time_to_99.py --workers 1,2,4,8,16 --threads 1,8   # the 16-core lab's scaling curve
    python benchmarks/time_to_99.py --workers 16 --threads 16 --shapes 1x16,2x8,4x4,8x2,16x1   # K x G = 16
    python benchmarks/time_to_99.py --dataset extended-mnist --target 0.99 ...   # a harder target (issue 35)

Every run is the user's command, timed from its start to its end (Python, the Spark session and
its JVMs, loading MNIST, the evaluations, a last test pass where there is one): what a user waits for. All stop at
99% on the 10,000 test images or after 4,000 steps per worker, train LeNet with batch 64 per
worker, SGD (lr 0.05, momentum 0.9, weight decay 5e-4, Caffe's inv policy), evaluate every
50 steps per worker, and follow the same evaluation rule (sparknet's default: a fixed sample of
2,000 test rows between whole passes, the whole set once the sample is within its sampling
error of 99% and every tenth time; with ``--eval-budget B`` below 1, an evaluation put off
while evaluations have taken more than that share of the time so far):

- ``one process``: ``sparknet train`` without Spark, with each of ``--threads`` torch threads (default: the
  largest K), a process of several threads allowed 8,000 steps so that it gets there;
- ``rounds`` and ``barrier``: ``sparknet train --workers K --tau 50`` on ``local[K]``, for each K of ``--workers``
  (with ``--round-seconds S``, rounds of S seconds in place of 50 steps; with ``--warmup-steps W``, each also started
  from W steps on the driver; with ``--slow-momentum M``, each also averaging with slow momentum M);
- ``K x G``: the barrier engine with K workers of G processes each (``--procs-per-worker G``, batch 64 per process,
  so 64 G per worker) on ``local[K*G]``, for each shape of ``--shapes``; ``KxG@LR`` gives that shape its own
  learning rate (a bigger batch usually takes a larger one: say how it was tuned);
- ``bare``: K bare one-thread PyTorch LeNet processes training at once, ``--bare-steps`` steps each, for each K of
  ``--workers``: no target, only their summed samples/s (their start left out), the machine's limit for K workers,
  against which each engine's in-round samples/s is put (``in_round_vs_bare``);
- ``torch_distributor``: Spark's TorchDistributor launching DDP on K local processes (one
  thread each, gradients averaged every step), started in a process of its own (this script
  with ``--torch-distributor-run``), the SparkSession it needs and its launch included.

The load average is sampled before and every 5 s during each run; time nothing else meanwhile.
Prints one JSON line per run and saves them all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler, last_summary, timed_command  # noqa: E402

MAX_STEPS, EVERY, BATCH, LR, SCREEN = 4000, 50, 64, 0.05, 2000
TRAIN: list[str] = []
"""Every sparknet run's command before its own flags (:func:`train_args`)."""


def train_args(dataset: str, target: float) -> list[str]:
    """``sparknet train`` of LeNet on ``dataset`` to ``target``, as every run of this script trains."""
    return ["sparknet", "train", "--model", "lenet", "--dataset", dataset, "--lr", str(LR), "--steps", str(MAX_STEPS),
            "--target-accuracy", str(target), "--batch-size", str(BATCH), "--eval-screen-rows", str(SCREEN), "--quiet"]


BARE_STEPS = [1000]
"""Steps of each bare process (``--bare-steps``)."""
RUNS: dict[str, list[str]] = {}
"""This call's runs (:func:`runs_for`)."""


def runs_for(workers: list[int], threads: list[int], shapes: list[str] = (),
             round_seconds: float | None = None, overlap: bool = False,
             warmup: list[int] = (), slow_momentum: list[float] = (), sharded: bool = False) -> dict[str, list[str]]:
    """The runs of one call: one process with each of ``threads``, then each engine with each of ``workers`` (a
    process with several threads may take twice the steps, so that it gets to the target), then the barrier engine
    with each ``KxG[@LR]`` of ``shapes``. With ``round_seconds``, each engine's rounds end after that many seconds
    instead of τ steps (``--round-seconds``): no worker waits for the slowest, whose samples weigh less. With
    ``overlap``, the rounds engine scores each round's weights in a driver thread while the next round trains
    (``--eval-overlap``): the evaluations leave the rounds' critical path, the target is seen a round late. With
    ``sharded``, the rounds engine scores each round's weights on its executors, where the test rows stay
    (``--eval-sharded``: one Spark job an evaluation, the driver's cores idle). For
    each W of ``warmup``, each engine also starts from W steps on the driver (``--warmup-steps W``, all the driver's
    cores, on the first rows of each partition, at most 20,000). For each M of ``slow_momentum``, each engine also
    averages with slow momentum M (``--strategy diloco --outer-lr 1 --outer-momentum M``: the average's change taken
    as an outer gradient with Nesterov momentum M, the SGD workers unchanged), cold and from each W of ``warmup``."""
    runs = {f"one process, {t} thread{'s' if t > 1 else ''}": [*TRAIN, "--threads", str(t), "--eval-every", str(EVERY),
                                                               "--steps", str(MAX_STEPS * (2 if t > 1 else 1))]
            for t in threads}
    for k in workers:
        end = ["--round-seconds", f"{round_seconds:g}"] if round_seconds else ["--tau", str(EVERY)]
        spark = [*TRAIN, "--workers", str(k), *end, "--master", f"local[{k}]"]
        timed = f", {round_seconds:g} s rounds" if round_seconds else ""
        runs[f"rounds, {k} workers{timed}"] = spark
        if overlap:
            runs[f"rounds, {k} workers{timed}, overlapped evaluation"] = [*spark, "--eval-overlap"]
        if sharded:
            runs[f"rounds, {k} workers{timed}, sharded evaluation"] = [*spark, "--eval-sharded"]
        runs[f"barrier, {k} workers{timed}"] = [*spark, "--engine", "barrier"]
        for w in warmup:
            runs[f"rounds, {k} workers{timed}, {w} warm-up steps"] = [*spark, "--warmup-steps", str(w)]
            runs[f"barrier, {k} workers{timed}, {w} warm-up steps"] = [*spark, "--engine", "barrier",
                                                                       "--warmup-steps", str(w)]
        for m in slow_momentum:
            slow = ["--strategy", "diloco", "--outer-lr", "1", "--outer-momentum", f"{m:g}"]
            for w in [0, *warmup]:
                warm = ["--warmup-steps", str(w)] if w else []
                also = f", {w} warm-up steps" if w else ""
                runs[f"rounds, {k} workers{timed}, slow momentum {m:g}{also}"] = [*spark, *slow, *warm]
                runs[f"barrier, {k} workers{timed}, slow momentum {m:g}{also}"] = [*spark, "--engine", "barrier",
                                                                                   *slow, *warm]
    for shape in shapes:
        size, _, lr = shape.partition("@")
        k, g = (int(v) for v in size.lower().split("x"))
        runs[f"barrier, {k} workers of {g} processes" + (f", lr {lr}" if lr else "")] = [
            *TRAIN, "--workers", str(k), "--procs-per-worker", str(g), "--tau", str(EVERY), "--engine", "barrier",
            "--master", f"local[{k * g}]", *(["--lr", lr] if lr else [])]
    return runs


def selected(names: list[str], only: str | None) -> list[str]:
    """The runs ``--only`` names: each of its ``|``-split parts names the runs that contain it, or (``=NAME``) the run
    of that name alone."""
    if only is None:
        return names
    parts = only.split("|")
    return [n for n in names if any(p[1:] == n if p.startswith("=") else p in n for p in parts)]


def _processes(run: str) -> int:
    """The processes a run's name says it trains with: ``rounds, 8 workers`` 8, ``... 2 workers of 4 processes`` 8."""
    words = run.replace(",", "").split()
    k = int(words[words.index("workers") - 1])
    return k * int(words[words.index("processes") - 1]) if "processes" in words else k


def _budget() -> float:
    return float(os.environ.get("SPARKNET_BENCH_EVAL_BUDGET", "1.0"))


def _dataset() -> tuple[str, float]:
    """The data set and the target of this call (``--dataset``, ``--target``): the runs and the DDP processes."""
    return os.environ.get("SPARKNET_BENCH_DATASET", "mnist"), float(os.environ.get("SPARKNET_BENCH_TARGET", "0.99"))


# -- the TorchDistributor run -----------------------------------------------------------------------
def _ddp_to_target() -> dict:
    """Each DDP process: its share of the call's data set, LeNet, one step after another, an evaluation every EVERY
    steps, to the call's target."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from net_vs_bare import bare_lenet
    from sparknet.datasets import load_dataset
    from sparknet.net import fixed_sample
    from sparknet.loop import screen_margin

    budget = _budget()
    dataset, target = _dataset()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        data = load_dataset(dataset)  # extended MNIST: its training digits, MNIST's test digits (as sparknet's)
        x, y = (torch.from_numpy(np.array(a[rank::world])) for a in (data.train.x, data.train.y))  # its own copy
        tx, ty = torch.from_numpy(data.test.x), torch.from_numpy(data.test.y)
        sample = torch.from_numpy(fixed_sample(len(ty), SCREEN).copy())
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(bare_lenet())
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=5e-4)
        inv = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: (1 + 1e-4 * it) ** -0.75)  # Caffe's inv policy
        loss_fn = torch.nn.CrossEntropyLoss()
        g = torch.Generator().manual_seed(rank)

        def accuracy(rows: torch.Tensor) -> float:
            mine = rows[rank::world]
            model.eval()
            with torch.no_grad():
                correct = sum(int((model(tx[mine[i:i + 1000]]).argmax(1) == ty[mine[i:i + 1000]]).sum())
                              for i in range(0, len(mine), 1000))
            model.train()
            counts = torch.tensor([correct, len(mine)], dtype=torch.float64)
            dist.all_reduce(counts)
            return float(counts[0] / counts[1])

        t0, eval_s, evals, step, acc = time.perf_counter(), 0.0, 0, 0, 0.0
        order = torch.randperm(len(x), generator=g)
        while step < MAX_STEPS:
            for _ in range(EVERY):
                start = (step * BATCH) % (len(x) - BATCH)
                idx = order[start:start + BATCH]
                loss = loss_fn(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                inv.step()
                step += 1
            # sparknet's budget: put an evaluation off while evaluations have taken more than that share of the time
            spent = evals and budget < 1 and eval_s > budget * (time.perf_counter() - t0)
            over = torch.tensor([1 if spent else 0])
            dist.all_reduce(over, op=dist.ReduceOp.MIN)  # any rank's yes, as sparknet's ranks agree
            if over.item() and step < MAX_STEPS:
                continue
            t = time.perf_counter()
            evals += 1
            screen = accuracy(sample)
            if screen >= target - screen_margin(target, SCREEN) or evals % 10 == 0:
                acc = accuracy(torch.arange(len(ty)))
            eval_s += time.perf_counter() - t
            if acc >= target:
                break
        return {"rank": rank, "steps": step, "test_accuracy": acc, "loop_s": time.perf_counter() - t0,
                "eval_s": eval_s, "evaluations": evals}
    finally:
        dist.destroy_process_group()


def torch_distributor_run(out: Path, processes: int) -> None:
    """The TorchDistributor command: a SparkSession on local[K], then DDP on K processes to the target."""
    from pyspark.ml.torch.distributor import TorchDistributor

    from sparknet.spark import get_session

    t0 = time.perf_counter()
    spark = get_session(f"local[{processes}]", app_name="torch-distributor-to-99")
    try:
        t_launch = time.perf_counter()
        result = TorchDistributor(num_processes=processes, local_mode=True, use_gpu=False).run(_ddp_to_target)
        out.write_text(json.dumps({**result, "session_s": t_launch - t0,
                                   "distributor_s": time.perf_counter() - t_launch}) + "\n")
    finally:
        spark.stop()


# -- the benchmark ----------------------------------------------------------------------------------
def _run(name: str, work: Path, timeout_s: float) -> dict:
    env = {**os.environ, "SPARKNET_BENCH_DIR": str(Path(__file__).resolve().parent),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    metrics = work / f"{name.replace(',', '').replace(' ', '_')}.json"
    if name.startswith("bare"):
        from parallel_efficiency import bare_pair

        with LoadSampler() as load:
            bare = bare_pair(BARE_STEPS[0], BATCH, 50_000, True, processes=int(name.split(",")[1].split()[0]))
        return {"run": name, **load.to_dict(), "summary": bare}
    if name.startswith("torch_distributor"):
        processes = int(name.split(",")[1].split()[0])
        cmd = [sys.executable, str(Path(__file__).relative_to(ROOT)), "--torch-distributor-run", str(metrics),
               "--workers", str(processes)]
        out = timed_command(cmd, cwd=ROOT, env=env, timeout_s=timeout_s)
        out["command"] = out["command"].replace(sys.executable, "python3", 1)  # the record names no interpreter's path
        result = json.loads(metrics.read_text())
        summary = {"test_accuracy": result["test_accuracy"], "steps": result["steps"],
                   "in_loop_s": round(result["loop_s"], 1), "eval_s": round(result["eval_s"], 1),
                   "session_s": round(result["session_s"], 1), "distributor_s": round(result["distributor_s"], 1)}
    else:
        out = timed_command([*RUNS[name], "--eval-budget", str(_budget()), "--metrics-out", str(metrics)], cwd=ROOT,
                            env=env, timeout_s=timeout_s)
        s = last_summary(metrics)
        summary = {k: s.get(k) for k in ("test_accuracy", "steps", "rounds", "stop_reason", "wall_s", "train_s",
                                         "setup_s", "first_round_s", "eval_s", "samples_per_s", "rounds_s",
                                         "slowest_compute_s", "mean_compute_s", "compute_s_by_worker", "phases_s",
                                         "warmup")}
    out.pop("stdout_tail", None)
    return {"run": name, **out, "summary": summary}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--only", default=None,
                   help="run only the runs whose name contains this (or one of several, split by |; =NAME: the run "
                        "of that name alone)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds each run may take")
    p.add_argument("--eval-budget", type=float, default=1.0,
                   help="sparknet's --eval-budget for every run (1: evaluate every 50 steps, the default here; "
                        "sparknet's own default toward a target is 0.25)")
    p.add_argument("--workers", default="2", help="comma-separated K: each engine and TorchDistributor with each")
    p.add_argument("--shapes", default="", help="comma-separated KxG[@LR]: the barrier engine with K workers of G "
                                                "processes each (and its own learning rate)")
    p.add_argument("--threads", default=None,
                   help="comma-separated threads of the one-process runs (default: the largest K)")
    p.add_argument("--round-seconds", type=float, default=None,
                   help="each engine's rounds end after this many seconds instead of tau = 50 steps")
    p.add_argument("--eval-overlap", action="store_true",
                   help="also the rounds engine with its evaluations in a driver thread (--eval-overlap)")
    p.add_argument("--eval-sharded", action="store_true",
                   help="also the rounds engine with its evaluations on its executors (--eval-sharded)")
    p.add_argument("--warmup-steps", default="",
                   help="comma-separated W: also each engine started from W steps on the driver (--warmup-steps)")
    p.add_argument("--slow-momentum", default="",
                   help="comma-separated M: also each engine averaging with slow momentum M (--strategy diloco "
                        "--outer-lr 1 --outer-momentum M), cold and from each --warmup-steps")
    p.add_argument("--bare-steps", type=int, default=BARE_STEPS[0], help="steps of each bare process")
    p.add_argument("--dataset", default="mnist", choices=("mnist", "extended-mnist"),
                   help="what every run trains on (extended-mnist: 100,000 deformed digits, made once before the "
                        "runs; every run tests on MNIST's test digits)")
    p.add_argument("--target", type=float, default=0.99, help="the test accuracy every run stops at")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "time_to_99.json"))
    p.add_argument("--torch-distributor-run", metavar="OUT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    workers = [int(k) for k in args.workers.split(",")]
    if args.torch_distributor_run:
        torch_distributor_run(Path(args.torch_distributor_run), workers[0])
        return 0
    threads = [int(t) for t in args.threads.split(",")] if args.threads else [max(workers)]
    shapes = [s for s in args.shapes.split(",") if s]
    if args.dataset != "mnist":  # made and cached here, so that no timed run makes it
        from sparknet.datasets import load_dataset

        load_dataset(args.dataset)
    TRAIN[:] = train_args(args.dataset, args.target)
    RUNS.update(runs_for(workers, threads, shapes, args.round_seconds, args.eval_overlap,
                         [int(w) for w in args.warmup_steps.split(",") if w],
                         [float(m) for m in args.slow_momentum.split(",") if m], args.eval_sharded))
    os.environ["SPARKNET_BENCH_EVAL_BUDGET"] = str(args.eval_budget)  # the runs and the DDP processes read it
    os.environ["SPARKNET_BENCH_DATASET"], os.environ["SPARKNET_BENCH_TARGET"] = args.dataset, str(args.target)
    BARE_STEPS[0] = args.bare_steps
    names = selected([*RUNS, *(f"torch_distributor, {k} processes" for k in workers),
                      *(f"bare, {k} processes" for k in workers)], args.only)
    runs = []
    with tempfile.TemporaryDirectory(prefix="sparknet-bench-") as tmp:
        for repeat in range(args.repeats):
            for name in (names if repeat % 2 == 0 else names[::-1]):
                try:
                    runs.append({"repeat": repeat, **_run(name, Path(tmp), args.timeout)})
                except (SystemExit, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
                    # one failed run is kept with its error and the call goes on: a lab call is too dear to lose
                    runs.append({"repeat": repeat, "run": name, "error": str(e)[-2000:]})
                print(json.dumps(runs[-1]), flush=True)
    report = {"benchmark": "time_to_99", "dataset": args.dataset, "target": args.target,
              "eval_budget": args.eval_budget, "cpu_count": os.cpu_count(),
              "workers": workers, "threads": threads, "shapes": shapes, "runs": runs}
    timed = [r for r in runs if "command_wall_s" in r]
    # each run's time over each one-process run's (the 0.40x of one thread, 1.2x of K threads)
    report["against_one_process"] = {
        b["run"]: {r["run"]: round(r["command_wall_s"] / b["command_wall_s"], 3) for r in timed if r is not b}
        for b in timed if b["run"].startswith("one process")}
    bare = {int(r["run"].split(",")[1].split()[0]): r["summary"]["samples_per_s"] for r in runs
            if r["run"].startswith("bare") and "summary" in r}
    report["in_round_vs_bare"] = {
        r["run"]: round(r["summary"]["samples_per_s"] / bare[k], 3) for r in timed
        if r["run"].startswith(("rounds", "barrier")) and r["summary"].get("samples_per_s")
        and (k := _processes(r["run"])) in bare}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
