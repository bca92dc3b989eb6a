"""GPUs scheduled from a Spark Connect session: a Connect server on ``local-cluster[1,2,1024]`` whose executor "has"
GPUs 3 and 5 through a discovery script. The barrier stage's ``mapInArrow(..., barrier=True, profile=)`` asks for each
worker's share, as the classic session's RDD does; torch has no CUDA here, so the tasks train on the CPU and say
which address Spark gave them.
"""

from __future__ import annotations

import pytest
import torch

from _spark_testlib import blobs, connect_session, fake_gpus, mlp
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.solvers import SolverConfig

pytestmark = pytest.mark.spark

pytest.importorskip("grpc_status", reason="Spark Connect's client needs grpcio-status (the [connect] extra)")


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    gpus = fake_gpus(tmp_path_factory.mktemp("gpu"), ["3", "5"], per_executor=2)
    yield from connect_session("local-cluster[1,2,1024]", "sparknet-tests-connect-gpus", gpus)


@pytest.mark.parametrize("gpus, distinct", [(1, 2), (0.5, 1)])
def test_a_connect_fit_asks_for_each_workers_gpu_share(spark, gpus, distinct):
    from sparknet.spark import SparkTrainer

    assert not torch.cuda.is_available()
    x, y = blobs(64, seed=1)
    frame = spark.createDataFrame([(row.tolist(), int(label)) for row, label in zip(x, y)],
                                  "features array<float>, label long")
    worker = WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=8, device="auto", gpus_per_worker=gpus)
    result = SparkTrainer(mlp(0), worker, DistributedConfig(workers=2, engine="barrier", tau=2, rounds=1),
                          spark=spark, loss=torch.nn.CrossEntropyLoss()).fit(frame)
    s = result.summary
    assert s["connect"] is True and s["gpu_scheduling"]["profile"] is not None
    addresses = [w["gpu_addresses"] for w in s["barrier_workers"]]
    assert all(len(a) == 1 for a in addresses) and len({a for t in addresses for a in t}) == distinct
    assert all(w["device"] == "cpu" and "assigned GPU" in w["device_reason"] for w in s["barrier_workers"])
