"""Spark ML face on local[2]: Pipeline fit/transform/evaluate, save/load, params, bad params."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _spark_testlib import module_session
from sparknet import zoo
from sparknet.datasets import synthetic
from sparknet.net import Net
from sparknet.solvers import SolverConfig

pytestmark = pytest.mark.spark

WIDTH, CLASSES = 8, 3
COLUMNS = [f"x{i}" for i in range(WIDTH)]


spark = module_session("local[2]")


def _frame(spark, ds):
    import pandas as pd

    pdf = pd.DataFrame(ds.x.astype("float64"), columns=COLUMNS)
    pdf["label"] = ds.y.astype("int64")
    return spark.createDataFrame(pdf)


@pytest.fixture(scope="module")
def data(spark):
    train = _frame(spark, synthetic(400, shape=(WIDTH,), num_classes=CLASSES, seed=1, noise=1.5)).cache()
    test = _frame(spark, synthetic(200, shape=(WIDTH,), num_classes=CLASSES, seed=2, noise=1.5)).cache()
    return train, test


def _estimator(**params):
    from sparknet.spark.ml import SparkNetEstimator

    kw = dict(workers=2, tau=10, rounds=4, lr=0.05, batchSize=32, seed=0)
    kw.update(params)
    return SparkNetEstimator(zoo.mlp(input_shape=[WIDTH], hidden=[16], num_classes=CLASSES), **kw)


@pytest.fixture(scope="module")
def fitted(data):
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import VectorAssembler

    train, _ = data
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=COLUMNS, outputCol="features"), _estimator()])
    return pipeline.fit(train)


def _predictions(df):
    rows = df.select("prediction", "probability").collect()
    return np.array([r.prediction for r in rows]), np.array([r.probability.toArray() for r in rows])


def test_pipeline_fit_transform_evaluate(fitted, data):
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql.types import DoubleType

    _, test = data
    scored = fitted.transform(test)
    assert isinstance(scored.schema["prediction"].dataType, DoubleType)
    assert isinstance(scored.schema["probability"].dataType, VectorUDT)
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored)
    assert accuracy > 0.7, accuracy  # chance is 1/3
    pred, prob = _predictions(scored)
    assert prob.shape == (200, CLASSES)
    np.testing.assert_allclose(prob.sum(axis=1), 1.0, atol=1e-9)
    assert np.array_equal(pred, prob.argmax(axis=1).astype(float))
    model = fitted.stages[-1]
    assert model.summary["rounds"] == 4 and model.summary["workers"] == 2
    assert len(model.history) >= 4


def test_transform_matches_the_driver_net(fitted, data):
    # the executors' UDF and the driver-side Net agree
    from pyspark.ml.functions import vector_to_array

    _, test = data
    scored = fitted.transform(test)
    rows = scored.select(vector_to_array("features").alias("f"), "probability").collect()
    x = torch.tensor(np.array([r.f for r in rows]), dtype=torch.float32)
    want = torch.softmax(fitted.stages[-1].net.predict(x).double(), dim=1).numpy()
    got = np.array([r.probability.toArray() for r in rows])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


def test_model_is_built_once_per_worker_process(fitted, data):
    import pandas as pd
    from pyspark.sql.functions import pandas_udf

    _, test = data
    model = fitted.stages[-1]
    for _ in range(2):
        fitted.transform(test).select("prediction").collect()

    def builds(s):
        import os

        from sparknet.spark import scoring

        counts = {k: v for k, v in scoring.BUILDS.items() if k.startswith(model_id)}
        return pd.Series([f"{os.getpid()} {sorted(counts.values())}"] * len(s))

    model_id = model.modelId
    builds.__annotations__ = {"s": pd.Series, "return": pd.Series}
    seen = {r[0] for r in test.select(pandas_udf(builds, "string")("label")).collect()}
    counts = [c for line in seen for c in [line.split(" ", 1)[1]]]
    # every Python worker that scored built the model exactly once, over two transforms
    assert "[1]" in counts and set(counts) <= {"[1]", "[]"}, seen


def test_pipeline_save_load_gives_identical_predictions(fitted, data, tmp_path):
    from pyspark.ml import PipelineModel

    from sparknet import model_io
    from sparknet.spark.ml import SparkNetModel

    _, test = data
    path = str(tmp_path / "pipeline")
    fitted.write().overwrite().save(path)
    loaded = PipelineModel.load(path)
    assert isinstance(loaded.stages[-1], SparkNetModel)
    assert loaded.stages[-1].modelId == fitted.stages[-1].modelId
    assert loaded.stages[-1].summary["rounds"] == 4
    pred_a, prob_a = _predictions(fitted.transform(test))
    pred_b, prob_b = _predictions(loaded.transform(test))
    assert np.array_equal(pred_a, pred_b)
    assert np.array_equal(prob_a, prob_b)
    # the same model as a plain sparknet model folder (what `sparknet predict` reads)
    folder = fitted.stages[-1].saveModelFolder(str(tmp_path / "folder"))
    saved = model_io.load_model(folder)
    assert saved.weights.allclose(fitted.stages[-1].weights, rtol=0, atol=0)
    assert saved.solver is not None and saved.config["dist"]["tau"] == 10


def test_features_cols_train_on_a_table_s_own_columns_as_an_assembler_would(fitted, data):
    from pyspark.sql import functions as F

    train, test = data
    model = _estimator(featuresCols=COLUMNS).fit(train)  # no VectorAssembler: the same rows, joined in order
    assert model.trainedColumns == COLUMNS
    assert model.weights.allclose(fitted.stages[-1].weights, rtol=0, atol=0)
    pred, prob = _predictions(model.transform(test))  # the same columns joined where the data has no features
    pred_a, prob_a = _predictions(fitted.transform(test))
    assert np.array_equal(pred, pred_a) and np.array_equal(prob, prob_a)
    mixed = train.select(F.array(*COLUMNS[:5]).alias("head"), *COLUMNS[5:], "label")  # an array and numbers
    assert _estimator(featuresCols=["head", *COLUMNS[5:]]).fit(mixed).weights.allclose(model.weights, rtol=0, atol=0)
    from sparknet.spark.ml import SparkNetEstimator

    one = SparkNetEstimator(zoo.mlp(input_shape=[1], hidden=[4], num_classes=CLASSES), featuresCols=["x0"], workers=2,
                            tau=5, rounds=1, seed=0).fit(train)  # one number column: an array of one
    assert one.trainedColumns == ["x0"] and one.transform(test).filter("prediction >= 0").count() == 200
    with pytest.raises(ValueError, match="set featuresCol .* or featuresCols .*, not both"):
        _estimator(featuresCols=COLUMNS, featuresCol="features").fit(train)
    with pytest.raises(ValueError, match="name a column twice"):
        _estimator(featuresCols=COLUMNS, labelCol="x0").fit(train)
    with pytest.raises(ValueError, match="featuresCols names one or more distinct columns"):
        _estimator(featuresCols=["x0", "x0"])


def test_weight_col_weighs_each_row_s_loss(data):
    """weightCol weighs the training rows' loss and the held-out rows' scores: the fit's test scores are what
    evaluate(weightCol=) gives its validation rows."""
    from pyspark.sql import functions as F

    train, test = data
    unheard = train.withColumn("w", (F.col("label") != 2).cast("double"))  # class 2's rows weigh nothing
    held = unheard.withColumn("held", F.abs((F.col("x1") * 11).cast("long")) % 5 == 0)
    model = _estimator(featuresCols=COLUMNS, weightCol="w", rounds=8, validationIndicatorCol="held").fit(held)
    validation = held.filter("held")
    scores = model.evaluate(validation, weightCol="w")
    assert model.summary["validation_weight"] == scores["weight"] < scores["rows"]
    assert model.summary["test_accuracy"] == pytest.approx(scores["accuracy"], rel=1e-12)
    assert model.summary["test_loss"] == pytest.approx(scores["loss"], rel=1e-5)
    assert model.summary["test_accuracy"] != pytest.approx(model.evaluate(validation)["accuracy"], rel=1e-6)
    pred, _ = _predictions(model.transform(test))
    plain, _ = _predictions(_estimator(featuresCols=COLUMNS, rounds=8).fit(unheard).transform(test))
    assert (pred == 2).mean() < 0.05 < (plain == 2).mean(), ((pred == 2).mean(), (plain == 2).mean())
    with pytest.raises(ValueError, match="weight column 'nope' not found"):
        _estimator(featuresCols=COLUMNS, weightCol="nope").fit(train)


def test_a_plain_module_trains_with_its_own_loss_and_its_model_saves(data, tmp_path):
    from pyspark.ml import Pipeline
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    from sparknet.spark.ml import SparkNetEstimator, SparkNetModel

    train, test = data
    module = torch.nn.Sequential(torch.nn.Linear(WIDTH, 16), torch.nn.ReLU(), torch.nn.Linear(16, CLASSES))
    before = [p.detach().clone() for p in module.parameters()]
    est = SparkNetEstimator(module, loss=torch.nn.CrossEntropyLoss(label_smoothing=0.05), featuresCols=COLUMNS,
                            workers=2, tau=10, rounds=8, lr=0.05, batchSize=32, seed=0)
    model = est.fit(train)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))  # a copy trained, not the user's
    scored = model.transform(test)
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored)
    assert accuracy > 0.7 and model.trainedColumns == COLUMNS and model.getImageShape() == [WIDTH], accuracy
    model.save(str(tmp_path / "model"))
    loaded = SparkNetModel.load(str(tmp_path / "model"), allow_pickle=True)  # the module is a pickle: trusted only
    assert np.array_equal(_predictions(loaded.transform(test))[1], _predictions(scored)[1])
    with pytest.raises(ValueError, match="pickle"):
        SparkNetModel.load(str(tmp_path / "model"))
    folder = model.saveModelFolder(str(tmp_path / "folder"))  # the task its fit was for, in the folder
    regressor = SparkNetEstimator(torch.nn.Linear(WIDTH, 1), loss=torch.nn.MSELoss(), featuresCols=COLUMNS, workers=2,
                                  tau=5, rounds=1).fit(train)
    regressor.saveModelFolder(str(tmp_path / "regressor"))
    assert SparkNetModel.fromModelFolder(str(tmp_path / "regressor"), allow_pickle=True).resolvedTask().value == \
        "regression"
    assert SparkNetModel.fromModelFolder(folder, allow_pickle=True).resolvedTask().value == "classification"
    with pytest.raises(ValueError, match="an estimator of a plain torch.nn.Module is not saved"):
        Pipeline(stages=[est]).write().save(str(tmp_path / "pipeline"))
    with pytest.raises(ValueError, match="a NetParams net carries its own loss layers"):
        SparkNetEstimator(zoo.mlp(input_shape=[WIDTH], hidden=[16], num_classes=CLASSES), loss=torch.nn.MSELoss())


def test_cross_validator_tunes_an_estimator_of_a_plain_module_every_fit_from_the_same_start(data):
    """CrossValidator copies the estimator for each param map and fits it on each fold: every fit trains its own
    copy of the module from the weights the user gave, so the learning rate that trains wins and the module given
    stays as it was."""
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    from sparknet.spark.ml import SparkNetEstimator

    train, test = data
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(WIDTH, 16), torch.nn.ReLU(), torch.nn.Linear(16, CLASSES))
    before = [p.detach().clone() for p in module.parameters()]
    est = SparkNetEstimator(module, loss=torch.nn.CrossEntropyLoss(), featuresCols=COLUMNS, workers=2, tau=10,
                            rounds=4, lr=0.05, batchSize=32, seed=0)
    grid = ParamGridBuilder().addGrid(est.lr, [1e-6, 0.05]).build()
    evaluator = MulticlassClassificationEvaluator(metricName="accuracy")
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, evaluator=evaluator, numFolds=2, seed=7).fit(train)
    assert cv.avgMetrics[1] > 0.7 and cv.avgMetrics[1] > cv.avgMetrics[0] + 0.2, cv.avgMetrics
    assert evaluator.evaluate(cv.bestModel.transform(test)) > 0.7
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))


def test_profile_dir_traces_a_round_of_each_of_the_estimator_s_workers(data, tmp_path):
    train, _ = data
    _estimator(featuresCols=COLUMNS, rounds=2, profileDir=str(tmp_path / "traces"), profileRound=1).fit(train)
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        f"worker-{i}-round1.{ext}" for i in (0, 1) for ext in ("json", "txt")]
    with pytest.raises(ValueError, match="profile_round must be at least 0"):
        _estimator(profileDir="t", profileRound=-1)


def test_evaluate_scores_where_the_rows_live_as_a_fit_scores_its_test_set(data):
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.sql import functions as F

    train, test = data
    model = _estimator(featuresCols=COLUMNS).fit(train)
    metrics = model.evaluate(test.repartition(3))
    scored = model.transform(test)
    assert metrics["rows"] == 200
    assert metrics["accuracy"] == MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored)
    x = np.array(test.select(*COLUMNS).collect(), dtype=np.float32)
    y = np.array([r.label for r in test.select("label").collect()])
    on_driver = model.net.evaluate((x, y))  # the loss and the metrics of the driver's net on the same rows
    assert metrics["loss"] == pytest.approx(on_driver.loss, rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(on_driver.accuracy)
    with pytest.raises(ValueError, match=r"labels range over \[0, 7\] but the net has 3 classes"):
        model.evaluate(test.withColumn("label", F.when(F.col("label") == 2, 7).otherwise(F.col("label"))))
    with pytest.raises(ValueError, match="the data evaluated on holds no rows"):
        model.evaluate(test.limit(0))
    with pytest.raises(ValueError, match="1 rows have a null label"):
        model.evaluate(test.withColumn("label", F.when(F.monotonically_increasing_id() == 0, None)
                                       .otherwise(F.col("label"))))


def test_evaluate_with_a_weight_col_gives_spark_s_weighted_accuracy(data):
    """evaluate(weightCol=) weighs each row's loss and hits by its sample weight: the accuracy, F1 and weighted
    precision Spark's evaluator gives with the same weightCol (and without it, unweighted), the loss the driver's net
    gives the same rows and weights; weights of one give the unweighted scores; bad weights are counted and named."""
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.sql import functions as F

    train, test = data
    model = _estimator(featuresCols=COLUMNS).fit(train)
    weighted = test.withColumn("w", F.abs((F.col("x0") * 7).cast("long")) % 4 * 0.5)  # 0, 0.5, 1 or 1.5
    metrics = model.evaluate(weighted.repartition(3), weightCol="w")
    w = np.array([r.w for r in weighted.select("w").collect()])
    assert metrics["rows"] == 200 and metrics["weight"] == pytest.approx(w.sum()) and (w == 0).any()
    scored, unweighted = model.transform(weighted), model.evaluate(weighted)
    for ours, theirs in (("accuracy", "accuracy"), ("f1", "f1"), ("weighted_precision", "weightedPrecision")):
        for weight_col, got in (("w", metrics), (None, unweighted)):  # and every row once
            spark_value = MulticlassClassificationEvaluator(
                metricName=theirs, **({"weightCol": weight_col} if weight_col else {})).evaluate(scored)
            assert got[ours] == pytest.approx(spark_value, rel=1e-12), (ours, weight_col)
    assert metrics["accuracy"] != pytest.approx(model.evaluate(test)["accuracy"], rel=1e-6)  # the weights tell
    x = np.array(weighted.select(*COLUMNS).collect(), dtype=np.float32)
    y = np.array([r.label for r in weighted.select("label").collect()])
    assert metrics["loss"] == pytest.approx(model.net.evaluate((x, y), weights=w).loss, rel=1e-5)
    ones = model.evaluate(test.withColumn("w", F.lit(1)), weightCol="w")
    plain = model.evaluate(test)
    assert ones["accuracy"] == plain["accuracy"] and ones["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    with pytest.raises(ValueError, match="1 rows have a null, NaN, infinite or negative sample weight"):
        model.evaluate(test.withColumn("w", F.when(F.monotonically_increasing_id() == 0, -1.0).otherwise(1.0)),
                       weightCol="w")
    with pytest.raises(ValueError, match="weight column 'name' has type string; sample weights are numbers"):
        model.evaluate(test.withColumn("name", F.lit("a")), weightCol="name")


def test_validation_fraction_holds_out_a_seeded_share_of_the_rows_and_scores_them(data):
    from sparknet.spark.data import held_out

    train, _ = data
    model = _estimator(featuresCols=COLUMNS, validationFraction=0.25, patience=2, rounds=6).fit(train)
    held = train.filter(held_out(0, [*COLUMNS, "label"], 0.25))  # the estimator's seed, its columns
    assert 60 < held.count() < 140  # of 400
    s = model.summary
    assert s["returned_weights"] == "best"
    assert model.evaluate(held)["accuracy"] == pytest.approx(s["test_accuracy"])  # its scores: those rows'
    with pytest.raises(ValueError, match="not both"):
        _estimator(featuresCols=COLUMNS, validationFraction=0.2, validationIndicatorCol="x0").fit(train)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        _estimator(validationFraction=1.0)


def test_model_from_a_net_trained_in_process_scores_arrays(spark, data):
    from pyspark.sql import functions as F

    from sparknet.spark.ml import SparkNetModel

    train_ds = synthetic(300, shape=(WIDTH,), num_classes=CLASSES, seed=1, noise=1.5)
    net = Net(zoo.mlp(input_shape=[WIDTH], hidden=[16], num_classes=CLASSES), SolverConfig(base_lr=0.05),
              batch_size=32, seed=0)
    net.set_training_data(train_ds)
    net.train(30)
    _, test = data
    df = test.select(F.array(*COLUMNS).alias("feats"), "label")
    model = SparkNetModel.from_net(net, featuresCol="feats", probabilityCol="")
    scored = model.transform(df)
    assert "probability" not in scored.columns
    rows = scored.collect()
    x = np.array([r.feats for r in rows], dtype=np.float32)
    assert [r.prediction for r in rows] == net.predict(x).argmax(1).double().tolist()
    # binary features: little-endian float32 bytes, read with imageShape
    blobs = spark.createDataFrame([(bytearray(row.astype("<f4").tobytes()),) for row in x[:20]], ["img"])
    scored = model.copy({model.featuresCol: "img", model.imageShape: [WIDTH]}).transform(blobs)
    assert [r.prediction for r in scored.collect()] == net.predict(x[:20]).argmax(1).double().tolist()


def test_estimator_params_round_trip(spark, tmp_path):  # save and load need the module's session
    from sparknet.spark.ml import SparkNetEstimator

    est = _estimator(engine="barrier", strategy="diloco", roundSeconds=2.5, warmup_steps=7, imageShape=[WIDTH],
                     featuresCol="feats", validationIndicatorCol="is_val")
    assert est.getEngine() == "barrier" and est.getWarmupSteps() == 7 and est.getTau() == 10
    est.save(str(tmp_path / "est"))
    loaded = SparkNetEstimator.load(str(tmp_path / "est"))

    def params(e):
        return {p.name: v for p, v in e.extractParamMap().items()}

    assert params(loaded) == params(est)
    assert loaded.uid == est.uid
    assert loaded.getNet().to_dict() == est.getNet().to_dict()
    run, dist = loaded.configs(default_workers=2)
    assert dist.engine.value == "barrier" and dist.round_seconds == 2.5 and run.batch_size == 32
    assert "Local steps per round" in loaded.explainParam("tau")


def test_the_engines_settings_are_params_too():
    from sparknet.spark import EngineOptions
    from sparknet.spark.ml import SparkNetEstimator

    assert SparkNetEstimator().engineOptions() == EngineOptions()
    est = SparkNetEstimator(roundTimeoutS=90, storageLevel="MEMORY_ONLY_2", workerStateOnDriver=True, maxRestarts=1)
    assert est.engineOptions() == EngineOptions(round_timeout_s=90.0, storage_level="MEMORY_ONLY_2",
                                                worker_state_on_driver=True, max_restarts=1)
    assert "longest wait for one round's Spark job" in est.explainParam("roundTimeoutS")
    assert not SparkNetEstimator().hasParam("fault") and not SparkNetEstimator().hasParam("link")  # code only


def test_the_gpu_share_and_the_workers_compute_options_are_params():
    from sparknet.net import Compute
    from sparknet.spark.ml import SparkNetEstimator

    run, _ = SparkNetEstimator().configs()
    assert run.worker().gpus_per_worker is None and run.worker().compute == Compute()
    est = SparkNetEstimator(gpusPerWorker=0.5, precision="BF16", compile=True, channelsLast=True)
    worker = est.configs()[0].worker()
    assert worker.gpus_per_worker == 0.5 and worker.compute == Compute("bf16", compile=True, channels_last=True)
    assert "stage-level resource profile" in est.explainParam("gpusPerWorker")
    with pytest.raises(ValueError, match="gpus_per_worker"):
        SparkNetEstimator(gpusPerWorker=0.3)


def test_workers_of_several_processes_are_params():
    from sparknet.spark.ml import SparkNetEstimator

    est = SparkNetEstimator(workers=2, procsPerWorker=4, shardReplica=True, engine="barrier")
    dist = est.configs()[1]
    assert (dist.workers, dist.procs_per_worker, dist.shard_replica, dist.ranks) == (2, 4, True, 8)
    assert "average their gradients every step" in est.explainParam("procsPerWorker")
    assert SparkNetEstimator(procsPerWorker=2, engine="barrier").configs(default_workers=4)[1].workers == 2
    with pytest.raises(ValueError, match="add --engine barrier"):
        SparkNetEstimator(procsPerWorker=2, engine="rounds").configs()
    with pytest.raises(ValueError, match="procs-per-worker must be at least 1"):
        SparkNetEstimator(procsPerWorker=0)
    # a param whose rule involves other params is checked when they are all set
    assert SparkNetEstimator(overlap=True, fragments=2, workers=2, engine="barrier").configs()[1].streaming()


def test_a_split_net_is_params_and_fits_as_a_pipeline_stage(data):
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import VectorAssembler

    from sparknet.spark.ml import SparkNetEstimator

    est = SparkNetEstimator(workers=4, modelParallel=2, parallelPlan="ip1=column", maxWeightBytes=1e6,
                            engine="barrier")
    dist = est.configs()[1]
    assert (dist.model_parallel, dist.parallel_plan, dist.max_weight_bytes) == (2, "ip1=column", 1e6)
    assert dist.as_workers().workers == 2 and "copy of the net is split" in est.explainParam("modelParallel")
    with pytest.raises(ValueError, match="model-parallel must be at least 1"):
        SparkNetEstimator(modelParallel=0)
    with pytest.raises(ValueError, match="do not divide into model-parallel groups of 2"):
        SparkNetEstimator(workers=3, modelParallel=2, engine="barrier").configs()
    both = SparkNetEstimator(workers=3, procsPerWorker=4, modelParallel=2, engine="barrier").configs()[1]
    assert (both.as_workers().workers, both.ranks) == (3, 12)  # three workers, each two copies split in two
    assert SparkNetEstimator(workers=4, modelParallel=4, engine="barrier").configs()[1].as_workers().workers == 1
    with pytest.raises(ValueError, match="a multiple of --model-parallel 4"):  # each param fine alone, not together
        SparkNetEstimator(workers=3, procsPerWorker=2, modelParallel=4, engine="barrier").configs()
    train, test = data  # one worker of the session's two task slots, its layers split over both
    stage = _estimator(engine="barrier", modelParallel=2)
    model = Pipeline(stages=[VectorAssembler(inputCols=COLUMNS, outputCol="features"), stage]).fit(train)
    summary = model.stages[-1].summary
    assert (summary["workers"], summary["model_parallel"], summary["plan"]) == (1, 2, {"ip1": "column", "ip2": "row"})
    assert len(summary["weight_bytes_per_worker"]) == 2
    scored = model.transform(test).select("prediction", "label").collect()
    assert np.mean([r.prediction == r.label for r in scored]) > 0.6


@pytest.mark.parametrize("params, match", [
    ({"engine": "spaceship"}, "unknown engine"),
    ({"strategy": "magic"}, "unknown strategy"),
    ({"tau": 0}, "tau must be at least 1"),
    ({"lr": -1.0}, "learning rate"),
    ({"workers": 0}, "workers must be at least 1"),
    ({"solverType": "newton"}, "solver"),
    ({"no_such_thing": 1}, "no parameter 'no_such_thing'"),
])
def test_bad_params_are_a_clear_value_error(params, match):
    from sparknet.spark.ml import SparkNetEstimator

    with pytest.raises(ValueError, match=match):
        SparkNetEstimator(**params)
    with pytest.raises(ValueError, match=match):
        _estimator().setParams(**params)


def test_bad_settings_fail_before_training(spark, data):
    from pyspark.ml.feature import VectorAssembler

    train, _ = data
    assembled = VectorAssembler(inputCols=COLUMNS, outputCol="features").transform(train)
    tracker = spark.sparkContext.statusTracker()
    jobs_before = len(tracker.getJobIdsForGroup())
    with pytest.raises(ValueError, match="give tau, round_seconds"):
        _estimator(tau=None).fit(assembled)
    with pytest.raises(ValueError, match="feature column 'nope' not found"):
        _estimator(featuresCol="nope").fit(assembled)
    with pytest.raises(ValueError, match="feature column 'x0' has type double"):
        _estimator(featuresCol="x0").fit(assembled)
    with pytest.raises(ValueError, match="targetAccuracy needs validation rows"):
        _estimator(targetAccuracy=0.9).fit(assembled)
    with pytest.raises(ValueError, match="patience needs validation rows: set validationIndicatorCol"):
        _estimator(patience=3).fit(assembled)
    assert len(tracker.getJobIdsForGroup()) == jobs_before  # no Spark job ran


def test_fit_shows_progress_and_calls_back_every_round(spark, data, tmp_path, capfd):
    """The estimator's fit: each round record to every callback and to metricsOut, and (stderr being no
    terminal here) one plain progress line per round; quiet=True draws none."""
    from pyspark.ml.feature import VectorAssembler

    from sparknet.metrics import read_metrics

    train, _ = data
    frame = VectorAssembler(inputCols=COLUMNS, outputCol="features").transform(train)
    seen, rounds = [], []
    est = _estimator(callbacks=[seen.append, lambda r: rounds.append(r["round"])],
                     metricsOut=str(tmp_path / "m.jsonl"))
    capfd.readouterr()
    model = est.fit(frame)
    err = capfd.readouterr().err
    assert rounds == [1, 2, 3, 4]
    assert [r["round"] for r in seen] == rounds and seen == model.history
    written = read_metrics(tmp_path / "m.jsonl")
    assert [r["round"] for r in written[:-1]] == rounds and written[-1]["event"] == "summary"
    lines = [ln for ln in err.splitlines() if ln.startswith("[sparknet] ")]
    assert [ln.split()[1] for ln in lines] == ["10/40", "20/40", "30/40", "40/40"], err
    assert all("round=" in ln and "loss=" in ln and "elapsed" in ln for ln in lines)

    assert model.summary["rounds_transport"] == "socket"  # the engines' default

    quiet = _estimator(quiet=True, roundsTransport="spark", roundTimeoutS=120.0).fit(frame)
    assert not [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("[sparknet] ")]
    assert quiet.summary["rounds_transport"] == "spark"  # an EngineOptions field, set as a Param


def test_callbacks_must_be_callables():
    with pytest.raises(ValueError, match="callbacks must be callables"):
        _estimator(callbacks=[1])


def test_fit_logs_to_the_users_active_mlflow_run(spark, data, tmp_path, monkeypatch):
    """mlflow='' inside mlflow.start_run(): params, per-round metrics and an MLflow model in the user's own run;
    mlflow.pyfunc.load_model scores a pandas frame as the Spark model does."""
    import mlflow

    monkeypatch.chdir(tmp_path)  # a SQLite store keeps its artifacts in ./mlruns
    import pandas as pd
    from pyspark.ml.feature import VectorAssembler
    from pyspark.ml.functions import vector_to_array

    train, test = data
    assembler = VectorAssembler(inputCols=COLUMNS, outputCol="features")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    try:
        mlflow.set_experiment("estimator")  # in this store: not the experiment an earlier test left active
        with mlflow.start_run() as mine:
            model = _estimator(mlflow="", quiet=True).fit(assembler.transform(train))
        client = mlflow.tracking.MlflowClient(uri)
        assert [r.info.run_id for r in client.search_runs([mine.info.experiment_id])] == [mine.info.run_id]
        run = client.get_run(mine.info.run_id)
        assert run.data.params["dist.tau"] == "10"
        assert len(client.get_metric_history(mine.info.run_id, "train/loss")) == 4
        loaded = mlflow.pyfunc.load_model(f"runs:/{mine.info.run_id}/model")
        rows = (model.transform(assembler.transform(test)).select(vector_to_array("features").alias("f"), "prediction")
                .limit(50).collect())
        out = loaded.predict(pd.DataFrame({"features": [np.asarray(r.f) for r in rows]}))
        assert list(out["prediction"]) == [r.prediction for r in rows]
    finally:
        mlflow.set_tracking_uri(None)


def test_the_output_probe_reads_an_image_shape_laid_out_otherwise_as_the_nets_own_input():
    """imageShape says how a column's values are laid out ([784] for flat pixels); the probe that counts the
    model's outputs gives the net its own input shape ((1, 28, 28)), as the model's predict does."""
    from sparknet import Net, zoo
    from sparknet.model_io import pack_model
    from sparknet.spark.ml import SparkNetModel

    net = Net(zoo.lenet())
    model = SparkNetModel._from_files(pack_model(net, input_shape=(1, 28, 28)), allow_pickle=False)
    assert model._outputs([784]) == 10 and model._outputs(None) == 10
