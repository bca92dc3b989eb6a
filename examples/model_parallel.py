"""A wide MLP on MNIST in the D x M layout: D replicas averaging, each split across M processes.

    python examples/model_parallel.py --workers 4 --model-parallel 2 --width 4096 --max-weight-bytes 60e6
    python examples/model_parallel.py --workers 2 --model-parallel 2 --width 4096 --max-weight-bytes 60e6

The net is ``784 -> W (column) -> W (row) -> 10``. Before anything is allocated, the weights
one process would hold are checked against ``--max-weight-bytes``: with too small an M the
run stops with the error (and the M that would fit). The fit then runs on Spark (``local[W]`` unless
``--master`` says otherwise) through the barrier engine: W tasks, each M of them one worker whose layers are
split over them (each task allocates only its own shards, cut from the driver's starting weights), training with
RMSprop for ``tau`` steps on the worker's rows of MNIST; the replicas average every shard between the tasks that
hold it. The replicas measure test accuracy together after every round; at the end each task reports the bytes
of weights it held, and with ``--out`` the whole (gathered) model is saved as an ordinary sparknet model folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.datasets import mnist
from sparknet.layers import ActivationLayer, LinearLayer, NetParams, RDDLayer, SoftmaxWithLoss
from sparknet.parallel import WeightBudgetError, check_weight_budget
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


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4, help="W = D x M processes (barrier tasks)")
    p.add_argument("--model-parallel", type=int, default=2, help="M: processes each replica is split across")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--max-weight-bytes", type=float, default=None, help="weights one process may hold")
    p.add_argument("--strategy", default="average")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tau", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--master", default=None, help="Spark master (default local[W])")
    p.add_argument("--out", default=None, help="save the gathered model folder here")
    args = p.parse_args(argv)
    _setup_logging()
    if args.max_weight_bytes is not None:
        args.max_weight_bytes = int(args.max_weight_bytes)
    net_def = wide_mlp(args.width, args.batch_size)
    try:  # fail here, before Spark starts, when a process's share does not fit
        need = check_weight_budget(net_def, args.max_weight_bytes, args.model_parallel)
    except WeightBudgetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    whole = check_weight_budget(net_def, None, 1)
    log.info("%s: %s bytes of weights in all, %s per process with M=%d (budget %s)", net_def.name, f"{whole:,}",
             f"{need:,}", args.model_parallel, f"{args.max_weight_bytes:,}" if args.max_weight_bytes else "none")
    from sparknet.spark import SparkTrainer, get_session
    from sparknet.spark.run import dataset_frame

    data = mnist()
    spark = get_session(args.master or f"local[{args.workers}]", app_name="sparknet-model-parallel")
    try:
        worker = WorkerConfig(solver=SolverConfig(type="rmsprop", base_lr=args.lr, rms_decay=0.9),
                              batch_size=args.batch_size, seed=args.seed)
        dist = DistributedConfig(workers=args.workers, model_parallel=args.model_parallel, engine="barrier",
                                 strategy=args.strategy, tau=args.tau, rounds=args.rounds,
                                 max_weight_bytes=args.max_weight_bytes)
        result = SparkTrainer(net_def, worker, dist, spark=spark).fit(dataset_frame(spark, "mnist", data.train),
                                                                      validation=(data.test.x, data.test.y))
    finally:
        spark.stop()
    if args.out:
        from sparknet.model_io import save_model

        save_model(args.out, net_def, result.weights, overwrite=True)
    s = result.summary
    summary = {"workers": args.workers, "data_parallel": s["data_parallel"], "model_parallel": s["model_parallel"],
               "width": args.width, "whole_weight_bytes": s["whole_weight_bytes"],
               "weight_bytes_per_worker": s["weight_bytes_per_worker"], "max_weight_bytes": args.max_weight_bytes,
               "rounds": s["rounds"], "tau": args.tau, "test_accuracy": s["test_accuracy"],
               "wall_s": round(s["wall_s"], 1)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
