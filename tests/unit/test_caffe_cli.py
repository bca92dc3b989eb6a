"""Caffe files on the command line: `sparknet train --prototxt/--solver` in one process, `sparknet caffe`.

Training runs bind the BVLC sources to the 5,000-image MNIST subset and read a few hundred
images, so each run takes seconds.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from sparknet.caffe import load_net_prototxt, read_caffemodel, write_caffemodel
from sparknet.caffe.cli import CaffeTrainFlags, file_kind, train_caffe_files
from sparknet.caffe.train import load_net_data, resolve_caffe_run, train_caffe
from sparknet.cli import main
from sparknet.config import DistributedConfig, RunConfig
from sparknet.metrics import read_metrics

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "caffe-models"
LENET_NET = MODELS / "mnist" / "lenet_train_test.prototxt"
LENET_SOLVER = MODELS / "mnist" / "lenet_solver.prototxt"
AE_SOLVER = MODELS / "mnist" / "mnist_autoencoder_solver.prototxt"
SMALL = "mnist_train_lmdb=mnist-small,mnist_test_lmdb=mnist-small:test"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.skipif(not LENET_SOLVER.is_file(), reason="BVLC Caffe files not found")


def _records(path: Path, event: str) -> list[dict]:
    return [r for r in read_metrics(path) if r["event"] == event]


# ------------------------------------------------------------------------------ sparknet train


def test_train_lenet_from_its_solver_end_to_end(tmp_path):
    out, snaps = tmp_path / "m.jsonl", tmp_path / "snaps"
    rc = main(["train", "--prototxt", str(LENET_NET), "--solver", str(LENET_SOLVER), "--steps", "30",
               "--eval-every", "15", "--test-iter", "2", "--display", "10", "--snapshot-every", "20",
               "--caffe-sources", SMALL, "--max-train-samples", "640", "--threads", "1",
               "--snapshot-dir", str(snaps), "--metrics-out", str(out), "--model-dir", str(tmp_path / "model"),
               "--tensorboard", str(tmp_path / "tb"), "--quiet"])
    assert rc == 0
    evals = _records(out, "eval")
    assert [r["step"] for r in evals] == [0, 15, 30]  # test_initialization, every test_interval, the end
    assert all(set(r["outputs"]["test"]) == {"accuracy", "loss"} for r in evals)
    assert [r["step"] for r in _records(out, "train")] == [10, 20, 30]
    assert [r["step"] for r in _records(out, "snapshot")] == [20, 30]
    summary = read_metrics(out)[-1]
    assert summary["event"] == "summary" and summary["engine"] == "local"
    assert summary["steps"] == 30 and summary["samples"] == 30 * 64 and summary["train_samples"] == 640
    assert summary["caffe"]["test_iter"] == {"test": 2} and summary["caffe"]["batch_size"] == 64
    assert evals[-1]["loss"] < 0.6 * evals[0]["loss"]  # it learned
    assert summary["test_accuracy"] == evals[-1]["test_accuracy"] > 0.4  # 10 classes: chance is 0.1

    # each snapshot is a .caffemodel and a model folder holding the same weights
    from sparknet.model_io import load_model

    final = read_caffemodel(snaps / "lenet_iter_30.caffemodel")
    folder = load_model(snaps / "lenet_iter_30")
    assert list(final) == ["conv1", "conv2", "ip1", "ip2"]
    for name, arrays in final.items():
        for a, t in zip(arrays, folder.weights[name]):
            assert np.array_equal(a, t.numpy())
    early = read_caffemodel(snaps / "lenet_iter_20.caffemodel")
    assert not np.array_equal(early["ip2"][0], final["ip2"][0])
    assert folder.config["caffe"]["transform"]["scale"] == pytest.approx(0.00390625)

    # --model-dir holds the final weights as a model folder of the same kind; --tensorboard logged the run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    saved = load_model(tmp_path / "model")
    assert saved.config["caffe"]["iteration"] == 30
    for name, arrays in final.items():
        for a, t in zip(arrays, saved.weights[name]):
            assert np.array_equal(a, t.numpy())
    board = EventAccumulator(str(tmp_path / "tb"))
    board.Reload()
    assert board.Tags()["scalars"], "--tensorboard wrote no scalars"


def test_one_process_keeps_a_moving_average_and_tests_and_snapshots_it_at_the_end(tmp_path):
    """A Caffe run in one process is the round loop too: --weight-ema works there as on Spark."""

    def train(name: str, *extra: str) -> tuple[list[dict], dict]:
        out = tmp_path / f"{name}.jsonl"
        assert main(["train", "--prototxt", str(LENET_NET), "--solver", str(LENET_SOLVER), "--steps", "20",
                     "--eval-every", "10", "--test-iter", "1", "--snapshot-every", "20", "--caffe-sources", SMALL,
                     "--max-train-samples", "320", "--threads", "1", "--snapshot-dir", str(tmp_path / name),
                     "--metrics-out", str(out), "--quiet", *extra]) == 0
        return _records(out, "eval"), read_caffemodel(tmp_path / name / "lenet_iter_20.caffemodel")

    plain_evals, plain = train("plain")
    ema_evals, ema = train("ema", "--weight-ema", "0.5")
    assert [r["step"] for r in ema_evals] == [r["step"] for r in plain_evals] == [0, 10, 20]
    assert ema_evals[1]["test_accuracy"] == plain_evals[1]["test_accuracy"]  # the same global weights until the end
    summary = read_metrics(tmp_path / "ema.jsonl")[-1]
    assert summary["returned_weights"] == "ema" and summary["weight_ema"] == 0.5
    assert summary["test_accuracy"] == ema_evals[-1]["test_accuracy"]
    assert not np.array_equal(ema["ip2"][0], plain["ip2"][0])  # the snapshot holds the average


def test_autoencoder_without_labels_trains_and_its_loss_halves(tmp_path):
    plan = resolve_caffe_run(solver=AE_SOLVER, max_iter=30, test_interval=30, test_iter=2, display=10,
                             sources=SMALL, max_train_samples=500, snapshot_dir=tmp_path / "ae")
    assert [t.label for t in plan.tests] == ["test-on-train", "test-on-test"]
    assert plan.primary_test.label == "test-on-test"
    x, y = load_net_data(plan.train_net, samples=10)
    assert x.shape == (10, 1, 28, 28) and not y.any()  # no label blob: placeholder labels
    summary = train_caffe(plan, threads=1, progress=False, metrics_out=tmp_path / "ae.jsonl")
    evals = _records(tmp_path / "ae.jsonl", "eval")
    first, last = evals[0]["outputs"], evals[-1]["outputs"]
    for label in ("test-on-train", "test-on-test"):
        assert set(first[label]) == {"cross_entropy_loss", "l2_error", "loss"}
        assert last[label]["cross_entropy_loss"] < 0.5 * first[label]["cross_entropy_loss"]
    assert summary["test_accuracy"] is None and summary["test_loss"] == last["test-on-test"]["loss"]


def test_prototxt_alone_uses_the_command_line_solver(tmp_path, monkeypatch):
    captured = {}
    monkeypatch.setattr("sparknet.caffe.train.train_caffe", lambda plan, **kw: captured.update(plan=plan, **kw) or {})
    run = RunConfig(steps=7, lr=0.05, lr_policy="fixed", eval_every=5)
    train_caffe_files(run, DistributedConfig(), CaffeTrainFlags(prototxt=str(LENET_NET), snapshot_dir=str(tmp_path)))
    plan = captured["plan"]
    assert plan.max_iter == 7 and plan.test_interval == 5 and plan.display == 100
    assert plan.solver.base_lr == 0.05 and plan.solver.lr_policy.value == "fixed"
    assert [t.iters for t in plan.tests] == [None]  # the whole TEST data set once per test
    assert plan.batch_size == 64 and plan.snapshot == 0 and plan.snapshot_after_train


def test_the_solver_file_wins_unless_a_flag_is_given(tmp_path, monkeypatch):
    captured = {}
    monkeypatch.setattr("sparknet.caffe.train.train_caffe", lambda plan, **kw: captured.update(plan=plan, **kw) or {})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="needs --prototxt NET, --solver SOLVER or both"):
        train_caffe_files(RunConfig(), DistributedConfig(), CaffeTrainFlags())  # no Caffe file
    train_caffe_files(RunConfig(), DistributedConfig(workers=2), CaffeTrainFlags(solver=str(LENET_SOLVER)))
    plan = captured["plan"]
    assert captured["workers"] == 2
    assert (plan.max_iter, plan.test_interval, plan.display, plan.snapshot) == (10000, 500, 100, 5000)
    assert [t.iters for t in plan.tests] == [100] and plan.batch_size == 64
    assert plan.solver.lr_policy.value == "inv" and plan.solver.max_iter == 10000
    # snapshot_prefix "examples/mnist/lenet" -> ./lenet, never the BVLC relative folder
    assert plan.snapshot_dir == tmp_path / "lenet" and plan.snapshot_prefix == "lenet"
    assert not (tmp_path / "examples").exists()

    train_caffe_files(RunConfig(steps=300, batch_size=32, lr=0.02, seed=5), DistributedConfig(),
                      CaffeTrainFlags(solver=str(LENET_SOLVER), test_iter=3, snapshot_every=0, display=7))
    plan = captured["plan"]
    assert (plan.max_iter, plan.batch_size, plan.seed, plan.snapshot, plan.display) == (300, 32, 5, 0, 7)
    assert plan.solver.base_lr == 0.02 and plan.solver.momentum == 0.9 and plan.solver.max_iter == 300
    assert plan.train_net.batch_size == 32 and plan.train_net.net_params.inputs[0].shape == (32, 1, 28, 28)
    assert [t.iters for t in plan.tests] == [3] and plan.tests[0].net.batch_size == 100


def test_fine_tuning_starts_from_the_weights_file(tmp_path):
    net = load_net_prototxt(LENET_NET, "TRAIN")
    start = net.build(seed=123)
    write_caffemodel(tmp_path / "init.caffemodel", start.layer_weights(), net)
    plan = resolve_caffe_run(LENET_NET, LENET_SOLVER, weights=tmp_path / "init.caffemodel", max_iter=1,
                             test_iter=1, sources=SMALL, max_train_samples=64, snapshot_dir=tmp_path / "s")
    summary = train_caffe(plan, threads=1, progress=False, metrics_out=tmp_path / "m.jsonl")
    evals = _records(tmp_path / "m.jsonl", "eval")
    # the test before the first update runs with the loaded weights
    from sparknet.caffe.train import CaffeEvaluator

    expected = CaffeEvaluator(plan.tests).evaluate(start.layer_weights())["test"]
    assert evals[0]["outputs"]["test"] == pytest.approx(expected)
    assert summary["caffe"]["weights"] == [str(tmp_path / "init.caffemodel")]


# ------------------------------------------------------------------------------ errors


def test_a_syntax_error_names_the_file_and_line_and_exits_2(tmp_path, caplog):
    lines = LENET_NET.read_text().splitlines()
    lines[11] = "  transform_param { scale 0.1 }"  # line 12: a missing colon inside a message
    bad = tmp_path / "bad.prototxt"
    bad.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.ERROR, logger="sparknet"):
        assert main(["train", "--prototxt", str(bad), "--steps", "1", "--quiet"]) == 2
    assert f"{bad}:12:" in caplog.text and "syntax error" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="sparknet"):
        assert main(["caffe", "inspect", str(bad)]) == 2
    assert f"{bad}:12:" in caplog.text


def test_a_solver_whose_net_is_missing_says_to_pass_the_prototxt(tmp_path, caplog):
    solver = tmp_path / "alone_solver.prototxt"
    solver.write_text(LENET_SOLVER.read_text())
    with caplog.at_level(logging.ERROR, logger="sparknet"):
        assert main(["train", "--solver", str(solver), "--steps", "1", "--quiet"]) == 2
    assert str(solver) in caplog.text and "examples/mnist/lenet_train_test.prototxt" in caplog.text
    assert "--prototxt" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="sparknet"):
        assert main(["train", "--solver", str(tmp_path / "nope.prototxt"), "--quiet"]) == 2
    assert "no such solver prototxt" in caplog.text


def test_an_unbound_data_source_names_the_flag(tmp_path, caplog):
    text = LENET_NET.read_text().replace("examples/mnist/mnist_train_lmdb", "my/own_lmdb")
    net = tmp_path / "mine.prototxt"
    net.write_text(text)
    with caplog.at_level(logging.ERROR, logger="sparknet"):
        assert main(["train", "--prototxt", str(net), "--steps", "1", "--quiet"]) == 2
    assert "my/own_lmdb" in caplog.text and "--caffe-sources" in caplog.text


# ------------------------------------------------------------------------------ sparknet caffe


def test_inspect_a_net_shows_layers_shapes_and_parameters(capsys):
    assert main(["caffe", "inspect", str(LENET_NET)]) == 0
    out = capsys.readouterr().out
    assert "phase TRAIN" in out and "Data (mnist)" in out
    conv1 = next(line for line in out.splitlines() if line.startswith("conv1"))
    assert conv1.split() == ["conv1", "Convolution", "data", "conv1", "64x20x24x24", "520"]
    assert "431,080 learnable parameters" in out
    assert "mnist_test_lmdb" not in out  # TRAIN phase
    assert main(["caffe", "inspect", str(LENET_NET), "--phase", "test", "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)
    accuracy = next(l for l in layers if l["layer"] == "accuracy")
    assert accuracy["type"] == "Accuracy" and accuracy["bottoms"] == ["ip2", "label"] and accuracy["shapes"] == [[]]
    ip2 = next(l for l in layers if l["layer"] == "ip2")
    assert ip2["shapes"] == [[100, 10]] and ip2["params"] == 5010


def test_inspect_cifar_quick_gives_caffes_shapes(capsys):
    assert main(["caffe", "inspect", str(MODELS / "cifar10" / "cifar10_quick.prototxt"), "--json"]) == 0
    layers = {l["layer"]: l for l in json.loads(capsys.readouterr().out)}
    assert layers["conv1"]["shapes"] == [[1, 32, 32, 32]] and layers["pool1"]["shapes"] == [[1, 32, 16, 16]]
    assert layers["ip2"]["shapes"] == [[1, 10]] and layers["ip1"]["params"] == 64 * 4 * 4 * 64 + 64


def test_inspect_a_solver_and_a_caffemodel(tmp_path, capsys):
    assert main(["caffe", "inspect", str(LENET_SOLVER)]) == 0
    out = capsys.readouterr().out
    settings = dict(line.split(None, 1) for line in out.splitlines()[1:] if not line.startswith("  ("))
    assert settings["max_iter"] == "10000" and settings["lr_policy"] == "inv" and settings["test_iter"] == "[100]"
    assert settings["net"] == "examples/mnist/lenet_train_test.prototxt" and "stepsize" not in settings
    assert main(["caffe", "inspect", str(AE_SOLVER), "--json"]) == 0
    ae = json.loads(capsys.readouterr().out)
    assert ae["test_states"] == [["test-on-train"], ["test-on-test"]] and ae["test_iter"] == [500, 100]

    net = load_net_prototxt(LENET_NET, "TRAIN")
    path = write_caffemodel(tmp_path / "w.caffemodel", net.build(seed=0).layer_weights(), net)
    assert file_kind(path) == "caffemodel" and file_kind(LENET_SOLVER) == "solver" and file_kind(LENET_NET) == "net"
    assert main(["caffe", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "500x800, 500" in out and "431,080 parameters" in out


def test_import_then_export_round_trips_exactly(tmp_path, capsys):
    from sparknet.model_io import load_model

    net = load_net_prototxt(LENET_NET, "TRAIN")
    weights = net.build(seed=4).layer_weights()
    original = write_caffemodel(tmp_path / "lenet.caffemodel", weights, net)
    assert main(["caffe", "import", "--prototxt", str(LENET_NET), "--weights", str(original),
                 "--solver", str(LENET_SOLVER), "--model-dir", str(tmp_path / "model")]) == 0
    saved = load_model(tmp_path / "model")
    assert saved.solver.lr_policy.value == "inv" and saved.config["caffe"]["dataset"] == "mnist"
    x = torch.rand(3, 1, 28, 28)
    with torch.no_grad():
        assert torch.allclose(saved.predict(x), net.build(seed=4)(x), atol=1e-6)

    assert main(["caffe", "export", "--model-dir", str(tmp_path / "model"), "--out", str(tmp_path / "out" / "lenet")]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[-2:] == [str(tmp_path / "out" / "lenet.prototxt"), str(tmp_path / "out" / "lenet.caffemodel")]
    back = read_caffemodel(tmp_path / "out" / "lenet.caffemodel")
    first = read_caffemodel(original)
    assert list(back) == list(first)
    for name in first:
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(first[name], back[name]))
    # the original prototxt comes back, both phases and data layers included
    again = load_net_prototxt(tmp_path / "out" / "lenet.prototxt", "TEST")
    assert again.data_binding.split == "test" and "accuracy" in again.layer_types


def test_export_a_layer_dsl_model_folder(tmp_path):
    from sparknet import zoo
    from sparknet.model_io import save_model
    from sparknet.weights import WeightCollection

    params = zoo.lenet()
    module = params.build(seed=0)
    save_model(tmp_path / "zoo", params, WeightCollection(module.layer_weights()))
    assert main(["caffe", "export", "--model-dir", str(tmp_path / "zoo"), "--out", str(tmp_path / "zl")]) == 0
    loaded = load_net_prototxt(tmp_path / "zl.prototxt", "TEST")
    rebuilt = loaded.build(seed=1)
    from sparknet.caffe import load_caffemodel_into

    load_caffemodel_into(rebuilt, tmp_path / "zl.caffemodel", strict=True)
    x = torch.rand(2, 1, 28, 28)
    with torch.no_grad():
        assert torch.allclose(rebuilt(x), module(x), atol=1e-6)


def test_import_missing_files_exit_2(tmp_path):
    assert main(["caffe", "import", "--prototxt", str(tmp_path / "none.prototxt"), "--model-dir", str(tmp_path / "m")]) == 2
    assert main(["caffe", "export", "--model-dir", str(tmp_path / "none"), "--out", str(tmp_path / "x")]) == 2


# ------------------------------------------------------------------------------ the example


def test_example_runs_quick(capsys):
    spec = importlib.util.spec_from_file_location("example_caffe_lenet", EXAMPLES / "caffe_lenet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--quick", "--json", "--caffe-dir", str(MODELS)])
    assert result["engine"] == "local" and result["steps"] == 60
    assert result["test_accuracy"] > 0.5, result  # chance is 0.1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["model"] == "LeNet"
