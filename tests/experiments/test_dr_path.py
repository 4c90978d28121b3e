"""scripts/dr_path.py: the λ path's contrasts against λ 100, with and without a temperature."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

METRICS = ("accuracy", "balanced_accuracy", "worst_class_accuracy", "mean_loss", "cvar_0.1", "cvar_0.05",
           "robust_run", "robust_chi2_0.1", "robust_chi2_0.8", "ece", "misclassified_loss")


def _means(base: float) -> dict[str, float]:
    return {metric: base + index / 100 for index, metric in enumerate(METRICS)}


def _run(folder: Path, label: str, seed: int, base: float, temperature_shift: float) -> None:
    run = folder / f"{label}-seed{seed}"
    run.mkdir(parents=True)
    method = label.split("[")[0]
    (run / "config.json").write_text(json.dumps({"label": label if "[" in label else "", "method": method,
                                                 "seed": seed, "eval_split": "test"}))
    shifted = {k: v + temperature_shift for k, v in _means(base).items()}
    report = {
        "run": str(run),
        "label": label, "method": method, "seed": seed,
        "results": [{"eps": eps, "metrics": {"mean": _means(base - eps)}} for eps in (0.0, 0.05, 0.2)],
        "robustness": {
            "clean": {"mean": _means(base)},
            "temperature_scaled": {"mean": shifted},
            "label_shift": {"points": [{"digit_factor": k, "mean": _means(base - k / 100)} for k in (0.25, 4.0)]},
            "noise": {"points": [{"sigma": 0.3, "mean": _means(base - 0.3)}]},
        },
    }
    (run / "eval.json").write_text(json.dumps(report))


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_contrasts_against_erm_and_erm_with_temperature(tmp_path: Path, load_script: Any) -> None:
    module = load_script("dr_path")
    dr, erm = {0: 0.50, 1: 0.40, 2: 0.45}, {0: 0.60, 1: 0.55, 2: 0.50}
    for seed in range(3):
        _run(tmp_path, "double-clip", seed, dr[seed], temperature_shift=0.0)
        _run(tmp_path, "double-clip[lam=100]", seed, erm[seed], temperature_shift=-0.2)
        # another rate: not double-clip[lam=100]'s twin, so it has no contrast
        _run(tmp_path, "double-clip[lam=0.1,lr=3.0]", seed, 0.3, temperature_shift=0.0)
    assert module.main(["x", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "contrasts.csv")
    assert {r["reference"] for r in rows} == {"double-clip"}
    figure = (tmp_path / "lambda-path.png").read_bytes()
    assert figure.startswith(b"\x89PNG") and b"Software" not in figure  # no version stamp: reproducible bytes
    against_erm = [r for r in rows if r["other"] == "double-clip[lam=100]"]
    against_t = [r for r in rows if r["other"] == "double-clip[lam=100]+T"]
    assert [r["column"] for r in against_erm] == list(module.AGAINST_ERM)
    assert [r["column"] for r in against_t] == list(module.AGAINST_ERM_T)
    differences = [dr[s] - erm[s] for s in range(3)]  # cvar_0.05 and every clean metric share the offset
    (cvar,) = [r for r in against_erm if r["column"] == "clean:cvar_0.05"]
    assert float(cvar["mean"]) == pytest.approx(sum(differences) / 3)
    assert (int(cvar["wins"]), int(cvar["seeds"])) == (0, 3)
    # accuracies in %: the same difference times 100
    (accuracy,) = [r for r in against_erm if r["column"] == "clean:accuracy"]
    assert float(accuracy["mean"]) == pytest.approx(100 * sum(differences) / 3)
    # against the twin's temperature-scaled values (0.2 lower on every metric)
    (cvar_t,) = [r for r in against_t if r["column"] == "clean:cvar_0.05"]
    assert float(cvar_t["mean"]) == pytest.approx(sum(differences) / 3 + 0.2)
    # under FGSM at 0.2 the fake metrics fall by eps for both rows: the same difference
    (fgsm,) = [r for r in against_erm if r["column"] == "eps=0.2:cvar_0.05"]
    assert float(fgsm["mean"]) == pytest.approx(sum(differences) / 3)


def test_each_method_is_contrasted_with_its_own_lambda_100_twin(tmp_path: Path, load_script: Any) -> None:
    module = load_script("dr_path")
    for seed in range(3):
        _run(tmp_path, "double-clip", seed, 0.5 + seed / 10, temperature_shift=0.0)
        _run(tmp_path, "double-clip[lam=3]", seed, 0.4, temperature_shift=0.0)
        _run(tmp_path, "double-clip[lam=100]", seed, 0.6, temperature_shift=0.0)
        _run(tmp_path, "mgda", seed, 0.3 + seed / 10, temperature_shift=0.0)
        _run(tmp_path, "mgda[lam=100]", seed, 0.1, temperature_shift=-0.1)
    assert module.main(["x", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "contrasts.csv")
    pairs = {(r["reference"], r["other"]) for r in rows}
    assert pairs == {("double-clip", "double-clip[lam=100]"), ("double-clip", "double-clip[lam=100]+T"),
                     ("double-clip[lam=3]", "double-clip[lam=100]"), ("double-clip[lam=3]", "double-clip[lam=100]+T"),
                     ("mgda", "mgda[lam=100]"), ("mgda", "mgda[lam=100]+T")}
    (mgda_cvar,) = [r for r in rows if (r["reference"], r["other"], r["column"])
                    == ("mgda", "mgda[lam=100]", "clean:cvar_0.05")]
    assert float(mgda_cvar["mean"]) == pytest.approx(0.3)  # (0.3 + s/10) - 0.1, meaned over s = 0, 1, 2
    (mgda_t,) = [r for r in rows if (r["reference"], r["other"], r["column"])
                 == ("mgda", "mgda[lam=100]+T", "clean:cvar_0.05")]
    assert float(mgda_t["mean"]) == pytest.approx(0.4)
    # rows by method, then by increasing λ (the default, 0.8, before 3)
    assert [r["reference"] for r in rows][::len(module.AGAINST_ERM) + len(module.AGAINST_ERM_T)] == [
        "double-clip", "double-clip[lam=3]", "mgda"]


def test_each_lambda_at_its_own_rate_meets_lambda_100_at_its_own(tmp_path: Path, load_script: Any) -> None:
    """A ``*-tuned`` folder (each λ at its own validated rate): the twin is the method's λ 100 row whatever its
    rate; elsewhere a row at another rate has none; two candidates are refused, not chosen between."""
    module = load_script("dr_path")
    rows = ["double-clip[lam=0.1]", "double-clip[lam=3,lr=3.0]", "double-clip[lam=100,lr=3.0]",
            "mgda[lr=0.3]", "mgda[lam=100,lr=1.0]"]
    assert module.erm_twin("double-clip[lam=0.1]", rows, own_rates=True) == "double-clip[lam=100,lr=3.0]"
    assert module.erm_twin("double-clip[lam=3,lr=3.0]", rows, own_rates=True) == "double-clip[lam=100,lr=3.0]"
    assert module.erm_twin("mgda[lr=0.3]", rows, own_rates=True) == "mgda[lam=100,lr=1.0]"
    assert module.erm_twin("double-clip[lam=100,lr=3.0]", rows, own_rates=True) is None
    assert module.erm_twin("double-clip[lam=0.1,rho=0.1]", rows, own_rates=True) is None  # another setting
    assert module.erm_twin("double-clip[lam=0.1]", rows) is None  # not a tuned folder: the rates differ
    with pytest.raises(SystemExit, match="more than one"):
        module.erm_twin("double-clip[lam=0.1]", [*rows, "double-clip[lam=100]"], own_rates=True)
    assert module.runs_at_own_rates(tmp_path / "weighted-tuned") and not module.runs_at_own_rates(tmp_path / "x")


def test_a_run_without_the_robustness_block_is_refused(tmp_path: Path, load_script: Any) -> None:
    module = load_script("dr_path")
    run = tmp_path / "double-clip-seed0"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"label": "", "method": "double-clip", "seed": 0}))
    (run / "eval.json").write_text(json.dumps({"run": str(run), "results": []}))
    with pytest.raises(SystemExit, match="no robustness block"):
        module.read_runs(tmp_path)


def _attributes_run(folder: Path, label: str, seed: int, base: float) -> None:
    run = folder / f"{label}-seed{seed}"
    run.mkdir(parents=True)
    method = label.split("[")[0]
    (run / "config.json").write_text(json.dumps({"label": label if "[" in label else "", "method": method,
                                                 "seed": seed, "eval_split": "test",
                                                 "experiment": "mnist-attributes"}))
    means = {**_means(base), "weighted_robust_chi2_0.8": base + 1}
    report = {
        "run": str(run), "label": label, "method": method, "seed": seed, "results": [],
        "robustness": {
            "clean": {"mean": means},
            "temperature_scaled": {"mean": {k: v - 0.1 for k, v in means.items()}},
            "label_shift": {"points": [{"positive_rate_strength": s, "mean": _means(base - s)} for s in (1.0, 2.0)]},
            "temperature_label_shift": {"points": [{"positive_rate_strength": s, "mean": _means(base - s - 0.1)}
                                                   for s in (1.0, 2.0)]},
            "noise": {"points": [{"sigma": 0.3, "mean": _means(base - 0.3),
                                  "temperature_scaled": {"mean": _means(base - 0.5)}}]},
        },
    }
    (run / "eval.json").write_text(json.dumps(report))


def test_the_attributes_have_their_own_hypotheses(tmp_path: Path, load_script: Any) -> None:
    """No FGSM column on the attributes; the balanced accuracy, the label-balancing worst case, the mirrored
    positive rate (s = 2) and the noise are contrasted, against λ 100 and (the losses) its temperature."""
    module = load_script("dr_path")
    for seed in range(3):
        _attributes_run(tmp_path, "double-clip[lam=0.1]", seed, 0.5 + seed / 10)
        _attributes_run(tmp_path, "double-clip[lam=100]", seed, 0.4)
    assert module.main(["x", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "contrasts.csv")
    against_erm = [r["column"] for r in rows if r["other"] == "double-clip[lam=100]"]
    assert against_erm == list(module.ATTRIBUTES_AGAINST_ERM)
    assert not any(column.startswith("eps=") for column in against_erm)
    assert {"clean:balanced_accuracy", "clean:weighted_robust_chi2_0.8", "label=2:cvar_0.05"} <= set(against_erm)
    (worst_case,) = [r for r in rows if (r["other"], r["column"])
                     == ("double-clip[lam=100]+T", "clean:weighted_robust_chi2_0.8")]
    assert float(worst_case["mean"]) == pytest.approx(0.3)  # 1.6 (seeds meaned) - (1.4 - 0.1: the temperature)


def test_runs_of_two_experiments_in_one_folder_are_refused(tmp_path: Path, load_script: Any) -> None:
    module = load_script("dr_path")
    _attributes_run(tmp_path, "double-clip[lam=100]", 0, 0.4)
    _run(tmp_path, "double-clip", 0, 0.5, temperature_shift=0.0)
    with pytest.raises(SystemExit, match="share one experiment"):
        module.experiment_of(tmp_path)


def test_under_shift_each_lambda_meets_lambda_100_with_its_clean_temperature(tmp_path: Path,
                                                                             load_script: Any) -> None:
    """The second family: the shifted tail and ECE against the twin's T@ numbers, Holm-corrected on its own."""
    module = load_script("dr_path")
    for seed in range(3):
        _attributes_run(tmp_path, "double-clip[lam=0.1]", seed, 0.5 + seed / 10)
        _attributes_run(tmp_path, "double-clip[lam=100]", seed, 0.4)
    assert module.main(["x", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "contrasts-temperature-shift.csv")
    assert [r["column"] for r in rows] == list(module.ATTRIBUTES_AGAINST_ERM_T_SHIFT)
    assert {r["other"] for r in rows} == {"double-clip[lam=100]+T"}
    (noise,) = [r for r in rows if r["column"] == "noise=0.3:cvar_0.05"]
    # DR 0.6 - 0.3 meaned over seeds, against the twin's temperature-scaled 0.4 - 0.5 (+ cvar_0.05's offset)
    assert float(noise["mean"]) == pytest.approx(0.3 - (-0.1))
    (label,) = [r for r in rows if r["column"] == "label=2:cvar_0.05"]
    assert float(label["mean"]) == pytest.approx((0.6 - 2) - (0.4 - 2 - 0.1))
    assert all(0 <= float(r["p"]) <= float(r["p_holm"]) <= 1 for r in rows)
    (summary,) = _rows(tmp_path / "contrasts-temperature-shift-summary.csv")
    assert int(summary["intervals"]) == len(rows)
    assert int(summary["survive_holm"]) == sum(r["survives_holm"] == "True" for r in rows)
    assert int(summary["exclude_0"]) >= int(summary["survive_holm"])
    # the first family is unchanged by it
    assert [r["column"] for r in _rows(tmp_path / "contrasts.csv") if r["other"].endswith("+T")] == list(
        module.ATTRIBUTES_AGAINST_ERM_T)


@pytest.mark.parametrize("folder", ["multimnist2-small/dr-path", "multimnist2-small/dr-path-tuned",
                                    "mnist-attributes-small/dr-path/weighted",
                                    "mnist-attributes-small/dr-path/unweighted",
                                    "mnist-attributes-small/dr-path/weighted-lr3",
                                    "mnist-attributes-small/dr-path/weighted-tuned",
                                    "mnist-attributes-small/dr-path/unweighted-tuned"])
def test_committed_contrasts_are_those_of_the_committed_runs(folder: str, load_script: Any) -> None:
    """contrasts.csv and contrasts-temperature-shift.csv recomputed from the committed eval.json files."""
    module = load_script("dr_path")
    path = Path(__file__).resolve().parents[2] / "results" / folder
    per_seed = module.read_runs(path)
    experiment = module.experiment_of(path)
    own_rates = module.runs_at_own_rates(path)
    shifted = module.shift_contrasts_with_temperature(per_seed, experiment, own_rates)
    for name, rows in (("contrasts.csv", module.contrasts(per_seed, experiment, own_rates)),
                       ("contrasts-temperature-shift.csv", shifted)):
        committed = _rows(path / name)
        assert [(r["reference"], r["other"], r["column"]) for r in committed] == [
            (r["reference"], r["other"], r["column"]) for r in rows]
        for mine, theirs in zip(rows, committed, strict=True):
            assert float(theirs["mean"]) == pytest.approx(float(mine["mean"]), rel=1e-12, abs=1e-12)
