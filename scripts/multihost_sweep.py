"""Everything a user runs, on a multi-host cluster in a box (scripts/netns_cluster.py): one rig, many commands.

    sudo python scripts/multihost_sweep.py                     # the commands below, short versions
    sudo python scripts/multihost_sweep.py --experiments       # and each experiment's --quick mode (long)
    sudo python scripts/multihost_sweep.py --out sweep.json

Each command runs against ``spark://`` on two worker hosts whose executors can read neither the
driver's loopback nor its files; the script records its exit status, its seconds from the command's
start and its last JSON line, prints one line per command and writes them all as JSON. It exits 1
when a command failed. Every command is bounded by ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("netns_cluster", ROOT / "scripts" / "netns_cluster.py")
netns_cluster = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(netns_cluster)

M = "$SPARKNET_MASTER"
TRAIN = ["sparknet", "train", "--workers", "2", "--master", M, "--quiet"]


def commands(work: Path, shared: Path, experiments: bool) -> dict[str, list[str]]:
    """The commands, by name. ``work`` is on the driver's disk only; ``shared`` is a folder every host mounts
    (on the rig, under /var/tmp), for what executors read or write themselves (predict's data and output)."""
    quick = ["--steps", "60", "--tau", "30"]
    out = {
        "train mnist rounds": [*TRAIN, "--dataset", "mnist", "--lr", "0.05", *quick],
        "train mnist barrier": [*TRAIN, "--dataset", "mnist", "--lr", "0.05", "--engine", "barrier", *quick],
        "train mnist-small diloco": [*TRAIN, "--dataset", "mnist-small", "--strategy", "diloco", *quick],
        "train mnist-small easgd": [*TRAIN, "--dataset", "mnist-small", "--strategy", "easgd", *quick],
        "train mnist-small sync": [*TRAIN, "--dataset", "mnist-small", "--strategy", "sync", "--engine", "barrier",
                                   *quick],
        "train mnist-small int8": [*TRAIN, "--dataset", "mnist-small", "--compression", "int8", *quick],
        "train mnist async": [*TRAIN, "--dataset", "mnist", "--strategy", "async", *quick],
        "train synthetic mlp": [*TRAIN, "--model", "mlp", "--dataset", "synthetic", *quick],
        "train shakespeare char_lstm": [*TRAIN, "--model", "char_lstm", "--dataset", "shakespeare", "--steps", "20",
                                        "--tau", "10"],
        "train synthetic-sequences char_lstm": [*TRAIN, "--model", "char_lstm", "--dataset", "synthetic-sequences",
                                                *quick],
        "train --data": [*TRAIN, "--model", "mlp", "--data", str(work / "digits.parquet"), *quick],
        "train --model-parallel 2": [*TRAIN, "--model", "mlp", "--dataset", "mnist-small", "--engine", "barrier",
                                     "--model-parallel", "2", *quick],
        "train --model-dir": [*TRAIN, "--model", "mlp", "--dataset", "mnist-small", "--model-dir",
                               str(shared / "model"), *quick],
        "predict": ["sparknet", "predict", "--master", M, "--model-dir", str(shared / "model"), "--data",
                    str(shared / "digits.parquet"), "--out", str(shared / "scored")],
        "doctor": ["sparknet", "doctor", "--master", M, "--json"],
        "example async_ps": [sys.executable, "examples/async_ps.py", "--quick", "--json", "--master", M],
        "example pipeline": [sys.executable, "examples/pipeline.py", "--quick", "--master", M],
        "example sql_train": [sys.executable, "examples/sql_train.py", "--quick", "--master", M],
        "example caffe_lenet": [sys.executable, "examples/caffe_lenet.py", "--quick", "--json", "--workers", "2",
                                "--master", M],
    }
    if experiments:
        for name in ("time-to-accuracy", "tau-sensitivity", "slow-network"):  # these run on Spark
            out[f"experiment {name}"] = ["sparknet", "experiment", name, "--quick", "--master", M,
                                         "--out", str(work / name)]
        for name in ("speedup-grid", "speedup-vs-overhead"):  # simulations in the driver's process: no master
            out[f"experiment {name}"] = ["sparknet", "experiment", name, "--quick", "--out", str(work / name)]
    return out


def _last_json(text: str):
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiments", action="store_true", help="also each experiment's --quick mode")
    p.add_argument("--only", default=None, help="run only the commands whose name contains this")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each command may take")
    p.add_argument("--out", default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    why = netns_cluster.rig_unavailable()
    if why:
        print(f"multihost_sweep: {why}", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="sparknet-sweep-") as tmp, \
            tempfile.TemporaryDirectory(prefix="sparknet-sweep-", dir="/var/tmp") as shared_tmp, \
            netns_cluster.NetnsCluster(workers=2, memory="1536m") as cluster:
        work, shared = Path(tmp), Path(shared_tmp)  # the rig's hosts have a private /tmp but share /var/tmp
        from sparknet.datasets import mnist_small
        from sparknet.spark.run import dataset_as_parquet

        dataset_as_parquet(mnist_small().train, work / "digits.parquet")  # on the driver's disk only
        dataset_as_parquet(mnist_small().test, shared / "digits.parquet")  # every host sees this one
        for name, cmd in commands(work, shared, args.experiments).items():
            if args.only and args.only not in name:
                continue
            cmd = [c.replace(M, cluster.master) for c in cmd]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, cwd=ROOT, env=cluster.env(), capture_output=True, text=True,
                                      timeout=args.timeout)
                rc, text = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as e:
                rc, text = 124, f"timed out after {args.timeout:g} s\n{e.stdout or ''}"
            wall = time.perf_counter() - t0
            last = _last_json(text if isinstance(text, str) else text.decode())
            tail = "" if rc == 0 else "\n".join(str(text).strip().splitlines()[-5:])
            results.append({"name": name, "command": " ".join(cmd), "rc": rc, "wall_s": round(wall, 1),
                            "result": last, "tail": tail})
            accuracy = (last or {}).get("test_accuracy")
            print(f"{'ok  ' if rc == 0 else 'FAIL'} {name:32s} {wall:6.1f} s"
                  + (f"  test accuracy {accuracy:.4f}" if isinstance(accuracy, float) else "")
                  + (f"\n     {tail}" if tail else ""), flush=True)
    report = {"hosts": 2, "commands": results, "failed": [r["name"] for r in results if r["rc"] != 0]}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
