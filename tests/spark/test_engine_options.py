"""Compression, automatic tau and the simulated link inside both Spark engines, on local[2,4].

One session for the module (``local[2,4]``: two task slots, a failed task retried, so an
injected kill is survived by the rounds engine). An MLP on three Gaussian blobs, wide enough
(387 weights) that the int8 codec's per-chunk scale and the barrier engine's per-rank record
are small beside the update itself.
"""

from __future__ import annotations

import math

import pytest
import torch

from _spark_testlib import module_session, two_blob_workers
from sparknet.config import DistributedConfig, Streaming, WorkerConfig
from sparknet.link import LinkModel
from sparknet.solvers import SolverConfig
from sparknet.spark import EngineOptions, SparkTrainer
from sparknet.spark.barrier.executor import FIELDS
from sparknet.strategies import Sync

pytestmark = pytest.mark.spark

SOLVER = SolverConfig(base_lr=0.05, momentum=0.9)
HIDDEN = 64
P = 2 * HIDDEN + HIDDEN + HIDDEN * 3 + 3  # weights of _mlp()
INT8 = P + 4 * math.ceil(P / 4096)          # an int8 message: the values, one float32 scale per chunk
WIDTH = {"none": 4, "fp16": 2, "bf16": 2}


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 3))


spark = module_session("local[2,4]")


@pytest.fixture(scope="module")
def data(spark):
    return two_blob_workers(spark.sparkContext)


def _fit(data, engine, *, rounds=6, tau=4, options=None, strategy="average", **dist):
    rdd, val = data
    trainer = SparkTrainer(_mlp(), WorkerConfig(solver=SOLVER, batch_size=8, seed=4),
                           DistributedConfig(workers=2, engine=engine, tau=tau, rounds=rounds, strategy=strategy, **dist),
                           options=options or EngineOptions())
    return trainer.fit(rdd, validation=val)


def _message_bytes(codec: str) -> int:
    return INT8 if codec == "int8" else WIDTH[codec] * P


def _expected_round_bytes(engine: str, codec: str, K: int = 2) -> int:
    if engine == "rounds":  # each worker: the weights (or the downlink message) down, its update up
        return 2 * K * _message_bytes(codec)
    if codec == "none":     # ring allreduce of the deltas and K records of FIELDS float32
        return 2 * (K - 1) * 4 * (P + K * FIELDS)
    return K * (K - 1) * (4 * FIELDS + _message_bytes(codec))  # ring all-gather of one message per rank


@pytest.mark.parametrize("engine", ["rounds", "barrier"])
def test_every_codec_trains_and_its_bytes_are_counted(data, engine):
    results = {codec: _fit(data, engine, compression=codec) for codec in ("none", "fp16", "bf16", "int8")}
    for codec, res in results.items():
        assert res.summary["test_accuracy"] >= 0.95, codec
        assert res.summary["compression"] == codec
        assert [h["bytes"] for h in res.history] == [_expected_round_bytes(engine, codec)] * 6, codec
        assert res.summary["bytes_communicated"] == 6 * _expected_round_bytes(engine, codec)
        assert all(h["compression"] == codec for h in res.history)
    none, int8 = results["none"].summary, results["int8"].summary
    assert int8["bytes_communicated"] <= 0.30 * none["bytes_communicated"]
    # error feedback: int8 lands close to the uncompressed run, not merely somewhere that classifies well
    gap = (results["int8"].weights.to_flat(torch.float32) - results["none"].weights.to_flat(torch.float32)).norm()
    assert gap < 0.05 * results["none"].weights.to_flat(torch.float32).norm()
    if engine == "rounds":
        assert all(w["sent_bytes"] == INT8 for h in results["int8"].history for w in h["per_worker"])


@pytest.mark.parametrize("engine", ["rounds", "barrier"])
def test_resume_with_int8_is_exact(data, tmp_path, engine):
    # the error-feedback residuals (and the rounds engine's downlink copy) must survive the stop
    whole = _fit(data, engine, rounds=5, tau=3, compression="int8", strategy="diloco")
    ckpt = str(tmp_path / "ckpt")
    _fit(data, engine, rounds=2, tau=3, compression="int8", strategy="diloco", checkpoint_dir=ckpt,
         checkpoint_every=1)
    resumed = _fit(data, engine, rounds=5, tau=3, compression="int8", strategy="diloco", checkpoint_dir=ckpt,
                   checkpoint_every=2, resume=True)
    assert resumed.summary["resumed_from"] == 2 and [h["round"] for h in resumed.history] == [3, 4, 5]
    assert torch.equal(resumed.weights.to_flat(torch.float32), whole.weights.to_flat(torch.float32))
    assert resumed.summary["bytes_communicated"] == 3 * _expected_round_bytes(engine, "int8")


def test_a_retried_int8_round_is_applied_once(data):
    clean = _fit(data, "rounds", compression="int8")
    hurt = _fit(data, "rounds", compression="int8", options=EngineOptions(fault="rank=1,round=3,kind=raise"))
    assert hurt.summary["retries"] == 1
    assert torch.equal(hurt.weights.to_flat(torch.float32), clean.weights.to_flat(torch.float32))


@pytest.mark.parametrize("engine", ["rounds", "barrier"])
def test_auto_tau_moves_tau_within_its_bounds_and_logs_it_every_round(data, engine):
    # a 0.2 s link makes synchronization far slower than a step: tau must grow from 2 towards its bound
    res = _fit(data, engine, rounds=6, tau=2, auto_tau=True, auto_tau_every=1, auto_tau_min=2, auto_tau_max=12,
               options=EngineOptions(link=LinkModel(latency_s=0.2)))
    taus = [h["tau"] for h in res.history]
    assert taus[0] == 2 and all(2 <= t <= 12 for t in taus) and len(set(taus)) > 1
    assert all(h["steps"] == h["tau"] for h in res.history)
    for before, after in zip(res.history, res.history[1:]):
        assert after["tau"] == before["next_tau"]  # the tau chosen after a round is the next round's
    if engine == "barrier":  # every rank ran the same tau: they chose it from the same allreduced values
        assert all(w["steps"] == h["tau"] for h in res.history for w in h["per_worker"])
    assert res.summary["auto_tau"] is True and res.summary["final_tau"] == res.history[-1]["next_tau"]


def test_the_link_waits_what_the_model_says(data):
    link = LinkModel(latency_s=0.2, bandwidth_bits_per_s=8e6)  # 1 MB/s
    rounds = _fit(data, "rounds", rounds=2, options=EngineOptions(link=link))
    for h in rounds.history:  # each task: the weights down, its delta up, both P float32
        assert all(w["link_s"] == pytest.approx(2 * link.delay(4 * P)) for w in h["per_worker"])
        assert h["link_s"] == pytest.approx(2 * link.delay(4 * P))  # the tasks wait at once
    assert rounds.summary["link_s"] == pytest.approx(2 * 2 * link.delay(4 * P))

    barrier = _fit(data, "barrier", rounds=2, compression="int8", options=EngineOptions(link=link))
    # + the evaluation's: count, loss, a classifier's four sums and its three counts of each of its 3 classes, float64
    per_round = link.allgather_delay(4 * FIELDS + INT8, 2) + link.allreduce_delay((2 + 4 + 3 * 3) * 8, 2)
    assert [h["link_s"] for h in barrier.history] == pytest.approx([per_round] * 2)

    sync = _fit(data, "barrier", rounds=2, tau=3, strategy="sync", options=EngineOptions(link=LinkModel(0.05)))
    each = LinkModel(0.05).allreduce_delay(0, 2)  # latency-bound: 2 (K-1) hops
    assert [h["link_s"] for h in sync.history] == pytest.approx([3 * each + each + each] * 2)  # steps, round, eval

    free = _fit(data, "rounds", rounds=2, options=EngineOptions(link=LinkModel()))
    assert free.summary["link"] is None and free.summary["link_s"] is None
    assert all("link_s" not in h and "link_s" not in w for h in free.history for w in h["per_worker"])


def test_what_the_engines_still_refuse():
    dist = DistributedConfig(workers=2, engine="barrier", rounds=1, compression="int8")
    with pytest.raises(ValueError, match="allreduces full gradients every step"):
        SparkTrainer(_mlp(), dist=dist, strategy=Sync())
    with pytest.raises(ValueError, match="must be a sparknet.link.LinkModel"):
        EngineOptions(link="50ms")


@pytest.mark.parametrize("name,value", [("elastic_after_s", -1.0), ("elastic_after_s", float("nan")),
                                        ("round_timeout_s", 0.0), ("rendezvous_timeout_s", float("inf"))])
def test_engine_options_refuse_impossible_seconds(name, value):
    with pytest.raises(ValueError, match=f"{name} must be"):
        EngineOptions(**{name: value})
    assert EngineOptions(elastic_after_s=None).elastic_after_s is None  # never: K workers always, in waves


@pytest.mark.parametrize("engine", ["rounds", "barrier"])
def test_rounds_between_full_evaluations_score_a_sample_and_the_last_one_the_whole_set(data, engine):
    rdd, (vx, vy) = data
    rows = len(vy) // 2  # a sample of half the rows: the smallest set a screen is made for
    res = _fit(data, engine, rounds=4, eval_screen_rows=rows, eval_budget=1.0)
    records = [h for h in res.history if h.get("event") == "round"]
    assert ["val_accuracy" in r for r in records] == [False, False, False, True]
    assert all(r["screen_rows"] == rows and 0 <= r["screen_accuracy"] <= 1 for r in records)
    assert records[-1]["val_accuracy"] == res.summary["test_accuracy"]
    # the sample is scored at the rounds in between; the whole set at the end, as without screens
    whole = _fit(data, engine, rounds=4, eval_screen_rows=0, eval_budget=1.0)
    assert all("val_accuracy" in r and "screen_accuracy" not in r for r in whole.history if r.get("event") == "round")
    assert torch.equal(res.weights.to_flat(), whole.weights.to_flat())


@pytest.mark.parametrize("engine", ["rounds", "barrier"])
def test_an_evaluation_budget_puts_evaluations_off_and_the_ranks_agree(data, engine):
    # a budget of 0.1% of the wall time: after the first evaluation the next due one is put off to the
    # last round (in the barrier engine every rank decides from its own clock and they agree, or it would hang)
    res = _fit(data, engine, rounds=6, eval_screen_rows=0, eval_budget=0.001)
    evaluated = [r["round"] for r in res.history if r.get("event") == "round" and "val_accuracy" in r]
    assert evaluated[0] == 1 and evaluated[-1] == 6 and len(evaluated) < 6, evaluated
    every = _fit(data, engine, rounds=6, eval_screen_rows=0, eval_budget=1.0)
    assert torch.equal(res.weights.to_flat(), every.weights.to_flat())  # evaluation never moves the weights


def test_an_overlapped_streamed_barrier_fit_trains_and_moves_one_fragment_a_round(data):
    link = LinkModel(latency_s=0.01)
    res = _fit(data, "barrier", rounds=6, overlap=True, fragments=3, options=EngineOptions(link=link))
    assert res.summary["test_accuracy"] >= 0.95
    # round 1 waits only for its evaluation's allreduce; a later round for what is left of the previous exchange's
    # delay once its own steps are done (nothing when they took longer), and its evaluation's when it has one
    each = link.allreduce_delay(0, 2)  # latency-bound: 2 (K-1) hops, whatever the bytes
    assert res.history[0]["link_s"] == pytest.approx(each)
    assert all(0 <= h["link_s"] <= 2 * each + 0.005 for h in res.history), [h["link_s"] for h in res.history]
    parts = [Streaming(fragments=3).part(r, P) for r in range(5)]
    # what each round sends: its fragment (the last round: all that is left) and the ranks' rows, ring-allreduced
    assert [h["bytes"] for h in res.history] == ([2 * 4 * (p.stop - p.start + 2 * FIELDS) for p in parts]
                                                 + [2 * 4 * (P + 2 * FIELDS)])
    # the fragment whose average each round applied: none in round 1 (round 1's travels behind round 2)
    assert [h.get("fragment") for h in res.history] == [None, 0, 1, 2, 0, None]
    assert [h["steps"] for h in res.history] == [4] * 6 and res.summary["total_steps"] == 24
    with pytest.raises(ValueError, match="average or diloco"):
        SparkTrainer(_mlp(), dist=DistributedConfig(workers=2, engine="barrier", rounds=1, overlap=True),
                     strategy=Sync())


@pytest.mark.parametrize("engine, names", [("rounds", ["worker-0", "worker-1"]), ("barrier", ["rank-0", "rank-1"])])
def test_profile_traces_one_round_of_every_worker_into_the_folder(data, engine, names, tmp_path):
    """WorkerConfig(profile=) has torch's profiler trace the asked round of every worker where it trains: a Chrome
    trace of the round's ops (its steps: matrix products, the solver's step) and their table, one of each a worker;
    the other rounds are not traced."""
    import json

    from sparknet.config import Profile

    rdd, val = data
    trainer = SparkTrainer(_mlp(), WorkerConfig(solver=SOLVER, batch_size=8, seed=4,
                                                profile=Profile(str(tmp_path / "traces"), round=2)),
                           DistributedConfig(workers=2, engine=engine, tau=4, rounds=4))
    trainer.fit(rdd, validation=val)
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == sorted(
        f"{n}-round2.{ext}" for n in names for ext in ("json", "txt"))
    for name in names:
        events = json.loads((tmp_path / "traces" / f"{name}-round2.json").read_text())["traceEvents"]
        ops = {e.get("name") for e in events}
        assert "aten::addmm" in ops and any(str(op).startswith("Optimizer.step") for op in ops), sorted(ops)[:20]
        assert "aten::addmm" in (tmp_path / "traces" / f"{name}-round2.txt").read_text()
