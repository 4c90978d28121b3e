"""Issue 29 ("Hostile input, round three"): ``drmoo report`` is a reader of untrusted trees.

One test (or a family) per defect ID; each ID is in the test's name.  Every case runs the real
command on a copy of a finished run or on a hand-made tree, and checks the report it writes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tracemalloc
from pathlib import Path

import pytest

from drmoo.cli import main

from .conftest import assert_one_line_refusal, run_cli

SECRET = "-----BEGIN OPENSSH PRIVATE KEY----- do-not-leak"


def _report(capsys: pytest.CaptureFixture, out: Path, *runs: Path) -> str:
    """``drmoo report --runs RUNS --out OUT``: it must succeed with no traceback; the report's text."""
    code, err = run_cli(["report", "--runs", *map(str, runs), "--out", str(out)], capsys)
    assert code == 0 and "Traceback" not in err, err
    return out.read_text()


@pytest.fixture
def shared(trained_run: Path, tmp_path: Path) -> Path:
    """A shared results tree: one good run (``good``), copied beside the cases of each test."""
    root = tmp_path / "shared"
    root.mkdir()
    shutil.move(trained_run, root / "good")
    return root


# ------------------------------------------------------------------------------- SEC-5


@pytest.mark.parametrize("name", ["metrics.csv", "config.json", "eval.json", "steps.csv"])
def test_sec5_report_never_embeds_a_link_target(shared: Path, tmp_path: Path, name: str,
                                                capsys: pytest.CaptureFixture) -> None:
    """`ln -s ~/.ssh/id_ed25519 SHARED/x/metrics.csv` put the key into the report."""
    secret = tmp_path / "id_ed25519"
    secret.write_text(f"epoch,key\n1,{SECRET}\n" if name.endswith(".csv") else json.dumps(
        {"experiment": SECRET, "method": SECRET, "seed": 0, "results": [{"eps": 0, "mean_acc": 0.5,
                                                                         "task_acc": [SECRET]}]}))
    victim = shared / "x"
    shutil.copytree(shared / "good", victim)
    (victim / name).unlink(missing_ok=True)
    (victim / name).symlink_to(secret)
    text = _report(capsys, tmp_path / "r.md", shared)
    assert "do-not-leak" not in text
    assert "symbolic link" in text  # the link is named as skipped, never followed


def test_sec5_a_linked_comparison_table_and_a_linked_directory_are_not_followed(
        shared: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    secret_dir = tmp_path / "private"
    secret_dir.mkdir()
    (secret_dir / "table.md").write_text(SECRET + "\n")
    (secret_dir / "table.csv").write_text("method\nx\n")
    (shared / "linked").symlink_to(secret_dir)
    comparison = shared / "cmp"
    comparison.mkdir()
    (comparison / "table.md").symlink_to(secret_dir / "table.md")
    (comparison / "table.csv").write_text("method\nx\n")
    (shared / "root").symlink_to("/")
    text = _report(capsys, tmp_path / "r.md", shared)
    assert "do-not-leak" not in text
    assert "Training run" in text  # the good run is still reported


# ------------------------------------------------------------------------------- CR-12 / U-10


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value))


def _bad_eval(run: Path) -> None:
    _write_json(run / "eval.json", {"results": [{}]})


def _hparams_list(run: Path) -> None:
    config = json.loads((run / "config.json").read_text())
    _write_json(run / "config.json", {**config, "hparams": [1, 2]})


def _config_list(run: Path) -> None:
    _write_json(run / "config.json", [1, 2, 3])


def _method_number(run: Path) -> None:
    config = json.loads((run / "config.json").read_text())
    _write_json(run / "config.json", {**config, "method": {"a": 1}})


def _settings_list(run: Path) -> None:
    for name in os.listdir(run):
        (run / name).unlink()
    _write_json(run / "ablation-lr.json", {"kind": "ablation", "what": "lr", "settings": [1, 2], "grid": [0.1]})


def _grid_strings(run: Path) -> None:
    _settings_list(run)
    _write_json(run / "ablation-lr.json", {"kind": "ablation", "what": "lr", "settings": {}, "grid": {"a": "x"}})


def _per_column_string(run: Path) -> None:
    for name in os.listdir(run):
        (run / name).unlink()
    (run / "table.md").write_text("| t |\n")
    (run / "table.csv").write_text("method\nx\n")
    _write_json(run / "agreement.json", {"per_column": "abc", "mean_tau_b": 0.5})


def _summary_methods_list(run: Path) -> None:
    for name in os.listdir(run):
        (run / name).unlink()
    (run / "summary.md").write_text("| t |\n")
    _write_json(run / "summary.json", {"problem": "linear", "methods": [1, 2]})


def _unreadable_subdirectory(run: Path) -> None:
    for name in os.listdir(run):  # not a run itself: the walk goes below it
        (run / name).unlink()
    (run / "locked").mkdir()
    (run / "locked" / "config.json").write_text("{}")
    (run / "locked").chmod(0)


def _not_json(run: Path) -> None:
    (run / "eval.json").write_text("{not json")


CASES = {"eval-results-of-empty-objects": _bad_eval, "hparams-a-list": _hparams_list,
         "config-a-list": _config_list, "method-an-object": _method_number, "settings-a-list": _settings_list,
         "grid-of-strings": _grid_strings, "per-column-a-string": _per_column_string,
         "summary-methods-a-list": _summary_methods_list, "mode-000-subdirectory": _unreadable_subdirectory,
         "eval-not-json": _not_json}


@pytest.mark.parametrize("case", list(CASES))
def test_cr12_u10_a_malformed_side_file_is_one_skipped_line_not_a_traceback(
        shared: Path, tmp_path: Path, case: str, capsys: pytest.CaptureFixture) -> None:
    """Well-formed JSON of the wrong shape gave a KeyError/TypeError traceback and no report at all."""
    bad = shared / "bad"
    shutil.copytree(shared / "good", bad)
    CASES[case](bad)
    try:
        text = _report(capsys, tmp_path / "r.md", shared)
    finally:
        for path in bad.rglob("*"):
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
    assert "Training run" in text  # the good run is still there (U-10)
    skipped = text.split("## Skipped", 1)[1]
    assert "bad" in skipped
    # one line for the bad directory: why it was skipped (root may list a mode-000 directory: then it is
    # reported as holding nothing drmoo wrote)
    assert "skipped:" in skipped or (case == "mode-000-subdirectory" and "no recognised results" in skipped)


# ------------------------------------------------------------------------------- SW-16


def test_sw16_a_stale_eval_json_is_not_shown_beside_the_new_metrics(
        trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`train --resume` kept the old eval.json and the report printed the old model's FGSM table."""
    assert main(["eval", "--run", str(trained_run), "--eps", "0", "--quiet"]) == 0
    stale = (trained_run / "eval.json").read_text()
    assert main(["train", "--resume", str(trained_run), "--max-steps", "2", "--quiet"]) == 0
    (trained_run / "eval.json").write_text(stale)  # as an older drmoo left it, or copied back by hand
    capsys.readouterr()
    text = _report(capsys, tmp_path / "r.md", trained_run)
    assert "| eps | task 1 |" not in text
    assert "not computed from the checkpoint" in text
    assert main(["eval", "--run", str(trained_run), "--eps", "0", "--quiet"]) == 0
    assert "| eps | task 1 |" in _report(capsys, tmp_path / "r.md", trained_run)


# ------------------------------------------------------------------------------- SEC-7


def test_sec7_oversized_tables_are_skipped_not_embedded(shared: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    """Three 200 MB sparse table.md gave 2.9 GB RSS and a 629 MB report; a 255 MB metrics.csv 4.6 GB RSS."""
    for index in range(3):
        comparison = shared / f"cmp{index}"
        comparison.mkdir()
        (comparison / "table.csv").write_text("method\nx\n")
        with (comparison / "table.md").open("wb") as handle:
            handle.write(b"| big |\n")
            handle.truncate(200 << 20)
    runs = shared / "long"
    shutil.copytree(shared / "good", runs)
    with (runs / "metrics.csv").open("a") as handle:  # many rows: only the last 40 are kept and shown
        header = (shared / "good" / "metrics.csv").read_text().splitlines()[0]
        row = ",".join("1" for _ in header.split(","))
        handle.write((row + "\n") * 200_000)
    tracemalloc.start()
    try:
        text = _report(capsys, tmp_path / "r.md", shared)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert (tmp_path / "r.md").stat().st_size < 1 << 20
    assert text.count("more than the 1048576") == 3
    assert "(last 40 of 200001 rows)" in text
    assert peak < 64 << 20, peak


# ------------------------------------------------------------------------------- DL-4


def test_dl4_a_file_quoting_the_report_marker_is_not_replaced(trained_run: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    """Any file whose first 4 KB quoted ``by `drmoo report` from:`` was replaced."""
    notes = tmp_path / "notes.md"
    notes.write_text("# My notes\n\nThe report says 'Collected ... by `drmoo report` from:' at the top.\n")
    before = notes.read_text()
    assert_one_line_refusal(*run_cli(["report", "--runs", str(trained_run), "--out", str(notes)], capsys),
                            "not a report drmoo wrote")
    assert notes.read_text() == before


def test_dl4_only_an_unmodified_report_is_replaced(trained_run: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "r.md"
    _report(capsys, out, trained_run)
    _report(capsys, out, trained_run)  # its own report, unmodified: replaced
    edited = out.read_text().replace("Training run", "Training run (my annotations)")
    out.write_text(edited)
    assert_one_line_refusal(*run_cli(["report", "--runs", str(trained_run), "--out", str(out)], capsys),
                            "not a report drmoo wrote")
    assert out.read_text() == edited


# ------------------------------------------------------------------------------- SW-23


def test_sw23_an_out_path_that_resolves_into_a_run_is_refused(trained_run: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    out = trained_run / "sub" / ".." / "r.md"
    assert_one_line_refusal(*run_cli(["report", "--runs", str(trained_run), "--out", str(out)], capsys),
                            "inside the run directory")
    assert not (trained_run / "r.md").exists() and not (trained_run / "sub").exists()
    (trained_run / "sub").mkdir()
    assert_one_line_refusal(*run_cli(["report", "--runs", str(trained_run), "--out",
                                      str(trained_run / "sub" / "r.md")], capsys), "inside the run directory")


def test_sw23_a_directory_given_twice_is_reported_once(trained_run: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    text = _report(capsys, tmp_path / "r.md", trained_run, trained_run, trained_run.parent)
    assert text.count("## 1. Training run") == 1 and "## 2." not in text


def test_sw23_strings_from_config_json_are_escaped(trained_run: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    config = json.loads((trained_run / "config.json").read_text())
    injected = "x](http://evil.example)<script>alert(1)</script>\n## Forged section |"
    (trained_run / "config.json").write_text(json.dumps({**config, "preset": injected,
                                                         "hparams": {**config["hparams"], "note": injected}}))
    text = _report(capsys, tmp_path / "r.md", trained_run)
    assert "<script>" not in text and not re.search(r"(?<!\\)\]\(http://evil", text)  # no live HTML, no link
    assert "\n## Forged section" not in text
    assert "\\<script\\>" in text and "\\](http://evil" in text  # shown, escaped
