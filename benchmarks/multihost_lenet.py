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
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import last_summary, rig_module, timed_command  # noqa: E402

netns_cluster = rig_module()


def _run(cmd: list[str], env: dict, metrics: Path, timeout_s: float) -> dict:
    out = timed_command(cmd, cwd=ROOT, env=env, timeout_s=timeout_s)
    out.pop("stdout_tail", None)
    summary = last_summary(metrics)
    return {**out, "summary": {k: summary.get(k) for k in ("engine", "workers", "test_accuracy", "steps", "rounds",
                                                           "stop_reason", "wall_s", "train_s", "samples_per_s",
                                                           "setup_s", "master")}}


_EMPTY_JOB = ("import json, sys\n"
              "from sparknet.spark import get_session\n"
              "from sparknet.spark.backend import empty_job_s\n"
              "spark = get_session(sys.argv[1])\n"
              "try:\n"
              "    print(json.dumps({'empty_job_s': empty_job_s(spark)}))\n"
              "finally:\n"
              "    spark.stop()\n")


def _empty_job(cluster, timeout: float) -> dict:
    """The median seconds of an empty Spark job on the rig (a fresh session, as a run's)."""
    done = subprocess.run([sys.executable, "-c", _EMPTY_JOB, cluster.master], env=cluster.env(), capture_output=True,
                          text=True, timeout=timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        print(f"multihost_lenet: the empty-job probe failed: {done.stderr[-2000:]}", file=sys.stderr)
        return {}
    return json.loads(lines[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="300 steps and no target (a smoke run)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "multihost_lenet_relay.json"))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds each run may take")
    args = p.parse_args(argv)
    why = netns_cluster.rig_unavailable()
    if why:
        print(f"multihost_lenet: {why}", file=sys.stderr)
        return 2
    train = ["sparknet", "train", "--model", "lenet", "--dataset", "mnist", "--lr", "0.05", "--quiet"]
    train += ["--steps", "300"] if args.quick else ["--steps", "4000", "--target-accuracy", "0.99"]
    runs = {}
    from sparknet.experiments.scaling import calibrate, calibration_around

    # this machine's step and evaluation before and after the runs (its speed moves by a fifth within an hour), so
    # the cost model prices these runs with the constants of their hour: the mean of the two readings
    before = calibrate().to_dict()
    print(json.dumps({"calibration_before": before}), flush=True)
    with tempfile.TemporaryDirectory(prefix="sparknet-bench-") as tmp:
        one = Path(tmp) / "one.jsonl"
        runs["one process, 2 threads"] = _run([*train, "--eval-every", "50", "--threads", "2", "--metrics-out",
                                               str(one)], dict(os.environ), one, args.timeout)
        print(json.dumps(runs["one process, 2 threads"]), flush=True)
        with netns_cluster.NetnsCluster(workers=2, memory="2g") as cluster:
            empty_job = _empty_job(cluster, args.timeout)  # the cluster's own job latency, for the cost model
            print(json.dumps(empty_job), flush=True)
            for engine in ("rounds", "barrier"):
                out = Path(tmp) / f"{engine}.jsonl"
                cmd = [*train, "--workers", "2", "--master", cluster.master, "--engine", engine, "--tau", "50",
                       "--metrics-out", str(out)]
                runs[f"2 hosts, {engine} engine"] = _run(cmd, cluster.env(), out, args.timeout)
                print(json.dumps(runs[f"2 hosts, {engine} engine"]), flush=True)
    after = calibrate().to_dict()
    print(json.dumps({"calibration_after": after}), flush=True)
    report = {"benchmark": "multihost_lenet", "quick": args.quick, "cpu_count": os.cpu_count(), **empty_job,
              **calibration_around(before, after), "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
