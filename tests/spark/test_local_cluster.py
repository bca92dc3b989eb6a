"""The rounds engine on local-cluster[2,1,1024]: two executor JVMs, a fake GPU discovery script; and every
learning task of the local[2] modules again, across the two executors.

As Spark's own TorchDistributor tests do, each worker "has" GPUs 0 and 1 through a discovery
script and every task asks for one, so the GPU-assignment path runs without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from _spark_testlib import (blobs, fake_gpus, hand_rounds, mlp, partitioned_rdd, regression_table, start_session,
                            stop_session)
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    gpus = fake_gpus(tmp_path_factory.mktemp("gpu"), ["0", "1"], per_executor=1, per_task="1")
    session = start_session("local-cluster[2,1,1024]", gpus)
    yield session
    stop_session(session, gpus)


def test_rounds_engine_averages_exactly_across_two_executors(spark):
    x, y = blobs(40, seed=7)
    parts = [(x[:16], y[:16]), (x[16:], y[16:])]
    solver = SolverConfig(base_lr=0.05, momentum=0.9)
    result = SparkTrainer(mlp(), WorkerConfig(solver=solver, batch_size=8, seed=2),
                          dist=DistributedConfig(workers=2, engine="rounds", tau=4, rounds=3)
                          ).fit(partitioned_rdd(spark.sparkContext, parts))
    expected = hand_rounds(mlp(), solver, parts, batch_size=8, seed=2, tau=4, rounds=3)
    assert torch.allclose(result.weights.to_flat(torch.float32), expected, atol=1e-5, rtol=1e-5)
    pids = {w["pid"] for h in result.history for w in h["per_worker"]}
    assert len(pids) >= 2  # the partitions trained in different processes (two executors)


def test_an_rdd_of_float_labels_regresses_to_r2_above_0_95_on_two_executors(spark):
    x, y = regression_table(1200)
    vx, vy = regression_table(300, seed=1)
    half = len(y) // 2
    rdd = partitioned_rdd(spark.sparkContext, [(x[:half], y[:half]), (x[half:], y[half:])])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    result = SparkTrainer(net, WorkerConfig(solver=SolverConfig(base_lr=0.02, momentum=0.9), batch_size=32, seed=1),
                          DistributedConfig(workers=2, tau=25, rounds=12), loss=torch.nn.L1Loss()
                          ).fit(rdd, validation=(vx, vy))
    assert result.summary["test_r2"] >= 0.95, result.summary
    assert len({w["pid"] for h in result.history for w in h["per_worker"]}) >= 2


def test_tasks_see_their_assigned_gpu_and_fall_back_to_the_cpu_without_cuda(spark):
    assert not torch.cuda.is_available()
    x, y = blobs(16, seed=8)
    result = SparkTrainer(mlp(), WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=4, device="auto"),
                          dist=DistributedConfig(workers=2, engine="rounds", tau=2, rounds=1)
                          ).fit(partitioned_rdd(spark.sparkContext, [(x[:8], y[:8]), (x[8:], y[8:])]))
    for worker in result.history[0]["per_worker"]:
        assert len(worker["gpu_addresses"]) == 1 and worker["gpu_addresses"][0] in ("0", "1")
        assert worker["device"] == "cpu"
        assert "assigned GPU" in worker["device_reason"] and "no CUDA" in worker["device_reason"]


def test_the_fallback_is_logged(monkeypatch, caplog):
    from pyspark import TaskContext

    from sparknet.spark.rounds.executor import task_device

    class FakeResource:
        addresses = ["1"]

    class FakeContext:
        def resources(self):
            return {"gpu": FakeResource()}

    monkeypatch.setattr(TaskContext, "get", classmethod(lambda cls: FakeContext()))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level("WARNING", logger="sparknet.spark.rounds.executor"):
        device, info = task_device("cuda")
    assert device == "cpu" and info["gpu_addresses"] == ["1"]
    assert "Spark assigned GPU ['1']" in caplog.text and "training on the CPU" in caplog.text
    assert task_device("cpu")[0] == "cpu"


# -- every learning task of the local[2] modules, here across two executor JVMs --------------------------------
# The same test bodies, called with this module's session: what they check on local[2] holds with each partition
# in another executor process.

def test_multilabel_trains_and_is_scored_across_two_executors(spark):
    from test_regression import Engine, test_multilabel_with_bce_trains_and_is_scored_by_accuracy_f1_and_auc as body

    body(spark, Engine.ROUNDS)


def test_an_autoencoder_trains_without_labels_across_two_executors(spark):
    from test_regression import Engine, test_an_autoencoder_trains_on_features_alone_and_is_scored_by_its_loss as body

    body(spark, Engine.BARRIER)


def test_sample_weights_choose_the_fit_across_two_executors(spark):
    from test_regression import test_sample_weights_choose_which_rows_the_net_fits as body

    body(spark)


@pytest.mark.parametrize("features_as", ["concat", "dict"])
def test_two_feature_columns_reach_the_net_across_two_executors(spark, features_as):
    from test_regression import Engine, test_feature_columns_reach_the_net_as_a_dict_by_name as as_dict
    from test_regression import test_two_feature_columns_are_concatenated_into_the_net_s_input as concatenated

    concatenated(spark) if features_as == "concat" else as_dict(spark, Engine.ROUNDS)


def test_spark_s_evaluators_and_cross_validator_take_the_models_across_two_executors(spark):
    from test_regression import (test_a_classifier_s_columns_are_what_spark_s_classification_evaluators_read,
                                 test_a_multilabel_model_s_prediction_is_what_spark_s_multilabel_evaluator_reads,
                                 test_the_estimator_is_a_regressor_that_spark_s_regression_evaluator_and_cross_validator_take)

    test_the_estimator_is_a_regressor_that_spark_s_regression_evaluator_and_cross_validator_take(spark)
    test_a_classifier_s_columns_are_what_spark_s_classification_evaluators_read(spark)
    test_a_multilabel_model_s_prediction_is_what_spark_s_multilabel_evaluator_reads(spark)


def test_spark_s_image_source_trains_across_two_executors(spark, tmp_path_factory):
    from test_image_sources import test_a_net_trains_on_a_directory_of_images as body
    from test_image_sources import write_images

    body(spark, write_images(tmp_path_factory.mktemp("images")), "image")
