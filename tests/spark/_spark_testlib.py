"""Helpers shared by the Spark test modules: a session per module, small data, hand-run references."""

from __future__ import annotations

import copy
import json
import os
import stat
import sys

import numpy as np
import torch

from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.spark.session import SIMPLIFIED_TRACEBACK_KEY
from sparknet.step import worker_seed

BASE_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.executor.memory": "768m",
    "spark.python.worker.reuse": "true",
    "spark.python.unix.domain.socket.enabled": "true",  # as sparknet's own sessions (get_session) set it
    SIMPLIFIED_TRACEBACK_KEY: "1",  # so too: the workers of RDD and mapInArrow jobs come from one daemon
}


def start_session(master: str, extra: dict | None = None):
    """A SparkSession for one test module (stop it in the fixture's finalizer)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName(f"sparknet-tests-{master}")
    for key, value in {**BASE_CONF, **(extra or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def stop_session(session, extra: dict | None = None) -> None:
    """Stop a module's session and take its ``extra`` settings out of the JVM, which outlives it.

    The first session of a test process starts the JVM with its settings as system properties, and every
    later SparkContext in that JVM reads them: a GPU amount per task left behind by the local-cluster
    module would keep every task of a later ``local[2]`` session waiting for a GPU that is not there."""
    jvm = session.sparkContext._jvm
    session.stop()
    for key in extra or {}:
        jvm.java.lang.System.clearProperty(key)


def connect_session(master: str, name: str, extra: dict | None = None):
    """A module's Spark Connect session: a real Connect server started from the installed pyspark on ``master``,
    listening on loopback, with ``extra`` settings; a fixture's body (yields it, stops the server after).

    The server takes a port the OS picks, which the client reads back from it (pyspark's way for its own tests,
    SPARK-42272, switched on by ``SPARK_TESTING`` while the session starts): two test modules running at once in
    the suite's two workers each get their own server. The JVM is started first, without ``SPARK_TESTING``, so
    the setting reaches nothing else."""
    import warnings

    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    conf = {**BASE_CONF, **(extra or {}), "spark.connect.grpc.binding.address": "127.0.0.1"}
    SparkContext._ensure_initialized(conf=SparkConf().setAll(list(conf.items())))
    builder = SparkSession.builder.remote(master).appName(name)
    for key, value in conf.items():
        builder = builder.config(key, value)
    testing = "SPARK_TESTING" not in os.environ
    os.environ.setdefault("SPARK_TESTING", "1")
    try:
        with warnings.catch_warnings():  # the server takes them at its start; the client's later attempt warns
            warnings.filterwarnings("ignore", message="Failed to set", category=UserWarning)
            session = builder.getOrCreate()
    finally:
        if testing:
            del os.environ["SPARK_TESTING"]
    try:
        yield session
    finally:
        session.stop()  # stops the local Connect server and its SparkContext too


def fake_gpus(folder, addresses: list[str], per_executor: int, per_task: str | None = None) -> dict:
    """Spark settings that give every worker of a local cluster the GPUs ``addresses`` through a discovery script
    written in ``folder``, as Spark's own resource-scheduling tests do; ``per_task``: every task asks for that many."""
    script = folder / "discover_gpus.sh"
    script.write_text("#!/usr/bin/env bash\necho '" + json.dumps({"name": "gpu", "addresses": addresses}) + "'\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    conf = {"spark.worker.resource.gpu.amount": str(len(addresses)),
            "spark.worker.resource.gpu.discoveryScript": str(script),
            "spark.executor.resource.gpu.amount": str(per_executor)}
    return {**conf, "spark.task.resource.gpu.amount": per_task} if per_task else conf


def module_session(master: str = "local[2]", extra: dict | None = None):
    """A module-scoped ``spark`` fixture: one SparkSession for the module, stopped after its last test."""
    import pytest

    @pytest.fixture(scope="module")
    def spark():
        session = start_session(master, extra)
        yield session
        stop_session(session, extra)

    return spark


def blobs(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Three Gaussian blobs in 2-D: float32 features, int64 labels."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]], dtype=np.float32)
    x = (centers[y] + rng.normal(0, 0.6, (n, 2))).astype(np.float32)
    return x, y.astype(np.int64)


def regression_table(n: int, outputs: int = 1, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A learnable table: y = x·W + 0.5 + small noise over 6 features (W the same for every seed)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    w = np.random.default_rng(100).normal(size=(6, outputs)).astype(np.float32)
    y = x @ w + 0.5 + rng.normal(0, 0.05, size=(n, outputs)).astype(np.float32)
    return x, (y[:, 0] if outputs == 1 else y)


def mlp(seed: int = 0) -> torch.nn.Module:
    """A small plain module (torch classes only, so executors unpickle it without test code)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def partitioned_rdd(sc, parts: list[tuple[np.ndarray, np.ndarray]]):
    """An RDD of (ndarray, label) whose partition i holds exactly ``parts[i]``, in order."""
    lists = [[(x[i], y[i].item()) for i in range(len(y))] for x, y in parts]  # int class ids, or floats
    return sc.parallelize(lists, len(lists)).flatMap(lambda rows: rows)


def two_blob_workers(sc):
    """240 blob rows in two cached partitions of 120, and 300 other rows to validate on."""
    x, y = blobs(240, seed=11)
    rdd = partitioned_rdd(sc, [(x[:120], y[:120]), (x[120:], y[120:])]).cache()
    return rdd, blobs(300, seed=12)


def flat(module: torch.nn.Module) -> torch.Tensor:
    return Net(copy.deepcopy(module)).get_flat()


def hand_rounds(model, solver: SolverConfig, parts, *, batch_size: int, seed: int, tau: int, rounds: int,
                start: torch.Tensor | None = None) -> torch.Tensor:
    """Listing 3 by hand in one process: K Nets built as the engines build them, averaged by samples."""
    nets = []
    for i, (x, y) in enumerate(parts):
        if len(y) == 0:
            continue
        net = Net(copy.deepcopy(model), solver, batch_size=batch_size, seed=worker_seed(seed, i))
        net.set_training_data((x, y))
        nets.append(net)
    g = flat(model) if start is None else start.clone()
    for _ in range(rounds):
        acc = torch.zeros_like(g, dtype=torch.float64)
        total = 0
        for net in nets:
            net.set_flat(g)
            stats = net.train(tau)
            acc += net.get_flat().double() * stats.samples
            total += stats.samples
        g = (acc / total).float()
    return g
