"""drmoo ablate: the paper's grids, outputs, resumability and refusals (App. F)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from drmoo.cli import main
from drmoo.experiments import synthetic
from drmoo.experiments.ablations import GRIDS, AblationConfig, grid_points

TINY_IMAGES = ["--input-size", "16", "--train-size", "48", "--test-size", "16", "--batch-size", "16"]


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def _assert_outputs(out: Path, what: str, rows: int) -> list[dict[str, str]]:
    table = _rows(out / f"ablation-{what}.csv")
    assert len(table) == rows
    assert (out / f"ablation-{what}.png").read_bytes()[:4] == b"\x89PNG"
    assert "| value |" in (out / f"ablation-{what}.md").read_text() or "| method |" in (
        out / f"ablation-{what}.md").read_text()
    manifest = json.loads((out / f"ablation-{what}.json").read_text())
    assert manifest["kind"] == "ablation" and manifest["what"] == what and manifest["backend"]
    return table


@pytest.fixture
def fast_point_plots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each grid point's own convergence.png (drawn by run_synthetic) costs ~1 s of matplotlib on this
    machine; the matrix tests below check the ablation's outputs, so they stub those per-point plots."""
    monkeypatch.setattr(synthetic, "plot_convergence", lambda curves, path, title: Path(path).write_bytes(b"png"))


def test_paper_grids_and_fixed_settings() -> None:
    lam = grid_points(AblationConfig("lambda", "linear"))
    assert [p.value for p in lam] == [0.4, 0.8, 1.6] and {p.method for p in lam} == {"double-clip"}
    batch = grid_points(AblationConfig("batch", "wine"))
    assert [p.batch_size for p in batch] == [32, 64, 128, 256, 512, 1024]
    assert batch[0].overrides == {"lr": 1e-2, "pref_lr": 1e-2, "c1": 1.0, "f1": 1.0, "c2": 0.5, "f2": 0.5,
                                  "rho": 1e-5}
    inner = {e: grid_points(AblationConfig("inner", e)) for e in ("linear", "wine")}
    assert [p.overrides["inner_steps"] for p in inner["linear"]] == [5, 10, 15, 20, 25]
    assert inner["linear"][0].overrides == {"lr": 5e-5, "pref_lr": 5e-5, "dual_lr": 1e-3, "rho": 1e-5,
                                            "inner_steps": 5}
    assert inner["wine"][0].overrides == {"lr": 1e-3, "pref_lr": 6e-4, "dual_lr": 1e-3, "rho": 1e-6,
                                          "inner_steps": 5}
    lr = grid_points(AblationConfig("lr", "linear"))
    clip = [p for p in lr if p.method == "double-clip"]
    loop = [p for p in lr if p.method == "double-loop"]
    assert [p.value for p in clip] == list(GRIDS["lr-double-clip"]) == [1e-3, 5e-3, 1e-2, 5e-2, 1e-1]
    assert [p.value for p in loop] == [1e-5, 5e-5, 5e-4, 1e-3, 5e-3, 1e-2]
    assert loop[0].overrides == {"rho": 1e-5, "dual_lr": 1e-3, "lr": 1e-5, "pref_lr": 1e-5}
    assert {p.method for p in lr} == {"double-clip", "double-loop", "mgda", "modo", "moco", "sdmgrad"}
    assert len(lr) == 5 + 5 * 6


def test_lambda_linear_end_to_end_and_rerun_skips(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "lam"
    args = ["ablate", "--what", "lambda", "--experiment", "linear", "--steps", "25", "--out", str(out), "--quiet"]
    assert main(args) == 0
    assert "| 0.8 | double-clip | ok |" in capsys.readouterr().out
    rows = _assert_outputs(out, "lambda", 3)
    assert [float(r["value"]) for r in rows] == [0.4, 0.8, 1.6]
    assert all(r["status"] == "ok" and int(r["steps"]) == 25 and int(r["batch_size"]) == 256 for r in rows)
    # The curves behind the PNG: one line per lambda, every iteration.
    curves = _rows(out / "ablation-lambda-curves.csv")
    assert {c["method"] for c in curves} == {"λ=0.4", "λ=0.8", "λ=1.6"} and len(curves) == 75
    summary = json.loads((out / "lam1.6" / "summary.json").read_text())
    assert summary["methods"]["double-clip"]["hparams"]["lam"] == 1.6

    stamps = {p.name: (p / "metrics.csv").stat().st_mtime_ns for p in out.iterdir() if p.is_dir()}
    assert main(args) == 0  # finished values are skipped
    assert {p: (out / p / "metrics.csv").stat().st_mtime_ns for p in stamps} == stamps
    # Other settings for a finished point: refused (a rerun never replaces finished work), every point kept.
    assert main([*args[:-5], "--steps", "26", "--grid", "0.4", "--out", str(out), "--quiet"]) == 2
    assert "steps 25 there, 26 now" in capsys.readouterr().err
    assert {p: (out / p / "metrics.csv").stat().st_mtime_ns for p in stamps} == stamps


def test_every_ablation_on_linear_with_the_paper_grids(tmp_path: Path, fast_point_plots: None) -> None:
    common = ["--experiment", "linear", "--steps", "3", "--quiet"]

    assert main(["ablate", "--what", "batch", "--out", str(tmp_path / "batch"), *common]) == 0
    rows = _assert_outputs(tmp_path / "batch", "batch", 6)
    # N1 = N2 = B: Double-Clip draws two batches per iteration.
    assert [int(r["samples_per_iteration"]) for r in rows] == [2 * b for b in (32, 64, 128, 256, 512, 1024)]

    assert main(["ablate", "--what", "inner", "--out", str(tmp_path / "inner"), *common]) == 0
    rows = _assert_outputs(tmp_path / "inner", "inner", 5)
    assert [int(r["samples_per_iteration"]) for r in rows] == [(d + 3) * 256 for d in (5, 10, 15, 20, 25)]

    assert main(["ablate", "--what", "lr", "--methods", "double-clip,mgda", "--out", str(tmp_path / "lr"),
                 *common]) == 0
    rows = _assert_outputs(tmp_path / "lr", "lr", 5 + 6)
    assert {r["status"] for r in rows} <= {"ok", "diverged"}
    assert [float(r["value"]) for r in rows if r["method"] == "mgda"] == [1e-5, 5e-5, 5e-4, 1e-3, 5e-3, 1e-2]
    assert [float(r["value"]) for r in rows if r["method"] == "double-clip"] == [1e-3, 5e-3, 1e-2, 5e-2, 1e-1]


def test_every_ablation_on_wine(tmp_path: Path, wine_csv: Path, fast_point_plots: None) -> None:
    # The grids are those of linear (checked above); two values each keep the CSV parsing per point cheap.
    common = ["--experiment", "wine", "--data-root", str(wine_csv), "--steps", "3", "--quiet"]
    for what, grid, rows in (("batch", "32,1024", 2), ("inner", "5,25", 2), ("lambda", "0.8", 1)):
        assert main(["ablate", "--what", what, "--grid", grid, "--out", str(tmp_path / what), *common]) == 0
        _assert_outputs(tmp_path / what, what, rows)
    assert main(["ablate", "--what", "lr", "--methods", "double-loop,double-clip", "--grid", "1e-3,1e-2",
                 "--out", str(tmp_path / "lr"), *common]) == 0
    rows = _assert_outputs(tmp_path / "lr", "lr", 4)
    loop = json.loads((tmp_path / "lr" / "double-loop-lr0.01" / "summary.json").read_text())
    hparams = loop["methods"]["double-loop"]["hparams"]
    assert hparams["lr"] == hparams["pref_lr"] == 1e-2 and hparams["dual_lr"] == 1e-3 and hparams["rho"] == 1e-5
    assert hparams["inner_steps"] == 15  # the wine preset's D is kept


def test_wine_without_its_csv_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["ablate", "--what", "batch", "--experiment", "wine", "--steps", "2", "--quiet",
                 "--out", str(tmp_path / "w")]) == 2
    assert "needs --data-root" in capsys.readouterr().err


def test_a_diverging_point_is_a_result_and_is_not_rerun(tmp_path: Path, fast_point_plots: None) -> None:
    out = tmp_path / "lr"
    # mgda with lr = 1e4 blows up within a few iterations on the linear problem.
    args = ["ablate", "--what", "lr", "--experiment", "linear", "--methods", "mgda", "--grid", "1e-3,1e4",
            "--steps", "40", "--out", str(out), "--quiet"]
    assert main(args) == 0
    rows = {float(r["value"]): r for r in _rows(out / "ablation-lr.csv")}
    assert rows[1e-3]["status"] == "ok" and rows[1e4]["status"] == "diverged"
    error = json.loads((out / "mgda-lr10000" / "point.json").read_text())["error"]
    assert "non-finite" in error or "diverged" in error
    stamp = (out / "mgda-lr10000" / "point.json").stat().st_mtime_ns
    assert main(args) == 0
    assert (out / "mgda-lr10000" / "point.json").stat().st_mtime_ns == stamp


def test_lambda_on_multimnist2_evaluates_fgsm(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "mm"
    assert main(["ablate", "--what", "lambda", "--experiment", "multimnist2", "--max-steps", "1", "--eps", "0,0.03",
                 "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--quiet", *TINY_IMAGES]) == 0
    assert "| λ=0.4 |" in capsys.readouterr().out
    rows = _assert_outputs(out, "lambda", 3)
    assert [float(r["value"]) for r in rows] == [0.4, 0.8, 1.6]
    assert all(0 <= float(r["acc_clean"]) <= 100 and "acc_eps0.03" in r for r in rows)
    config = json.loads((out / "lam1.6" / "double-clip-seed0" / "config.json").read_text())
    assert config["hparams"]["lam"] == 1.6 and config["input_size"] == 16 and config["max_steps"] == 1


@pytest.mark.parametrize(("args", "message"), [
    (["--what", "depth", "--experiment", "linear"], "argument --what: invalid choice: 'depth'"),
    (["--what", "lambda", "--experiment", "celeba"], "argument --experiment: invalid choice: 'celeba'"),
    (["--what", "lr", "--experiment", "multimnist2"], "--what lr is not supported on multimnist2"),
    (["--what", "batch", "--experiment", "linear", "--batch-size", "64"], "--batch-size cannot be fixed"),
    (["--what", "lambda", "--experiment", "linear", "--max-steps", "3"], "--max-steps/--epochs"),
    (["--what", "inner", "--experiment", "linear", "--methods", "mgda"], "--methods applies to --what lr only"),
    (["--what", "lr", "--experiment", "linear", "--methods", "adamw"], "no synthetic preset for method(s)"),
])
def test_bad_requests_exit_2_with_a_clear_message(tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str],
                                                  message: str) -> None:
    try:
        code = main(["ablate", *args, "--out", str(tmp_path / "x"), "--quiet"])
    except SystemExit as exited:  # the fixed sets (--what, --experiment) are argparse choices
        code = exited.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # refused before anything is written
