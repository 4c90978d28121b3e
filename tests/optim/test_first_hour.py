"""Issue 38, a user's first hour: the features-mode caveat at run time, Double-Loop's dual_lr under
``optimizer=``, hyperparameters given as text, and a method's name held in a ``str``.

* Features mode changed the result of Double-Clip and Nash-MTL at their parameters-mode rates (their
  theta step length reads the Gram's scale) and nothing said so at run time: they, and MGDA with its
  clip, now warn once (:class:`drmoo.optim.FeaturesRateWarning`) unless ``features_rate_chosen=True``.
* ``Balancer("double-loop", ..., optimizer=opt)`` ignored ``opt``: eta stepped with ``dual_lr`` after a
  scheduler had set theta's lr to 0.  dual_lr now follows the optimizer's lr in ratio.
* ``lam="0.8"`` was silently read as 0.8.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import drmoo
from drmoo.optim import FeaturesRateWarning, _features_rate, available, create

RATE_SENSITIVE = {"double-clip", "nashmtl"}  # theta's step length reads the Gram's scale (and clipped MGDA)


@pytest.fixture(autouse=True)
def fresh_warning_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warning is issued once per class and process: each test starts with none issued."""
    monkeypatch.setattr(_features_rate, "_warned", set())


def _trunk() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 4)


def _built(method: str, **hparams: object) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drmoo.Balancer(method, _trunk().parameters(), 2, lr=1e-2, **hparams)  # type: ignore[call-overload]
    return [w for w in caught if issubclass(w.category, FeaturesRateWarning)]


@pytest.mark.parametrize("method", [m for m in available() if m != "moco"])  # MoCo refuses features mode
def test_features_mode_warns_once_exactly_for_the_methods_whose_step_length_reads_the_gram(method: str) -> None:
    first = _built(method, jacobian="features")
    assert len(first) == (method in RATE_SENSITIVE), [str(w.message) for w in first]
    if first:
        message = str(first[0].message)
        assert "jacobian='features'" in message and "features_rate_chosen=True" in message
        assert first[0].filename == __file__  # it points at the user's line, not at drmoo's
        assert not _built(method, jacobian="features")  # once per method and process
    assert not _built(method)  # parameters mode: nothing to warn about


def test_clipped_mgda_warns_and_saying_so_silences_it() -> None:
    assert len(_built("mgda", jacobian="features", clip_c1=1.0, clip_c2=0.5)) == 1
    _features_rate._warned.clear()
    assert not _built("mgda", jacobian="features", clip_c1=1.0, clip_c2=0.5, features_rate_chosen=True)
    assert not _built("double-clip", jacobian="features", features_rate_chosen=True)
    assert not _built("nashmtl", jacobian="features", features_rate_chosen=True)


def test_the_step_optimizers_warn_too_and_a_filter_silences_them() -> None:
    params = list(_trunk().parameters())
    with pytest.warns(FeaturesRateWarning, match="NashMTL with jacobian='features'"):
        drmoo.optim.NashMTL(params, 2, jacobian="features")
    _features_rate._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=FeaturesRateWarning)  # the documented alternative
        drmoo.optim.DoubleClipMGDA(params, 2, jacobian="features")
    with pytest.raises(ValueError, match="features_rate_chosen must be True or False"):
        drmoo.optim.DoubleClipMGDA(params, 2, jacobian="features", features_rate_chosen="yes")  # type: ignore[arg-type]


def _double_loop_run(lr_factors: list[float]) -> tuple[list[float], list[torch.Tensor]]:
    """Double-Loop under optimizer= with a scheduler setting theta's lr to ``lr_factors[t]`` * 0.1:
    (eta's step size used at each backward, eta after it)."""
    torch.manual_seed(0)
    trunk, heads = nn.Linear(3, 4), nn.Linear(4, 2)
    optimizer = torch.optim.SGD([*trunk.parameters(), *heads.parameters()], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factors[min(step, len(lr_factors) - 1)])
    balancer = drmoo.Balancer("double-loop", trunk.parameters(), 2, dual_lr=0.05, optimizer=optimizer)
    x, y = torch.randn(32, 3), torch.randn(32, 2)
    used, etas = [], []
    for _ in lr_factors:
        optimizer.zero_grad()
        balancer.backward((heads(trunk(x)) - y) ** 2)
        used.append(balancer.algorithm.param_groups[0]["dual_lr"])
        etas.append(balancer.eta.clone())
        optimizer.step()
        scheduler.step()
    return used, etas


def test_double_loop_dual_lr_follows_the_optimizers_lr_in_ratio() -> None:
    used, etas = _double_loop_run([1.0, 0.5, 0.0, 0.0])
    assert used == pytest.approx([0.05, 0.025, 0.0, 0.0])
    assert not torch.equal(etas[0], etas[1])  # eta moves while the rate is > 0
    assert torch.equal(etas[1], etas[2]) and torch.equal(etas[2], etas[3])  # and stops with theta's lr at 0


def test_double_loop_under_an_optimizer_starting_at_lr_0_is_refused() -> None:
    trunk = _trunk()
    optimizer = torch.optim.SGD(trunk.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="dual_lr follows the optimizer's learning rate in ratio"):
        drmoo.Balancer("double-loop", trunk.parameters(), 2, optimizer=optimizer)


@pytest.mark.parametrize("value", ["0.8", b"0.8", True])
@pytest.mark.parametrize("name", ["lam", "lr", "rho"])
def test_a_hyperparameter_given_as_text_or_a_flag_is_refused(name: str, value: object) -> None:
    params = list(_trunk().parameters())
    with pytest.raises(ValueError, match=f"{name} must be a number, got"):
        drmoo.Balancer("double-clip", params, 2, **{name: value})  # type: ignore[call-overload]
    with pytest.raises(ValueError, match=f"{name} must be a number, got"):
        create("mgda", params, 2, **{name: value})


def test_a_method_name_held_in_a_str() -> None:
    from_config: str = "famo"
    assert drmoo.method_name(from_config) == "famo"
    balancer = drmoo.Balancer(drmoo.method_name(from_config), _trunk().parameters(), 2, lr=1e-2)
    assert balancer.method == "famo"
    assert set(drmoo.MethodName.__args__) == set(available())  # type: ignore[attr-defined]
    for wrong in ("Double-Clip", "", 3):
        with pytest.raises(ValueError, match=r"unknown method .*valid choices: double-clip"):
            drmoo.method_name(wrong)  # type: ignore[arg-type]


def test_the_api_pages_table_lists_each_methods_own_hyperparameters() -> None:
    """docs/api.md's table under drmoo.Balancer names, per method, the keywords of its class beyond the
    ones every method takes: it must follow the constructors."""
    import inspect
    import re
    from pathlib import Path

    common = {"lr", "lam", "divergence", "capturable", "backend", "jacobian", "jacobian_strategy"}
    page = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    rows = dict(re.findall(r'^\| `"([a-z-]+)"` \| \[`\w+`\]\(#[\w.]+\) \| (.*) \|$', page, re.M))
    assert set(rows) == set(available())
    for name, cls in available().items():
        own = {p.name for p in inspect.signature(cls.__init__).parameters.values()
               if p.kind is inspect.Parameter.KEYWORD_ONLY} - common
        assert set(re.findall(r"`([a-z_0-9]+)`", rows[name])) == own, name


def test_the_api_page_names_no_private_module_and_no_internal_collective() -> None:
    """Issue 38: 17 pointers to drmoo.optim._features / _base and drmoo.distributed's collectives were on
    the API page.  Every docstring the page renders (its members lists) must name none."""
    import importlib
    import inspect
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    rendered = []
    for module_name, members in re.findall(r"^::: ([\w.]+)\n(?:    .*\n)*?      members: \[(.*)\]", page, re.M):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:  # a class rendered on its own (drmoo.optim.MultiObjectiveOptimizer)
            parent, _, name = module_name.rpartition(".")
            module = getattr(importlib.import_module(parent), name)
        rendered.append((module_name, inspect.getdoc(module) or ""))
        for member in members.split(", "):
            value = getattr(module, member)
            rendered.append((f"{module_name}.{member}", inspect.getdoc(value) or ""))
            # A class's own public members (mkdocstrings renders no inherited one).
            for key, attribute in vars(value).items() if inspect.isclass(value) else []:
                if not key.startswith("_") and (callable(attribute) or isinstance(attribute, property)):
                    rendered.append((f"{module_name}.{member}.{key}", inspect.getdoc(attribute) or ""))
    assert len(rendered) > 30
    private = re.compile(r"drmoo\.optim\._\w|drmoo\._\w|all_reduce_\w|fingerprint")
    found = [(name, match.group()) for name, doc in rendered for match in [private.search(doc)] if match]
    assert not found, found
