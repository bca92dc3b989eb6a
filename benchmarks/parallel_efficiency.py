"""Parallel efficiency of K=2 sparknet workers against two bare PyTorch processes, and TorchDistributor.

    python benchmarks/parallel_efficiency.py                 # LeNet, batch 64, one thread per worker, tau 50

Side by side in one run, on the same MNIST-shaped data:

1. ``bare``: two independent one-thread PyTorch processes training LeNet at once — the
   practical limit for two workers on this machine (their samples/s summed);
2. ``rounds`` and ``barrier``: sparknet with K=2 workers (tau 50) on ``local[2]``; samples/s is
   training samples over the wall time of the rounds (compute and synchronization both);
3. ``torch_distributor``: Spark's TorchDistributor running DDP on 2 local processes (gloo),
   samples/s over its training loop, plus its launch overhead.

Efficiency = samples/s ÷ the bare aggregate. Prints and saves JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler  # noqa: E402
from net_vs_bare import BareLoop, make_data  # noqa: E402


def _bare_process(steps: int, batch: int, n: int, real: bool, start, out) -> None:
    import torch

    torch.set_num_threads(1)
    x, y = make_data(n, real)
    loop = BareLoop(x, y, batch)
    loop.train(20)
    start.wait(timeout=120)
    t0 = time.perf_counter()
    loop.train(steps)
    out.put(steps * batch / (time.perf_counter() - t0))


def bare_pair(steps: int, batch: int, n: int, real: bool, processes: int = 2) -> dict:
    """``processes`` bare one-thread LeNet processes training at once, ``steps`` steps each after 20 untimed ones:
    their summed samples/s (the machine's limit for that many workers) and each one's."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_bare_process, args=(steps, batch, n, real, start, out)) for _ in range(processes)]
    for p in procs:
        p.start()
    try:
        rates = [out.get(timeout=900) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return {"samples_per_s": sum(rates), "per_process": rates}


def sparknet_run(spark, engine: str, df, steps: int, tau: int, batch: int) -> dict:
    from sparknet import DistributedConfig, SolverConfig, WorkerConfig, zoo
    from sparknet.spark import SparkTrainer

    rounds = []
    worker = WorkerConfig(solver=SolverConfig(base_lr=0.01, weight_decay=5e-4), batch_size=batch, threads=1,
                          steps=steps)
    trainer = SparkTrainer(zoo.lenet(batch_size=batch), worker, DistributedConfig(workers=2, engine=engine, tau=tau),
                           spark=spark, on_round=rounds.append)
    result = trainer.fit(df)
    recs = [r for r in rounds if r.get("event") == "round"][1:]  # the first round warms the workers up
    samples = sum(r["samples"] for r in recs)
    wall = sum(r["round_s"] for r in recs)
    overhead = [r["round_s"] - r["compute_s"] for r in recs]
    return {"samples_per_s": samples / wall, "rounds": len(recs), "round_s_median": statistics.median(r["round_s"] for r in recs),
            "overhead_s_median": statistics.median(overhead), "setup_s": result.summary.get("setup_s"),
            "wall_s": result.summary.get("wall_s")}


def _ddp_train(steps: int, batch: int, n: int, real: bool) -> dict:
    """Runs in each TorchDistributor process (torchrun sets the rendezvous variables)."""
    import time

    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.environ.get("SPARKNET_BENCH_DIR", "."))
    from net_vs_bare import bare_lenet, make_data

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        x, y = make_data(n, real)
        x, y = x[rank::2], y[rank::2]
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(bare_lenet())
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
        loss_fn = torch.nn.CrossEntropyLoss()
        g = torch.Generator().manual_seed(rank)

        def run(k):
            for _ in range(k):
                idx = torch.randint(0, len(x), (batch,), generator=g)
                loss = loss_fn(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()

        run(20)
        dist.barrier()
        t0 = time.perf_counter()
        run(steps)
        dist.barrier()
        wall = time.perf_counter() - t0
        return {"samples_per_s": 2 * steps * batch / wall, "rank": rank}
    finally:
        dist.destroy_process_group()


def torch_distributor(steps: int, batch: int, n: int, real: bool) -> dict:
    from pyspark.ml.torch.distributor import TorchDistributor

    os.environ["SPARKNET_BENCH_DIR"] = str(Path(__file__).resolve().parent)
    t0 = time.perf_counter()
    out = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(_ddp_train, steps, batch, n, real)
    total = time.perf_counter() - t0
    train_s = 2 * steps * batch / out["samples_per_s"]
    return {"samples_per_s": out["samples_per_s"], "total_s": total, "launch_overhead_s": total - train_s}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000, help="steps per worker")
    p.add_argument("--tau", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--synthetic", action="store_true")
    p.add_argument("--skip", nargs="*", default=[], help="runs to skip: bare rounds barrier torch_distributor")
    p.add_argument("--out", default="benchmarks/results/parallel_efficiency.json")
    args = p.parse_args(argv)
    load = LoadSampler().start()
    real = not args.synthetic
    results: dict = {}
    if "bare" not in args.skip:
        results["bare"] = bare_pair(args.steps, args.batch_size, args.samples, real)
        print("bare", json.dumps(results["bare"]))
    from sparknet.spark import get_session
    from sparknet.spark.run import dataset_as_parquet

    spark = get_session("local[2]")
    try:
        import tempfile

        from sparknet.datasets import ArrayDataset

        x, y = make_data(args.samples, real)
        with tempfile.TemporaryDirectory() as tmp:
            path = dataset_as_parquet(ArrayDataset(x.numpy(), y.numpy()), Path(tmp) / "train.parquet")
            df = spark.read.parquet(str(path))
            for engine in ("rounds", "barrier"):
                if engine not in args.skip:
                    results[engine] = sparknet_run(spark, engine, df, args.steps, args.tau, args.batch_size)
                    print(engine, json.dumps(results[engine]))
        if "torch_distributor" not in args.skip:
            try:
                results["torch_distributor"] = torch_distributor(args.steps, args.batch_size, args.samples, real)
            except Exception as e:  # recorded, not hidden
                results["torch_distributor"] = {"error": f"{type(e).__name__}: {e}"}
            print("torch_distributor", json.dumps(results["torch_distributor"]))
    finally:
        spark.stop()
        load.stop()
    limit = results.get("bare", {}).get("samples_per_s")
    if limit:
        for k, v in results.items():
            if "samples_per_s" in v:
                v["efficiency"] = v["samples_per_s"] / limit
    summary = {k: {kk: v.get(kk) for kk in ("samples_per_s", "efficiency", "overhead_s_median", "launch_overhead_s")}
               for k, v in results.items()}
    print(json.dumps(summary, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "parallel_efficiency", "args": vars(args),
                               **load.to_dict(), "results": results}, indent=2))
    return results


if __name__ == "__main__":
    main()
