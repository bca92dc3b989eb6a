"""The bad-input catalogue on Spark, both engines: every case is one clear error before a step is trained.

Each case also checks that nothing is left behind: no round record was emitted, no RDD stays
cached, no job group stays set on the driver thread. Cases that ``test_data.py`` already runs
on the rounds engine (missing column, string feature column, rows of different lengths, wrong
length for the net, label out of range, more workers than rows, empty DataFrame, NaN features)
run here on the barrier engine only; docs/RELIABILITY.md lists every case with its test.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from _spark_testlib import blobs, mlp, module_session, partitioned_rdd
from sparknet.config import DistributedConfig, WorkerConfig
from sparknet.solvers import SolverConfig
from sparknet.spark import EngineOptions, SparkTrainer

pytestmark = pytest.mark.spark

ENGINES = ("rounds", "barrier")
ROWS = "features array<float>, label long"


spark = module_session("local[2]")


def _trainer(engine: str, *, net=None, loss=None, workers: int = 2, on_round=None) -> SparkTrainer:
    return SparkTrainer(net or mlp(), WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=4, seed=0), loss=loss,
                        on_round=on_round, dist=DistributedConfig(workers=workers, tau=2, rounds=1, engine=engine),
                        options=EngineOptions(rendezvous_timeout_s=60, collective_timeout_s=60))


def _refused(spark, engine: str, data, error, match: str, **fit_kw):
    """Fit ``data`` and expect ``error`` matching ``match``, with no round run and nothing left cached."""
    rounds: list[dict] = []
    with pytest.raises(error, match=match) as info:
        _trainer(engine, on_round=rounds.append, **fit_kw.pop("trainer", {})).fit(data, **fit_kw)
    sc = spark.sparkContext
    assert rounds == []
    assert sc._jsc.getPersistentRDDs().size() == 0
    assert sc.getLocalProperty("spark.jobGroup.id") is None
    return info.value


def _good_rows(n: int = 16) -> list[tuple[list[float], int]]:
    x, y = blobs(n)
    return [(x[i].tolist(), int(y[i])) for i in range(n)]


# (case, schema, rows, engines, message); rows=None builds the case in the test
_DATA_CASES = [
    # covered on the rounds engine by test_data.py::test_bad_input_is_refused_before_any_training
    ("missing feature column", "x array<float>, label long", [([1.0, 2.0], 0)] * 4, ("barrier",),
     "feature column 'features' not found; the DataFrame has columns"),
    ("string feature column", "features string, label long", [("1,2", 0)] * 4, ("barrier",),
     "has type string; expected array<float>"),
    ("rows differ in length", ROWS, [([1.0, 2.0], 0)] * 3 + [([1.0, 2.0, 3.0], 1)], ("barrier",),
     r"feature rows differ in length \(\[2, 3\] values\); every row needs the same length"),
    ("label out of range", ROWS, [([1.0, 2.0], 0)] * 3 + [([1.0, 2.0], 5)], ("barrier",),
     r"labels range over \[0, 5\] but the net has 3 classes \(labels must be 0..2\)"),
    ("more workers than rows", ROWS, [([1.0, 2.0], 0)], ("barrier",),
     "has 1 rows, fewer than the 2 workers asked for; use at most 1 workers"),
    ("empty DataFrame", ROWS, [], ("barrier",), "training data is empty"),
    ("NaN features", ROWS, [([1.0, float("nan")], 0)] * 4, ("barrier",), "4 rows hold NaN or infinite"),
    # new here: both engines
    ("missing label column", "features array<float>", [([1.0, 2.0],)] * 4, ENGINES,
     "label column 'label' not found"),
    ("string label column", "features array<float>, label string", [([1.0, 2.0], "cat")] * 4, ENGINES,
     "label column 'label' has type string; expected integer class ids"),
    ("array of strings", "features array<string>, label long", [(["1", "2"], 0)] * 4, ENGINES,
     "has type array<string>"),
    ("negative label", ROWS, [([1.0, 2.0], 0)] * 3 + [([1.0, 2.0], -1)], ENGINES,
     "negative label -1; labels are class ids 0..C-1"),
    ("fractional label", "features array<float>, label double", [([1.0, 2.0], 0.5)] * 4, ENGINES,
     "4 labels are not whole numbers"),
    ("null label", ROWS, [([1.0, 2.0], 0)] * 3 + [([1.0, 2.0], None)], ENGINES, "1 rows have a null label"),
    ("infinite feature", ROWS, [([float("inf"), 1.0], 0)] + [([1.0, 2.0], 1)] * 3, ENGINES,
     "1 rows hold NaN or infinite"),
    ("null row", ROWS, [(None, 0)] + [([1.0, 2.0], 1)] * 3, ENGINES, "1 rows have a null feature value"),
    ("null inside a row", ROWS, [([None, 1.0], 0)] + [([1.0, 2.0], 1)] * 7, ENGINES,
     "1 rows have a null feature value"),
]


@pytest.mark.parametrize("case, schema, rows, engine, message", [
    pytest.param(case, schema, rows, engine, message, id=f"{case}-{engine}")
    for case, schema, rows, engines, message in _DATA_CASES for engine in engines
])
def test_bad_dataframe_is_refused_before_any_training(spark, case, schema, rows, engine, message):
    df = spark.createDataFrame(rows, schema)
    _refused(spark, engine, df, ValueError, message)


@pytest.mark.parametrize("engine", ENGINES)
def test_bad_rdd_elements_are_refused(spark, engine):
    sc = spark.sparkContext
    x, y = blobs(8)
    not_pairs = sc.parallelize([(x[i], int(y[i])) for i in range(7)] + ["just a string"], 2)
    _refused(spark, engine, not_pairs, ValueError, "1 elements are not \\(numeric array, label\\) pairs")
    wide = partitioned_rdd(sc, [(np.zeros((4, 3), np.float32), y[:4]), (np.zeros((4, 3), np.float32), y[4:])])
    err = _refused(spark, engine, wide, ValueError, r"the net cannot take features of shape \(3,\)")
    assert "pass image_shape= or fix the feature column" in str(err)


def test_wrong_length_for_an_image_net_names_both_shapes(spark):
    from sparknet import zoo

    conv = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(8, 3))
    df = spark.createDataFrame([([0.5] * 15, 1)] * 4, ROWS)
    _refused(spark, "barrier", df, ValueError,
             r"feature rows must hold 16 values for this net \(shape \(1, 4, 4\)\), but rows hold \[15\] values",
             image_shape=[1, 4, 4], trainer={"net": conv})
    small = zoo.mlp(input_shape=(1, 4, 4), hidden=(4,), num_classes=3, batch_size=4)
    _refused(spark, "barrier", df, ValueError,
             r"image_shape \(1, 3, 5\) holds 15 values but the net's input layer takes \(1, 4, 4\) \(16 values\)",
             image_shape=[1, 3, 5], trainer={"net": small})


def test_an_empty_dataframe_partition_sits_out_in_the_barrier_engine(spark):
    # the rounds engine: test_data.py::test_an_empty_partition_sits_out
    rows = _good_rows(12)
    df = spark.createDataFrame(spark.sparkContext.parallelize([[], rows], 2).flatMap(lambda part: part), ROWS)
    assert df.rdd.getNumPartitions() == 2
    res = _trainer("barrier").fit(df)
    assert res.summary["rows_per_partition"] == [0, 12]
    assert res.history[-1]["samples"] == 8  # the non-empty worker: tau 2 x batch 4
    assert torch.isfinite(res.weights.to_flat(torch.float32)).all()


def test_an_empty_partition_is_refused_where_every_step_needs_every_worker(spark):
    x, y = blobs(12)
    rdd = partitioned_rdd(spark.sparkContext, [(x[:0], y[:0]), (x, y)])
    rounds: list[dict] = []
    trainer = SparkTrainer(mlp(), WorkerConfig(solver=SolverConfig(base_lr=0.1), batch_size=4), on_round=rounds.append,
                           dist=DistributedConfig(workers=2, tau=2, rounds=1, engine="barrier", strategy="sync"))
    with pytest.raises(ValueError, match="a strategy that allreduces gradients every step needs data in every "
                                         "partition"):
        trainer.fit(rdd)
    assert rounds == [] and spark.sparkContext._jsc.getPersistentRDDs().size() == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_model_that_cannot_be_pickled_is_refused_before_any_job(spark, engine):
    class WithLock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 3)
            self.lock = threading.Lock()

        def forward(self, x):
            return self.lin(x)

    df = spark.createDataFrame(_good_rows(), ROWS)
    _refused(spark, engine, df, TypeError, "model cannot be copied or pickled .*cannot pickle '_thread.lock'",
             trainer={"net": WithLock()})


@pytest.mark.parametrize("engine", ENGINES)
def test_a_loss_that_cannot_be_pickled_is_refused_before_training(spark, engine):
    lock = threading.Lock()

    def loss(pred, y):
        with lock:
            return torch.nn.functional.cross_entropy(pred, y)

    df = spark.createDataFrame(_good_rows(), ROWS)
    _refused(spark, engine, df, ValueError, "the model, loss or strategy cannot be pickled for the executors",
             trainer={"loss": loss})


def test_bad_validation_data_is_refused(spark):
    df = spark.createDataFrame(_good_rows(), ROWS)
    x, y = blobs(8)
    x[3, 1] = np.nan
    _refused(spark, "rounds", df, ValueError, "validation data: 1 rows hold NaN or infinite", validation=(x, y))
    _refused(spark, "rounds", df, ValueError, r"validation data: labels range over \[7, 7\] but the net has 3 classes",
             validation=(blobs(8)[0], np.full(8, 7)))
    bad_df = spark.createDataFrame([([1.0, float("nan")], 0)] * 2, ROWS)
    _refused(spark, "barrier", df, ValueError, "validation data: 2 rows hold NaN", validation=bad_df)
