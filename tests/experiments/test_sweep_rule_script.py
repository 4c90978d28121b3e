"""scripts/sweep_rule.py, which chooses the batch-64 regime's rates, is the rule that chose SMALL_LR.

The batch-64 regime (``scripts/reproduce_small.sh b64-sweep``, ``b64-runoff``, ``b64``) takes its
stage-2 finalists and its winners from this script instead of from hand-copied specs, so the script
must pick exactly what the committed sweeps picked.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

from drmoo.experiments.multimnist import SMALL_LR

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("experiment", ["multimnist2", "multimnist3"])
def test_script_picks_the_committed_winners_and_finalists(experiment: str, load_script: Any) -> None:
    rule = load_script("sweep_rule")
    sweep = ROOT / "results" / f"{experiment}-small" / "lr-sweep"
    own_sweep = {"moco"} if experiment == "multimnist2" else set()  # MoCo's 2-digit rate: its own sweep
    assert rule.winners(sweep) == {m: lr for m, lr in SMALL_LR[experiment].items() if m not in own_sweep}
    ran = rule.clean_by_rate(sweep / "runoff" / "table.csv")
    assert {m: sorted(pair) for m, pair in rule.finalists(sweep).items()} == {m: sorted(r) for m, r in ran.items()}
    # the committed grids were already extended wherever the rule asked for it
    assert rule.extension(sweep) == []


def test_features_rows_are_swept_apart_from_parameters_rows(tmp_path: Path, load_script: Any) -> None:
    """A ``jacobian=features`` row is its own key: its rates never mix with the parameters-mode rows'."""
    rule = load_script("sweep_rule")
    rows = [("double-clip[lr=1.0]", 90.0), ("double-clip[lr=0.3]", 80.0),
            ("double-clip[jacobian=features,lr=0.1]", 70.0), ("double-clip[jacobian=features,lr=0.3]", 60.0),
            ("moco[ema=0.95,lr=0.3]", 99.0)]
    with (tmp_path / "table.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "eps", "mean_acc"])
        writer.writerows([name, 0.0, acc] for name, acc in rows)
    assert rule.clean_by_rate(tmp_path / "table.csv") == {
        "double-clip": {1.0: 90.0, 0.3: 80.0}, "double-clip[jacobian=features]": {0.1: 70.0, 0.3: 60.0}}
    # the features row's best rate sits at the low end: the next rate down, in its own mode
    assert rule.extension(tmp_path) == ["double-clip[lr=3.0]", "double-clip[jacobian=features,lr=0.03]"]
    assert rule.with_rate("double-clip[jacobian=features]", 0.003) == "double-clip[jacobian=features,lr=0.003]"


def test_label_imbalance_tables_rank_by_balanced_accuracy(tmp_path: Path, load_script: Any) -> None:
    """mnist-attributes' table (set, metric, mean): the rule reads the prevalence set's mean balanced
    accuracy, never plain accuracy (which would pick the rate that predicts the majority label)."""
    rule = load_script("sweep_rule")
    balanced, plain = "mean_balanced_accuracy", "mean_accuracy"
    rows = [("mgda[lr=0.1]", "prevalence", plain, 95.0), ("mgda[lr=0.1]", "prevalence", balanced, 60.0),
            ("mgda[lr=1.0]", "prevalence", plain, 90.0), ("mgda[lr=1.0]", "prevalence", balanced, 85.0),
            ("mgda[lr=1.0]", "balanced", balanced, 10.0), ("mgda[lr=0.3]", "prevalence", balanced, 70.0),
            ("mgda[lam=100,pref_lr=0,lr=0.3]", "prevalence", balanced, 75.0)]
    with (tmp_path / "table.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "set", "metric", "mean", "std", "seeds"])
        writer.writerows([name, where, metric, value, 0.0, 1] for name, where, metric, value in rows)
    assert rule.clean_by_rate(tmp_path / "table.csv") == {
        "mgda": {0.1: 60.0, 1.0: 85.0, 0.3: 70.0}, "mgda[lam=100,pref_lr=0]": {0.3: 75.0}}
    # mgda's best rate, 1.0, is the grid's top end; the plain reference's one rate is both ends: one below
    assert rule.extension(tmp_path) == ["mgda[lr=3.0]", "mgda[lam=100,pref_lr=0,lr=0.1]"]
    (tmp_path / "bad.csv").write_text("method,score\nmgda[lr=0.1],1\n")
    with pytest.raises(ValueError, match="neither an eps nor a set/metric"):
        rule.clean_by_rate(tmp_path / "bad.csv")


def test_rows_name_a_winner_at_the_preset_rate_as_the_preset_row(tmp_path: Path, load_script: Any) -> None:
    """``rows SWEEP EXPERIMENT``: a winner at the small preset's own rate is the bare row (its runs are the
    preset's, reused, not repeated under a second name); a winner elsewhere keeps its rate."""
    rule = load_script("sweep_rule")
    committed = ROOT / "results" / "multimnist3-small" / "lr-sweep"  # SMALL_LR came from this sweep
    assert rule.preset_rows(committed, "multimnist3") == list(rule.winners(committed))
    preset_rate = SMALL_LR["multimnist2"]["mgda"]
    other_rate = 1.0 if preset_rate != 1.0 else 0.3
    runoff = tmp_path / "runoff"
    runoff.mkdir()
    rows = [(f"mgda[lr={preset_rate}]", 80.0), (f"mgda[lr={other_rate * 3}]", 70.0),
            (f"mgda[lam=100,pref_lr=0,lr={other_rate}]", 60.0), (f"mgda[lam=100,pref_lr=0,lr={preset_rate}]", 50.0)]
    for table in (tmp_path / "table.csv", runoff / "table.csv"):  # the same scores in both stages
        with table.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["method", "eps", "mean_acc"])
            writer.writerows([name, 0.0, score] for name, score in rows)
    assert rule.preset_rows(tmp_path, "multimnist2") == ["mgda", f"mgda[lam=100,pref_lr=0,lr={other_rate!r}]"]
    assert rule.preset_rows(tmp_path, "multimnist2", tuned_only=True) == [f"mgda[lam=100,pref_lr=0,lr={other_rate!r}]"]
    assert rule.preset_rows(committed, "multimnist3", tuned_only=True) == []


def test_attribute_contrasts_add_the_tuned_rates_once_both_stages_ran(tmp_path: Path, load_script: Any) -> None:
    """scripts/attribute_contrasts.py asks "what wins" and "does DR help" again at the rates the validation
    sweep chose, but only once its second stage has run; rows at the preset's rate are the preset's rows."""
    contrasts = load_script("attribute_contrasts")
    sweep = tmp_path / "lr-sweep"
    (sweep / "runoff").mkdir(parents=True)
    assert contrasts.tuned_contrasts(tmp_path) == []  # no stage run yet
    scores = {"double-clip[lr=1.0]": 92.0, "double-clip[lr=3.0]": 91.0, "mgda[lr=1.0]": 86.0, "mgda[lr=0.3]": 85.0,
              "mgda[lam=100,pref_lr=0,lr=1.0]": 90.0, "mgda[lam=100,pref_lr=0,lr=3.0]": 86.0}
    # another method's stage 1 has run and its stage 2 has not: the key rows' winners are decided all the same
    for table, extra in ((sweep / "table.csv", {"famo[lr=0.1]": 80.0, "famo[lr=0.3]": 81.0}),
                         (sweep / "runoff" / "table.csv", {})):
        with table.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["method", "set", "metric", "mean", "std", "seeds"])
            writer.writerows([name, "prevalence", "mean_balanced_accuracy", score, 0.0, 1]
                             for name, score in {**scores, **extra}.items())
    with pytest.raises(ValueError, match="famo: stage 2 ran"):
        load_script("sweep_rule").winners(sweep)
    assert SMALL_LR["multimnist2"]["double-clip"] == 1.0  # mnist-attributes' small preset takes these rates
    preset = "double-clip"  # Double-Clip's winner is the preset's rate: its preset row, and no twin added
    assert contrasts.tuned_contrasts(tmp_path) == [
        (preset, "mgda[lr=1.0]"), (preset, "mgda[lam=100,pref_lr=0,lr=1.0]"),
        ("mgda[lr=1.0]", "mgda[lam=100,pref_lr=0,lr=1.0]"), ("mgda[lr=1.0]", "mgda[lam=100,lr=1.0]"),
        ("mgda[lr=1.0]", "unweighted:mgda[lr=1.0]"),
        ("mgda[lam=100,pref_lr=0,lr=1.0]", "unweighted:mgda[lam=100,pref_lr=0,lr=1.0]")]
