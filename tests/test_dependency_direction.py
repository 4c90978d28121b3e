"""Dependencies point one way (DESIGN.md, "Layers and layout"): kernels -> optim -> experiments -> cli, no cycles.

The imports are read from the source (``ast``), nothing is imported: every ``import`` and ``from ... import``
anywhere in a module counts, a function-level (deferred) one included, since it ties the modules as
surely as one at the top.  Only imports under ``if TYPE_CHECKING:`` are left out: they never run.
``from package import name`` counts as an import of the submodule ``package.name`` when that is a module
file, else of the package itself.  Importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` too,
but Python initialises a package before its submodules, so a submodule that imports its siblings does not
close a loop through its package: no edge is drawn to the packages above an imported module.  The lazy
names of ``drmoo/__init__.py`` (PEP 562, ``importlib`` on first use) and the registry's import of the
built-in experiments by name are no import statements and are not read: both run on first use, not at
import, and load modules of their own layer or below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "python"
PACKAGES = ("drmoo", "drmoo_kernels")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(path): path for package in PACKAGES
                            for path in sorted((SOURCE / package).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, at any depth, except in ``if TYPE_CHECKING:`` bodies."""
    found: list[ast.Import | ast.ImportFrom] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.append(child)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for branch in child.orelse:  # the else branch does run
                found.extend(_import_nodes(branch) if not isinstance(branch, (ast.Import, ast.ImportFrom))
                             else [branch])
        else:
            found.extend(_import_nodes(child))
    return found


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def imports_of(module: str) -> set[str]:
    """The modules of drmoo and drmoo_kernels that ``module`` imports (resolved to module names)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names if _ours(alias.name))
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        if not _ours(base):
            continue
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            targets.add(submodule if submodule in MODULES else base)
    unknown = sorted(t for t in targets if t not in MODULES)
    assert not unknown, f"{module} imports {unknown}, which are not modules under {SOURCE}"
    return targets - {module}


GRAPH: dict[str, set[str]] = {module: imports_of(module) for module in MODULES}

# Layers from the bottom up: a module may import its own layer and those below, never one above.
LAYERS = ("kernels", "core", "experiments", "cli")


def layer(module: str) -> str:
    if module.startswith("drmoo_kernels"):
        return "kernels"
    if module == "drmoo.experiments" or module.startswith("drmoo.experiments."):
        return "experiments"
    if module in ("drmoo.cli", "drmoo.__main__"):
        return "cli"
    return "core"  # optim, objective, jacobian, balancer, data, models, store, ...


def test_the_graph_is_read() -> None:
    assert {"drmoo_kernels", "drmoo.optim._base", "drmoo.experiments.training", "drmoo.cli"} <= set(GRAPH)
    assert "drmoo.optim._base" in GRAPH["drmoo.optim._joint"]  # a relative import, resolved
    assert "drmoo.distributed" in GRAPH["drmoo.optim._base"]  # "from drmoo import distributed": the submodule
    assert "drmoo.experiments.training" in GRAPH["drmoo.cli"]  # function-level imports count


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_points_up(module: str) -> None:
    """drmoo_kernels imports nothing of drmoo; optim (the core) nothing of experiments or the CLI;
    experiments nothing of the CLI."""
    rank = LAYERS.index(layer(module))
    upward = sorted(target for target in GRAPH[module] if LAYERS.index(layer(target)) > rank)
    assert not upward, f"{module} ({layer(module)}) imports {upward}, a layer above it"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = lowlink[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = lowlink[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    lowlink[node] = min(lowlink[node], index[successor])
            else:
                work.pop()
                if work:
                    lowlink[work[-1][0]] = min(lowlink[work[-1][0]], lowlink[node])
                if lowlink[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def test_no_import_cycles() -> None:
    cycles = _cycles(GRAPH)
    described = ["; ".join(f"{m} -> {sorted(t for t in GRAPH[m] if t in cycle)}" for m in cycle) for cycle in cycles]
    assert not cycles, f"import cycles (deferred imports included): {described}"


def test_the_cycle_finder_finds_a_deferred_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
