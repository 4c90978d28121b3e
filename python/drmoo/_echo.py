"""Values echoed in one-line error messages, shortened: a message names the problem, not the whole input.

A refused ``--seeds`` of 20,000 values, or a count of 100,000 digits, is shown by its first few items
(or characters) and how many there are, so the error stays one readable line.  Imports nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["MAX_ECHOED_CHARS", "MAX_ECHOED_ITEMS", "echo", "echo_items", "first_repeat", "shortened"]

MAX_ECHOED_ITEMS = 5  # items of a list shown before "... (N values)"
MAX_ECHOED_CHARS = 80  # characters of one value shown before "... (N characters)"


def echo(text: str) -> str:
    """``text`` quoted as ``repr`` does; a long one shortened, with its length or number of comma-separated values.

    >>> echo(",".join(map(str, range(20000))))
    "'0,1,2,3,4,...' (20000 comma-separated values)"
    """
    items = text.split(",")
    if len(items) > MAX_ECHOED_ITEMS and len(text) > MAX_ECHOED_CHARS:
        head = ",".join(items[:MAX_ECHOED_ITEMS])[:MAX_ECHOED_CHARS]
        return f"{head + ',...'!r} ({len(items)} comma-separated values)"
    if len(text) > MAX_ECHOED_CHARS:
        return f"{shortened(text)!r} ({len(text)} characters)"
    return repr(text)


def echo_items(values: Sequence[Any]) -> str:
    """A list as an error message shows it: ``[0, 1, 2]``, or its first items and their number when long."""
    shown = ", ".join(shortened(repr(value)) for value in values[:MAX_ECHOED_ITEMS])
    if len(values) > MAX_ECHOED_ITEMS:
        return f"[{shown}, ...] ({len(values)} values)"
    return f"[{shown}]"


def shortened(text: str) -> str:
    """``text`` unquoted, cut after :data:`MAX_ECHOED_CHARS` characters (marked by "...")."""
    return text if len(text) <= MAX_ECHOED_CHARS else text[:MAX_ECHOED_CHARS] + "..."


def first_repeat(values: Iterable[Any]) -> Any | None:
    """The first value seen twice (None when each is given once); one pass over hashable values, never None."""
    seen: set[Any] = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    return None
