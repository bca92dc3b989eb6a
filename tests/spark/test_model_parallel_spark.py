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
from _spark_testlib import blobs, module_session, partitioned_rdd
from sparknet.cli import main
from sparknet.collective import FIELDS
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.layers import ActivationLayer, LinearLayer, NetParams, RDDLayer, SoftmaxWithLoss
from sparknet.parallel import WeightBudgetError
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer

pytestmark = pytest.mark.spark

TOL = 1e-5


spark = module_session("local[4]")


def tiny_net(batch_size: int = 8) -> NetParams:
    """2 -> 16 -> 8 -> 3: ip1 and ip2 pair up as column and row under the default plan."""
    return NetParams(
        RDDLayer("data", shape=[batch_size, 2]), RDDLayer("label", shape=[batch_size], dtype="int64"),
        LinearLayer("ip1", ["data"], num_outputs=16), ActivationLayer("relu1", ["ip1"], tops=["ip1"]),
        LinearLayer("ip2", ["ip1"], num_outputs=8), ActivationLayer("relu2", ["ip2"], tops=["ip2"]),
        LinearLayer("ip3", ["ip2"], num_outputs=3), SoftmaxWithLoss("loss", ["ip3", "label"]), name="tiny")


# --------------------------------------------------------------------------- the two-process reference


def _reference_rank(rank, out, x, y, solver, seed, tau, rounds):
    """By hand, without the engine or its round loop: one replica, built whole as the driver builds it and split in
    two (rank 0's weights scattered), trained tau x rounds steps."""
    from sparknet.net import Net
    from sparknet.parallel import gather_full_weights, init_layout, parallelize
    from sparknet.step import worker_seed

    layout = init_layout(2)
    module = parallelize(tiny_net().build(seed=seed), layout, {"ip1": "column", "ip2": "row"})
    net = Net(module, solver, batch_size=8, seed=worker_seed(seed, 0))  # the replica's data order: its worker's
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
    assert s["data_parallel"] == 2 and [w["worker"] for w in s["barrier_workers"]] == [0, 0, 1, 1]
    whole = s["whole_weight_bytes"]
    assert whole > 200_000
    assert all(0.45 * whole < b < 0.55 * whole and b <= 200_000 for b in s["weight_bytes_per_worker"])
    assert s["bytes_communicated"] > 0  # the two replicas averaged every round
    first, last = result.history[0], result.history[-1]
    assert last["loss"] < first["loss"] and last["val_accuracy"] > 0.9
    assert s["test_accuracy"] == pytest.approx(last["val_accuracy"], abs=1e-6)  # the driver scores the same weights


def test_a_failed_split_stage_starts_again_from_its_last_state_and_ends_as_an_undisturbed_fit(spark, tmp_path):
    from sparknet.errors import WorkerError
    from sparknet.spark import EngineOptions

    x, y = blobs(64, seed=4)
    rdd = partitioned_rdd(spark.sparkContext, [(x[:32], y[:32]), (x[32:], y[32:])])
    worker = WorkerConfig(solver=SolverConfig(base_lr=0.05, momentum=0.9), batch_size=8, seed=2)

    def fit(name, **options):  # every round's state and every rank's solver state reach the driver
        dist = DistributedConfig(workers=2, engine="barrier", model_parallel=2, tau=2, rounds=3,
                                 checkpoint_dir=str(tmp_path / name), checkpoint_every=1)
        return SparkTrainer(tiny_net(), worker, dist, spark=spark, options=EngineOptions(**options)).fit(
            rdd, validation=(x, y))

    clean = fit("clean")
    hurt = fit("hurt", fault="rank=1,round=2,kind=raise")  # rank 1 fails after round 2's steps, on the first attempt
    assert hurt.summary["restarts"] == 1 and hurt.summary["restart_log"][0]["after_round"] == 1
    assert [h["round"] for h in hurt.history] == [1, 2, 3] and [h.get("restarts") for h in hurt.history] == [None, 1, 1]
    # the restart began at round 2 from round 1's global weights and every rank's own part of the momentum
    assert torch.equal(hurt.weights.to_flat(), clean.weights.to_flat())
    with pytest.raises(WorkerError) as info:
        fit("failed", fault="rank=1,round=2,kind=raise", max_restarts=0)
    assert info.value.rank == 1 and "injected fault" in str(info.value)


# -- a split worker's exchange: whatever the strategy or the stream, as the whole replica's -------------------------

def _quarters(n: int = 32, seed: int = 1):
    x, y = blobs(n, seed=seed)
    q = n // 4
    return [(x[i * q:(i + 1) * q], y[i * q:(i + 1) * q]) for i in range(4)]


def _dsl_mlp():
    from sparknet import zoo

    return zoo.mlp(input_shape=[2], hidden=[8], num_classes=3)  # ip1 (2 -> 8) column, ip2 (8 -> 3) row


def _replica_fit(spark, split: bool, rounds: int = 5, strategy: str = "diloco", parts=None, **options):
    """K = 2 workers of 2 processes (tau 3) on four partitions of 8 rows: the layers split over a worker's
    processes, both on the worker's 16 rows a step (batch 16), or the replica whole on each, each on its own
    partition (batch 8) and their gradients averaged: the same mean gradient every step."""
    shape = dict(workers=4, model_parallel=2) if split else dict(workers=2, procs_per_worker=2)
    config = DistributedConfig(engine="barrier", strategy=strategy, tau=3, rounds=rounds, **shape, **options)
    worker = WorkerConfig(solver=SolverConfig(base_lr=0.1, momentum=0.9), batch_size=16 if split else 8, seed=5)
    return SparkTrainer(_dsl_mlp(), worker, dist=config, spark=spark).fit(
        partitioned_rdd(spark.sparkContext, parts or _quarters()))


@pytest.mark.parametrize("options", [{"strategy": "average"}, {}, {"strategy": "easgd"}, {"overlap": True},
                                     {"weight_ema": 0.5}, {"compression": "bf16"}])
def test_a_split_worker_exchanges_as_the_whole_replica_does(spark, options):
    # each process exchanges its part of the layers with the process of the other worker that holds the same part:
    # averaging, DiLoCo's outer step, EASGD's elastic pull (each process keeps its own part between rounds), an
    # exchange a round late, the moving average kept part by part and joined on the driver, bf16 updates (each value
    # rounded on its own, so the whole layers both processes hold stay equal)
    split, whole = (_replica_fit(spark, flag, **options) for flag in (True, False))
    ws, ww = (r.weights.to_flat(torch.float32) for r in (split, whole))
    assert torch.allclose(ws, ww, atol=1e-5, rtol=1e-4), float((ws - ww).abs().max())
    from sparknet.net import Net

    assert not torch.allclose(ws, Net(_dsl_mlp()).get_flat(), atol=1e-3)
    s = split.summary
    assert (s["workers"], s["procs_per_worker"], s["data_parallel"], s["model_parallel"]) == (2, 2, 2, 2)
    assert [(w["worker"], w["proc"]) for w in s["barrier_workers"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [h["workers"] for h in split.history] == [2] * 5
    # ip1's weight and bias and ip2's weight halve; ip2's bias is whole on both
    assert s["weight_bytes_per_worker"] == [4 * (8 + 4 + 12 + 3)] * 4
    from sparknet.collective import FIELDS

    # the round's bytes count both columns of a worker: each allreduces its 27 values and the rows (float32), or
    # all-gathers its rank's row and its values at 2 bytes each (bf16)
    column = 2 * 1 * (FIELDS * 4 + 2 * 27) if "compression" in options else 2 * 1 * 4 * (27 + 2 * FIELDS)
    assert [h["bytes"] for h in split.history] == [2 * column] * 5


def test_a_split_workers_int8_updates_quantize_the_layers_its_processes_hold_whole_alike(spark, tmp_path):
    # each process's int8 chunks start at every weight it holds, so the error it feeds back into its next update is
    # the same on both processes of a worker for ip2's bias, which both hold whole; chunked as one run, each
    # process's scales would take in its own half of ip1 and ip2, and the whole bias would drift apart between them
    from sparknet.checkpoint import CheckpointManager

    result = _replica_fit(spark, True, rounds=3, compression="int8", checkpoint_dir=str(tmp_path), checkpoint_every=1)
    states = CheckpointManager(str(tmp_path)).load(3).state["workers"]
    residual = {rank: torch.as_tensor(states[rank]["extra"]["residual"]) for rank in range(4)}
    for first, second in ((0, 1), (2, 3)):  # the two processes of each worker
        assert torch.equal(residual[first][-3:], residual[second][-3:])  # ip2's bias, whole on both
        assert not torch.equal(residual[first][:-3], residual[second][:-3])  # their own parts
    # each column all-gathers its rank's row and its 27 values in int8, with a scale for each of its 4 weights
    assert [h["bytes"] for h in result.history] == [2 * 2 * 1 * (FIELDS * 4 + 27 + 4 * 4)] * 3
    assert result.history[-1]["loss"] < result.history[0]["loss"]


@pytest.mark.parametrize("options", [{"fragments": 2}, {"overlap": True, "fragments": 3}])
def test_a_split_worker_streams_its_own_part_a_fragment_at_a_time(spark, options):
    # every process of a worker holds its parts in the same shapes, so the fragments of its flat weights fall on the
    # same layers in every column: the whole layers both processes hold move in the same round on both
    split = _replica_fit(spark, True, **options)
    F = options["fragments"]
    records = [h for h in split.history if h.get("event") == "round"]
    late = [None] if options.get("overlap") else []
    assert [h.get("fragment") for h in records] == (late + [i % F for i in range(4)])[:4] + [None]
    whole_round = _replica_fit(spark, True, rounds=1).history[0]["bytes"]
    assert all(h["bytes"] < whole_round for h in records[:4] if h.get("fragment") is not None)
    losses = [h["loss"] for h in records if h["loss"] == h["loss"]]  # overlapped, the first round's sums come late
    assert len(losses) >= 4 and losses[-1] < losses[0]


def test_a_split_sequence_model_trains_as_the_whole_one_does(spark):
    # paper 001's character model split: the LSTM whole on both processes of a worker, the output layer split by
    # vocabulary (a lone column layer: its output gathered), a label per position
    from sparknet import zoo
    from sparknet.datasets import synthetic_sequences

    data = synthetic_sequences(64, seq_len=12, vocab_size=8, seed=3)
    parts = [(data.x[i * 16:(i + 1) * 16], data.y[i * 16:(i + 1) * 16]) for i in range(4)]
    net = zoo.char_lstm(vocab_size=8, seq_len=12, hidden=16, num_layers=1, batch_size=16)

    def fit(split):
        shape = dict(workers=4, model_parallel=2, parallel_plan="logits=column") if split else dict(
            workers=2, procs_per_worker=2)
        config = DistributedConfig(engine="barrier", strategy="diloco", tau=3, rounds=3, **shape)
        worker = WorkerConfig(solver=SolverConfig(base_lr=0.1, momentum=0.9), batch_size=32 if split else 16, seed=5)
        rows = [list(zip(x, y)) for x, y in parts]  # partition i holds parts[i], in order
        return SparkTrainer(net, worker, dist=config, spark=spark).fit(
            spark.sparkContext.parallelize(rows, len(rows)).flatMap(lambda r: r))

    split, whole = fit(True), fit(False)
    ws, ww = (r.weights.to_flat(torch.float32) for r in (split, whole))
    assert torch.allclose(ws, ww, atol=1e-5, rtol=1e-4), float((ws - ww).abs().max())
    assert split.summary["plan"] == {"logits": "column"}
    assert split.history[-1]["loss"] < split.history[0]["loss"]


def test_a_split_convolution_feeds_a_row_split_layer_as_the_whole_net_does(spark):
    # LeNet with its second convolution split by output channels and ip1 by the flattened features those channels
    # give (nothing is communicated between them): a 4-d weight cut along its first dimension, a weight along its second
    from sparknet import zoo

    rng = np.random.default_rng(4)
    x = rng.normal(size=(64, 784)).astype(np.float32)
    y = (x[:, :392].sum(1) > x[:, 392:].sum(1)).astype(np.int64)
    parts = [(x[i * 16:(i + 1) * 16], y[i * 16:(i + 1) * 16]) for i in range(4)]

    def fit(split):
        shape = dict(workers=4, model_parallel=2, parallel_plan="conv2=column,ip1=row") if split else dict(
            workers=2, procs_per_worker=2)
        config = DistributedConfig(engine="barrier", strategy="average", tau=2, rounds=2, **shape)
        worker = WorkerConfig(solver=SolverConfig(base_lr=0.01, momentum=0.9), batch_size=32 if split else 16, seed=5)
        return SparkTrainer(zoo.lenet(batch_size=16), worker, dist=config, spark=spark).fit(
            partitioned_rdd(spark.sparkContext, parts))

    split, whole = fit(True), fit(False)
    ws, ww = (r.weights.to_flat(torch.float32) for r in (split, whole))
    assert torch.allclose(ws, ww, atol=1e-5, rtol=1e-4), float((ws - ww).abs().max())
    s = split.summary
    assert s["plan"] == {"conv2": "column", "ip1": "row"}
    # conv2 (50 x 20 x 5 x 5 + 50) and ip1's weight (500 x 800) halve; the rest is whole on both
    halved = 50 * 20 * 25 + 50 + 500 * 800
    assert s["weight_bytes_per_worker"] == [4 * (ws.numel() - halved // 2)] * 4


def test_a_split_regression_net_trains_as_the_whole_one_does(spark):
    from _spark_testlib import regression_table
    from sparknet.layers import EuclideanLoss

    x, y = regression_table(64, seed=2)
    parts = [(x[i * 16:(i + 1) * 16], y[i * 16:(i + 1) * 16]) for i in range(4)]
    net = NetParams(RDDLayer("data", shape=[16, 6]), RDDLayer("label", shape=[16, 1]),
                    LinearLayer("ip1", ["data"], num_outputs=8), ActivationLayer("relu1", ["ip1"], tops=["ip1"]),
                    LinearLayer("ip2", ["ip1"], num_outputs=1), EuclideanLoss("loss", ["ip2", "label"]), name="reg")

    def fit(split):
        shape = dict(workers=4, model_parallel=2) if split else dict(workers=2, procs_per_worker=2)
        config = DistributedConfig(engine="barrier", strategy="average", tau=3, rounds=3, **shape)
        worker = WorkerConfig(solver=SolverConfig(base_lr=0.05, momentum=0.9), batch_size=32 if split else 16, seed=5)
        return SparkTrainer(net, worker, dist=config, spark=spark).fit(partitioned_rdd(spark.sparkContext, parts))

    split, whole = fit(True), fit(False)
    ws, ww = (r.weights.to_flat(torch.float32) for r in (split, whole))
    assert torch.allclose(ws, ww, atol=1e-5, rtol=1e-4), float((ws - ww).abs().max())
    assert split.summary["plan"] == {"ip1": "column", "ip2": "row"}
    assert split.history[-1]["loss"] < split.history[0]["loss"]


def test_a_split_fit_warms_up_on_the_driver_and_stops_on_an_epoch_budget(spark):
    result = _replica_fit(spark, True, rounds=None, strategy="average", warmup_steps=4, epochs=3.0, data_mode="memory")
    s = result.summary
    assert s["warmup"]["steps"] == 4 and result.history[-1]["stop_reason"] == "epochs"
    assert s["data_mode"] == "memory" and "split copy's 2 partitions" in s["data_mode_reason"]
    # a step of a split worker is one batch of its 16 rows: three passes over the 32 rows take 3 steps a worker
    assert s["samples"] >= 3 * 32 and s["total_steps"] == 3 * len(result.history)


def test_a_split_worker_streams_its_partitions_as_the_whole_replica_does(spark):
    # each process of a split copy streams its own partition and takes half of every batch from it, the halves
    # joined: the mean gradient of two whole processes that each stream their partition with half the batch
    # (24 rows a partition, 8 a share: the shuffled order within each of the 5 epochs matters)
    split, whole = (_replica_fit(spark, flag, strategy="average", data_mode="stream", parts=_quarters(96))
                    for flag in (True, False))
    ws, ww = (r.weights.to_flat(torch.float32) for r in (split, whole))
    assert torch.allclose(ws, ww, atol=1e-5, rtol=1e-4), float((ws - ww).abs().max())
    memory = _replica_fit(spark, True, strategy="average", data_mode="memory", parts=_quarters(96))
    assert not torch.allclose(ws, memory.weights.to_flat(torch.float32), atol=1e-4)  # another order of batches
    assert [r.summary["data_mode"] for r in (split, whole)] == ["stream", "stream"]


@pytest.mark.parametrize("stream", [{"fragments": 2}, {"overlap": True},
                                    {"data_mode": "stream", "parts": _quarters(96)}, {"weight_ema": 0.5}])
def test_a_resumed_split_fit_repeats_the_uninterrupted_one_bitwise(spark, tmp_path, stream):
    import shutil

    from sparknet.checkpoint import CheckpointManager

    ckpt = tmp_path / "ckpt"
    whole = _replica_fit(spark, True, checkpoint_dir=str(ckpt), checkpoint_every=1, checkpoint_keep=5, **stream)
    saved = CheckpointManager(str(ckpt)).load(2)  # the whole weights, the parts joined: one process loads them
    assert saved.weights.to_flat().numel() == 51
    for r in (3, 4, 5):  # as if the run had stopped after round 2
        shutil.rmtree(ckpt / f"ckpt-{r:08d}")
    resumed = _replica_fit(spark, True, checkpoint_dir=str(ckpt), checkpoint_every=2, resume=True, **stream)
    assert resumed.summary["resumed_from"] == 2 and [h["round"] for h in resumed.history] == [3, 4, 5]
    # DiLoCo's outer momentum, each process's part of its own momentum and of its streamed weights (or of the moving
    # average of the weights) survived the stop
    assert torch.equal(resumed.weights.to_flat(torch.float32), whole.weights.to_flat(torch.float32))


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
    (["--workers", "2", "--model-parallel", "2", "--auto-tau"], "fixed --tau"),
    (["--workers", "2", "--max-weight-bytes", "4e5"], "with --model-parallel 2 each rank would hold"),
    (["--workers", "2", "--parallel-plan", "ip1=column"], "--parallel-plan needs --model-parallel M with M > 1"),
    (["--workers", "2", "--model-parallel", "2", "--device", "auto"], "use device cpu"),
])
def test_what_cannot_run_is_refused_clearly(spark, tmp_path, caplog, extra, message):
    data = _parquet(tmp_path / "blobs.parquet", n=40)
    argv = ["train", "--model", "mlp", "--data", data, "--tau", "2", "--rounds", "1", "--quiet", "--engine", "barrier"]
    with caplog.at_level(logging.ERROR, logger="sparknet"):
        code = main(argv + extra)
    assert code == 2
    assert message in caplog.text


@pytest.mark.parametrize("shape", [{"workers": 4, "model_parallel": 2},
                                   {"workers": 2, "procs_per_worker": 2, "shard_replica": True}])
def test_a_replica_cut_over_its_processes_stops_early_returns_its_best_weights_and_resumes(spark, tmp_path, shape):
    # no evaluation betters the first by 10: round 1's weights (joined from their parts on the driver) are returned
    def fit(rounds, **extra):
        config = DistributedConfig(engine="barrier", strategy="diloco", tau=3, rounds=rounds, eval_budget=1.0,
                                   **shape, **extra)
        worker = WorkerConfig(solver=SolverConfig(base_lr=0.1, momentum=0.9), batch_size=8, seed=5)
        return SparkTrainer(_dsl_mlp(), worker, dist=config, spark=spark).fit(
            partitioned_rdd(spark.sparkContext, _quarters()), validation=blobs(100, seed=9))

    stopped = fit(8, patience=3, min_delta=10.0)
    assert [h["round"] for h in stopped.history] == [1, 2, 3, 4]
    assert stopped.summary["best_round"] == 1 and stopped.summary["returned_weights"] == "best"
    first = fit(1)
    assert torch.allclose(stopped.weights.to_flat(torch.float32), first.weights.to_flat(torch.float32), atol=1e-6)
    assert stopped.summary["test_loss"] == pytest.approx(first.summary["test_loss"], rel=1e-5)
    ckpt = str(tmp_path / "ckpt")
    fit(2, patience=3, min_delta=10.0, checkpoint_dir=ckpt, checkpoint_every=1)
    resumed = fit(8, patience=3, min_delta=10.0, checkpoint_dir=ckpt, resume=True)  # the count goes on from round 2
    assert [h["round"] for h in resumed.history] == [3, 4] and resumed.summary["best_round"] == 1
    assert torch.equal(resumed.weights.to_flat(torch.float32), stopped.weights.to_flat(torch.float32))
