"""Temperature scaling: one temperature per task that minimises the negative log-likelihood (float64).

The scaled logits are ``z / T``.  In ``beta = 1 / T`` the NLL ``mean_j[logsumexp(beta z_j) - beta z_j[y_j]]``
is convex (its second derivative is the variance of z under softmax(beta z)), so its derivative
``mean_j[E_softmax(beta z_j)[z_j] - z_j[y_j]]`` is non-decreasing and :func:`fit_temperature` finds its
root by safeguarded Newton steps, to a few units in the last place.  T is kept within
[:data:`T_MIN`, :data:`T_MAX`]; a fit that ends at a bound says so.  A -inf logit in a class other than
the sample's label is allowed (that class has probability 0 at every T and drops out); a NaN or +inf
logit, or -inf on the label, makes the NLL infinite or undefined at every T: no fit (:func:`fittable`).

A temperature changes no top label (argmax(z / T) = argmax(z) for T > 0) and no ranking of a
two-class score (softmax(z / T)[1] = sigmoid((z_1 - z_0) / T) is increasing in z_1 - z_0): accuracy,
balanced accuracy, worst-class accuracy and AUC are the same with and without it.  What it moves is
the confidence, and with it every loss, tail and calibration number.

Where the temperature is fitted (:func:`cross_fitted_temperatures`).  A run trained on all the
training digits has no validation data it has not seen (the validation split's digits are among its
training digits), so ``drmoo eval`` fits by two-fold cross-fitting on the evaluated split: the split
is cut into two fixed halves (a permutation seeded with :data:`FOLD_SEED`, the same for every run of
a split), each half's logits are scaled by the temperature fitted on the other half, and no sample is
scored with a temperature fitted on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["FOLD_SEED", "T_MAX", "T_MIN", "Fit", "cross_fitted_temperatures", "fit_temperature", "fittable", "nll"]

T_MIN, T_MAX = 1e-2, 1e2
FOLD_SEED = 0
_MAX_STEPS = 2200  # bisection alone reaches adjacent floats in fewer


@dataclass(frozen=True)
class Fit:
    """A fitted temperature and whether the fit stopped at a bound of [T_MIN, T_MAX]."""

    temperature: float
    at_bound: bool


def _checked(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    if logits.dim() != 2 or labels.dim() != 1 or logits.shape[0] != labels.shape[0] or labels.numel() == 0:
        raise ValueError(f"logits must be [N, C] and labels [N] with N >= 1, got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")
    z, y = logits.detach().to("cpu", torch.float64), labels.detach().to("cpu", torch.long)
    if not _fittable(z, y):
        raise ValueError("logits contain NaN or +Inf, or -Inf on a sample's label: the likelihood is infinite or "
                         "undefined at every temperature")
    return z, y


def _fittable(z: Tensor, y: Tensor) -> bool:
    if bool(torch.isnan(z).any()) or bool(torch.isposinf(z).any()):
        return False
    if z.dim() != 2 or y.shape != z.shape[:1] or not bool(((y >= 0) & (y < z.shape[1])).all()):
        return True  # not this check's business: the shape checks and cross_entropy name what is wrong
    return bool(torch.isfinite(z.gather(1, y[:, None])).all())


def fittable(logits: Tensor, labels: Tensor) -> bool:
    """Whether the NLL of ``labels`` under softmax(logits / T) is finite for every T > 0, so that a temperature
    can be fitted: no logit NaN or +inf and no sample's own label at -inf.  A -inf logit in another class is
    fine: that class has probability 0 at every T and drops out of the likelihood."""
    return _fittable(logits.detach().to("cpu", torch.float64), labels.detach().to("cpu", torch.long))


def nll(logits: Tensor, labels: Tensor, temperature: float) -> float:
    """Mean negative log-likelihood of ``labels`` under softmax(logits / temperature), in float64."""
    z, y = _checked(logits, labels)
    return float(torch.nn.functional.cross_entropy(z / temperature, y))


def _slope_and_curvature(z: Tensor, y: Tensor, beta: float) -> tuple[float, float]:
    """The NLL's first and second derivatives in beta: mean E_q[z] - z_y and mean Var_q[z], q = softmax(beta z)."""
    q = torch.softmax(beta * z, 1)
    z = torch.where(torch.isneginf(z), 0.0, z)  # a -inf class has q = 0 and adds nothing (0 * -inf would be NaN)
    expected = (q * z).sum(1)
    variance = (q * (z - expected[:, None]) ** 2).sum(1)
    return float((expected - z.gather(1, y[:, None]).squeeze(1)).mean()), float(variance.mean())


def fit_temperature(logits: Tensor, labels: Tensor) -> Fit:
    """The temperature T in [T_MIN, T_MAX] that minimises the NLL of ``labels`` under softmax(logits / T).

    Newton's method on the NLL's derivative in beta = 1/T, safeguarded by a bracket of its root (a
    step that leaves the bracket bisects it), until a step is within a few units in the last place.
    """
    z, y = _checked(logits, labels)
    low, high = 1.0 / T_MAX, 1.0 / T_MIN
    if _slope_and_curvature(z, y, low)[0] >= 0:  # the NLL grows from beta = 1/T_MAX on: the hottest allowed
        return Fit(T_MAX, True)
    if _slope_and_curvature(z, y, high)[0] <= 0:  # still falling at 1/T_MIN (every sample right): the coldest
        return Fit(T_MIN, True)
    beta = 1.0
    for _ in range(_MAX_STEPS):
        slope, curvature = _slope_and_curvature(z, y, beta)
        if slope < 0:
            low = beta
        else:
            high = beta
        if slope == 0:
            break
        step = beta - slope / curvature if curvature > 0 else math.nan
        if abs(step - beta) <= 4 * math.ulp(beta):  # converged: the next step is below the float resolution
            break
        candidate = step if low < step < high else low + (high - low) / 2
        if not low < candidate < high:  # the bracket holds adjacent floats
            break
        beta = candidate
    return Fit(1.0 / beta, False)


def fold_of(count: int) -> Tensor:
    """Each sample's fold (0 or 1): a permutation seeded with FOLD_SEED, its first half fold 0."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(FOLD_SEED))
    folds = torch.empty(count, dtype=torch.long)
    folds[order[: count // 2]] = 0
    folds[order[count // 2 :]] = 1
    return folds


def cross_fitted_temperatures(logits: Tensor, labels: Tensor) -> tuple[Tensor, list[Fit]]:
    """Per sample, the temperature fitted on the other fold (:func:`fold_of`), and the two fits.

    With fewer than 2 samples there is no other fold: ValueError.
    """
    z, y = _checked(logits, labels)
    if y.numel() < 2:
        raise ValueError("cross-fitting a temperature needs at least 2 samples")
    folds = fold_of(y.numel())
    fits = [fit_temperature(z[folds != fold], y[folds != fold]) for fold in (0, 1)]
    per_sample = torch.tensor([fit.temperature for fit in fits], dtype=torch.float64)[folds]
    return per_sample, fits


def scaled(logits: Tensor, temperatures: Tensor | float) -> Tensor:
    """``logits / T`` in float64, T one number or one per sample (``[N]``)."""
    z = logits.detach().to("cpu", torch.float64)
    if isinstance(temperatures, Tensor):
        return z / temperatures.to(torch.float64)[:, None]
    if not math.isfinite(temperatures) or temperatures <= 0:
        raise ValueError(f"a temperature must be a finite number > 0, got {temperatures!r}")
    return z / temperatures
