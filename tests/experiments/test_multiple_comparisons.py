"""The paired p-values and Holm's correction behind scripts/multiple_comparisons.py."""

from __future__ import annotations

import csv
import math
import random
from pathlib import Path
from typing import Any

import pytest
from scipy import stats

from drmoo.experiments.paired_stats import holm_adjusted, paired_differences, paired_p_value

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("seed", range(6))
def test_p_value_from_the_interval_is_the_paired_t_tests(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    mine = {s: rng.gauss(0.3, 1.0) for s in range(n)}
    theirs = {s: rng.gauss(0.0, 1.0) for s in range(n)}
    (row,) = paired_differences({"a": {0: mine}, "b": {0: theirs}}, "a", [0])
    expected = stats.ttest_1samp([mine[s] - theirs[s] for s in range(n)], 0.0).pvalue
    # Both sides are the same t statistic through two different scipy routes (ppf then sf): they agree to
    # the quantile's inversion accuracy, far below any decision threshold.
    assert paired_p_value(row) == pytest.approx(expected, rel=1e-6, abs=1e-12)


def test_p_value_edge_cases() -> None:
    assert math.isnan(paired_p_value({"seeds": 1, "mean": 2.0, "ci_low": math.nan, "ci_high": math.nan}))
    assert paired_p_value({"seeds": 5, "mean": 2.0, "ci_low": 2.0, "ci_high": 2.0}) == 0.0
    assert paired_p_value({"seeds": 5, "mean": 0.0, "ci_low": 0.0, "ci_high": 0.0}) == 1.0
    # An interval whose end touches 0 is a p of exactly 5 %.
    assert paired_p_value({"seeds": 5, "mean": 1.0, "ci_low": 0.0, "ci_high": 2.0}) == pytest.approx(0.05)


def test_holm_by_hand() -> None:
    # Sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> monotone: 0.06.
    assert holm_adjusted([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    adjusted = holm_adjusted([0.5, math.nan, 0.9])  # NaN is no member: m = 2
    assert adjusted[0] == pytest.approx(1.0) and math.isnan(adjusted[1]) and adjusted[2] == pytest.approx(1.0)
    assert holm_adjusted([]) == []


def test_script_writes_the_family_and_refuses_unknown_folders(tmp_path: Path, load_script: Any) -> None:
    module = load_script("multiple_comparisons")
    folder = tmp_path / "multimnist3-small"
    folder.mkdir()
    fields = ["reference", "other", "column", "mean", "ci_low", "ci_high", "wins", "ties", "seeds"]
    rows = [["dc", "x", "0.0", "5.0", "4.0", "6.0", "5", "0", "5"],   # tiny p: survives
            ["dc", "x", "0.1", "1.0", "0.01", "1.99", "4", "0", "5"],  # excludes 0 alone, not after Holm
            ["dc", "y", "0.0", "0.5", "-1.0", "2.0", "3", "0", "5"]]
    with (folder / "paired.csv").open("w", newline="") as handle:
        csv.writer(handle).writerows([fields, *rows])
    assert module.main(["x", str(folder)]) == 0
    with (folder / "multiple-comparisons.csv").open() as handle:
        written = list(csv.DictReader(handle))
    assert [(r["excludes_0"], r["survives_holm"]) for r in written] == [
        ("True", "True"), ("True", "False"), ("False", "False")]
    with pytest.raises(SystemExit, match="no family"):
        module.family_rows(tmp_path)
    # a set-up's folder inside a λ path is that path's family; the same name elsewhere is not
    assert module.family_of(tmp_path / "mnist-attributes-small" / "dr-path" / "weighted") == "dr-path"
    assert module.family_of(tmp_path / "multimnist2-small" / "dr-path-tuned") == "dr-path"
    with pytest.raises(SystemExit, match="no family"):
        module.family_of(tmp_path / "mnist-attributes-small" / "weighted")


def test_a_hypothesis_listed_twice_counts_once(tmp_path: Path, load_script: Any) -> None:
    module = load_script("multiple_comparisons")
    folder = tmp_path / "mnist-attributes-small"
    fields = ["reference", "other", "column", "mean", "ci_low", "ci_high", "wins", "ties", "seeds"]
    tables = {
        # The label-balanced set's accuracy is its balanced accuracy: one hypothesis in two columns.
        "weighted/paired.csv": [["dc", "x", "balanced:mean_accuracy", "5.0", "4.0", "6.0", "5", "0", "5"],
                                ["dc", "x", "balanced:mean_balanced_accuracy", "5.0", "4.0", "6.0", "5", "0", "5"]],
        "unweighted/paired.csv": [["dc", "x", "prevalence:mean_auc", "1.0", "0.5", "1.5", "5", "0", "5"]],
        # contrasts.csv names unweighted/paired.csv's rows "unweighted:...": its first row repeats the one
        # above; its second, the same names without the prefix, is another hypothesis (the weighted rows).
        "contrasts.csv": [["unweighted:dc", "unweighted:x", "prevalence:mean_auc", "1.0", "0.5", "1.5", "5", "0", "5"],
                          ["dc", "x", "prevalence:mean_auc", "0.2", "-1.0", "1.4", "3", "0", "5"]],
    }
    for name, rows in tables.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        with (folder / name).open("w", newline="") as handle:
            csv.writer(handle).writerows([fields, *rows])
    rows = module.family_rows(folder)
    assert [row["hypothesis"] for row in rows] == [0, 0, 2, 2, 4]
    assert module.summary(rows) == (5, 4, 4, 3, 2, 2)


@pytest.mark.parametrize("folder", ["multimnist2-small", "multimnist3-small", "mnist-attributes-small",
                                    "multimnist2-small/dr-path", "mnist-attributes-small/dr-path/weighted",
                                    "mnist-attributes-small/dr-path/unweighted"])
def test_committed_tables_are_current(folder: str, load_script: Any) -> None:
    module = load_script("multiple_comparisons")
    rows = module.family_rows(ROOT / "results" / folder)
    with (ROOT / "results" / folder / "multiple-comparisons.csv").open() as handle:
        committed = list(csv.DictReader(handle))
    assert [(r["other"], r["column"], r["survives_holm"]) for r in committed] == [
        (r["other"], r["column"], str(r["survives_holm"])) for r in rows]


def _fake_run(folder: Path, seed: int, epochs: list[float], clean: float, stopped: bool = False) -> None:
    import json

    run = folder / f"mgda-seed{seed}"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"eval_split": "test", "label": "mgda", "method": "mgda",
                                                  "seed": seed}))
    (run / "metrics.csv").write_text("epoch,test_acc\n" + "".join(f"{i},{a}\n" for i, a in enumerate(epochs)))
    (run / "eval.json").write_text(json.dumps({"results": [{"eps": 0.0, "mean_acc": clean}]}))
    if stopped:
        (run / "diverged").write_text("")


def test_divergences_counts_stopped_and_collapsed_runs(tmp_path: Path, load_script: Any) -> None:
    module = load_script("divergences")
    _fake_run(tmp_path / "a", 0, [0.5, 0.9, 0.91], 0.91)
    _fake_run(tmp_path / "a", 1, [0.5, 0.91, 0.44], 0.44)  # the 91 % -> 44 % collapse
    _fake_run(tmp_path / "a", 2, [0.5, 0.9], 0.85, stopped=True)
    _fake_run(tmp_path / "a", 3, [0.5, 0.9], 0.805)  # 9.5 points: under the threshold
    (row,) = module.divergence_rows(tmp_path)
    assert (row["folder"], row["runs"], row["stopped"], row["collapsed"]) == ("a", 4, 1, 1)
    assert row["max_drop"] == pytest.approx(47.0) and row["seeds"] == "1 2"
    assert module.main(["x", str(tmp_path)]) == 0 and (tmp_path / "divergences.csv").is_file()
