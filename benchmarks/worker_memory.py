"""How much memory a barrier-engine rank takes for the weights it trains: each rank's resident memory from its task's
start to its peak, in MiB and in copies of the weights it holds.

    python benchmarks/worker_memory.py                          # this tree
    python benchmarks/worker_memory.py --baseline-rev aa975fb   # beside an earlier commit (one with the rss facts)
    python benchmarks/worker_memory.py --width 2048 --out F     # 16 layers of 2,048 (240 MiB): fixed costs small

Two fits of an MLP of about 64 MiB of float32 weights (6 inputs, 16 hidden layers of 1,024, 3 classes: many layers
of one size, as a transformer's are, so that FSDP2 gathers a sixteenth of it at a time; SGD with momentum, batch 8,
tau 3, 3 rounds) on ``local[2]``, each a fresh process with Spark's Python workers not reused:
K = 2 workers of one process (each rank holds the whole replica), and K = 1 worker of 2 processes with
``--shard-replica`` (each rank holds half). A rank's growth is its peak resident memory less its memory at its
task's start (``barrier_workers[i]["peak_rss_mb"] - ["rss_start_mb"]``, Linux's ``VmHWM`` after ``clear_refs``):
it counts what the task allocated and touched, the weights and every copy of them, the solver's state, the
exchange's buffers, the messages to the driver, and the modules the task imported; not the memory the Python
worker shares with the daemon it was forked from. A memory figure, not a time: other work on the machine does not
move it, but its load is sampled all the same. Beside them, the peers: the same model's 9 steps in bare PyTorch, one
process holding it whole and two sharding it with FSDP2 over gloo (no Spark, no exchange, no messages to a driver),
each with the malloc settings sparknet's ranks of its kind have (``sparknet._malloc``).
Prints and saves JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler, commit_of, save_json, source_trees  # noqa: E402

HIDDEN = [1024] * 16

FIT = r"""
import json, sys
import numpy as np
from pyspark.sql import SparkSession
from sparknet import zoo
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer

shard = sys.argv[1] == "sharded"
spark = (SparkSession.builder.master("local[2]").appName("sparknet-worker-memory")
         .config("spark.driver.memory", "2g").config("spark.python.worker.reuse", "false")
         .config("spark.ui.enabled", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
try:
    rng = np.random.RandomState(0)
    x, y = rng.randn(256, 6).astype(np.float32), rng.randint(0, 3, 256)
    rdd = spark.sparkContext.parallelize([(x[i], int(y[i])) for i in range(256)], 2)
    dist = DistributedConfig(workers=1 if shard else 2, procs_per_worker=2 if shard else 1, shard_replica=shard,
                             engine="barrier", tau=3, rounds=3)
    result = SparkTrainer(zoo.mlp(input_shape=[6], hidden=json.loads(sys.argv[2]), num_classes=3),
                          WorkerConfig(solver=SolverConfig(base_lr=0.01, momentum=0.9), batch_size=8, seed=5),
                          dist=dist).fit(rdd)
    ranks = [{k: w.get(k) for k in ("rank", "rss_start_mb", "peak_rss_mb", "weight_bytes")}
             for w in result.summary["barrier_workers"]]
    print("RESULT " + json.dumps({"weights_mb": result.weights.nbytes / 2**20, "ranks": ranks}), flush=True)
finally:
    spark.stop()
"""


BARE = r"""
import json, os, sys, tempfile
import torch

def rss():
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}

rank, world, store, hidden, steps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), 9
from sparknet._malloc import keep_freed_memory, large_blocks_mapped
keep_freed_memory()  # as sparknet's Python workers do
mapped = large_blocks_mapped()  # held: the settings last as long as the process
if world > 1:  # and its sharded replica's ranks
    mapped.__enter__()
torch.set_num_threads(1)
torch.manual_seed(5)
widths = [6, *hidden]
layers = [m for a, b in zip(widths, widths[1:]) for m in (torch.nn.Linear(a, b), torch.nn.ReLU())]
if world > 1:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = rss()["VmRSS"]
    with torch.device("meta"):
        model = torch.nn.Sequential(*[m for a, b in zip(widths, widths[1:]) for m in (torch.nn.Linear(a, b),
                                                                                       torch.nn.ReLU())],
                                    torch.nn.Linear(widths[-1], 3))
    mesh = init_device_mesh("cpu", (world,))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.01)
else:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = rss()["VmRSS"]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(widths[-1], 3))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
for _ in range(steps):
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
print("RESULT " + json.dumps({"rank": rank, "rss_start_mb": start, "peak_rss_mb": rss()["VmHWM"]}), flush=True)
if world > 1:
    dist.barrier()
    dist.destroy_process_group()
"""


def bare(world: int, timeout_s: float, hidden: list[int]) -> dict:
    """The same MLP's 9 steps in bare PyTorch (no Spark, no exchange, no messages): one process holding it whole, or
    ``world`` processes sharding it with FSDP2 over gloo, as a sharded replica's ranks do."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with tempfile.TemporaryDirectory(prefix="sparknet-bare-fsdp-") as tmp, LoadSampler() as load:
        procs = [subprocess.Popen([sys.executable, "-c", BARE, str(r), str(world), str(Path(tmp) / "store"),
                                   json.dumps(hidden)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for r in range(world)]
        try:
            outs = [p.communicate(timeout=timeout_s) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    ranks = []
    for p, (out, err) in zip(procs, outs):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"the bare run of {world} process(es) failed (exit {p.returncode}):\n{err[-3000:]}")
        ranks.append(json.loads(lines[-1][len("RESULT "):]))
    return {"kind": "bare FSDP2" if world > 1 else "bare whole", "ranks": ranks, **load.to_dict()}


def _copies(fit: dict, whole_mb: float) -> dict:
    for rank in fit["ranks"]:
        held = whole_mb / 2 if "FSDP2" in fit["kind"] or fit["kind"] == "sharded" else whole_mb
        rank["growth_mb"] = rank["peak_rss_mb"] - rank["rss_start_mb"]
        rank["copies_of_held_weights"] = rank["growth_mb"] / held
    return fit


def one_fit(src: Path, kind: str, timeout_s: float, hidden: list[int]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    with LoadSampler() as load:
        proc = subprocess.run([sys.executable, "-c", FIT, kind, json.dumps(hidden)], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the {kind} fit failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1][len("RESULT "):])
    return _copies({"kind": kind, **out, **load.to_dict()}, out["weights_mb"])  # a sharded rank holds about half


def _show(fit: dict) -> None:
    print(json.dumps({"tree": fit["tree"], "kind": fit["kind"]}),
          [(round(r["growth_mb"]), round(r["copies_of_held_weights"], 1)) for r in fit["ranks"]], flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-rev", default=None, help="an earlier commit to run beside this tree")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each fit may take")
    p.add_argument("--width", type=int, default=HIDDEN[0], help="width of each of the 16 hidden layers")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "worker_memory.json"))
    args = p.parse_args(argv)
    hidden = [args.width] * len(HIDDEN)
    report = {"benchmark": "worker_memory", "hidden": hidden, "cpu_count": os.cpu_count(),
              "commit": commit_of(), "baseline_rev": args.baseline_rev, "fits": []}
    with tempfile.TemporaryDirectory(prefix="sparknet-worker-memory-") as tmp, \
            source_trees(ROOT, args.baseline_rev, Path(tmp)) as trees:
        for kind in ("whole", "sharded"):
            for name, src in trees.items():
                fit = {"tree": name, **one_fit(src, kind, args.timeout, hidden)}
                _show(fit)
                report["fits"].append(fit)
        whole_mb = report["fits"][0]["weights_mb"]
        for world in (1, 2):  # the peers: the same model and steps in bare PyTorch
            fit = {"tree": "bare PyTorch", **_copies(bare(world, args.timeout, hidden), whole_mb)}
            _show(fit)
            report["fits"].append(fit)
    save_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
