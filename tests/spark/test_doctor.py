"""`sparknet doctor` on local[2]: all OK for LeNet; FAIL with a fix when memory is too small."""

import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparknet import zoo
from sparknet.cli import main
from sparknet.tools.doctor import (COMMUNICATION_COPIES, CheckResult, Status, estimate_training_memory, format_bytes,
                                   format_table, parse_memory, run_doctor, task_memory_budget)

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def spark():
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2]").appName("test-doctor")
               .config("spark.ui.enabled", "false").config("spark.python.worker.reuse", "true")
               # 512 MiB a task: LeNet's measured Python worker (290-310 MiB with torch) sat at the 80% line of
               # Spark's default 768 MiB shared by two slots, a WARN some runs and not others
               .config("spark.executor.memory", "1g").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


def _by_check(results):
    out = {}
    for r in results:
        out.setdefault(r.check, []).append(r)
    return out


def test_local_two_slots_is_all_ok(spark):
    results = run_doctor(spark=spark, model="lenet", timeout_s=120)
    checks = _by_check(results)
    assert {"executors", "versions", "pickle", "memory", "barrier"} <= set(checks)
    assert [r for r in results if r.status is not Status.OK] == []
    assert "2 task slots" in checks["executors"][0].detail
    assert any(r.where == "local executor" for r in checks["versions"])
    assert "2 barrier tasks met" in checks["barrier"][0].detail
    assert not spark.sparkContext._jsc.sc().isStopped()  # a session it was given is left running


def test_model_too_big_for_the_executor_memory_fails_with_the_fix(spark, capsys):
    # AlexNet (61 M parameters, batch 64) in 1 GiB shared by 2 task slots.
    rc = main(["doctor", "--model", "alexnet", "--executor-memory", "1g", "--no-barrier", "--timeout", "120"])
    out = capsys.readouterr().out
    assert rc == 1
    memory_lines = [ln for ln in out.splitlines() if ln.startswith("memory")]
    assert memory_lines and "FAIL" in memory_lines[0]
    assert "fix: set --conf spark.executor.memory=" in out
    assert "0 FAIL" not in out.splitlines()[-1]

    results = run_doctor(spark=spark, model="alexnet", executor_memory="1g", barrier=False)
    (memory,) = [r for r in results if r.check == "memory"]
    assert memory.status is Status.FAIL
    # the suggested size covers the estimate for both slots
    suggested = memory.fix.split("spark.executor.memory=")[1].split()[0]
    assert parse_memory(suggested) >= 2 * estimate_training_memory(zoo.alexnet(batch_size=64), batch_size=64).total
    assert all(r.status is Status.OK for r in results if r.check != "memory")


def test_partition_skew_warns(spark, tmp_path):
    path = tmp_path / "skewed"
    path.mkdir()
    for i, rows in enumerate((95, 5)):  # two files: two partitions
        table = pa.table({"features": [[float(i)] * 4] * rows, "label": [i] * rows})
        pq.write_table(table, path / f"part-{i}.parquet")
    results = run_doctor(spark=spark, model="lenet", data=str(path), workers=2, skew_ratio=1.5, barrier=False)
    (skew,) = [r for r in results if r.check == "skew"]
    assert skew.status is Status.WARN
    assert "100 rows in 2 partitions: 5 to 95 rows, max/mean 1.90" in skew.detail
    assert "repartition(2)" in skew.fix
    # with another worker count the engines repartition evenly: no warning
    results = run_doctor(spark=spark, model="lenet", data=str(path), workers=3, skew_ratio=1.5, barrier=False)
    (skew,) = [r for r in results if r.check == "skew"]
    assert skew.status is Status.OK and "3 even partitions" in skew.detail
    missing = run_doctor(spark=spark, model="lenet", data=str(tmp_path / "nope"), barrier=False)
    assert [r.status for r in missing if r.check == "data"] == [Status.FAIL]


def test_a_probe_past_its_timeout_or_failing_is_a_finding_with_advice(spark):
    from sparknet.tools.doctor import _probe_failure, _run_job

    sc = spark.sparkContext

    def sleep(rows):
        import time

        time.sleep(120)
        yield 0

    value, error = _run_job(sc, "probe executors", sc.parallelize(range(2), 2).mapPartitions(sleep).collect, 3)
    assert value is None and isinstance(error, TimeoutError)
    assert str(error).startswith("probe executors did not finish within 3 s")
    assert "no executor ran the probe in time" in _probe_failure(error, 3).fix
    assert sc.getLocalProperty("spark.jobGroup.id") is None  # the caller's thread keeps its own (none)

    def broken(rows):
        raise ModuleNotFoundError("No module named 'sparknet'")
        yield

    value, error = _run_job(sc, "probe executors", sc.parallelize(range(2), 2).mapPartitions(broken).collect, 120)
    finding = _probe_failure(error, 120)
    assert finding.status is Status.FAIL and "ModuleNotFoundError: No module named 'sparknet'" in finding.detail
    assert "install sparknet and torch on every node" in finding.fix


def test_estimate_counts_weights_state_and_activations():
    net = zoo.lenet(batch_size=64)
    est = estimate_training_memory(net, batch_size=32, solver_type="adam")
    n_params = 431_080  # LeNet of Listing 2
    assert est.weights == est.gradients == 4 * n_params
    assert est.optimizer == 2 * 4 * n_params  # Adam keeps two moments
    assert est.communication == COMMUNICATION_COPIES * 4 * n_params
    per_sample = sum(v for k, v in {"data": 784, "label": 1, "conv1": 20 * 24 * 24, "pool1": 20 * 12 * 12,
                                    "conv2": 50 * 8 * 8, "pool2": 50 * 4 * 4, "ip1": 500, "ip2": 10}.items())
    assert est.activations >= 2 * 4 * per_sample * 32
    assert estimate_training_memory(net, batch_size=64).activations > est.activations


def test_budget_and_table_formatting():
    budgets = task_memory_budget(declared_executor_memory=parse_memory("4g"), executor_cores=4,
                                 host_available=parse_memory("64g"), tasks_on_host=8)
    assert [b.bytes for b in budgets] == [parse_memory("1g"), parse_memory("8g")]
    assert parse_memory("512") == parse_memory("512m") == parse_memory("512MiB") == 512 << 20
    assert parse_memory("512b") == 512 and parse_memory("1p") == 1 << 50  # Spark's byte strings, b to p
    with pytest.raises(ValueError, match="memory size"):
        parse_memory("lots")
    table = format_table([CheckResult("memory", "executor a/1", Status.FAIL, "needs more", "set --conf x=1"),
                          CheckResult("barrier", "cluster", Status.OK, "met")])
    assert "fix: set --conf x=1" in table and table.splitlines()[-1] == "1 OK, 0 WARN, 1 FAIL"


def test_estimate_holds_one_process_part_of_a_split_or_sharded_replica():
    from sparknet.parallel import weight_bytes_per_rank

    net = zoo.lenet(batch_size=64)
    whole = estimate_training_memory(net, batch_size=64)
    split = estimate_training_memory(net, batch_size=64, model_parallel=2)
    sharded = estimate_training_memory(net, batch_size=64, shard=4)
    # ip1 (800 -> 500, column) and ip2 (500 -> 10, row) split in two: half of ip1 and of ip2's weight on each process
    assert split.weights == split.gradients == whole.weights - 4 * (400_000 + 500 + 5_000) // 2
    assert split.communication == COMMUNICATION_COPIES * split.weights
    # a quarter of every parameter, and ip1 gathered whole while it computes
    assert sharded.gradients == weight_bytes_per_rank(net, shard=4) < whole.gradients // 3
    assert sharded.weights == sharded.gradients + 4 * (400_000 + 500)
    assert split.activations == sharded.activations == whole.activations  # counted whole: an upper bound


def test_a_worker_of_several_processes_is_checked_process_by_process(spark, tmp_path):
    # AlexNet in 1 GiB for two slots fails, and the fix names sharding; a worker of two processes sharding it holds
    # its part of the weights and solver state in each
    whole, sharded = (run_doctor(spark=spark, model="alexnet", executor_memory="1g", barrier=False, **kw)
                      for kw in ({}, {"workers": 1, "procs_per_worker": 2, "shard_replica": True}))
    (w,), (s,) = ([r for r in results if r.check == "memory"] for results in (whole, sharded))
    assert w.status is Status.FAIL and "--shard-replica" in w.fix
    part = estimate_training_memory(zoo.alexnet(batch_size=64), batch_size=64, shard=2)
    assert f"gradients {format_bytes(part.gradients)}" in s.detail and format_bytes(part.gradients) not in w.detail
    # the rows: a split copy's process holds both partitions in memory, or streams its own
    path = tmp_path / "rows"
    path.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"features": [[0.5] * 4] * 50, "label": [i] * 50}), path / f"part-{i}.parquet")
    held = {}
    for mode in ("memory", "stream"):
        results = run_doctor(spark=spark, model="lenet", data=str(path), workers=1, model_parallel=2,
                             data_mode=mode, barrier=False)
        (held[mode],) = [r.detail for r in results if r.check == "memory"]
    assert f"data {format_bytes(2 * 50 * 24)}" in held["memory"]
    assert "the 2 partitions of its split copy" in held["memory"]
    assert f"data {format_bytes(50 * 24)}" in held["stream"] and "streamed through one window" in held["stream"]
