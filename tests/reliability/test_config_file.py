"""Issue 38 item 7: ``drmoo train --config FILE`` (TOML or JSON, the keys of a run's config.json).

``--config x.yaml`` was refused as an unknown option, and a run's own ``config.json`` could not be
replayed.  Now the file's settings are the run's, the command line overrides them, and a key that is
not a run setting is refused before anything is written.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from drmoo.experiments.config_file import options_from_config_file

from .conftest import TINY_RUN, assert_one_line_refusal, run_cli


def _config(run: Path) -> dict[str, object]:
    return json.loads((run / "config.json").read_text())


def test_a_runs_own_config_json_replays_it(trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    replay = tmp_path / "replay"
    code, err = run_cli(["train", "--config", str(trained_run / "config.json"), "--out", str(replay), "--quiet"],
                        capsys)
    assert code == 0, err
    assert _config(replay) == _config(trained_run)
    # The same settings train the same run: the logged step is identical (its duration aside).
    assert _logged_without_time(replay) == _logged_without_time(trained_run)


def _logged_without_time(run: Path) -> list[dict[str, str]]:
    with (run / "steps.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert rows
    return [{key: value for key, value in row.items() if key != "step_s"} for row in rows]  # step_s: its clock


def test_the_command_line_overrides_the_file(trained_run: Path, tmp_path: Path, reliability_cache: str,
                                            capsys: pytest.CaptureFixture) -> None:
    settings = _config(trained_run)
    settings["cache_dir"] = reliability_cache
    file = tmp_path / "settings.json"
    file.write_text(json.dumps(settings))
    out = tmp_path / "changed"
    code, err = run_cli(["train", "--config", str(file), "--seed", "3", "--lr", "0.5", "--hp", "lam=1.6",
                         "--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    changed, saved = _config(out), _config(trained_run)
    assert changed["seed"] == 3 and changed["hparams"]["lr"] == 0.5 and changed["hparams"]["lam"] == 1.6
    for key in saved:
        if key not in ("seed", "hparams", "cache_dir"):
            assert changed[key] == saved[key], key
    assert {k: v for k, v in changed["hparams"].items() if k not in ("lr", "lam")} == \
        {k: v for k, v in saved["hparams"].items() if k not in ("lr", "lam")}


def test_a_toml_file_holds_some_settings_and_the_presets_fill_in_the_rest(
        tmp_path: Path, tiny_args: Callable[..., list[str]], capsys: pytest.CaptureFixture) -> None:
    file = tmp_path / "run.toml"
    file.write_text('method = "mgda"\nseed = 2\nmax_steps = 1\n\n[hparams]\nlam = 1.6\ndivergence = "kl"\n')
    out = tmp_path / "toml-run"
    code, err = run_cli(["train", "--config", str(file), "--out", str(out), *tiny_args()], capsys)
    assert code == 0, err
    config = _config(out)
    assert (config["method"], config["seed"], config["max_steps"]) == ("mgda", 2, 1)
    assert config["hparams"]["lam"] == 1.6 and config["hparams"]["divergence"] == "kl"
    assert config["batch_size"] == 16  # from the command line (TINY_RUN)


@pytest.mark.parametrize(("content", "name", "fragments"), [
    ('{"method": "mgda", "learning_rate": 0.1}', "x.json", ["unknown setting(s) learning_rate", "hparams"]),
    ("method: mgda\n", "x.yaml", ["expected a .toml or .json file"]),
    ('method = "mgda"\nseed = \n', "x.toml", ["not valid TOML"]),
    ('{"method": "mgda", "seed": "three"}', "x.json", ["--seed"]),
    ('{"method": "mgda", "seed": true}', "x.json", ["seed = True is not a setting's value"]),
    ('{"method": "mgda", "hparams": {"lam": -1}}', "x.json", ["lam"]),
    ('["mgda"]', "x.json", ["expected a table of settings"]),
])
def test_a_bad_file_is_one_line_and_writes_nothing(content: str, name: str, fragments: list[str], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    file = tmp_path / name
    file.write_text(content)
    out = tmp_path / "never"
    code, err = run_cli(["train", "--config", str(file), "--out", str(out), *TINY_RUN], capsys)
    if "--seed" in fragments:  # argparse's own refusal of the value, as when it is typed
        assert code == 2 and "--seed" in err and "Traceback" not in err
    else:
        assert_one_line_refusal(code, err, *fragments)
    assert not out.exists()


def test_config_and_resume_are_refused_together(trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    code, err = run_cli(["train", "--config", str(trained_run / "config.json"), "--resume", str(trained_run)],
                        capsys)
    assert_one_line_refusal(code, err, "--config", "--resume")


def test_typed_hyperparameters_are_left_out_of_the_files(tmp_path: Path) -> None:
    file = tmp_path / "c.json"
    file.write_text('{"method": "mgda", "hparams": {"lr": 0.1, "lam": 0.8, "divergence": "chi2"}, "label": "x"}')
    options, label = options_from_config_file(file, ["--lr", "0.3", "--hp=lam=2"])
    assert options == ["--method=mgda", "--hp", "divergence='chi2'"] and label == "x"
