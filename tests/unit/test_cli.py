"""`sparknet train` in one process writes the metrics contract."""

import json

from sparknet.cli import main
from sparknet.metrics import read_metrics


def test_train_writes_eval_and_summary_records(tmp_path):
    out = tmp_path / "m.jsonl"
    rc = main(["train", "--model", "mlp", "--dataset", "synthetic", "--steps", "60", "--eval-every", "30",
               "--batch-size", "32", "--lr", "0.05", "--lr-policy", "fixed", "--threads", "1",
               "--metrics-out", str(out), "--quiet"])
    assert rc == 0
    records = read_metrics(out)
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [30, 60]
    for r in evals:
        assert set(r) >= {"step", "samples", "wall_s", "loss", "test_accuracy"}
    summary = records[-1]
    assert summary["event"] == "summary"
    assert summary["samples"] == 60 * 32
    assert summary["samples_per_s"] > 0
    assert summary["test_accuracy"] > 0.5  # synthetic classes are separable; chance is 0.1
    json.dumps(summary)


def test_bad_flag_values_exit_with_a_message(capsys):
    assert main(["train", "--steps", "0", "--quiet"]) == 2
    assert main(["train", "--dataset", "imagenet-22k", "--steps", "1", "--quiet"]) == 2


def test_version(capsys):
    assert main(["version"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"].startswith("2.13")


def test_save_model_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sparknet._model_io import load_model

    model_dir, tb = tmp_path / "model", tmp_path / "tb"
    rc = main(["train", "--model", "mlp", "--dataset", "synthetic", "--steps", "20", "--eval-every", "10",
               "--threads", "1", "--save-model", str(model_dir), "--tensorboard", str(tb), "--quiet"])
    assert rc == 0
    saved = load_model(model_dir)
    assert saved.weights.numel > 0
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert acc.Tags()["scalars"], "no scalars were written"


def test_every_built_in_sequence_data_set_trains_the_char_lstm(tmp_path):
    """synthetic-sequences names its vocabulary from its tokens (it once failed with a KeyError)."""
    out = tmp_path / "m.jsonl"
    rc = main(["train", "--model", "char_lstm", "--dataset", "synthetic-sequences", "--steps", "60",
               "--batch-size", "32", "--lr", "0.05", "--threads", "1", "--metrics-out", str(out), "--quiet"])
    assert rc == 0
    summary = read_metrics(out)[-1]
    assert summary["event"] == "summary" and summary["steps"] == 60
    assert summary["test_accuracy"] > 1 / 16 * 2  # the next token follows a rule; chance is 1/16
