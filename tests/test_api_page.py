"""The documentation site's build-time helpers: the Balancer overloads' defaults, display formulas as MathML,
one contents entry per module on the API page, the committed results' figures served to the pages.  (The full
page is built by scripts/test.sh with --strict.)"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from types import ModuleType

import griffe

import drmoo.optim

ROOT = Path(__file__).resolve().parents[1]


def _docs_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


OVERLOADS = _docs_module("griffe_overload_defaults")
MATH = _docs_module("math_hook")
FIGURES = _docs_module("figures_hook")


def test_every_balancer_overload_shows_its_methods_defaults() -> None:
    loader = griffe.GriffeLoader(search_paths=[str(ROOT / "python")],
                                 extensions=griffe.load_extensions(OVERLOADS.OverloadDefaults))
    init = loader.load("drmoo")["balancer"]["Balancer"]["__init__"]
    overloads = init.overloads or []
    assert len(overloads) == len(drmoo.optim.available())
    for overload in overloads:
        method = str(next(p for p in overload.parameters if p.name == "method").annotation.slice).strip("'\"")
        defaults = inspect.signature(drmoo.optim.available()[method].__init__).parameters
        for parameter in overload.parameters:
            assert parameter.default != "...", f"Balancer({method!r}): {parameter.name} shows '...'"
            if parameter.name in defaults and defaults[parameter.name].default is not inspect.Parameter.empty:
                assert parameter.default == repr(defaults[parameter.name].default), (method, parameter.name)
    double_clip = next(o for o in overloads if "double-clip" in str(o.parameters["method"].annotation))
    assert double_clip.parameters["lam"].default == "0.8"


def test_a_display_formula_becomes_mathml_and_code_is_left_alone() -> None:
    page = "text\n\n$$\nL^i = \\lambda\n$$\n\n```bash\necho $$\n```\n"
    converted = MATH.display_math(page)
    assert '<div class="math-display"><math' in converted and 'display="block"' in converted
    assert "$$\nL^i" not in converted
    assert converted.endswith("```bash\necho $$\n```\n")


def test_the_api_page_lists_each_module_once_in_its_contents() -> None:
    """A `:::` block under the page's own "## module" heading hides its root heading; without
    show_root_toc_entry: false mkdocstrings still added a second contents entry for the module."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "\n            show_root_toc_entry: false\n" in config  # the python handler's options
    assert "- docs/griffe_overload_defaults.py:OverloadDefaults" in config
    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert api.count("show_root_heading: false") == api.count(":::")


def test_the_results_figures_join_the_site_and_a_missing_one_fails_the_build(tmp_path: Path) -> None:
    import pytest
    from mkdocs.config import load_config
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import Files

    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"))
    config.plugins._current_plugin = "figures_hook"  # what mkdocs sets while it runs a hook's event
    served = FIGURES.on_files(Files([]), config)
    assert sorted(file.src_uri for file in served) == sorted(f"results/figures/{name}" for name in FIGURES.FIGURES)
    assert all(Path(file.abs_src_path).read_bytes().startswith(b"\x89PNG") for file in served)
    config["config_file_path"] = str(tmp_path / "mkdocs.yml")  # a root without the results
    with pytest.raises(PluginError, match="is missing"):
        FIGURES.on_files(Files([]), config)
