"""The API reference (docs/api.md, built by mkdocstrings) has no holes that ``mkdocs build --strict`` lets through.

The site is built once into a temporary folder; the objects checked are exactly those the API page
renders (its headings' anchors), read with Griffe as mkdocstrings reads them (Google docstrings, after
docs/griffe_rst.py).  What each test guards:

* every rendered function, method and class documents every parameter of its signature in its
  parameter table, and no parameter that is not there (``dual_objective`` once lacked ``divergence``
  and ``sample_weight``, written two to a line; ``worst_case_weights`` had no table at all);
* formulas are MathML written at build time (no raw LaTeX, no script or font from another host), and
  no formula or code fragment turns into italics (``f*'(u)`` did);
* the optimizers' base class shows what a training loop uses, not its ~15 helpers for implementing a
  method.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import griffe
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _griffe_rst() -> ModuleType:
    spec = importlib.util.spec_from_file_location("griffe_rst_for_tests", ROOT / "docs" / "griffe_rst.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GRIFFE_RST = _griffe_rst()


@pytest.fixture(scope="module")
def api_page(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The API page's HTML, from a real ``mkdocs build --strict`` of this checkout."""
    site = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
        cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return (site / "api" / "index.html").read_text(encoding="utf-8")


def rendered_paths(page: str) -> list[str]:
    """The dotted paths of the objects the page documents, in page order (mkdocstrings' heading ids)."""
    return re.findall(r'<h\d id="([\w.]+)" class="doc doc-heading"', page)


@pytest.fixture(scope="module")
def packages() -> griffe.ModulesCollection:
    """drmoo and drmoo_kernels as mkdocstrings sees them (mkdocs.yml: paths [python], Google style, our extension)."""
    loader = griffe.GriffeLoader(
        search_paths=[str(ROOT / "python")], docstring_parser=griffe.Parser.google,
        extensions=griffe.load_extensions(GRIFFE_RST.RestructuredTextToMarkdown),
    )
    for package in ("drmoo", "drmoo_kernels"):
        loader.load(package)
    loader.resolve_aliases(external=False, implicit=False)
    return loader.modules_collection


def _lookup(collection: griffe.ModulesCollection, path: str) -> griffe.Object:
    package, _, rest = path.partition(".")
    obj = collection[package][rest] if rest else collection[package]
    return obj.final_target if obj.is_alias else obj


def documented_parameters(obj: griffe.Object) -> list[str]:
    """The names in an object's parameter tables (``*args`` / ``**kwargs`` written with or without stars)."""
    if obj.docstring is None:
        return []
    return [parameter.name.lstrip("*") for section in obj.docstring.parsed
            if section.kind in (griffe.DocstringSectionKind.parameters, griffe.DocstringSectionKind.other_parameters)
            for parameter in section.value]


def signature_parameters(function: griffe.Function) -> list[str]:
    return [parameter.name for parameter in function.parameters if parameter.name not in ("self", "cls")]


def parameter_table_problems(obj: griffe.Object) -> str | None:
    """What an object's parameter table gets wrong against its signature, or None."""
    if obj.is_function:
        signature, documented = signature_parameters(obj), documented_parameters(obj)
    elif obj.is_class:
        init = obj.all_members.get("__init__")
        if init is None:
            return None
        init = init.final_target if init.is_alias else init
        # mkdocstrings shows the class docstring's table; an __init__ docstring's table counts as well
        signature, documented = signature_parameters(init), documented_parameters(obj) + documented_parameters(init)
    else:  # attributes and properties take no parameters
        return None
    missing = [name for name in signature if name not in documented]
    unknown = [name for name in documented if name not in signature]
    if not missing and not unknown:
        return None
    return f"{obj.path}: " + "; ".join(
        part for part in (f"not in its parameter table: {', '.join(missing)}" if missing else "",
                          f"documented but not in its signature: {', '.join(unknown)}" if unknown else "") if part)


def test_every_rendered_object_documents_every_parameter(api_page: str, packages: griffe.ModulesCollection) -> None:
    paths = rendered_paths(api_page)
    # the page's sections (docs/api.md): a finder that found nothing would pass silently
    for expected in ("drmoo.dual_objective", "drmoo.worst_case_weights", "drmoo.balancer.Balancer.backward",
                     "drmoo.optim.DoubleClipMGDA", "drmoo.optim.DoubleClipMGDA.step", "drmoo.distributed.shard",
                     "drmoo_kernels.get_divergence"):
        assert expected in paths, expected
    checked = [_lookup(packages, path) for path in paths]
    assert sum(obj.is_function for obj in checked) >= 25
    problems = [problem for obj in checked if (problem := parameter_table_problems(obj)) is not None]
    assert not problems, "\n".join(problems)


def test_the_check_sees_two_arguments_on_one_line_and_a_missing_table() -> None:
    """The two holes the reference had, as Griffe parses them: the test above must call them problems."""
    module = griffe.visit("probe", Path("probe.py"), code='''
def two_on_a_line(lam, divergence="chi2"):
    """Summary.

    Args:
        lam: lambda > 0.  divergence: a name.
    """

def no_table(losses, eta):
    """Summary only."""

def complete(lam, *tensors, **overrides):
    """Summary.

    Args:
        lam: lambda.
        *tensors: tensors.
        **overrides: more.
    """
''', docstring_parser=griffe.Parser.google)
    assert parameter_table_problems(module["two_on_a_line"]) == (
        "probe.two_on_a_line: not in its parameter table: divergence")
    assert parameter_table_problems(module["no_table"]) == "probe.no_table: not in its parameter table: losses, eta"
    assert parameter_table_problems(module["complete"]) is None


def _outside_code(page: str) -> str:
    """The page's text with code blocks, code spans, MathML and tags removed."""
    text = re.sub(r"<(pre|code|math|script|style)\b.*?</\1>", " ", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", text))


def test_formulas_are_mathml_and_nothing_is_fetched_from_another_host(api_page: str) -> None:
    formulas = re.findall(r'<span class="math"><math xmlns="http://www.w3.org/1998/Math/MathML"', api_page)
    assert len(formulas) >= 10, len(formulas)  # dual_objective's, the divergences', Double-Clip's ...
    raw_latex = re.findall(r".{0,40}\\(?:lambda|mathrm|mathbb|eta|ell|omega|frac|sqrt|hat)\b.{0,40}",
                           _outside_code(api_page))
    assert not raw_latex, raw_latex
    # what a browser would load: scripts, stylesheets, fonts (links to other sites are fine)
    fetched = re.findall(r'<(?:script|link|img)\b[^>]*(?:src|href)="(https?:[^"]+)"', api_page)
    assert not fetched, fetched


def test_no_formula_turns_into_italics(api_page: str) -> None:
    """Markdown reads ``f*'(u) ... f*'(v)`` as emphasis; the docstrings' emphasis is only ever words."""
    emphasised = re.findall(r"<em>(.*?)</em>", api_page, flags=re.S)
    assert emphasised  # "required" in the parameter tables: the finder works
    not_words = [text for text in emphasised if not re.fullmatch(r"[A-Za-z][A-Za-z\s-]*", text)]
    assert not not_words, not_words


def test_the_base_class_shows_what_a_training_loop_uses(api_page: str) -> None:
    members = {path.rsplit(".", 1)[1] for path in rendered_paths(api_page)
               if path.startswith("drmoo.optim.MultiObjectiveOptimizer.")}
    assert {"w", "eta", "preset", "load_state_dict", "add_param_group"} <= members, members
    internals = {"task_jacobian", "apply_direction", "draw_losses", "commit_", "check_dual", "dual_forward"}
    assert not members & internals, members & internals


def test_math_markup_is_safe_inside_markdown() -> None:
    converted = GRIFFE_RST.rst_to_markdown(r"ratio :math:`f^{*\prime}(u_b^i)` and :func:`~drmoo.x` *word*")
    assert converted.startswith('ratio <span class="math"><math ')
    assert converted.endswith("</math></span> and `drmoo.x` *word*")
    formula = converted[: converted.index("</span>")]
    assert not set("*_[]`\\") & set(formula), formula


def test_signatures_are_wrapped_code_blocks_not_heading_lines(api_page: str) -> None:
    """A signature inside a heading is one line that cannot wrap or scroll, and ran past the page
    (``Balancer(method, params, num_tasks, ..., **hparams)``); mkdocs.yml puts it in a code block
    under the heading, formatted to 80 columns."""
    headings = re.findall(r'<h\d id="[\w.]+" class="doc doc-heading">(.*?)</h\d>', api_page, flags=re.S)
    with_signature = [heading for heading in headings if "(" in re.sub(r"<[^>]+>", "", heading)]
    assert not with_signature, with_signature[:3]
    signatures = re.findall(r'<div class="doc-signature highlight"><pre>(.*?)</pre>', api_page, flags=re.S)
    assert len(signatures) >= 25
    lines = [line for block in signatures for line in html.unescape(re.sub(r"<[^>]+>", "", block)).splitlines()]
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)


def test_the_docs_build_refuses_to_run_without_a_signature_formatter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Black or Ruff mkdocstrings wrote every signature on one unbroken line and said so only at the
    info level (the strict build passed): the extension now stops the build with the install line."""
    GRIFFE_RST.RestructuredTextToMarkdown()  # ruff is installed here: no complaint
    for name in ("black", "ruff", "ruff.__main__"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(RuntimeError, match=r"neither is installed here: pip install ruff"):
        GRIFFE_RST.RestructuredTextToMarkdown()
