"""A Griffe extension for the API reference: the docstrings' reStructuredText markup read as Markdown.

drmoo's docstrings are Google-style with Sphinx roles (``:func:`name```, ``:math:`...```) and
``.. code-block::`` directives, which Markdown would show verbatim.

* ``:math:`...``` becomes MathML, converted here at build time (latex2mathml, pure Python): browsers
  draw MathML themselves, so the site needs no JavaScript renderer, no web font and no CDN, and
  shows its formulas offline.  The characters Markdown would act on (``*`` for emphasis, ``_``,
  brackets, backslashes, backticks) are written as character references, so a formula such as
  :math:`f^{*\\prime}` is never turned into italics.
* Any other role becomes a code span (its target text).
* A directive line is dropped, leaving its indented block as a Markdown code block.

Only what the site shows changes; the docstrings stay as they are.

The extension also refuses to build without a signature formatter: mkdocstrings wraps the signatures
(``separate_signature``, ``line_length`` in mkdocs.yml) with Black or Ruff, and without either it writes
each one on a single unbroken line and says so only at the ``info`` level, which ``--strict`` ignores.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import griffe
from latex2mathml.converter import convert as latex_to_mathml

_MATH = re.compile(r":math:`([^`]+)`")
_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):`~?([^`]+)`")
_DIRECTIVE = re.compile(r"^[ \t]*\.\. code-block::.*\n", re.MULTILINE)
# Markdown's inline syntax characters (emphasis, links, code spans, escapes, line breaks) -> character
# references, which Markdown passes through and the browser reads as the characters themselves.
_MARKDOWN_ACTIVE = str.maketrans({char: f"&#{ord(char)};" for char in "*_[]`\\!\n"})


def math_to_html(latex: str) -> str:
    """Inline MathML for a LaTeX formula, safe to embed in Markdown text."""
    # In a <span>: a paragraph that opened with a bare <math> element would be taken for a block of raw HTML.
    return f"<span class=\"math\">{latex_to_mathml(latex.strip()).translate(_MARKDOWN_ACTIVE)}</span>"


def rst_to_markdown(text: str) -> str:
    text = _DIRECTIVE.sub("", text)
    text = _MATH.sub(lambda match: math_to_html(match[1]), text)
    return _ROLE.sub(lambda match: f"`{match[1]}`", text)


def _convert(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = rst_to_markdown(obj.docstring.value)


def require_signature_formatter() -> None:
    """Raise unless mkdocstrings can format the API page's signatures (Black, or Ruff's binary)."""
    if importlib.util.find_spec("black") is not None:
        return
    try:
        from ruff.__main__ import find_ruff_bin

        find_ruff_bin()
    except (ImportError, FileNotFoundError):
        raise RuntimeError("the API page's signatures are wrapped by ruff (or black), and neither is installed "
                           "here: pip install ruff (requirements-dev.txt pins it), then build again") from None


class RestructuredTextToMarkdown(griffe.Extension):
    def __init__(self) -> None:
        require_signature_formatter()  # loaded once per build, before any page is rendered
        super().__init__()

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        _convert(obj)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        _convert(pkg)  # the top-level package is not among the objects on_object sees
