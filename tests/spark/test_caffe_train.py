"""`sparknet train --solver ... --workers 2` on local[2]: the BVLC LeNet files through the rounds engine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from _spark_testlib import start_session
from sparknet.caffe import read_caffemodel
from sparknet.caffe.train import CaffeEvaluator, resolve_caffe_run
from sparknet.cli import main
from sparknet.metrics import read_metrics

pytestmark = pytest.mark.spark

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "caffe-models"
LENET_SOLVER = MODELS / "mnist" / "lenet_solver.prototxt"
SMALL = "mnist_train_lmdb=mnist-small,mnist_test_lmdb=mnist-small:test"


@pytest.fixture(scope="module")
def spark():
    if not LENET_SOLVER.is_file():
        pytest.skip("BVLC Caffe files not found")
    session = start_session("local[2]")
    yield session
    session.stop()


def test_lenet_solver_on_two_workers_tests_and_snapshots_between_rounds(spark, tmp_path, capsys):
    out, snaps = tmp_path / "m.jsonl", tmp_path / "snaps"
    rc = main(["train", "--solver", str(LENET_SOLVER), "--workers", "2", "--tau", "5", "--steps", "10",
               "--eval-every", "5", "--test-iter", "2", "--display", "5", "--snapshot-every", "5",
               "--caffe-sources", SMALL, "--max-train-samples", "256", "--snapshot-dir", str(snaps),
               "--metrics-out", str(out), "--quiet"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the result line, --quiet too
    assert printed["rounds"] == 2 and printed["rounds_transport"] == "socket" and printed["data_mode"] == "memory"
    records = read_metrics(out)
    rounds = [r for r in records if r["event"] == "round"]
    assert [(r["round"], r["total_steps"], r["workers"]) for r in rounds] == [(1, 5, 2), (2, 10, 2)]
    assert all(r["samples"] == 2 * 5 * 64 for r in rounds)
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [0, 5, 10]
    assert [r["step"] for r in records if r["event"] == "train"] == [5, 10]
    assert [r["step"] for r in records if r["event"] == "snapshot"] == [5, 10]
    summary = records[-1]
    assert summary["event"] == "summary" and summary["engine"] == "rounds" and summary["workers"] == 2
    assert summary["steps"] == 10 and summary["rounds"] == 2 and summary["train_samples"] == 256
    assert summary["master"].startswith("local")
    assert evals[-1]["loss"] < evals[0]["loss"]

    # the snapshot after round 1 holds that round's global weights: testing it gives the logged numbers
    mid, final = read_caffemodel(snaps / "lenet_iter_5.caffemodel"), read_caffemodel(snaps / "lenet_iter_10.caffemodel")
    assert not np.array_equal(mid["ip1"][0], final["ip1"][0])
    plan = resolve_caffe_run(solver=LENET_SOLVER, test_iter=2, sources=SMALL, snapshot_dir=tmp_path / "unused")
    import torch

    evaluator = CaffeEvaluator(plan.tests)
    for snap, record in ((mid, evals[1]), (final, evals[2])):
        weights = {name: [torch.from_numpy(a) for a in arrays] for name, arrays in snap.items()}
        assert evaluator.evaluate(weights)["test"] == pytest.approx(record["outputs"]["test"], rel=1e-5)
    assert summary["test_accuracy"] == evals[-1]["test_accuracy"]


def test_barrier_engine_reports_its_own_tests_and_snapshots_at_the_end(spark, tmp_path):
    out, snaps = tmp_path / "m.jsonl", tmp_path / "snaps"
    rc = main(["train", "--solver", str(LENET_SOLVER), "--workers", "2", "--engine", "barrier", "--tau", "5",
               "--steps", "10", "--eval-every", "5", "--test-iter", "2", "--snapshot-every", "5",
               "--caffe-sources", SMALL, "--max-train-samples", "256", "--snapshot-dir", str(snaps),
               "--metrics-out", str(out), "--quiet"])
    assert rc == 0
    records = read_metrics(out)
    assert [r["total_steps"] for r in records if r["event"] == "round"] == [5, 10]
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [0, 5, 10]
    assert evals[1]["test_accuracy"] is not None  # the engine's own test after round 1
    assert evals[-1]["outputs"]["test"]["accuracy"] == evals[-1]["test_accuracy"]
    # no weights between rounds in this engine: the final snapshot only
    assert [r["step"] for r in records if r["event"] == "snapshot"] == [10]
    assert records[-1]["engine"] == "barrier" and records[-1]["steps"] == 10


def test_the_autoencoder_solver_trains_on_two_spark_workers_without_labels(spark, tmp_path):
    """Caffe's mnist_autoencoder solver (a net with no label blob) through the rounds engine, not one process."""
    out = tmp_path / "ae.jsonl"
    rc = main(["train", "--solver", str(MODELS / "mnist" / "mnist_autoencoder_solver.prototxt"), "--workers", "2",
               "--tau", "10", "--steps", "40", "--eval-every", "20", "--test-iter", "2", "--display", "10",
               "--caffe-sources", SMALL, "--max-train-samples", "500", "--snapshot-dir", str(tmp_path / "ae"),
               "--metrics-out", str(out), "--quiet"])
    assert rc == 0
    records = read_metrics(out)
    rounds = [r for r in records if r["event"] == "round"]
    assert len(rounds) == 4 and all(r["workers"] == 2 for r in rounds)
    evals = [r for r in records if r["event"] == "eval"]
    first, last = evals[0]["outputs"]["test-on-test"], evals[-1]["outputs"]["test-on-test"]
    assert last["cross_entropy_loss"] < 0.7 * first["cross_entropy_loss"], (first, last)
    summary = records[-1]
    assert summary["engine"] == "rounds" and summary["test_accuracy"] is None
