"""The synthetic experiment and its command line."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from drmoo.cli import EXIT_DIVERGED, EXIT_USAGE, main
from drmoo.experiments.problems import make_linear_problem


def test_linear_problem_follows_the_recipe() -> None:
    problem = make_linear_problem(seed=0)
    assert problem.inputs.shape == (6000, 10) and problem.targets.shape == (6000, 3)
    assert problem.num_tasks == 3
    # Same seed, same data; another seed, other data.
    assert torch.equal(make_linear_problem(seed=0).targets, problem.targets)
    assert not torch.equal(make_linear_problem(seed=1).targets, problem.targets)
    # Least-squares residual variances recover the noise variances 0.04, 0.36, 0.25.
    solution = torch.linalg.lstsq(problem.inputs, problem.targets).solution
    residual_var = (problem.targets - problem.inputs @ solution).var(0)
    torch.testing.assert_close(residual_var, torch.tensor([0.04, 0.36, 0.25]), rtol=0.08, atol=0)
    # The recipe's correlations: theta2* ~ -0.2 theta1*, theta3* ~ 0.5 theta1*.
    cosine = torch.nn.functional.cosine_similarity
    assert float(cosine(solution[:, 0], solution[:, 1], dim=0)) < 0
    assert float(cosine(solution[:, 0], solution[:, 2], dim=0)) > 0
    losses = problem.loss_fn(problem.fresh_params(), problem.inputs[:4], problem.targets[:4])
    assert losses.shape == (4, 3) and losses.requires_grad


def test_cli_writes_all_outputs_and_reuses_finished_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    args = ["synthetic", "--problem", "linear", "--methods", "double-clip,double-loop", "--steps", "30",
            "--seed", "0", "--out", str(out), "--quiet"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| double-clip |" in printed and "| double-loop |" in printed
    for name in ("metrics.csv", "summary.json", "summary.md", "convergence.csv", "convergence.png"):
        assert (out / name).stat().st_size > 0, name
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert len(rows) == 60
    assert {"method", "iteration", "samples", "balanced_grad_norm", "dual_obj_1", "w_3", "eta_2"} <= set(rows[0])
    loop_rows = [r for r in rows if r["method"] == "double-loop"]
    assert int(loop_rows[0]["samples"]) == (20 + 3) * 256  # D = 20 inner draws + 3 outer draws
    summary = json.loads((out / "summary.json").read_text())
    clip = summary["methods"]["double-clip"]
    assert clip["samples_per_iteration"] == 512
    assert clip["hparams"]["c2"] == 0.1 and clip["hparams"]["lr"] == 0.01
    assert clip["final_balanced_grad_norm"]["mean"] < clip["first_balanced_grad_norm"]["mean"]
    assert (out / "convergence.png").read_bytes()[:4] == b"\x89PNG"
    # the final parameters' per-sample losses: the tail and the worst cases are at least the mean
    tail = clip["final_loss_metrics"]
    assert clip["final_loss_metrics_seeds"] == 1
    assert tail["cvar_0.05"]["mean"] >= tail["cvar_0.1"]["mean"] >= tail["mean_loss"]["mean"] > 0
    assert tail["robust_chi2_0.1"]["mean"] >= tail["robust_chi2_0.8"]["mean"] >= tail["mean_loss"]["mean"]
    assert tail["robust_run"]["mean"] >= tail["robust_chi2_0.8"]["mean"]  # the run's lambda 0.6 < 0.8
    assert "cvar_0.05" in (out / "summary.md").read_text()

    # A second invocation with the same settings reuses the finished runs bit for bit.
    before = (out / "metrics.csv").read_text()
    stamp = (out / "runs" / "double-clip-seed0.csv").stat().st_mtime_ns
    assert main(args) == 0
    assert (out / "runs" / "double-clip-seed0.csv").stat().st_mtime_ns == stamp
    assert (out / "metrics.csv").read_text() == before
    assert json.loads((out / "summary.json").read_text())["methods"]["double-clip"]["final_loss_metrics"] == tail


def test_cli_overrides_and_several_seeds(tmp_path: Path) -> None:
    out = tmp_path / "seeds"
    assert main(["synthetic", "--methods", "double-clip", "--seeds", "0,1", "--steps", "5", "--hp", "lam=0.9",
                 "--hp", "divergence=cvar_smooth(0.5)", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == [0, 1]
    assert summary["methods"]["double-clip"]["hparams"]["lam"] == 0.9
    assert summary["methods"]["double-clip"]["hparams"]["divergence"] == "cvar_smooth(0.5)"
    curves = list(csv.DictReader((out / "convergence.csv").open()))
    assert len(curves) == 5 and all(int(c["seeds"]) == 2 for c in curves)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--methods", "nope"], "unknown method"),
        (["--problem", "cubic"], "invalid choice: 'cubic'"),
        (["--hp", "lam=-1"], "lam must be finite and > 0"),
        # a run that reaches a non-finite step diverged: its own exit status, not a refused setting's
        (["--hp", "divergence=kl", "--hp", "lam=0.1"], "kl weights exp((loss - eta)/lam) overflow"),
    ],
)
def test_cli_errors_are_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture, args: list, message: str) -> None:
    try:
        code = main(["synthetic", "--steps", "2", "--out", str(tmp_path / "x"), "--quiet", *args])
    except SystemExit as exit_:  # argparse refuses an invalid choice itself, with the same one line and status
        code = exit_.code
    assert code == (EXIT_DIVERGED if "overflow" in message else EXIT_USAGE)
    assert message in capsys.readouterr().err
