"""Test tiers: one line per tier at the end of every run, and a failure when a tier went missing.

The tiers are the folders under ``tests/`` that hold test modules: ``unit`` (pure, one
process), ``dist`` (two-process gloo on loopback) and ``spark`` (a real Spark session). Every
run ends with a line per tier that ran::

    tests/unit: 412 passed, 0 failed, 3 skipped

A run started on the whole ``tests/`` folder (the README's ``python -m pytest``) fails when
some tier collected no test at all: a folder that pytest silently stopped collecting (as
``dist`` once was, through pytest's default ``norecursedirs``) must not pass as green.
A module skipped as a whole (an optional dependency missing) counts as collected.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TIERS = tuple(sorted(d.name for d in TESTS.iterdir() if d.is_dir() and any(d.glob("test_*.py"))))

_RANK = {"passed": 0, "skipped": 1, "failed": 2}  # a test failing in any phase failed


class _Tiers:
    """Counts per tier: items collected (before ``-k``/``-m``) and each test's outcome."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.collected: Counter = Counter()  # tier -> items collected, or modules skipped as a whole
        self.outcomes: dict[str, tuple[str, str]] = {}  # nodeid -> (tier, "passed" | "failed" | "skipped")
        self.missing: list[str] = []
        self.counted_workers = False

    def tier(self, nodeid: str) -> str | None:
        path = (self.config.rootpath / nodeid.split("::", 1)[0]).resolve()
        try:
            parts = path.relative_to(TESTS).parts
        except ValueError:
            return None
        return parts[0] if len(parts) > 1 and parts[0] in TIERS else None

    def record(self, nodeid: str, outcome: str) -> None:
        tier = self.tier(nodeid)
        if tier is not None:
            previous = self.outcomes.get(nodeid, (tier, "passed"))[1]
            self.outcomes[nodeid] = (tier, max(previous, outcome, key=_RANK.__getitem__))

    def whole_folder(self) -> bool:
        """Whether this run was started on ``tests/`` itself (or a folder above it), not on a part."""
        if self.config.getoption("lf", False):
            return False  # --last-failed leaves passing files out on purpose
        for arg in self.config.args:
            path = (self.config.invocation_params.dir / arg).resolve()
            if "::" not in arg and (path == TESTS or path in TESTS.parents):
                return True
        return False

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        tier = self.tier(item.nodeid)
        if tier is not None:
            self.collected[tier] += 1

    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        """Under pytest-xdist the workers collect; the controller counts the first worker's list once."""
        if not self.counted_workers:
            self.counted_workers = True
            for nodeid in ids:
                tier = self.tier(nodeid)
                if tier is not None:
                    self.collected[tier] += 1

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.record(report.nodeid, "failed")
        elif report.skipped and report.nodeid.endswith(".py"):
            self.record(report.nodeid, "skipped")
            tier = self.tier(report.nodeid)
            if tier is not None:
                self.collected[tier] += 1

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed or report.skipped:
            self.record(report.nodeid, report.outcome)
        elif report.when == "call":
            self.record(report.nodeid, "passed")

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) or not self.whole_folder():
            return
        self.missing = [tier for tier in TIERS if self.collected[tier] == 0]
        if self.missing:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        counts = {tier: Counter() for tier in TIERS}
        for tier, outcome in self.outcomes.values():
            counts[tier][outcome] += 1
        terminalreporter.section("tiers")
        for tier in TIERS:
            c = counts[tier]
            if self.collected[tier] or tier in self.missing:
                terminalreporter.write_line(f"tests/{tier}: {c['passed']} passed, {c['failed']} failed, "
                                            f"{c['skipped']} skipped")
        for tier in self.missing:
            terminalreporter.write_line(f"tests/{tier} collected no test: check norecursedirs and its test_*.py "
                                        "files (this run fails)", red=True, bold=True)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Tiers(config), "sparknet-tiers")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``--dist loadgroup``), a test module runs whole on one worker (its one
    SparkSession and module fixtures stay one), and the multi-host tier runs on one worker, one rig
    at a time."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        group = "cluster" if module.startswith("tests/cluster/") else module
        item.add_marker(pytest.mark.xdist_group(group))
