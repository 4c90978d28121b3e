"""`drmoo synthetic` / `drmoo ablate` and their --out: finished work is kept, someone's files are never written
into, every refusal comes before anything is created, and the lr ablation covers every method it accepts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from drmoo.experiments import synthetic
from drmoo.experiments.ablations import AblationConfig, grid_points

from .conftest import assert_one_line_refusal, run_cli

LINEAR = ["--problem", "linear", "--methods", "mgda", "--quiet"]


@pytest.fixture(autouse=True)
def fast_plots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each synthetic output's convergence.png costs ~1 s of matplotlib; these tests are about the files kept."""
    monkeypatch.setattr(synthetic, "plot_convergence", lambda curves, path, title: Path(path).write_bytes(b"png"))


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _stamps(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_rerun_with_other_settings_is_refused_and_the_finished_run_kept(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "S"
    code, err = run_cli(["synthetic", *LINEAR, "--steps", "6", "--out", str(out)], capsys)
    assert code == 0, err
    before = _files(out)
    assert len(before["runs/mgda-seed0.csv"].decode().splitlines()) == 7  # header + 6 iterations
    for other in (["--steps", "3"], ["--steps", "6", "--hp", "lam=0.9"]):
        code, err = run_cli(["synthetic", *LINEAR, *other, "--out", str(out)], capsys)
        what = "steps 6 there, 3 now" if "3" in other else "lam 0.6 there, 0.9 now"
        assert_one_line_refusal(code, err, "mgda-seed0.csv is a finished run with other settings", what,
                                "another --out")
        assert _files(out) == before  # the 6-step run, its settings and the summaries, byte for byte


def test_a_foreign_non_empty_out_is_refused_and_left_as_it_was(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    mine = tmp_path / "U"
    mine.mkdir()
    (mine / "metrics.csv").write_text("my,own\n1,2\n")
    (mine / "summary.md").write_text("# my notes\n")
    before = _files(mine)
    code, err = run_cli(["synthetic", *LINEAR, "--steps", "2", "--out", str(mine)], capsys)
    assert_one_line_refusal(code, err, "not empty and holds no drmoo synthetic output", "metrics.csv")
    assert _files(mine) == before and sorted(p.name for p in mine.iterdir()) == ["metrics.csv", "summary.md"]


def test_reruns_with_the_same_settings_reuse_finished_work(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # synthetic: the finished runs are reused, not retrained
    out = tmp_path / "S"
    argv = ["synthetic", *LINEAR, "--seeds", "0,1", "--steps", "3", "--out", str(out)]
    assert run_cli(argv, capsys)[0] == 0
    runs = {name: data for name, data in _files(out).items() if name.startswith("runs/")}
    stamps = {name: stamp for name, stamp in _stamps(out).items() if name.startswith("runs/")}
    assert run_cli(argv, capsys)[0] == 0
    assert {n: d for n, d in _files(out).items() if n.startswith("runs/")} == runs
    assert {n: s for n, s in _stamps(out).items() if n.startswith("runs/")} == stamps
    # ablate (each grid point is a synthetic --out with ablate's point.json beside it): reused as well ...
    ablation = tmp_path / "A"
    argv = ["ablate", "--what", "lambda", "--experiment", "linear", "--grid", "0.4,0.8", "--steps", "3",
            "--quiet", "--out", str(ablation)]
    code, err = run_cli(argv, capsys)
    assert code == 0, err
    points = {n: s for n, s in _stamps(ablation).items() if n.startswith("lam")}
    assert "lam0.4/point.json" in points and "lam0.4/runs/double-clip-seed0.csv" in points
    code, err = run_cli(argv, capsys)
    assert code == 0, err
    assert {n: s for n, s in _stamps(ablation).items() if n.startswith("lam")} == points
    # ... and a new grid value beside finished ones is run; a finished point with other settings is kept
    code, err = run_cli([*argv[:6], "0.4,0.8,1.6", *argv[7:]], capsys)
    assert code == 0, err
    assert (ablation / "lam1.6" / "point.json").is_file()
    before = _files(ablation)
    code, err = run_cli([*argv[:8], "4", *argv[9:]], capsys)
    assert_one_line_refusal(code, err, "lam0.4", "finished run with other settings", "steps 3 there, 4 now")
    assert _files(ablation) == before


def test_ablate_lr_gives_each_method_only_the_fixed_hyperparameters_it_has(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "lr"
    code, err = run_cli(["ablate", "--what", "lr", "--experiment", "linear", "--methods", "famo,nashmtl",
                         "--grid", "1e-3", "--steps", "2", "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    famo = json.loads((out / "famo-lr0.001" / "summary.json").read_text())["methods"]["famo"]["hparams"]
    nash = json.loads((out / "nashmtl-lr0.001" / "summary.json").read_text())["methods"]["nashmtl"]["hparams"]
    assert famo["lr"] == famo["pref_lr"] == 1e-3 and "rho" not in famo  # FAMO's w step is ablated too
    assert nash["lr"] == 1e-3 and "rho" not in nash and "pref_lr" not in nash  # NashMTL has no w step
    # --methods all: every method with synthetic settings, each point's settings its optimizer's own
    from drmoo.experiments.synthetic import NUM_TASKS
    from drmoo.optim._method_arguments import accepted_hyperparameters, check_hyperparameter_values

    points = grid_points(AblationConfig("lr", "linear", methods=["all"]))
    assert {p.method for p in points} == {"double-clip", "double-loop", "mgda", "modo", "moco", "sdmgrad",
                                          "nashmtl", "famo"}
    for point in points:
        accepted = accepted_hyperparameters(point.method)
        assert accepted is None or set(point.overrides) <= accepted
        assert point.overrides["lr"] == point.value
        check_hyperparameter_values(point.method, point.overrides, NUM_TASKS)
    clip = next(p for p in points if p.method == "double-clip")
    assert clip.overrides == {"rho": 1e-5, "lr": clip.value, "pref_lr": clip.value}  # the paper's, unchanged


@pytest.mark.parametrize(("argv", "message"), [
    (["synthetic", "--hp", "lr=abc"], "lr must be a number"),
    (["synthetic", "--problem", "wine"], "needs --data-root"),
    (["synthetic", "--problem", "wine", "--data-root", "{tmp}/nowhere"], "wine data not found"),
    (["ablate", "--what", "lambda", "--experiment", "wine"], "needs --data-root"),
    (["ablate", "--what", "lambda", "--experiment", "wine", "--data-root", "{tmp}/nowhere"], "wine data not found"),
])
def test_bad_input_is_refused_before_out_is_created(argv: list[str], message: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    code, err = run_cli([*argv, "--steps", "2", "--quiet", "--out", str(out)], capsys)
    assert_one_line_refusal(code, err, message)
    assert not out.exists()
