"""What the command prints: --quiet keeps the result line; pyspark's pandas warning is hidden in a run only."""

from __future__ import annotations

import json
import warnings

from sparknet import cli

PANDAS_NOTICE = "PySpark does not yet fully support pandas >= 3.0.0. Some features may not work correctly."


def test_quiet_train_prints_only_the_result_line(capsys):
    rc = cli.main(["train", "--model", "mlp", "--dataset", "synthetic", "--steps", "20", "--eval-every", "10",
                   "--threads", "1", "--quiet"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, lines
    assert json.loads(lines[0])["steps"] == 20


def test_pyspark_pandas_warning_is_hidden_inside_a_command_only(monkeypatch):
    def configure(p):
        def run(args):
            warnings.warn(PANDAS_NOTICE, FutureWarning, stacklevel=1)
            warnings.warn("some other future change", FutureWarning, stacklevel=1)
            return 0

        p.set_defaults(_run=run)

    monkeypatch.setitem(cli.COMMANDS, "warn-twice", ("test only", configure))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["warn-twice"]) == 0
        warnings.warn(PANDAS_NOTICE, FutureWarning, stacklevel=1)  # outside the command: not filtered
    messages = [str(w.message) for w in caught]
    assert messages == ["some other future change", PANDAS_NOTICE]
