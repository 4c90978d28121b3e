"""The robustness metrics against independent references: CVaR, the robust objective, ECE, temperature, shifts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize

from drmoo.experiments import dr_metrics, shifts, temperature
from drmoo.metrics import roc_auc
from drmoo_kernels import get_divergence

FAST = settings(max_examples=40, deadline=None)
# float64 sums of <= 60 terms of size <= 50: every reference below agrees to far better than this
TOL = 1e-9

losses_st = st.lists(st.floats(0.0, 50.0, allow_nan=False), min_size=1, max_size=60)
# few distinct values, so that ties are common
tied_st = st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 7.5]), min_size=1, max_size=60)
alpha_st = st.floats(0.01, 1.0)


def _t(values: list[float] | list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _ru_brute_force(values: list[float], alpha: float, weights: list[float] | None = None) -> float:
    """min over t of t + E_p[(l - t)_+] / alpha: the piecewise-linear objective is minimised at a sample value."""
    p = [1 / len(values)] * len(values) if weights is None else [w / sum(weights) for w in weights]
    return min(t + sum(pj * max(v - t, 0.0) for pj, v in zip(p, values)) / alpha for t in values)


@FAST
@given(st.one_of(losses_st, tied_st), alpha_st)
def test_cvar_is_the_rockafellar_uryasev_minimum(values: list[float], alpha: float) -> None:
    value = dr_metrics.cvar(_t(values), alpha)
    assert value == pytest.approx(_ru_brute_force(values, alpha), rel=TOL, abs=TOL)
    assert max(values) + TOL >= value >= sum(values) / len(values) - TOL


@FAST
@given(tied_st, st.integers(1, 10))
def test_cvar_at_an_integer_count_is_the_mean_of_the_worst(values: list[float], k: int) -> None:
    k = min(k, len(values))
    worst = sorted(values, reverse=True)[:k]
    assert dr_metrics.cvar(_t(values), k / len(values)) == pytest.approx(sum(worst) / k, rel=TOL, abs=TOL)


def test_cvar_counts_the_boundary_sample_by_its_fraction() -> None:
    # n alpha = 1.2: the worst sample whole, the next with weight 0.2, over 1.2
    assert dr_metrics.cvar(torch.tensor([1.0, 2.0, 3.0, 4.0]), 0.3) == pytest.approx((4 + 0.2 * 3) / 1.2, rel=1e-15)
    assert dr_metrics.cvar(torch.tensor([3.0, 1.0]), 1.0) == 2.0  # alpha 1: the mean


@FAST
@given(tied_st, st.lists(st.integers(0, 4), min_size=60, max_size=60), alpha_st)
def test_weighted_cvar_equals_cvar_of_the_replicated_sample(values: list[float], counts: list[int],
                                                           alpha: float) -> None:
    counts = counts[: len(values)]
    if sum(counts) == 0:
        counts[0] = 1
    replicated = [v for v, c in zip(values, counts) for _ in range(c)]
    weighted = dr_metrics.cvar(_t(values), alpha, _t(counts))
    assert weighted == pytest.approx(dr_metrics.cvar(_t(replicated), alpha), rel=TOL, abs=TOL)


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5, math.nan, True])
def test_cvar_refuses_a_level_outside_zero_one(alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha"):
        dr_metrics.cvar(torch.tensor([1.0]), alpha)


def _dual_brute_force(values: list[float], lam: float, divergence: str, weights: list[float] | None = None) -> float:
    f = get_divergence(divergence)
    losses = _t(values)
    p = torch.full_like(losses, 1 / len(values)) if weights is None else _t(weights)
    p = p / p.sum()

    def dual(eta: float) -> float:
        return eta + lam * float((p * f.conj((losses - eta) / lam)).sum())

    result = optimize.minimize_scalar(dual, bounds=(min(values) - 1.0, max(values) + 1.0), method="bounded",
                                      options={"xatol": 1e-12})
    return float(result.fun)


@FAST
@given(losses_st, st.floats(0.05, 20.0))
def test_chi2_objective_is_the_variance_penalty_where_nothing_is_clipped(values: list[float], lam: float) -> None:
    mean = sum(values) / len(values)
    if mean - min(values) >= 2 * lam:  # a worst-case weight would hit 0: the closed form does not hold
        lam = (mean - min(values)) / 2 + 1.0
    variance = sum((v - mean) ** 2 for v in values) / len(values)
    value = dr_metrics.robust_objective(_t(values), lam, "chi2")
    assert value == pytest.approx(mean + variance / (4 * lam), rel=TOL, abs=TOL)


@FAST
@given(losses_st, st.floats(0.05, 20.0))
def test_kl_objective_is_the_log_mean_exp(values: list[float], lam: float) -> None:
    exact = lam * math.log(math.fsum(math.exp((v - max(values)) / lam) for v in values) / len(values)) + max(values)
    assert dr_metrics.robust_objective(_t(values), lam, "kl") == pytest.approx(exact, rel=TOL, abs=TOL)


@FAST
@given(st.one_of(losses_st, tied_st), st.floats(0.05, 20.0),
       st.sampled_from(["chi2", "cvar_smooth(0.1)", "cressie_read(3)", "kl"]))
def test_objective_is_the_dual_minimum_at_least_the_mean_and_falls_with_lambda(values: list[float], lam: float,
                                                                             divergence: str) -> None:
    losses = _t(values)
    value = dr_metrics.robust_objective(losses, lam, divergence)
    # the bounded scalar search stops within ~1e-12 of the minimiser; the dual is flat there
    assert value <= _dual_brute_force(values, lam, divergence) + 1e-9
    assert value == pytest.approx(_dual_brute_force(values, lam, divergence), rel=1e-7, abs=1e-7)
    assert value >= sum(values) / len(values) - TOL
    assert dr_metrics.robust_objective(losses, 2 * lam, divergence) <= value + TOL


@FAST
@given(losses_st, st.floats(0.05, 20.0), st.sampled_from(["chi2", "kl", "cvar_smooth(0.1)"]))
def test_worst_case_ratios_are_a_distribution_and_the_closed_forms(values: list[float], lam: float,
                                                                  divergence: str) -> None:
    losses = _t(values)
    solved = dr_metrics.worst_case(losses, lam, divergence)
    assert bool((solved.ratios >= 0).all())
    # E_p[dq/dp] = 1 at the minimising eta: the slope 1 - E_p[f*'] is within one bracket step of its root
    assert float(solved.ratios.mean()) == pytest.approx(1.0, abs=1e-6)
    if divergence == "kl":
        expected = torch.softmax(losses / lam, 0) * len(values)
        torch.testing.assert_close(solved.ratios, expected, rtol=1e-9, atol=1e-12)
    mean = sum(values) / len(values)
    if divergence == "chi2" and mean - min(values) < 2 * lam:  # unclipped: 1 + (l - E l) / (2 lam)
        torch.testing.assert_close(solved.ratios, 1 + (losses - mean) / (2 * lam), rtol=1e-7, atol=1e-7)


def test_chi2_objective_clips_at_a_small_lambda() -> None:
    # mean 1, min 0 > 2 lam away: the worst case puts no weight on the 0-loss samples; brute force agrees
    values = [0.0, 0.0, 3.0]
    value = dr_metrics.robust_objective(_t(values), 0.1, "chi2")
    assert value == pytest.approx(_dual_brute_force(values, 0.1, "chi2"), rel=1e-9)
    assert value != pytest.approx(1.0 + 2.0 / 0.4)  # the unclipped closed form overstates it
    ratios = dr_metrics.worst_case(torch.tensor(values, dtype=torch.float64), 0.1, "chi2").ratios
    assert ratios.tolist() == [0.0, 0.0, pytest.approx(3.0)]  # all the mass on the one positive loss


@FAST
@given(tied_st, st.lists(st.integers(0, 4), min_size=60, max_size=60), st.floats(0.05, 5.0))
def test_weighted_nominal_equals_the_replicated_sample(values: list[float], counts: list[int], lam: float) -> None:
    counts = counts[: len(values)]
    if sum(counts) == 0:
        counts[0] = 1
    replicated = [v for v, c in zip(values, counts) for _ in range(c)]
    weighted = dr_metrics.robust_objective(_t(values), lam, "chi2", _t(counts))
    assert weighted == pytest.approx(dr_metrics.robust_objective(_t(replicated), lam, "chi2"),
                                     rel=TOL, abs=TOL)


def test_robust_objective_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="lam"):
        dr_metrics.robust_objective(torch.tensor([1.0]), 0.0)
    with pytest.raises(ValueError, match="NaN"):
        dr_metrics.robust_objective(torch.tensor([1.0, math.nan]), 1.0)
    with pytest.raises(ValueError, match="weights"):
        dr_metrics.robust_objective(torch.tensor([1.0, 2.0]), 1.0, "chi2", torch.tensor([-1.0, 2.0]))


def test_ece_of_a_hand_computed_example() -> None:
    confidence = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.55, 0.95], dtype=torch.float64)
    correct = torch.tensor([1, 0, 1, 1, 0, 1])
    # sorted: (0.55 0) (0.6 1) | (0.7 1) (0.8 0) | (0.9 1) (0.95 1); gaps 0.075, 0.25, 0.075, each bin 2/6
    assert dr_metrics.expected_calibration_error(confidence, correct, bins=3) == pytest.approx(0.4 / 3, rel=1e-12)
    # one bin: |accuracy - mean confidence|; more bins than samples: one sample per bin, |correct - confidence|
    assert dr_metrics.expected_calibration_error(confidence, correct, bins=1) == pytest.approx(
        abs(4 / 6 - float(confidence.double().mean())), rel=1e-12)
    per_sample = float((correct.double() - confidence.double()).abs().mean())
    assert dr_metrics.expected_calibration_error(confidence, correct, bins=15) == pytest.approx(per_sample, rel=1e-12)


@FAST
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.booleans()), min_size=1, max_size=80))
def test_ece_is_a_weighted_mean_gap_within_zero_one(samples: list[tuple[float, bool]]) -> None:
    confidence = torch.tensor([c for c, _ in samples], dtype=torch.float64)
    correct = torch.tensor([k for _, k in samples])
    value = dr_metrics.expected_calibration_error(confidence, correct)
    assert 0.0 <= value <= 1.0
    # the triangle inequality: binning never exceeds the per-sample gap, never falls below the global one
    assert value <= float((correct.double() - confidence).abs().mean()) + TOL
    assert value >= abs(float(correct.double().mean() - confidence.mean())) - TOL


def test_worst_class_and_misclassified_loss() -> None:
    labels = torch.tensor([0, 0, 1, 1, 1, 2])
    predictions = torch.tensor([0, 1, 1, 1, 0, 2])
    assert dr_metrics.worst_class_accuracy(labels, predictions) == 0.5
    assert dr_metrics.balanced_accuracy(labels, predictions) == pytest.approx((0.5 + 2 / 3 + 1) / 3)
    losses = torch.tensor([0.1, 2.0, 0.2, 0.3, 4.0, 0.0])
    assert dr_metrics.misclassified_loss(losses, labels == predictions) == 3.0
    assert math.isnan(dr_metrics.misclassified_loss(losses, torch.ones(6, dtype=torch.bool)))


def _logits(seed: int, count: int = 200, classes: int = 10, scale: float = 4.0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(count, classes, generator=generator, dtype=torch.float64)
    # labels drawn at a quarter of the logits' confidence: an overconfident model
    labels = torch.multinomial(torch.softmax(logits / scale, 1), 1, generator=generator).squeeze(1)
    return logits, labels


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_temperature_minimises_the_nll(seed: int) -> None:
    logits, labels = _logits(seed)
    fit = temperature.fit_temperature(logits, labels)
    assert not fit.at_bound
    best = optimize.minimize_scalar(lambda log_t: temperature.nll(logits, labels, math.exp(log_t)),
                                    bounds=(math.log(temperature.T_MIN), math.log(temperature.T_MAX)),
                                    method="bounded", options={"xatol": 1e-10})
    assert temperature.nll(logits, labels, fit.temperature) <= float(best.fun) + 1e-12
    assert fit.temperature == pytest.approx(math.exp(best.x), rel=1e-4)
    assert fit.temperature > 2  # the labels were drawn at a quarter of the logits' scale: it cools them


def test_temperature_changes_no_top_label_and_no_ranking() -> None:
    # exact as functions of the logits; the scale keeps every probability off 1.0 in float64 (where ties begin)
    logits, labels = _logits(3, classes=2, scale=1.0)
    per_sample, fits = temperature.cross_fitted_temperatures(logits, labels)
    scaled = temperature.scaled(logits, per_sample)
    assert torch.equal(scaled.argmax(1), logits.argmax(1))
    for t in (fits[0].temperature, 0.5, 30.0):
        plain, hot = torch.softmax(logits, 1)[:, 1], torch.softmax(temperature.scaled(logits, t), 1)[:, 1]
        assert roc_auc(labels, hot) == roc_auc(labels, plain)


def test_cross_fitting_scores_each_half_with_the_other_halfs_temperature() -> None:
    logits, labels = _logits(4)
    per_sample, fits = temperature.cross_fitted_temperatures(logits, labels)
    folds = temperature.fold_of(labels.numel())
    for fold in (0, 1):
        other = temperature.fit_temperature(logits[folds != fold], labels[folds != fold]).temperature
        assert fits[fold].temperature == other
        assert bool((per_sample[folds == fold] == other).all())
    assert torch.equal(temperature.fold_of(labels.numel()), folds)  # fixed: the same halves for every run


def test_temperature_stops_at_a_bound_when_every_sample_is_right() -> None:
    logits = torch.tensor([[5.0, 0.0], [0.0, 5.0]])
    fit = temperature.fit_temperature(logits, torch.tensor([0, 1]))
    assert fit.at_bound and fit.temperature == temperature.T_MIN


@FAST
@given(st.lists(st.floats(0.0, 10.0), min_size=2, max_size=12), st.integers(1, 500))
def test_target_counts_sum_to_the_total_and_follow_the_mix(mix: list[float], total: int) -> None:
    if sum(mix) == 0:
        mix[0] = 1.0
    counts = shifts.target_counts(_t(mix), total)
    assert int(counts.sum()) == total
    exact = [m / sum(mix) * total for m in mix]
    assert all(abs(c - e) < 1 for c, e in zip(counts.tolist(), exact))


def test_resampled_label_mix_is_the_target_and_deterministic() -> None:
    labels = torch.tensor([0] * 90 + [1] * 10)
    for strength, rate in ((1.0, 0.5), (2.0, 0.9), (0.5, 0.3)):
        rows = shifts.resample_rows(labels, shifts.binary_target(labels, strength))
        assert rows.numel() == 100
        assert float(labels[rows].double().mean()) == pytest.approx(rate)
        assert torch.equal(rows, shifts.resample_rows(labels, shifts.binary_target(labels, strength)))
    # ten positives drawn 90 times: each 9 times (rounds of a fixed permutation)
    rows = shifts.resample_rows(labels, shifts.binary_target(labels, 2.0))
    assert sorted(torch.bincount(rows[labels[rows] == 1]).tolist()[90:]) == [9] * 10
    digits = torch.arange(10).repeat(20)
    mix = shifts.digit_target(digits, 3, 4.0)
    assert float(mix[3]) == pytest.approx(4 / 13)
    with pytest.raises(ValueError, match="class 1"):
        shifts.resample_rows(torch.zeros(5, dtype=torch.long), torch.tensor([0.5, 0.5]))
