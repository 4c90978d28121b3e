"""Issue 35, item 3: ``jacobian_strategy`` is a constructor argument of every optimizer and of
``drmoo.optim.create`` (as it is of ``drmoo.Balancer``), checked once, by ``drmoo.jacobian.check_strategy``.

It stays what the ``jacobian_strategy`` property always was: how this process computes the per-task gradients
(the same gradients up to rounding), not a hyperparameter -- neither in ``param_groups`` nor in ``state_dict``,
so loading a state keeps the strategy the optimizer was built with.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import drmoo
from drmoo.jacobian import STRATEGIES
from drmoo.optim import MultiObjectiveOptimizer, available, create

METHODS = sorted(available())


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(3))]


def _class(name: str) -> Any:
    """The method's class, typed loosely: each constructor has its own keywords."""
    return available()[name]


@pytest.mark.parametrize("name", METHODS)
def test_every_constructor_takes_it_with_default_auto(name: str) -> None:
    parameter = inspect.signature(_class(name).__init__).parameters["jacobian_strategy"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default == "auto"
    assert _class(name)(_params(), 2).jacobian_strategy == "auto"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", METHODS)
def test_every_method_and_create_end_up_with_the_strategy_given(name: str, strategy: str) -> None:
    assert _class(name)(_params(), 2, jacobian_strategy=strategy).jacobian_strategy == strategy
    built = create(name, _params(), 2, jacobian_strategy=strategy)
    assert built.jacobian_strategy == strategy
    assert "jacobian_strategy" not in built.defaults and "jacobian_strategy" not in built.param_groups[0]


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("bad", ["vmap", "Loop", "", None, 1])
def test_a_bad_strategy_is_refused_by_name(name: str, bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"unknown Jacobian strategy {bad!r}; valid choices: auto, loop, batched"):
        _class(name)(_params(), 2, jacobian_strategy=bad)
    with pytest.raises(ValueError, match=rf"unknown Jacobian strategy {bad!r}"):
        create(name, _params(), 2, jacobian_strategy=bad)


def test_the_check_is_the_one_in_drmoo_jacobian(monkeypatch: pytest.MonkeyPatch) -> None:
    """One validation: the constructors go through the property, which calls drmoo.jacobian.check_strategy."""
    from drmoo.jacobian import check_strategy

    calls: list[str] = []

    def counting_check(value: str) -> str:
        calls.append(value)
        return check_strategy(value)

    monkeypatch.setattr("drmoo.optim._base.check_strategy", counting_check)
    for name in METHODS:
        create(name, _params(), 2, jacobian_strategy="batched")
    assert calls == ["batched"] * len(METHODS)


def test_the_balancer_passes_it_to_the_constructor() -> None:
    balancer = drmoo.Balancer("double-clip", _params(), 2, lr=0.1, jacobian_strategy="batched")
    assert balancer.algorithm.jacobian_strategy == "batched"
    with pytest.raises(ValueError, match="unknown Jacobian strategy 'vmap'"):
        drmoo.Balancer("double-clip", _params(), 2, lr=0.1, jacobian_strategy="vmap")  # type: ignore[call-overload]


def _stepped(name: str, strategy: str) -> MultiObjectiveOptimizer:
    torch.manual_seed(0)
    theta = nn.Parameter(torch.randn(3))
    optimizer = create(name, [theta], 2, jacobian_strategy=strategy)
    x = torch.randn(8, 3)

    def closure() -> torch.Tensor:
        return torch.stack([(x @ theta - 1.0) ** 2, (x @ theta + 1.0) ** 2], dim=1)

    optimizer.step(closure)
    return optimizer


@pytest.mark.parametrize("name", ["mgda", "double-clip"])
def test_it_is_not_training_state(name: str) -> None:
    """Saved under "loop", loaded into one built "batched": the loaded one keeps "batched" (the strategies
    give the same gradients to rounding: a resumed run may take another device's); a copy keeps its own."""
    saved = _stepped(name, "loop").state_dict()
    assert "jacobian_strategy" not in str(saved)
    resumed = _stepped(name, "batched")
    resumed.load_state_dict(saved)
    assert resumed.jacobian_strategy == "batched"
    assert copy.deepcopy(resumed).jacobian_strategy == "batched"


def test_the_cli_flag_reaches_the_optimizer_and_hp_refuses_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    # drmoo train needs the experiments extra; the oldest-torch CI leg (tests/optim only) installs none.
    pytest.importorskip("torchvision", reason="drmoo train needs torchvision (the 'experiments' extra)")
    from drmoo import cli
    from drmoo.experiments import training

    built: list[MultiObjectiveOptimizer] = []

    def recording_create(*args: Any, **kwargs: Any) -> MultiObjectiveOptimizer:
        built.append(create(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(training, "create", recording_create)
    argv = ["train", "--experiment", "multimnist2", "--preset", "quick", "--input-size", "16", "--train-size", "32",
            "--test-size", "16", "--batch-size", "16", "--max-steps", "1", "--weights", "none", "--quiet",
            "--cache-dir", str(tmp_path / "cache")]
    assert cli.main([*argv, "--jacobian-strategy", "batched", "--out", str(tmp_path / "run")]) == 0
    assert [optimizer.jacobian_strategy for optimizer in built] == ["batched"]
    assert cli.main([*argv, "--hp", "jacobian_strategy=batched", "--out", str(tmp_path / "hp")]) == 2
    assert "use --jacobian-strategy instead of --hp jacobian_strategy" in capsys.readouterr().err
    assert not (tmp_path / "hp").exists()
