"""Multi-MNIST-k experiments (multimnist4, multimnist9): registered, a small preset only, the MultiLeNet with k
heads, and drmoo train / eval / compare end to end on shrunk sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drmoo.cli import main
from drmoo.experiments import multimnist
from drmoo.experiments.multimnist import (
    DIGIT_COUNTS,
    EXPERIMENTS,
    GRID_EXPERIMENTS,
    build_model,
    method_hparams,
    recipe_of,
)
from drmoo.experiments.registry import get_experiment
from drmoo.experiments.run_config import RunConfig
from drmoo.models import MultiLeNet
from drmoo.optim import available


def test_registered_with_the_small_preset_only() -> None:
    assert GRID_EXPERIMENTS == {"multimnist4": 4, "multimnist9": 9}
    assert EXPERIMENTS == {"multimnist2": 2, "multimnist3": 3}  # the paper's two (bench-iter) are unchanged
    assert DIGIT_COUNTS == {**EXPERIMENTS, **GRID_EXPERIMENTS}
    for name, digits in GRID_EXPERIMENTS.items():
        experiment = get_experiment(name)
        assert set(experiment.presets) == {"small"}
        small = experiment.presets["small"]
        assert small["model"] == "lenet" and small["input_size"] == 28 and small["weights"] == "none"
        assert small["train_size"] == 12000 and small["test_size"] == 2000 and small["batch_size"] == 256
        assert small["epochs"] == multimnist.GRID_SMALL_EPOCHS[name]
        config = RunConfig(experiment=name, method="mgda", preset="small", **small)
        recipe = recipe_of(config)
        assert recipe.digits == digits and recipe.shift == 0 and recipe.canvas == {4: 42, 9: 56}[digits]
        model = build_model(config, recipe.digits)
        assert isinstance(model, MultiLeNet) and len(model.heads) == digits
        logits = model(torch.zeros(2, 3, 28, 28))
        assert len(logits) == digits and all(z.shape == (2, 10) for z in logits)
    # the 2/3-digit presets are untouched by the new entries
    assert set(get_experiment("multimnist2").presets) == {"paper", "medium", "small", "quick"}


def test_method_settings_borrow_the_three_digit_rates() -> None:
    for name in GRID_EXPERIMENTS:
        for method in available():
            mine = method_hparams(method, preset="small", experiment=name)
            three = method_hparams(method, preset="small", experiment="multimnist3")
            assert mine == three, (name, method)
            assert mine["lr"] == multimnist.SMALL_LR["multimnist3"][method]
    assert method_hparams("moco", preset="small", experiment="multimnist9")["ema"] == 0.9
    assert method_hparams("mgda", experiment="multimnist4")["lr"] == 1e-4  # no preset: the paper's
    with pytest.raises(ValueError, match="valid choices: multimnist2, multimnist3, multimnist4, multimnist9"):
        method_hparams("mgda", experiment="multimnist5")


SHRUNK = ["--preset", "small", "--max-steps", "3", "--train-size", "48", "--test-size", "20", "--batch-size", "16",
          "--device", "cpu", "--quiet"]


@pytest.mark.parametrize("name", ["multimnist4", "multimnist9"])
def test_train_then_eval_from_the_command_line(name: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    assert main(["train", "--experiment", name, "--method", "mgda", "--cache-dir", str(tmp_path / "cache"),
                 "--out", str(run), *SHRUNK]) == 0
    config = json.loads((run / "config.json").read_text())
    assert config["experiment"] == name and config["model"] == "lenet" and config["hparams"]["lr"] == 0.3
    digits = GRID_EXPERIMENTS[name]
    (cached,) = (tmp_path / "cache" / "multimnist").glob("*.pt")
    assert cached.name.startswith(f"{digits}digit-28px-")
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--eps", "0,0.05", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert f"| task {digits} | mean |" in printed and f"({name}, mgda, seed 0)" in printed
    report = json.loads((run / "eval.json").read_text())
    assert report["test_samples"] == 20 and [len(r["task_acc"]) for r in report["results"]] == [digits, digits]


def test_compare_two_methods_and_a_missing_preset(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cmp"
    assert main(["compare", "--experiment", "multimnist4", "--methods", "mgda,double-clip", "--eps", "0,0.01",
                 "--cache-dir", str(tmp_path / "cache"), "--out", str(out), *SHRUNK]) == 0
    table = (out / "table.md").read_text()
    assert "### multimnist4: accuracy (%) under FGSM" in table and "| mgda |" in table and "| double-clip |" in table
    assert "Clean (paper)" not in table  # no paper reference for a benchmark the paper does not have
    capsys.readouterr()
    assert main(["train", "--experiment", "multimnist9", "--preset", "quick", "--out", str(tmp_path / "q")]) == 2
    assert "unknown preset 'quick'; valid choices: small" in capsys.readouterr().err
