"""User-facing text speaks of the library: README.md, CHANGELOG.md, every page under docs/ and the files those
pages include name no issue of the project's tracker, no test file, no CI anecdote and no internal target; a
result is stated as what the library does and measures.  Each hit is reported as file:line with the phrase and
what to write instead."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "docs").rglob("*.md"))


def _included(pages: list[Path]) -> list[Path]:
    """The files the docs pages include (``--8<-- "path"``, pymdownx.snippets): the site shows their text too."""
    found = {REPO / match.split(":")[0]
             for page in pages for match in re.findall(r'^--8<-- "([^"]+)"', page.read_text(encoding="utf-8"), re.M)}
    return sorted(path for path in found if path.is_file())


USER_TEXT = [REPO / "README.md", REPO / "CHANGELOG.md", *PAGES, *_included(PAGES)]

# (pattern, what to do instead).  Precise on purpose: "issue" and "target" alone are ordinary words
# ("the stable-ABI target", "pip's issue tracker"), and a URL such as .../issues/6634 is a citation.
FORBIDDEN: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\bissues? #?\d+(?:\s*(?:/|,|and)\s*#?\d+)*\b", re.I),
     "a tracker number means nothing to a user: say what changed or what the library does"),
    (re.compile(r"\btest_\w+\.py\b"), "name the behaviour that is tested, not the test file"),
    (re.compile(r"\bCI run\b|\bone CI\b|\bfilled (?:its|CI's|the CI's) disk\b", re.I),
     "an anecdote about a CI run: state what the library or the scripts do"),
    (re.compile(r"\bprevious table's\b|\bthe machines? (?:these|the) (?:figures|numbers) come from\b", re.I),
     "an anecdote about where numbers came from: give the machine and the figure"),
    (re.compile(r"\bround (?:one|two|three|four|five|six|seven|eight|nine|ten|\d+)\b", re.I),
     "a project round means nothing to a user"),
    (re.compile(r"\b\d+(?:\.\d+)?\s?[×x] (?:target|goal)\b"
                r"|\b(?:target|goal)\b[^\n]{0,40}\b(?:is |was )?(?:met|missed)\b"
                r"|\bmiss(?:es|ed)? (?:the|its|their) (?:target|goal)\b", re.I),
     "an internal target: state what the library does (the measured figure)"),
    (re.compile(r"\bSW-\d+\b"), "a design-card identifier means nothing to a user"),
    (re.compile(r"\bin this project\b|\bthis session(?:'s)?\b|\blent GPUs?\b", re.I),
     "how the project was worked on means nothing to a user: state what the library does"),
]


def problems(text: str, name: str) -> list[str]:
    """Every forbidden phrase of ``text`` as ``name:line: "phrase": advice``."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for pattern, advice in FORBIDDEN:
            for match in pattern.finditer(line):
                found.append(f'{name}:{number}: "{match.group(0)}": {advice}')
    return found


@pytest.mark.parametrize("path", USER_TEXT, ids=lambda path: str(path.relative_to(REPO)))
def test_user_text_has_no_internal_talk(path: Path) -> None:
    found = problems(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    assert not found, "\n".join(found)


@pytest.mark.parametrize(("text", "caught"), [
    ("as issue 35 asks", True), ("issues 21/26/27", True), ("(Issue #12)", True), ("see test_cli.py", True),
    ("one CI run filled its disk", True), ("the previous table's CPU", True), ("round four", True),
    ("over the 1.3× target", True), ("its goal, 0.3×, is missed", True), ("Two methods miss the target", True),
    ("(SW-25)", True), ("not yet run on a GPU in this project", True), ("this session's changes", True),
    ("pip's tracker: https://github.com/pypa/pip/issues/6634", False), ("its stable-ABI target (2.11)", False),
    ("CI runs `bash scripts/test.sh`", False), ("float32 rounding", False), ("a round trip", False),
    ("the test suite executes it", False), ("overlapping in-place targets", False),
])
def test_the_patterns_catch_internal_talk_and_pass_ordinary_text(text: str, caught: bool) -> None:
    assert bool(problems(text, "probe")) is caught, problems(text, "probe")
