"""The driver's progress line: one line rewritten in place, log records printed above it."""

from __future__ import annotations

import io
import logging

from sparknet.metrics import MetricsLogger


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_updates_in_place_and_log_lines_do_not_break_it(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    root = logging.getLogger()
    handler = logging.StreamHandler(term)  # what logging.basicConfig gives the command
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    try:
        with MetricsLogger(progress=True, total=100) as metrics:
            metrics.progress(50, round=1, loss=0.51234, acc=0.9, tau=50, **{"samples/s": 1234.5})
            logging.getLogger("sparknet.test").info("a message while the line is up")
            metrics.progress(50, round=2, loss=0.25, acc=0.95, tau=50)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    out = term.getvalue()
    assert "round=1, loss=0.5123, acc=0.9, tau=50, samples/s=1234" in out
    assert "100/100" in out and "round=2" in out
    before, _, after = out.partition("a message while the line is up")
    assert after, out
    # The line was cleared (carriage return, blanks, carriage return) before the message and
    # the message ended its own line, rather than being glued to the end of the progress line.
    assert before.endswith("\r") and after.startswith("\n"), repr(out)
    # Nothing but the one log line ends a line: the progress line is rewritten with \r.
    assert out.count("\n") <= 2, repr(out)
