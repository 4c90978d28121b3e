"""Features mode's trunk-gradient check (``check_trunk_gradients``): on by default, it stops a step whose lifted
trunk gradients hold a NaN/Inf before ``.grad`` is written; off, they are written unread as a plain backward
writes them, every other guard of the step still runs, and a finite step is the same step bit for bit.

The trunk below makes a NaN gradient from finite losses: ``sqrt(0 * b)`` is 0 forwards and its backward is
``0.5 / sqrt(0) * 0 = inf * 0 = NaN`` for ``b``; nothing above z (the losses, the rows w.r.t. z) sees it.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import drmoo
from drmoo.optim import NonFiniteStepError, create

METHODS = ("mgda", "double-clip", "famo")


class Trunk(nn.Module):
    def __init__(self, nan_gradient: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.b = nn.Parameter(torch.ones(3))
        self.nan_gradient = nan_gradient

    def forward(self, x: Tensor) -> Tensor:
        z = torch.tanh(self.linear(x))
        if self.nan_gradient:
            z = z + torch.sqrt(0.0 * self.b)  # 0 forwards, NaN into b.grad backwards
        return z


def problem(nan_gradient: bool, seed: int = 0) -> tuple[Trunk, nn.Linear, Tensor]:
    torch.manual_seed(seed)
    trunk, heads = Trunk(nan_gradient), nn.Linear(3, 2)
    return trunk, heads, torch.randn(8, 4)


def balancer_of(method: str, trunk: nn.Module, **options: object) -> drmoo.Balancer:
    return drmoo.Balancer(method, trunk.parameters(), 2, jacobian="features", lr=0.1, features_rate_chosen=True,
                          **options) if method != "famo" else \
        drmoo.Balancer(method, trunk.parameters(), 2, jacobian="features", lr=0.1, **options)


@pytest.mark.parametrize("method", METHODS)
def test_by_default_a_nan_trunk_gradient_stops_the_step_before_grad_is_written(method: str) -> None:
    trunk, heads, x = problem(nan_gradient=True)
    balancer = balancer_of(method, trunk)
    z = trunk(x)
    with pytest.raises(NonFiniteStepError, match="backward pass through the trunk"):
        balancer.backward(heads(z) ** 2, features=z)
    assert all(param.grad is None for param in trunk.parameters())
    assert balancer.steps_taken == 0


@pytest.mark.parametrize("method", METHODS)
def test_unchecked_a_nan_trunk_gradient_is_written_as_a_plain_backward_writes_it(method: str) -> None:
    trunk, heads, x = problem(nan_gradient=True)
    balancer = balancer_of(method, trunk, check_trunk_gradients=False)
    z = trunk(x)
    balancer.backward(heads(z) ** 2, features=z)
    assert trunk.b.grad is not None and torch.isnan(trunk.b.grad).all()
    assert trunk.linear.weight.grad is not None and torch.isfinite(trunk.linear.weight.grad).all()
    assert balancer.steps_taken == 1


@pytest.mark.parametrize("method", METHODS)
def test_unchecked_a_finite_step_is_the_checked_step_bit_for_bit(method: str) -> None:
    runs = []
    for check in (True, False):
        trunk, heads, x = problem(nan_gradient=False, seed=3)
        balancer = balancer_of(method, trunk, check_trunk_gradients=check)
        optimizer = torch.optim.SGD([*trunk.parameters(), *heads.parameters()], lr=0.05)
        for _ in range(3):
            optimizer.zero_grad()
            z = trunk(x)
            balancer.backward(heads(z) ** 2, features=z)
            optimizer.step()
        runs.append([p.detach().clone() for p in (*trunk.parameters(), *heads.parameters(), balancer.w)])
    for checked, unchecked in zip(*runs):
        assert torch.equal(checked, unchecked)


def test_unchecked_a_nan_loss_still_stops_the_step() -> None:
    trunk, heads, x = problem(nan_gradient=False)
    balancer = balancer_of("mgda", trunk, check_trunk_gradients=False)
    z = trunk(x)
    losses = heads(z) ** 2
    losses = losses * torch.tensor([1.0, float("nan")])
    with pytest.raises(NonFiniteStepError):
        balancer.backward(losses, features=z)
    assert all(param.grad is None for param in trunk.parameters())


@pytest.mark.parametrize("value", ["false", None, 2])
def test_check_trunk_gradients_must_be_a_bool(value: object) -> None:
    trunk, _, _ = problem(nan_gradient=False)
    with pytest.raises(ValueError, match="check_trunk_gradients must be True or False"):
        drmoo.Balancer("mgda", trunk.parameters(), 2, jacobian="features", lr=0.1,
                       check_trunk_gradients=value)  # type: ignore[arg-type]


def test_the_step_api_reads_the_attribute() -> None:
    """``optimizer.step(closure)`` in features mode: the attribute turns the check off there too (theta is then
    written with the NaN, as a plain optimizer would)."""
    outcomes = []
    for check in (True, False):
        trunk, heads, x = problem(nan_gradient=True)
        optimizer = create("mgda", trunk.parameters(), 2, jacobian="features", lr=0.1)
        optimizer.check_trunk_gradients = check
        z = trunk(x)

        def closure(z: Tensor = z, heads: nn.Module = heads) -> tuple[Tensor, Tensor]:
            return heads(z) ** 2, z

        try:
            optimizer.step(closure)
            outcomes.append(bool(torch.isnan(trunk.b).any()))
        except NonFiniteStepError:
            outcomes.append("refused")
    assert outcomes == ["refused", True]


@pytest.mark.parametrize("method", METHODS)
def test_under_a_grad_scaler_the_trunk_is_tested_anyway(method: str) -> None:
    """An overflow is the scaler's signal to skip the step: with the test off, the balancer must still see it
    (found_inf = 1, eta and w unchanged, no step counted), or it would commit a step the scaler skips."""
    trunk, heads, x = problem(nan_gradient=True)
    balancer = balancer_of(method, trunk, check_trunk_gradients=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    eta_before, w_before = balancer.eta.clone(), balancer.w.clone()
    z = trunk(x)
    balancer.backward(heads(z) ** 2, features=z, scaler=scaler)
    assert float(balancer.stats["found_inf"]) == 1.0 and balancer.steps_taken == 0
    assert torch.equal(balancer.eta, eta_before) and torch.equal(balancer.w, w_before)


def test_the_attribute_written_later_is_checked_at_the_step() -> None:
    trunk, heads, x = problem(nan_gradient=False)
    balancer = balancer_of("mgda", trunk)
    balancer.algorithm.check_trunk_gradients = "false"  # type: ignore[assignment]
    z = trunk(x)
    eta_before, w_before = balancer.eta.clone(), balancer.w.clone()
    with pytest.raises(ValueError, match="check_trunk_gradients must be True or False, got 'false'"):
        balancer.backward(heads(z) ** 2, features=z)
    assert all(param.grad is None for param in trunk.parameters()) and balancer.steps_taken == 0
    assert torch.equal(balancer.eta, eta_before) and torch.equal(balancer.w, w_before)
