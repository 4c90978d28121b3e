"""Dependencies point one way (DESIGN.md, "Layers and layout"): kernels -> optim -> experiments -> cli, no cycles.

The imports are read from the source (``ast``), nothing is imported: every ``import`` and ``from ... import``
anywhere in a module counts, a function-level (deferred) one included, since it ties the modules as
surely as one at the top.  Imports under ``if TYPE_CHECKING:`` never run, so the layers and the run-time
cycles leave them out; a second graph counts them too, and must have no cycle either (a cycle held only
by type hints still ties two modules into one, the optimizer base and its features engine once did).
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


def _import_nodes(node: ast.AST, type_checking: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, at any depth, except in ``if TYPE_CHECKING:`` bodies
    (those too with ``type_checking``)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.append(child)
        elif isinstance(child, ast.If) and _is_type_checking(child.test) and not type_checking:
            for branch in child.orelse:  # the else branch does run
                found.extend(_import_nodes(branch) if not isinstance(branch, (ast.Import, ast.ImportFrom))
                             else [branch])
        else:
            found.extend(_import_nodes(child, type_checking))
    return found


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def imports_of(module: str, type_checking: bool = False) -> set[str]:
    """The modules of drmoo and drmoo_kernels that ``module`` imports (resolved to module names); with
    ``type_checking``, those imported under ``if TYPE_CHECKING:`` too."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), type_checking):
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
TYPED_GRAPH: dict[str, set[str]] = {module: imports_of(module, type_checking=True) for module in MODULES}

# Layers from the bottom up: a module may import its own layer and those below, never one above.
LAYERS = ("kernels", "core", "experiments", "cli")


def layer(module: str) -> str:
    if module.startswith("drmoo_kernels"):
        return "kernels"
    if module == "drmoo.experiments" or module.startswith("drmoo.experiments."):
        return "experiments"
    if module in ("drmoo.cli", "drmoo.__main__") or module.startswith("drmoo.cli."):
        return "cli"
    return "core"  # optim, objective, jacobian, balancer, data, models, store, ...


def test_the_graph_is_read() -> None:
    assert {"drmoo_kernels", "drmoo.optim._base", "drmoo.experiments.training", "drmoo.cli"} <= set(GRAPH)
    assert "drmoo.optim._base" in GRAPH["drmoo.optim._joint"]  # a relative import, resolved
    assert "drmoo.distributed" in GRAPH["drmoo.optim._base"]  # "from drmoo import distributed": the submodule
    assert "drmoo.experiments.training" in GRAPH["drmoo.cli.train"]  # function-level imports count


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


def test_no_import_cycles_even_through_type_hints() -> None:
    """No two modules need each other, not even for their type hints (``_base`` <-> ``_features`` and
    ``experiments.evaluation`` <-> ``experiments.training`` did, under ``TYPE_CHECKING``)."""
    cycles = _cycles(TYPED_GRAPH)
    described = ["; ".join(f"{m} -> {sorted(t for t in TYPED_GRAPH[m] if t in cycle)}" for m in cycle)
                 for cycle in cycles]
    assert not cycles, f"import cycles through type hints: {described}"


def test_type_hint_imports_are_read() -> None:
    assert "drmoo.experiments.training" not in GRAPH["drmoo.experiments.registry"]  # under TYPE_CHECKING only
    assert "drmoo.experiments.training" in TYPED_GRAPH["drmoo.experiments.registry"]
    assert _cycles({"a": {"b"}, "b": set()}) == [] and TYPED_GRAPH["drmoo.cli"] >= GRAPH["drmoo.cli"]


# The optimizer package reads as engines + methods + bookkeeping: how task gradients are taken (the Jacobian
# engines and their interface) and the bookkeeping of a step never import the base class or a method; the
# dependency points from the optimizer to them.
OPTIM = "drmoo.optim"
ENGINES = ("_engine", "_parameters", "_features", "_direction")
BOOKKEEPING = ("_hyperparameters", "_state_dict", "_head_grads", "_agreement", "_shared_reach", "_losses", "_guards")
METHODS = ("mgda", "double_clip", "double_loop", "modo", "moco", "sdmgrad", "nashmtl", "famo", "_joint")


@pytest.mark.parametrize("name", ENGINES + BOOKKEEPING)
def test_engines_and_bookkeeping_import_no_optimizer(name: str) -> None:
    module = f"{OPTIM}.{name}"
    assert module in TYPED_GRAPH, f"{module} is missing: update the expected layout of drmoo.optim"
    above = sorted(t for t in TYPED_GRAPH[module] if t in {f"{OPTIM}.{m}" for m in ("_base", *METHODS)} | {OPTIM})
    assert not above, f"{module} imports {above} (type hints included): an engine or bookkeeping module must " \
                      "not depend on the optimizer it serves"


def test_the_engines_share_one_interface() -> None:
    for engine in ("_parameters", "_features"):
        assert f"{OPTIM}._engine" in GRAPH[f"{OPTIM}.{engine}"], f"{engine} must implement drmoo.optim._engine's"


MAX_CLASS_LINES = 450


def _class_sizes(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    return [(node.name, (node.end_lineno or node.lineno) - node.lineno + 1)
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_class_is_over_450_lines(module: str) -> None:
    """A class that grows past this does several jobs (MultiObjectiveOptimizer reached 843 lines)."""
    big = [(name, lines) for name, lines in _class_sizes(MODULES[module]) if lines > MAX_CLASS_LINES]
    assert not big, f"{module}: classes over {MAX_CLASS_LINES} lines: {big}; split them by job"


def test_the_class_size_rule_measures_whole_classes(tmp_path: Path) -> None:
    source = tmp_path / "big.py"
    source.write_text("class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES + "\n\nclass Small:\n    pass\n")
    assert _class_sizes(source) == [("Big", MAX_CLASS_LINES + 1), ("Small", 2)]
