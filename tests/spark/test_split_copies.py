"""Workers whose processes both split the layers and average gradients (``--procs-per-worker G --model-parallel
M``, local[8]): K = 2 workers of G = 4 processes, each two copies of the net split in two. A worker trains as one
of two whole-replica processes fed its copies' rows, the exchange runs copy by copy and part by part, a stopped or
failed fit continues exactly, and ``sparknet train`` runs the shape end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from _spark_testlib import blobs, module_session, partitioned_rdd
from sparknet.cli import main
from sparknet.collective import FIELDS
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer

pytestmark = pytest.mark.spark

SOLVER = SolverConfig(base_lr=0.1, momentum=0.9)


spark = module_session("local[8]")


def _mlp():
    from sparknet import zoo

    return zoo.mlp(input_shape=[2], hidden=[8], num_classes=3)  # ip1 (2 -> 8) column, ip2 (8 -> 3) row


def _eighths(n: int = 64, seed: int = 1):
    x, y = blobs(n, seed=seed)
    q = n // 8
    return [(x[i * q:(i + 1) * q], y[i * q:(i + 1) * q]) for i in range(8)], (x, y)


def _pairs(parts):
    """Partitions 2i and 2i + 1 as one: the rows a split copy's two processes share, in their order."""
    return [(np.concatenate([parts[i][0], parts[i + 1][0]]), np.concatenate([parts[i][1], parts[i + 1][1]]))
            for i in range(0, len(parts), 2)]


def _fit(spark, parts, copies_split: bool, rounds: int = 3, validation=None, **options):
    """K = 2 workers, DiLoCo, tau 3, batch 16: four processes each, two copies of the net split in two (on eight
    partitions), or two processes each, the replica whole on each (on the same rows as four partitions, a copy's two
    partitions as one); each copy draws its batches as the whole process with its index does."""
    shape = dict(procs_per_worker=4, model_parallel=2) if copies_split else dict(procs_per_worker=2)
    config = DistributedConfig(engine="barrier", workers=2, strategy=options.pop("strategy", "diloco"), tau=3,
                               rounds=rounds, **shape, **options)
    worker = WorkerConfig(solver=SOLVER, batch_size=16, seed=5)
    rows = parts if copies_split else _pairs(parts)
    return SparkTrainer(_mlp(), worker, dist=config, spark=spark).fit(partitioned_rdd(spark.sparkContext, rows),
                                                                      validation=validation)


@pytest.mark.parametrize("options", [{}, {"strategy": "easgd"}, {"overlap": True}, {"compression": "bf16"}])
def test_a_worker_of_split_copies_trains_as_a_worker_of_whole_replicas(spark, options):
    # the two copies of a worker average their gradients every step, each copy's parts in its two processes; between
    # the workers each process exchanges its part of the copy's piece with the process of the other worker in its
    # place: DiLoCo's outer step, EASGD's pull (each keeps its own part between rounds), a round late, bf16 updates
    parts, validation = _eighths()
    split, whole = (_fit(spark, parts, flag, validation=validation, **options) for flag in (True, False))
    ws, ww = (r.weights.to_flat(torch.float32) for r in (split, whole))
    assert torch.allclose(ws, ww, atol=1e-5, rtol=1e-4), float((ws - ww).abs().max())
    from sparknet.net import Net

    assert not torch.allclose(ws, Net(_mlp()).get_flat(), atol=1e-3)
    s = split.summary
    assert (s["workers"], s["procs_per_worker"], s["data_parallel"], s["model_parallel"]) == (2, 4, 4, 2)
    assert [(w["worker"], w["proc"], w["copy"]) for w in s["barrier_workers"]] == [
        (k, 2 * c + j, c) for k in (0, 1) for c in (0, 1) for j in (0, 1)]
    # ip1's weight and bias and ip2's weight halve; ip2's bias is whole on both parts
    assert s["weight_bytes_per_worker"] == [4 * (8 + 4 + 12 + 3)] * 8
    # every step the copies allreduce their 27 gradients; each round a worker's four processes exchange a piece each:
    # half of their part and of the rows (27 values and 2 x FIELDS, padded to whole pieces), as float32 over the two
    # workers' ring, or their rank's row and their bf16 values gathered
    inner = [h["inner_allreduce_bytes"] for h in split.history if "inner_allreduce_bytes" in h]  # overlapped: the
    assert inner == [3 * 4 * 27] * (2 if "overlap" in options else 3)  # first round's record comes with the second's
    piece = -(-(FIELDS * 4 + 2 * 27) // 2) if "compression" in options else 4 * -(-(27 + 2 * FIELDS) // 2)
    column = 2 * 1 * piece
    assert [h["bytes"] for h in split.history] == [4 * column] * 3
    assert split.history[-1]["val_accuracy"] == pytest.approx(whole.history[-1]["val_accuracy"], abs=1e-6)


def test_split_copies_stream_their_partitions_as_whole_processes_do(spark):
    # each process of a copy streams its own partition (24 rows) and gives the copy's batch of 16 its 8 rows: the mean
    # gradient of a worker's four whole processes that each stream their partition with batch 8
    parts, _ = _eighths(192)

    def fit(copies_split):
        shape = dict(procs_per_worker=4, model_parallel=2) if copies_split else dict(procs_per_worker=4)
        config = DistributedConfig(engine="barrier", workers=2, strategy="diloco", tau=3, rounds=3, data_mode="stream",
                                   **shape)
        worker = WorkerConfig(solver=SOLVER, batch_size=16 if copies_split else 8, seed=5)
        return SparkTrainer(_mlp(), worker, dist=config, spark=spark).fit(partitioned_rdd(spark.sparkContext, parts))

    split, whole = fit(True), fit(False)
    ws, ww = (r.weights.to_flat(torch.float32) for r in (split, whole))
    assert torch.allclose(ws, ww, atol=1e-5, rtol=1e-4), float((ws - ww).abs().max())
    assert split.summary["data_mode"] == "stream" and split.summary["model_parallel"] == 2


def test_a_sharded_split_worker_clips_its_gradients_by_the_whole_models_norm(spark):
    parts, _ = _eighths()
    clipped = SolverConfig(base_lr=0.1, momentum=0.9, clip_gradients=0.05)  # below the gradients' norm: it clips
    results = []
    for flag, extra in ((True, {"shard_replica": True}), (True, {}), (False, {})):
        config = DistributedConfig(engine="barrier", workers=2, strategy="average", tau=3, rounds=2,
                                   **(dict(procs_per_worker=4, model_parallel=2) if flag else dict(procs_per_worker=2)),
                                   **extra)
        results.append(SparkTrainer(_mlp(), WorkerConfig(solver=clipped, batch_size=16, seed=5), dist=config,
                                    spark=spark).fit(partitioned_rdd(spark.sparkContext, parts if flag else
                                                                     _pairs(parts))).weights.to_flat(torch.float32))
    for got in results[:2]:
        assert torch.allclose(got, results[2], atol=1e-5, rtol=1e-4), float((got - results[2]).abs().max())
    unclipped = _fit(spark, parts, False, rounds=2, strategy="average").weights.to_flat(torch.float32)
    assert not torch.allclose(unclipped, results[2], atol=1e-3)


@pytest.mark.parametrize("options", [{}, {"overlap": True}, {"fragments": 2}])
def test_a_worker_of_split_copies_sharded_over_the_copies_trains_as_a_worker_of_whole_replicas(spark, options):
    # --shard-replica beside --model-parallel: each copy's parts sharded again over the worker's two copies (FSDP2 over
    # tensor parallelism on the worker's 2 x 2 mesh), its gradients averaged as FSDP2 reduce-scatters them; the
    # exchange runs part by part, whole, a round late, or a fragment of the whole weights at a time
    parts, validation = _eighths()
    sharded = _fit(spark, parts, True, validation=validation, shard_replica=True, **options)
    whole = _fit(spark, parts, False, validation=validation, **options)
    ws, ww = (r.weights.to_flat(torch.float32) for r in (sharded, whole))
    assert torch.allclose(ws, ww, atol=1e-5, rtol=1e-4), float((ws - ww).abs().max())
    s = sharded.summary
    assert s["shard_replica"] and (s["procs_per_worker"], s["model_parallel"]) == (4, 2)
    # a copy's part of ip1 (4 x 2 and 4), ip2 (3 x 4) and ip2's bias (3, whole in the copy) cut by rows again: the
    # first copy's process holds 2 + 2 + 2 + 2 rows of them, the second's 2 + 2 + 1 + 1
    held = [4 * (4 + 2 + 8 + 2)] * 2 + [4 * (4 + 2 + 4 + 1)] * 2
    assert s["weight_bytes_per_rank"] == held * 2 and s["weight_bytes_per_worker"] == held * 2
    from sparknet.parallel import weight_bytes_per_rank

    plan = s["plan"]  # the default plan: ip1 by columns, ip2 by rows
    assert weight_bytes_per_rank(_mlp(), 2, plan, shard=2) == held[0]  # what a budget is checked against, first
    if not options:  # each process allreduces its own part and the rows with its place in the other worker
        assert [h["bytes"] for h in sharded.history] == [2 * 1 * 4 * (16 + 16 + 11 + 11 + 4 * 2 * FIELDS)] * 3
    assert sharded.history[-1]["val_accuracy"] == pytest.approx(whole.history[-1]["val_accuracy"], abs=1e-6)


def test_sharded_split_copies_send_int8_updates_each_part_in_its_own_chunks(spark):
    # each process of a column chunks its own boxes of the weights: the first copy's 16 values and the second's 11,
    # in 4 weights each, a scale a weight
    parts, validation = _eighths()
    result = _fit(spark, parts, True, validation=validation, shard_replica=True, compression="int8")
    column = {values: 2 * 1 * (FIELDS * 4 + values + 4 * 4) for values in (16, 11)}
    assert [h["bytes"] for h in result.history] == [2 * column[16] + 2 * column[11]] * 3
    assert result.history[-1]["loss"] < result.history[0]["loss"] and result.summary["test_accuracy"] > 0.9


@pytest.mark.parametrize("shard", [False, True])
def test_a_stopped_fit_resumes_and_a_failed_stage_restarts_as_the_uninterrupted_fit(spark, tmp_path, shard):
    from sparknet.checkpoint import CheckpointError, CheckpointManager

    parts, _ = _eighths(96, seed=6)
    whole = _fit(spark, parts, True, rounds=4, shard_replica=shard)
    ckpt = str(tmp_path / "ckpt")
    first = _fit(spark, parts, True, rounds=2, checkpoint_dir=ckpt, checkpoint_every=1, shard_replica=shard)
    # the checkpoint holds the whole weights, joined from the first copy's two parts
    saved = CheckpointManager(ckpt).load()
    assert torch.equal(saved.weights.to_flat(torch.float32), first.weights.to_flat(torch.float32))
    resumed = _fit(spark, parts, True, rounds=4, checkpoint_dir=ckpt, resume=True, shard_replica=shard)
    assert resumed.summary["resumed_from"] == 2 and [h["round"] for h in resumed.history] == [3, 4]
    # each process's momentum (its part, its copy's) and DiLoCo's outer momentum (by part) survived the stop
    assert torch.equal(resumed.weights.to_flat(torch.float32), whole.weights.to_flat(torch.float32))
    with pytest.raises(CheckpointError, match=f"2 workers of 4 processes{', sharded' if shard else ''}, split in 2"):
        _fit(spark, parts, False, rounds=4, checkpoint_dir=ckpt, resume=True)
    from sparknet.spark import EngineOptions

    config = DistributedConfig(engine="barrier", workers=2, procs_per_worker=4, model_parallel=2, strategy="diloco",
                               tau=3, rounds=4, checkpoint_dir=str(tmp_path / "hurt"), checkpoint_every=1,
                               shard_replica=shard)
    # rank 6 (the second copy of the second worker) fails after round 2's steps, on the first attempt
    hurt = SparkTrainer(_mlp(), WorkerConfig(solver=SOLVER, batch_size=16, seed=5), dist=config, spark=spark,
                        options=EngineOptions(fault="rank=6,round=2,kind=raise")).fit(
        partitioned_rdd(spark.sparkContext, parts))
    assert hurt.summary["restarts"] == 1 and [h["round"] for h in hurt.history] == [1, 2, 3, 4]
    assert torch.equal(hurt.weights.to_flat(torch.float32), whole.weights.to_flat(torch.float32))


def test_sparknet_train_runs_workers_of_split_copies_end_to_end(spark, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sparknet.model_io import load_model

    x, y = blobs(600, seed=3)  # the last tenth is held out as the test set
    data = tmp_path / "blobs.parquet"
    offsets = pa.array(np.arange(0, (len(x) + 1) * 2, 2, dtype=np.int32))
    pq.write_table(pa.table({"features": pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1))),
                             "label": pa.array(y)}), data)
    metrics, model = tmp_path / "run.jsonl", tmp_path / "model"
    code = main(["train", "--model", "mlp", "--data", str(data), "--workers", "2", "--procs-per-worker", "4",
                 "--model-parallel", "2", "--engine", "barrier", "--tau", "10", "--rounds", "3", "--batch-size",
                 "16", "--lr", "0.05", "--metrics-out", str(metrics), "--model-dir", str(model), "--quiet"])
    assert code == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    summary = records[-1]
    assert summary["event"] == "summary" and summary["plan"] == {"ip1": "column", "ip2": "row"}
    assert (summary["workers"], summary["procs_per_worker"], summary["data_parallel"]) == (2, 4, 4)
    assert summary["test_accuracy"] > 0.8
    saved = load_model(model)  # an ordinary model folder holding the whole (gathered) net
    scored = saved.net.evaluate((x[-60:], y[-60:])).accuracy
    assert scored == pytest.approx(summary["test_accuracy"], abs=1e-6)
