"""A wide MLP on MNIST in the D x M layout: D replicas averaging, each split across M workers.

    python examples/model_parallel.py --workers 4 --model-parallel 2 --width 4096 --max-weight-bytes 60e6
    python examples/model_parallel.py --workers 2 --model-parallel 2 --width 4096 --max-weight-bytes 60e6

The net is ``784 -> W (column) -> W (row) -> 10``. Before anything is allocated, the weights
one worker would hold are checked against ``--max-weight-bytes``: with too small an M the
run stops with the error (and the M that would fit). Each worker then builds only its own
shards (:func:`sparknet.parallel.build_parallel`), trains with RMSprop for ``tau`` steps
on its replica's shard of MNIST, and the replicas average every shard over their
data-parallel group: :func:`sparknet.parallel.run_rank`, the round loop every engine runs, with
the data-parallel group's allreduce as its exchange. The replicas measure test accuracy
together after every round; at the end each worker reports the bytes of weights it held, and with
``--out`` rank 0 saves the whole (gathered) model as an ordinary sparknet model folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparknet.config import WorkerConfig
from sparknet.datasets import mnist
from sparknet.layers import ActivationLayer, LinearLayer, NetParams, RDDLayer, SoftmaxWithLoss
from sparknet.parallel import ModelParallelJob, WeightBudgetError, check_weight_budget, run_rank
from sparknet.parallel.runner import weights_from_result
from sparknet.solvers import SolverConfig

log = logging.getLogger("model_parallel")


def wide_mlp(width: int, batch_size: int = 64) -> NetParams:
    """``784 -> width -> width -> 10`` with the two wide layers marked for splitting."""
    return NetParams(
        RDDLayer("data", shape=[batch_size, 1, 28, 28]),
        RDDLayer("label", shape=[batch_size], dtype="int64"),
        LinearLayer("ip1", ["data"], num_outputs=width, parallel="column"),
        ActivationLayer("relu1", ["ip1"], tops=["ip1"]),
        LinearLayer("ip2", ["ip1"], num_outputs=width, parallel="row"),
        ActivationLayer("relu2", ["ip2"], tops=["ip2"]),
        LinearLayer("ip3", ["ip2"], num_outputs=10),
        SoftmaxWithLoss("loss", ["ip3", "label"]),
        name=f"wide_mlp_{width}",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    _setup_logging()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        out[rank] = _train(rank, args)
    except Exception:
        out[f"error{rank}"] = traceback.format_exc()
    finally:
        dist.destroy_process_group()


def _train(rank: int, args: argparse.Namespace) -> dict:
    world = dist.get_world_size()
    net_def = wide_mlp(args.width, args.batch_size)
    worker = WorkerConfig(solver=SolverConfig(type="rmsprop", base_lr=args.lr, rms_decay=0.9),
                          batch_size=args.batch_size, seed=args.seed)
    job = ModelParallelJob(net=net_def, worker=worker, model_parallel=args.model_parallel, strategy=args.strategy,
                           tau=args.tau, rounds=args.rounds,
                           max_weight_bytes=args.max_weight_bytes, sample_shape=(1, 28, 28))
    data = mnist()
    part = data.train.shard(rank, world)  # a replica's M ranks pool their parts (run_rank does it)

    def report(record: dict) -> None:
        if rank == 0:
            log.info("round %d: loss %.4f, test accuracy %.4f (compute %.2f s, sync %.1f ms)", record["round"],
                     record["loss"], record["val_accuracy"], record["compute_s"], record["allreduce_s"] * 1e3)

    result = run_rank(job, part.x, part.y, validation=(data.test.x, data.test.y), on_round=report)
    if rank == 0 and args.out:
        from sparknet.model_io import save_model

        save_model(args.out, net_def, weights_from_result(result), overwrite=True)
    return {k: result[k] for k in ("rank", "dp_rank", "mp_rank", "weight_bytes", "history")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4, help="W = D x M worker processes (gloo on loopback)")
    p.add_argument("--model-parallel", type=int, default=2, help="M: workers each replica is split across")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--max-weight-bytes", type=float, default=None, help="weights one worker may hold")
    p.add_argument("--strategy", default="average")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tau", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="save the gathered model folder here")
    args = p.parse_args(argv)
    _setup_logging()
    if args.max_weight_bytes is not None:
        args.max_weight_bytes = int(args.max_weight_bytes)
    net_def = wide_mlp(args.width, args.batch_size)
    try:  # fail on the driver, before any process starts, when a worker's share does not fit
        need = check_weight_budget(net_def, args.max_weight_bytes, args.model_parallel)
    except WeightBudgetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    whole = check_weight_budget(net_def, None, 1)
    log.info("%s: %s bytes of weights in all, %s per worker with M=%d (budget %s)", net_def.name, f"{whole:,}",
             f"{need:,}", args.model_parallel, f"{args.max_weight_bytes:,}" if args.max_weight_bytes else "none")
    mnist()  # fetch and cache once, before the workers read it
    manager = mp.Manager()
    try:
        out = manager.dict()
        mp.spawn(_worker, args=(args.workers, _free_port(), args, out), nprocs=args.workers, join=True)
        errors = [v for k, v in out.items() if str(k).startswith("error")]
        if errors:
            print("\n".join(errors), file=sys.stderr)
            return 1
        results = [out[r] for r in range(args.workers)]
    finally:
        manager.shutdown()
    final = next(r["history"][-1] for r in results if r["rank"] == 0)
    final = {"test_accuracy": final["val_accuracy"], "elapsed_s": final["wall_s"]}
    summary = {"workers": args.workers, "data_parallel": args.workers // args.model_parallel,
               "model_parallel": args.model_parallel, "width": args.width, "whole_weight_bytes": whole,
               "weight_bytes_per_worker": [r["weight_bytes"] for r in results],
               "max_weight_bytes": args.max_weight_bytes, "rounds": args.rounds, "tau": args.tau,
               "test_accuracy": final["test_accuracy"], "wall_s": round(final["elapsed_s"], 1)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
