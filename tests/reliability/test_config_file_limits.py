"""``--config FILE`` refuses, in one line and before anything is written, a TOML file nested thousands of
levels deep (it was a RecursionError traceback of thousands of lines) and a JSON file that gives a key
twice (JSON kept the last value silently; TOML already refuses it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from drmoo.store import MAX_JSON_DEPTH

from .conftest import assert_one_line_refusal, run_cli


@pytest.mark.parametrize("toml", [
    "hparams = " + "[" * 5000 + "]" * 5000 + "\n",  # arrays: tomllib recurses once per level
    "hparams = " + "{a = " * 5000 + "1" + "}" * 5000 + "\n",  # inline tables
    "hparams = " + "[" * (MAX_JSON_DEPTH + 5) + "]" * (MAX_JSON_DEPTH + 5) + "\n",  # parses, but deeper than JSON may
], ids=["arrays-5000", "tables-5000", "arrays-over-the-json-bound"])
def test_a_deeply_nested_toml_config_is_one_line(toml: str, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                 tiny_args: Callable[..., list[str]]) -> None:
    path = tmp_path / "deep.toml"
    path.write_text(toml)
    out = tmp_path / "out"
    code, err = run_cli(["train", "--config", str(path), "--out", str(out), *tiny_args("--max-steps", "1")], capsys)
    assert_one_line_refusal(code, err, str(path), f"nested deeper than {MAX_JSON_DEPTH} levels")
    assert not out.exists()


def test_a_json_config_that_gives_a_key_twice_is_refused_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture, tiny_args: Callable[..., list[str]]) -> None:
    path = tmp_path / "run.json"
    path.write_text('{"method": "mgda", "seed": 1, "seed": 2}')
    out = tmp_path / "out"
    code, err = run_cli(["train", "--config", str(path), "--out", str(out), *tiny_args("--max-steps", "1")], capsys)
    assert_one_line_refusal(code, err, str(path), "'seed' is given twice")
    assert not out.exists()


def test_a_key_given_twice_in_the_hparams_table_too(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                     tiny_args: Callable[..., list[str]]) -> None:
    path = tmp_path / "run.json"
    path.write_text('{"method": "mgda", "hparams": {"lam": 1.0, "lam": 2.0}}')
    out = tmp_path / "out"
    code, err = run_cli(["train", "--config", str(path), "--out", str(out), *tiny_args("--max-steps", "1")], capsys)
    assert_one_line_refusal(code, err, "'lam' is given twice")
