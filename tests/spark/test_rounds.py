"""The rounds engine on local[2]: exactness, records, stopping rules, errors, cleanup."""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest
import torch

from _spark_testlib import blobs, flat, hand_rounds, mlp, module_session, partitioned_rdd
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.errors import WorkerError
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.spark import EngineOptions, SparkTrainer

pytestmark = pytest.mark.spark


spark = module_session("local[2]")


def _flat(result):
    return result.weights.to_flat(torch.float32)


def test_average_is_the_sample_weighted_mean_over_three_rounds_with_momentum(spark, tmp_path):
    # uneven partitions: the mean is weighted 12:20; momentum makes each worker's solver state matter
    x, y = blobs(32, seed=1)
    parts = [(x[:12], y[:12]), (x[12:], y[12:])]
    solver = SolverConfig(base_lr=0.05, momentum=0.9)
    records = []
    trainer = SparkTrainer(mlp(), WorkerConfig(solver=solver, batch_size=8, seed=3),
                           dist=DistributedConfig(workers=2, engine="rounds", tau=3, rounds=3),
                           on_round=records.append, options=EngineOptions(staging_dir=str(tmp_path)))
    result = trainer.fit(partitioned_rdd(spark.sparkContext, parts))
    expected = hand_rounds(mlp(), solver, parts, batch_size=8, seed=3, tau=3, rounds=3)
    assert torch.allclose(_flat(result), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(_flat(result), flat(mlp()), atol=1e-3)  # it did train

    # one record per round, handed to on_round as it happened
    assert records == result.history and [r["round"] for r in records] == [1, 2, 3]
    last = records[-1]
    for key in ("event", "round", "steps", "total_steps", "samples", "total_samples", "wall_s", "round_s",
                "compute_s", "comm_s", "loss", "bytes", "tau", "workers", "engine", "strategy", "per_worker"):
        assert key in last, key
    assert last["event"] == "round" and last["engine"] == "rounds" and last["strategy"] == "average"
    assert last["steps"] == 3 and last["total_steps"] == 9 and last["samples"] == 2 * 3 * 8
    assert last["round_s"] >= last["compute_s"] > 0
    assert last["comm_s"] == pytest.approx(last["round_s"] - last["compute_s"])
    assert result.summary["setup_s"] <= result.history[0]["start_s"] < last["start_s"] < last["wall_s"]
    nbytes = expected.numel() * 4
    assert last["bytes"] == 4 * nbytes  # out to 2 workers, 2 deltas back
    assert [w["index"] for w in last["per_worker"]] == [0, 1]
    assert all(w["samples"] == 24 and w["steps"] == 3 and w["attempt"] == 0 for w in last["per_worker"])
    s = result.summary
    assert s["rounds"] == 3 and s["bytes_communicated"] == 12 * nbytes and s["stop_reason"] == "rounds"
    assert s["rows_per_partition"] == [12, 20] and s["samples"] == 144 and s["samples_per_s"] > 0
    # the staged files and state are gone, the job group is cleared
    assert os.listdir(tmp_path) == []
    assert spark.sparkContext.getLocalProperty("spark.jobGroup.id") is None


def test_tau_one_plain_sgd_round_equals_one_large_batch_step(spark):
    x, y = blobs(16, seed=2)
    parts = [(x[:8], y[:8]), (x[8:], y[8:])]
    solver = SolverConfig(base_lr=0.2, momentum=0.0, weight_decay=0.0)
    trainer = SparkTrainer(mlp(1), WorkerConfig(solver=solver, batch_size=8, seed=0),
                           dist=DistributedConfig(workers=2, engine="rounds", tau=1, rounds=1))
    # starting from given weights (as a resumed run does), not the module's own
    result = trainer.fit(partitioned_rdd(spark.sparkContext, parts), initial_weights=Net(mlp(7)).get_weights())
    big = Net(mlp(7), solver, batch_size=16, seed=0)
    big.set_training_data((x, y))
    big.train(1)
    assert torch.allclose(_flat(result), big.get_flat(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("transport", ["socket", "spark"])
def test_nine_workers_on_two_slots_and_state_that_follows_its_partition(spark, transport):
    # through Spark, K > 8 aggregates in a tree (depth 2); through the driver's socket, the driver sums the
    # nine updates; nine partitions share two Python workers, so a round often finds a partition in another
    # process than last time: its momentum must follow (and a prefetched message must be the round's)
    x, y = blobs(54, seed=5)
    parts = [(x[i * 6:(i + 1) * 6], y[i * 6:(i + 1) * 6]) for i in range(9)]
    solver = SolverConfig(base_lr=0.05, momentum=0.9)
    result = SparkTrainer(mlp(), WorkerConfig(solver=solver, batch_size=4, seed=1),
                          dist=DistributedConfig(workers=9, engine="rounds", tau=2, rounds=2),
                          options=EngineOptions(rounds_transport=transport)
                          ).fit(partitioned_rdd(spark.sparkContext, parts))
    assert result.summary["rounds_transport"] == transport
    expected = hand_rounds(mlp(), solver, parts, batch_size=4, seed=1, tau=2, rounds=2)
    assert torch.allclose(_flat(result), expected, atol=1e-5, rtol=1e-5)
    assert [w["index"] for w in result.history[-1]["per_worker"]] == list(range(9))


def _fit_three_rounds(spark, transport: str, compression: str = "none"):
    x, y = blobs(32, seed=1)
    parts = [(x[:12], y[:12]), (x[12:], y[12:])]
    solver = SolverConfig(base_lr=0.05, momentum=0.9)
    return SparkTrainer(mlp(), WorkerConfig(solver=solver, batch_size=8, seed=3),
                        dist=DistributedConfig(workers=2, engine="rounds", tau=3, rounds=3, compression=compression),
                        options=EngineOptions(rounds_transport=transport)
                        ).fit(partitioned_rdd(spark.sparkContext, parts))


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_weights_through_the_drivers_socket_are_bit_identical_to_sparks_broadcasts(spark, compression):
    results = {t: _fit_three_rounds(spark, t, compression) for t in ("spark", "socket")}
    assert {t: r.summary["rounds_transport"] for t, r in results.items()} == {"spark": "spark", "socket": "socket"}
    assert torch.equal(_flat(results["spark"]), _flat(results["socket"]))
    assert [r["bytes"] for r in results["spark"].history] == [r["bytes"] for r in results["socket"].history]


def test_a_driver_socket_the_tasks_cannot_reach_falls_back_to_spark_for_the_rest_of_the_fit(spark, monkeypatch,
                                                                                           caplog):
    import zmq

    from sparknet.spark.rounds import driver as _rounds_exchange
    from sparknet.spark._relay import RelayAddress, RoundRelay

    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as sock:  # a port nothing listens on
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        sock.unbind(f"tcp://127.0.0.1:{port}")

    class Firewalled(RoundRelay):  # what executors behind a firewall see: an address they cannot reach
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.address = RelayAddress(f"tcp://127.0.0.1:{port}", self.address.keys, reach_s=1.0)

    monkeypatch.setattr(_rounds_exchange, "RoundRelay", Firewalled)
    with caplog.at_level("WARNING", logger="sparknet.spark.rounds.driver"):
        fell_back = _fit_three_rounds(spark, "socket")
    assert fell_back.summary["rounds_transport"] == "spark"
    assert any("could not reach the driver's socket" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    assert torch.equal(_flat(fell_back), _flat(_fit_three_rounds(spark, "spark")))


def test_stopping_rules_steps_epochs_and_target(spark):
    x, y = blobs(64, seed=4)
    df = spark.createDataFrame([(x[i].tolist(), int(y[i])) for i in range(len(y))], "features array<float>, label long")
    df = df.repartition(2).cache()
    solver = SolverConfig(base_lr=0.1)

    # the steps rule caps the last round: 4 + 4 + 2
    res = SparkTrainer(mlp(), WorkerConfig(solver=solver, batch_size=8, steps=10),
                       dist=DistributedConfig(workers=2, tau=4)).fit(df)
    assert [h["steps"] for h in res.history] == [4, 4, 2] and res.summary["stop_reason"] == "steps"

    # epochs: 64 rows, 2 workers x 2 steps x 8 = 32 samples a round -> 2 rounds for one epoch
    res = SparkTrainer(mlp(), WorkerConfig(solver=solver, batch_size=8), DistributedConfig(workers=2, tau=2, epochs=1.0)).fit(df)
    assert res.summary["rounds"] == 2 and res.summary["stop_reason"] == "epochs"

    # target accuracy, measured on the driver every round
    res = SparkTrainer(mlp(), WorkerConfig(solver=solver, batch_size=8),
                       dist=DistributedConfig(workers=2, tau=10, rounds=30, target_accuracy=0.9,
                                              eval_budget=1.0)).fit(df, validation=df)
    assert res.summary["stop_reason"] == "target_accuracy" and res.summary["rounds"] < 30
    assert res.history[-1]["val_accuracy"] >= 0.9 and res.summary["test_accuracy"] >= 0.9
    assert res.net.test() == pytest.approx(res.summary["test_accuracy"])


def test_the_summary_s_test_scores_are_the_last_round_s_whole_evaluation_not_one_pass_more(spark, monkeypatch):
    """A fit's last round is scored on the whole validation set (here a screen's rows and the rest, apart); the
    summary reports those scores of the weights it returns instead of scoring them again on the driver."""
    x, y = blobs(64, seed=2)
    df = partitioned_rdd(spark.sparkContext, [(x[:32], y[:32]), (x[32:], y[32:])])
    passes = []  # the driver's evaluations: (sample, rest_of)
    evaluate = Net.evaluate

    def counted(net, *args, **kwargs):
        passes.append((kwargs.get("sample"), kwargs.get("rest_of")))
        return evaluate(net, *args, **kwargs)

    monkeypatch.setattr(Net, "evaluate", counted)
    res = SparkTrainer(mlp(), WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=8),
                       dist=DistributedConfig(workers=2, tau=5, rounds=30, target_accuracy=0.9, eval_budget=1.0,
                                              eval_screen_rows=16)).fit(df, validation=df)
    monkeypatch.undo()
    whole = [h for h in res.history if "val_loss" in h]
    assert res.summary["stop_reason"] == "target_accuracy" and whole[-1] is res.history[-1]
    assert (None, 16) in passes  # the last round's whole evaluation: its screen joined with the rest
    assert len([p for p in passes if p[0] is None]) == len(whole)  # and no pass after it
    s, last = res.summary, res.history[-1]
    assert {k.removeprefix("test_"): v for k, v in s.items() if k.startswith("test_")} == {
        k.removeprefix("val_"): v for k, v in last.items() if k.startswith("val_")}
    again = res.net.evaluate(batch_size=64)  # the returned weights, scored in one pass here
    assert again.accuracy == s["test_accuracy"] and again.loss == pytest.approx(s["test_loss"], rel=1e-6)


def test_warm_start_on_the_driver_then_round_seconds(spark):
    x, y = blobs(48, seed=5)
    rdd = partitioned_rdd(spark.sparkContext, [(x[:24], y[:24]), (x[24:], y[24:])])
    res = SparkTrainer(mlp(), WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=8),
                       dist=DistributedConfig(workers=2, tau=None, round_seconds=0.05, rounds=2, warmup_steps=5)
                       ).fit(rdd)
    assert res.summary["warmup"]["steps"] == 5 and res.summary["warmup"]["rows"] == 48
    assert all(h["tau"] is None and h["steps"] >= 1 for h in res.history)


@pytest.mark.parametrize("source", ["rdd", "frame"])
@pytest.mark.parametrize("engine", ["rounds", "barrier"])
def test_the_workers_start_from_the_warmed_weights(spark, engine, source):
    """A fit warmed up on the driver ends where a fit started from those warmed weights by hand ends. A DataFrame's
    sample is read from the files its rows were staged in where they were converted (both engines, one machine)."""
    x, y = blobs(48, seed=6)
    rdd = partitioned_rdd(spark.sparkContext, [(x[:24], y[:24]), (x[24:], y[24:])]).cache()
    if source == "frame":  # the same rows in the same two partitions, as doubles (float32 values, exactly)
        rows = [([float(v) for v in row], int(label)) for row, label in zip(x, y)]
        rdd = spark.createDataFrame(spark.sparkContext.parallelize(rows, 2), "features array<double>, label long")
    solver = SolverConfig(base_lr=0.1, momentum=0.0, lr_policy="fixed")  # no dependence on the solver's iteration
    model = mlp(seed=2)
    # the driver's warm-up, by hand: every row (fewer than the sample bound), in partition order, the fit's seed
    warm = Net(mlp(seed=2), solver, batch_size=8, seed=4)
    warm.set_training_data((x, y))
    warm.train(6)
    assert not torch.equal(warm.get_flat(), flat(model))

    def fit(**kw):
        return SparkTrainer(model, WorkerConfig(solver=solver, batch_size=8, seed=4),
                            dist=DistributedConfig(workers=2, engine=engine, tau=3, rounds=2, **kw))

    warmed = fit(warmup_steps=6).fit(rdd)
    by_hand = fit().fit(rdd, initial_weights=warm.get_flat())
    cold = fit().fit(rdd)
    assert warmed.summary["warmup"]["steps"] == 6
    assert torch.allclose(_flat(warmed), _flat(by_hand), atol=1e-6)
    assert not torch.allclose(_flat(warmed), _flat(cold), atol=1e-4)


def _boom(pred, y):
    raise RuntimeError("loss exploded on purpose")


def test_a_failing_worker_surfaces_as_worker_error_with_rank(spark):
    import pyspark.cloudpickle as cp

    cp.register_pickle_by_value(sys.modules[__name__])
    try:
        x, y = blobs(16)
        rdd = partitioned_rdd(spark.sparkContext, [(x[:8], y[:8]), (x[8:], y[8:])])
        trainer = SparkTrainer(mlp(), WorkerConfig(batch_size=4), DistributedConfig(workers=2, tau=1, rounds=1), loss=_boom)
        with pytest.raises(WorkerError) as info:
            trainer.fit(rdd)
    finally:
        cp.unregister_pickle_by_value(sys.modules[__name__])
    assert info.value.rank in (0, 1)
    assert "loss exploded on purpose" in str(info.value) and "_boom" in info.value.log_tail
    assert spark.sparkContext.getLocalProperty("spark.jobGroup.id") is None


def _parquet_frame(spark, path, x, y):
    """``(x, y)`` written as Parquet at ``path`` and read back: a DataFrame the rounds engine stages where its
    batches are converted (sparknet.spark.rounds.executor.stage_frame)."""
    spark.createDataFrame([(x[i].tolist(), int(y[i])) for i in range(len(y))],
                          "features array<float>, label long").write.parquet(str(path))
    return spark.read.parquet(str(path))


def _staged_fit(df, engine: str, staging_dir, initial_weights=None, **dist):
    return SparkTrainer(mlp(), WorkerConfig(solver=SolverConfig(base_lr=0.1, momentum=0.9), batch_size=8, seed=3),
                        DistributedConfig(workers=2, tau=3, rounds=3, engine=engine, **dist),
                        options=EngineOptions(staging_dir=str(staging_dir))).fit(df, initial_weights=initial_weights)


@pytest.mark.parametrize("engine", ["rounds", "barrier"])
def test_a_dataframe_staged_where_it_is_converted_trains_as_through_an_rdd_of_chunks(spark, tmp_path, monkeypatch,
                                                                                     engine):
    """A DataFrame whose rows do not come from the driver is staged by the tasks that convert its Arrow batches, the
    chunks never back in the JVM (the rounds engine's jobs and the barrier stage read the staged files); the same
    DataFrame staged through the RDD of chunks (as rows the driver shipped are) gives the same rows per partition and
    the same final weights, bit for bit."""
    from sparknet.spark import data as spark_data

    x, y = blobs(96, seed=8)
    df = _parquet_frame(spark, tmp_path / "rows.parquet", x, y)
    direct = _staged_fit(df, engine, tmp_path / "staged")
    monkeypatch.setattr(spark_data, "ships_local_data", lambda rdd, **kw: True)  # the road of the driver's rows
    through_chunks = _staged_fit(df, engine, tmp_path / "staged")
    assert direct.summary["rows_per_partition"] == through_chunks.summary["rows_per_partition"]
    assert sum(direct.summary["rows_per_partition"]) == 96
    assert torch.equal(_flat(direct), _flat(through_chunks))
    assert not list((tmp_path / "staged").iterdir())  # the fits' ends removed what they staged


@pytest.mark.parametrize("warmup_steps", [0, 7], ids=["cold", "warmed"])
@pytest.mark.parametrize("engine", ["rounds", "barrier"])
def test_a_data_set_dealt_to_its_own_tasks_is_read_and_staged_in_one_task(spark, tmp_path, monkeypatch,
                                                                          engine, warmup_steps):
    """The command line's DataFrame of a data set (its partitions copy their rows out of the cached arrays,
    ``dataset_frame(..., partitions=K)``) is read, converted and staged in one task; the same DataFrame through its
    rows in the JVM (what any DataFrame gets) trains to the same weights, bit for bit. Warmed up, the dealt data
    set's warm-up reads its sample on the driver and trains while Spark stages the rows; the other reads it from the
    staged files after: the same sample, the same weights."""
    from sparknet.datasets import ArrayDataset
    from sparknet.spark import data as spark_data
    from sparknet.spark.run import dataset_frame

    monkeypatch.setenv("SPARKNET_CACHE", str(tmp_path))
    x, y = blobs(96, seed=8)
    dealt = dataset_frame(spark, "blobs", ArrayDataset(x, y), partitions=2)
    assert dealt.partitions == 2
    start = flat(mlp(seed=9)) if warmup_steps else None  # a warm-up starts from the fit's initial weights
    in_one_task = _staged_fit(dealt, engine, tmp_path / "staged", start, warmup_steps=warmup_steps)
    assert "frame" not in vars(dealt)  # no DataFrame made
    # spark.range's numbers and empty partitions are no rows of the driver's (tasks over them are staged where they
    # run); parallelize's are
    sc = spark.sparkContext
    assert not spark_data.ships_local_data(dealt.frame.rdd) and spark_data.ships_local_data(sc.parallelize([1, 2], 2))
    assert not spark_data.ships_local_data(sc.parallelize([], 2)) and not spark_data.ships_local_data(sc.range(4, numSlices=2))
    # the road of any DataFrame
    through_the_jvm = _staged_fit(dealt.frame, engine, tmp_path / "staged", start, warmup_steps=warmup_steps)
    assert in_one_task.summary["rows_per_partition"] == through_the_jvm.summary["rows_per_partition"] == [48, 48]
    assert torch.equal(_flat(in_one_task), _flat(through_the_jvm))
    if warmup_steps:
        ahead, after = in_one_task.summary["warmup"], through_the_jvm.summary["warmup"]
        assert ahead.pop("while_staging") and "while_staging" not in after
        assert ahead["steps"] == warmup_steps and ahead["rows"] == 96 and ahead["loss"] == after["loss"]


def test_a_fit_that_fails_while_its_warm_up_trains_ends_the_warm_up(spark, tmp_path, monkeypatch):
    """A dealt data set warms up in a thread while Spark stages its rows; a fit that fails meanwhile (here its
    validation labels are no classes of the net's) ends the warm-up at its next step, not after all its steps (five
    million of them here: minutes)."""
    import threading
    import time

    from sparknet.datasets import ArrayDataset
    from sparknet.spark.run import dataset_frame

    monkeypatch.setenv("SPARKNET_CACHE", str(tmp_path))
    x, y = blobs(96, seed=8)
    frame = dataset_frame(spark, "blobs", ArrayDataset(x, y), partitions=2)
    trainer = SparkTrainer(mlp(), WorkerConfig(solver=SolverConfig(base_lr=0.1, momentum=0.9), batch_size=8, seed=3),
                           DistributedConfig(workers=2, tau=3, rounds=3, warmup_steps=5_000_000),
                           options=EngineOptions(staging_dir=str(tmp_path / "staged")))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="validation data: labels range over"):
        trainer.fit(frame, validation=(x, y + 100))
    assert time.perf_counter() - t0 < 60
    assert not [t for t in threading.enumerate() if t.name.startswith("sparknet-warmup")]


def test_a_barrier_stage_that_finds_no_staged_rows_starts_again_over_the_chunks(spark, tmp_path, monkeypatch):
    """The staged files gone before the barrier stage starts (as on a host Spark did not stage on): each task says so,
    the stage starts again over the chunks, not counted as a restart, and trains to the same weights."""
    x, y = blobs(96, seed=8)
    df = _parquet_frame(spark, tmp_path / "rows.parquet", x, y)
    staged_dir = tmp_path / "staged"
    expected = _staged_fit(df, "barrier", staged_dir)
    assert expected.summary["staged_rows_missing"] is False
    probe = SparkTrainer._probe

    def probe_then_lose_the_files(*args, **kwargs):  # on the driver, after the stage job, before the stage
        for folder in staged_dir.iterdir():
            shutil.rmtree(folder)
        return probe(*args, **kwargs)

    monkeypatch.setattr(SparkTrainer, "_probe", staticmethod(probe_then_lose_the_files))
    again = _staged_fit(df, "barrier", staged_dir)
    assert again.summary["staged_rows_missing"] is True and again.summary["restarts"] == 0
    assert torch.equal(_flat(expected), _flat(again))


def test_a_lazy_rdd_is_made_once_on_first_use_and_not_to_be_unpersisted():
    from sparknet.spark.data import LazyRDD

    made = []

    class Rdd:
        def count(self):
            return 7

        def unpersist(self):
            made.append("unpersisted")

    lazy = LazyRDD(lambda: made.append("made") or Rdd())
    assert lazy.unpersist() is None and made == []  # never made: nothing to unpersist, nothing made for it
    assert lazy.count() == 7 and lazy.count() == 7 and made == ["made"]
    lazy.unpersist()
    assert made == ["made", "unpersisted"]


@pytest.mark.parametrize("kind", ["rdd", "parquet", "dealt"])
def test_a_partition_whose_files_vanished_is_rerun_from_the_cached_chunks(spark, tmp_path, monkeypatch, kind):
    x, y = blobs(32, seed=6)
    if kind == "rdd":
        rdd = partitioned_rdd(spark.sparkContext, [(x[:16], y[:16]), (x[16:], y[16:])])
    else:  # staged where converted (or read): the chunks are made only for the rerun
        if kind == "parquet":
            rdd = _parquet_frame(spark, tmp_path / "rows.parquet", x, y)
        else:  # no DataFrame made until the rerun asks for one
            from sparknet.datasets import ArrayDataset
            from sparknet.spark.run import dataset_frame

            monkeypatch.setenv("SPARKNET_CACHE", str(tmp_path / "cache"))
            rdd = dataset_frame(spark, "blobs", ArrayDataset(x, y), partitions=2)
        tmp_path = tmp_path / "staged"
        tmp_path.mkdir()

    def wipe(record):  # as if the executor's disk and Python workers were lost after round 1
        if record["round"] == 1:
            for d in os.listdir(tmp_path):
                shutil.rmtree(tmp_path / d)

    res = SparkTrainer(mlp(), WorkerConfig(solver=SolverConfig(base_lr=0.1, momentum=0.0), batch_size=8), on_round=wipe,
                       dist=DistributedConfig(workers=2, tau=2, rounds=3),
                       options=EngineOptions(staging_dir=str(tmp_path))).fit(rdd)
    assert res.summary["rounds"] == 3 and res.summary["rerun_partitions"] == 2
    assert kind != "dealt" or "frame" in vars(rdd)  # made for the rerun
    assert [w["source"] for w in res.history[1]["per_worker"]] == ["chunks", "chunks"]
    assert all(w["source"] in ("cache", "file") for w in res.history[2]["per_worker"])
    assert np.isfinite(res.history[-1]["loss"])


def test_an_overlapped_evaluation_scores_the_same_weights_a_round_late(spark):
    """eval_overlap: each round's weights are scored in a driver thread while the next round's job runs. Training
    is untouched (the same final weights, bit for bit); every record carries the same scores as without overlap,
    handed on in round order; the target, seen a round late, ends the run one round later."""
    x, y = blobs(400, seed=6)
    vx, vy = blobs(300, seed=7)
    df = spark.createDataFrame([(x[i].tolist(), int(y[i])) for i in range(len(y))], "features array<float>, label long")
    df = df.repartition(2).cache()

    def fit(overlap: bool, **dist):
        seen = []
        kw = dict(workers=2, tau=5, eval_budget=1.0, eval_screen_rows=0, eval_overlap=overlap)
        kw.update(dist)
        res = SparkTrainer(mlp(1), WorkerConfig(solver=SolverConfig(base_lr=0.05), batch_size=16, seed=2),
                           DistributedConfig(**kw), on_round=seen.append).fit(df, validation=(vx, vy))
        assert [r["round"] for r in seen] == [r["round"] for r in res.history]  # handed on in round order
        return res, seen

    plain, _ = fit(False, rounds=6)
    behind, seen = fit(True, rounds=6)
    assert torch.equal(_flat(plain), _flat(behind))
    assert [r["val_accuracy"] for r in behind.history] == [r["val_accuracy"] for r in plain.history]
    assert [r["val_loss"] for r in behind.history] == [r["val_loss"] for r in plain.history]
    assert [r.get("eval_overlapped", False) for r in behind.history] == [True] * 5 + [False]  # the last: at once

    target = 0.97
    plain, _ = fit(False, rounds=40, target_accuracy=target)
    behind, _ = fit(True, rounds=40, target_accuracy=target)
    first = next(r["round"] for r in plain.history if r["val_accuracy"] >= target)
    assert plain.summary["stop_reason"] == "target_accuracy" and plain.summary["rounds"] == first
    assert behind.summary["stop_reason"] == "target_accuracy" and behind.summary["rounds"] == first + 1
    assert [r["val_accuracy"] for r in behind.history[:first]] == [r["val_accuracy"] for r in plain.history]


def test_overlap_is_refused_where_the_evaluation_runs_with_the_training():
    with pytest.raises(ValueError, match="eval_overlap.*barrier engine evaluates on its workers"):
        DistributedConfig(workers=2, engine="barrier", eval_overlap=True)
