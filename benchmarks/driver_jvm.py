"""What the driver JVM's compiler options cost: a session's start, and Spark's own work once it runs.

    python benchmarks/driver_jvm.py                 # 3 fresh processes per option set, alternating
    python benchmarks/driver_jvm.py --repeats 2 --sets defaults,late-c2

Each run is a fresh Python process that starts a ``local[2]`` session through :func:`sparknet.spark.get_session`
(its driver JVM with the options of the set, sparknet's class archive as a user's later runs have it), then runs
three jobs four times each: a ``mapInArrow`` pass over MNIST's 50,000 training rows in a Parquet file (written
once by the script, beside its runs: the staging a fit does), an aggregation over 30 million generated rows (the
SQL a user's ETL runs), and 20,000 rows of MNIST to pandas. A run reports the session's start (the process's
start to the session, its imports included), the JVM's CPU seconds by then (from ``/proc``) and each job's seconds;
the first of each job pays for the Python daemon's start and the JIT's first compiles, the last shows the hot code.
The sets:

- ``defaults``: Java's own tiers (``-XX:+TieredCompilation``, Java's default said aloud, which keeps sparknet's
  own options off);
- ``late-c2``: :data:`sparknet.spark.session.LATE_OPTIMIZER` (what sparknet's sessions have);
- ``late-c2-10x``: C2's thresholds 4 to 33 times Java's (its invocation count 10 times, where ``late-c2``'s is 40
  times);
- ``c1-only``: ``-XX:TieredStopAtLevel=1``, the test suite's (short JVMs: no optimizing compiler at all).

The load average is sampled before and during each run. Prints and saves JSON. Time nothing else beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler, commit_of, save_json  # noqa: E402

from sparknet.spark.session import LATE_OPTIMIZER  # noqa: E402

SETS = {"defaults": "-XX:+TieredCompilation", "late-c2": LATE_OPTIMIZER,
        "late-c2-10x": "-XX:Tier4InvocationThreshold=50000 -XX:Tier4MinInvocationThreshold=20000 "
                       "-XX:Tier4CompileThreshold=60000 -XX:Tier4BackEdgeThreshold=400000",
        "c1-only": "-XX:TieredStopAtLevel=1"}

RUN = r"""
import json, os, sys, time
t0 = time.perf_counter()
from sparknet.spark.session import get_session
spark = get_session("local[2]", conf={"spark.driver.extraJavaOptions": sys.argv[1]})
ready = time.perf_counter() - t0
try:
    jvm = spark.sparkContext._jvm
    stat = open(f"/proc/{jvm.java.lang.ProcessHandle.current().pid()}/stat").read().rsplit(")", 1)[1].split()
    cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    args = [str(a) for a in jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments()]
    import pyspark.sql.functions as F
    frame = spark.read.parquet(sys.argv[2])
    label = frame.columns[-1]

    def labels(batches):
        for batch in batches:
            yield batch.select([label])

    jobs = {"staging_s": [], "aggregation_s": [], "to_pandas_s": []}
    for _ in range(4):
        t = time.perf_counter()
        frame.mapInArrow(labels, f"{label} long").count()
        jobs["staging_s"].append(round(time.perf_counter() - t, 3))
        t = time.perf_counter()
        keyed = spark.range(0, 30_000_000).select((F.col("id") * 7 % 13).alias("k"), "id")
        keyed.groupBy("k").agg(F.sum("id")).collect()
        jobs["aggregation_s"].append(round(time.perf_counter() - t, 3))
        t = time.perf_counter()
        frame.limit(20_000).toPandas()
        jobs["to_pandas_s"].append(round(time.perf_counter() - t, 3))
    print(json.dumps({"session_s": round(ready, 3), "jvm_cpu_s": cpu, "jvm_args": args, **jobs}))
finally:
    spark.stop()
"""


def mnist_parquet(where: Path) -> Path:
    """MNIST's training rows as a Parquet file under ``where``, in the columns sparknet's own copy has."""
    from sparknet.datasets import mnist
    from sparknet.spark.run import dataset_as_parquet

    return dataset_as_parquet(mnist().train, where / "mnist-train.parquet")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each run may take")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "driver_jvm.json"))
    args = p.parse_args(argv)
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        raise SystemExit(f"unknown sets {unknown}: choose from {list(SETS)}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="sparknet-driver-jvm-") as where:
        data = mnist_parquet(Path(where))
        for repeat in range(args.repeats):
            for name in (sets if repeat % 2 == 0 else sets[::-1]):
                with LoadSampler(every_s=2.0) as load:
                    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", RUN, SETS[name], str(data)],
                                          capture_output=True, text=True, timeout=args.timeout, cwd=where)
                if proc.returncode != 0:
                    raise SystemExit(f"the {name} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
                record = json.loads(proc.stdout.strip().splitlines()[-1])
                tiers = [a for a in record["jvm_args"] if "Tier" in a]
                assert tiers == SETS[name].split(), (name, record["jvm_args"])  # the JVM had these and no others
                run = {"set": name, "repeat": repeat, **{k: v for k, v in record.items() if k != "jvm_args"},
                       **load.to_dict()}
                runs.append(run)
                print(json.dumps(run), flush=True)
    summary = {name: {"median_session_s": statistics.median(r["session_s"] for r in runs if r["set"] == name),
                      "median_jvm_cpu_s": statistics.median(r["jvm_cpu_s"] for r in runs if r["set"] == name),
                      **{f"median_last_{job}": statistics.median(r[job][-1] for r in runs if r["set"] == name)
                         for job in ("staging_s", "aggregation_s", "to_pandas_s")}}
               for name in sets}
    result = {"benchmark": "driver_jvm", "commit": commit_of(), "cpus": os.cpu_count(),
              "data": "MNIST's 50,000 training rows", "sets": {name: SETS[name] for name in sets}, "summary": summary,
              "runs": runs}
    print(json.dumps(summary, indent=1))
    print("saved", save_json(result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
