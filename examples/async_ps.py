"""Asynchronous training through a parameter server on the driver (TensorOnSpark).

    python examples/async_ps.py                        # MNIST, LeNet, 2 workers on local[2]
    python examples/async_ps.py --quick                # the 5,000-image subset, a small MLP
    python examples/async_ps.py --combiner staleness --tau 5
    python examples/async_ps.py --master spark://127.0.0.1:7077

No worker ever waits for another. :class:`~sparknet.ps.AsyncSession` starts a parameter
server on the driver and runs one Spark job per epoch; each task trains its own copy of the
network on its partition and, every ``--tau`` local steps, pushes its change to the
server and pulls the server's current weights back. The server merges each push as it
arrives (``--combiner``: ``delta`` adds the change, ``staleness`` scales it down by how many
other pushes landed since the worker's last pull, ``mean`` and ``elastic`` as in
TensorOnSpark). The training set is the MNIST Parquet table read back as a DataFrame; the
test set is scored on the driver after every epoch. The run prints the test accuracy and
what the asynchrony cost: pushes applied and their staleness.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

log = logging.getLogger("async_ps")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the 5,000-image MNIST subset and a small MLP (seconds)")
    p.add_argument("--master", default=None, help="Spark master URL (default local[WORKERS])")
    p.add_argument("--workers", type=int, default=2, help="partitions, one asynchronous worker each")
    p.add_argument("--combiner", default="delta", choices=["delta", "staleness", "mean", "elastic"],
                   help="how the server merges a push into its weights")
    p.add_argument("--tau", type=int, default=10, help="local steps between a worker's pushes")
    p.add_argument("--epochs", type=int, default=None, help="passes over the data (default 3, quick 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="most local steps per worker (default: the epochs' worth; quick 60)")
    p.add_argument("--lr", type=float, default=None, help="base learning rate (default 0.01, quick 0.05)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    return p


def main(argv=None, spark=None) -> dict:
    """Run the example; returns the result (accuracy, pushes, staleness). ``spark``: a session to reuse."""
    args = build_parser().parse_args(argv)
    for name in ("workers", "tau", "batch_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("py4j").setLevel(logging.WARNING)  # its connection notices say nothing to a user
    from sparknet import zoo
    from sparknet.datasets import mnist, mnist_small
    from sparknet.ps import AsyncSession
    from sparknet.solvers import SolverConfig
    from sparknet.spark import get_session
    from sparknet.spark.run import dataset_frame

    own = spark is None
    if own:
        spark = get_session(args.master or f"local[{args.workers}]", app_name="sparknet-async-ps")
    t0 = time.perf_counter()
    try:
        if args.quick:
            data, name = mnist_small(), "mnist_small"
            net = zoo.mlp(input_shape=[1, 28, 28], hidden=[64], num_classes=10)
            epochs, steps, lr = args.epochs or 2, args.steps or 60, args.lr or 0.05
        else:
            data, name = mnist(), "mnist"
            net = zoo.lenet()
            epochs, steps, lr = args.epochs or 3, args.steps, args.lr or 0.01
        train = dataset_frame(spark, name, data.train)  # features array<float>, label long
        solver = SolverConfig(base_lr=lr, momentum=0.9, weight_decay=5e-4)
        session = AsyncSession(net, solver, combiner=args.combiner, seed=0, spark=spark)
        log.info("training %s asynchronously: %d workers, push every %d steps, %s combiner",
                 "an MLP" if args.quick else "LeNet", args.workers, args.tau, args.combiner)
        m = session.run(data=train, batch_size=args.batch_size, tau=args.tau, epochs=epochs,
                        num_workers=args.workers, steps=steps, validation_data=data.test)
        result = {"combiner": m["combiner"], "workers": m["workers"], "tau": m["tau"],
                  "epochs": m["epochs_run"], "steps_per_worker": m["steps_per_worker"], "samples": m["samples"],
                  "test_accuracy": m["test_accuracy"], "chance": 0.1, "pushes": m["pushes"],
                  "staleness_mean": m["staleness_mean"], "staleness_max": m["staleness_max"],
                  "rejected": m["rejected_total"], "train_s": m["train_s"], "wall_s": time.perf_counter() - t0,
                  "master": spark.sparkContext.master}
    finally:
        if own:
            spark.stop()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"test accuracy {result['test_accuracy']:.4f} after {result['steps_per_worker']} steps per worker; "
              f"{result['pushes']} pushes, staleness {result['staleness_mean']:.2f} on average "
              f"(at most {result['staleness_max']}) ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
