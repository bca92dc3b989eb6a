"""`sparknet plot`: learning curves from a metrics file."""

import json
import struct

import pytest

from sparknet.cli import main
from sparknet.tools.plot import extract_curves, plot_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _rounds_file(path, rounds=12, workers=3):
    with open(path, "w", encoding="utf-8") as f:
        for r in range(1, rounds + 1):
            per_worker = [{"index": i, "samples": 320, "steps": 5, "loss": 2.3 * 0.9 ** r + 0.01 * i}
                          for i in range(workers)]
            f.write(json.dumps({"event": "round", "round": r, "steps": 5, "total_steps": 5 * r,
                                "samples": 320 * workers, "wall_s": 0.4 * r, "compute_s": 0.3, "comm_s": 0.1,
                                "loss": 2.3 * 0.9 ** r, "val_accuracy": 1 - 0.8 ** r, "bytes": 1000, "tau": 5,
                                "per_worker": per_worker}) + "\n")
        f.write(json.dumps({"event": "summary", "test_accuracy": 0.9, "wall_s": 5.0}) + "\n")
    return path


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_rounds_file_writes_a_png(tmp_path):
    metrics = _rounds_file(tmp_path / "run.jsonl")
    out = plot_metrics(metrics, tmp_path / "plots" / "curves.png", dpi=50)
    assert out.exists()
    width, height = _png_size(out)
    assert (width, height) == (600, 400)  # 12x8 inches at 50 dpi
    assert out.stat().st_size > 10_000  # four panels of curves, not a blank image


def test_curves_have_the_run_and_each_worker(tmp_path):
    records = [json.loads(line) for line in _rounds_file(tmp_path / "run.jsonl").read_text().splitlines()]
    curves = extract_curves(records)
    assert set(curves.worker_loss) == {"0", "1", "2"}
    assert len(curves.loss["train"]) == 12 and len(curves.accuracy["validation"]) == 12
    # samples are cumulative over rounds: 12 rounds x 3 workers x 320
    assert curves.loss["train"].samples[-1] == 12 * 3 * 320
    assert curves.worker_loss["2"].value[0] == pytest.approx(2.3 * 0.9 + 0.02)


def test_plot_eval_records_through_the_cli(tmp_path, capsys):
    metrics = tmp_path / "local.jsonl"
    metrics.write_text("".join(
        json.dumps({"event": "eval", "step": s, "samples": 64 * s, "wall_s": s / 100, "loss": 1 / s,
                    "test_accuracy": 1 - 1 / s}) + "\n" for s in (10, 20, 30)))
    assert main(["plot", str(metrics)]) == 0
    out = tmp_path / "local.png"
    assert capsys.readouterr().out.strip() == str(out)
    assert _png_size(out) == (1200, 800)


def test_nothing_to_plot_is_a_clear_error(tmp_path):
    metrics = tmp_path / "empty.jsonl"
    metrics.write_text(json.dumps({"event": "summary", "wall_s": 1.0}) + "\n")
    with pytest.raises(ValueError, match="nothing|no round or eval"):
        plot_metrics(metrics)
    assert main(["plot", str(tmp_path / "missing.jsonl")]) == 2
