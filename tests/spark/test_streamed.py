"""Streamed partitions on real Spark (local[2]): rows stay on the executors' disk and train through a
bounded shuffle window, on both engines; ``auto`` chooses from the partition's size and the task's memory."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from _spark_testlib import module_session, partitioned_rdd
from sparknet.config import DistributedConfig, Engine, WorkerConfig
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer
from sparknet._enums import DataMode
from sparknet.spark.data import choose_data_mode
from sparknet.spark.trainer import EngineOptions

pytestmark = pytest.mark.spark

spark = module_session("local[2]")

WIDTH = 256  # 1 KiB rows: a 1 MiB window holds one block of 1,024 rows, so a partition of 2,000 is two windows


def _blobs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(99).normal(0, 1, (3, WIDTH)).astype(np.float32)
    y = rng.integers(0, 3, n)
    return (centers[y] + rng.normal(0, 1.5, (n, WIDTH))).astype(np.float32), y.astype(np.int64)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


@pytest.fixture(scope="module")
def data(spark):
    x, y = _blobs(4000, seed=1)
    rdd = partitioned_rdd(spark.sparkContext, [(x[:2000], y[:2000]), (x[2000:], y[2000:])]).cache()
    yield rdd, _blobs(600, seed=2)
    rdd.unpersist()


def _fit(spark, rdd, val, engine: Engine, mode: str = "stream", staging_dir=None):
    trainer = SparkTrainer(_net(), WorkerConfig(solver=SolverConfig(base_lr=0.02, momentum=0.9), batch_size=50, seed=3),
                           DistributedConfig(workers=2, tau=30, rounds=4, engine=engine, data_mode=mode,
                                             stream_buffer_mb=1),
                           spark=spark, options=EngineOptions(staging_dir=staging_dir))
    return trainer.fit(rdd, validation=val)


def test_a_streamed_fit_on_the_rounds_engine_trains_and_is_reproducible(spark, data, tmp_path):
    rdd, val = data
    a = _fit(spark, rdd, val, Engine.ROUNDS, staging_dir=str(tmp_path))
    s = a.summary
    assert s["data_mode"] == "stream" and "as asked" in s["data_mode_reason"], s
    assert s["test_accuracy"] >= 0.9, s
    # 4 rounds of 30 steps of 50 rows: 6,000 rows per worker, three epochs of its 2,000, through two windows each
    rounds = [r for r in a.history if r.get("event") == "round"]
    assert sum(w["samples"] for w in rounds[-1]["per_worker"]) == 2 * 30 * 50
    b = _fit(spark, rdd, val, Engine.ROUNDS, staging_dir=str(tmp_path))
    assert torch.equal(a.weights.to_flat(torch.float32), b.weights.to_flat(torch.float32))
    assert not os.listdir(tmp_path)  # the fit's staged rows are gone with it


def test_a_streamed_fit_takes_other_batches_than_an_in_memory_one_and_trains_as_well(spark, data):
    rdd, val = data
    streamed = _fit(spark, rdd, val, Engine.ROUNDS)
    held = _fit(spark, rdd, val, Engine.ROUNDS, mode="memory")
    assert held.summary["data_mode"] == "memory"
    assert not torch.equal(streamed.weights.to_flat(torch.float32), held.weights.to_flat(torch.float32))
    assert abs(streamed.summary["test_accuracy"] - held.summary["test_accuracy"]) < 0.05


def test_a_streamed_fit_on_the_barrier_engine_trains(spark, data):
    rdd, val = data
    s = _fit(spark, rdd, val, Engine.BARRIER).summary
    assert s["data_mode"] == "stream" and s["test_accuracy"] >= 0.9, s


def test_auto_streams_only_partitions_too_big_for_a_task(spark, data):
    sc = spark.sparkContext
    small, why_small = choose_data_mode("auto", 2 << 20, sc)
    big, why_big = choose_data_mode("auto", 64 << 30, sc)
    assert (small, big) == (DataMode.MEMORY, DataMode.STREAM)
    assert "in memory" in why_small and "streamed" in why_big and "spark.driver.memory" in why_big
    rdd, val = data
    assert _fit(spark, rdd, val, Engine.ROUNDS, mode="auto").summary["data_mode"] == "memory"
    with pytest.raises(ValueError, match="data mode"):
        DistributedConfig(workers=2, data_mode="disk")
