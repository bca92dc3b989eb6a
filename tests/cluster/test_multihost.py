"""Two worker hosts, each its own network and mount namespace (scripts/netns_cluster.py): what a user runs.

The executors can reach neither the driver's loopback nor its files (a private /tmp and home on
each host), as on a real cluster. Needs root; under CI (``CI=true``, where the suite runs as
root) a rig that cannot start fails the run instead of skipping it.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from _rig import (LOSS_NOTICED, finished_after_one_restart, finished_on_fewer_workers, host_lost_after_round,
                  host_lost_for_good, rig_session)
from sparknet import zoo
from sparknet.config import DistributedConfig, RunConfig, WorkerConfig
from sparknet.datasets import synthetic
from sparknet.metrics import read_metrics
from sparknet.solvers import SolverConfig

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def spark(cluster):
    with rig_session(cluster, "sparknet-multihost-tests", **LOSS_NOTICED) as session:
        yield session


def _hosts(records) -> set[str]:
    return {w["host"] for r in records if r.get("event") == "round" for w in r.get("per_worker", ())}


# The README's command on all of MNIST once; the other engines on its 4,000-digit cut, the same road with a
# fifteenth of the rows to ship to the hosts.
@pytest.mark.parametrize("engine,strategy,dataset", [("rounds", "average", "mnist"),
                                                     ("barrier", "average", "mnist-small"),
                                                     ("rounds", "async", "mnist-small")])
def test_sparknet_train_on_mnist_uses_both_hosts(spark, cluster, tmp_path, engine, strategy, dataset):
    from sparknet.cli import train_command

    out = tmp_path / "metrics.jsonl"
    lr = 0.01 if strategy == "async" else 0.05  # a push moves the server by a whole worker's change
    run = RunConfig(model="lenet", dataset=dataset, steps=60, lr=lr, quiet=True, metrics_out=str(out))
    dist = DistributedConfig(workers=2, master=cluster.master, engine=engine, strategy=strategy, tau=30)
    summary = train_command(run, dist)
    # the async run's pushes land in whatever order the hosts make them: runs of 60 or 90 steps ended anywhere
    # from 0.51 to above 0.7 (chance is 0.1); the synchronous engines' runs are repeatable
    assert summary["test_accuracy"] > (0.4 if strategy == "async" else 0.7)
    assert summary["steps"] == 60
    if strategy == "async":
        hosts = {h for r in read_metrics(out) if r.get("event") == "epoch" for h in r["hosts"]}
    elif engine == "barrier":
        hosts = {w["host"] for w in summary["barrier_workers"]}
    else:
        hosts = _hosts(read_metrics(out))
    assert hosts == {cluster.hostname(1), cluster.hostname(2)}


def test_the_estimator_fits_and_transforms_on_two_hosts(spark, cluster):
    from sparknet.spark.ml import SparkNetEstimator

    train, test = (synthetic(n, shape=(6,), num_classes=3, seed=s, noise=1.0) for n, s in ((400, 1), (200, 2)))
    frame = lambda ds: spark.createDataFrame([([float(v) for v in x], int(y)) for x, y in zip(ds.x, ds.y)],
                                             "features array<double>, label long")
    model = SparkNetEstimator(zoo.mlp(input_shape=[6], hidden=[16], num_classes=3), workers=2, tau=10, rounds=6,
                              lr=0.05, batchSize=32, seed=0).fit(frame(train))
    scored = model.transform(frame(test)).select("label", "prediction").collect()
    accuracy = np.mean([r.label == r.prediction for r in scored])
    assert len(scored) == 200 and accuracy > 0.8


def _scoring_files(root: Path):
    """A small saved model and 60 rows of Parquet to score, under ``root``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sparknet import Net
    from sparknet.model_io import save_model

    x = np.random.default_rng(0).normal(size=(60, 5)).astype(np.float32)
    net = Net(zoo.mlp(input_shape=[5], hidden=[8], num_classes=3), batch_size=16, seed=0)
    model = save_model(root / "model", net)
    data = root / "data.parquet"
    pq.write_table(pa.table({"id": np.arange(60), "features": list(x)}), data)
    return str(model), str(data)


def test_predict_refuses_data_only_the_driver_has_before_scoring(spark, cluster, tmp_path, caplog):
    from sparknet.cli import main

    model, data = _scoring_files(tmp_path)
    out = tmp_path / "scored"
    assert main(["predict", "--master", cluster.master, "--model-dir", model, "--data", data, "--out", str(out)]) == 2
    message = caplog.text
    assert f"--data {data} is not on every host" in message
    assert cluster.hostname(1) in message and cluster.hostname(2) in message
    assert "hdfs://" in message and "s3a://" in message and "Traceback" not in message
    assert not out.exists()


def test_predict_reads_and_writes_a_folder_every_host_mounts(spark, cluster, tmp_path):
    """/var/tmp is the same folder on every host of the rig (only /tmp and the home are private)."""
    import shutil
    import tempfile

    import pyarrow.parquet as pq

    from sparknet.tools.predict import predict

    shared = Path(tempfile.mkdtemp(prefix="sparknet-shared-", dir="/var/tmp"))
    try:
        model, data = _scoring_files(shared)
        with pytest.raises(ValueError, match=f"--out {tmp_path / 'scored'} is not on every host"):
            predict(model, data, str(tmp_path / "scored"), spark=spark)
        assert sorted(p.name for p in shared.iterdir()) == ["data.parquet", "model"]  # the marker is gone
        result = predict(model, data, str(shared / "scored"), spark=spark, partitions=2)
        assert result.rows == 60
        assert sorted(pq.read_table(shared / "scored").column("id").to_pylist()) == list(range(60))
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_train_reads_a_table_named_by_a_uri_on_the_hosts_and_refuses_one_only_the_driver_has(spark, cluster,
                                                                                             tmp_path, caplog):
    """``sparknet train --data file:///...``: a table in a folder every host mounts is read by the executors where
    it lives; one in the driver's private /tmp is refused before training, naming the hosts that cannot see it."""
    import shutil
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    from sparknet.cli import main

    ds = synthetic(900, shape=(6,), num_classes=3, seed=0, noise=1.0)
    table = pa.table({"features": list(ds.x.astype(np.float32)), "label": ds.y.astype(np.int64)})
    pq.write_table(table, tmp_path / "rows.parquet")
    common = ["train", "--model", "mlp", "--master", cluster.master, "--workers", "2", "--tau", "10", "--rounds", "4",
              "--lr", "0.05", "--quiet"]
    assert main([*common, "--data", (tmp_path / "rows.parquet").as_uri()]) == 2
    # the hosts whose probe tasks ran are named (Spark may run them all on one executor)
    assert "is not on every host" in caplog.text and any(cluster.hostname(i) in caplog.text for i in (1, 2))
    shared = Path(tempfile.mkdtemp(prefix="sparknet-shared-", dir="/var/tmp"))
    try:
        pq.write_table(table, shared / "rows.parquet")
        out = tmp_path / "metrics.jsonl"
        assert main([*common, "--data", (shared / "rows.parquet").as_uri(), "--metrics-out", str(out)]) == 0
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    summary = read_metrics(out)[-1]
    assert summary["test_accuracy"] > 0.8 and 800 < summary["data_rows"] < 900  # a seeded sample held out
    assert _hosts(read_metrics(out)) == {cluster.hostname(1), cluster.hostname(2)}


def test_spark_ml_save_and_load_refuse_a_folder_only_the_driver_has(spark, tmp_path):
    from sparknet import Net
    from sparknet.spark.ml import SparkNetEstimator, SparkNetModel

    net = zoo.mlp(input_shape=[5], hidden=[8], num_classes=3)
    for what, thing in (("estimator", SparkNetEstimator(net)), ("model", SparkNetModel.from_net(Net(net, seed=0)))):
        with pytest.raises(ValueError, match=f"the save path {tmp_path / what} is not on every host.*s3a://"):
            thing.save(str(tmp_path / what))
        assert not (tmp_path / what).exists()
    (tmp_path / "saved").mkdir()
    with pytest.raises(ValueError, match="the saved model .* is not on every host"):
        SparkNetModel.load(str(tmp_path / "saved"))


def _blob_frame(spark, n=1200, seed=0):
    """Two partitions whose rows and their order are fixed (sliced, not shuffled): a ``repartition``'s rows
    arrive in the order its shuffle blocks are fetched, which differs from one fit to the next."""
    ds = synthetic(n, shape=(6,), num_classes=3, seed=seed, noise=1.0)
    rows = [([float(v) for v in x], int(y)) for x, y in zip(ds.x, ds.y)]
    return spark.createDataFrame(spark.sparkContext.parallelize(rows, 2), "features array<double>, label long"), ds


def test_a_host_lost_mid_run_costs_nothing_in_the_rounds_engine(spark, cluster):
    """Host 1 dies after round 2: its partition moves to host 2 and the run ends with the weights of
    an undisturbed run (the chunks are replicated; the driver holds every worker's solver state)."""
    from sparknet.spark import EngineOptions, SparkTrainer

    df, ds = _blob_frame(spark)
    val = synthetic(300, shape=(6,), num_classes=3, seed=5, noise=1.0)

    def fit(on_round=None):
        trainer = SparkTrainer(zoo.mlp(input_shape=[6], hidden=[16], num_classes=3),
                               WorkerConfig(solver=SolverConfig(base_lr=0.05, momentum=0.9), batch_size=16, seed=3),
                               dist=DistributedConfig(workers=2, tau=10, rounds=6), spark=spark, on_round=on_round,
                               options=EngineOptions(storage_level="MEMORY_AND_DISK_2", round_timeout_s=180))
        return trainer.fit(df, validation=(val.x, val.y))

    calm = fit()
    lost = []

    def kill_after_round_two(record):
        if record["round"] == 2 and not lost:
            cluster.kill_host(1)
            lost.append(record["round"])

    try:
        hit = fit(kill_after_round_two)
    finally:
        if lost:
            cluster.start_host(1)
    assert lost == [2] and hit.summary["rerun_partitions"] >= 1
    assert abs(hit.summary["test_accuracy"] - calm.summary["test_accuracy"]) <= 0.005
    moved = [r for r in hit.history if r.get("event") == "round" and r["round"] > 2]
    assert {w["host"] for r in moved for w in r["per_worker"]} == {cluster.hostname(2)}
    np.testing.assert_array_equal(hit.weights.to_flat().numpy(), calm.weights.to_flat().numpy())



def _mlp_trainer(spark, dist, **kwargs):
    from sparknet.spark import SparkTrainer

    return SparkTrainer(zoo.mlp(input_shape=[6], hidden=[16], num_classes=3),
                        WorkerConfig(solver=SolverConfig(base_lr=0.05, momentum=0.9), batch_size=16, seed=3), dist, spark=spark, **kwargs)


@pytest.mark.parametrize("engine", ["rounds", "barrier"])
def test_a_parquet_frame_every_host_reads_trains_on_both_hosts(spark, cluster, engine):
    """Rows read from a folder every host mounts: the rounds engine stages them where Spark converts them, in each
    host's private /tmp, and its tasks train where their files are or rerun a partition from the chunks; the barrier
    engine, whose tasks Spark may run away from such files on a cluster, reads them through
    the cached chunks, one rank on each host."""
    import shutil
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    ds, val = synthetic(1200, shape=(6,), num_classes=3, seed=0, noise=1.0), synthetic(300, shape=(6,), num_classes=3,
                                                                                      seed=1, noise=1.0)
    shared = Path(tempfile.mkdtemp(prefix="sparknet-shared-", dir="/var/tmp"))
    try:
        pq.write_table(pa.table({"features": list(ds.x.astype(np.float32)), "label": ds.y.astype(np.int64)}),
                       shared / "rows.parquet")
        result = _mlp_trainer(spark, DistributedConfig(workers=2, engine=engine, tau=10, rounds=6)).fit(
            spark.read.parquet(str(shared / "rows.parquet")), validation=(val.x, val.y))
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    s = result.summary
    assert sum(s["rows_per_partition"]) == 1200 and s["test_accuracy"] > 0.8
    if engine == "barrier":
        assert {w["host"] for w in s["barrier_workers"]} == {cluster.hostname(1), cluster.hostname(2)}
        assert s["restarts"] == 0 and s["staged_rows_missing"] is False
    else:
        # where Spark ran a partition away from its staged files, the round reran it from the chunks and says so
        assert _hosts(result.history) <= {cluster.hostname(1), cluster.hostname(2)} and _hosts(result.history)


def test_the_barrier_engine_restarts_when_a_lost_host_comes_back(spark, cluster):
    """Host 1 dies after round 2 and comes back a few seconds later: the stage starts again from the
    driver's newest state once both slots are there, and the run completes."""
    from sparknet.spark import EngineOptions

    df, _ = _blob_frame(spark)
    val = synthetic(300, shape=(6,), num_classes=3, seed=5, noise=1.0)
    # a simulated link of 0.3 s a collective keeps round 3 running when host 1 dies
    with host_lost_after_round(cluster, spark.sparkContext, slots=2) as kill_after_round_two:
        trainer = _mlp_trainer(spark, DistributedConfig(workers=2, engine="barrier", tau=10, rounds=6,
                                                        link_latency="300ms"),
                               on_round=kill_after_round_two, options=EngineOptions(rendezvous_timeout_s=90))
        result = trainer.fit(df, validation=(val.x, val.y))
    s = finished_after_one_restart(result, rounds=6)
    assert {w["host"] for w in s["barrier_workers"]} == {cluster.hostname(1), cluster.hostname(2)}


def test_the_barrier_engine_goes_on_with_the_worker_left_when_a_host_is_gone_for_good(spark, cluster):
    """Host 1 dies after round 2 and stays down: after ``elastic_after_s`` the stage starts again with one worker on
    host 2, which trains on both partitions' rows, and the fit ends every round."""
    from sparknet.spark import EngineOptions

    df, _ = _blob_frame(spark)
    val = synthetic(300, shape=(6,), num_classes=3, seed=5, noise=1.0)

    with host_lost_for_good(cluster, spark.sparkContext, slots=2) as kill_after_round_two:
        trainer = _mlp_trainer(spark, DistributedConfig(workers=2, engine="barrier", tau=10, rounds=6,
                                                        link_latency="300ms"),
                               on_round=kill_after_round_two, options=EngineOptions(rendezvous_timeout_s=60,
                                                                                    elastic_after_s=0))
        result = trainer.fit(df, validation=(val.x, val.y))
    s = finished_on_fewer_workers(result, rounds=6, workers=1)
    assert [(w["host"], w["rows"]) for w in s["barrier_workers"]] == [(cluster.hostname(2), df.count())]
    after = [r for r in result.history if r.get("event") == "round" and r["round"] > s["elastic_log"][0]["after_round"]]
    assert after and all(r["workers"] == 1 for r in after)


def test_the_barrier_engine_takes_a_host_back_between_two_rounds(spark, cluster):
    """Host 1 dies after round 2: one worker goes on on host 2. Host 1 is started again after round 4; once the
    cluster has both slots, the stage of one worker is stopped after a round and both workers go on, each on its
    own partition, from that round's state. Rounds of 2 s (``round_seconds``) leave time for the host to come up."""
    import threading

    from sparknet.spark import EngineOptions

    df, _ = _blob_frame(spark)
    val = synthetic(300, shape=(6,), num_classes=3, seed=5, noise=1.0)
    revive = threading.Thread(target=cluster.start_host, args=(1,))
    with host_lost_for_good(cluster, spark.sparkContext, slots=2) as kill_after_round_two:
        def on_round(record):
            kill_after_round_two(record)
            if record["round"] == 4 and not revive.is_alive() and not cluster.host_up(1):
                revive.start()

        trainer = _mlp_trainer(spark, DistributedConfig(workers=2, engine="barrier", tau=None, round_seconds=2.0,
                                                        rounds=16, link_latency="300ms"),
                               on_round=on_round, options=EngineOptions(rendezvous_timeout_s=60, elastic_after_s=0))
        try:
            result = trainer.fit(df, validation=(val.x, val.y))
        finally:
            if revive.ident is not None:
                revive.join(timeout=120)
    s = result.summary  # one restart, or two where Spark still counted host 1's slot at first; the grow is not one
    assert 1 <= s["restarts"] <= 2 and s["test_accuracy"] > 0.8, s["restart_log"]
    assert [r["round"] for r in result.history if r.get("event") == "round"] == list(range(1, 17))
    (shrank, one), (grew, two) = ((e["after_round"], e["workers"]) for e in s["elastic_log"])
    assert (one, two) == (1, 2) and 2 <= shrank < grew < 16 and s["elastic_workers"] is None
    workers = {r["round"]: r["workers"] for r in result.history if r.get("event") == "round"}
    assert {workers[r] for r in range(shrank + 1, grew + 1)} == {1} and {workers[r] for r in range(grew + 1, 17)} == {2}
    assert {w["host"] for w in s["barrier_workers"]} == {cluster.hostname(1), cluster.hostname(2)}
    assert [w["rows"] for w in s["barrier_workers"]] == [600, 600]  # each worker on its own partition again


def test_the_barrier_engine_says_it_needs_k_slots_when_a_host_is_gone_for_good(spark, cluster):
    from sparknet.errors import EngineError
    from sparknet.spark import EngineOptions

    df, _ = _blob_frame(spark)

    t0 = time.monotonic()
    with host_lost_for_good(cluster, spark.sparkContext, slots=2) as kill_after_round_two:
        trainer = _mlp_trainer(spark, DistributedConfig(workers=2, engine="barrier", tau=10, rounds=6,
                                                        link_latency="300ms"),
                               on_round=kill_after_round_two, options=EngineOptions(rendezvous_timeout_s=20,
                                                                                    elastic_after_s=None))
        with pytest.raises(EngineError, match=r"runs all 2 workers at once \(2 tasks\) but the cluster has 1 task "
                                              r"slot\(s\) left .*use --engine rounds"):
            trainer.fit(df)
    assert time.monotonic() - t0 < 120  # it waited rendezvous_timeout_s for the host, not for ever


def test_async_training_goes_on_when_a_host_dies_mid_epoch(spark, cluster, monkeypatch):
    """Host 1 dies while both tasks push to the parameter server: Spark runs its task again on host 2,
    the retried task's pushes for steps already applied count once, and the epoch completes."""
    import threading

    import torch

    from sparknet import Net
    from sparknet.ps import AsyncSession, ParameterServer
    from sparknet.ps import session as session_module

    df, _ = _blob_frame(spark, n=2400)
    val = synthetic(300, shape=(6,), num_classes=3, seed=5, noise=1.0)
    sc = spark.sparkContext

    def slow_step(net, batch):  # 0.1 s a step: each task pushes every 0.5 s for 6 s or more
        time.sleep(0.1)
        x, y = batch
        net.optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net.module(x), y)
        loss.backward()
        net.optimizer.step()
        return loss.item()

    done = threading.Event()
    killed = []

    servers = []

    class WatchedServer(ParameterServer):  # the session's server, for the killer to watch
        def start(self):
            servers.append(self)
            return super().start()

    monkeypatch.setattr(session_module, "ParameterServer", WatchedServer)

    def kill_when_both_tasks_run():
        """Kill host 1 once both tasks have pushed: in the middle of the epoch."""
        deadline = time.monotonic() + 120
        while not done.is_set() and time.monotonic() < deadline:
            if servers and len(servers[0].stats()["applied_by_worker"]) >= 2:
                cluster.kill_host(1)
                killed.append(servers[0].stats()["pushes_applied"])
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_when_both_tasks_run, daemon=True)
    net = Net(zoo.mlp(input_shape=[6], hidden=[16], num_classes=3), SolverConfig(base_lr=0.05), seed=0)
    sess = AsyncSession(net, combiner="delta", spark=spark)
    killer.start()
    try:
        m = sess.run(slow_step, df, batch_size=16, tau=5, epochs=1, validation_data=(val.x, val.y))
    finally:
        done.set()
        killer.join(timeout=130)
        if not cluster.host_up(1):
            cluster.start_host(1)
    epoch = m["epochs"][0]
    assert killed and epoch["retried_tasks"] == 1 and epoch["hosts"] == [cluster.hostname(2)]
    assert sum(t["rows"] for t in m["tasks"]) == 2400
    # every step's push applied once: the retried task's pushes for steps its dead attempt had pushed are
    # acknowledged as duplicates, not applied again
    assert epoch["pushes_applied"] == sum(-(-t["steps"] // 5) for t in m["tasks"]) and m["duplicate_pushes"] >= 1
    assert m["test_accuracy"] > 0.8
