"""Every number quoted in the verdicts is the one in the committed CSV it names (issue 27).

The verdict prose of the small benchmark (the results READMEs, the README's results summary,
docs/experiments.md's experiments paragraph and "What reproduces", and docs/choosing.md's guide to when to
turn DR on) sits between ``<!-- verdict -->``
and ``<!-- /verdict -->``.  A number quoted there carries, right after it, an HTML comment naming its
cell (invisible when rendered):

    93.80<!--cell table.csv method=double-clip eps=0-->               a mean accuracy
    93.80 ± 0.79<!--cell table.csv method=double-clip eps=0-->        mean ± std
    +2.33 [+0.73, +3.92] 5/5<!--cell paired.csv other=mgda column=0-->  paired mean [95 % CI] wins/seeds
    353<!--cell table.csv method=double-clip[max_steps=353] eps=0 iterations-->  a named column

``FILE`` is relative to the markdown file, or to the block's ``<!-- verdict dir=DIR -->``; the
``key=value`` words select exactly one row (numbers compare as numbers); a last bare word names the
column, else the form of the quoted text decides it: ``mean_acc`` / ``mean`` (``diff_mean`` before
an interval, where the file has it), ``std_acc`` / ``std``, ``ci_low``, ``ci_high``, ``wins``,
``seeds``.  A quoted value must equal the cell rounded to the decimals it shows.

A number in a verdict block that carries no cell fails the test, unless it is a setting rather than
a result: inside backticks, after ε, λ, β or "lr" / "rate" (and the numbers joined to it by
"–", ",", "and", "or", "to"), a count of seeds or digits, a commit, an issue number, or a year.
"""

from __future__ import annotations

import csv
import math
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", "docs/experiments.md", "results/multimnist2-small/README.md",
             "results/multimnist3-small/README.md", "results/multimnist2-small/batch64/README.md",
             "results/multimnist2-small/features/README.md",
             "results/multimnist-k-small/README.md", "results/mnist-attributes-small/README.md",
             "results/multimnist2-small/dr-path/README.md", "results/mnist-attributes-small/dr-path/README.md",
             "docs/choosing.md")

_NUMBER = r"[+\-−]?\d+(?:,\d{3})*(?:\.\d+)?"
_CELL = re.compile(r"<!--cell\s+(?P<spec>[^>]*?)\s*-->")
_BLOCK = re.compile(r"<!-- verdict(?:\s+dir=(?P<dir>\S+))?\s*-->(?P<body>.*?)<!-- /verdict -->", re.S)
# The quoted forms, each ending where the cell comment starts.
_INTERVAL = re.compile(rf"(?P<x>{_NUMBER})\s*\[(?P<lo>{_NUMBER}),\s*(?P<hi>{_NUMBER})\](?:\s+(?P<w>\d+)/(?P<n>\d+))?$")
_SPREAD = re.compile(rf"(?P<x>{_NUMBER})\s*±\s*(?P<sd>{_NUMBER})$")
_SINGLE = re.compile(rf"(?P<x>{_NUMBER})$")
# Numbers that are settings or counts, not results (see the module docstring).
_SETTING = re.compile(
    rf"`[^`]*`|(?:ε|λ|β|\blr\b|\brates?\b)\s*(?:from\s*)?(?:[=≤≥<>]\s*)?{_NUMBER}(?:\s*(?:–|,|and|or|to)\s*(?:ε\s*)?{_NUMBER})*"
    rf"|\b\d+ (?:paired )?(?:seeds?|digits?|rows?|methods?|runs?|baselines?)\b|\bn = \d+\b|\b[0-9a-f]{{7,40}}\b"
    r"|\bissue \d+|\b20\d\d\b|\b\d+/\d+\b|\b(?:of|the) (?:eight|five|six|seven)\b"
)


@cache
def _table(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames or []), list(reader)


def _as_number(text: str) -> float:
    return float(text.replace("−", "-").replace(",", ""))


def _same(a: str, b: str) -> bool:
    try:
        return math.isclose(float(a), float(b), abs_tol=1e-12)
    except ValueError:
        return a == b


def _cell_row(spec: str, base: Path) -> tuple[Path, list[str], dict[str, str], str | None]:
    words = spec.split()
    path = base / words[0]
    header, rows = _table(path)
    selectors = dict(word.split("=", 1) for word in words[1:] if "=" in word)
    column = [word for word in words[1:] if "=" not in word]
    unknown = set(selectors) - set(header)
    assert not unknown, f"{path}: no column {sorted(unknown)} (cell {spec!r})"
    found = [row for row in rows if all(_same(row[key], value) for key, value in selectors.items())]
    assert len(found) == 1, f"{path}: {len(found)} rows match {selectors} (cell {spec!r})"
    return path, header, found[0], column[0] if column else None


def _first(header: list[str], *names: str) -> str:
    return next(name for name in names if name in header)


def _check(quoted: str, value: str, where: str) -> None:
    decimals = len(quoted.split(".")[1]) if "." in quoted else 0
    number = _as_number(quoted)
    assert value not in ("", "nan"), f"{where}: the cell is empty"
    assert abs(number - float(value)) <= 0.5 * 10**-decimals + 1e-9, f"{where}: quoted {quoted}, the file has {value}"


def _cells(document: str) -> list[tuple[str, int, str, Path, str]]:
    """(block text, position of the cell in it, spec, base directory, document) of every cell."""
    text = (ROOT / document).read_text()
    found = []
    for block in _BLOCK.finditer(text):
        base = (ROOT / document).parent / (block["dir"] or "")
        found += [(block["body"], cell.start(), cell["spec"], base, document) for cell in _CELL.finditer(block["body"])]
    return found


def _blocks(document: str) -> list[str]:
    return [block["body"] for block in _BLOCK.finditer((ROOT / document).read_text())]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_document_has_verdict_blocks(document: str) -> None:
    """Guards the check itself: a document whose markers were lost would pass with nothing checked."""
    assert _blocks(document), f"{document} has no <!-- verdict --> block"
    assert len(_cells(document)) >= 5, f"{document}: its verdicts quote fewer than 5 checked numbers"


@pytest.mark.parametrize("document", DOCUMENTS)
def test_quoted_numbers_are_the_committed_cells(document: str) -> None:
    """Each quoted number equals its named cell, rounded as quoted (fails when prose and CSV drift)."""
    for body, start, spec, base, _ in _cells(document):
        before = body[:start]
        _, header, row, column = _cell_row(spec, base)
        where = f"{document}: {before[-60:]!r} <- {spec}"
        if column is not None:
            match = _SINGLE.search(before)
            assert match, f"{where}: no number before the cell"
            _check(match["x"], row[column], where)
        elif match := _INTERVAL.search(before):
            _check(match["x"], row[_first(header, "diff_mean", "mean")], where)
            _check(match["lo"], row["ci_low"], where)
            _check(match["hi"], row["ci_high"], where)
            if match["w"] is not None:
                _check(match["w"], row["wins"], where)
                _check(match["n"], row.get("seeds") or "5", where)
        elif match := _SPREAD.search(before):
            _check(match["x"], row[_first(header, "mean_acc", "mean")], where)
            _check(match["sd"], row[_first(header, "std_acc", "std")], where)
        else:
            match = _SINGLE.search(before)
            assert match, f"{where}: no number before the cell"
            _check(match["x"], row[_first(header, "mean_acc", "mean", "diff_mean")], where)


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_result_in_a_verdict_names_its_cell(document: str) -> None:
    """A result quoted without a cell is unchecked prose: refused (settings and counts excepted)."""
    unchecked = []
    for body in _blocks(document):
        # Blank out what is checked (a quoted form and its cell) and what is a setting or a count.
        text = body
        for cell in reversed(list(_CELL.finditer(body))):
            before = text[: cell.start()]
            match = _INTERVAL.search(before) or _SPREAD.search(before) or _SINGLE.search(before)
            begin = match.start() if match else cell.start()
            text = text[:begin] + " " * (cell.end() - begin) + text[cell.end():]
        text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
        text = _SETTING.sub(lambda m: " " * len(m.group()), text)
        unchecked += [match.group() for match in re.finditer(rf"(?<![\w.]){_NUMBER}(?![\w])", text)
                      if re.search(r"[.+\-−]", match.group())]
    assert not unchecked, f"{document}: numbers in a verdict without a <!--cell ...-->: {unchecked}"


def test_retrained_double_clip_reproduces_the_committed_runs() -> None:
    """The ablation rows are paired with Double-Clip retrained in ablations/ (the committed runs keep no
    checkpoint); the verdicts also pair them with the comparison's rows, which holds only if the retrained
    runs are the committed ones, accuracy for accuracy."""
    import json

    results = ROOT / "results" / "multimnist2-small"
    for seed in range(5):
        retrained = json.loads((results / "ablations" / f"double-clip-seed{seed}" / "eval.json").read_text())
        committed = json.loads((results / f"double-clip-seed{seed}" / "eval.json").read_text())
        assert retrained["results"] == committed["results"], seed
