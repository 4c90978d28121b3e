"""Issue 28, item 3: type checkers see drmoo's public API as typed as it is at run time.

``drmoo.Balancer("dubble-clip", p, num_tasks=2, lam="0.8")`` passed mypy and pyright (``method: str``,
``**hparams: Any``) and failed only when run.  Now ``method`` is a Literal of the eight names and each
method's hyperparameters are typed (one overload per method).  Checked here:

* mypy --strict (the repository's configuration, pyproject.toml's [tool.mypy]) accepts the public
  entry points (the package, drmoo.Balancer, drmoo.optim's registry, drmoo.distributed) and
  usage_ok.py, and rejects every line of usage_bad.py marked ``# rejected`` -- and no other line
  (test_mypy_tree.py checks the whole python/ tree);
* pyright (strict) does the same with the two usage files;
* each overload lists exactly its method's constructor keywords, so that the types cannot drift from
  the classes.

mypy keeps its cache in .mypy_cache at the repository root: a warm run takes a few seconds (a cold
one about a minute, most of it reading torch).
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

from drmoo.optim import available

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PUBLIC_MODULES = ["python/drmoo/__init__.py", "python/drmoo/balancer.py", "python/drmoo/distributed.py",
                  "python/drmoo/optim/__init__.py"]
BALANCER_OWN_KEYWORDS = {"optimizer", "allow_partial_shared", "jacobian", "jacobian_strategy", "check_trunk_gradients"}


def rejected_lines(path: Path) -> set[int]:
    return {number for number, line in enumerate(path.read_text().splitlines(), 1) if "# rejected" in line}


def run(command: list[str]) -> str:
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    return result.stdout + result.stderr


def errors_by_file(output: str, pattern: str) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {}
    for match in re.finditer(pattern, output, flags=re.MULTILINE):
        found.setdefault(Path(match["path"]).name, set()).add(int(match["line"]))
    return found


def assert_only_the_rejected_lines_fail(found: dict[str, set[int]], output: str) -> None:
    assert set(found) <= {"usage_bad.py"}, f"errors outside usage_bad.py:\n{output}"
    expected = rejected_lines(HERE / "usage_bad.py")
    assert found.get("usage_bad.py", set()) == expected, (
        f"lines with errors {sorted(found.get('usage_bad.py', set()))}, lines marked rejected {sorted(expected)}:\n"
        f"{output}")


def test_mypy_strict_accepts_the_public_api_and_typed_use_and_rejects_each_misuse() -> None:
    output = run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir",
                  str(ROOT / ".mypy_cache"), "--hide-error-context", "--no-pretty", "--no-error-summary",
                  *PUBLIC_MODULES, str(HERE / "usage_ok.py"), str(HERE / "usage_bad.py")])
    found = errors_by_file(output, r"^(?P<path>[^:\n]+\.py):(?P<line>\d+): error:")
    assert "error" not in output.replace("usage_bad.py", "") or found, output  # e.g. a config error
    assert_only_the_rejected_lines_fail(found, output)


def test_pyright_accepts_typed_use_and_rejects_each_misuse() -> None:
    pyright = Path(sys.executable).parent / "pyright"
    assert pyright.exists(), "pyright is in requirements-dev.txt: install it into this environment"
    output = run([str(pyright), "-p", str(HERE / "pyrightconfig.json"), "--pythonpath", sys.executable])
    found = errors_by_file(output, r"^\s*(?P<path>/[^:\n]+\.py):(?P<line>\d+):\d+ - error")
    assert "usage_bad.py" in output, output  # pyright ran and read the files
    assert_only_the_rejected_lines_fail(found, output)


def overload_keywords() -> dict[str, set[str]]:
    """{method: the keyword-only names of its overload of Balancer.__init__}, read from the source."""
    source = (ROOT / "python" / "drmoo" / "balancer.py").read_text()
    balancer = next(node for node in ast.parse(source).body
                    if isinstance(node, ast.ClassDef) and node.name == "Balancer")
    keywords: dict[str, set[str]] = {}
    for node in balancer.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__" and any(
                isinstance(d, ast.Name) and d.id == "overload" for d in node.decorator_list):
            annotation = node.args.args[1].annotation
            assert isinstance(annotation, ast.Subscript) and isinstance(annotation.slice, ast.Constant)
            keywords[annotation.slice.value] = {arg.arg for arg in node.args.kwonlyargs}
    return keywords


def test_each_overload_lists_exactly_its_methods_hyperparameters() -> None:
    import drmoo.balancer

    overloads = overload_keywords()
    assert set(overloads) == set(available())
    assert set(drmoo.balancer.MethodName.__args__) == set(available())
    for name, cls in available().items():
        constructor = inspect.signature(cls.__init__).parameters.values()
        own = {p.name for p in constructor if p.kind is inspect.Parameter.KEYWORD_ONLY}
        assert overloads[name] - BALANCER_OWN_KEYWORDS == own - BALANCER_OWN_KEYWORDS, name
        assert BALANCER_OWN_KEYWORDS <= overloads[name], name
