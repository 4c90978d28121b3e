"""Every code block of README.md and docs/ is executed or declared not to be Python, so that none can rot.

A fenced block's info string says what it is:

* ``python`` -- a complete program: executed here, each block on its own (a fresh namespace, a
  temporary working folder), so a block must define or import everything it uses;
* ``bash`` -- shell commands (installs, the CLI, scripts): not executed here (the CLI and the
  scripts have their own tests), but counted;
* ``text`` -- output or a fragment shown for reading: not executed, counted.

Any other info string, or none, fails :func:`test_every_code_block_is_declared`: a block cannot be
skipped without saying so.  The docs pages that include README sections (pymdownx.snippets'
``--8<--`` lines) hold no copy of their blocks, so each block is executed once, from its source.
"""

from __future__ import annotations

import re
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


def test_the_fence_parser() -> None:
    lines = ["text", "```python", "a = 1", "```", "* item", "  ```bash", "  echo x", "  ```", "~~~~text", "```",
             "~~~~"]
    blocks = code_blocks(ROOT / "docs" / "fixture.md", "\n".join(lines))
    assert [(b.line, b.language, b.code) for b in blocks] == [
        (2, "python", "a = 1\n"), (6, "bash", "echo x\n"), (9, "text", "```\n")]


def test_the_readme_sections_the_docs_include_exist() -> None:
    """The docs pages include README sections by name (pymdownx.snippets): each must be marked once,
    start before end, in README.md -- checked here too, for a plain pytest run (mkdocs --strict does
    it in scripts/test.sh)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    included = {name for page in DOCUMENTS[1:]
                for name in re.findall(r'^--8<-- "README\.md:([\w-]+)"$', page.read_text(encoding="utf-8"), re.M)}
    assert included, "the docs pages include no README section: has the include syntax changed?"
    for name in sorted(included):
        starts = readme.count(f"<!-- --8<-- [start:{name}] -->")
        ends = readme.count(f"<!-- --8<-- [end:{name}] -->")
        assert starts == ends == 1, f"README.md must mark section {name!r} once (start {starts}, end {ends})"
        assert readme.index(f"[start:{name}]") < readme.index(f"[end:{name}]"), name


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda block: block.name)
def test_python_code_block_runs(block: CodeBlock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    # Padded so that a traceback's line numbers are the markdown file's.
    source = "\n" * block.line + block.code
    exec(compile(source, str(block.path), "exec"), {"__name__": "__doc_example__"})
