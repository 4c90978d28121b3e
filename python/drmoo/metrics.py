"""Binary classification metrics per task (paper Table 2): accuracy, balanced accuracy, ROC AUC.

Inputs are per-task columns: labels ``[N, m]`` in {0, 1}, hard predictions ``[N, m]`` in {0, 1} and
scores ``[N, m]`` (any monotone score of the positive class: drmoo's evaluations use the logit margin
z_1 - z_0, which ranks as the softmax probability does and stays ordered where that probability is NaN or
rounds to 0 or 1; ±inf scores rank as the extremes).

One-class rules (a small or skewed split can miss a class for a rare attribute such as Bald):

* balanced accuracy is the mean recall over the classes *present* in the labels, so with one class
  it is that class's recall (= the accuracy); this is what scikit-learn's ``balanced_accuracy_score``
  returns too;
* ROC AUC is undefined without both classes: the task's AUC is NaN, the averaged AUC is the mean
  over the tasks where it is defined (NaN if there is none), and :func:`task_metrics` lists the
  tasks it left out under ``auc_undefined_tasks``.

A NaN score (a margin of two equal infinite logits, a NaN logit) has no rank: the task's AUC is NaN
too, handled as above (never a NaN ranked above or below the real scores).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["accuracy", "balanced_accuracy", "roc_auc", "task_metrics"]


def _column(values: Tensor, name: str) -> Tensor:
    if values.dim() != 1:
        raise ValueError(f"{name} must be one column [N], got shape {tuple(values.shape)}")
    return values


def _check_pair(labels: Tensor, other: Tensor, other_name: str) -> None:
    _column(labels, "labels")
    _column(other, other_name)
    if labels.shape != other.shape:
        raise ValueError(f"labels {tuple(labels.shape)} and {other_name} {tuple(other.shape)} differ in length")
    if labels.numel() == 0:
        raise ValueError("metrics need at least one sample")
    if not bool(((labels == 0) | (labels == 1)).all()):
        raise ValueError("binary metrics need labels in {0, 1}")


def _check_predictions(predictions: Tensor) -> None:
    # probabilities or margins passed as hard predictions would match no label and score 0 silently
    if not bool(((predictions == 0) | (predictions == 1)).all()):
        bad = float(predictions[(predictions != 0) & (predictions != 1)][0])
        raise ValueError(f"predictions must be hard predictions in {{0, 1}}, got the value {bad:g} (pass scores to "
                         "roc_auc, and threshold them for accuracy)")


def accuracy(labels: Tensor, predictions: Tensor) -> float:
    """Fraction of correct predictions."""
    _check_pair(labels, predictions, "predictions")
    _check_predictions(predictions)
    return float((labels == predictions).double().mean())


def balanced_accuracy(labels: Tensor, predictions: Tensor) -> float:
    """Mean recall over the classes present in ``labels`` (one class present: its recall)."""
    _check_pair(labels, predictions, "predictions")
    _check_predictions(predictions)
    recalls = [float((predictions[labels == c] == c).double().mean()) for c in (0, 1) if bool((labels == c).any())]
    return sum(recalls) / len(recalls)


def roc_auc(labels: Tensor, scores: Tensor) -> float:
    """Area under the ROC curve, NaN when ``labels`` hold a single class or any score is NaN.

    Rank form (Mann-Whitney U): AUC = (sum of the positives' ranks - P(P+1)/2) / (P N), with tied
    scores sharing their average rank, so a tie between a positive and a negative counts 1/2.
    ±inf scores rank first / last (equal infinities tie); a NaN score has no place in the ranking, so
    the AUC is undefined (NaN), not the AUC of the NaN placed above every real score.
    """
    _check_pair(labels, scores, "scores")
    positives = int(labels.sum())
    negatives = labels.numel() - positives
    scores = scores.double()
    if positives == 0 or negatives == 0 or bool(torch.isnan(scores).any()):
        return math.nan
    order = torch.argsort(scores)
    ordered = scores[order]
    # average rank (1-based) of each run of equal scores
    _, inverse, counts = torch.unique_consecutive(ordered, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    average = ends - (counts.double() - 1) / 2
    ranks = torch.empty_like(scores)
    ranks[order] = average[inverse]
    rank_sum = float(ranks[labels == 1].sum())
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def _nanmean(values: list[float]) -> float:
    defined = [v for v in values if not math.isnan(v)]
    return sum(defined) / len(defined) if defined else math.nan


def task_metrics(labels: Tensor, predictions: Tensor, scores: Tensor, names: list[str] | None = None
                 ) -> dict[str, Any]:
    """Per-task and task-averaged accuracy, balanced accuracy and AUC (fractions in [0, 1]).

    ``auc_undefined_tasks`` names the tasks whose test labels hold one class or whose scores hold a NaN
    (their AUC is NaN and left out of ``mean_auc``).
    """
    if labels.dim() != 2 or labels.shape != predictions.shape or labels.shape != scores.shape:
        raise ValueError(f"labels, predictions and scores must share one [N, m] shape, got "
                         f"{tuple(labels.shape)}, {tuple(predictions.shape)}, {tuple(scores.shape)}")
    m = labels.shape[1]
    if m == 0:
        raise ValueError(f"task_metrics needs at least one task column, got shape {tuple(labels.shape)}")
    if names is None:
        names = [f"task {i + 1}" for i in range(m)]
    elif len(names) != m:  # zip would drop or misalign names, and auc_undefined_tasks name the wrong tasks
        raise ValueError(f"names must name the {m} task columns, got {len(names)} name(s): {list(names)[:10]!r}")
    acc = [accuracy(labels[:, i], predictions[:, i]) for i in range(m)]
    bal = [balanced_accuracy(labels[:, i], predictions[:, i]) for i in range(m)]
    auc = [roc_auc(labels[:, i], scores[:, i]) for i in range(m)]
    return {
        "tasks": names,
        "accuracy": acc, "balanced_accuracy": bal, "auc": auc,
        "mean_accuracy": sum(acc) / m, "mean_balanced_accuracy": sum(bal) / m, "mean_auc": _nanmean(auc),
        "positive_rate": labels.double().mean(0).tolist(),
        "auc_undefined_tasks": [name for name, value in zip(names, auc) if math.isnan(value)],
    }
