"""The paired table's decimal places: a column of losses in nats, whose differences are thousandths, printed
as "+0.00 [-0.00, +0.00]" with two places; each column now gets the places of its smallest non-zero mean or
interval half-width (at least 2, at most 4), and exact zeros keep two."""

from __future__ import annotations

import math

import pytest

from drmoo.experiments.paired_stats import paired_differences, paired_markdown, shown_decimals


def row(mean: float, low: float = math.nan, high: float = math.nan) -> dict[str, float]:
    return {"mean": mean, "ci_low": low, "ci_high": high}


@pytest.mark.parametrize(("rows", "places"), [
    ([row(1.5, 0.5, 2.5)], 2),                       # half-width 1.0
    ([row(0.05, 0.04, 0.06)], 2),                    # 0.05 and 0.01: both show at two places
    ([row(0.0034, 0.0012, 0.0056)], 3),              # 0.0034 and half-width 0.0022: first digit at place 3
    ([row(0.2, 0.19992, 0.20008)], 4),               # half-width 8e-5: capped at 4
    ([row(0.0, 0.0, 0.0)], 2),                       # a method that trains the same model: zeros, two places
    ([row(0.004)], 3),                               # one seed: no interval, the mean alone
    ([row(math.nan)], 2),                            # no common seed
    ([row(1.2, 0.2, 2.2), row(0.009, 0.004, 0.014)], 3),  # the column's smallest sets the places for all rows
])
def test_shown_decimals(rows: list[dict[str, float]], places: int) -> None:
    assert shown_decimals(rows) == places


def test_a_loss_column_is_printed_with_its_digits_and_an_accuracy_column_keeps_two() -> None:
    # Per seed: the reference's loss is lower by 0.003, 0.004, 0.005 nats; its accuracy higher by 1, 2, 3 points.
    per_seed = {
        "ref": {"loss": {0: 0.500, 1: 0.600, 2: 0.700}, "acc": {0: 91.0, 1: 92.0, 2: 93.0}},
        "other": {"loss": {0: 0.503, 1: 0.604, 2: 0.705}, "acc": {0: 90.0, 1: 90.0, 2: 90.0}},
    }
    rows = paired_differences(per_seed, "ref", ["loss", "acc"])
    text = paired_markdown(rows, {"loss": "loss", "acc": "acc"}, sense="higher")
    line = next(line for line in text.splitlines() if line.startswith("| other |"))
    loss_cell, acc_cell = (cell.strip() for cell in line.split("|")[2:4])
    # mean -0.004, sd 0.001, half-width t(0.975, 2) * 0.001 / sqrt(3) = 4.303 * 0.000577 = 0.00248: places 3
    assert loss_cell == "-0.004 [-0.006, -0.002] 0/3"
    # mean 2, sd 1, half-width 4.303 / sqrt(3) = 2.48: places 2
    assert acc_cell == "+2.00 [-0.48, +4.48] 3/3"
