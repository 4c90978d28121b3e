"""The optimizer API refuses nonsense with a clear error, and a failed call changes nothing (issue 12).

One test per case: parameter-group hyperparameters are checked like constructor arguments;
``load_state_dict`` refuses another method's state, another problem's state and damaged states
before loading anything; a failed step leaves everything -- the heads' ``.grad`` included -- as it
was; ``drmoo.dual_objective`` refuses an infinite lambda, NaN dual variables and bad importance
weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from drmoo import dual_objective
from drmoo.optim import DoubleClipMGDA, MoCo, NonFiniteStepError, available, create

METHODS = sorted(available())


def build(toy: Callable[..., Any], method: str, **kwargs: Any) -> tuple[Any, Any]:
    problem = toy()
    torch.manual_seed(0)
    return problem, create(method, problem.shared, problem.num_tasks, backend="reference", **kwargs)


def fresh_closure(problem: Any, seed: int = 1) -> Callable[..., Tensor]:
    draw = problem.batches(seed)
    last: list[Tensor] = []

    def closure(same_batch: bool = False) -> Tensor:
        if not same_batch:
            last[:] = [draw()]
        return problem.losses(last[0])

    return closure


# ------------------------------------------------------------------- param-group hyperparameters
@pytest.mark.parametrize("method", METHODS)
def test_a_param_group_with_a_negative_lr_is_refused(toy, method: str) -> None:
    problem = toy()
    with pytest.raises(ValueError, match=r"lr must be finite and >= 0, got -1"):
        create(method, [{"params": problem.shared, "lr": -1.0}], 3, backend="reference")
    optimizer = create(method, [problem.A], 3, backend="reference")
    with pytest.raises(ValueError, match=r"lr must be finite and >= 0, got -1"):
        optimizer.add_param_group({"params": [problem.c], "lr": -1.0})
    assert len(optimizer.param_groups) == 1  # the refused group was not added


@pytest.mark.parametrize("method", METHODS)
def test_a_param_group_with_a_negative_lam_is_refused_when_added(toy, method: str) -> None:
    problem = toy()
    with pytest.raises(ValueError, match=r"lam must be finite and > 0, got -1"):
        create(method, [{"params": problem.shared, "lam": -1.0}], 3, backend="reference")


@pytest.mark.parametrize("method", METHODS)
def test_a_param_group_with_a_nan_lr_is_refused_clearly(toy, method: str) -> None:
    problem = toy()
    optimizer = create(method, [problem.A], 3, backend="reference")
    with pytest.raises(ValueError, match=r"^lr must be finite and >= 0, got nan$"):
        optimizer.add_param_group({"params": [problem.c], "lr": float("nan")})


def test_a_param_group_with_an_unknown_hyperparameter_is_refused(toy) -> None:
    problem = toy()
    with pytest.raises(ValueError, match=r"DoubleClipMGDA has no hyperparameter 'lamda'"):
        DoubleClipMGDA([{"params": problem.shared, "lamda": 0.5}], 3)


def test_a_param_group_with_a_string_flag_is_refused(toy) -> None:
    problem = toy()
    with pytest.raises(ValueError, match=r"resample must be True or False, got 'no'"):
        DoubleClipMGDA([{"params": problem.shared, "resample": "no"}], 3)


def test_a_param_group_with_a_bad_method_specific_value_is_refused(toy) -> None:
    problem = toy()
    with pytest.raises(ValueError, match="solver must be one of"):
        create("mgda", [{"params": problem.shared, "solver": "exact"}], 3)
    with pytest.raises(ValueError, match="inner_steps must be an int >= 1"):
        create("double-loop", [{"params": problem.shared, "inner_steps": 0}], 3)
    with pytest.raises(ValueError, match="ema must be in"):
        create("moco", [{"params": problem.shared, "ema": 1.5}], 3)


def test_param_groups_that_disagree_are_refused(toy) -> None:
    problem = toy()
    with pytest.raises(ValueError, match="'lr' differs between parameter groups"):
        DoubleClipMGDA([{"params": [problem.A], "lr": 0.1}, {"params": [problem.c], "lr": 0.2}], 3)


def test_valid_param_groups_are_accepted_and_normalized(toy) -> None:
    problem = toy()
    optimizer = DoubleClipMGDA([{"params": [problem.A], "lr": 1}, {"params": [problem.c], "lr": 1.0}], 3)
    assert [group["lr"] for group in optimizer.param_groups] == [1.0, 1.0]
    assert isinstance(optimizer.param_groups[0]["lr"], float)


# --------------------------------------------------------------------------------- load_state_dict
def trained_state(toy: Callable[..., Any], method: str, num_tasks: int = 3) -> dict[str, Any]:
    problem = toy(num_tasks=num_tasks)
    optimizer = create(method, problem.shared, num_tasks, backend="reference", lr=0.05)
    optimizer.step(fresh_closure(problem))
    return copy.deepcopy(optimizer.state_dict())


def assert_load_refused(optimizer: Any, state: dict[str, Any], message: str) -> None:
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(ValueError, match=message):
        optimizer.load_state_dict(state)
    after = optimizer.state_dict()  # a refused load changed nothing
    assert after["param_groups"] == before["param_groups"]
    for key, value in before["state"]["drmoo"].items():
        assert torch.equal(after["state"]["drmoo"][key], value) if isinstance(value, Tensor) else (
            after["state"]["drmoo"][key] == value), key


def test_double_clip_refuses_mocos_state(toy) -> None:
    _, optimizer = build(toy, "double-clip")
    assert_load_refused(optimizer, trained_state(toy, "moco"), "saved by MoCo, not by DoubleClipMGDA")


def test_mgda_refuses_double_clips_state(toy) -> None:
    _, optimizer = build(toy, "mgda")
    assert_load_refused(optimizer, trained_state(toy, "double-clip"), "saved by DoubleClipMGDA, not by MGDA")


def test_a_state_without_its_method_entry_is_still_recognised_by_its_hyperparameters(toy) -> None:
    """States saved before the ``method`` entry existed: the hyperparameter names tell the method."""
    _, optimizer = build(toy, "mgda")
    state = trained_state(toy, "double-clip")
    del state["state"]["drmoo"]["method"]
    assert_load_refused(optimizer, state, r"hyperparameters are not MGDA's .*it was saved by another method")


@pytest.mark.parametrize("method", METHODS)
def test_a_state_for_another_number_of_tasks_is_refused(toy, method: str) -> None:
    _, optimizer = build(toy, method)
    assert_load_refused(optimizer, trained_state(toy, method, num_tasks=2), r"shape \(2,\).*num_tasks=3")


@pytest.mark.parametrize("method", METHODS)
def test_a_state_without_w_is_refused(toy, method: str) -> None:
    _, optimizer = build(toy, method)
    state = trained_state(toy, method)
    del state["state"]["drmoo"]["w"]
    assert_load_refused(optimizer, state, "state_dict has no 'w' entry")


def test_a_state_without_a_methods_own_entry_is_refused(toy) -> None:
    _, optimizer = build(toy, "moco")
    state = trained_state(toy, "moco")
    del state["state"]["drmoo"]["tracking"]
    assert_load_refused(optimizer, state, "state_dict has no 'tracking' entry")


def test_a_state_for_another_model_is_refused(toy) -> None:
    """MoCo's tracking matrix is m x n: a model with other shared parameters cannot continue it."""
    state = trained_state(toy, "moco")
    problem = toy(hidden=6)
    optimizer = MoCo(problem.shared, 3)
    assert_load_refused(optimizer, state, r"tracking has shape \(3, 24\).*expects \(3, 36\)")


def test_a_state_with_non_finite_duals_is_refused(toy) -> None:
    _, optimizer = build(toy, "double-clip")
    state = trained_state(toy, "double-clip")
    state["state"]["drmoo"]["eta"][1] = float("nan")
    assert_load_refused(optimizer, state, "eta has NaN or Inf")


def test_a_state_with_w_off_the_simplex_is_refused(toy) -> None:
    _, optimizer = build(toy, "double-clip")
    state = trained_state(toy, "double-clip")
    state["state"]["drmoo"]["w"] *= 2.0
    assert_load_refused(optimizer, state, "w is not on the probability simplex")


def test_a_state_with_an_invalid_hyperparameter_is_refused(toy) -> None:
    _, optimizer = build(toy, "double-clip")
    state = trained_state(toy, "double-clip")
    state["param_groups"][0]["lr"] = -1.0
    assert_load_refused(optimizer, state, "invalid hyperparameter: lr must be finite and >= 0")


def test_something_that_is_not_a_state_dict_is_refused(toy) -> None:
    _, optimizer = build(toy, "double-clip")
    assert_load_refused(optimizer, {"weights": torch.zeros(3)}, "not an optimizer state_dict")


# ------------------------------------------------------------------------------ failed steps
def nan_gradient_closure(problem: Any) -> Callable[..., Tensor]:
    """Finite losses whose shared-parameter gradient is NaN: d sqrt(u)/du = inf at u = 0, times 0."""
    draw = problem.batches(2)
    last: list[Tensor] = []

    def closure(same_batch: bool = False) -> Tensor:
        if not same_batch:
            last[:] = [draw()]
        poison = torch.sqrt(0.0 * problem.A.sum()) * 0.0
        return problem.losses(last[0]) + poison

    return closure


@pytest.mark.parametrize("heads_grad_before", ["none", "accumulated"])
@pytest.mark.parametrize("method", METHODS)
def test_a_step_with_a_nan_gradient_leaves_the_heads_grad_as_it_was(toy, method: str, heads_grad_before: str) -> None:
    problem, optimizer = build(toy, method, lr=0.05)
    optimizer.step(fresh_closure(problem))  # a good step first: state that a failed step could corrupt
    if heads_grad_before == "none":
        problem.H.grad = None
    else:
        problem.H.grad = torch.full_like(problem.H, 0.25)  # e.g. accumulated from an earlier backward
    grad_object = problem.H.grad
    snapshot = problem.snapshot(), copy.deepcopy(optimizer.state_dict())
    with pytest.raises(NonFiniteStepError, match="non-finite"):
        optimizer.step(nan_gradient_closure(problem))
    if heads_grad_before == "none":
        assert problem.H.grad is None
    else:
        assert problem.H.grad is grad_object and torch.equal(problem.H.grad, torch.full_like(problem.H, 0.25))
    for got, want in zip(problem.snapshot(), snapshot[0]):
        assert torch.equal(got, want)
    assert optimizer.steps_taken == 1
    for key, value in snapshot[1]["state"]["drmoo"].items():
        mine = optimizer.state_dict()["state"]["drmoo"][key]
        assert torch.equal(mine, value) if isinstance(value, Tensor) else mine == value, key


@pytest.mark.parametrize("method", METHODS)
def test_a_successful_step_adds_to_an_accumulated_heads_grad(toy, method: str) -> None:
    """The other half of the bargain: a step that succeeds accumulates into .grad, as backward does."""
    runs = []
    for accumulated in (None, torch.full((4, 3), 0.25, dtype=torch.float64)):
        problem, optimizer = build(toy, method, lr=0.05)
        problem.H.grad = None if accumulated is None else accumulated.clone()
        optimizer.step(fresh_closure(problem))
        runs.append(problem.H.grad.clone())
    torch.testing.assert_close(runs[1], runs[0] + 0.25, rtol=1e-13, atol=1e-13)


# ------------------------------------------------------------------------------ dual_objective
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lam": float("inf")}, r"lam \(the divergence regularization lambda\) must be finite and > 0, got inf"),
        ({"lam": float("nan")}, r"lam .* must be finite and > 0, got nan"),
        ({"scale": float("inf")}, r"scale .* must be finite and > 0, got inf"),
        ({"eta": torch.tensor([0.0, float("nan")])}, r"eta \(the dual variables\) contains NaN or Inf"),
        ({"eta": torch.tensor([float("inf"), 0.0])}, r"eta \(the dual variables\) contains NaN or Inf"),
        ({"sample_weight": torch.tensor([[1.0, 1.0], [-0.5, 1.0]])}, r"sample_weight .* must be finite and >= 0"),
        ({"sample_weight": torch.tensor([[1.0, float("nan")], [1.0, 1.0]])}, r"sample_weight .* must be finite"),
    ],
    ids=["lam-inf", "lam-nan", "scale-inf", "eta-nan", "eta-inf", "weight-negative", "weight-nan"],
)
def test_dual_objective_refuses(kwargs: dict[str, Any], message: str) -> None:
    arguments = {"losses": torch.rand(2, 2), "eta": torch.zeros(2), "lam": 0.6, **kwargs}
    with pytest.raises(ValueError, match=message):
        dual_objective(**arguments)


def test_dual_objective_accepts_zero_weights() -> None:
    """Zero importance weights are valid (a sample that does not count); the objective stays finite."""
    losses = torch.rand(3, 2)
    weights = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    objective = dual_objective(losses, torch.zeros(2), 0.6, sample_weight=weights)
    assert bool(torch.isfinite(objective).all())
