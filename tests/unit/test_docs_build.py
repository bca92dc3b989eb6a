"""The reference builds: ``mkdocs build --strict`` (the guides in docs/ and the API pages made from the
docstrings by mkdocstrings), every warning an error: a broken link, a missing page, a docstring mkdocstrings
cannot read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("mkdocstrings", reason="the reference needs the dev extra's mkdocs and mkdocstrings")


def test_the_reference_builds_with_warnings_as_errors(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    api = (tmp_path / "site" / "reference" / "spark" / "index.html").read_text(encoding="utf-8")
    assert "SparkTrainer" in api and "on_round" in api  # built from the docstrings
    for page in ("CONNECT", "ESTIMATOR", "PARAMETER_SERVER", "CAFFE", "CLUSTERS"):
        assert (tmp_path / "site" / page / "index.html").exists(), page
