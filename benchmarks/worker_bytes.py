"""Bytes a round sends between hosts when workers are several processes: K = 2 workers of G = 2 processes on the
multi-host rig (scripts/netns_cluster.py, two hosts of two task slots), a 1.06 M-weight MLP (4.2 MB of float32).

    sudo python benchmarks/worker_bytes.py            # about two minutes; needs root (network namespaces)

A worker's two ranks are placed on one host, so only the exchange between the workers, the state sent to the driver
and Spark's own messages cross the hosts' links. Each shape is fitted for 1 and for 3 rounds of 50 steps. The bytes
the two links carry (both ways, from the kernel's counters) are read before and after each fit. Their difference
over the two extra rounds is one round's cost, with the stage's launch and the starting weights left out. The shapes:

- the replica whole on each worker's two ranks (each column carries half of the round's buffer);
- the same with int8 updates;
- the replica sharded over them with FSDP2 (each column carries its rank's part);
- the layers split over them with tensor parallelism (--model-parallel 2: each column carries its rank's part, and
  the activations the two ranks sum every step stay on their host), in float32 and with int8 updates.

Prints and saves JSON with the load average sampled before and during (bytes do not depend on it; Spark's own
messages do, a little).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler, rig_module, save_json  # noqa: E402

netns_cluster = rig_module()

SHAPES = {"whole": {}, "whole, int8": {"compression": "int8"}, "sharded": {"shard_replica": True},
          "split": {"model_parallel": 2}, "split, int8": {"model_parallel": 2, "compression": "int8"}}


def _session(cluster):
    """The project's session (:func:`~sparknet.spark.session.get_session`) with its driver on the rig's bridge."""
    from sparknet.spark.session import get_session

    os.environ.update({"PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": cluster.driver_ip})
    return get_session(cluster.master, app_name="sparknet-worker-bytes",
                       conf={**cluster.driver_conf(), "spark.locality.wait": "0s", "spark.driver.memory": "2g",
                             "spark.ui.enabled": "false"})


def _fit(spark, cluster, frame, rounds: int, extra: dict) -> dict:
    from sparknet import zoo
    from sparknet.config import DistributedConfig, WorkerConfig
    from sparknet.solvers import SolverConfig
    from sparknet.spark import SparkTrainer

    dist = DistributedConfig(workers=2, procs_per_worker=2, engine="barrier", tau=50, rounds=rounds, **extra)
    trainer = SparkTrainer(zoo.mlp(input_shape=[6], hidden=[1024, 1024], num_classes=3),
                           WorkerConfig(solver=SolverConfig(base_lr=0.05, momentum=0.9), batch_size=16, seed=3),
                           dist, spark=spark)
    before = [cluster.link_bytes(i) for i in (1, 2)]
    result = trainer.fit(frame)
    crossed = sum(cluster.link_bytes(i) - b for i, b in zip((1, 2), before))
    last = [r for r in result.history if r.get("event") == "round"][-1]
    hosts = {}
    for rank in result.summary["barrier_workers"]:
        hosts.setdefault(rank["worker"], set()).add(rank["host"])
    return {"rounds": rounds, "crossed_bytes": crossed, "record_bytes": last["bytes"],
            "inner_gather_bytes": last.get("inner_gather_bytes"),
            "step_gradient_bytes": last["inner_allreduce_bytes"] // 50 if "inner_allreduce_bytes" in last else None,
            "workers_on_one_host": all(len(h) == 1 for h in hosts.values())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "worker_bytes.json"))
    args = p.parse_args(argv)
    why = netns_cluster.rig_unavailable()
    if why:
        print(f"worker_bytes: {why}", file=sys.stderr)
        return 2
    from sparknet.datasets import synthetic
    from sparknet.spark.backend import task_slots

    weights = 6 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 3 + 3
    shapes = {}
    with LoadSampler() as load, netns_cluster.NetnsCluster(workers=2, cores=2, memory="1536m") as cluster:
        spark = _session(cluster)
        try:
            deadline = time.monotonic() + 120  # both hosts' executors registered: four task slots
            while task_slots(spark.sparkContext) != 4:
                if time.monotonic() > deadline:
                    raise RuntimeError("the rig's two hosts did not offer four task slots within 120 s")
                time.sleep(0.5)
            ds = synthetic(1200, shape=(6,), num_classes=3, seed=0, noise=1.0)
            rows = [([float(v) for v in x], int(y)) for x, y in zip(ds.x, ds.y)]
            frame = spark.createDataFrame(spark.sparkContext.parallelize(rows, 4),
                                          "features array<double>, label long").cache()
            frame.count()
            for name, extra in SHAPES.items():
                one, three = (_fit(spark, cluster, frame, rounds, extra) for rounds in (1, 3))
                per_round = (three["crossed_bytes"] - one["crossed_bytes"]) / 2
                shapes[name] = {"one_round": one, "three_rounds": three, "crossed_bytes_per_round": per_round,
                                "weight_bytes": 4 * weights,
                                "per_round_over_weight_bytes": round(per_round / (4 * weights), 3)}
                print(json.dumps({name: shapes[name]}), flush=True)
        finally:
            spark.stop()
    report = {"benchmark": "worker_bytes", "workers": 2, "procs_per_worker": 2, "hosts": 2, "tau": 50,
              "weights": weights, "shapes": shapes, **load.to_dict()}
    save_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
