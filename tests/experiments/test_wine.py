"""The UCI white-wine problem (App. E.2): loader, labels, error messages, command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drmoo.cli import main
from drmoo.experiments.problems import WINE_COLUMNS, load_wine_table, make_wine_problem


def test_wine_problem_from_the_real_table(wine_csv: Path) -> None:
    problem = make_wine_problem(seed=0, data_root=wine_csv.parent)
    columns, table = load_wine_table(wine_csv)
    assert problem.inputs.shape == (table.shape[0], 3, 12) and problem.targets.shape == (table.shape[0], 3)
    for task, (name, quantile) in enumerate((("quality", 0.5), ("residual sugar", 0.8), ("alcohol", 0.1))):
        column = columns.index(name)
        threshold = torch.quantile(table[:, column], quantile)
        expected = (table[:, column] >= threshold).float()
        assert torch.equal(problem.targets[:, task], expected)
        # the label's own column is removed from that task's inputs, and only that one
        assert bool((problem.inputs[:, task, column] == 0).all())
        others = [c for c in range(12) if c != column]
        assert bool((problem.inputs[:, task, others].std(0) > 0.5).all())
    # ">=" with discrete quality: the median quality is 6, so 6 counts as positive
    assert 0.6 < float(problem.targets[:, 0].mean()) < 0.7
    losses = problem.loss_fn(problem.fresh_params(), problem.inputs[:8], problem.targets[:8])
    torch.testing.assert_close(losses, torch.full((8, 3), float(torch.log(torch.tensor(2.0)))))


def test_semicolon_separated_file_reads_the_same(tmp_path: Path, wine_csv: Path) -> None:
    lines = wine_csv.read_text().splitlines()
    header = ";".join(f'"{name}"' for name in lines[0].split(","))
    (tmp_path / "winequality-white.csv").write_text("\n".join([header] + [ln.replace(",", ";") for ln in lines[1:]]))
    assert torch.equal(load_wine_table(tmp_path)[1], load_wine_table(wine_csv)[1])


def _write(tmp_path: Path, rows: list[str]) -> Path:
    path = tmp_path / "winequality-white.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


GOOD_ROW = "7,0.27,0.36,20.7,0.045,45,170,1.001,3,0.45,8.8,6"


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], "empty"),
        (["a,b,c", GOOD_ROW], "line 1 .header. lacks the column"),
        ([",".join(WINE_COLUMNS), GOOD_ROW, "7,0.27,0.36"], "line 3 has 3 fields"),
        ([",".join(WINE_COLUMNS), GOOD_ROW, GOOD_ROW.replace("8.8", "eight")], "line 3 has a non-numeric value"),
        ([",".join(WINE_COLUMNS), GOOD_ROW, GOOD_ROW.replace("8.8", "nan")], "line 3 has a NaN"),
        ([",".join(WINE_COLUMNS), GOOD_ROW], "only 1 data rows"),
    ],
)
def test_malformed_files_name_file_line_and_problem(tmp_path: Path, rows: list[str], message: str) -> None:
    path = _write(tmp_path, rows)
    with pytest.raises(ValueError, match=message) as info:
        load_wine_table(path)
    assert str(path) in str(info.value)


def test_missing_file_and_missing_root(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(FileNotFoundError, match=r"winequality-white\.csv"):
        load_wine_table(tmp_path)
    with pytest.raises(ValueError, match="needs --data-root"):
        make_wine_problem(seed=0)
    assert main(["synthetic", "--problem", "wine", "--data-root", str(tmp_path / "nowhere"), "--steps", "2",
                 "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert "wine data not found" in capsys.readouterr().err


def test_cli_on_wine(tmp_path: Path, wine_csv: Path) -> None:
    out = tmp_path / "wine"
    assert main(["synthetic", "--problem", "wine", "--data-root", str(wine_csv), "--steps", "20",
                 "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["methods"]["double-loop"]["hparams"]["inner_steps"] == 15
    assert summary["methods"]["double-loop"]["samples_per_iteration"] == 18 * 256
    assert "white wine" in summary["description"]
