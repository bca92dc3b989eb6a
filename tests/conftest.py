"""Test tiers: one line per tier at the end of every run, and a failure when a tier went missing.

The tiers are the folders under ``tests/`` that hold test modules: ``unit`` (pure, one
process), ``dist`` (two-process gloo on loopback) and ``spark`` (a real Spark session). Every
run ends with a line per tier that ran::

    tests/unit: 412 passed, 0 failed, 3 skipped

A run started on the whole ``tests/`` folder (the README's ``python -m pytest``) fails when
some tier collected no test at all: a folder that pytest silently stopped collecting (as
``dist`` once was, through pytest's default ``norecursedirs``) must not pass as green.
A module skipped as a whole (an optional dependency missing) counts as collected.

The suite's Spark JVMs (drivers, executors, the test clusters' daemons) compile with the client
compiler only and collect with the serial collector (:func:`_quick_jvms`): a test's JVM lives a
minute or less, and the optimising compiler's work for it is CPU the two-core machine's other
tests wait for (a session's start and a few jobs: about 33 CPU-seconds, 20 with these options).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from sparknet.spark.session import DAEMON_MODULE, DAEMON_MODULE_KEY

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
        self.workers_of: dict[str, set[str]] = {}  # module (the tier for tests/cluster) -> xdist workers it ran on
        self.split: list[str] = []

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
        worker = getattr(getattr(report, "node", None), "gateway", None)  # set on the xdist controller
        if worker is not None:
            self.workers_of.setdefault(_scope(report.nodeid), set()).add(worker.id)
        if report.failed or report.skipped:
            self.record(report.nodeid, report.outcome)
        elif report.when == "call":
            self.record(report.nodeid, "passed")

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
            return
        if self.whole_folder():
            self.missing = [tier for tier in TIERS if self.collected[tier] == 0]
        self.split = sorted(scope for scope, workers in self.workers_of.items() if len(workers) > 1)
        if self.missing or self.split:
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
        for scope in self.split:
            terminalreporter.write_line(f"{scope} ran on several xdist workers ({', '.join(sorted(self.workers_of[scope]))}): "
                                        "each started its own SparkSession or rig; run with --dist loadscope, "
                                        "which tests/conftest.py keeps whole (this run fails)", red=True, bold=True)


def _scope(nodeid: str) -> str:
    """What must run whole on one xdist worker: a test module, or the multi-host tier (one rig at a time)."""
    module = nodeid.split("::", 1)[0]
    return "tests/cluster" if module.startswith("tests/cluster/") else module


JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""Java options of every Spark JVM the suite starts (short-lived: the optimising compiler does not pay)."""


def _quick_jvms(config: pytest.Config) -> None:
    """Give the suite's Spark JVMs :data:`JVM_OPTIONS`, through Spark's own configuration.

    A ``spark-defaults.conf`` in a fresh ``SPARK_CONF_DIR`` reaches every driver (the test modules'
    sessions, sparknet's own, the commands run as subprocesses) and, through the application, every
    executor; it also gives the test modules' own sessions the Python daemon sparknet's sessions
    get (:data:`sparknet.spark.session.DAEMON_MODULE`: workers forked with torch loaded); ``SPARK_DAEMON_JAVA_OPTS`` reaches the test clusters' masters and workers. A user's own
    ``SPARK_CONF_DIR`` is left as it is. The xdist workers inherit the controller's.
    """
    if "SPARK_CONF_DIR" in os.environ:
        return
    folder = tempfile.mkdtemp(prefix="sparknet-tests-conf-")
    Path(folder, "spark-defaults.conf").write_text(f"spark.driver.extraJavaOptions {JVM_OPTIONS}\n"
                                                   f"spark.executor.extraJavaOptions {JVM_OPTIONS}\n"
                                                   f"{DAEMON_MODULE_KEY} {DAEMON_MODULE}\n")
    os.environ["SPARK_CONF_DIR"] = folder
    os.environ.setdefault("SPARK_DAEMON_JAVA_OPTS", JVM_OPTIONS)
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


def _leave_the_cache_as_found(config: pytest.Config) -> None:
    """Remove, at the end of the run, the Parquet copies of ``sparknet train --data`` files that the run's tests
    wrote into the user's cache (``parquet/data-*``, one per file a test made, named by its path and so new every
    run). Done once, by the process that runs the session (the xdist controller, after its workers)."""
    if hasattr(config, "workerinput"):
        return
    from sparknet.datasets.cache import cache_root

    folder = cache_root() / "parquet"
    before = set(folder.glob("data-*"))

    def remove() -> None:
        for path in set(folder.glob("data-*")) - before:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    config.add_cleanup(remove)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Tiers(config), "sparknet-tiers")
    _quick_jvms(config)
    _leave_the_cache_as_found(config)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which would make its scheduler for --dist
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under pytest-xdist, a test module runs whole on one worker (its one SparkSession and module
    fixtures stay one), the multi-host tier runs on one worker (one rig at a time), and the work goes
    out in the order it was collected: the multi-host tier and the Spark modules, the longest, first.
    (``--dist loadscope``, the suite's default; another ``--dist`` is xdist's own.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # not by the number of tests: a Spark test outweighs many

        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return ModuleScheduling(config, log)
