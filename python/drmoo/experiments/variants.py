"""Method variants for ``drmoo compare --methods``: ``NAME`` or ``NAME[KEY=VALUE,...]``.

A comparison often needs the same method twice with different settings: reference rows (MGDA with
its preference frozen at uniform, ``mgda[pref_lr=0]``; MGDA with the exact min-norm solver,
``mgda[solver=min_norm]``), an ablation (``double-clip[lam=0.4]``) or an equal-budget row
(``double-clip[epochs=8]``).  A variant's text is its label: the name of its row in every table and
(made filesystem-safe) of its run directories.  Keys are the method's hyperparameters, except the
run-length fields ``epochs`` and ``max_steps``, which set the run's budget.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .run_config import MAX_LABEL

__all__ = ["RUN_KEYS", "MethodVariant", "expand_all", "parse_variants", "run_dir_name"]

RUN_KEYS = ("epochs", "max_steps")  # keys that set the run's length instead of a hyperparameter
_MAX_TEXT = 2000  # a --methods value longer than this is a mistake, not a comparison
_SPEC = re.compile(r"^(?P<method>[a-z0-9][a-z0-9_-]*)(?:\[(?P<settings>[^\[\]]*)\])?$")
_KEY = re.compile(r"^[a-z_][a-z0-9_]*$")


@dataclass(frozen=True)
class MethodVariant:
    """One row of a comparison: a registered method, its setting overrides and its label."""

    method: str
    hparams: dict[str, Any] = field(default_factory=dict)
    run: dict[str, int] = field(default_factory=dict)  # epochs / max_steps
    label: str = ""  # "" for the plain method (its row is called by the method's name)

    @property
    def name(self) -> str:
        return self.label or self.method


def _split_top_level(text: str) -> list[str]:
    """Split at the commas that are not inside [...]."""
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in {text!r}")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in {text!r}")
    parts.append("".join(current))
    return [part.strip() for part in parts]


def _value(text: str) -> Any:
    """A Python literal (number, bool, None, quoted string), else the bare word itself (e.g. min_norm)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    raise ValueError(f"a variant setting is a number, a bool or a word, got {text!r}")


def parse_variants(text: str) -> list[MethodVariant]:
    """``"double-clip,mgda[pref_lr=0],double-clip[lam=0.4]"`` -> one variant per item, in order.

    ``all`` stays a plain item (the caller expands it).  Duplicates are refused: two rows with the
    same settings would count one result twice.
    """
    if len(text) > _MAX_TEXT:
        raise ValueError(f"--methods is {len(text)} characters long (at most {_MAX_TEXT})")
    variants: list[MethodVariant] = []
    for item in _split_top_level(text):
        if not item:
            raise ValueError(f"empty method name in {text!r}")
        match = _SPEC.match(item)
        if match is None:
            raise ValueError(f"cannot read the method {item!r}: expected NAME or NAME[KEY=VALUE,...]")
        hparams: dict[str, Any] = {}
        run: dict[str, int] = {}
        settings = match.group("settings")
        if settings is not None:
            for setting in settings.split(","):
                key, sep, raw = (part.strip() for part in setting.partition("="))
                if not sep or not _KEY.match(key) or not raw:
                    raise ValueError(f"cannot read the setting {setting.strip()!r} of {item!r}: expected KEY=VALUE")
                if key in hparams or key in run:
                    raise ValueError(f"{item!r} sets {key} twice")
                value = _value(raw)
                if key in RUN_KEYS:
                    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**9:
                        raise ValueError(f"{key} in {item!r} must be an integer in [1, 1e9], got {raw!r}")
                    run[key] = value
                else:
                    hparams[key] = value
        label = item if settings is not None else ""
        if len(label) > MAX_LABEL:  # before the run config says it in its own words
            raise ValueError(f"the variant {item[:40]!r}... is {len(item)} characters long; a variant's text labels "
                             f"its row and names its run directories, so it is at most {MAX_LABEL} characters")
        variants.append(MethodVariant(match.group("method"), hparams, run, label))
    names = [variant.name for variant in variants]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"--methods names {', '.join(duplicates)} more than once (each row must be a different run)")
    return variants


def expand_all(text: str, methods: Sequence[str]) -> str:
    """``text`` with its item ``all`` replaced by every method in ``methods`` (in their order).

    ``all,mgda[pref_lr=0]`` is every method plus one variant.  ``all+VARIANT`` (an older help's
    spelling) is refused with the spelling that works, not read as a method's name.
    """
    items = _split_top_level(text)
    for item in items:
        if item.startswith("all+"):
            raise ValueError(f"cannot read {item!r}: write all,{item[len('all+'):]} (all, then each variant to add, "
                             "separated by commas)")
    expanded: list[str] = []
    for item in items:
        expanded.extend(methods if item == "all" else [item])
    return ",".join(expanded)


def run_dir_name(label: str, seed: int) -> str:
    """The run directory of a label and seed: ``mgda[pref_lr=0]`` -> ``mgda_pref_lr-0-seed3``."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", label.replace("=", "-")).strip("_")
    return f"{slug}-seed{seed}"
