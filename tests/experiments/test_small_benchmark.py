"""The converged CPU benchmark (issue 21): MultiLeNet, the validation holdout, method variants, paired statistics."""

from __future__ import annotations

import csv
import json
import math
import random
import re
from pathlib import Path

import pytest
import torch

from drmoo.cli import main
from drmoo.data.mnist import DigitSplits
from drmoo.data.multimnist import VALIDATION_FRACTION, MultiMnistRecipe, _generate, holdout_splits
from drmoo.experiments.multimnist import PRESETS, SMALL_LR, SMALL_MOCO_EMA, build_model, method_hparams
from drmoo.experiments.paired_stats import (
    paired_differences,
    paired_markdown,
    t_quantile,
)
from drmoo.experiments.registry import get_experiment
from drmoo.experiments.robustness import balancing_table, preference_trace
from drmoo.experiments.run_config import RunConfig
from drmoo.experiments.variants import MethodVariant, parse_variants, run_dir_name
from drmoo.models import MultiLeNet
from drmoo.optim import available
from drmoo.store import UsageError

# ------------------------------------------------------------------------------------------ the model


@pytest.mark.parametrize("tasks", [1, 2, 3])
def test_multilenet_has_sener_and_koltuns_shapes(tasks: int) -> None:
    model = MultiLeNet([10] * tasks)
    sizes = [p.numel() for p in model.shared_parameters()]
    # conv 1->10 5x5 (250 + 10), conv 10->20 5x5 (5000 + 20), linear 320->50 (16000 + 50)
    assert sizes == [250, 10, 5000, 20, 16000, 50]
    assert sum(p.numel() for p in model.task_parameters()) == tasks * (50 * 50 + 50 + 50 * 10 + 10)
    outputs = model(torch.rand(4, 3, 28, 28))
    assert len(outputs) == tasks and all(o.shape == (4, 10) for o in outputs)
    # the three grey channels are one image: averaging them makes a 1-channel input give the same logits
    grey = torch.rand(2, 1, 28, 28)
    assert torch.allclose(model(grey.expand(-1, 3, -1, -1))[0], model(grey)[0])


def test_multilenet_refuses_what_it_cannot_take() -> None:
    with pytest.raises(ValueError, match="28 x 28 inputs"):
        MultiLeNet([10, 10], input_size=32)
    with pytest.raises(ValueError, match="num_classes"):
        MultiLeNet([])
    with pytest.raises(ValueError, match=r"expected images \[B, C, 28, 28\]"):
        MultiLeNet([10])(torch.rand(2, 3, 32, 32))
    config = RunConfig(experiment="multimnist2", method="mgda", preset="small", **{
        **PRESETS["small"]["multimnist2"], "weights": "imagenet"})
    with pytest.raises(ValueError, match="the LeNet trains from scratch"):
        build_model(config, 2)


# ------------------------------------------------------------------------------- held-out digits


def _tagged_digits(train: int, test: int) -> DigitSplits:
    """Every digit is a flat image whose value tags it: training digits 1..train, test digits 200.."""
    values = torch.arange(1, train + 1, dtype=torch.uint8)
    test_values = torch.arange(200, 200 + test, dtype=torch.uint8)
    return DigitSplits(values.view(-1, 1, 1).expand(-1, 28, 28).clone(), torch.arange(train) % 10,
                       test_values.view(-1, 1, 1).expand(-1, 28, 28).clone(), torch.arange(test) % 10,
                       source="tagged", fingerprint="tagged")


@pytest.mark.parametrize("digits", [2, 3])
def test_no_held_out_digit_is_in_a_training_composite(digits: int) -> None:
    """Test composites come only from test digits, validation composites only from held-out training digits."""
    splits = _tagged_digits(train=50, test=20)
    size = 36 if digits == 2 else 42  # no resize: the composites' pixel values are the digits' tags
    for holdout in ("test", "validation"):
        recipe = MultiMnistRecipe(digits=digits, input_size=size, seed=1, train_size=400, test_size=300,
                                  holdout=holdout)
        out = _generate(recipe, splits)
        train_values = set(out["train_images"].unique().tolist()) - {0}
        eval_values = set(out["test_images"].unique().tolist()) - {0}
        if holdout == "test":
            assert train_values <= set(range(1, 51)) and eval_values <= set(range(200, 220))
        else:
            kept = round(50 * (1 - VALIDATION_FRACTION))
            assert train_values <= set(range(1, kept + 1))  # the held-out training digits are never trained on
            assert eval_values <= set(range(kept + 1, 51))  # and the test digits are never looked at
        assert train_values and eval_values


def test_validation_holdout_of_the_embedded_digits_is_disjoint_from_training() -> None:
    index = torch.arange(5000).view(-1, 1, 1)  # each "image" holds its own index (the split is by position)
    splits = DigitSplits(index[:4000], index[:4000].flatten() % 10, index[4000:], index[4000:].flatten() % 10,
                         source="indexed", fingerprint="indexed")
    train_images, _, held_images, _, source = holdout_splits(MultiMnistRecipe(holdout="validation"), splits)
    assert train_images.shape[0] == 3200 and held_images.shape[0] == 800 and "800 held-out" in source
    train_ids, held_ids = set(train_images.flatten().tolist()), set(held_images.flatten().tolist())
    assert not train_ids & held_ids and (train_ids | held_ids) == set(range(4000))  # test digits 4000.. unused
    with pytest.raises(ValueError, match="holdout must be one of"):
        MultiMnistRecipe(holdout="train")


# --------------------------------------------------------------------------------------- variants


def test_variants_parse_into_method_settings_and_labels() -> None:
    variants = parse_variants("double-clip, mgda[pref_lr=0], mgda[solver=min_norm, lr=0.3], double-clip[max_steps=353]")
    assert variants == [
        MethodVariant("double-clip"),
        MethodVariant("mgda", {"pref_lr": 0}, {}, "mgda[pref_lr=0]"),
        MethodVariant("mgda", {"solver": "min_norm", "lr": 0.3}, {}, "mgda[solver=min_norm, lr=0.3]"),
        MethodVariant("double-clip", {}, {"max_steps": 353}, "double-clip[max_steps=353]"),
    ]
    assert [v.name for v in variants][:2] == ["double-clip", "mgda[pref_lr=0]"]
    assert run_dir_name("mgda[pref_lr=0]", 3) == "mgda_pref_lr-0-seed3"
    assert run_dir_name("mgda", 0) == "mgda-seed0"  # plain methods keep their old directories


@pytest.mark.parametrize(("text", "message"), [
    ("mgda,mgda", "more than once"),
    ("mgda[lr=1],mgda[lr=1]", "more than once"),
    ("mgda[lr]", "expected KEY=VALUE"),
    ("mgda[lr=1", "unbalanced"),
    ("mgda]", "unbalanced"),
    ("mgda[lr=1,lr=2]", "sets lr twice"),
    ("mgda[epochs=0]", r"integer in \[1, 1e9\]"),
    ("mgda[max_steps=1e20]", r"integer in \[1, 1e9\]"),
    ("mgda[lr=[1]]", "cannot read the method"),
    ("mgda[lr={1}]", "number, a bool or a word"),
    ("MGDA!", "cannot read the method"),
    ("mgda,,famo", "empty method name"),
    ("m" * 3000, "characters long"),
])
def test_bad_variants_are_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_variants(text)


# ------------------------------------------------------------------------------ paired statistics


@pytest.mark.parametrize("dof", [1, 2, 3, 4, 5, 9, 10, 29, 30, 200])
def test_t_quantile_is_scipys(dof: int) -> None:
    """Issue 28 item 7: the Student-t quantile was a hand-written bisection on a closed-form CDF; it is scipy's."""
    from scipy import stats

    assert t_quantile(0.975, dof) == float(stats.t.ppf(0.975, dof))
    for bad_dof in (0, 1.5, True):
        with pytest.raises(ValueError):
            t_quantile(0.975, bad_dof)
    with pytest.raises(ValueError):
        t_quantile(1.0, dof)


def test_the_statistics_helpers_exist_once() -> None:
    """Issue 28 item 7: mean ± std was written twice, and the t CDF, Kendall's tau_b and ranks by hand."""
    from drmoo.experiments import celeba, paired_stats, robustness, summaries

    assert robustness.mean_std is summaries.mean_std and celeba.mean_std is summaries.mean_std
    assert not hasattr(paired_stats, "student_t_cdf_two_sided")


def test_paired_differences_are_per_seed_with_a_t_interval() -> None:
    rng = random.Random(0)
    base = {seed: rng.uniform(80, 90) for seed in range(5)}
    gains = [1.0, 2.0, 0.5, -0.5, 2.0]  # the reference's advantage on each seed
    per_seed = {"ref": {0.0: {s: base[s] + gains[s] for s in base}}, "other": {0.0: dict(base)},
                "partial": {0.0: {0: base[0] + 1.0, 1: base[1] + 3.0}}}  # seed 0 tied, seed 1 lost
    rows = paired_differences(per_seed, "ref", [0.0])
    other = next(r for r in rows if r["other"] == "other")
    mean = sum(gains) / 5
    sd = math.sqrt(sum((g - mean) ** 2 for g in gains) / 4)
    half = 2.7764451051977934 * sd / math.sqrt(5)  # t_{0.975, 4}
    assert math.isclose(other["mean"], mean, abs_tol=1e-9) and other["wins"] == 4 and other["seeds"] == 5
    assert math.isclose(other["ci_low"], mean - half, abs_tol=1e-9)
    assert math.isclose(other["ci_high"], mean + half, abs_tol=1e-9)
    partial = next(r for r in rows if r["other"] == "partial")  # only the seeds both rows ran are paired
    assert partial["seeds"] == 2 and partial["ties"] == 1 and partial["wins"] == 0
    text = paired_markdown(rows, {0.0: "Clean"})
    assert "| other | +1.00 [" in text and "4/5 |" in text and "(1 tied)" in text
    with pytest.raises(ValueError, match="reference row 'nope'"):
        paired_differences(per_seed, "nope", [0.0])


def test_preference_trace_reads_the_step_log_and_refuses_damage(tmp_path: Path) -> None:
    with (tmp_path / "steps.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["step", "w_1", "w_2"])
        writer.writeheader()
        writer.writerows([{"step": 1, "w_1": 0.5, "w_2": 0.5}, {"step": 2, "w_1": 0.7, "w_2": 0.3},
                          {"step": 3, "w_1": 0.6, "w_2": 0.4}])
    trace = preference_trace(tmp_path)
    assert trace == {"final": [0.6, 0.4], "low": [0.5, 0.3], "high": [0.7, 0.5]}
    table = balancing_table({"mgda": [trace, None], "famo": [None]})
    assert "| mgda | 0.6000, 0.4000 | [0.5000, 0.7000] / [0.3000, 0.5000] |" in table
    assert "| famo | n/a | n/a |" in table
    (tmp_path / "steps.csv").write_text("step,w_1\n1,nan\n")
    assert preference_trace(tmp_path) is None
    (tmp_path / "steps.csv").write_text("step,w_1\n1,garbage\n")
    assert preference_trace(tmp_path) is None
    assert preference_trace(tmp_path / "missing") is None


# ------------------------------------------------------------------------------- the small preset


@pytest.mark.parametrize("experiment", ["multimnist2", "multimnist3"])
def test_small_preset_uses_the_swept_learning_rates_and_the_papers_dr_settings(experiment: str) -> None:
    assert set(SMALL_LR) == {"multimnist2", "multimnist3", "multimnist4", "multimnist9"}  # 4, 9: the 3-digit rates
    assert set(SMALL_LR[experiment]) == set(available())
    registered = get_experiment(experiment).method_hparams
    for method in available():
        hparams = method_hparams(method, preset="small", experiment=experiment)
        assert hparams["lr"] == SMALL_LR[experiment][method]
        assert registered(method, None, preset="small") == hparams  # the CLI's lookup, by experiment
        paper = method_hparams(method)
        own = {"lr", "ema"} if method == "moco" else {"lr"}  # MoCo's tracking weight was swept too
        assert {k: v for k, v in hparams.items() if k not in own} == {k: v for k, v in paper.items() if k not in own}
        assert method_hparams(method, {"lr": 0.123}, preset="small", experiment=experiment)["lr"] == 0.123
    assert PRESETS["small"]["multimnist2"]["model"] == "lenet" and PRESETS["small"]["multimnist3"]["input_size"] == 28
    moco = method_hparams("moco", preset="small", experiment=experiment)
    assert moco["ema"] == SMALL_MOCO_EMA[experiment] != method_hparams("moco")["ema"]
    assert method_hparams("moco", {"ema": 0.95}, preset="small", experiment=experiment)["ema"] == 0.95


def test_small_preset_runs_through_compare_with_variants(tmp_path: Path) -> None:
    """One step of the small preset: variants as rows, paired differences, the balancing table, the LeNet."""
    out = tmp_path / "compare"
    args = ["compare", "--experiment", "multimnist2", "--preset", "small", "--methods",
            "double-clip,mgda,mgda[pref_lr=0],mgda[solver=min_norm]", "--seeds", "0,1", "--max-steps", "1",
            "--train-size", "64", "--test-size", "32", "--batch-size", "16", "--eps", "0,0.1",
            "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--quiet", "--device", "cpu"]
    assert main([*args, "--jobs", "2"]) == 0  # two worker processes
    first = (out / "table.md").read_text()
    assert main(args) == 0  # one process: every run is reused, the same table comes out
    assert (out / "table.md").read_text().split("wall time")[1].split("\n", 1)[1] == first.split("wall time")[1].split(
        "\n", 1)[1]
    table = (out / "table.md").read_text()
    assert "model `lenet`, 28px inputs" in table
    assert re.search(r"wall time of this call \d+s; the 8 runs' optimizer steps [\d,]+s in all", table)
    assert "| mgda[pref_lr=0] |" in table and "| mgda[solver=min_norm] |" in table
    assert "Paired differences, double-clip minus each row" in table
    assert re.search(r"\| mgda \| [+-]\d+\.\d\d \[[+-]\d+\.\d\d, [+-]\d+\.\d\d\] \d/2( \(\d tied\))? \|", table)
    assert "What the balancing did" in table and "| mgda[pref_lr=0] | 0.5000, 0.5000 |" in table
    config = json.loads((out / "mgda_pref_lr-0-seed1" / "config.json").read_text())
    assert config["label"] == "mgda[pref_lr=0]" and config["hparams"]["pref_lr"] == 0
    assert config["hparams"]["lr"] == SMALL_LR["multimnist2"]["mgda"] and config["model"] == "lenet"
    report = json.loads((out / "mgda_solver-min_norm-seed0" / "eval.json").read_text())
    assert report["label"] == "mgda[solver=min_norm]" and report["model"] == "lenet"
    paired = list(csv.DictReader((out / "paired.csv").open()))
    assert {row["other"] for row in paired} == {"mgda", "mgda[pref_lr=0]", "mgda[solver=min_norm]"}
    assert len(paired) == 3 * 2


def test_compare_refuses_repeated_seeds_and_rows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = ["compare", "--experiment", "multimnist2", "--preset", "small", "--out", str(tmp_path / "o"), "--quiet"]
    assert main([*base, "--methods", "mgda", "--seeds", "0,0"]) == 2
    assert "repeats a seed" in capsys.readouterr().err
    assert main([*base, "--methods", "mgda,mgda"]) == 2
    assert "more than once" in capsys.readouterr().err
    assert main([*base, "--methods", "mgda[nope=1]"]) == 2
    assert "unknown hyperparameter(s) nope for mgda" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_run_config_checks_model_split_and_label() -> None:
    good = {"experiment": "multimnist2", "method": "mgda", "preset": "small"}
    for field, value, message in (("model", "vgg", "--model"), ("eval_split", "train", "--eval-split"),
                                  ("label", "a/b", "path separators")):
        with pytest.raises(UsageError, match=message):
            RunConfig(**good, **{field: value}).validate()
    assert RunConfig(**good, label="mgda[pref_lr=0]").name == "mgda[pref_lr=0]"
    assert RunConfig(**good).name == "mgda"


RESULTS = Path(__file__).resolve().parents[2] / "results"
SMALL_RESULTS = RESULTS / "multimnist2-small"


def _sweep_winners(table: Path, keys: tuple[str, ...]) -> dict[str, tuple[float, ...]]:
    """The rule of the small preset's sweeps: per method, the setting (the variant's ``keys``) with the
    highest mean clean validation accuracy, ties to the smaller setting.  Checks that every run of the
    sweep was evaluated on the validation split of the small preset."""
    if not table.is_file():
        pytest.fail(f"{table} is missing: the small preset's settings must come with their sweep")
    best: dict[str, tuple[tuple[float, ...], float]] = {}
    with table.open(newline="") as handle:
        for row in csv.DictReader(handle):
            if float(row["eps"]) != 0.0:
                continue
            variant = parse_variants(row["method"])[0]
            setting, accuracy = tuple(float(variant.hparams[key]) for key in keys), float(row["mean_acc"])
            known = best.get(variant.method)
            if known is None or accuracy > known[1] or (accuracy == known[1] and setting < known[0]):
                best[variant.method] = (setting, accuracy)
    configs = [json.loads(path.read_text()) for path in table.parent.glob("*/config.json")]
    assert configs and all(c["eval_split"] == "validation" and c["preset"] == "small" for c in configs)
    return {method: setting for method, (setting, _) in best.items()}


def _clean_sweep_rows(table: Path) -> tuple[list[tuple[MethodVariant, int, float]], list[dict]]:
    """(variant, seeds, mean clean validation accuracy) of each row of a sweep's table.csv, and the
    config.json of each of its runs, checking that every run was evaluated on the validation split of
    the small preset."""
    if not table.is_file():
        pytest.fail(f"{table} is missing: the small preset's settings must come with their sweep")
    with table.open(newline="") as handle:
        rows = [(parse_variants(row["method"])[0], int(row["seeds"]), float(row["mean_acc"]))
                for row in csv.DictReader(handle) if float(row["eps"]) == 0.0]
    configs = [json.loads(path.read_text()) for path in table.parent.glob("*/config.json")]
    assert configs and all(c["eval_split"] == "validation" and c["preset"] == "small" for c in configs)
    return rows, configs


def _clean_accuracy_by_rate(table: Path, seeds: set[int]) -> tuple[dict[str, dict[float, float]], list[dict]]:
    """method -> trunk rate -> mean clean validation accuracy of one sweep stage, run on ``seeds``; and
    its runs' configs."""
    rows, configs = _clean_sweep_rows(table)
    accuracy: dict[str, dict[float, float]] = {}
    for variant, count, mean in rows:
        assert count == len(seeds), (variant, count)
        accuracy.setdefault(variant.method, {})[float(variant.hparams["lr"])] = mean
    assert {c["seed"] for c in configs} == seeds
    return accuracy, configs


def _two_stage_winners(sweep: Path, excluded: set[str]) -> tuple[dict[str, float], list[dict]]:
    """The rule of the small preset's learning-rate sweeps, fixed before the second stage ran.  Stage 1
    (``sweep/table.csv``, seed 0): every rate of the grid.  Stage 2 (``sweep/runoff/table.csv``, seeds
    1 and 2): each method's two best stage-1 rates (ties to the smaller).  Winner: the higher mean over
    seeds 0-2, ties to the smaller rate.  Checks that stage 2 ran exactly those two rates.  Also returns
    the configs of both stages' runs."""
    first, first_configs = _clean_accuracy_by_rate(sweep / "table.csv", {0})
    second, second_configs = _clean_accuracy_by_rate(sweep / "runoff" / "table.csv", {1, 2})
    assert set(second) == set(first) - excluded
    winners: dict[str, float] = {}
    for method, rates in second.items():
        finalists = sorted(first[method], key=lambda lr: (-first[method][lr], lr))[:2]
        assert sorted(rates) == sorted(finalists), method
        three_seed_mean = {lr: (first[method][lr] + 2 * rates[lr]) / 3 for lr in finalists}
        winners[method] = max(finalists, key=lambda lr: (three_seed_mean[lr], -lr))
    return winners, first_configs + second_configs


def _sweep_winners(table: Path, keys: tuple[str, ...]) -> dict[str, tuple[float, ...]]:
    """The rule of MoCo's own 3-seed sweep: per method, the setting (the variant's ``keys``) with the
    highest mean clean validation accuracy, ties to the smaller setting."""
    best: dict[str, tuple[tuple[float, ...], float]] = {}
    for variant, _, accuracy in _clean_sweep_rows(table)[0]:
        setting = tuple(float(variant.hparams[key]) for key in keys)
        known = best.get(variant.method)
        if known is None or accuracy > known[1] or (accuracy == known[1] and setting < known[0]):
            best[variant.method] = (setting, accuracy)
    return {method: setting for method, (setting, _) in best.items()}


@pytest.mark.parametrize("experiment", ["multimnist2", "multimnist3"])
def test_small_preset_learning_rates_are_the_committed_sweeps_winners(experiment: str) -> None:
    """SMALL_LR is what the two-stage rule picks from each experiment's committed validation sweep (on
    2 digits every method but MoCo, whose rate comes from its own sweep below)."""
    sweep = RESULTS / f"{experiment}-small" / "lr-sweep"
    own_sweep = {"moco"} if experiment == "multimnist2" else set()
    winners, configs = _two_stage_winners(sweep, own_sweep)
    assert winners == {method: lr for method, lr in SMALL_LR[experiment].items() if method not in own_sweep}
    assert set(winners) | own_sweep == set(SMALL_LR[experiment])
    assert {c["experiment"] for c in configs} == {experiment}
    if experiment == "multimnist3":  # swept with the preset's MoCo tracking weight
        assert {c["hparams"]["ema"] for c in configs if c["method"] == "moco"} == {SMALL_MOCO_EMA[experiment]}


def test_small_preset_moco_setting_is_its_sweeps_winner() -> None:
    """MoCo's (ema, lr) is the winner of its 3-seed sweep, and that sweep ran every setting on 3 seeds."""
    table = SMALL_RESULTS / "moco-sweep" / "table.csv"
    assert _sweep_winners(table, ("ema", "lr")) == {
        "moco": (SMALL_MOCO_EMA["multimnist2"], SMALL_LR["multimnist2"]["moco"])}
    with table.open(newline="") as handle:
        assert {row["seeds"] for row in csv.DictReader(handle)} == {"3"}


def test_robustness_figure_draws_a_std_band_over_seeds() -> None:
    """Issue 28 item 6: robustness.png showed no spread over seeds; each row's mean now lies in a ±1 std band."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    from drmoo.experiments.robustness import robustness_figure

    rows = [{"method": "mgda", "eps": eps, "mean_acc": mean, "std_acc": std, "seeds": 3}
            for eps, mean, std in ((0.0, 90.0, 1.0), (0.1, 70.0, 2.0))]
    rows += [{"method": "modo", "eps": eps, "mean_acc": 80.0, "std_acc": 0.0, "seeds": 1} for eps in (0.0, 0.1)]
    figure = robustness_figure(rows, "test")
    try:
        (axis,) = figure.axes
        bands = [c for c in axis.collections if isinstance(c, PolyCollection)]
        assert len(bands) == 1  # mgda's; modo ran one seed
        low, high = bands[0].get_paths()[0].vertices[:, 1].min(), bands[0].get_paths()[0].vertices[:, 1].max()
        assert (low, high) == (68.0, 91.0)
        assert [line.get_label() for line in axis.lines] == ["mgda", "modo"]
        assert "band ±1 std" in axis.get_title()
    finally:
        plt.close(figure)


def test_time_text_sums_the_runs_own_step_times(tmp_path: Path) -> None:
    """A reused run still counts its training; a run without a step log leaves only the call's time."""
    import time

    from drmoo.experiments.robustness import time_text

    for name, steps in (("a", "0.25\n0.5"), ("b", "1.25")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "steps.csv").write_text("step,step_s\n" + "\n".join(
            f"{i},{s}" for i, s in enumerate(steps.split("\n"))) + "\n")
    text = time_text(tmp_path, ["a", "b"], time.perf_counter())
    assert text == "wall time of this call 0s; the 2 runs' optimizer steps 2s in all"
    (tmp_path / "c").mkdir()
    assert time_text(tmp_path, ["a", "c"], time.perf_counter()) == "wall time of this call 0s"
