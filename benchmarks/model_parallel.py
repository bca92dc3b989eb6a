"""Step time against the model-parallel degree M for wide MLPs (paper 001's experiment).

    python benchmarks/model_parallel.py                       # widths 1024 2048 4096 8192
    python benchmarks/model_parallel.py --widths 2048 --steps 5

For each width W the net is ``784 -> W -> W -> 10`` (``ip1`` split by columns, ``ip2`` by
rows, ``ip3`` whole), trained with SGD (momentum 0.9) on synthetic MNIST-shaped batches
through :class:`sparknet.Net`. Measured, side by side in one run:

- ``M=1, 1 thread``: the whole net in one process;
- ``M=1, 2 threads``: the whole net in one process using both cores (intra-op threads);
- ``M=2, 1 thread each``: two gloo processes on loopback, each holding half of ip1 and ip2.

Each configuration runs ``--warmup`` untimed steps and then ``--steps`` timed ones; the
median step time is reported (for M=2, the slower rank's). Also measured: the time of one
allreduce of the ``[batch, W]`` activations between the two processes (the collective a
column-row pair costs in the forward pass; backward costs one more, of ``[batch, 784]``).
Results go to ``benchmarks/results/model_parallel.json`` and a markdown table is printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparknet import zoo
from sparknet.net import Net
from sparknet.parallel import init_layout, local_weight_bytes, parallelize, weight_bytes_per_rank
from sparknet.solvers import SolverConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler  # noqa: E402

PLAN = {"ip1": "column", "ip2": "row"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _net_def(width: int, batch: int):
    return zoo.mlp(input_shape=(784,), hidden=(width, width), num_classes=10, batch_size=batch)


def _data(batch: int, batches: int = 4):
    rng = np.random.default_rng(0)
    x = rng.random((batch * batches, 784), dtype=np.float32)
    y = rng.integers(0, 10, size=batch * batches)
    return x, y


def _time_steps(net: Net, warmup: int, steps: int, barrier=None) -> list[float]:
    net.train(warmup)
    times = []
    for _ in range(steps):
        if barrier is not None:
            barrier()
        t = time.perf_counter()
        net.train(1)
        times.append(time.perf_counter() - t)
    return times


def _solver() -> SolverConfig:
    return SolverConfig(base_lr=0.01, momentum=0.9)


def measure_whole(width: int, batch: int, threads: int, warmup: int, steps: int) -> dict:
    """Step time of the unsplit net in this process with ``threads`` intra-op threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        net = Net(_net_def(width, batch), _solver(), batch_size=batch, seed=0)
        net.set_training_data(_data(batch))
        times = _time_steps(net, warmup, steps)
        return {"median_s": statistics.median(times), "min_s": min(times), "times_s": times,
                "weight_bytes": local_weight_bytes(net)}
    finally:
        torch.set_num_threads(previous)


def _split_worker(rank: int, port: int, out, width: int, batch: int, warmup: int, steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    try:
        torch.set_num_threads(1)
        layout = init_layout(model_parallel=2)
        module = parallelize(_net_def(width, batch).build(seed=0), layout, plan=PLAN)
        net = Net(module, _solver(), batch_size=batch, seed=0)
        net.set_training_data(_data(batch), shuffle=False)
        times = _time_steps(net, warmup, steps, barrier=dist.barrier)
        # The forward collective of a column-row pair, alone: allreduce of [batch, width] floats.
        buf = torch.randn(batch, width)
        for _ in range(2):
            dist.all_reduce(buf)
        ar = []
        for _ in range(max(steps, 5)):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(buf)
            ar.append(time.perf_counter() - t)
        out[rank] = {"times_s": times, "weight_bytes": local_weight_bytes(net),
                     "allreduce_s": statistics.median(ar)}
    except Exception:
        out[f"error{rank}"] = traceback.format_exc()
    finally:
        dist.destroy_process_group()


def measure_split(width: int, batch: int, warmup: int, steps: int) -> dict:
    """Step time with ip1/ip2 split across two one-thread gloo processes."""
    manager = mp.Manager()
    try:
        out = manager.dict()
        mp.spawn(_split_worker, args=(_free_port(), out, width, batch, warmup, steps), nprocs=2, join=True)
        errors = [v for k, v in out.items() if str(k).startswith("error")]
        if errors:
            raise RuntimeError("\n".join(errors))
        ranks = [out[0], out[1]]
    finally:
        manager.shutdown()
    per_step = [max(a, b) for a, b in zip(ranks[0]["times_s"], ranks[1]["times_s"])]
    return {"median_s": statistics.median(per_step), "min_s": min(per_step), "times_s": per_step,
            "weight_bytes_per_rank": [r["weight_bytes"] for r in ranks],
            "allreduce_activations_s": max(r["allreduce_s"] for r in ranks)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "model_parallel.json"))
    args = p.parse_args(argv)

    load = LoadSampler().start()
    rows = []
    for width in args.widths:
        params = weight_bytes_per_rank(_net_def(width, args.batch), 1) // 4
        one = measure_whole(width, args.batch, 1, args.warmup, args.steps)
        two_threads = measure_whole(width, args.batch, 2, args.warmup, args.steps)
        split = measure_split(width, args.batch, args.warmup, args.steps)
        row = {
            "width": width, "parameters": params, "batch": args.batch,
            "m1_1thread_s": one["median_s"], "m1_2threads_s": two_threads["median_s"], "m2_s": split["median_s"],
            "speedup_m2_vs_1thread": one["median_s"] / split["median_s"],
            "speedup_m2_vs_2threads": two_threads["median_s"] / split["median_s"],
            "weight_bytes_m1": one["weight_bytes"], "weight_bytes_m2_per_rank": split["weight_bytes_per_rank"],
            "allreduce_activations_s": split["allreduce_activations_s"],
            "raw": {"m1_1thread": one["times_s"], "m1_2threads": two_threads["times_s"], "m2": split["times_s"]},
        }
        rows.append(row)
        print(f"width {width}: {params:,} parameters; M=1 {one['median_s'] * 1e3:.1f} ms (1 thread), "
              f"{two_threads['median_s'] * 1e3:.1f} ms (2 threads); M=2 {split['median_s'] * 1e3:.1f} ms",
              file=sys.stderr, flush=True)

    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), **load.stop(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "net": "784 -> W -> W -> 10, ip1 column, ip2 row, ip3 whole; SGD momentum 0.9",
            "batch": args.batch, "steps": args.steps, "warmup": args.warmup}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    print("| width W | parameters | M=1, 1 thread (ms) | M=1, 2 threads (ms) | M=2, 1 thread each (ms) | "
          "speedup vs 1 thread | speedup vs 2 threads | weights per rank, M=2 | allreduce [B, W] (ms) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        share = max(r["weight_bytes_m2_per_rank"]) / r["weight_bytes_m1"]
        print(f"| {r['width']} | {r['parameters'] / 1e6:.1f} M | {r['m1_1thread_s'] * 1e3:.1f} | "
              f"{r['m1_2threads_s'] * 1e3:.1f} | {r['m2_s'] * 1e3:.1f} | {r['speedup_m2_vs_1thread']:.2f}x | "
              f"{r['speedup_m2_vs_2threads']:.2f}x | {share:.1%} | {r['allreduce_activations_s'] * 1e3:.2f} |")
    print(f"\nsaved {out}; load average before {meta['load_average_before']}, during {meta['load_average_during']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
