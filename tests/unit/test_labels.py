"""What a net learns: the task inferred from its loss, the regression metrics, and a regression Net."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparknet import zoo
from sparknet.layers import EuclideanLoss, LinearLayer, NetParams, RDDLayer
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.labels import Task, infer_task, regression_metrics, regression_sums


@pytest.mark.parametrize("loss", [torch.nn.MSELoss(), torch.nn.L1Loss(), torch.nn.HuberLoss(), torch.nn.SmoothL1Loss()])
def test_a_regression_loss_means_regression(loss):
    assert infer_task(loss) is Task.REGRESSION


def test_no_loss_or_a_classification_loss_means_classification_and_a_given_task_wins():
    assert infer_task(None) is Task.CLASSIFICATION
    assert infer_task(torch.nn.CrossEntropyLoss()) is Task.CLASSIFICATION
    assert infer_task(torch.nn.CrossEntropyLoss(), task="regression") is Task.REGRESSION
    assert infer_task(torch.nn.MSELoss(), task=Task.CLASSIFICATION) is Task.CLASSIFICATION
    with pytest.raises(ValueError, match="task must be one of"):
        infer_task(None, task="ranking")


def _euclidean_net() -> NetParams:
    return NetParams(RDDLayer("data", shape=[8, 3]), RDDLayer("label", shape=[8, 1]),
                     LinearLayer("fc", ["data"], num_outputs=1), EuclideanLoss("loss", ["fc", "label"]))


def test_a_euclidean_loss_layer_means_regression():
    assert infer_task(None, _euclidean_net()) is Task.REGRESSION
    assert infer_task(None, zoo.lenet()) is Task.CLASSIFICATION
    assert Net(_euclidean_net()).task is Task.REGRESSION


def test_the_metrics_are_r2_rmse_and_mae_of_the_summed_values():
    y = torch.tensor([1.0, 2.0, 3.0, 4.0])
    pred = torch.tensor([1.5, 2.0, 2.0, 4.0])
    m = regression_metrics(regression_sums(pred, y))
    sse, sst = 0.25 + 0 + 1 + 0, ((y - y.mean()) ** 2).sum().item()
    assert math.isclose(m["r2"], 1 - sse / sst) and math.isclose(m["rmse"], math.sqrt(sse / 4))
    assert math.isclose(m["mae"], 1.5 / 4)
    # sums add up: two halves give the whole
    halves = np.add(regression_sums(pred[:2], y[:2]), regression_sums(pred[2:], y[2:]))
    assert regression_metrics(halves) == pytest.approx(m)
    assert math.isnan(regression_metrics([0, 0, 0, 0, 0])["r2"])


def test_a_regression_net_takes_one_number_per_row_for_one_output_without_broadcasting():
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 1)
    net = Net(module, SolverConfig(base_lr=0.1), loss=torch.nn.MSELoss(), batch_size=8)
    x = torch.randn(8, 3)
    y = torch.arange(8)  # whole numbers: taken as floats to regress
    net.set_validation_data((x.numpy(), y.numpy()))
    res = net.evaluate()
    with torch.no_grad():
        want = ((module(x)[:, 0] - y.float()) ** 2).mean().item()  # [n, 1] against [n], not an [n, n] broadcast
    assert math.isclose(res.loss, want, rel_tol=1e-5)
    assert math.isnan(res.accuracy) and res.score == res.metrics["r2"] and set(res.metrics) == {"r2", "rmse", "mae"}


def test_a_regression_net_learns_a_line():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32) + 1.0).astype(np.float32)
    torch.manual_seed(0)
    net = Net(torch.nn.Linear(3, 1), SolverConfig(base_lr=0.05, momentum=0.9), loss=torch.nn.MSELoss(), batch_size=32,
              seed=0)
    net.set_training_data((x, y))
    net.set_validation_data((x, y))
    before = net.evaluate().metrics["r2"]
    net.train(300)
    after = net.evaluate()
    assert before < 0.5 and after.metrics["r2"] > 0.999 and after.metrics["rmse"] < 0.05


def test_bce_losses_mean_multilabel_and_its_metrics_are_accuracy_and_mean_f1():
    from sparknet.labels import multilabel_metrics, multilabel_sums

    assert infer_task(torch.nn.BCEWithLogitsLoss()) is Task.MULTILABEL
    assert infer_task(torch.nn.MultiLabelSoftMarginLoss()) is Task.MULTILABEL
    y = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    logits = torch.tensor([[2.0, -1.0, -3.0], [-1.0, 0.5, -2.0], [0.3, 0.2, -1.0]])  # 0: TP FN FP; 1: TP TP
    m = multilabel_metrics(multilabel_sums(logits, y))
    assert m["accuracy"] == 7 / 9
    # label 0: tp 1, fp 1, fn 1 -> F1 0.5; label 1: tp 2 -> 1.0; label 2 never true nor predicted: left out
    assert m["f1"] == pytest.approx((0.5 + 1.0) / 2)
    halves = np.add(multilabel_sums(logits[:1], y[:1]), multilabel_sums(logits[1:], y[1:]))
    assert multilabel_metrics(halves) == m


def _exact_auc(scores: np.ndarray, truth: np.ndarray) -> float:
    """Mann-Whitney: the share of (positive, negative) pairs the positive outscores, ties a half."""
    pos, neg = scores[truth], scores[~truth]
    return float(((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum())
                 / (len(pos) * len(neg)))


def test_multilabel_auc_is_each_label_s_pairwise_auc_averaged_and_adds_up_over_batches():
    from sparknet.labels import AUC_BINS, multilabel_metrics, multilabel_sums

    rng = np.random.default_rng(0)
    truth = rng.random((300, 3)) < np.array([0.3, 0.5, 0.7])
    logits = torch.tensor(np.where(truth, 0.8, -0.8) * np.array([0.5, 1.0, 3.0]) + rng.normal(size=truth.shape))
    y = torch.tensor(truth, dtype=torch.float32)
    m = multilabel_metrics(multilabel_sums(logits, y))
    # the AUC of the binned sigmoids, where scores in one bin tie, is the pairwise AUC of those bins
    binned = np.minimum((torch.sigmoid(logits.double()).numpy() * AUC_BINS).astype(int), AUC_BINS - 1)
    want = np.mean([_exact_auc(binned[:, j], truth[:, j]) for j in range(3)])
    assert m["auc"] == pytest.approx(want, abs=1e-12)
    # and within a bin's width of the unbinned AUC; better separated labels score higher
    exact = [_exact_auc(logits[:, j].numpy(), truth[:, j]) for j in range(3)]
    assert m["auc"] == pytest.approx(np.mean(exact), abs=0.01) and exact[0] < exact[1] < exact[2]
    parts = np.add(multilabel_sums(logits[:100], y[:100]), multilabel_sums(logits[100:], y[100:]))
    assert multilabel_metrics(parts) == pytest.approx(m)
    # a label whose rows are all positive has no AUC and is left out of the mean
    y_all = y.clone()
    y_all[:, 0] = 1.0
    assert multilabel_metrics(multilabel_sums(logits, y_all))["auc"] == pytest.approx(np.mean(
        [_exact_auc(binned[:, j], truth[:, j]) for j in (1, 2)]), abs=1e-12)


def test_top_k_accuracy_counts_a_label_among_the_k_highest_outputs_past_k_classes():
    from sparknet.labels import TOP_K, classification_metrics, classification_sums

    torch.manual_seed(0)
    logits = torch.randn(500, 10)
    y = torch.randint(0, 10, (500,))
    m = classification_metrics(classification_sums(logits, y))
    rank = (logits > logits.gather(1, y[:, None])).sum(1)  # outputs above the label's own
    assert m["accuracy"] == int((rank == 0).sum()) / 500
    assert m[f"top{TOP_K}_accuracy"] == int((rank < TOP_K).sum()) / 500 and m["accuracy"] < m["top5_accuracy"]
    # a class axis at 1 (Caffe's layout, a label per position) is read the same way
    seq = torch.randn(4, 10, 7)  # [n, classes, positions]
    ys = torch.randint(0, 10, (4, 7))
    flat = classification_metrics(classification_sums(seq.movedim(1, -1).reshape(-1, 10), ys.reshape(-1)))
    assert classification_metrics(classification_sums(seq, ys)) == {k: flat[k] for k in ("accuracy", "top5_accuracy")}
    # five classes or fewer: no top-k accuracy
    assert set(classification_metrics(classification_sums(torch.randn(8, 5), torch.randint(0, 5, (8,))))) == {
        "accuracy", "f1", "weighted_precision", "macro_f1"}


@pytest.mark.parametrize("binary", [False, True])
def test_f1_and_precision_weigh_each_class_by_its_share_of_the_labels_as_spark_does(binary):
    """Spark's MulticlassClassificationEvaluator's f1 and weightedPrecision: each class's F1 and precision (0 for a
    class never predicted) weighed by its share of the labels; the macro F1, every class labelled or predicted
    alike; sample weights count a row w times; batches add up."""
    from sparknet.labels import classification_metrics, classification_sums

    torch.manual_seed(1)
    n, classes = 300, 4
    logits = torch.randn(n) if binary else torch.randn(n, classes)
    y = torch.randint(0, 2 if binary else classes, (n,))
    if not binary:
        logits[:, 3] -= 10.0  # class 3 is never predicted: its precision is 0, its F1 too
    w = torch.randint(0, 3, (n,)).double()

    def spark_like(weights):
        predicted = ((logits > 0).long() if binary else logits.argmax(1)).numpy()
        truth, weights = y.numpy(), weights.numpy()
        total, f1, precision, by_class = weights.sum(), 0.0, 0.0, []
        for c in range(2 if binary else classes):
            tp = weights[(predicted == c) & (truth == c)].sum()
            p = tp / weights[predicted == c].sum() if weights[predicted == c].sum() else 0.0
            r = tp / weights[truth == c].sum() if weights[truth == c].sum() else 0.0
            share = weights[truth == c].sum() / total
            f1 += share * (2 * p * r / (p + r) if p + r else 0.0)
            precision += share * p
            if weights[(truth == c) | (predicted == c)].sum():
                by_class.append(2 * p * r / (p + r) if p + r else 0.0)
        return f1, precision, sum(by_class) / len(by_class)

    for weights in (None, w):
        halves = [classification_sums(logits[s], y[s], None if weights is None else weights[s])
                  for s in (slice(0, 170), slice(170, None))]
        m = classification_metrics([a + b for a, b in zip(*halves)])
        f1, precision, macro = spark_like(torch.ones(n, dtype=torch.float64) if weights is None else weights)
        assert m["f1"] == pytest.approx(f1, rel=1e-12) and m["weighted_precision"] == pytest.approx(precision,
                                                                                                   rel=1e-12)
        assert 0 < m["f1"] < 1 and m["f1"] != m["accuracy"] and m["macro_f1"] == pytest.approx(macro, rel=1e-12)
    if not binary:  # a label no output stands for (an ignored index) is no class's, and wrong
        sums = classification_sums(logits[:3], torch.tensor([0, -100, 9]))
        assert sum(sums[4 + 2 * classes:]) == 1.0 and classification_metrics(sums)["accuracy"] <= 1 / 3


def test_a_multilabel_net_learns_two_independent_labels():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 4)).astype(np.float32)
    y = np.stack([x[:, 0] > 0, x[:, 1] + x[:, 2] > 0], axis=1).astype(np.int64)  # ints: taken as 0/1 floats
    torch.manual_seed(0)
    net = Net(torch.nn.Linear(4, 2), SolverConfig(base_lr=0.5, momentum=0.9), loss=torch.nn.BCEWithLogitsLoss(),
              batch_size=32, seed=0)
    net.set_training_data((x, y))
    net.set_validation_data((x, y))
    net.train(200)
    res = net.evaluate()
    assert res.metrics["accuracy"] > 0.95 and res.metrics["f1"] > 0.95 and res.score == res.accuracy
    assert res.metrics["auc"] > 0.99


def test_a_weighted_net_s_loss_is_the_weighted_mean_of_its_rows_losses():
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 4)
    x = torch.randn(6, 3)
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    w = torch.tensor([1.0, 0.0, 2.0, 0.5, 0.0, 3.0])
    net = Net(module, SolverConfig(base_lr=0.1, momentum=0.0), batch_size=6, weighted=True)
    net.set_training_data((x.numpy(), np.column_stack([y.numpy(), w.numpy()]).astype(np.float32)), shuffle=False)
    with torch.no_grad():
        per = torch.nn.functional.cross_entropy(module(x), y, reduction="none")
    want = float((per * w).sum() / w.sum())
    stats = net.train(1)
    assert math.isclose(stats.loss, want, rel_tol=1e-6)


def _repeated(w: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each row ``i`` of the tensors ``w[i]`` times (whole-number weights)."""
    rows = torch.repeat_interleave(torch.arange(len(w)), w.long())
    return [t[rows] for t in tensors]


@pytest.mark.parametrize("case", ["classes", "top_k", "binary", "positions", "regression", "numbers", "multilabel"])
def test_weighted_sums_count_a_row_of_weight_w_as_w_rows(case):
    """Every task's sums weighed by whole-number weights equal those of each row repeated that many times; a row of
    weight 0 adds nothing. The metrics are those of the repeated rows, to rounding."""
    from sparknet.labels import task_metrics, task_sums

    g = torch.Generator().manual_seed(1)
    n = 40
    pred, y, task = {
        "classes": lambda: (torch.randn(n, 4, generator=g), torch.randint(0, 4, (n,), generator=g),
                            Task.CLASSIFICATION),
        "top_k": lambda: (torch.randn(n, 9, generator=g), torch.randint(0, 9, (n,), generator=g), Task.CLASSIFICATION),
        "binary": lambda: (torch.randn(n, generator=g), torch.randint(0, 2, (n,), generator=g), Task.CLASSIFICATION),
        "positions": lambda: (torch.randn(n, 6, 3, generator=g), torch.randint(0, 6, (n, 3), generator=g),
                              Task.CLASSIFICATION),
        "regression": lambda: (torch.randn(n, generator=g), torch.randn(n, generator=g), Task.REGRESSION),
        "numbers": lambda: (torch.randn(n, 3, generator=g), torch.randn(n, 3, generator=g), Task.REGRESSION),
        "multilabel": lambda: (torch.randn(n, 3, generator=g), torch.randint(0, 2, (n, 3), generator=g).float(),
                               Task.MULTILABEL),
    }[case]()
    w = torch.randint(0, 4, (n,), generator=g).double()
    assert (w == 0).any()
    weighted = task_sums(task, pred, y, w)
    repeated = task_sums(task, *_repeated(w, pred, y))
    assert weighted == pytest.approx(repeated, rel=1e-12, abs=1e-9)
    assert task_metrics(task, weighted) == pytest.approx(task_metrics(task, repeated), rel=1e-12)
    assert task_sums(task, pred, y, torch.ones(n)) == pytest.approx(task_sums(task, pred, y), rel=1e-12)
    with pytest.raises(ValueError, match="3 sample weights for 40 rows"):
        task_sums(task, pred, y, w[:3])


@pytest.mark.parametrize("kind", ["module", "layers", "regression"])
def test_evaluate_with_weights_scores_as_the_rows_repeated(kind):
    """Net.evaluate(weights=) gives the loss and metrics of each row repeated its weight's times, in batches that cut
    the rows anywhere; weights of 1 give the unweighted result; bad weights are refused by count."""
    torch.manual_seed(0)
    x = torch.randn(30, 8, 3) if kind == "regression" else torch.randn(30, 3)
    if kind == "module":
        net = Net(torch.nn.Linear(3, 7), SolverConfig(), batch_size=8)
        y = torch.randint(0, 7, (30,))
    elif kind == "layers":
        net = Net(zoo.mlp(input_shape=(3,), hidden=(5,), num_classes=7), SolverConfig(), batch_size=8)
        y = torch.randint(0, 7, (30,))
    else:
        net = Net(_euclidean_net(), SolverConfig(), batch_size=8)
        x, y = x[:, 0, :], torch.randn(30, 1)
    w = torch.randint(0, 4, (30,)).double()
    got = net.evaluate((x, y), batch_size=7, weights=w)
    want = net.evaluate(tuple(_repeated(w, x, y)), batch_size=1000)
    assert got.samples == 30 and got.weight == float(w.sum()) == want.samples and want.weight is None
    assert got.loss == pytest.approx(want.loss, rel=1e-5)
    assert got.metrics == pytest.approx(want.metrics, rel=1e-6)  # float32 outputs of batches cut apart
    ones = net.evaluate((x, y), batch_size=7, weights=np.ones(30))
    plain = net.evaluate((x, y), batch_size=7)
    assert ones.loss == pytest.approx(plain.loss, rel=1e-6) and ones.metrics == pytest.approx(plain.metrics)
    for bad, message in ((w[:5], "5 for 30 rows"), (torch.full((30,), -1.0), "30 of them NaN, infinite or negative")):
        with pytest.raises(ValueError, match=message):
            net.evaluate((x, y), weights=bad)


def test_validation_data_with_weights_is_scored_weighted_by_every_evaluation():
    """(x, y, w) validation data: evaluate() and test() weigh each row as evaluate(weights=) does, a screen joined
    with the rows it left out gives the whole set's scores, and the rows' total weight is the net's
    validation_weight; data given to evaluate() is its own (unweighted unless weights come with it)."""
    torch.manual_seed(0)
    net = Net(zoo.mlp(input_shape=(3,), hidden=(5,), num_classes=4), SolverConfig(), batch_size=8)
    x, y, w = torch.randn(40, 3), torch.randint(0, 4, (40,)), torch.randint(0, 4, (40,)).double()
    assert net.validation_weight is None
    net.set_validation_data((x.numpy(), y.numpy(), w.numpy()))
    want = net.evaluate((x, y), weights=w)
    got = net.evaluate()
    assert (got.loss, got.metrics, got.weight) == (want.loss, want.metrics, want.weight)
    assert net.validation_weight == float(w.sum()) and net.test() == want.score
    joined = net.evaluate(sample=15).joined(net.evaluate(rest_of=15))
    assert joined.weight == want.weight and joined.loss == pytest.approx(want.loss, rel=1e-6)
    assert joined.metrics == pytest.approx(want.metrics, rel=1e-9)
    assert net.evaluate((x, y)).weight is None  # other data: its own rows, each once
    net.set_validation_data((x, y))
    assert net.validation_weight is None and net.evaluate().weight is None
    with pytest.raises(ValueError, match="39 for 40 rows"):
        net.set_validation_data((x, y, w[1:]))
    with pytest.raises(ValueError, match="1 of them NaN, infinite or negative"):
        net.set_validation_data((x, y, torch.cat([w[1:], torch.tensor([math.nan])])))
    with pytest.raises(ValueError, match="all 40 rows have a sample weight of 0"):
        net.set_validation_data((x, y, np.zeros(40)))
