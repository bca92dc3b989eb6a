"""The rounds engine's evaluation where the validation rows stay in Spark (``eval_sharded``), on local[2]: the same
scores as the driver's evaluation, screens and weights included, the training untouched, the rows never on the
driver, and the cached rows let go."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _spark_testlib import blobs, mlp, module_session
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.solvers import SolverConfig
from sparknet.spark import SparkTrainer

pytestmark = pytest.mark.spark

spark = module_session("local[2]")


def _frame(spark, x, y, w=None, partitions: int = 3):
    rows = [(x[i].tolist(), int(y[i])) + (() if w is None else (float(w[i]),)) for i in range(len(y))]
    schema = "features array<float>, label long" + ("" if w is None else ", weight double")
    return spark.createDataFrame(rows, schema).repartition(partitions)


def _fit(train, validation, *, sharded: bool, weight_col=None, **dist):
    kw = dict(workers=2, tau=5, rounds=3, eval_budget=1.0, eval_screen_rows=0, eval_sharded=sharded)
    kw.update(dist)
    trainer = SparkTrainer(mlp(1), WorkerConfig(solver=SolverConfig(base_lr=0.05), batch_size=16, seed=2),
                           DistributedConfig(**kw))
    return trainer.fit(train, validation=validation, weight_col=weight_col)


def _scores(result, prefix="val_"):
    return [{k: v for k, v in r.items() if k.startswith(prefix)} for r in result.history]


def _persisted(spark) -> int:
    return len(spark.sparkContext._jsc.getPersistentRDDs())


@pytest.fixture(scope="module")
def data(spark):
    x, y = blobs(400, seed=6)
    vx, vy = blobs(300, seed=7)
    train = _frame(spark, x, y, partitions=2).cache()
    train.count()  # cached now: what the tests count as persisted before a fit
    return train, (vx, vy)


def _close(a: list[dict], b: list[dict]) -> None:
    """The same metrics, to float rounding: the executors add up their partitions' sums, the driver its batches'."""
    assert [sorted(r) for r in a] == [sorted(r) for r in b] and a
    for ra, rb in zip(a, b):
        for key in ra:
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-9), key


def test_every_round_is_scored_where_the_rows_are_as_the_driver_scores_it(spark, data):
    """A validation DataFrame of 3 partitions, dealt into one a worker: every round's scores are the driver's
    (accuracy, the F1 scores and the loss, to rounding), the weights trained are the same bits, one Spark job an
    evaluation, and the driver's net never held a validation row. The chunks are let go at the end."""
    train, (vx, vy) = data
    frame = _frame(spark, vx, vy)
    before = _persisted(spark)
    driver = _fit(train, frame, sharded=False)
    sharded = _fit(train, frame, sharded=True)
    assert _persisted(spark) == before
    assert torch.equal(driver.weights.to_flat(torch.float32), sharded.weights.to_flat(torch.float32))
    _close(_scores(sharded), _scores(driver))
    assert [r["val_accuracy"] for r in sharded.history] == [r["val_accuracy"] for r in driver.history]
    assert sharded.summary["eval_sharded"] is True and sharded.summary["evaluation_jobs"] == 3
    assert "eval_sharded" in driver.summary and driver.summary["eval_sharded"] is False
    assert sharded.summary["test_accuracy"] == driver.summary["test_accuracy"]
    assert sharded.net._val is None and driver.net._val is not None
    assert sharded.summary["validation_weight"] is None


def test_local_arrays_are_handed_to_spark_and_a_screen_with_the_rest_is_the_whole_set(spark, data):
    """(x, y) arrays go to Spark once, in contiguous slices, then stay there. A screen of 50 rows scores the rows the
    driver's net screens, and the 250 it left out, joined with it, give the whole set's scores (a target loss judges
    the whole set, so every round screens and completes)."""
    train, val = data
    kw = dict(eval_screen_rows=50, target_loss=1e-9, rounds=3)
    driver = _fit(train, val, sharded=False, **kw)
    sharded = _fit(train, val, sharded=True, **kw)
    assert [r["screen_rows"] for r in sharded.history] == [50] * 3
    _close(_scores(sharded, "screen_"), _scores(driver, "screen_"))
    _close(_scores(sharded), _scores(driver))
    assert sharded.summary["evaluation_jobs"] == 6  # a screen and the rest, each round


def test_a_weight_column_weighs_each_row_where_it_stays(spark, data):
    """The fit's weight_col on the validation DataFrame: each row counts its weight, as on the driver, and the
    summary says the total. Half the rows are misclassified on purpose at weight 0, so an unweighted score would
    differ."""
    train, (vx, vy) = data
    wrong = np.arange(len(vy)) % 2 == 0
    vy = np.where(wrong, (vy + 1) % 3, vy)
    w = np.where(wrong, 0.0, np.linspace(0.5, 2.0, len(vy)))
    frame = _frame(spark, vx, vy, w)
    train_w = train.withColumn("weight", train["label"] * 0 + 1.0)
    driver = _fit(train_w, frame, sharded=False, weight_col="weight")
    sharded = _fit(train_w, frame, sharded=True, weight_col="weight")
    _close(_scores(sharded), _scores(driver))
    assert sharded.summary["validation_weight"] == pytest.approx(driver.summary["validation_weight"], rel=1e-12)
    assert sharded.summary["validation_weight"] == pytest.approx(float(w.sum()), rel=1e-6)
    assert sharded.history[-1]["val_accuracy"] > 0.9  # the wrong rows weigh nothing


def test_bad_validation_rows_are_refused_with_the_drivers_words(spark, data):
    train, (vx, vy) = data
    before = _persisted(spark)
    with pytest.raises(ValueError, match=r"validation data: labels range over \[0, 7\] but the net has 3 classes"):
        _fit(train, _frame(spark, vx, np.where(vy == 1, 7, 0)), sharded=True)
    zero = _frame(spark, vx, vy, np.zeros(len(vy)))
    with pytest.raises(ValueError, match="all 300 rows have a sample weight of 0"):
        _fit(train.withColumn("weight", train["label"] * 0 + 1.0), zero, sharded=True, weight_col="weight")
    with pytest.raises(ValueError, match="all 300 rows have a sample weight of 0"):
        _fit(train, (vx, vy, np.zeros(len(vy))), sharded=True)
    assert _persisted(spark) == before


def test_sharded_evaluation_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="eval_sharded.*barrier engine evaluates on its workers"):
        DistributedConfig(workers=2, engine="barrier", eval_sharded=True)
    with pytest.raises(ValueError, match="eval_sharded.*eval_overlap.*choose one"):
        DistributedConfig(workers=2, eval_sharded=True, eval_overlap=True)
