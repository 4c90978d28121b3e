"""Graded distribution shift at test time: label shift by deterministic resampling, covariate shift by noise.

Strength 0 is always the nominal evaluation set itself.

Label shift (no model pass: the clean logits are resampled).  Each task is shifted on its own: task
i's metrics at a strength are computed on a resample of the evaluation set whose task-i label mix is
the target, of the set's own size N.  :func:`resample_rows` draws class c's ``n_c`` rows (``n_c``:
the target mix times N, rounded by largest remainders so that they sum to N) by walking a fixed
permutation of the class's rows (seeded with :data:`SHIFT_SEED`), round after round when ``n_c``
exceeds the class's count, so the resample is the same for every method and run of a split.

* binary tasks (the attribute experiments): strength s moves the positive rate from the set's own
  rate pi_0 towards and past one half, ``pi(s) = pi_0 + s (1/2 - pi_0)``: s = 1 is label-balanced,
  s = 2 swaps the two labels' rates (:data:`BINARY_STRENGTHS`);
* ten-class tasks (Multi-MNIST): one digit made k times commoner (k > 1) or rarer (k < 1) than in
  the set, the other digits keeping their relative mix (:data:`DIGIT_FACTORS`); each metric is the
  mean over the ten choices of the digit.  Strength is log2 k.

Covariate shift: Gaussian noise of standard deviation sigma (:data:`NOISE_SIGMAS`, on the [0, 1]
image, clamped) added to every test image, the same draw for every model
(:func:`drmoo.experiments.robust_eval.collect_logits`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BINARY_STRENGTHS", "DIGIT_FACTORS", "NOISE_SIGMAS", "SHIFT_SEED", "binary_target", "digit_target",
           "resample_rows", "target_counts"]

SHIFT_SEED = 0
BINARY_STRENGTHS = (0.5, 1.0, 1.5, 2.0)
DIGIT_FACTORS = (0.25, 0.5, 2.0, 4.0)
NOISE_SIGMAS = (0.1, 0.2, 0.3)


def target_counts(mix: Tensor, total: int) -> Tensor:
    """Integer counts per class summing to ``total``, proportional to ``mix`` (largest remainders, ties to
    the lower class index)."""
    mix = mix.to(torch.float64)
    if mix.dim() != 1 or bool((mix < 0).any()) or not float(mix.sum()) > 0:
        raise ValueError("a class mix must be a non-negative vector with a positive sum")
    exact = mix / mix.sum() * total
    counts = torch.floor(exact).long()
    short = total - int(counts.sum())
    remainders = exact - counts
    order = sorted(range(mix.numel()), key=lambda c: (-float(remainders[c]), c))
    for c in order[:short]:
        counts[c] += 1
    return counts


def resample_rows(labels: Tensor, mix: Tensor) -> Tensor:
    """Row indices of a resample of ``labels`` (classes 0..C-1) of the same size whose class mix is ``mix``.

    A class the target needs but ``labels`` lacks cannot be drawn: ValueError.
    """
    labels = labels.to("cpu", torch.long)
    counts = target_counts(mix, labels.numel())
    generator = torch.Generator().manual_seed(SHIFT_SEED)
    rows = []
    for c, need in enumerate(counts.tolist()):
        members = torch.nonzero(labels == c).squeeze(1)
        order = members[torch.randperm(members.numel(), generator=generator)]
        if need == 0:
            continue
        if order.numel() == 0:
            raise ValueError(f"the shifted mix needs class {c}, which the evaluation set does not hold")
        rows.append(order[torch.arange(need) % order.numel()])
    return torch.cat(rows)


def binary_target(labels: Tensor, strength: float) -> Tensor:
    """The class mix [1 - pi, pi] at ``strength``: pi = pi_0 + strength (1/2 - pi_0), clamped to [0, 1]."""
    rate = float(labels.double().mean())
    shifted = min(max(rate + strength * (0.5 - rate), 0.0), 1.0)
    return torch.tensor([1.0 - shifted, shifted], dtype=torch.float64)


def digit_target(labels: Tensor, digit: int, factor: float, classes: int = 10) -> Tensor:
    """The class mix of ``labels`` with ``digit``'s share multiplied by ``factor`` (then renormalised)."""
    counts = torch.bincount(labels.to("cpu", torch.long), minlength=classes).to(torch.float64)
    counts[digit] *= factor
    return counts / counts.sum()

