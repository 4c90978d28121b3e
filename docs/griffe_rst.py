"""A Griffe extension for the API reference: the docstrings' reStructuredText markup read as Markdown.

drmoo's docstrings are Google-style with Sphinx roles (``:func:`name```, ``:math:`...```) and
``.. code-block::`` directives, which Markdown would show verbatim.  A role becomes a code span
(its target text) and a directive line is dropped, leaving its indented block as a Markdown code
block.  Only what the site shows changes; the docstrings stay as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj|math):`~?([^`]+)`")
_DIRECTIVE = re.compile(r"^[ \t]*\.\. code-block::.*\n", re.MULTILINE)


def rst_to_markdown(text: str) -> str:
    return _ROLE.sub(lambda match: f"`{match[1]}`", _DIRECTIVE.sub("", text))


def _convert(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = rst_to_markdown(obj.docstring.value)


class RestructuredTextToMarkdown(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        _convert(obj)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        _convert(pkg)  # the top-level package is not among the objects on_object sees
