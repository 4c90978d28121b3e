"""What distributional robustness targets, measured on per-sample losses and predictions (float64).

Every function here takes one task's per-sample values on one evaluation set and returns a number;
:mod:`drmoo.experiments.robust_eval` applies them to each task of a trained run.  The definitions
(docs/robustness-metrics.md states them with their conventions):

* :func:`cvar`: the conditional value at risk of the loss at level ``alpha`` in Rockafellar and
  Uryasev's form, ``min_t t + E_p[(loss - t)_+] / alpha``: the mean of the worst ``alpha`` fraction of
  the probability mass, the sample on the boundary counted with the fraction of its mass that
  falls inside (``n * alpha`` need not be an integer; ties do not change the value).
* :func:`robust_objective`: the f-divergence worst case ``sup_q E_q[loss] - lam * D_f(q || p)``, from
  its dual ``min_eta eta + lam * E_p[f*((loss - eta) / lam)]``, a 1-D convex problem solved by
  bisection on its derivative ``1 - E_p[f*'((loss - eta) / lam)]`` down to adjacent floats (KL by its
  closed form ``lam * log E_p exp(loss / lam)``).  f* and f*' are the training objective's own
  (:mod:`drmoo_kernels.divergences`).
* :func:`expected_calibration_error`: top-label ECE over equal-mass bins.
* :func:`worst_class_accuracy` / :func:`balanced_accuracy`: the lowest / mean recall over the classes
  present in the labels.
* :func:`misclassified_loss`: the mean loss over the misclassified samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from drmoo_kernels import Divergence, get_divergence

__all__ = ["ECE_BINS", "WorstCase", "balanced_accuracy", "cvar", "expected_calibration_error", "misclassified_loss",
           "nominal_weights", "robust_objective", "worst_case", "worst_class_accuracy"]

ECE_BINS = 15
_MAX_BISECTIONS = 2200  # float64 bisection reaches adjacent floats in <= ~2100 halvings from any bracket


def _values(values: Tensor, name: str) -> Tensor:
    if not isinstance(values, Tensor) or values.dim() != 1 or values.numel() == 0:
        shape = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise ValueError(f"{name} must be a non-empty column [N], got {shape}")
    values = values.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"{name} contains NaN or Inf")
    return values


def nominal_weights(count: int, weights: Tensor | None = None) -> Tensor:
    """The nominal distribution p over ``count`` samples: uniform, or ``weights`` normalised to sum 1."""
    if weights is None:
        return torch.full((count,), 1.0 / count, dtype=torch.float64)
    weights = _values(weights, "weights")
    if weights.numel() != count:
        raise ValueError(f"weights have {weights.numel()} entries for {count} samples")
    if bool((weights < 0).any()) or not float(weights.sum()) > 0:
        raise ValueError("weights must be >= 0 with a positive sum")
    return weights / weights.sum()


def cvar(losses: Tensor, alpha: float, weights: Tensor | None = None) -> float:
    """CVaR at level ``alpha`` in (0, 1] of ``losses`` under p (uniform, or ``weights`` normalised).

    ``min_t t + E_p[(loss - t)_+] / alpha`` (Rockafellar-Uryasev), evaluated exactly: sorted from the
    largest, each sample contributes the part of its mass that lies within the top ``alpha`` of the
    total, and the sum is divided by ``alpha``.  ``alpha = 1`` is the mean.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
    losses = _values(losses, "losses")
    p = nominal_weights(losses.numel(), weights)
    ordered, order = torch.sort(losses, descending=True, stable=True)
    mass = p[order]
    above = torch.cumsum(mass, 0) - mass  # mass strictly before each sample in the order
    inside = torch.clamp(torch.clamp(above + mass, max=alpha) - above, min=0.0)
    return float((inside * ordered).sum() / alpha)


@dataclass(frozen=True)
class WorstCase:
    """The solved dual of one robust objective: its value, the minimising eta, and the worst case's density
    ratios dq/dp = f*'((loss - eta) / lam) per sample (in the input's order; 0 where p is 0)."""

    value: float
    eta: float
    ratios: Tensor


def _checked_lam(lam: float) -> float:
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam <= 0:
        raise ValueError(f"lam must be a finite number > 0, got {lam!r}")
    return float(lam)


def worst_case(losses: Tensor, lam: float, divergence: str | Divergence = "chi2",
               weights: Tensor | None = None) -> WorstCase:
    """``sup_q E_q[loss] - lam * D_f(q || p)`` of ``losses`` (p uniform or ``weights`` normalised), with the
    maximising q as density ratios.

    Solved from the dual ``min_eta eta + lam * E_p[f*((loss - eta) / lam)]`` in float64.  The
    derivative in eta, ``1 - E_p[f*'((loss - eta) / lam)]``, is non-decreasing and its root lies
    between the smallest and the largest loss (f*'(0) = 1 for every f), so bisection on its sign
    brackets the minimiser to adjacent floats; the objective is the smaller of the dual's values
    at the bracket's two ends.  KL: the closed form ``lam * log E_p exp(loss / lam)``, eta equal to it.
    """
    lam = _checked_lam(lam)
    all_losses = _values(losses, "losses")
    p = nominal_weights(all_losses.numel(), weights)
    keep = p > 0
    losses, p = all_losses[keep], p[keep]
    f = get_divergence(divergence)

    def ratios_at(eta: float) -> Tensor:
        ratios = torch.zeros_like(all_losses)
        ratios[keep] = f.conj_grad((losses - eta) / lam)
        return ratios

    if f.name == "kl":  # lam * log sum_j p_j exp(l_j / lam), as a log-sum-exp: exact and overflow-free
        value = lam * float(torch.logsumexp(losses / lam + torch.log(p), 0))
        return WorstCase(value, value, ratios_at(value))

    def dual(eta: float) -> float:
        return eta + lam * float((p * f.conj((losses - eta) / lam)).sum())

    def slope(eta: float) -> float:
        return 1.0 - float((p * f.conj_grad((losses - eta) / lam)).sum())

    low, high = float(losses.min()), float(losses.max())
    if low == high:  # f*(0) = 0: the worst case of a constant loss is that loss, q = p
        return WorstCase(low, low, ratios_at(low))
    for _ in range(_MAX_BISECTIONS):
        middle = low + (high - low) / 2
        if not low < middle < high:
            break
        if slope(middle) < 0:
            low = middle
        else:
            high = middle
    eta = low if dual(low) <= dual(high) else high
    return WorstCase(dual(eta), eta, ratios_at(eta))


def robust_objective(losses: Tensor, lam: float, divergence: str | Divergence = "chi2",
                     weights: Tensor | None = None) -> float:
    """``sup_q E_q[loss] - lam * D_f(q || p)`` of ``losses``, p uniform or ``weights`` normalised
    (:func:`worst_case`'s value).  At least the mean under p (q = p), and non-increasing in ``lam``."""
    return worst_case(losses, lam, divergence, weights).value


def expected_calibration_error(confidence: Tensor, correct: Tensor, bins: int = ECE_BINS) -> float:
    """Expected calibration error over ``bins`` equal-mass bins.

    The samples, ordered by confidence (ties kept in sample order), are cut into ``bins`` contiguous
    bins, bin ``b`` holding positions ``floor(b N / bins)`` to ``floor((b + 1) N / bins) - 1``
    (sizes differ by at most one; with N < bins some are empty and left out).  ECE is
    ``sum_b (N_b / N) |accuracy_b - mean confidence_b|``.  ``confidence`` is the top label's
    probability, ``correct`` whether the top label is right.
    """
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be an integer >= 1, got {bins!r}")
    confidence = _values(confidence, "confidence")
    hits = _values(correct.to(torch.float64), "correct")
    if hits.numel() != confidence.numel():
        raise ValueError(f"confidence ({confidence.numel()}) and correct ({hits.numel()}) differ in length")
    count = confidence.numel()
    ordered, order = torch.sort(confidence, stable=True)
    hits = hits[order]
    total = 0.0
    for b in range(bins):
        start, stop = b * count // bins, (b + 1) * count // bins
        if stop > start:
            gap = float(hits[start:stop].mean() - ordered[start:stop].mean())
            total += (stop - start) / count * abs(gap)
    return total


def _recalls(labels: Tensor, predictions: Tensor) -> list[float]:
    if labels.shape != predictions.shape or labels.dim() != 1 or labels.numel() == 0:
        raise ValueError(f"labels {tuple(labels.shape)} and predictions {tuple(predictions.shape)} must be one "
                         "non-empty column each")
    return [float((predictions[labels == c] == c).double().mean()) for c in torch.unique(labels).tolist()]


def worst_class_accuracy(labels: Tensor, predictions: Tensor) -> float:
    """The lowest recall over the classes present in ``labels`` (the worst digit; the worse of two labels)."""
    return min(_recalls(labels, predictions))


def balanced_accuracy(labels: Tensor, predictions: Tensor) -> float:
    """The mean recall over the classes present in ``labels`` (any number of classes)."""
    recalls = _recalls(labels, predictions)
    return sum(recalls) / len(recalls)


def misclassified_loss(losses: Tensor, correct: Tensor) -> float:
    """The mean of ``losses`` over the samples whose top label is wrong; NaN when every one is right."""
    losses = _values(losses, "losses")
    wrong = ~correct.to("cpu", torch.bool)
    return float(losses[wrong].mean()) if bool(wrong.any()) else math.nan
