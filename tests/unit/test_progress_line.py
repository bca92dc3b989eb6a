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


def test_in_a_log_each_advance_is_one_plain_line_with_the_same_fields(monkeypatch):
    log_file = io.StringIO()  # not a terminal: a file, a pipe, a log collector
    monkeypatch.setattr("sys.stderr", log_file)
    with MetricsLogger(progress=True, total=100) as metrics:
        metrics.progress(50, round=1, loss=0.51234, acc=0.9, tau=50, **{"samples/s": 1234.5})
        metrics.progress(0, acc=0.93)  # an evaluation between advances: shown with the next line
        metrics.progress(50, round=2, loss=0.25, tau=50)
    lines = log_file.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in log_file.getvalue(), lines
    assert lines[0].startswith("[sparknet] 50/100 steps (50%) round=1 loss=0.5123 acc=0.9 tau=50 samples/s=1234 | ")
    assert "elapsed, about " in lines[0] and lines[0].endswith(" left")
    assert lines[1].startswith("[sparknet] 100/100 steps (100%) round=2 loss=0.25 acc=0.93 tau=50")
    assert "left" not in lines[1]


def test_a_run_that_may_stop_sooner_shows_its_time_left_as_at_most_so_much(monkeypatch):
    """Toward a target the step count is a limit, not the run's length: the time left to it is an upper bound, on
    the terminal's bar and in a log's lines; without a target it is an estimate."""
    for out, early_stop, said in [(_Terminal(), True, "at most 00:00 left"), (io.StringIO(), True, "at most 0s left"),
                                  (_Terminal(), False, "00:00<00:00"), (io.StringIO(), False, "about 0s left")]:
        monkeypatch.setattr("sys.stderr", out)
        with MetricsLogger(progress=True, total=100, early_stop=early_stop) as metrics:
            metrics.progress(50, round=1, acc=0.9)
        text = out.getvalue()
        assert said in text and "round=1" in text and "50/100" in text, (early_stop, text)
        assert ("at most" in text) is early_stop, text


def test_no_progress_asked_prints_nothing(monkeypatch):
    log_file = io.StringIO()
    monkeypatch.setattr("sys.stderr", log_file)
    with MetricsLogger(progress=False, total=10) as metrics:
        metrics.progress(10, round=1)
    assert log_file.getvalue() == ""


def test_a_notebook_kernel_gets_a_bar_not_plain_lines(monkeypatch):
    """In a Jupyter kernel (IPython's ZMQ shell; its stderr is no terminal) the bar is tqdm.auto's, not the plain
    lines a log gets; anywhere else in_notebook() is false."""
    import sys
    import types

    import tqdm.auto

    from sparknet.metrics import in_notebook

    assert not in_notebook()
    shell_cls = type("ZMQInteractiveShell", (), {})
    fake_ipython = types.SimpleNamespace(get_ipython=lambda: shell_cls())
    monkeypatch.setitem(sys.modules, "IPython", fake_ipython)
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    monkeypatch.setattr("sys.stderr", io.StringIO())  # a kernel's stream: not a terminal
    assert in_notebook()
    with MetricsLogger(progress=True, total=10) as metrics:
        assert metrics._bar is not None and not metrics._plain
        assert isinstance(metrics._bar, tqdm.auto.tqdm)
        metrics.progress(10, round=1)
    assert "[sparknet]" not in sys.stderr.getvalue()
