"""Bad input to the drmoo optimizers: clear errors, and nothing updated by a failed step."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from drmoo.optim import DoubleClipMGDA, DoubleLoopMGDA, MultiObjectiveOptimizer, available, create

OPTIMIZERS = [DoubleClipMGDA, DoubleLoopMGDA]


def failing_on_call(good: Callable[[], Tensor], bad: Callable[[Tensor], Tensor], call: int) -> Callable[[], Tensor]:
    """A closure that behaves until its ``call``-th invocation, which returns ``bad(good())``."""
    count = [0]

    def closure() -> Tensor:
        count[0] += 1
        losses = good()
        return bad(losses) if count[0] == call else losses

    return closure


def with_nan(losses: Tensor) -> Tensor:
    return losses * torch.where(torch.arange(losses.shape[1]) == 1, float("nan"), 1.0)


def with_inf(losses: Tensor) -> Tensor:
    return losses + torch.where(torch.arange(losses.shape[1]) == 0, float("inf"), 0.0)


def assert_nothing_changed(problem, optimizer: MultiObjectiveOptimizer, before: list[Tensor],
                           w: Tensor, eta: Tensor, steps: int) -> None:
    for got, want in zip(problem.snapshot()[:2], before[:2]):
        assert torch.equal(got, want), "a failed step changed the shared parameters"
    assert torch.equal(optimizer.w, w) and torch.equal(optimizer.eta, eta)
    assert optimizer.steps_taken == steps


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("corrupt", [with_nan, with_inf], ids=["nan", "inf"])
def test_non_finite_losses_on_any_call_abort_the_step(toy, cls: type, corrupt: Callable) -> None:
    calls_per_step = 2 if cls is DoubleClipMGDA else 5 + 3
    for failing_call in range(1, calls_per_step + 1):
        problem = toy()
        optimizer = cls(problem.shared, 3)
        optimizer.step(problem.closure(0))
        before, w, eta = problem.snapshot(), optimizer.w.clone(), optimizer.eta.clone()
        closure = failing_on_call(problem.closure(1), corrupt, failing_call)
        with pytest.raises(ValueError, match=r"non-finite \(NaN or Inf\) per-sample losses for task\(s\)"):
            optimizer.step(closure)
        assert_nothing_changed(problem, optimizer, before, w, eta, steps=1)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_non_finite_gradients_abort_the_step(cls: type) -> None:
    # sqrt(|theta|^2) is finite at theta = 0 but its gradient is NaN there.
    theta = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    optimizer = cls([theta], 2)
    w, eta = optimizer.w.clone(), optimizer.eta.clone()

    def closure() -> Tensor:
        return torch.sqrt((theta**2).sum()) + torch.ones(4, 2, dtype=torch.float64)

    with pytest.raises(ValueError, match="non-finite gradients"):
        optimizer.step(closure)
    assert torch.equal(theta, torch.zeros(3, dtype=torch.float64))
    assert torch.equal(optimizer.w, w) and torch.equal(optimizer.eta, eta) and optimizer.steps_taken == 0


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize(
    ("make_losses", "error", "message"),
    [
        (lambda p: p.losses(torch.arange(8))[:, :2], ValueError, "for 2 tasks.*num_tasks=3"),
        (lambda p: p.losses(torch.arange(8)).mean(1), ValueError, r"shape \(8,\).*\[B, 3\]"),
        (lambda p: p.losses(torch.arange(8)).mean(), ValueError, r"shape \(\).*\[B, 3\]"),
        (lambda p: p.losses(torch.arange(0)), ValueError, "empty batch"),
        (lambda p: p.losses(torch.arange(8)).detach(), ValueError, "no autograd graph"),
        (lambda p: [1.0, 2.0], TypeError, "must return a Tensor"),
        (lambda p: p.losses(torch.arange(8)).long(), TypeError, "floating point"),
    ],
    ids=["wrong-m", "1-d", "scalar", "empty", "no-graph", "not-a-tensor", "integer"],
)
def test_malformed_closure_output(toy, cls: type, make_losses: Callable, error: type, message: str) -> None:
    problem = toy()
    optimizer = cls(problem.shared, 3)
    before, w, eta = problem.snapshot(), optimizer.w.clone(), optimizer.eta.clone()
    with pytest.raises(error, match=message):
        optimizer.step(lambda: make_losses(problem))
    assert_nothing_changed(problem, optimizer, before, w, eta, steps=0)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_missing_closure(toy, cls: type) -> None:
    with pytest.raises(ValueError, match="needs a closure"):
        cls(toy().shared, 3).step()


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lam": 0.0}, "lam must be finite and > 0"),
        ({"lam": -1.0}, "lam must be finite and > 0"),
        ({"lam": float("nan")}, "lam"),
        ({"lr": -0.1}, "lr must be finite and >= 0"),
        ({"divergence": "hellinger"}, "unknown divergence.*valid choices"),
        ({"divergence": "cvar_smooth(2)"}, "0 < alpha < 1"),
        ({"backend": "warp-drive"}, "unknown backend"),
    ],
)
def test_bad_hyperparameters(toy, cls: type, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(toy().shared, 3, **kwargs)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_bad_construction(toy, cls: type) -> None:
    problem = toy()
    for bad in (0, -2, 1.5, "3"):
        with pytest.raises(ValueError, match="num_tasks"):
            cls(problem.shared, bad)
    with pytest.raises(ValueError, match="no parameters that require grad"):
        cls([torch.zeros(3)], 3)
    with pytest.raises(ValueError, match="one device and dtype"):
        cls([torch.zeros(2, requires_grad=True), torch.zeros(2, dtype=torch.float64, requires_grad=True)], 3)
    with pytest.raises(ValueError, match="differs between parameter groups"):
        cls([{"params": [problem.A]}, {"params": [problem.c], "lam": 0.9}], 3)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_state_dict_for_another_task_count_is_rejected(toy, cls: type) -> None:
    problem = toy()
    saved = cls(problem.shared, 3).state_dict()
    two_tasks = toy(num_tasks=2)
    with pytest.raises(ValueError, match="num_tasks=2"):
        cls(two_tasks.shared, 2).load_state_dict(saved)
    with pytest.raises(ValueError, match="not saved by a drmoo optimizer"):
        cls(problem.shared, 3).load_state_dict(torch.optim.SGD(problem.shared, lr=0.1).state_dict())


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_single_task_and_parameter_groups(toy, cls: type) -> None:
    problem = toy(num_tasks=1)
    optimizer = cls([{"params": [problem.A]}, {"params": [problem.c]}], 1)
    before = problem.snapshot()
    for seed in range(3):
        optimizer.step(problem.closure(seed))
    assert optimizer.w.tolist() == [1.0]
    assert not torch.equal(problem.A, before[0]) and not torch.equal(problem.c, before[1])


def test_registry() -> None:
    assert {"double-clip", "double-loop"} <= set(available())
    theta = torch.zeros(2, requires_grad=True)
    assert isinstance(create("double-clip", [theta], 2, lr=0.1), DoubleClipMGDA)
    with pytest.raises(ValueError, match=r"unknown method 'adam'.*double-clip"):
        create("adam", [theta], 2)
