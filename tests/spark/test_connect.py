"""Training and scoring from a Spark Connect session: a real Connect server (``remote("local[2]")``).

The client has no SparkContext, RDDs or broadcasts and its executors may not reach it: the barrier
engine runs as one ``mapInArrow(..., barrier=True)`` stage with its weights in the plan and its
results as rows; the Estimator fits, transforms, saves and loads; what cannot work is refused first.
"""

from __future__ import annotations


import pytest
import torch

from _spark_testlib import blobs, connect_session, mlp
from sparknet import zoo
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.solvers import SolverConfig

pytestmark = pytest.mark.spark

pytest.importorskip("grpc_status", reason="Spark Connect's client needs grpcio-status (the [connect] extra)")


@pytest.fixture(scope="module")
def spark():
    yield from connect_session("local[2]", "sparknet-tests-connect")


def _frame(spark, x, y):
    return spark.createDataFrame([(row.tolist(), int(label)) for row, label in zip(x, y)],
                                 "features array<float>, label long")


def _trainer(spark, engine="barrier", **dist):
    from sparknet.spark import SparkTrainer

    records = []
    kw = dict(workers=2, tau=20, rounds=5, engine=engine)
    kw.update(dist)
    trainer = SparkTrainer(mlp(0), WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=32, seed=3),
                           DistributedConfig(**kw), spark=spark, loss=torch.nn.CrossEntropyLoss(),
                           on_round=records.append)
    return trainer, records


def test_session_is_connect(spark):
    from sparknet.spark.session import is_connect, session_master, session_parallelism

    assert is_connect(spark) and is_connect(spark.range(1))
    assert session_master(spark) == "local[2]"
    assert session_parallelism(spark) == 2
    with pytest.raises(Exception, match="sparkContext|JVM_ATTRIBUTE_NOT_SUPPORTED"):
        spark.sparkContext  # noqa: B018 - what made every fit fail before


def test_trainer_fits_with_the_barrier_engine(spark):
    x, y = blobs(1200, seed=1)
    vx, vy = blobs(400, seed=2)
    trainer, records = _trainer(spark)
    result = trainer.fit(_frame(spark, x, y), (vx, vy))
    assert result.summary["connect"] is True and result.summary["engine"] == "barrier"
    assert result.summary["rows_per_partition"] and sum(result.summary["rows_per_partition"]) == 1200
    assert [r["round"] for r in result.history] == [1, 2, 3, 4, 5]
    assert records == result.history  # on_round saw every record, when the stage ended
    assert result.history[-1]["total_steps"] == 100 and result.history[-1]["workers"] == 2
    assert all(r["wall_s"] > 0 for r in result.history)
    assert [w["rank"] for w in result.summary["barrier_workers"]] == [0, 1]
    assert result.summary["test_accuracy"] >= 0.9
    # the returned weights are what rank 0 ended with: scoring them here gives the last record's accuracy
    assert result.summary["test_accuracy"] == pytest.approx(result.history[-1]["val_accuracy"], abs=1e-9)
    # the ranks' shares summed are the whole set's scores, F1 by class among them
    here = result.net.evaluate()
    for name in ("accuracy", "f1", "weighted_precision", "macro_f1"):
        assert result.summary[f"test_{name}"] == pytest.approx(here.metrics[name], abs=1e-9), name


def test_a_worker_of_two_processes_trains_sharded_from_a_connect_session(spark):
    x, y = blobs(600, seed=1)
    vx, vy = blobs(200, seed=2)
    trainer, records = _trainer(spark, workers=1, procs_per_worker=2, shard_replica=True, rounds=3)
    result = trainer.fit(_frame(spark, x, y), (vx, vy))
    s = result.summary
    assert s["connect"] is True and s["procs_per_worker"] == 2 and s["shard_replica"] is True
    assert [(w["worker"], w["proc"]) for w in s["barrier_workers"]] == [(0, 0), (0, 1)]
    # the two ranks held a part each of the weights, and the gathered whole scores as the last record says
    assert sum(s["weight_bytes_per_rank"]) == 4 * result.weights.to_flat().numel()
    assert s["test_accuracy"] == pytest.approx(records[-1]["val_accuracy"]) and s["test_accuracy"] > 0.8


def test_a_worker_of_two_processes_trains_split_from_a_connect_session(spark):
    from sparknet.spark import SparkTrainer

    x, y = blobs(600, seed=1)
    vx, vy = blobs(200, seed=2)
    records = []
    net = zoo.mlp(input_shape=[2], hidden=[16], num_classes=3)  # ip1 column, ip2 row
    trainer = SparkTrainer(net, WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=32, seed=3),
                           DistributedConfig(workers=2, model_parallel=2, engine="barrier", tau=20, rounds=3),
                           spark=spark, on_round=records.append)
    result = trainer.fit(_frame(spark, x, y), (vx, vy))
    s = result.summary
    assert s["connect"] is True and (s["procs_per_worker"], s["model_parallel"]) == (2, 2)
    assert [(w["worker"], w["proc"]) for w in s["barrier_workers"]] == [(0, 0), (0, 1)]
    # each process cut its part from the whole starting weights in the stage's plan; the worker gathered the whole
    assert max(s["weight_bytes_per_worker"]) < 4 * result.weights.to_flat().numel()
    assert s["test_accuracy"] == pytest.approx(records[-1]["val_accuracy"]) and s["test_accuracy"] > 0.8


def test_two_feature_columns_reach_the_net_as_a_dict(spark):
    from sparknet.spark import SparkTrainer

    class Columns(torch.nn.Module):
        def __init__(self, body):
            super().__init__()
            self.body = body

        def forward(self, columns):
            return self.body(torch.stack([columns["a"], columns["b"]], 1))

    x, y = blobs(1200, seed=1)
    vx, vy = blobs(400, seed=2)
    frame = spark.createDataFrame([(float(r[0]), float(r[1]), int(t)) for r, t in zip(x, y)], "a double, b double, "
                                  "label long")
    trainer = SparkTrainer(Columns(mlp(0)), WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=32, seed=3),
                           DistributedConfig(workers=2, tau=20, rounds=5, engine="barrier"), spark=spark,
                           loss=torch.nn.CrossEntropyLoss())
    result = trainer.fit(frame, ({"a": vx[:, 0], "b": vx[:, 1]}, vy), features_col=["a", "b"], features_as="dict")
    assert result.summary["connect"] is True and result.summary["feature_columns"] == {"a": [], "b": []}
    assert result.summary["test_accuracy"] >= 0.9
    assert list(result.weights) == [n for n, _ in Columns(mlp(0)).named_parameters()]


def test_rounds_engine_refused_with_the_reason(spark):
    x, y = blobs(200, seed=1)
    trainer, _ = _trainer(spark, engine="rounds")
    with pytest.raises(ValueError, match="Spark Connect.*engine='barrier'"):
        trainer.fit(_frame(spark, x, y))


def test_the_parameter_server_is_refused_with_the_reason(spark):
    from sparknet.ps import AsyncSession

    x, y = blobs(200, seed=1)
    session = AsyncSession(mlp(0), SolverConfig(base_lr=0.1), loss=torch.nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="parameter server cannot run from a Spark Connect session.*engine='barrier'"):
        session.run(data=_frame(spark, x, y), num_workers=2, steps=5)


def test_checkpoints_refused_with_the_reason(spark, tmp_path):
    x, y = blobs(200, seed=1)
    trainer, _ = _trainer(spark, checkpoint_dir=str(tmp_path / "ck"))
    with pytest.raises(ValueError, match="Spark Connect.*checkpoint"):
        trainer.fit(_frame(spark, x, y))


def test_bad_labels_get_the_classic_error(spark):
    x, y = blobs(200, seed=1)
    df = spark.createDataFrame([(row.tolist(), float(label) + 0.5) for row, label in zip(x, y)],
                               "features array<float>, label double")
    trainer, _ = _trainer(spark, rounds=1)
    with pytest.raises(ValueError, match="not whole numbers"):
        trainer.fit(df)


def test_a_failed_rank_is_named(spark):
    from sparknet.errors import WorkerError
    from sparknet.spark import EngineOptions, SparkTrainer

    x, y = blobs(400, seed=1)
    trainer = SparkTrainer(mlp(0), WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=32),
                           DistributedConfig(workers=2, tau=10, rounds=3, engine="barrier"), spark=spark,
                           loss=torch.nn.CrossEntropyLoss(),
                           options=EngineOptions(fault="rank=1,round=2,kind=raise", max_restarts=0))
    with pytest.raises(WorkerError) as info:
        trainer.fit(_frame(spark, x, y))
    assert info.value.rank == 1


def test_estimator_fits_transforms_saves_and_loads(spark, tmp_path):
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    from sparknet.spark.ml import SparkNetEstimator, SparkNetModel

    x, y = blobs(800, seed=4)
    df = _frame(spark, x, y)
    est = SparkNetEstimator(zoo.mlp(input_shape=[2], hidden=[16], num_classes=3), workers=2, tau=10, rounds=4,
                            lr=0.1, batchSize=32, seed=0, engine="barrier")
    model = est.fit(df)
    assert [r["round"] for r in model.history] == [1, 2, 3, 4]
    scored = model.transform(df)
    assert {"prediction", "probability", "rawPrediction"} <= set(scored.columns)
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored)
    assert accuracy >= 0.9
    assert model.evaluate(df)["accuracy"] == accuracy  # scored where the rows live, over Connect too
    model.save(str(tmp_path / "model"))
    loaded = SparkNetModel.load(str(tmp_path / "model"))
    first = [r.prediction for r in scored.select("prediction").limit(20).collect()]
    again = [r.prediction for r in loaded.transform(df).select("prediction").limit(20).collect()]
    assert first == again
    est.save(str(tmp_path / "estimator"))
    assert SparkNetEstimator.load(str(tmp_path / "estimator")).getOrDefault("tau") == 10


def test_estimator_of_a_plain_module_on_a_table_s_own_columns_with_weights(spark):
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    from sparknet.spark.ml import SparkNetEstimator

    x, y = blobs(800, seed=5)
    df = spark.createDataFrame([(float(a), float(b), int(label), float(label != 2)) for (a, b), label in zip(x, y)],
                               "a double, b double, label long, w double")
    est = SparkNetEstimator(mlp(0), loss=torch.nn.CrossEntropyLoss(), featuresCols=["a", "b"], weightCol="w",
                            workers=2, tau=10, rounds=6, lr=0.1, batchSize=32, seed=0, engine="barrier",
                            validationFraction=0.25)
    model = est.fit(df)
    assert model.trainedColumns == ["a", "b"]
    # the held-out rows scored with their weights: class 2's, never predicted, count for nothing (unweighted, the
    # accuracy would be about two thirds)
    assert 0 < model.summary["validation_weight"] < 0.25 * 800 and model.summary["test_accuracy"] >= 0.9, model.summary
    scored = model.transform(df)
    predicted = [r.prediction for r in scored.select("prediction").collect()]
    assert predicted.count(2.0) < 0.05 * len(predicted)  # class 2's rows weigh nothing
    right = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored.filter("label != 2"))
    assert right >= 0.9, right
