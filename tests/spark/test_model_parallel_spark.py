"""Model parallelism in the barrier engine's stage (local[4]): exactness against two plain gloo
processes, the full D = 2 x M = 2 layout, ``sparknet train --model-parallel`` end to end,
and the clear refusals."""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from _two_ranks import run_two_ranks
from _spark_testlib import blobs, partitioned_rdd, start_session
from sparknet.cli import main
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.layers import ActivationLayer, LinearLayer, NetParams, RDDLayer, SoftmaxWithLoss
from sparknet.parallel import WeightBudgetError
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer

pytestmark = pytest.mark.spark

TOL = 1e-5


@pytest.fixture(scope="module")
def spark():
    session = start_session("local[4]")
    yield session
    session.stop()


def tiny_net(batch_size: int = 8) -> NetParams:
    """2 -> 16 -> 8 -> 3: ip1 and ip2 pair up as column and row under the default plan."""
    return NetParams(
        RDDLayer("data", shape=[batch_size, 2]), RDDLayer("label", shape=[batch_size], dtype="int64"),
        LinearLayer("ip1", ["data"], num_outputs=16), ActivationLayer("relu1", ["ip1"], tops=["ip1"]),
        LinearLayer("ip2", ["ip1"], num_outputs=8), ActivationLayer("relu2", ["ip2"], tops=["ip2"]),
        LinearLayer("ip3", ["ip2"], num_outputs=3), SoftmaxWithLoss("loss", ["ip3", "label"]), name="tiny")


# --------------------------------------------------------------------------- the two-process reference


def _reference_rank(rank, out, x, y, solver, seed, tau, rounds):
    """By hand, without the runner or dp_round: one replica split in two, trained tau x rounds steps."""
    from sparknet.net import Net
    from sparknet.parallel import build_parallel, gather_full_weights, init_layout, replica_seed

    layout = init_layout(2)
    module = build_parallel(tiny_net(), layout, {"ip1": "column", "ip2": "row"}, seed=seed)
    torch.manual_seed(replica_seed(layout, seed))
    net = Net(module, solver, batch_size=8, seed=replica_seed(layout, seed))
    net.set_training_data((x, y))
    for _ in range(rounds):
        net.train(tau)
    flat = gather_full_weights(net).to_flat(torch.float32)
    if rank == 0:
        out["flat"] = flat.numpy().copy()


def _reference(*args) -> torch.Tensor:
    return torch.from_numpy(run_two_ranks(_reference_rank, *args)["flat"])


# --------------------------------------------------------------------------- tests


def test_one_replica_split_in_two_equals_two_plain_processes(spark):
    x, y = blobs(48, seed=1)
    solver = SolverConfig(base_lr=0.05, momentum=0.9)
    trainer = SparkTrainer(tiny_net(), WorkerConfig(solver=solver, batch_size=8, seed=5),
                           DistributedConfig(workers=2, engine="barrier", model_parallel=2, tau=3, rounds=3), spark=spark)
    parts = [(x[:20], y[:20]), (x[20:], y[20:])]  # the replica pools them in partition order
    result = trainer.fit(partitioned_rdd(spark.sparkContext, parts), validation=(x, y))
    expected = _reference(x, y, solver, 5, 3, 3)
    got = result.weights.to_flat(torch.float32)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=TOL, rtol=TOL), float((got - expected).abs().max())
    s = result.summary
    assert s["plan"] == {"ip1": "column", "ip2": "row"} and s["data_parallel"] == 1 and s["model_parallel"] == 2
    assert s["rounds"] == 3 and s["total_steps"] == 9 and [h["round"] for h in result.history] == [1, 2, 3]
    # ip1 (16x2 + 16) and ip2's weight (8x16) halve; ip2's bias and ip3 stay whole on both ranks
    assert s["weight_bytes_per_worker"] == [4 * (24 + 64 + 8 + 27)] * 2
    assert s["whole_weight_bytes"] == 4 * (48 + 136 + 27)
    assert spark.sparkContext.getLocalProperty("spark.jobGroup.id") is None


def test_two_replicas_of_two_shards_train_and_each_worker_holds_about_half(spark):
    x, y = blobs(400, seed=2)
    wide = NetParams(
        RDDLayer("data", shape=[16, 2]), RDDLayer("label", shape=[16], dtype="int64"),
        LinearLayer("ip1", ["data"], num_outputs=256), ActivationLayer("relu1", ["ip1"], tops=["ip1"]),
        LinearLayer("ip2", ["ip1"], num_outputs=256), ActivationLayer("relu2", ["ip2"], tops=["ip2"]),
        LinearLayer("ip3", ["ip2"], num_outputs=3), SoftmaxWithLoss("loss", ["ip3", "label"]), name="wide")
    worker = WorkerConfig(solver=SolverConfig(base_lr=0.02, momentum=0.9), batch_size=16)
    parts = [(x[i::4], y[i::4]) for i in range(4)]
    rdd = partitioned_rdd(spark.sparkContext, parts)
    with pytest.raises(WeightBudgetError, match="model-parallel 2"):  # unsplit, one worker's budget is too small
        SparkTrainer(wide, worker, DistributedConfig(workers=4, engine="barrier", rounds=1, max_weight_bytes=200_000),
                     spark=spark).fit(rdd)
    dist = DistributedConfig(workers=4, engine="barrier", model_parallel=2, tau=5, rounds=4, max_weight_bytes=200_000)
    result = SparkTrainer(wide, worker, dist, spark=spark).fit(rdd, validation=(x, y))
    s = result.summary
    assert s["data_parallel"] == 2 and [w["dp_rank"] for w in s["barrier_workers"]] == [0, 0, 1, 1]
    whole = s["whole_weight_bytes"]
    assert whole > 200_000
    assert all(0.45 * whole < b < 0.55 * whole and b <= 200_000 for b in s["weight_bytes_per_worker"])
    assert s["bytes_communicated"] > 0  # the two replicas averaged every round
    first, last = result.history[0], result.history[-1]
    assert last["loss"] < first["loss"] and last["val_accuracy"] > 0.9
    assert s["test_accuracy"] == pytest.approx(last["val_accuracy"], abs=1e-6)  # the driver scores the same weights


def test_a_failed_split_stage_starts_again_and_ends_as_an_undisturbed_fit(spark):
    from sparknet.errors import WorkerError
    from sparknet.spark import EngineOptions

    x, y = blobs(64, seed=4)
    rdd = partitioned_rdd(spark.sparkContext, [(x[:32], y[:32]), (x[32:], y[32:])])
    worker = WorkerConfig(solver=SolverConfig(base_lr=0.05, momentum=0.9), batch_size=8, seed=2)
    dist = DistributedConfig(workers=2, engine="barrier", model_parallel=2, tau=2, rounds=3)

    def fit(**options):
        return SparkTrainer(tiny_net(), worker, dist, spark=spark, options=EngineOptions(**options)).fit(
            rdd, validation=(x, y))

    clean = fit()
    hurt = fit(fault="rank=1,round=2,kind=raise")  # rank 1 fails after round 2's steps, on the first attempt
    assert hurt.summary["restarts"] == 1 and hurt.summary["restart_log"][0]["after_round"] == 0
    assert [h["round"] for h in hurt.history] == [1, 2, 3] and all(h.get("restarts") == 1 for h in hurt.history)
    assert torch.equal(hurt.weights.to_flat(), clean.weights.to_flat())  # the restart trained from the start
    with pytest.raises(WorkerError) as info:
        fit(fault="rank=1,round=2,kind=raise", max_restarts=0)
    assert info.value.rank == 1 and "injected fault" in str(info.value)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """A ``--data`` run keeps a Parquet copy of its rows in the data cache, named by the files it read: each test's
    fresh file would leave one more in the user's cache, so these tests get a cache of their own."""
    monkeypatch.setenv("SPARKNET_CACHE", str(tmp_path / "cache"))


def _parquet(path, n: int = 600) -> str:
    x, y = blobs(n, seed=3)
    offsets = pa.array(np.arange(0, (n + 1) * 2, 2, dtype=np.int32))
    table = pa.table({"features": pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1))),
                      "label": pa.array(y)})
    pq.write_table(table, path)
    return str(path)


def test_sparknet_train_model_parallel_end_to_end(spark, tmp_path):
    from sparknet.model_io import load_model

    data = _parquet(tmp_path / "blobs.parquet")
    metrics, model = tmp_path / "run.jsonl", tmp_path / "model"
    code = main(["train", "--model", "mlp", "--data", data, "--workers", "2", "--engine", "barrier",
                 "--model-parallel", "2", "--tau", "10", "--rounds", "3", "--batch-size", "16", "--lr", "0.05",
                 "--metrics-out", str(metrics), "--model-dir", str(model), "--quiet"])
    assert code == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["round"] for r in records if r["event"] == "round"] == [1, 2, 3]
    summary = records[-1]
    assert summary["event"] == "summary" and summary["plan"] == {"ip1": "column", "ip2": "row"}
    per_worker = summary["weight_bytes_per_worker"]
    assert len(per_worker) == 2 and all(0.45 < b / summary["whole_weight_bytes"] < 0.55 for b in per_worker)
    assert summary["test_accuracy"] > 0.8
    saved = load_model(model)  # an ordinary model folder holding the whole (gathered) net
    x, y = blobs(600, seed=3)
    acc = saved.net.evaluate((x[-60:], y[-60:])).accuracy
    assert acc == pytest.approx(summary["test_accuracy"], abs=1e-6)


@pytest.mark.parametrize("extra, message", [
    (["--workers", "3", "--model-parallel", "2"], "do not divide into model-parallel groups of 2"),
    (["--workers", "2", "--model-parallel", "2", "--engine", "rounds"], "add --engine barrier"),
    (["--workers", "2", "--model-parallel", "2", "--strategy", "sync"], "does not know about split layers"),
    (["--workers", "2", "--model-parallel", "2", "--round-seconds", "2"], "fixed --tau"),
    (["--workers", "2", "--model-parallel", "2", "--parallel-plan", "ip1=sideways"], "LAYER=column"),
    (["--workers", "2", "--model-parallel", "2", "--parallel-plan", "conv9=column"], "conv9"),
    (["--workers", "2", "--model-parallel", "2", "--max-weight-bytes", "1e4"], "over the budget"),
    (["--workers", "2", "--model-parallel", "2", "--link-latency", "50ms"], "drop --compression, --auto-tau"),
    (["--workers", "2", "--max-weight-bytes", "4e5"], "with --model-parallel 2 each rank would hold"),
    (["--workers", "2", "--parallel-plan", "ip1=column"], "--parallel-plan needs --model-parallel M with M > 1"),
    (["--workers", "2", "--model-parallel", "2", "--checkpoint-dir", "ckpt"], "drop --checkpoint-dir"),
    (["--workers", "2", "--model-parallel", "2", "--device", "auto"], "use device cpu"),
])
def test_what_cannot_run_is_refused_clearly(spark, tmp_path, caplog, extra, message):
    data = _parquet(tmp_path / "blobs.parquet", n=40)
    argv = ["train", "--model", "mlp", "--data", data, "--tau", "2", "--rounds", "1", "--quiet", "--engine", "barrier"]
    with caplog.at_level(logging.ERROR, logger="sparknet"):
        code = main(argv + extra)
    assert code == 2
    assert message in caplog.text
