"""What the committed small-preset results (issue 21) rest on, checked against today's code.

* The committed runs still describe the code: the first steps of a committed run, retrained now
  with the very command the README gives, log the same values as its committed ``steps.csv``.
* The 3-digit small preset runs through ``compare`` (a 1-step smoke test, as for 2 digits), and
  ``drmoo report`` of such a comparison carries its paired-differences table.
* The pairing claim: runs of different methods with one seed start from the same weights and
  draw the same batches.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest
import torch

from drmoo import store
from drmoo.cli import main
from drmoo.optim import available

ROOT = Path(__file__).resolve().parents[2]
SMALL_RESULTS = ROOT / "results" / "multimnist2-small"

# ---------------------------------------------------------------- committed runs reproduce
REPRODUCED_STEPS = 4
# steps.csv holds float32 values.  The committed runs may have used another kernel backend or
# thread count, which sums in another order: a sum of n float32 terms then moves by up to about
# n unit roundoffs (Higham's gamma_n), i.e. a few ulps per value, compounded over the steps
# (measured here: at most 8 ulps after 4 steps).  256 ulps of the committed value (2^-15 to
# 2^-16 relative) allow that 30-fold, while a changed setting is far outside: a learning rate
# 1 % off moves dual_objective and eta by 1e-3 to 1e-2 relative (10^4 ulps and more) at step 1.
ULPS = 256
CHECKED_COLUMNS = ("dual_objective", "w_", "eta_", "balanced_grad_norm")


def _float32_ulp(value: float) -> float:
    return float(torch.tensor(abs(value), dtype=torch.float32).nextafter(torch.tensor(math.inf)).item()
                 - abs(torch.tensor(value, dtype=torch.float32).item()))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.mark.parametrize("run", ["double-clip-seed0", "mgda-seed0"])
def test_a_committed_small_run_reproduces_its_first_steps(run: str, tmp_path: Path) -> None:
    committed = SMALL_RESULTS / run
    config = json.loads((committed / "config.json").read_text())
    # The README's command for this run (its preset supplies everything else), stopped early.
    argv = ["train", "--experiment", config["experiment"], "--method", config["method"], "--preset",
            config["preset"], "--seed", str(config["seed"]), "--device", "cpu", "--quiet",
            "--max-steps", str(REPRODUCED_STEPS), "--cache-dir", str(tmp_path / "cache"),
            "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    today = json.loads((tmp_path / "run" / "config.json").read_text())
    # Today's preset gives the committed run's settings (a changed learning rate, epoch count,
    # data size or hyperparameter would make the committed results describe another command).
    assert {**today, "max_steps": None, "cache_dir": None} == config
    new_rows = list(csv.DictReader((tmp_path / "run" / "steps.csv").open()))
    old_rows = list(csv.DictReader((committed / "steps.csv").open()))[:REPRODUCED_STEPS]
    assert len(new_rows) == len(old_rows) == REPRODUCED_STEPS
    compared = 0
    for new, old in zip(new_rows, old_rows):
        assert (new["step"], new["samples"]) == (old["step"], old["samples"])
        for column in [name for name in old if name.startswith(CHECKED_COLUMNS)]:
            expected, got = float(old[column]), float(new[column])
            assert abs(got - expected) <= ULPS * _float32_ulp(expected), (
                f"{run} step {old['step']} {column}: committed {expected!r}, today {got!r}")
            compared += 1
    assert compared == REPRODUCED_STEPS * 6  # dual objective, grad norm, w and eta of both tasks


def test_the_ulp_helper() -> None:
    assert _float32_ulp(1.0) == 2.0 ** -23 and _float32_ulp(0.5) == 2.0 ** -24 and _float32_ulp(-3.0) == 2.0 ** -22


# ---------------------------------------------------------------- 3 digits: compare and report
TINY = ["--train-size", "64", "--test-size", "32", "--batch-size", "16", "--quiet", "--device", "cpu"]


@pytest.fixture(scope="module")
def three_digit_comparison(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One step of the 3-digit small preset, two methods, two seeds (so paired differences exist)."""
    out = tmp_path_factory.mktemp("compare3") / "compare"
    assert main(["compare", "--experiment", "multimnist3", "--preset", "small", "--methods", "double-clip,mgda",
                 "--seeds", "0,1", "--max-steps", "1", "--eps", "0,0.1", "--out", str(out),
                 "--cache-dir", str(out.parent / "cache"), *TINY]) == 0
    return out


def test_the_three_digit_small_preset_runs_through_compare(three_digit_comparison: Path) -> None:
    table = (three_digit_comparison / "table.md").read_text()
    assert "model `lenet`, 28px inputs" in table
    config = json.loads((three_digit_comparison / "mgda-seed1" / "config.json").read_text())
    assert (config["experiment"], config["preset"], config["model"], config["input_size"]) == (
        "multimnist3", "small", "lenet", 28)
    report = json.loads((three_digit_comparison / "double-clip-seed0" / "eval.json").read_text())
    assert report["iterations"] == 1 and report["experiment"] == "multimnist3"
    assert [result["eps"] for result in report["results"]] == [0.0, 0.1]
    assert all(len(result["task_acc"]) == 3 for result in report["results"])  # one accuracy per digit


def test_drmoo_report_of_a_small_comparison_has_the_paired_differences(three_digit_comparison: Path,
                                                                      tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    assert main(["report", "--runs", str(three_digit_comparison), "--out", str(out)]) == 0
    report = out.read_text()
    assert "Paired differences, double-clip minus each row" in report
    # one row per baseline: mean difference [95 % interval] and wins out of the 2 seeds
    row = r"\| mgda \| [+-]\d+\.\d\d \[[+-]\d+\.\d\d, [+-]\d+\.\d\d\] \d/2( \(\d tied\))? \|"
    assert re.search(row, report), report


# ---------------------------------------------------------------- pairing: same seed, same start
TINY_LR = "1e-300"  # every update (lr x gradient, about 1e-300) rounds to nothing in the float32 weights


def test_every_method_starts_from_the_same_weights_and_batches_for_one_seed(tmp_path: Path) -> None:
    """A 1-step run whose updates round to zero keeps its initial weights in its checkpoint, beside its
    data stream: both must be the same for all eight methods with one seed, and differ for another seed."""
    def start(method: str, seed: int) -> dict:
        run = tmp_path / f"{method}-{seed}"
        assert main(["train", "--experiment", "multimnist2", "--preset", "small", "--method", method, "--seed",
                     str(seed), "--lr", TINY_LR, "--head-lr", TINY_LR, "--max-steps", "1", "--out", str(run),
                     "--cache-dir", str(tmp_path / "cache"), *TINY, "--train-size", "256"]) == 0
        state = store.read_checkpoint_file(run / "checkpoint.pt").state
        # one pass of 16 batches: no method's first step (Double-Loop and SDMGrad draw several batches)
        # reaches the reshuffle, so the saved permutation is the one every method started from
        assert state["stream"]["samples_drawn"] < 256, method
        return state

    reference = start("double-clip", 0)
    assert reference["stream"]["samples_drawn"] > 0
    for method in sorted(set(available()) - {"double-clip"}):
        state = start(method, 0)
        assert state["model"].keys() == reference["model"].keys()
        for name, tensor in reference["model"].items():
            assert torch.equal(state["model"][name], tensor), f"{method}: {name} starts elsewhere"
        assert torch.equal(state["stream"]["order"], reference["stream"]["order"]), method
    other_seed = start("double-clip", 1)
    assert not any(torch.equal(other_seed["model"][name], tensor) for name, tensor in reference["model"].items())
    assert not torch.equal(other_seed["stream"]["order"], reference["stream"]["order"])
