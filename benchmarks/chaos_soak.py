"""Chaos soak: LeNet trains on two worker hosts while a random host or executor is killed every 45-90 s.

    sudo python benchmarks/chaos_soak.py                      # 10 minutes of kills for each engine, then each
                                                              # engine's undisturbed run of the same length
    sudo python benchmarks/chaos_soak.py --rounds 40 --epochs 3 --every 20 30 --down 5 10    # a short one

The rig is scripts/netns_cluster.py: two worker hosts of one core each, in their own network and
mount namespaces, a standalone master and the driver on a private bridge. Two engines are soaked,
each on its own run: the rounds engine (``--rounds`` rounds of tau=50) and the asynchronous
parameter server (``--epochs`` epochs, tau=10, learning rate 0.01: at 0.05 two asynchronous
LeNet workers diverge). While a run trains, a seeded chaos thread waits 45-90 s, then either
kills a random worker host outright (every process in it, its link down) and brings it back
15-30 s later, or kills a random host's executor (the host's worker daemon starts a new one).
It goes on for ``--minutes`` (10), or until the run ends if that is sooner; a run still
training then finishes calm. Each engine then trains again, undisturbed, with the same settings
and seed.

What the report holds, for each engine: every chaos event with its time from the run's start;
the run's wall time from the fit's start (data shipped, evaluation included); what the run's
own records say of the failures (rounds: the retried tasks, the partitions rerun from the cached
chunks where their executor was lost, the rounds run on one host, the rounds with fewer workers;
asynchronous: the retried tasks and duplicate pushes per epoch); the final test
accuracy of the disturbed and the undisturbed run and their difference in points; and the load
average before and during. The soak passes when every run ends (no hang, no lost run) and the
disturbed accuracy is within ``--tolerance`` points (0.5) of the undisturbed one. Needs root for
the namespaces; time nothing else while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler, rig_module, save_json  # noqa: E402

netns_cluster = rig_module()


class Chaos:
    """A thread that, until stopped, waits ``every`` seconds (uniform in the range), then kills a random host (back
    after ``down`` seconds) or a random host's executors; every event is recorded with its time."""

    def __init__(self, cluster, *, seed: int, every=(45.0, 90.0), down=(15.0, 30.0), window_s: float = 600.0):
        self.cluster, self.every, self.down, self.window_s = cluster, every, down, window_s
        self.rng = random.Random(seed)
        self.events: list[dict] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="sparknet-chaos", daemon=True)

    def _note(self, action: str, host: int, **extra) -> None:
        self.events.append({"t_s": round(time.monotonic() - self._t0, 1), "action": action, "host": host, **extra})
        print(f"chaos: {self.events[-1]}", flush=True)

    def _run(self) -> None:
        hosts = list(range(1, self.cluster.workers + 1))
        while not self._stop.wait(self.rng.uniform(*self.every)):
            if time.monotonic() - self._t0 > self.window_s:  # the soak's window is over: the run goes on calm
                self._note("window over", 0)
                return
            host = self.rng.choice(hosts)
            try:
                if self.rng.random() < 0.5:
                    self.cluster.kill_host(host)
                    self._note("host killed", host)
                    self._stop.wait(self.rng.uniform(*self.down))  # down for a while even when stopping
                    self.cluster.start_host(host)
                    self._note("host back", host)
                else:
                    self._note("executors killed", host, killed=self.cluster.kill_executors(host))
            except Exception as exc:  # the rig failed: recorded, and the soak reports it
                self.errors.append(f"{type(exc).__name__}: {exc}")
                return

    def __enter__(self) -> Chaos:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.down[1] + self.cluster.timeout_s + 30)
        for host in range(1, self.cluster.workers + 1):  # every host up again for the next run
            if not self.cluster.host_up(host):
                self.cluster.start_host(host)


def _rounds_run(spark, data, *, rounds: int, seed: int, on_round) -> dict:
    from sparknet.config import DistributedConfig, RunConfig
    from sparknet.spark.trainer import SparkTrainer

    train_df, test, net_params = data
    run = RunConfig(model="lenet", dataset="mnist", lr=0.05, seed=seed, quiet=True)
    dist = DistributedConfig(workers=2, tau=50, rounds=rounds, eval_every_rounds=10)
    trainer = SparkTrainer.from_config(net_params, run, dist, spark=spark, on_round=on_round)
    result = trainer.fit(train_df, validation=test)
    rounds_ = [r for r in result.history if r.get("event") == "round"]
    s = result.summary
    return {"test_accuracy": s.get("test_accuracy"), "rounds": len(rounds_),
            "retried_tasks": sum(int(r.get("retries") or 0) for r in rounds_),
            "rounds_with_retries": [r["round"] for r in rounds_ if r.get("retries")],
            # a partition whose executor was lost runs again from the cached chunks with the state the driver holds
            # (rerun_partitions counts them from the run's start)
            "partitions_rerun": int(rounds_[-1].get("rerun_partitions") or 0) if rounds_ else 0,
            "rounds_with_reruns": [b["round"] for a, b in zip([{}, *rounds_], rounds_)
                                   if (b.get("rerun_partitions") or 0) > (a.get("rerun_partitions") or 0)],
            "rounds_on_one_host": [r["round"] for r in rounds_ if len(r.get("hosts") or ()) < 2],
            "rounds_with_fewer_workers": [r["round"] for r in rounds_ if r.get("trained_workers") is not None],
            "elastic_rounds": s.get("elastic_rounds"), "restarts": s.get("restarts"),
            "samples": s.get("samples"), "train_s": s.get("train_s")}


def _async_run(spark, data, *, epochs: int, seed: int, on_round) -> dict:
    from sparknet.ps import AsyncSession
    from sparknet.solvers import SolverConfig

    train_df, test, net_params = data
    sess = AsyncSession(net_params, SolverConfig(base_lr=0.01, momentum=0.9), combiner="delta", spark=spark,
                        seed=seed)
    m = sess.run(data=train_df, batch_size=64, tau=10, epochs=epochs, feed_names=("features", "label"),
                 image_shape=(1, 28, 28), validation_data=(test.x, test.y), on_epoch=on_round)
    return {"test_accuracy": m.get("test_accuracy"), "epochs": len(m["epochs"]),
            "retried_tasks": sum(e["retried_tasks"] for e in m["epochs"]),
            "epochs_with_retries": [e["epoch"] for e in m["epochs"] if e["retried_tasks"]],
            "duplicate_pushes": m.get("duplicate_pushes"), "pushes": m.get("pushes"),
            "rejected_total": m.get("rejected_total"), "rejected": m.get("rejected"),
            "connections_refused": m.get("connections_refused")}


def soak(cluster, spark, data, engine: str, *, chaos: bool, args) -> dict:
    """One run of ``engine``, with the chaos thread or without; its figures and events."""
    run = _rounds_run if engine == "rounds" else _async_run
    size = {"rounds": args.rounds} if engine == "rounds" else {"epochs": args.epochs}
    seen = []
    t_start = time.monotonic()

    def on_record(record: dict) -> None:
        seen.append(record)
        n = record.get("round", record.get("epoch", 0) + 1)
        if n % 10 == 0 or engine == "async":
            print(f"{engine}{' (chaos)' if chaos else ''}: {'round' if engine == 'rounds' else 'epoch'} {n} at "
                  f"{time.monotonic() - t_start:.0f} s", flush=True)

    sampler = LoadSampler(every_s=5.0).start()
    t0 = time.perf_counter()
    events, errors = [], []
    try:
        if chaos:
            with Chaos(cluster, seed=args.seed, every=tuple(args.every), down=tuple(args.down),
                       window_s=60 * args.minutes) as c:
                out = run(spark, data, seed=args.seed, on_round=on_record, **size)
            events, errors = c.events, c.errors
        else:
            out = run(spark, data, seed=args.seed, on_round=on_record, **size)
        outcome = "finished"
    except Exception as exc:  # a lost run is the soak's failure: reported, not raised
        out, outcome = {}, f"failed: {type(exc).__name__}: {exc}"
    wall = time.perf_counter() - t0
    return {"engine": engine, "chaos": chaos, "outcome": outcome, "wall_s": round(wall, 1),
            "chaos_s": round(min(wall, 60 * args.minutes), 1) if chaos else 0.0, **out,
            "records_seen": len(seen), "events": events, "chaos_errors": errors, **sampler.stop()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", nargs="+", choices=["rounds", "async"], default=["rounds", "async"])
    p.add_argument("--rounds", type=int, default=150, help="rounds of the rounds engine's runs (tau=50)")
    p.add_argument("--epochs", type=int, default=20, help="epochs of the parameter server's runs (tau=10)")
    p.add_argument("--every", type=float, nargs=2, default=[45.0, 90.0], metavar=("MIN", "MAX"),
                   help="seconds between chaos events")
    p.add_argument("--down", type=float, nargs=2, default=[15.0, 30.0], metavar=("MIN", "MAX"),
                   help="seconds a killed host stays down")
    p.add_argument("--minutes", type=float, default=10.0,
                   help="how long the chaos lasts (it stops sooner if the run ends; the run goes on calm after it)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tolerance", type=float, default=0.5, help="accuracy points the disturbed run may lose")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "chaos_soak.json"))
    args = p.parse_args(argv)
    why = netns_cluster.rig_unavailable()
    if why:
        print(f"chaos_soak: {why}", file=sys.stderr)
        return 2
    from sparknet._app import build_model, load_training_data
    from sparknet.config import RunConfig
    from sparknet.spark.data import frame_from_arrays
    from sparknet.spark.session import get_session

    runs = []
    with netns_cluster.NetnsCluster(workers=2, memory="2g") as cluster:
        os.environ.update({"PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": cluster.driver_ip})
        # spark.locality.wait=0s: a host that comes back gets tasks again at once (docs/RELIABILITY.md)
        spark = get_session(cluster.master, app_name="sparknet-chaos-soak",
                            conf={**cluster.driver_conf(), "spark.locality.wait": "0s", "spark.task.maxFailures": "8",
                                  "spark.driver.memory": "2g", "spark.ui.enabled": "false"})
        try:
            run = RunConfig(model="lenet", dataset="mnist", lr=0.05, seed=args.seed)
            train, test, info = load_training_data(run)
            data = (frame_from_arrays(spark, train.x, train.y).cache(), test, build_model(run, info))
            for engine in args.engines:
                for chaos in (True, False):
                    runs.append(soak(cluster, spark, data, engine, chaos=chaos, args=args))
                    shown = {k: v for k, v in runs[-1].items() if k not in ("events", "load_average_during")}
                    print(json.dumps(shown), flush=True)
        finally:
            spark.stop()
    verdicts = {}
    for engine in args.engines:
        hit, calm = (next(r for r in runs if r["engine"] == engine and r["chaos"] is c) for c in (True, False))
        gap = None
        if hit.get("test_accuracy") is not None and calm.get("test_accuracy") is not None:
            gap = round(100 * (calm["test_accuracy"] - hit["test_accuracy"]), 2)
        verdicts[engine] = {"kills": sum(1 for e in hit["events"] if "killed" in e["action"]),
                            "accuracy_points_lost": gap,
                            "passed": (hit["outcome"] == calm["outcome"] == "finished" and not hit["chaos_errors"]
                                       and gap is not None and gap <= args.tolerance)}
    report = {"benchmark": "chaos_soak", "cpu_count": os.cpu_count(), "args": vars(args), "verdicts": verdicts,
              "runs": runs}
    save_json(report, args.out)
    print(json.dumps(verdicts), flush=True)
    return 0 if all(v["passed"] for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
