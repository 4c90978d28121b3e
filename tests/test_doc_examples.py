"""Every code block of README.md and docs/ is executed or declared not to be Python, so that none can rot.

A fenced block's info string says what it is:

* ``python`` -- a complete program: executed here, each block on its own (a fresh namespace, a
  temporary working folder), so a block must define or import everything it uses;
* ``bash`` -- shell commands (installs, the CLI, scripts): not executed here (the CLI and the
  scripts have their own tests), but every ``drmoo ...`` command in them is parsed by the CLI's own
  argparse parser (never run), so a renamed or removed option fails here;
* ``text`` -- output or a fragment shown for reading: not executed, counted.

Any other info string, or none, fails :func:`test_every_code_block_is_declared`: a block cannot be
skipped without saying so.  The files a docs page includes whole (pymdownx.snippets' ``--8<--`` lines:
the results READMEs, bench/README.md) are not read here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXECUTED = {"python"}
NOT_EXECUTED = {"bash", "text"}
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass(frozen=True)
class CodeBlock:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str  # the info string's first word ("" when there is none)
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(path: Path, text: str | None = None) -> list[CodeBlock]:
    """The fenced blocks of a markdown file (backtick or tilde fences, possibly indented in a list)."""
    blocks: list[CodeBlock] = []
    lines = (path.read_text(encoding="utf-8") if text is None else text).splitlines()
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        info = opening["info"].strip()
        body: list[str] = []
        end = index + 1
        while end < len(lines):
            closing = _FENCE.match(lines[end])
            if closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence) \
                    and not closing["info"].strip():
                break
            body.append(lines[end][len(indent):] if lines[end].startswith(indent) else lines[end])
            end += 1
        else:
            raise AssertionError(f"{path.relative_to(ROOT)}:{index + 1}: a code fence is never closed")
        language = info.split()[0].lstrip("{.").rstrip("}") if info else ""
        blocks.append(CodeBlock(path, index + 1, language, "\n".join(body) + "\n"))
        index = end + 1
    return blocks


ALL_BLOCKS = [block for document in DOCUMENTS for block in code_blocks(document)]
PYTHON_BLOCKS = [block for block in ALL_BLOCKS if block.language in EXECUTED]


def test_every_code_block_is_declared() -> None:
    undeclared = [f"{block.name} ({block.language or 'no info string'})" for block in ALL_BLOCKS
                  if block.language not in EXECUTED | NOT_EXECUTED]
    assert not undeclared, (
        "code blocks must be `python` (executed by this test), `bash` or `text` (shown only): "
        + ", ".join(undeclared))
    counts = {language: sum(block.language == language for block in ALL_BLOCKS)
              for language in sorted(EXECUTED | NOT_EXECUTED)}
    print(f"code blocks in {len(DOCUMENTS)} documents: {counts}; executed: {len(PYTHON_BLOCKS)}")
    assert len(PYTHON_BLOCKS) + sum(counts[language] for language in NOT_EXECUTED) == len(ALL_BLOCKS)
    # The README's two APIs and the docs' own examples: a parser that found none would pass silently.
    assert sum(block.path.name == "README.md" for block in PYTHON_BLOCKS) >= 2
    assert any(block.path.parent.name == "docs" for block in PYTHON_BLOCKS)


def test_every_examples_page_is_executed_and_in_the_nav() -> None:
    """docs/examples/: each page is a program the suite runs (AMP, DDP, torch.compile, Lightning), and the
    site's navigation lists it (mkdocs --strict would only warn about a page left out)."""
    pages = sorted((ROOT / "docs" / "examples").glob("*.md"))
    assert {page.stem for page in pages} >= {"amp", "ddp", "compile", "lightning"}
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in pages:
        assert sum(block.path == page for block in PYTHON_BLOCKS) >= 1, f"{page.name} has no executed block"
        assert f": examples/{page.name}\n" in nav, f"{page.name} is not in mkdocs.yml's nav"


def test_the_fence_parser() -> None:
    lines = ["text", "```python", "a = 1", "```", "* item", "  ```bash", "  echo x", "  ```", "~~~~text", "```",
             "~~~~"]
    blocks = code_blocks(ROOT / "docs" / "fixture.md", "\n".join(lines))
    assert [(b.line, b.language, b.code) for b in blocks] == [
        (2, "python", "a = 1\n"), (6, "bash", "echo x\n"), (9, "text", "```\n")]


def test_the_docs_pages_hold_their_own_text() -> None:
    """The docs pages once included README sections by name (pymdownx.snippets); the README is now a short
    entry point and the pages hold the text (issue 38).  A page may still include a whole file (the results
    READMEs, bench/README.md), which must exist -- checked here too, for a plain pytest run (mkdocs --strict
    does it in scripts/test.sh)."""
    includes = [(page, target) for page in DOCUMENTS[1:]
                for target in re.findall(r'^--8<-- "([^"]+)"$', page.read_text(encoding="utf-8"), re.M)]
    assert includes, "the docs include no file at all: has the include syntax changed?"
    for page, target in includes:
        assert not target.startswith("README.md"), f"{page.name} includes {target}: the page must hold its text"
        assert (ROOT / target).is_file(), f"{page.name} includes {target}, which does not exist"
    assert "--8<-- [start:" not in (ROOT / "README.md").read_text(encoding="utf-8")


def _anchors(markdown: str) -> set[str]:
    """The ids python-markdown's toc gives the headings of a page (mkdocs' anchors)."""
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", markdown, re.M):
        slug = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
        anchors.add(re.sub(r"[-\s]+", "-", slug))
    return anchors


def test_the_readme_is_a_short_entry_point() -> None:
    """Issue 38: the README is a pitch, the install, a quick start with the Balancer in its first screen,
    the two commands, the results in short and links; the docs pages carry the rest."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines"
    readme_python = [block for block in PYTHON_BLOCKS if block.path.name == "README.md"]
    first_balancer = min(block.line for block in readme_python if "drmoo.Balancer(" in block.code)
    assert first_balancer <= 90, f"the README's Balancer quick start starts at line {first_balancer}"
    assert "pip install dist/drmoo-" in text and "pip install --no-build-isolation ." in text.replace(" &&", "")
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert f"```bash\n{command}\n```" in text, command
    # The features-mode caveat, where the quick start shows the mode.
    quick_start = text[text.index("## Quick start"):text.index("## Two commands")]
    assert 'jacobian="features"' in quick_start and "Double-Clip and Nash-MTL" in quick_start


def test_the_readme_links_resolve() -> None:
    """Every relative link of the README names a file of the repository, and an anchor that its heading
    gives (mkdocs checks the docs' own links; the README is outside the site)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert sum(link.startswith("docs/") for link in links) >= 8, links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = ROOT / target
        assert path.exists(), f"README.md links to {link}: no such file"
        if anchor:
            assert anchor in _anchors(path.read_text(encoding="utf-8")), f"README.md links to {link}: no such heading"


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda block: block.name)
def test_python_code_block_runs(block: CodeBlock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    # Padded so that a traceback's line numbers are the markdown file's.
    source = "\n" * block.line + block.code
    exec(compile(source, str(block.path), "exec"), {"__name__": "__doc_example__"})


# ------------------------------------------------------------------ the CLI lines of bash blocks
BASH_BLOCKS = [block for block in ALL_BLOCKS if block.language == "bash"]


def drmoo_commands(block: CodeBlock) -> list[tuple[int, list[str]]]:
    """(line, drmoo's arguments) of every ``drmoo ...`` command of a bash block.

    Backslash continuations are joined first and ``#`` comments dropped (shlex); a command is
    ``drmoo ARGS``, ``python -m drmoo ARGS`` or a launcher's ``... -m drmoo ARGS`` (torchrun).  A
    placeholder such as ``DIR`` or ``/path/to/x.csv`` is an ordinary value: options are parsed,
    never run, so it needs to exist nowhere.
    """
    commands: list[tuple[int, list[str]]] = []
    lines = block.code.splitlines()
    index = 0
    while index < len(lines):
        first, logical = index, lines[index]
        while logical.rstrip().endswith("\\") and index + 1 < len(lines):
            index += 1
            logical = logical.rstrip()[:-1] + " " + lines[index]
        index += 1
        words = shlex.split(logical, comments=True)
        for position, word in enumerate(words):
            module_form = word == "drmoo" and position > 0 and words[position - 1] == "-m"
            if (position == 0 and word == "drmoo") or module_form:
                commands.append((block.line + 1 + first, words[position + 1:]))
                break
    return commands


def _strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The CLI's parser with abbreviations off in every subcommand: the docs must spell an option
    in full, so that a renamed option (``--max-steps`` -> ``--max-steps-total``) is not accepted as
    a prefix of its new name."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                _strict(subparser)
    return parser


def parse_drmoo(arguments: list[str]) -> str | None:
    """None when the CLI's own parser accepts ``arguments``, else argparse's error message."""
    from drmoo import cli

    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            _strict(cli.build_parser()).parse_args(cli._attach_negative_values(list(arguments)))
    except SystemExit as exit_:
        return errors.getvalue().strip().splitlines()[-1] if exit_.code else "exited (--help or --version?)"
    return None


def test_the_bash_blocks_hold_drmoo_commands() -> None:
    """The parser below must find the README's CLI examples (a finder that found none would pass)."""
    commands = [command for block in BASH_BLOCKS for command in drmoo_commands(block)]
    subcommands = {arguments[0] for _, arguments in commands if arguments}
    assert {"train", "eval", "compare", "bench-iter", "synthetic", "ablate", "report"} <= subcommands, subcommands


@pytest.mark.parametrize("block", [block for block in BASH_BLOCKS if drmoo_commands(block)], ids=lambda b: b.name)
def test_every_drmoo_command_of_a_bash_block_parses(block: CodeBlock) -> None:
    refused = [f"{block.path.relative_to(ROOT)}:{line}: drmoo {shlex.join(arguments)}: {error}"
               for line, arguments in drmoo_commands(block) if (error := parse_drmoo(arguments)) is not None]
    assert not refused, "\n".join(refused)


def test_the_command_finder_and_a_renamed_option() -> None:
    block = CodeBlock(ROOT / "docs" / "fixture.md", 10, "bash", "\n".join([
        "pip install drmoo  # not drmoo's CLI",
        "drmoo train --experiment multimnist2 \\",
        "    --max-steps 3 --out DIR   # a comment: --no-such-option",
        "torchrun --nproc_per_node=2 -m drmoo eval --run runs/dc",
        "drmoo train --max-step 3 --out DIR",
        "drmoo train --no-such-option 1",
    ]) + "\n")
    found = drmoo_commands(block)
    assert found == [
        (12, ["train", "--experiment", "multimnist2", "--max-steps", "3", "--out", "DIR"]),
        (14, ["eval", "--run", "runs/dc"]),
        (15, ["train", "--max-step", "3", "--out", "DIR"]),
        (16, ["train", "--no-such-option", "1"]),
    ]
    assert [parse_drmoo(arguments) is None for _, arguments in found] == [True, True, False, False]
    assert "--no-such-option" in str(parse_drmoo(found[3][1]))
