"""Regression, and Spark ML's evaluators on sparknet's models, on real Spark (local[2])."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from _spark_testlib import module_session, regression_table
from sparknet.config import DistributedConfig, Engine, WorkerConfig
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer

pytestmark = pytest.mark.spark


spark = module_session("local[2]")


def _frame(spark, x, y):
    if y.ndim == 1:
        rows = [([float(v) for v in a], float(b)) for a, b in zip(x, y)]
        return spark.createDataFrame(rows, "features array<double>, label double").repartition(2)
    rows = [([float(v) for v in a], [float(v) for v in b]) for a, b in zip(x, y)]
    return spark.createDataFrame(rows, "features array<double>, label array<double>").repartition(2)


def _net(outputs: int = 1) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, outputs))


def test_a_double_label_and_mse_train_on_the_rounds_engine_to_r2_above_0_95(spark):
    x, y = regression_table(1600)
    vx, vy = regression_table(400, seed=1)
    trainer = SparkTrainer(_net(), WorkerConfig(solver=SolverConfig(base_lr=0.02, momentum=0.9), batch_size=32, seed=1),
                           DistributedConfig(workers=2, tau=25, rounds=12), loss=torch.nn.MSELoss(), spark=spark)
    result = trainer.fit(_frame(spark, x, y), validation=(vx, vy))
    s = result.summary
    assert s["test_r2"] >= 0.95, s
    assert s["test_accuracy"] is None and s["test_rmse"] > 0 and s["test_mae"] > 0
    # the metrics are those of the returned weights: recompute them here
    net = _net()
    flat = result.weights.to_flat(torch.float32)
    torch.nn.utils.vector_to_parameters(flat, net.parameters())
    with torch.no_grad():
        pred = net(torch.from_numpy(vx)).numpy()[:, 0]
    r2 = 1 - ((pred - vy) ** 2).sum() / ((vy - vy.mean()) ** 2).sum()
    assert math.isclose(s["test_r2"], r2, rel_tol=1e-4)
    assert math.isclose(s["test_rmse"], float(np.sqrt(((pred - vy) ** 2).mean())), rel_tol=1e-4)
    rounds = [r for r in result.history if r.get("event") == "round"]
    assert "val_accuracy" not in rounds[-1] and {"val_r2", "val_rmse", "val_mae", "val_loss"} <= set(rounds[-1])


def test_several_label_columns_are_one_array_of_numbers_a_row(spark):
    x, y = regression_table(1200, outputs=2)
    rows = [([float(v) for v in a], [float(v) for v in b], float(b[0]), float(b[1])) for a, b in zip(x, y)]
    # not repartitioned: a round-robin repartition orders rows by the columns a fit selects, which differ here
    df = spark.createDataFrame(rows, "features array<double>, both array<double>, p double, q float")
    vx, vy = regression_table(300, outputs=2, seed=1)

    def fit(label_col, net=None):
        trainer = SparkTrainer(net or _net(2), WorkerConfig(solver=SolverConfig(base_lr=0.02, momentum=0.9),
                                                            batch_size=32, seed=1),
                               DistributedConfig(workers=2, tau=25, rounds=6), loss=torch.nn.MSELoss(), spark=spark)
        return trainer.fit(df, validation=(vx, vy), label_col=label_col)

    joined = fit(["p", "q"])
    assert joined.summary["test_r2"] > 0.9, joined.summary
    as_array = fit("both")  # q is a float: joined as doubles of the same values as the array's
    assert joined.weights.allclose(as_array.weights, rtol=0, atol=0)
    with pytest.raises(ValueError, match="class ids are one column"):
        SparkTrainer(_net(2), WorkerConfig(), DistributedConfig(workers=2, tau=5, rounds=1), spark=spark).fit(
            df, label_col=["p", "q"])
    with pytest.raises(ValueError, match="label column 'features' has type array<double>; several label columns"):
        fit(["p", "features"])


def test_target_accuracy_is_a_target_on_r2(spark):
    x, y = regression_table(1600)
    vx, vy = regression_table(400, seed=1)
    trainer = SparkTrainer(_net(), WorkerConfig(solver=SolverConfig(base_lr=0.02, momentum=0.9), batch_size=32, seed=1),
                           DistributedConfig(workers=2, tau=25, rounds=40, target_accuracy=0.9),
                           loss=torch.nn.MSELoss(), spark=spark)
    result = trainer.fit(_frame(spark, x, y), validation=(vx, vy))
    rounds = [r for r in result.history if r.get("event") == "round"]
    assert result.summary["stop_reason"] == "target_accuracy" and len(rounds) < 40
    assert rounds[-1]["val_r2"] >= 0.9 and all(r["val_r2"] < 0.9 for r in rounds[:-1] if "val_r2" in r)


def test_vector_labels_and_huber_loss_train_on_the_barrier_engine(spark):
    x, y = regression_table(1600, outputs=2)
    vx, vy = regression_table(400, outputs=2, seed=1)
    worker = WorkerConfig(solver=SolverConfig(base_lr=0.05, momentum=0.9), batch_size=32, seed=1)
    trainer = SparkTrainer(_net(2), worker, DistributedConfig(workers=2, tau=25, rounds=12, engine=Engine.BARRIER),
                           loss=torch.nn.HuberLoss(), spark=spark)
    result = trainer.fit(_frame(spark, x, y), validation=_frame(spark, vx, vy))
    assert result.summary["test_r2"] >= 0.95, result.summary


def _multilabel_frame(spark, n: int, seed: int):
    x, _ = regression_table(n, seed=seed)
    y = np.stack([x[:, 0] > 0, x[:, 1] + x[:, 2] > 0, x[:, 3] - x[:, 4] > 0.5], axis=1).astype(np.float64)
    rows = [([float(v) for v in a], [float(v) for v in b]) for a, b in zip(x, y)]
    return spark.createDataFrame(rows, "features array<double>, label array<double>").repartition(2)


@pytest.mark.parametrize("engine", [Engine.ROUNDS, Engine.BARRIER])
def test_multilabel_with_bce_trains_and_is_scored_by_accuracy_f1_and_auc(spark, engine):
    trainer = SparkTrainer(_net(3), WorkerConfig(solver=SolverConfig(base_lr=0.2, momentum=0.9), batch_size=32, seed=1),
                           DistributedConfig(workers=2, tau=25, rounds=10, engine=engine),
                           loss=torch.nn.BCEWithLogitsLoss(), spark=spark)
    result = trainer.fit(_multilabel_frame(spark, 1600, 0), validation=_multilabel_frame(spark, 400, 1))
    s = result.summary
    assert s["test_accuracy"] > 0.95 and s["test_f1"] > 0.93 and s["test_auc"] > 0.98, s
    assert {"val_accuracy", "val_f1", "val_auc"} <= set(result.history[-1])


def test_a_multilabel_label_outside_0_1_is_refused(spark):
    rows = [([0.1 * i] * 6, [1.0, 2.0 if i == 3 else 0.0]) for i in range(20)]
    df = spark.createDataFrame(rows, "features array<double>, label array<double>")
    trainer = SparkTrainer(_net(2), WorkerConfig(batch_size=8), DistributedConfig(workers=2, tau=5, rounds=1),
                           loss=torch.nn.BCEWithLogitsLoss(), spark=spark)
    with pytest.raises(ValueError, match=r"range over \[0, 2\]; a multi-label net takes 0 or 1"):
        trainer.fit(df)


def test_two_feature_columns_are_concatenated_into_the_net_s_input(spark):
    x, y = regression_table(1600)
    vx, vy = regression_table(400, seed=1)

    def frame(a, b):  # the first four features as an ML vector, the fifth and sixth as plain numbers
        from pyspark.ml.linalg import Vectors

        rows = [(Vectors.dense([float(v) for v in r[:4]]), float(r[4]), float(r[5]), float(t)) for r, t in zip(a, b)]
        return spark.createDataFrame(rows, ["head", "e", "f", "label"]).repartition(2)

    trainer = SparkTrainer(_net(), WorkerConfig(solver=SolverConfig(base_lr=0.02, momentum=0.9), batch_size=32, seed=1),
                           DistributedConfig(workers=2, tau=25, rounds=12), loss=torch.nn.MSELoss(), spark=spark)
    result = trainer.fit(frame(x, y), validation=frame(vx, vy), features_col=["head", "e", "f"])
    assert result.summary["test_r2"] >= 0.95, result.summary
    # a column that is not there is named before any job runs
    with pytest.raises(ValueError, match="feature column 'g' not found"):
        trainer.fit(frame(x, y), features_col=["head", "g"])


def _dict_net() -> torch.nn.Module:
    class ByColumn(torch.nn.Module):
        """Takes {"head": [n, 2, 2], "e": [n], "f": [n]}: fails on one concatenated tensor."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.grid = torch.nn.Linear(4, 16)
            self.scalars = torch.nn.Linear(2, 16)
            self.out = torch.nn.Linear(16, 1)

        def forward(self, columns):
            assert columns["head"].shape[1:] == (2, 2) and columns["e"].dim() == 1, {k: v.shape for k, v in
                                                                                     columns.items()}
            hidden = self.grid(columns["head"].flatten(1)) + self.scalars(torch.stack([columns["e"], columns["f"]], 1))
            return self.out(torch.relu(hidden))

    return ByColumn()


def _columns_frame(spark, x, y, *, bad_row: int | None = None):
    """The first four features as an ML vector ``head``, the fifth and sixth as numbers ``e`` and ``f``; the
    columns in another order than the net reads them."""
    from pyspark.ml.linalg import Vectors

    rows = [(float(t), float(r[5]), Vectors.dense([float(v) for v in (r[:3] if i == bad_row else r[:4])]),
             float(r[4])) for i, (r, t) in enumerate(zip(x, y))]
    return spark.createDataFrame(rows, ["label", "f", "head", "e"]).repartition(2)


@pytest.mark.parametrize("engine", [Engine.ROUNDS, Engine.BARRIER])
def test_feature_columns_reach_the_net_as_a_dict_by_name(spark, engine):
    x, y = regression_table(1600)
    vx, vy = regression_table(400, seed=1)
    trainer = SparkTrainer(_dict_net(), WorkerConfig(solver=SolverConfig(base_lr=0.02, momentum=0.9), batch_size=32,
                                                     seed=1),
                           DistributedConfig(workers=2, tau=25, rounds=12, engine=engine), loss=torch.nn.MSELoss(),
                           spark=spark)
    # validation as arrays by column: the rounds engine; as a DataFrame with the same columns: the barrier engine
    validation = ({"head": vx[:, :4], "e": vx[:, 4], "f": vx[:, 5]}, vy) if engine is Engine.ROUNDS \
        else _columns_frame(spark, vx, vy)
    result = trainer.fit(_columns_frame(spark, x, y), validation=validation, features_col=["head", "e", "f"],
                         features_as="dict", image_shape={"head": [2, 2]})
    s = result.summary
    assert s["test_r2"] >= 0.95, s
    assert s["feature_columns"] == {"head": [2, 2], "e": [], "f": []}, s["feature_columns"]
    assert "'head', 'e', 'f' as a dict" in s["input"]
    # the weights carry the module's own names, and score the validation rows as the summary says
    net = _dict_net()
    assert list(result.weights) == [n for n, _ in net.named_parameters()]
    net.load_state_dict({n: result.weights[n][0] for n in result.weights})
    with torch.no_grad():
        pred = net({"head": torch.from_numpy(vx[:, :4]).reshape(-1, 2, 2), "e": torch.from_numpy(vx[:, 4]),
                    "f": torch.from_numpy(vx[:, 5])}).numpy()[:, 0]
    r2 = 1 - ((pred - vy) ** 2).sum() / ((vy - vy.mean()) ** 2).sum()
    assert math.isclose(s["test_r2"], r2, rel_tol=1e-4)


def test_a_dict_of_columns_is_refused_clearly_where_it_cannot_work(spark):
    x, y = regression_table(64)
    trainer = SparkTrainer(_dict_net(), WorkerConfig(batch_size=8), DistributedConfig(workers=2, tau=5, rounds=1),
                           loss=torch.nn.MSELoss(), spark=spark)
    # concatenated (the default), the same net cannot take the columns: said before training
    with pytest.raises(ValueError, match="the net cannot take features"):
        trainer.fit(_columns_frame(spark, x, y), features_col=["head", "e", "f"])
    # one row's vector holds 3 values where the first row's holds 4
    with pytest.raises(ValueError, match=r"columns 'head' \[2, 2\], 'e', 'f'\): feature rows must hold 6 values .* \(1 rows do not fit\)"):
        trainer.fit(_columns_frame(spark, x, y, bad_row=40), features_col=["head", "e", "f"], features_as="dict",
                    image_shape={"head": [2, 2]})
    with pytest.raises(ValueError, match=r"gives column 'head' the shape \(3, 2\), but its rows hold 4 values"):
        trainer.fit(_columns_frame(spark, x, y), features_col=["head", "e", "f"], features_as="dict",
                    image_shape={"head": [3, 2]})
    with pytest.raises(ValueError, match="image_shape is a dict of shapes by column"):
        trainer.fit(_columns_frame(spark, x, y), features_col=["head", "e", "f"], features_as="dict",
                    image_shape=[2, 2])
    with pytest.raises(ValueError, match="features_as must be one of concat, dict"):
        trainer.fit(_columns_frame(spark, x, y), features_col=["head", "e", "f"], features_as="dicts")
    with pytest.raises(ValueError, match="from a DataFrame's columns"):
        trainer.fit(spark.sparkContext.parallelize([(a, b) for a, b in zip(x, y)]), features_as="dict")


def test_sample_weights_choose_which_rows_the_net_fits(spark):
    # two halves of the table follow opposite maps; the weights say which one counts
    x, y = regression_table(1600)
    other = -(y - 0.5) + 0.5
    labels = np.concatenate([y[:800], other[800:]])
    weights = np.concatenate([np.ones(800), np.full(800, 0.01)])
    rows = [([float(v) for v in a], float(b), float(c)) for a, b, c in zip(x, labels, weights)]
    df = spark.createDataFrame(rows, "features array<double>, label double, w double").repartition(2)
    vx, vy = regression_table(400, seed=1)

    def fit(weight_col):
        trainer = SparkTrainer(_net(), WorkerConfig(solver=SolverConfig(base_lr=0.02, momentum=0.9), batch_size=32,
                                                    seed=1),
                               DistributedConfig(workers=2, tau=25, rounds=12), loss=torch.nn.MSELoss(), spark=spark)
        return trainer.fit(df, validation=(vx, vy), weight_col=weight_col).summary["test_r2"]

    weighted, plain = fit("w"), fit(None)
    assert weighted >= 0.9 and plain < 0.3, (weighted, plain)


def test_a_negative_weight_is_refused(spark):
    x, y = regression_table(40)
    rows = [([float(v) for v in a], float(b), -1.0 if i == 5 else 1.0) for i, (a, b) in enumerate(zip(x, y))]
    df = spark.createDataFrame(rows, "features array<double>, label double, w double")
    trainer = SparkTrainer(_net(), WorkerConfig(batch_size=8), DistributedConfig(workers=2, tau=2, rounds=1),
                           loss=torch.nn.MSELoss(), spark=spark)
    with pytest.raises(ValueError, match="1 rows have a null, NaN, infinite or negative sample weight"):
        trainer.fit(df, weight_col="w")


def test_a_nan_label_is_refused_before_training(spark):
    x, y = regression_table(200)
    y[7] = np.nan
    trainer = SparkTrainer(_net(), WorkerConfig(batch_size=32), DistributedConfig(workers=2, tau=5, rounds=1),
                           loss=torch.nn.MSELoss(), spark=spark)
    with pytest.raises(ValueError, match="1 labels in column 'label' are NaN or infinite"):
        trainer.fit(_frame(spark, x, y))


def test_fractional_labels_with_a_classification_loss_say_how_to_regress(spark):
    x, y = regression_table(200)
    trainer = SparkTrainer(_net(3), WorkerConfig(batch_size=32), DistributedConfig(workers=2, tau=5, rounds=1),
                           spark=spark)
    with pytest.raises(ValueError, match="not whole numbers.*torch.nn.MSELoss"):
        trainer.fit(_frame(spark, x, y))


def _regression_net_params(batch: int = 32):
    from sparknet.layers import ActivationLayer, EuclideanLoss, LinearLayer, NetParams, RDDLayer

    return NetParams(RDDLayer("data", shape=[batch, 6]), RDDLayer("label", shape=[batch, 1]),
                     LinearLayer("ip1", ["data"], num_outputs=16), ActivationLayer("relu1", ["ip1"], tops=["ip1"]),
                     LinearLayer("ip2", ["ip1"], num_outputs=1), EuclideanLoss("loss", ["ip2", "label"]))


@pytest.mark.parametrize("outputs", [1, 2])
def test_an_estimator_without_a_net_sizes_the_zoo_mlp_to_the_task_s_labels(spark, outputs):
    """No net: the ``model`` Param's zoo mlp, its last layer as wide as a row's numbers and its loss the task's."""
    from sparknet.spark.ml import SparkNetEstimator

    x, y = regression_table(1200, outputs=outputs)
    est = SparkNetEstimator(model="mlp", task="regression", workers=2, tau=25, rounds=8, lr=0.02, momentum=0.9,
                            batch_size=32, seed=1)
    model = est.fit(_frame(spark, x, y))
    assert model.resolvedTask().value == "regression"
    assert model.net.net_params.layers[-2].num_outputs == outputs
    vx, vy = regression_table(300, outputs=outputs, seed=1)
    scored = model.transform(_frame(spark, vx, vy)).select("label", "prediction").collect()
    truth = np.array([r.label for r in scored])
    prediction = np.array([np.asarray(r.prediction) for r in scored]).reshape(truth.shape)
    assert 1 - ((prediction - truth) ** 2).sum() / ((truth - truth.mean(0)) ** 2).sum() > 0.9
    with pytest.raises(ValueError, match="the zoo model 'lenet' is a classifier; task 'regression' takes model"):
        SparkNetEstimator(model="lenet", task="regression", workers=2, rounds=1).fit(_frame(spark, x, y))


def test_an_estimator_s_label_cols_are_one_array_of_numbers_a_row(spark):
    from sparknet.spark.ml import SparkNetEstimator

    x, y = regression_table(1200, outputs=2)
    rows = [([float(v) for v in a], [float(v) for v in b], float(b[0]), float(b[1])) for a, b in zip(x, y)]
    df = spark.createDataFrame(rows, "features array<double>, both array<double>, p double, q double")  # one order

    def fit(**labels):
        return SparkNetEstimator(model="mlp", task="regression", workers=2, tau=25, rounds=4, lr=0.02, momentum=0.9,
                                 batch_size=32, seed=1, **labels).fit(df)

    joined = fit(labelCols=["p", "q"])
    assert joined.net.net_params.layers[-2].num_outputs == 2  # the zoo mlp sized to the two columns
    assert joined.weights.allclose(fit(labelCol="both").weights, rtol=0, atol=0)
    with pytest.raises(ValueError, match="set labelCol .* or labelCols .*, not both"):
        fit(labelCols=["p", "q"], labelCol="both")
    with pytest.raises(ValueError, match="class ids are one column"):
        SparkNetEstimator(model="mlp", workers=2, rounds=1, labelCols=["p", "q"]).fit(df)


def test_the_estimator_is_a_regressor_that_spark_s_regression_evaluator_and_cross_validator_take(spark):
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    from sparknet.spark.ml import SparkNetEstimator

    x, y = regression_table(1200)
    vx, vy = regression_table(400, seed=1)
    est = SparkNetEstimator(_regression_net_params(), workers=2, tau=25, rounds=10, lr=0.02, momentum=0.9,
                            batch_size=32, seed=1)
    model = est.fit(_frame(spark, x, y))
    assert model.getTask() == "regression" and model.resolvedTask().value == "regression"
    scored = model.transform(_frame(spark, vx, vy))
    assert "probability" not in scored.columns and dict(scored.dtypes)["prediction"] == "double"
    r2 = RegressionEvaluator(metricName="r2").evaluate(scored)
    assert r2 >= 0.95
    # the evaluator's RMSE is that of the predictions the model gives
    rows = scored.select("label", "prediction").collect()
    rmse = float(np.sqrt(np.mean([(r.label - r.prediction) ** 2 for r in rows])))
    assert math.isclose(RegressionEvaluator(metricName="rmse").evaluate(scored), rmse, rel_tol=1e-9)

    # CrossValidator picks the learning rate that trains (0.02) over one that barely moves (1e-5)
    grid = ParamGridBuilder().addGrid(est.lr, [1e-5, 0.02]).build()
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, evaluator=RegressionEvaluator(metricName="r2"),
                        numFolds=2, seed=7)
    cv_model = cv.fit(_frame(spark, x, y))
    assert cv_model.avgMetrics[1] > 0.9 > cv_model.avgMetrics[0]
    assert RegressionEvaluator(metricName="r2").evaluate(cv_model.transform(_frame(spark, vx, vy))) >= 0.95


def test_a_classifier_s_columns_are_what_spark_s_classification_evaluators_read(spark):
    from pyspark.ml.evaluation import BinaryClassificationEvaluator, MulticlassClassificationEvaluator

    from sparknet import zoo
    from sparknet.spark.ml import SparkNetEstimator

    x, target = regression_table(1200)
    y = (target > np.median(target)).astype(np.int64)  # two classes from the same table
    vx, vt = regression_table(400, seed=1)
    vy = (vt > np.median(target)).astype(np.int64)

    def frame(a, b):
        rows = [([float(v) for v in r], int(c)) for r, c in zip(a, b)]
        return spark.createDataFrame(rows, "features array<double>, label long").repartition(2)

    est = SparkNetEstimator(zoo.mlp(input_shape=[6], hidden=[16], num_classes=2, batch_size=32), workers=2, tau=25,
                            rounds=8, lr=0.05, momentum=0.9, batch_size=32, seed=1)
    model = est.fit(frame(x, y))
    scored = model.transform(frame(vx, vy))
    assert {"prediction", "probability", "rawPrediction"} <= set(scored.columns)
    auc = BinaryClassificationEvaluator().evaluate(scored)  # reads rawPrediction
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored)
    rows = scored.select("label", "prediction", "rawPrediction").collect()
    assert math.isclose(accuracy, np.mean([r.label == r.prediction for r in rows]), rel_tol=1e-12)
    assert all(int(np.argmax(r.rawPrediction.toArray())) == r.prediction for r in rows)
    assert auc > 0.95 and accuracy > 0.9


@pytest.mark.parametrize("engine", [Engine.ROUNDS, Engine.BARRIER])
def test_an_autoencoder_trains_on_features_alone_and_is_scored_by_its_loss(spark, engine):
    rng = np.random.default_rng(0)
    basis = rng.normal(size=(3, 8)).astype(np.float32)

    def frame(n, seed):  # 8 features on a 3-dimensional subspace: a 3-unit bottleneck can rebuild them
        z = np.random.default_rng(seed).normal(size=(n, 3)).astype(np.float32)
        return spark.createDataFrame([([float(v) for v in r],) for r in z @ basis], "features array<double>")

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 3), torch.nn.Linear(3, 8))
    val = frame(300, 1)
    first = SparkTrainer(net, WorkerConfig(solver=SolverConfig(base_lr=0.02, momentum=0.9), batch_size=32, seed=1),
                         DistributedConfig(workers=2, tau=1, rounds=1, engine=engine), loss=torch.nn.MSELoss(),
                         spark=spark).fit(frame(1600, 0), validation=val, label_col=None)
    trainer = SparkTrainer(net, WorkerConfig(solver=SolverConfig(base_lr=0.02, momentum=0.9), batch_size=32, seed=1),
                           DistributedConfig(workers=2, tau=25, rounds=12, engine=engine), loss=torch.nn.MSELoss(),
                           spark=spark)
    result = trainer.fit(frame(1600, 0), validation=val, label_col=None)
    s = result.summary
    assert s["test_accuracy"] is None and s["test_loss"] < first.summary["test_loss"] / 20, (s, first.summary)
    assert "val_loss" in result.history[-1] and "val_accuracy" not in result.history[-1]


def test_a_multilabel_model_s_prediction_is_what_spark_s_multilabel_evaluator_reads(spark):
    from pyspark.ml.evaluation import MultilabelClassificationEvaluator
    from pyspark.sql import functions as F

    from sparknet.layers import ActivationLayer, LinearLayer, NetParams, RDDLayer, SigmoidCrossEntropyLoss
    from sparknet.spark.ml import SparkNetEstimator

    net = NetParams(RDDLayer("data", shape=[32, 6]), RDDLayer("label", shape=[32, 3]),
                    LinearLayer("ip1", ["data"], num_outputs=16), ActivationLayer("relu1", ["ip1"], tops=["ip1"]),
                    LinearLayer("ip2", ["ip1"], num_outputs=3), SigmoidCrossEntropyLoss("loss", ["ip2", "label"]))
    est = SparkNetEstimator(net, task="multilabel", workers=2, tau=25, rounds=10, lr=0.2, momentum=0.9,
                            batch_size=32, seed=1)
    model = est.fit(_multilabel_frame(spark, 1600, 0))
    scored = model.transform(_multilabel_frame(spark, 400, 1))
    # the evaluator takes label sets as arrays of the indices that are 1
    scored = scored.withColumn("labels", F.expr("transform(filter(sequence(0, 2), i -> label[i] > 0.5), "
                                                "i -> cast(i as double))"))
    # (micro F1 and Hamming loss: a row with no label true and none predicted makes the per-row ones 0/0)
    assert MultilabelClassificationEvaluator(labelCol="labels", metricName="microF1Measure").evaluate(scored) > 0.93
    assert MultilabelClassificationEvaluator(labelCol="labels", metricName="hammingLoss").evaluate(scored) < 0.05
    first = scored.select("probability", "prediction").first()
    assert [float(i) for i, p in enumerate(first.probability.toArray()) if p > 0.5] == list(first.prediction)
