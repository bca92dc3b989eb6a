"""Sessions that sparknet starts keep Spark's own logging out of the user's way from the JVM's start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sparknet.spark import session as spark_session
from sparknet.spark.session import LOG_LEVEL_ENV, quiet_log_settings, spark_log_level

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from first_round import trimmed_java  # noqa: E402  (the benchmark's copy of this machine's Java, as jlink makes one)

pytestmark = pytest.mark.spark

DRIVER, EXECUTOR = "spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions"


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No Spark configuration folder of the user's, no submit arguments, no level set, no JVM yet."""
    monkeypatch.setattr(spark_session, "_jvm_running", lambda: False)  # another module's session may have started one
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    monkeypatch.setenv("SPARK_CONF_DIR", str(conf_dir))
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS", raising=False)
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    monkeypatch.setenv(spark_session.CLASS_ARCHIVE_ENV, "0")  # no class archive written at the JVM's exit (a minute)
    return conf_dir


def test_driver_and_local_executors_point_at_the_packaged_file(clean_env):
    out = quiet_log_settings("local-cluster[2,1,1024]", {}, "ERROR")
    assert set(out) == {DRIVER, EXECUTOR}
    for options in out.values():
        assert "-Dlog4j2.configurationFile=file:" in options and options.endswith("-DSPARKNET_SPARK_LOG_LEVEL=ERROR")
        assert "-Dspark" not in options  # Spark refuses -Dspark... in executor options
    path = out[DRIVER].split("configurationFile=file://")[1].split()[0]
    assert "rootLogger.level" in open(path, encoding="utf-8").read()


def test_remote_executors_keep_their_cluster_logging(clean_env):
    assert set(quiet_log_settings("spark://10.0.0.1:7077", {}, "WARN")) == {DRIVER}
    assert set(quiet_log_settings("yarn", {}, "WARN")) == {DRIVER}


def test_user_options_are_kept_and_a_user_log4j_file_wins(clean_env):
    out = quiet_log_settings("local[2]", {DRIVER: "-Xss4m -Dfoo=1"}, "ERROR")
    assert out[DRIVER].startswith("-Xss4m -Dfoo=1 -Dlog4j2.configurationFile=")
    mine = {DRIVER: "-Dlog4j2.configurationFile=/etc/my-log4j2.properties",
            EXECUTOR: "-Dlog4j.configurationFile=/etc/old.properties"}
    assert quiet_log_settings("local[2]", mine, "ERROR") == {}


def test_spark_defaults_options_are_merged_not_replaced(clean_env):
    (clean_env / "spark-defaults.conf").write_text(
        "# site settings\nspark.driver.extraJavaOptions   -XX:+UseG1GC -Dsite=1\nspark.executor.memory 2g\n")
    out = quiet_log_settings("local[2]", {}, "ERROR")
    assert out[DRIVER].startswith("-XX:+UseG1GC -Dsite=1 -Dlog4j2.configurationFile=")


def test_a_log4j_file_in_the_conf_dir_or_java_options_in_submit_args_leave_logging_alone(clean_env, monkeypatch):
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "--driver-java-options -Dx=1 pyspark-shell")
    assert quiet_log_settings("local[2]", {}, "ERROR") == {}
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS")
    (clean_env / "log4j2.properties").write_text("rootLogger.level = info\n")
    assert quiet_log_settings("local[2]", {}, "ERROR") == {}


def test_the_driver_jvm_leaves_its_optimizing_compiler_to_hot_code_unless_told(clean_env):
    """A session sparknet starts asks its driver JVM for C2 only on code far hotter than Java's defaults (a faster
    start on few cores); a user's own tiers or thresholds, in the session's settings or Spark's defaults, win."""
    assert spark_session.LATE_OPTIMIZER in spark_session.session_settings("local[2]")[DRIVER]
    mine = spark_session.session_settings("local[2]", {DRIVER: "-Xss4m -XX:TieredStopAtLevel=1"})[DRIVER]
    assert mine.startswith("-Xss4m -XX:TieredStopAtLevel=1") and "Tier4" not in mine
    (clean_env / "spark-defaults.conf").write_text("spark.driver.extraJavaOptions -XX:Tier4CompileThreshold=9000\n")
    assert spark_session.LATE_OPTIMIZER not in spark_session.session_settings("local[2]")[DRIVER]


def test_a_running_driver_jvm_keeps_the_options_it_was_started_with(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "40000")  # what spark-submit gives the Python driver
    assert quiet_log_settings("local[2]", {}, "ERROR") == {}


def test_log_level_from_argument_environment_or_default(clean_env, monkeypatch):
    assert spark_log_level() == "ERROR"
    monkeypatch.setenv(LOG_LEVEL_ENV, "info")
    assert spark_log_level() == "INFO"
    assert spark_log_level("warn") == "WARN"
    with pytest.raises(ValueError, match="not one of"):
        spark_log_level("loud")


def test_a_new_session_starts_quiet(clean_env, tmp_path):
    """A fresh process (the JVM starts once per process) prints no Spark chatter while it starts and runs a job."""
    script = textwrap.dedent("""
        from sparknet.spark import get_session
        spark = get_session("local[1]", conf={"spark.ui.enabled": "false"})
        try:
            # the job's Python workers are forked by sparknet's daemon: torch is loaded before the task imports it
            rows = spark.sparkContext.parallelize(range(10), 2).map(
                lambda x: (x, __import__("sys").modules.get("torch") is not None)).collect()
            assert sum(x for x, _ in rows) == 45
            print("torch preloaded", sorted({loaded for _, loaded in rows}))
            # a mapInArrow job's workers come from the same daemon (its start is paid once, not twice)
            import os
            import pyarrow as pa
            rdd_daemon = spark.sparkContext.parallelize([0], 1).map(lambda _: os.getppid()).collect()
            arrow_daemon = spark.range(0, 1, numPartitions=1).mapInArrow(
                lambda batches: (pa.RecordBatch.from_pydict({"d": [os.getppid()]}) for _ in batches),
                "d long").collect()
            print("one daemon", rdd_daemon == [row.d for row in arrow_daemon])
            root = spark.sparkContext._jvm.org.apache.logging.log4j.LogManager.getRootLogger()
            print("root level", root.getLevel().toString())
            print("driver memory", spark.conf.get("spark.driver.memory"))
        finally:
            spark.stop()
    """)
    proc = subprocess.run([sys.executable, "-W", "ignore::FutureWarning", "-c", script], capture_output=True,
                          text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "root level ERROR" in proc.stdout
    assert f"driver memory {spark_session.driver_memory()}" in proc.stdout  # a local session's larger heap
    assert "torch preloaded [True]" in proc.stdout
    assert "one daemon True" in proc.stdout
    for chatter in ("Using Spark's default log4j profile", "Setting default log level", " WARN ", " INFO "):
        assert chatter not in proc.stderr, proc.stderr


def test_a_users_driver_memory_wins(clean_env, monkeypatch):
    assert not spark_session._user_sets_driver_memory(None)
    assert spark_session._user_sets_driver_memory({"spark.driver.memory": "6g"})
    (clean_env / "spark-defaults.conf").write_text("spark.driver.memory   4g\n")
    assert spark_session._user_sets_driver_memory(None)


def test_sparknet_train_with_its_output_in_a_log_writes_one_progress_line_per_round(tmp_path):
    """``sparknet train ... 2> run.log`` (nohup, CI, a scheduler's log): a plain line for every round."""
    log_path, metrics = tmp_path / "run.log", tmp_path / "m.jsonl"
    with open(log_path, "w") as err:
        proc = subprocess.run([sys.executable, "-W", "ignore::FutureWarning", "-m", "sparknet.cli", "train",
                               "--model", "mlp", "--dataset", "synthetic", "--workers", "2", "--steps", "60",
                               "--tau", "20", "--master", "local[2]", "--metrics-out", str(metrics)],
                              stdout=subprocess.PIPE, stderr=err, text=True, timeout=300, cwd=tmp_path)
    text = log_path.read_text()
    assert proc.returncode == 0, text[-3000:]
    rounds = [json.loads(line) for line in metrics.read_text().splitlines() if '"event": "round"' in line]
    lines = [line for line in text.splitlines() if line.startswith("[sparknet] ")]
    assert len(rounds) == 3 and len(lines) == 3, text[-3000:]
    summary = json.loads(metrics.read_text().splitlines()[-1])
    result = json.loads(proc.stdout.splitlines()[-1])  # what the command printed
    # the first round began after the session and the data, and before the command ended
    assert summary["setup_s"] < summary["first_round_s"] == result["first_round_s"] < result["command_s"]
    # when each step before it ended, in the command's seconds, in the order they run (the rounds engine stages)
    phases = summary["phases_s"]
    # the data set loaded and the model built in a thread while the session starts
    assert list(phases)[0] == "imported" and set(list(phases)[1:4]) == {"loaded", "built", "session"}
    assert list(phases).index("loaded") < list(phases).index("built")
    assert list(phases)[4:] == ["data", "fit", "planned", "staged", "checked", "launch", "first_round"]
    assert 0 < phases["session"] and all(a <= b for a, b in zip(phases.values(), list(phases.values())[1:]))
    assert phases["first_round"] == summary["first_round_s"]
    assert summary["rounds_s"] == pytest.approx(sum(r["round_s"] for r in rounds))
    assert 0 < summary["mean_compute_s"] <= summary["slowest_compute_s"] <= summary["rounds_s"]
    # within the rounds' time; a round the evaluation budget skipped has none
    assert summary["eval_s"] == pytest.approx(sum(r.get("eval_s", 0.0) for r in rounds))
    assert 0 < summary["eval_s"] < summary["train_s"]
    for i, (line, record) in enumerate(zip(lines, rounds), 1):
        assert line.startswith(f"[sparknet] {20 * i}/60 steps ({100 * i / 3:.0f}%) round={i} "), line
        assert f"loss={record['loss']:.4g}" in line and " elapsed" in line
    assert "\r" not in text  # nothing redrawn in a log


def test_the_class_archive_is_written_once_then_mapped(tmp_path, monkeypatch):
    """The first session writes its JVM's classes at exit; a dump a minute old becomes the archive later sessions
    map, and the other dumps go."""
    monkeypatch.delenv(spark_session.CLASS_ARCHIVE_ENV, raising=False)
    conf = tmp_path / "conf"
    (conf / "spark-defaults.conf").parent.mkdir()
    (conf / "spark-defaults.conf").write_text("spark.ui.enabled false\n")
    monkeypatch.setenv("SPARK_CONF_DIR", str(conf))
    assert spark_session.class_archive_options(tmp_path) == ""  # Spark would put that folder on the class path
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path / "absent"))
    first = spark_session.class_archive_options(tmp_path)
    assert first.startswith("-XX:ArchiveClassesAtExit=") and first.split()[0].endswith(f".{os.getpid()}.jsa")
    dump = Path(first.split()[0].split("=", 1)[1])
    other = dump.with_name(dump.name.replace(f".{os.getpid()}.", ".1."))
    for path in (dump, other):
        path.write_bytes(b"classes")
        os.utime(path, (time.time() - 120, time.time() - 120))  # done: older than a minute
    mapped = spark_session.class_archive_options(tmp_path)
    archive = Path(mapped.split()[0].split("=", 1)[1])
    assert mapped.startswith("-XX:SharedArchiveFile=") and archive.read_bytes() == b"classes"
    assert list(tmp_path.glob("*.jsa")) == [archive]
    monkeypatch.setenv(spark_session.CLASS_ARCHIVE_ENV, "0")
    assert spark_session.class_archive_options(tmp_path) == ""


def test_a_session_starts_quietly_on_a_class_archive_that_does_not_match(tmp_path, monkeypatch):
    """A real JVM handed an archive that is not one of its own (another Java wrote it, or it was cut short) loads its
    classes as usual: the session starts, runs a job and says nothing about it. (Writing a real archive at the JVM's
    exit takes a minute here: measured by ``benchmarks/first_round.py``, not in the suite.)"""
    env = {**os.environ, "SPARKNET_CACHE": str(tmp_path / "cache")}
    for name in (spark_session.CLASS_ARCHIVE_ENV, "SPARK_CONF_DIR"):  # the suite's conf folder: no archive with it
        env.pop(name, None)
    monkeypatch.delenv("SPARK_CONF_DIR", raising=False)
    monkeypatch.delenv(spark_session.CLASS_ARCHIVE_ENV, raising=False)
    folder = tmp_path / "cache" / "jvm"
    dump = Path(spark_session.class_archive_options(folder).split()[0].split("=", 1)[1])  # this Java's and Spark's
    archive = folder / (dump.name.split(".")[0] + ".jsa")
    archive.write_bytes(b"not a class archive")
    script = textwrap.dedent("""
        from sparknet.spark import get_session
        spark = get_session("local[1]", conf={"spark.ui.enabled": "false"})
        try:
            assert spark.sparkContext.parallelize(range(4), 2).sum() == 6
            args = spark.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments()
            print("archive options", [a for a in args if "Archive" in a])
        finally:
            spark.stop()
    """)
    proc = subprocess.run([sys.executable, "-W", "ignore::FutureWarning", "-c", script], capture_output=True,
                          text=True, timeout=240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"-XX:SharedArchiveFile={archive}" in proc.stdout
    assert "cds" not in proc.stderr.lower() and "archive" not in proc.stderr.lower(), proc.stderr[-3000:]


def test_a_java_without_base_archives_gets_one_of_sparknet_then_the_class_archive(tmp_path, monkeypatch):
    """Java 17 without its base archive refuses to start when asked to write an archive of an application's classes
    (a jlink image, as the Spark lab's bundled Java is). Given the driver's heap, sparknet writes a base archive for
    that Java once, and the JVM starts on it, writes the classes it loaded at exit, and maps both later; without the
    heap, no archive options."""
    monkeypatch.delenv(spark_session.CLASS_ARCHIVE_ENV, raising=False)
    monkeypatch.delenv("SPARK_CONF_DIR", raising=False)
    java = trimmed_java(tmp_path / "jdk") / "bin" / "java"
    refused = subprocess.run([str(java), f"-XX:ArchiveClassesAtExit={tmp_path / 'x.jsa'}", "-version"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "base CDS archive" in refused.stdout + refused.stderr  # what the lab saw
    assert subprocess.run([str(java), "-version"], capture_output=True, timeout=60).returncode == 0  # a working Java
    cache = tmp_path / "cache"
    assert spark_session.class_archive_options(cache).startswith("-XX:ArchiveClassesAtExit=")  # the machine's Java
    monkeypatch.setenv("JAVA_HOME", str(java.parent.parent))
    assert spark_session.class_archive_options(cache) == ""  # the heap the base must be written for is not known
    assert spark_session.class_archive_options(cache, heap="not memory") == ""

    first = spark_session.class_archive_options(cache, heap="2g").split()
    base = next(cache.glob("base-*-2048m.jsa"))  # written by that Java, for a 2 GiB heap
    assert first[0] == f"-XX:SharedArchiveFile={base}" and first[1].startswith("-XX:ArchiveClassesAtExit=")
    assert spark_session.class_archive_options(cache, heap="2048m").split()[0] == first[0]  # written once
    dump = Path(first[1].split("=", 1)[1])
    started = subprocess.run([str(java), "-Xmx2g", *first, "-version"], capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr[-2000:]
    assert dump.is_file() and dump.stat().st_size > 0  # the classes it loaded, on top of the base
    os.utime(dump, (time.time() - 120, time.time() - 120))
    mapped = spark_session.class_archive_options(cache, heap="2g").split()
    assert mapped[0].startswith(f"-XX:SharedArchiveFile={base}:") and not dump.exists()
    shared = subprocess.run([str(java), "-Xmx2g", mapped[0], "-Xshare:on", "-version"], capture_output=True,
                            text=True, timeout=60)
    assert shared.returncode == 0, shared.stderr[-2000:]  # -Xshare:on: it starts only if it maps both
    other = spark_session.class_archive_options(cache, heap="40g").split()  # past 32 GiB: a base of its own
    assert other[0] == f"-XX:SharedArchiveFile={next(cache.glob('base-*-40960m.jsa'))}"


_DRIVER_SETTINGS = """
def driver_settings(spark):  # what a session's driver JVM says of sparknet's settings
    from sparknet.spark.session import LATE_OPTIMIZER, driver_memory
    args = list(spark.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    return [spark.sparkContext.master, f"-Xmx{driver_memory()}" in args,
            any("log4j2.configurationFile" in a for a in args), all(a in args for a in LATE_OPTIMIZER.split())]
"""


def _run_by_a_fresh_process(tmp_path, script: str) -> subprocess.CompletedProcess:
    """``script`` (after :data:`_DRIVER_SETTINGS`) run by a fresh interpreter in ``tmp_path`` with a user's empty Spark
    configuration folder (not the suite's: its JVM options would win) and no class archive; it must succeed."""
    (tmp_path / "conf").mkdir()
    env = {**os.environ, spark_session.CLASS_ARCHIVE_ENV: "0",  # no archive written at the JVM's exit (a minute)
           "SPARK_CONF_DIR": str(tmp_path / "conf")}
    proc = subprocess.run([sys.executable, "-c", _DRIVER_SETTINGS + textwrap.dedent(script)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_driver_jvm_started_ahead_is_the_session_s_with_sparknet_s_settings(tmp_path):
    """start_driver_jvm starts the driver JVM in a thread before torch loads (as ``python -m sparknet train`` does on
    fewer than four cores); get_session then makes its session on that JVM, with the master it is given, and the JVM
    has the heap and the Java options sparknet sets for its driver."""
    printed = _run_by_a_fresh_process(tmp_path, """
        import sys
        from sparknet.spark.session import get_session, start_driver_jvm
        thread = start_driver_jvm()
        assert "torch" not in sys.modules
        thread.join(180)
        from pyspark import SparkContext
        gateway = SparkContext._gateway
        assert gateway is not None and start_driver_jvm() is None  # up, and not started twice
        import torch  # noqa: F401  (what the command loads meanwhile)
        spark = get_session("local[1]", conf={"spark.ui.enabled": "false"})
        try:
            assert SparkContext._gateway is gateway and spark.sparkContext.parallelize(range(4), 2).sum() == 6
            print(*driver_settings(spark))
        finally:
            spark.stop()
    """).stdout.split()
    assert printed[-4:] == ["local[1]", "True", "True", "True"], printed


def test_a_session_started_ahead_is_the_one_get_session_returns_with_sparknet_s_settings(tmp_path):
    """start_session_ahead starts the whole session in a thread before torch loads (as ``python -m sparknet train``
    does where cores are spare), then its Python workers (one job); get_session on the same master waits for the
    session and returns it, the active session of the asking thread, its driver JVM with the heap and the Java
    options sparknet sets; asked for another master, it stops that one and starts the one asked for."""
    proc = _run_by_a_fresh_process(tmp_path, """
        import sys
        import time
        from sparknet.spark.backend import start_python_workers
        from sparknet.spark.session import get_session, start_session_ahead
        thread = start_session_ahead("local[1]", then=start_python_workers)
        assert "torch" not in sys.modules
        assert start_session_ahead("local[1]") is None  # not started twice
        import torch  # noqa: F401  (what the command loads meanwhile)
        from pyspark.sql import SparkSession
        spark = get_session("local[1]")
        assert SparkSession.getActiveSession() is spark
        thread.join(180)  # then it started the session's Python workers
        assert not thread.is_alive()
        try:
            tracker, deadline = spark.sparkContext.statusTracker(), time.monotonic() + 60
            while (job := tracker.getJobInfo(0)) is None or job.status == "RUNNING":  # the tracker hears late
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert (job.status, tracker.getJobInfo(1)) == ("SUCCEEDED", None)  # one job, done
            assert spark.sparkContext.parallelize(range(4), 2).sum() == 6 and spark.range(3).count() == 3
            print(*driver_settings(spark))
        finally:
            spark.stop()
        start_session_ahead("local[1]").join(180)
        other = get_session("local[2]")  # not the master started ahead
        try:
            print(other.sparkContext.master, other.sparkContext.parallelize(range(4), 2).sum())
        finally:
            other.stop()
    """)
    assert proc.stdout.split()[-6:] == ["local[1]", "True", "True", "True", "local[2]", "6"], proc.stdout


_HANDED_OVER = textwrap.dedent("""
    import sys
    from sparknet.spark import session
    handed = []  # what each get_session found started ahead
    found = session._session_ahead
    session._session_ahead = lambda master: handed.append(found(master)) or handed[-1]
    start = session.start_session_ahead

    def start_and_wait(*args, **kwargs):  # the session made before the command's imports end, as with cores to
        thread = start(*args, **kwargs)  # spare: its first Java calls outside the command's own warning filter
        session._AHEAD["made"].wait(180)
        return thread

    session.start_session_ahead = start_and_wait
    from sparknet.__main__ import main
    code = main()
    print("HANDED", [getattr(s, "sparkContext", None) and f"{s.sparkContext.master} {s.sparkContext.appName}"
                     for s in handed], file=sys.stderr)
    sys.exit(code)
""")
"""``python -m sparknet`` run so that it says which session each ``get_session`` was handed from those started
ahead (``HANDED ['master name']``; ``[None]``: none)."""


def _command_ahead_or_not(tmp_path, setting: str, *argv: str) -> str:
    """``python -m sparknet *argv`` in ``tmp_path`` with ``$SPARKNET_SESSION_AHEAD`` at ``setting``: it succeeds and
    prints no pandas notice; the masters and names of the sessions it was handed from those started ahead."""
    env = {**os.environ, spark_session.SESSION_AHEAD_ENV: setting, spark_session.CLASS_ARCHIVE_ENV: "0"}
    proc = subprocess.run([sys.executable, "-c", _HANDED_OVER, *argv], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert spark_session.PANDAS_NOTICE not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr.split("HANDED ")[-1].strip()


def test_the_command_trains_the_same_with_its_session_started_ahead_or_its_jvm_alone(tmp_path):
    """``python -m sparknet train`` on two workers, its whole session started ahead or its driver JVM alone
    (``$SPARKNET_SESSION_AHEAD``): the command trains on the session started ahead where there is one, on the master
    it asks for, and the seeded fit ends with the same losses either way. pyspark's notice about pandas, which the
    session's first Java call with arguments gives as it loads pyspark's testing helpers (in the thread, with the
    session ahead), is not printed: the command hides it."""
    summaries, losses = {}, {}
    for setting in ("1", "0"):
        metrics = tmp_path / f"ahead-{setting}.jsonl"
        handed = _command_ahead_or_not(tmp_path, setting, "train", "--model", "mlp", "--dataset", "synthetic",
                                       "--workers", "2", "--steps", "20", "--tau", "10", "--quiet",
                                       "--metrics-out", str(metrics))
        assert handed == ("['local[2] sparknet']" if setting == "1" else "[None]")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        summaries[setting] = records[-1]
        losses[setting] = [r["loss"] for r in records if r.get("event") == "round"]
    for summary in summaries.values():
        assert summary["event"] == "summary" and summary["master"] == "local[2]" and summary["steps"] == 20
    assert len(losses["1"]) == 2 and losses["1"] == losses["0"]
    assert summaries["1"]["test_loss"] == summaries["0"]["test_loss"]


def test_the_command_scores_the_same_with_its_session_started_ahead_or_its_jvm_alone(tmp_path):
    """``python -m sparknet predict`` starts its session while torch loads too: handed the session started ahead
    (its default master, ``local[*]``, and its own name), it writes the same scores as with its driver JVM alone."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sparknet import Net, zoo
    from sparknet.model_io import save_model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype(np.float32)
    net = Net(zoo.mlp(input_shape=[5], hidden=[8], num_classes=3), batch_size=16, seed=0)
    net.set_training_data((x, (x[:, 0] > 0).astype(np.int64)))
    net.train(5)
    save_model(tmp_path / "model", net)
    pq.write_table(pa.table({"id": np.arange(40), "features": list(x)}), tmp_path / "data.parquet")
    scored = {}
    for setting in ("1", "0"):
        handed = _command_ahead_or_not(tmp_path, setting, "predict", "--model-dir", "model", "--data", "data.parquet",
                                       "--out", f"scored-{setting}", "--partitions", "2")
        assert handed == ("['local[*] sparknet-predict']" if setting == "1" else "[None]")  # its own name
        scored[setting] = pq.read_table(tmp_path / f"scored-{setting}").to_pandas().sort_values("id")
    assert len(scored["1"]) == 40 and scored["1"]["prediction"].tolist() == scored["0"]["prediction"].tolist()
    assert np.array_equal(np.stack(scored["1"]["probability"]), np.stack(scored["0"]["probability"]))


def test_a_session_sparknet_starts_spreads_a_shuffle_s_partitions_over_the_hosts_unless_told(clean_env):
    """A shuffle's reduce tasks are placed with no preference for the hosts holding its map output (a small table
    dealt into K partitions would otherwise be staged on the one host that read it); the user's setting, in the
    session's conf or Spark's defaults, wins."""
    key = "spark.shuffle.reduceLocality.enabled"
    assert spark_session.session_settings("spark://h:7077")[key] == "false"
    assert spark_session.session_settings("spark://h:7077", {key: "true"})[key] == "true"
    (clean_env / "spark-defaults.conf").write_text(f"{key} true\n")
    assert key not in spark_session.session_settings("spark://h:7077")


def test_a_session_of_the_user_s_own_on_a_cluster_is_told_how_to_spread_the_workers():
    for master, value, told in (("spark://h:7077", None, True), ("spark://h:7077", "true", True),
                                ("spark://h:7077", "false", False), ("local[4]", None, False),
                                ("local-cluster[2,1,1024]", "true", False), ("yarn", " False ", False)):
        message = spark_session.spread_warning(master, value)
        assert (message is not None) == told, (master, value)
    assert "set to false" in spark_session.spread_warning("yarn", None)
