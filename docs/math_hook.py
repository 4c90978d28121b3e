"""mkdocs hook: a display formula in a page's Markdown, between two lines that hold only ``$$``, becomes
MathML at build time (latex2mathml, as docs/griffe_rst.py does for the API reference's formulas).  Browsers
draw MathML themselves: the site needs no JavaScript renderer, no web font and no CDN, and reads offline.

Only such display blocks are converted (an inline ``$`` is too common in shell text); a code block is left
alone, since its ``$$`` lines would be indented or fenced.
"""

from __future__ import annotations

import re
from typing import Any

from latex2mathml.converter import convert as latex_to_mathml

_DISPLAY = re.compile(r"^\$\$\n(.+?)\n\$\$$", re.MULTILINE | re.DOTALL)


def display_math(markdown: str) -> str:
    """``markdown`` with each ``$$`` block replaced by a block of MathML."""
    return _DISPLAY.sub(
        lambda match: f'<div class="math-display">{latex_to_mathml(match.group(1).strip(), display="block")}</div>',
        markdown,
    )


def on_page_markdown(markdown: str, **_: Any) -> str:
    return display_math(markdown)
