"""LeNet on MNIST to 99% on two worker hosts (scripts/netns_cluster.py), both engines, beside one process.

    sudo python benchmarks/multihost_lenet.py                  # both engines and the one-process run
    sudo python benchmarks/multihost_lenet.py --quick          # 300 steps, no target: a smoke run

Each run is the user's command, timed from its start (Spark session, JVMs, data shipped to the
hosts, evaluation included) to its end; the summary's in-round figures are reported beside it.
The workers are two hosts of one core each, in their own network and mount namespaces on this
machine, so the data reaches them through Spark as it would on a real cluster. The one-process
run (no Spark, two threads, evaluating every 50 steps) is the bar two workers have to beat on
this machine. The load average is sampled before and every 5 s during each run. Time nothing
else while it runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("netns_cluster", ROOT / "scripts" / "netns_cluster.py")
netns_cluster = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(netns_cluster)


class LoadSampler:
    """The 1-minute load average every ``every_s`` seconds while it runs."""

    def __init__(self, every_s: float = 5.0):
        self.every_s, self.samples, self._stop = every_s, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.every_s):
            self.samples.append(round(os.getloadavg()[0], 2))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)


def _run(cmd: list[str], env: dict, metrics: Path, timeout_s: float) -> dict:
    before = os.getloadavg()
    t0 = time.perf_counter()
    with LoadSampler() as load:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    summary = next(r for r in reversed(records) if r.get("event") == "summary")
    return {"command": " ".join(cmd), "command_wall_s": round(wall, 1), "summary": {
        k: summary.get(k) for k in ("engine", "workers", "test_accuracy", "steps", "rounds", "stop_reason", "wall_s",
                                    "train_s", "samples_per_s", "setup_s", "master")},
            "load_average_before": [round(v, 2) for v in before], "load_average_during": load.samples}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="300 steps and no target (a smoke run)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "multihost_lenet.json"))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds each run may take")
    args = p.parse_args(argv)
    why = netns_cluster.rig_unavailable()
    if why:
        print(f"multihost_lenet: {why}", file=sys.stderr)
        return 2
    train = ["sparknet", "train", "--model", "lenet", "--dataset", "mnist", "--lr", "0.05", "--quiet"]
    train += ["--steps", "300"] if args.quick else ["--steps", "4000", "--target-accuracy", "0.99"]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="sparknet-bench-") as tmp:
        one = Path(tmp) / "one.jsonl"
        runs["one process, 2 threads"] = _run([*train, "--eval-every", "50", "--threads", "2", "--metrics-out",
                                               str(one)], dict(os.environ), one, args.timeout)
        print(json.dumps(runs["one process, 2 threads"]), flush=True)
        with netns_cluster.NetnsCluster(workers=2, memory="2g") as cluster:
            for engine in ("rounds", "barrier"):
                out = Path(tmp) / f"{engine}.jsonl"
                cmd = [*train, "--workers", "2", "--master", cluster.master, "--engine", engine, "--tau", "50",
                       "--metrics-out", str(out)]
                runs[f"2 hosts, {engine} engine"] = _run(cmd, cluster.env(), out, args.timeout)
                print(json.dumps(runs[f"2 hosts, {engine} engine"]), flush=True)
    report = {"benchmark": "multihost_lenet", "quick": args.quick, "cpu_count": os.cpu_count(), "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
