"""One experiment registry, and no import cycle among drmoo.experiments' modules (issue 14, item 4)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import drmoo.experiments

PACKAGE = "drmoo.experiments"
FOLDER = Path(drmoo.experiments.__file__).parent


def _imported_siblings(path: Path) -> set[str]:
    """The drmoo.experiments modules ``path`` imports anywhere (functions included; TYPE_CHECKING blocks not)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skipped.update(id(child) for block in node.body for child in ast.walk(block))
    siblings = {p.stem for p in FOLDER.glob("*.py")} - {"__init__"}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                names = [node.module] if node.module else [alias.name for alias in node.names]
            elif node.module and node.module.startswith(PACKAGE + "."):
                names = [node.module[len(PACKAGE) + 1:]]
            elif node.module == PACKAGE:
                names = [alias.name for alias in node.names]
            else:
                names = []
            found.update(name.split(".")[0] for name in names)
        elif isinstance(node, ast.Import):
            found.update(alias.name[len(PACKAGE) + 1:].split(".")[0] for alias in node.names
                         if alias.name.startswith(PACKAGE + "."))
    return found & siblings


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt] if nxt in path else [*path, nxt]
            if nxt not in state:
                found = visit(nxt, [*path, nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_experiments_have_no_import_cycle() -> None:
    graph = {path.stem: _imported_siblings(path) for path in FOLDER.glob("*.py") if path.stem != "__init__"}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    # The trainer knows no experiment: the experiments register into the registry, which imports none of them.
    assert graph["training"] & {"celeba", "multimnist", "robustness", "registry"} == set()
    assert graph["registry"] == set()


def test_every_builtin_experiment_is_registered_in_a_fresh_interpreter() -> None:
    code = ("from drmoo.experiments.registry import experiments; "
            "print(','.join(sorted(experiments())))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ("celeba,celeba40,mnist-attributes,mnist-attributes-unweighted,"
                           "multimnist2,multimnist3,multimnist4,multimnist9")


def test_unknown_experiment_and_a_second_registration_are_refused() -> None:
    from drmoo.experiments.registry import get_experiment, register

    with pytest.raises(ValueError, match=r"unknown experiment 'imagenet'; valid choices: .*multimnist2"):
        get_experiment("imagenet")
    celeba = get_experiment("celeba")
    assert register(celeba) is celeba  # importing twice is harmless
    clash = type(celeba)(**{**celeba.__dict__, "presets": {}})
    with pytest.raises(ValueError, match="already registered"):
        register(clash)
