"""Binary metrics against hand-computed values and scikit-learn: accuracy, balanced accuracy, ROC AUC."""

from __future__ import annotations

import math

import pytest
import torch

from drmoo.metrics import accuracy, balanced_accuracy, roc_auc, task_metrics

LABELS = torch.tensor([1, 0, 1, 1, 0])
PREDICTIONS = torch.tensor([1, 0, 0, 1, 1])
SCORES = torch.tensor([0.9, 0.4, 0.4, 0.8, 0.1])


def test_hand_computed_values() -> None:
    assert accuracy(LABELS, PREDICTIONS) == pytest.approx(3 / 5)
    # recall of the positives 2/3, of the negatives 1/2
    assert balanced_accuracy(LABELS, PREDICTIONS) == pytest.approx((2 / 3 + 1 / 2) / 2)
    # positive-negative pairs: 0.9 beats both, 0.8 beats both, 0.4 ties one (1/2) and beats 0.1 -> 5.5 / 6
    assert roc_auc(LABELS, SCORES) == pytest.approx(5.5 / 6)


def test_auc_extremes_and_invariance() -> None:
    assert roc_auc(LABELS, LABELS.double()) == 1.0
    assert roc_auc(LABELS, -LABELS.double()) == 0.0
    assert roc_auc(LABELS, torch.zeros(5)) == 0.5  # all tied
    assert roc_auc(LABELS, SCORES.exp() * 3) == pytest.approx(roc_auc(LABELS, SCORES))  # monotone map


def test_one_class_rules() -> None:
    ones = torch.ones(4, dtype=torch.long)
    assert math.isnan(roc_auc(ones, torch.rand(4)))
    assert math.isnan(roc_auc(1 - ones, torch.rand(4)))
    # balanced accuracy with one class present is that class's recall (= the accuracy)
    assert balanced_accuracy(ones, torch.tensor([1, 0, 1, 1])) == pytest.approx(3 / 4)
    labels = torch.stack([LABELS, torch.ones(5, dtype=torch.long)], dim=1)
    predictions = torch.stack([PREDICTIONS, torch.tensor([1, 1, 1, 1, 0])], dim=1)
    scores = torch.stack([SCORES, torch.rand(5)], dim=1)
    report = task_metrics(labels, predictions, scores, names=["a", "b"])
    assert report["tasks"] == ["a", "b"] and report["auc_undefined_tasks"] == ["b"]
    assert math.isnan(report["auc"][1])
    assert report["mean_auc"] == pytest.approx(5.5 / 6)  # the undefined task is left out
    assert report["mean_accuracy"] == pytest.approx((3 / 5 + 4 / 5) / 2)
    assert report["mean_balanced_accuracy"] == pytest.approx(((2 / 3 + 1 / 2) / 2 + 4 / 5) / 2)
    assert report["positive_rate"] == pytest.approx([3 / 5, 1.0])
    only_undefined = task_metrics(labels[:, 1:], predictions[:, 1:], scores[:, 1:])
    assert math.isnan(only_undefined["mean_auc"]) and only_undefined["tasks"] == ["task 1"]


@pytest.mark.parametrize("seed", range(5))
def test_agrees_with_sklearn_with_ties(seed: int) -> None:
    from sklearn import metrics  # installed with mlxtend (requirements-dev.txt): a dev dependency, never skipped
    generator = torch.Generator().manual_seed(seed)
    labels = (torch.rand(200, generator=generator) < 0.2).long()
    scores = (torch.rand(200, generator=generator) + 0.3 * labels).mul(10).round() / 10  # many ties
    predictions = (scores > 0.6).long()
    assert roc_auc(labels, scores) == pytest.approx(metrics.roc_auc_score(labels, scores), abs=1e-12)
    assert accuracy(labels, predictions) == pytest.approx(metrics.accuracy_score(labels, predictions))
    assert balanced_accuracy(labels, predictions) == pytest.approx(
        metrics.balanced_accuracy_score(labels, predictions))


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="labels in \\{0, 1\\}"):
        accuracy(torch.tensor([0, 2]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="differ in length"):
        roc_auc(torch.tensor([0, 1]), torch.tensor([0.1, 0.2, 0.3]))
    with pytest.raises(ValueError, match="one column"):
        balanced_accuracy(torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="at least one sample"):
        accuracy(torch.zeros(0), torch.zeros(0))
    with pytest.raises(ValueError, match="share one \\[N, m\\] shape"):
        task_metrics(torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(3, 1))
