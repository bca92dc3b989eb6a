"""Train Caffe's own LeNet files (BVLC ``examples/mnist``) through sparknet, unmodified.

    python examples/caffe_lenet.py --caffe-dir PATH/caffe-models       # 2 workers on Spark, the whole solver
    python examples/caffe_lenet.py --quick                              # one process, 60 iterations, seconds
    python examples/caffe_lenet.py --workers 2 --steps 3000 --tau 50    # a shorter Spark run

The same as ``sparknet train --solver mnist/lenet_solver.prototxt --workers 2``, written out
with the library: :func:`~sparknet.caffe.train.resolve_caffe_run` reads the solver (which
names the net), binds the net's ``mnist_train_lmdb``/``mnist_test_lmdb`` sources to
sparknet's MNIST, applies the net's ``scale: 0.00390625`` as Caffe does, and
:func:`~sparknet.caffe.train.train_caffe` trains for ``max_iter`` iterations per worker,
testing every ``test_interval`` on ``test_iter`` batches of the test set and writing
Caffe-named snapshots (``lenet_iter_N.caffemodel`` plus a sparknet model folder).

``--caffe-dir`` is the folder holding ``mnist/lenet_solver.prototxt``; by default the
``SPARKNET_CAFFE_MODELS`` environment variable, else ``shared/caffe-models`` beside this
repository. ``--quick`` trains 60 iterations on the first 2,000 images of the 5,000-image
MNIST subset in this process and tests on 300 images.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("caffe_lenet")


def default_caffe_dir() -> Path:
    """``$SPARKNET_CAFFE_MODELS``, else ``shared/caffe-models`` next to the repository."""
    env = os.environ.get("SPARKNET_CAFFE_MODELS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1].parent / "shared" / "caffe-models"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one process, 60 iterations on 2,000 images (seconds)")
    p.add_argument("--caffe-dir", default=None, help="folder holding mnist/lenet_solver.prototxt")
    p.add_argument("--workers", type=int, default=None, help="workers (default 2; --quick: 1)")
    p.add_argument("--tau", type=int, default=50, help="local iterations between averages (Spark)")
    p.add_argument("--master", default=None, help="Spark master URL (default local[WORKERS]); trains on Spark")
    p.add_argument("--steps", type=int, default=None, help="iterations per worker (default: the solver's max_iter)")
    p.add_argument("--snapshot-dir", default=None, help="where snapshots go (default: ./lenet; --quick: a temp folder)")
    p.add_argument("--metrics-out", default=None, help="JSON-lines metrics file")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def main(argv: list[str] | None = None, *, spark=None) -> dict:
    """Run the example; returns the summary record."""
    from sparknet.caffe.train import resolve_caffe_run, train_caffe
    from sparknet.config import DistributedConfig

    args = build_parser().parse_args(argv)
    caffe_dir = Path(args.caffe_dir) if args.caffe_dir else default_caffe_dir()
    solver = caffe_dir / "mnist" / "lenet_solver.prototxt"
    if not solver.is_file():
        raise SystemExit(f"{solver} not found; pass --caffe-dir (the folder with mnist/lenet_solver.prototxt)")
    workers = args.workers or (1 if args.quick else 2)
    with tempfile.TemporaryDirectory(prefix="caffe-lenet-") as tmp:
        if args.quick:
            plan = resolve_caffe_run(
                solver=solver, max_iter=args.steps or 60, test_interval=30, test_iter=3, display=20, snapshot=0,
                sources="mnist_train_lmdb=mnist-small,mnist_test_lmdb=mnist-small:test",
                max_train_samples=2000, snapshot_dir=args.snapshot_dir or Path(tmp) / "lenet")
        else:
            plan = resolve_caffe_run(solver=solver, max_iter=args.steps, snapshot_dir=args.snapshot_dir)
        log.info("training %s with %s: %d iterations per worker, %d worker(s)", plan.net_path, solver,
                 plan.max_iter, workers)
        dist = DistributedConfig(workers=workers, tau=args.tau, master=args.master)
        summary = train_caffe(plan, workers=workers, dist=dist, metrics_out=args.metrics_out,
                              progress=not args.quick, threads=1 if args.quick else None, spark=spark)
    result = {k: summary.get(k) for k in ("model", "engine", "workers", "steps", "test_accuracy", "test_loss",
                                           "wall_s", "samples_per_s", "snapshots")}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"LeNet from {solver.name}: test accuracy {result['test_accuracy']:.4f} after {result['steps']} "
              f"iterations per worker on {workers} worker(s), {result['wall_s']:.0f} s")
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    main(sys.argv[1:])
