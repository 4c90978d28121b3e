"""Parameters mode guards the task weights w (and MoCo its tracked Jacobian) before anything is written.

The rows J are guarded where they are made; a NaN w -- a solver fed an overflowing Gram, MoCo's tracked
estimate grown past its dtype -- used to pass every guard and write NaN into theta (``step``) or ``.grad``
(``drmoo.Balancer``).  Now such a step raises :class:`NonFiniteStepError` and changes nothing: not theta,
not ``.grad``, not eta, w or the method's own state.  And a MoCo state whose tracked Jacobian cannot be
squared is refused at ``load_state_dict``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import drmoo
from drmoo.optim import MGDA, MoCo, NonFiniteStepError, SDMGrad

M = 3


def _model() -> tuple[nn.Linear, nn.Linear, Tensor, Tensor]:
    torch.manual_seed(0)
    return nn.Linear(4, 5), nn.Linear(5, M), torch.randn(8, 4), torch.randn(8, M)


def _losses(trunk: nn.Linear, head: nn.Linear, x: Tensor, y: Tensor) -> Tensor:
    return (head(torch.tanh(trunk(x))) - y) ** 2


def _state(optimizer: Any) -> dict[str, Tensor]:
    return {key: value.clone() for key, value in optimizer.state["drmoo"].items() if isinstance(value, Tensor)}


def _unchanged(before: dict[str, Tensor], after: dict[str, Tensor]) -> None:
    for key, value in before.items():
        assert torch.equal(value, after[key]) or (value.isnan() == after[key].isnan()).all(), key


METHODS = {"mgda": MGDA, "moco": MoCo, "sdmgrad": SDMGrad}


def _corrupt_w(optimizer: Any) -> None:
    optimizer.state["drmoo"]["w"].fill_(float("nan"))


def _overflow_tracking(optimizer: Any) -> None:
    optimizer.state["drmoo"]["tracking"].fill_(1e30)  # finite, but its Gram (1e60 * n) is not in float32


CORRUPTIONS = [(name, _corrupt_w) for name in METHODS] + [("moco", _overflow_tracking)]


@pytest.mark.parametrize(("method", "corrupt"), CORRUPTIONS, ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_a_step_with_non_finite_weights_writes_no_parameter(method: str, corrupt: Any) -> None:
    trunk, head, x, y = _model()
    optimizer = METHODS[method](trunk.parameters(), M, lr=0.1)
    optimizer.step(lambda: _losses(trunk, head, x, y))  # a normal step first: the state is a stepped one
    corrupt(optimizer)
    theta, state = copy.deepcopy(trunk.state_dict()), _state(optimizer)
    with pytest.raises(NonFiniteStepError, match="nothing was updated"):
        optimizer.step(lambda: _losses(trunk, head, x, y))
    for key, value in trunk.state_dict().items():
        assert torch.equal(value, theta[key]), key
    _unchanged(state, _state(optimizer))


@pytest.mark.parametrize(("method", "corrupt"), CORRUPTIONS, ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_a_balancer_step_with_non_finite_weights_leaves_grad_as_it_was(method: str, corrupt: Any) -> None:
    trunk, head, x, y = _model()
    balancer = drmoo.Balancer(method, trunk.parameters(), M, lr=0.1)  # type: ignore[call-overload]
    balancer.backward(_losses(trunk, head, x, y))
    trunk.zero_grad(set_to_none=False)
    trunk.weight.grad.fill_(0.25)  # type: ignore[union-attr]  # an earlier accumulation, to be kept
    corrupt(balancer._algorithm)
    state = _state(balancer._algorithm)
    with pytest.raises(NonFiniteStepError, match="nothing was updated"):
        balancer.backward(_losses(trunk, head, x, y))
    assert torch.equal(trunk.weight.grad, torch.full_like(trunk.weight, 0.25))
    _unchanged(state, _state(balancer._algorithm))


def test_moco_refuses_at_load_a_tracked_jacobian_whose_gram_overflows() -> None:
    trunk, head, x, y = _model()
    optimizer = MoCo(trunk.parameters(), M, lr=0.1)
    optimizer.step(lambda: _losses(trunk, head, x, y))
    saved = copy.deepcopy(optimizer.state_dict())
    saved["state"]["drmoo"]["tracking"] *= 1e30  # entries ~1e27..1e30: finite, squares are not (float32)
    fresh = MoCo(trunk.parameters(), M, lr=0.1)
    before = _state(fresh)
    with pytest.raises(ValueError, match=r"tracking .*Gram is not finite"):
        fresh.load_state_dict(saved)
    _unchanged(before, _state(fresh))
    fresh.load_state_dict(optimizer.state_dict())  # the undamaged state loads
