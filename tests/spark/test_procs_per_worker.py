"""Workers of several processes on local[4]: K = 2 workers of G = 2 barrier tasks each.

A worker's ranks average their gradients every step, so it trains as one process with G times the batch; the
strategy runs every tau steps between the workers. The checks compare a K = 2, G = 2 fit with a K = 2, G = 1 fit
whose partitions are the union of each worker's two: with every partition one minibatch, both see the same
gradients, and the global weights agree to float tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _spark_testlib import blobs, mlp, module_session, partitioned_rdd
from sparknet.collective import FIELDS
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer
from sparknet.spark.barrier.executor import worker_order
from sparknet.strategies import make_compressor

pytestmark = pytest.mark.spark

SOLVER = SolverConfig(base_lr=0.1, momentum=0.9, weight_decay=0.0)


spark = module_session("local[4]")


def _quarters(n: int = 32, seed: int = 1):
    x, y = blobs(n, seed=seed)
    q = n // 4
    return [(x[i * q:(i + 1) * q], y[i * q:(i + 1) * q]) for i in range(4)]


def _fit(spark, parts, *, procs: int, batch: int, strategy: str = "average", rounds: int = 2, validation=None,
         **dist):
    config = DistributedConfig(workers=2, procs_per_worker=procs, engine="barrier", strategy=strategy, tau=3,
                               rounds=rounds, **dist)
    return SparkTrainer(mlp(), WorkerConfig(solver=SOLVER, batch_size=batch, seed=5), dist=config).fit(
        partitioned_rdd(spark.sparkContext, parts), validation)


@pytest.mark.parametrize("strategy, compression", [("average", "none"), ("diloco", "none"), ("easgd", "none"),
                                                   ("average", "int8")])
def test_a_worker_of_two_processes_is_one_process_with_twice_the_batch(spark, strategy, compression):
    parts = _quarters()
    pairs = [tuple(np.concatenate(a) for a in zip(*parts[i:i + 2])) for i in (0, 2)]
    two = _fit(spark, parts, procs=2, batch=8, strategy=strategy, compression=compression)
    one = _fit(spark, pairs, procs=1, batch=16, strategy=strategy, compression=compression)
    w2, w1 = (r.weights.to_flat(torch.float32) for r in (two, one))
    assert torch.allclose(w2, w1, atol=1e-5, rtol=1e-4), float((w2 - w1).abs().max())
    assert not torch.allclose(w2, Net(mlp()).get_flat(), atol=1e-3)  # it trained
    last2, last1 = two.history[-1], one.history[-1]
    # the worker's counts pool its two ranks: 3 steps of 2 x 8 rows per worker, as one rank of 16 rows
    assert [w["samples"] for w in last2["per_worker"]] == [w["samples"] for w in last1["per_worker"]] == [48, 48]
    assert last2["samples"] == last1["samples"] == 96
    assert last2["loss"] == pytest.approx(last1["loss"], rel=1e-4)
    # every step's gradients met inside the worker: 3 allreduces of the mlp's 51 float32 gradients a round
    assert last2["inner_allreduce_bytes"] == 3 * 51 * 4 and "inner_allreduce_bytes" not in last1
    # between the workers each of a worker's two columns carries half of what one process sends (its piece of the
    # 51 values and two rows of 7, or of one int8 message, padded to an even size), and the worker's ranks trade
    # their pieces: the network between hosts carries the round's exchange once, not once a process
    if compression == "none":
        sent, piece = 4 * (51 + 2 * FIELDS), 4 * -(-(51 + 2 * FIELDS) // 2)
    else:
        message = FIELDS * 4 + make_compressor("int8").wire_nbytes(51)
        sent, piece = message, -(-message // 2)
    # K = 2: a ring allreduce moves 2(K - 1) times its buffer, a ring all-gather K(K - 1) times its message; a
    # round's bytes count every column: the worker's two send what one process sends, but for the padding
    assert last1["bytes"] == 2 * sent and last2["bytes"] == 2 * 2 * piece
    # G = 2 ranks trade a piece (float32), or a piece of each worker's message (int8)
    assert last2["inner_gather_bytes"] == 2 * piece * (1 if compression == "none" else 2)
    assert "inner_gather_bytes" not in last1


def test_the_summary_says_which_ranks_make_each_worker_and_evaluation_covers_every_row(spark):
    parts = _quarters()
    vx, vy = blobs(60, seed=9)
    result = _fit(spark, parts, procs=2, batch=8, validation=(vx, vy), rounds=3)
    s = result.summary
    assert s["workers"] == 2 and s["procs_per_worker"] == 2
    ranks = s["barrier_workers"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    # local mode: one host, so worker w is tasks 2w and 2w + 1 in task order
    assert [(r["worker"], r["proc"], r["group_rank"]) for r in ranks] == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    # the four ranks score a quarter of the validation rows each and agree on the sums: the driver's own
    # evaluation of the final weights gives the same accuracy and loss
    last = result.history[-1]
    driver = result.net.evaluate((vx, vy))
    assert last["val_accuracy"] == pytest.approx(driver.accuracy)
    assert last["val_loss"] == pytest.approx(driver.loss, rel=1e-5)


def test_more_ranks_than_task_slots_is_refused_naming_the_shape(spark):
    shape = r"2 workers of 4 processes\) runs all 8 workers at once but local\[4\] has 4 task slots"
    with pytest.raises(ValueError, match=shape):
        _fit(spark, _quarters(), procs=4, batch=8)


def test_a_worker_of_several_processes_needs_rows_in_every_partition(spark):
    parts = _quarters()
    parts[3] = (parts[3][0][:0], parts[3][1][:0])
    with pytest.raises(ValueError, match=r"several processes \(its 2 processes step together\) needs data in every "):
        _fit(spark, parts, procs=2, batch=8)


def test_worker_order_keeps_a_workers_ranks_on_one_host():
    assert worker_order(["b", "a", "b", "a"], 1) == [0, 1, 2, 3]  # one process a worker: the tasks' own order
    order = worker_order(["b", "a", "b", "a"], 2)
    assert order == [1, 3, 0, 2]
    hosts = ["b", "a", "b", "a"]
    assert [{hosts[order[r]] for r in (2 * w, 2 * w + 1)} for w in (0, 1)] == [{"a"}, {"b"}]


@pytest.mark.parametrize("options, message", [
    ({"engine": "rounds"}, "add --engine barrier"),
    ({"strategy": "sync"}, "train with --workers 4 instead"),
    ({"strategy": "async"}, "choose --strategy average, diloco or easgd"),
    ({"model_parallel": 2, "shard_replica": True}, "a multiple of 2 above it"),
    ({"model_parallel": 4}, "a multiple of --model-parallel 4"),
    ({"round_seconds": 1.0}, "rounds need a fixed tau"),
    ({"auto_tau": True}, "rounds need a fixed tau"),
    ({"shard_replica": True, "procs_per_worker": 1}, "give --procs-per-worker G with G > 1"),
    ({"procs_per_worker": 0}, "at least 1"),
])
def test_what_a_worker_of_several_processes_cannot_do_is_refused(options, message):
    base = {"workers": 2, "procs_per_worker": 2, "engine": "barrier", "tau": 5, "rounds": 1}
    with pytest.raises(ValueError, match=message):
        DistributedConfig(**{**base, **options})


# -- a sharded replica (--shard-replica): FSDP2 over each worker's ranks, the exchange shard by shard ---------------

def _dsl_mlp(hidden=(8,)):
    from sparknet import zoo

    return zoo.mlp(input_shape=[2], hidden=list(hidden), num_classes=3)


def _replica_fit(spark, net, shard: bool, rounds: int = 2, strategy: str = "diloco", **options):
    """K = 2 workers of G = 2 processes (DiLoCo, tau 3), the replica sharded over its processes or whole."""
    config = DistributedConfig(workers=2, procs_per_worker=2, shard_replica=shard, engine="barrier",
                               strategy=strategy, tau=3, rounds=rounds, **options)
    return SparkTrainer(net(), WorkerConfig(solver=SOLVER, batch_size=8, seed=5), dist=config).fit(
        partitioned_rdd(spark.sparkContext, _quarters()))


@pytest.mark.parametrize("kind", ["module", "layers"])
def test_a_sharded_replica_trains_as_the_whole_replica_does(spark, kind):
    net = mlp if kind == "module" else _dsl_mlp
    sharded, whole = _replica_fit(spark, net, True), _replica_fit(spark, net, False)
    ws, ww = (r.weights.to_flat(torch.float32) for r in (sharded, whole))
    assert torch.allclose(ws, ww, atol=1e-5, rtol=1e-4), float((ws - ww).abs().max())
    assert not torch.allclose(ws, Net(net()).get_flat(), atol=1e-3)
    s = sharded.summary
    assert s["shard_replica"] is True
    # each rank holds a part of the weights and of the momentum, the first part of an odd row count the larger
    total, held = 4 * ws.numel(), s["weight_bytes_per_rank"]
    assert held[0] + held[1] == held[2] + held[3] == total and total / 2 <= held[0] < total, held
    assert sum(s["solver_state_bytes_per_rank"]) == 2 * total


@pytest.mark.parametrize("options", [{"overlap": True, "fragments": 3}, {"fragments": 2}, {"weight_ema": 0.5},
                                     {"strategy": "easgd"}, {"compression": "bf16"}])
def test_a_sharded_replica_exchanges_as_the_whole_replica_does_whatever_the_exchange(spark, options):
    # each rank exchanges its rows of the fragment the whole replica exchanges (the mlp's 51 weights in 3 or 2 parts
    # cut rows and weights in two; the ranks' parts are 30 and 21 values), a round late when overlapped; the moving
    # average is kept part by part and joined on the driver; EASGD's workers keep their own parts between rounds
    sharded, whole = (_replica_fit(spark, mlp, shard, rounds=5, **options) for shard in (True, False))
    ws, ww = (r.weights.to_flat(torch.float32) for r in (sharded, whole))
    assert torch.allclose(ws, ww, atol=1e-5, rtol=1e-4), float((ws - ww).abs().max())
    assert not torch.allclose(ws, Net(mlp()).get_flat(), atol=1e-3)
    rounds = [[h.get("fragment") for h in r.history if h.get("event") == "round"] for r in (sharded, whole)]
    assert rounds[0] == rounds[1] and len(rounds[0]) == 5
    if "fragments" in options:
        late = [None] if options.get("overlap") else []  # overlapped, a record says what arrived in its round
        assert rounds[0] == (late + [i % options["fragments"] for i in range(4)])[:4] + [None], rounds[0]
    assert sharded.summary["shard_replica"] is True
    assert sharded.summary.get("returned_weights") == whole.summary.get("returned_weights")


def test_a_sharded_replicas_int8_exchange_sends_each_part_with_its_own_scales(spark):
    sharded, whole = (_replica_fit(spark, mlp, shard, rounds=3, compression="int8") for shard in (True, False))
    # each column allgathers its part's int8 message (row fields, one scale, a byte a value): 30 and 21 values; a
    # round's bytes count both columns
    parts = [b // 4 for b in sharded.summary["weight_bytes_per_rank"][:2]]
    assert parts == [30, 21]
    both = sum(2 * (FIELDS * 4 + make_compressor("int8").wire_nbytes(part)) for part in parts)
    assert [h["bytes"] for h in sharded.history if h.get("event") == "round"] == [both] * 3
    # a part's own scale rounds its values on another grid than the whole replica's one scale: close, not equal
    ws, ww = (r.weights.to_flat(torch.float32) for r in (sharded, whole))
    assert torch.allclose(ws, ww, atol=1e-2) and not torch.equal(ws, ww)
    assert not torch.allclose(ws, Net(mlp()).get_flat(), atol=1e-1)


def test_a_replica_over_the_weight_budget_trains_only_sharded_and_its_gathered_weights_score_as_reported(spark):
    from sparknet.parallel import WeightBudgetError, weight_bytes_per_rank

    x, y = blobs(64, seed=3)
    parts = [(x[i::4], y[i::4]) for i in range(4)]
    vx, vy = blobs(80, seed=4)
    net = _dsl_mlp((64, 64))
    whole, half = weight_bytes_per_rank(net), weight_bytes_per_rank(net, shard=2)
    budget = (whole + half) // 2  # over one rank's half, under the whole replica

    def fit(shard):
        config = DistributedConfig(workers=2, procs_per_worker=2, shard_replica=shard, engine="barrier", tau=5,
                                   rounds=3, max_weight_bytes=budget)
        return SparkTrainer(net, WorkerConfig(solver=SOLVER, batch_size=8, seed=5), dist=config).fit(
            partitioned_rdd(spark.sparkContext, parts), (vx, vy))

    with pytest.raises(WeightBudgetError, match=r"with --shard-replica each of a worker's 2 processes would hold"):
        fit(False)
    result = fit(True)
    s = result.summary
    assert max(s["weight_bytes_per_rank"]) == half <= budget < whole
    # the workers score the validation rows shard by shard; the driver scores the gathered weights: the same
    last = result.history[-1]
    assert s["test_accuracy"] == pytest.approx(last["val_accuracy"]) and s["test_accuracy"] > 0.6
    driver = result.net.evaluate((vx, vy))
    assert driver.accuracy == pytest.approx(s["test_accuracy"])


# -- checkpoints: every process's solver state, and a sharded replica's parts joined on the driver ----------------

@pytest.mark.parametrize("shard, ema", [(False, None), (True, None), (True, 0.5)])
def test_a_resumed_fit_of_workers_of_several_processes_repeats_the_uninterrupted_one_bitwise(spark, tmp_path, shard,
                                                                                            ema):
    from sparknet.checkpoint import CheckpointError

    x, y = blobs(96, seed=6)
    parts = [(x[i::4], y[i::4]) for i in range(4)]

    def fit(rounds, **dist):
        config = DistributedConfig(workers=2, procs_per_worker=2, shard_replica=shard, engine="barrier",
                                   strategy="diloco", tau=3, rounds=rounds, weight_ema=ema, **dist)
        return SparkTrainer(mlp(), WorkerConfig(solver=SOLVER, batch_size=8, seed=5), dist=config).fit(
            partitioned_rdd(spark.sparkContext, parts))

    whole = fit(5)
    ckpt = str(tmp_path / "ckpt")
    first = fit(2, checkpoint_dir=ckpt, checkpoint_every=1)
    assert first.summary["checkpoints"] == [1, 2]
    # the checkpoint holds the whole weights, one process can load them (a sharded replica's parts joined)
    from sparknet.checkpoint import CheckpointManager

    saved = CheckpointManager(ckpt).load()
    if ema is None:  # the fit returns the moving average, the checkpoint holds the global weights beside it
        assert torch.equal(saved.weights.to_flat(torch.float32), first.weights.to_flat(torch.float32))
    resumed = fit(5, checkpoint_dir=ckpt, checkpoint_every=2, resume=True)
    assert resumed.summary["resumed_from"] == 2 and [h["round"] for h in resumed.history] == [3, 4, 5]
    # the workers' momentum (each process its own, or its part) and DiLoCo's outer momentum survived the stop
    assert torch.equal(resumed.weights.to_flat(torch.float32), whole.weights.to_flat(torch.float32))
    with pytest.raises(CheckpointError, match="2 workers of 2 processes.*resume with --workers 2 --procs-per-worker 2"):
        config = DistributedConfig(workers=2, procs_per_worker=1, engine="barrier", tau=3, rounds=5,
                                   checkpoint_dir=ckpt, resume=True)
        SparkTrainer(mlp(), WorkerConfig(solver=SOLVER, batch_size=8, seed=5), dist=config).fit(
            partitioned_rdd(spark.sparkContext, parts[:2]))


@pytest.mark.parametrize("shard, stream", [(False, {"fragments": 2}), (True, {"fragments": 2}),
                                           (False, {"overlap": True}), (True, {"overlap": True, "fragments": 3})])
def test_a_streamed_fit_resumed_from_a_checkpoint_mid_run_repeats_the_uninterrupted_one_bitwise(spark, tmp_path,
                                                                                               shard, stream):
    import shutil

    # a streamed worker goes on from its own weights: the checkpoint holds them, where its progress counts from and
    # the part whose global weights it takes next round, each rank its own (its part of them when sharded); an
    # overlapped one also the sums of the exchange still in flight when the checkpoint was written, which the next
    # round applies
    ckpt = tmp_path / "ckpt"

    def fit(**dist):
        return _replica_fit(spark, mlp, shard, rounds=5, checkpoint_dir=str(ckpt), **stream, **dist)

    whole = fit(checkpoint_every=1, checkpoint_keep=5)
    for r in (3, 4, 5):  # as if the run had stopped after round 2 (the planned last round exchanges every part)
        shutil.rmtree(ckpt / f"ckpt-{r:08d}")
    resumed = fit(checkpoint_every=2, resume=True)
    assert resumed.summary["resumed_from"] == 2 and [h["round"] for h in resumed.history] == [3, 4, 5]
    assert torch.equal(resumed.weights.to_flat(torch.float32), whole.weights.to_flat(torch.float32))
