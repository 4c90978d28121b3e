"""Edge cases of the evaluation metrics found by an audit: infinite logits, NaN scores, odd eval.json files.

Every expected value is computed by hand in the comment beside it.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from drmoo import store
from drmoo.experiments import results_report, robust_eval, temperature
from drmoo.experiments.celeba import predictions_and_scores
from drmoo.experiments.evaluation import task_accuracies
from drmoo.metrics import roc_auc, task_metrics

INF = math.inf
BALL = ("chi2", 0.8)


# ------------------------------------------------------------------ 1. +inf logit on the true class


def test_a_plus_inf_logit_on_the_true_class_is_a_right_top_label() -> None:
    # Top labels (argmax of the logits): [0, +inf] -> 1, [0, 1] -> 1, [2, 0] -> 0; labels 1, 1, 0: all right.
    # accuracy = 3/3 = 1; recall of class 1 = 2/2, of class 0 = 1/1 -> balanced = (1 + 1)/2 = 1, worst = 1.
    # (The old code read the top label from softmax([0, inf]) = [nan, nan], whose max names class 0:
    # accuracy 2/3, balanced (1/2 + 1)/2 = 0.75, worst 1/2.)
    z = torch.tensor([[0.0, INF], [0.0, 1.0], [2.0, 0.0]])
    y = torch.tensor([1, 1, 0])
    assert robust_eval.Scored.of(z, y).predictions.tolist() == [1, 1, 0]
    m = robust_eval.task_metrics(z, y, BALL)
    assert (m["accuracy"], m["balanced_accuracy"], m["worst_class_accuracy"]) == (1.0, 1.0, 1.0)
    assert task_accuracies([z], y[:, None]) == [m["accuracy"]]  # eval.json's task_acc agrees with the block
    # row 0's loss is logsumexp(0, inf) - inf = inf - inf = NaN: every loss number undefined, as documented
    assert math.isnan(m["mean_loss"]) and math.isnan(m["ece"])


def test_a_task_whose_logits_are_all_nan_has_no_top_label() -> None:
    # No logit at all: no top label, so no accuracy (NaN, null in eval.json), not the share of class 0.
    z = torch.full((3, 2), math.nan)
    m = robust_eval.task_metrics(z, torch.tensor([0, 0, 1]), BALL)
    assert all(math.isnan(m[key]) for key in robust_eval.METRICS)


# ------------------------------------------------------------------ 2. AUC with infinite / NaN scores


def test_auc_ranks_the_logit_margin_so_infinite_logits_rank_right() -> None:
    # Margins z1 - z0: -inf, 2, -1, 1; labels 0, 1, 0, 1.
    # Ranks (ascending): -inf -> 1, -1 -> 2, 1 -> 3, 2 -> 4; positives' rank sum = 4 + 3 = 7;
    # AUC = (7 - P(P+1)/2) / (P N) = (7 - 3) / (2 * 2) = 1.0 (every positive above every negative).
    # (The old score softmax(z)[:, 1] was NaN on row 0, which roc_auc ranked highest: AUC 0.5.)
    z = torch.tensor([[INF, 0.0], [0.0, 2.0], [1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([[0], [1], [0], [1]])
    predictions, scores = predictions_and_scores([z])
    assert scores[:, 0].tolist() == [-INF, 2.0, -1.0, 1.0]
    assert predictions[:, 0].tolist() == [0, 1, 0, 1]
    assert task_metrics(y, predictions, scores)["auc"] == [1.0]


def test_auc_of_margins_beyond_float32_softmax_resolution() -> None:
    # Margins 20 (negative) and 30 (positive): the positive is above the negative, AUC = 1/(1*1) = 1.
    # In float32, sigmoid(20) = 1 - 2.1e-9 and sigmoid(30) = 1 - 9.4e-14 both round to 1.0 (the spacing
    # below 1 is 6e-8): the old softmax score tied them, AUC 1/2.
    z = torch.tensor([[0.0, 20.0], [0.0, 30.0]])
    _, scores = predictions_and_scores([z])
    assert roc_auc(torch.tensor([0, 1]), scores[:, 0]) == 1.0


def test_a_nan_score_makes_the_auc_undefined_not_ranked() -> None:
    # Row 0's margin is inf - inf = NaN (both logits +inf): it has no rank, so the AUC is undefined (NaN) and
    # the task is named among the undefined ones. (The old roc_auc ranked the NaN above every score: the
    # negative row 0 on top, ranks 1..4 for -1, 1, 2, NaN: positives 3 + 2 = 5, AUC (5 - 3)/4 = 0.5.)
    z = torch.tensor([[INF, INF], [0.0, 2.0], [1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([[0], [1], [0], [1]])
    predictions, scores = predictions_and_scores([z])
    assert math.isnan(scores[0, 0])
    report = task_metrics(y, predictions, scores)
    assert math.isnan(report["auc"][0]) and report["auc_undefined_tasks"] == ["task 1"]
    assert math.isnan(roc_auc(torch.tensor([0, 1, 0, 1]), torch.tensor([math.nan, 2.0, -1.0, 1.0])))


# ------------------------------------------------------------------ 3. -inf logit and the temperature block


def test_a_minus_inf_logit_in_a_wrong_class_is_fitted_not_reported_unscaled() -> None:
    # Every label is its row's top logit, so the NLL's slope in beta = 1/T, mean_j (E_q[z_j] - z_j[y_j]), is
    # <= 0 at every beta (row 0's -inf class has q = 0 at every T: its term is 0 - 0): each fold's fit (and the
    # whole split's) runs to beta = 1/T_MIN, T = 0.01.
    # Scaled losses (z / 0.01): row 0: 0; rows 1 and 3: log(1 + e^-100); row 2: log(1 + e^-200).
    # mean_loss = (2 log1p(e^-100) + log1p(e^-200)) / 4 = 1.86e-44.
    # Unscaled: (0 + 2 log1p(e^-1) + log1p(e^-2)) / 4 = (2 * 0.3132617 + 0.1269280) / 4 = 0.1883628: what the
    # old code reported under the T label (its fold temperatures NaN).
    z = [torch.tensor([[-INF, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 1.0]])]
    y = torch.tensor([[1], [1], [0], [1]])
    clean = robust_eval.metrics_block(z, y, BALL)
    assert clean["mean"]["mean_loss"] == pytest.approx((2 * math.log1p(math.exp(-1)) + math.log1p(math.exp(-2))) / 4)
    assert clean["mean"]["mean_loss"] == pytest.approx(0.1883628, abs=1e-7)
    scaled = robust_eval.temperature_block(z, y, BALL)
    assert scaled["fold_temperatures"] == [[temperature.T_MIN, temperature.T_MIN]]
    assert scaled["at_bound"] == [True] and scaled["whole_split_temperature"] == [temperature.T_MIN]
    expected = (2 * math.log1p(math.exp(-100)) + math.log1p(math.exp(-200))) / 4
    assert scaled["mean"]["mean_loss"] == pytest.approx(expected, rel=1e-9)
    assert scaled["mean"]["accuracy"] == 1.0  # a temperature changes no top label: 4/4 right


def test_the_temperature_fit_allows_minus_inf_only_where_the_likelihood_is_finite() -> None:
    labels = torch.tensor([1, 1, 0, 1])
    finite = torch.tensor([[0.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.5, 0.0]])
    assert temperature.fittable(finite, labels)
    with_minus_inf = finite.clone()
    with_minus_inf[0, 0] = -INF  # a wrong class: probability 0 at every T, drops out
    assert temperature.fittable(with_minus_inf, labels)
    # row 0 is then certain (loss 0 at every T) and adds 0 to the NLL and to its slope: the NLL's minimiser is
    # the one without row 0
    fit = temperature.fit_temperature(with_minus_inf, labels).temperature
    assert fit == pytest.approx(temperature.fit_temperature(finite[1:], labels[1:]).temperature, rel=1e-12)
    on_label = finite.clone()
    on_label[0, 1] = -INF  # the label's own logit: loss +inf at every T
    for bad in (on_label, torch.tensor([[0.0, INF]] * 4), torch.tensor([[math.nan, 0.0]] * 4)):
        assert not temperature.fittable(bad, labels)
        with pytest.raises(ValueError, match="every temperature"):
            temperature.fit_temperature(bad, labels)


def test_an_unfitted_task_reports_no_scaled_number_at_all() -> None:
    # A +inf logit: the NLL is undefined at every T, no fit. Every scaled number is NaN (null), the accuracies
    # too, in the T block and wherever the clean temperatures are applied (noise, FGSM, label shift); the old
    # code reported the unscaled numbers there (accuracy 3/4, read from the NaN softmax of row 0).
    z = [torch.tensor([[0.0, INF], [0.0, 1.0], [2.0, 0.0], [0.0, 1.0]])]
    y = torch.tensor([[1], [1], [0], [1]])
    fitted = robust_eval.fit_temperatures(z, y)
    assert fitted.per_sample == [None] and math.isnan(fitted.whole[0])
    scaled = robust_eval.temperature_block(z, y, BALL, fitted=fitted)
    assert all(math.isnan(scaled["mean"][key]) for key in robust_eval.METRICS)
    shifted = [torch.tensor([[0.0, 3.0], [0.0, 1.0], [2.0, 0.0], [0.0, 1.0]])]  # e.g. a noise point, finite
    assert all(math.isnan(v) for v in robust_eval.metrics_block(fitted.apply(shifted), y, BALL)["mean"].values())
    for point in robust_eval.label_shift_block(fitted.apply(z), y, BALL)["points"]:
        assert all(math.isnan(point["mean"][key]) for key in robust_eval.METRICS)
    assert robust_eval.metrics_block(z, y, BALL)["mean"]["accuracy"] == 1.0  # unscaled: 4/4 top labels right


# ------------------------------------------------------------------ 5. drmoo report on odd eval.json files


@pytest.fixture(scope="module")
def healthy_eval() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    z = [torch.randn(6, 10, generator=g) for _ in range(2)]
    y = torch.randint(0, 10, (6, 2), generator=g)
    clean = robust_eval.metrics_block(z, y, BALL)
    return robust_eval.json_safe({
        "method": "double_clip", "seed": 0, "experiment": "multimnist", "test_samples": 6,
        "results": [{"eps": 0.0, "mean_acc": 0.1, "task_acc": [0.1, 0.1], "metrics": clean}],
        "robustness": {"run_ball": {"divergence": "chi2", "lam": 0.8}, "clean": clean,
                       "temperature_scaled": robust_eval.temperature_block(z, y, BALL),
                       "label_shift": robust_eval.label_shift_block(z, y, BALL), "noise": {"points": []}}})


def _collect(tmp_path: Path, report: dict[str, Any]) -> tuple[list[Any], list[tuple[Path, str]]]:
    """A run directory whose eval.json (``report``) matches its checkpoint, so that it is shown; collected."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"experiment": "multimnist", "method": "double_clip", "seed": 0}))
    (run / "metrics.csv").write_text("epoch,acc\n1,0.5\n")
    sha = store.write_checkpoint_file(run / "checkpoint.pt", {"step": 1}, {"step": 1})
    (run / "eval.json").write_text(json.dumps({**report, "checkpoint": {"step": 1, "payload_sha256": sha}}))
    return results_report.collect([run])


def test_report_shows_a_healthy_eval_json(tmp_path: Path, healthy_eval: dict[str, Any]) -> None:
    sections, skipped = _collect(tmp_path, healthy_eval)
    assert skipped == [] and any("| mean_loss |" in table for table in sections[0].tables)


@pytest.mark.parametrize(("where", "value", "reason"), [
    # 10**400 is valid JSON, but no float (max ~1.8e308): formatting it raised OverflowError (a traceback)
    (("robustness", "clean", "mean", "mean_loss"), 10 ** 400,
     "eval.json.robustness.clean.mean.mean_loss is an integer too large"),
    (("results", 0, "task_acc", 0), 10 ** 400, "eval.json.results[0].task_acc[0] is an integer too large"),
    # a string where a number is formatted with :g gave "Unknown format code 'g'", naming no file or key
    (("robustness", "run_ball", "lam"), "0.8", "eval.json.robustness.run_ball.lam is not"),
    (("robustness", "label_shift", "points", 0, "digit_factor"), "0.25",
     "eval.json.robustness.label_shift.points[0].digit_factor is not"),
    # 1 value on a 2-task run: shown as task 1, the mean as task 2 and the T-mean as the mean, silently
    (("robustness", "clean", "per_task", "mean_loss"), [1.0],
     "eval.json.robustness.clean.per_task.mean_loss has 1 values, not one per task (2"),
], ids=["huge-int-metric", "huge-int-task-acc", "lam-string", "digit-factor-string", "per-task-too-short"])
def test_report_skips_an_odd_eval_json_naming_the_file_and_the_key(
        tmp_path: Path, healthy_eval: dict[str, Any], where: tuple[Any, ...], value: Any, reason: str) -> None:
    report = copy.deepcopy(healthy_eval)
    target = report
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    sections, skipped = _collect(tmp_path, report)
    assert sections == []
    assert len(skipped) == 1 and skipped[0][1].startswith("skipped: ") and reason in skipped[0][1], skipped
