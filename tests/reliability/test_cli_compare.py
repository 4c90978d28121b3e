"""Issue 29, the compare command's options (SW-17, U-7, U-8, U-9, U-13): every refusal is one line,
given before anything is written, naming the option that is wrong."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import assert_one_line_refusal, run_cli


@pytest.mark.parametrize("methods, first, second", [
    ("double-clip,double-clip[lam=0.8]", "double-clip", "double-clip[lam=0.8]"),  # 0.8 is the default
    ("mgda[solver='min_norm'],mgda[solver=min_norm]", "mgda[solver='min_norm']", "mgda[solver=min_norm]"),
    ("mgda[lam=0.8],mgda[lam=.8]", "mgda[lam=0.8]", "mgda[lam=.8]"),
])
def test_the_same_settings_under_two_labels_are_refused(methods: str, first: str, second: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    """SW-17: identical settings under two labels trained and tabulated twice."""
    out = tmp_path / "cmp"
    assert_one_line_refusal(*run_cli(["compare", "--methods", methods, "--out", str(out), "--quiet"], capsys),
                            f"{first} and {second} are the same settings")
    assert not out.exists()


def test_rows_that_differ_in_one_setting_are_both_kept() -> None:
    """SW-17's check compares effective settings: a different value (or seed) is a different run."""
    from drmoo.experiments.robustness import check_distinct
    from drmoo.experiments.run_config import RunConfig

    base = {"experiment": "multimnist2", "method": "double-clip", "preset": "quick", "seed": 0}
    check_distinct([RunConfig(**base, hparams={"lam": 0.8}),
                    RunConfig(**base, hparams={"lam": 0.4}, label="double-clip[lam=0.4]"),
                    RunConfig(**{**base, "seed": 1}, hparams={"lam": 0.8})])


def test_all_then_variants_is_every_method_plus_them(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """U-7: ``all+VARIANT`` was documented but refused: ``all,VARIANT`` is the syntax, and ``all+`` says so."""
    from drmoo.experiments.variants import expand_all

    assert expand_all("all,mgda[pref_lr=0]", ["a", "b"]) == "a,b,mgda[pref_lr=0]"
    assert expand_all("mgda[pref_lr=0],all", ["a", "b"]) == "mgda[pref_lr=0],a,b"
    out = tmp_path / "cmp"
    assert_one_line_refusal(*run_cli(["compare", "--methods", "all+mgda[pref_lr=0]", "--out", str(out), "--quiet"],
                                     capsys), "write all,mgda[pref_lr=0]")
    assert not out.exists()


def test_a_reference_that_names_no_row_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """U-8: ``--reference`` naming no row was silently ignored (no paired table, no word)."""
    out = tmp_path / "cmp"
    assert_one_line_refusal(*run_cli(["compare", "--methods", "mgda,modo", "--reference", "double-clip", "--out",
                                      str(out), "--quiet"], capsys),
                            "--reference double-clip", "the rows are mgda, modo")
    assert not out.exists()


@pytest.mark.parametrize("extra, fragment", [
    (["--jobs", "257"], "--jobs"),
    (["--experiment", "celeba", "--jobs", "2"], "--jobs"),
    (["--experiment", "celeba", "--reference", "mgda"], "--reference"),
    (["--experiment", "celeba", "--eps-space", "normalized"], "--eps-space"),
])
def test_compare_checks_everything_before_creating_out(extra: list[str], fragment: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """U-9: compare created --out before it refused --jobs 257 and CelebA combinations."""
    out = tmp_path / "cmp"
    assert_one_line_refusal(*run_cli(["compare", "--methods", "mgda", *extra, "--out", str(out), "--quiet"], capsys),
                            fragment)
    assert not out.exists()


def test_a_run_that_cannot_grow_is_not_blamed_on_resume(tmp_path: Path, tiny_args: Callable[..., list[str]],
                                                        capsys: pytest.CaptureFixture) -> None:
    """U-13: ``compare --epochs 2 --max-steps 1`` over a finished 1-step run blamed ``--resume``, which the
    user never gave; the message names the setting that stops the run."""
    out = tmp_path / "cmp"
    base = ["compare", "--methods", "mgda", "--eps", "0", "--out", str(out)]
    assert run_cli([*base, "--max-steps", "1", *tiny_args()], capsys)[0] == 0
    code, err = run_cli([*base, "--epochs", "2", "--max-steps", "1", *tiny_args()], capsys)
    assert_one_line_refusal(code, err, "nothing to train", "--max-steps 1")
    assert "--resume" not in err


def test_a_run_checkpoint_is_read_through_the_documented_public_function(trained_run: Path) -> None:
    """Issue 28 item 7: run checkpoints could be read only through an undocumented function."""
    import drmoo.experiments
    from drmoo.experiments import read_checkpoint
    from drmoo.experiments.checkpoints import read_checkpoint as defined

    assert read_checkpoint is defined and "read_checkpoint" in drmoo.experiments.__all__
    state = read_checkpoint(str(trained_run))  # a path as text, as a user types it
    assert state["step"] == 1 and state["config"]["method"] == "double-clip" and "model" in state
    documented = read_checkpoint.__doc__ or ""
    assert all(part in documented for part in ("Args:", "run_dir:", "Returns:", "Raises:"))
    cli_page = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    assert "drmoo.experiments.read_checkpoint" in cli_page
