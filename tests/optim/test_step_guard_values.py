"""The eager step guard tests its "these values are finite" guards in one pass (drmoo.optim._guards).

Each guard of an eager step used to compute its own flags (isfinite, all, stack: four to eleven ops) and OR
them into the step's flag; now a :class:`FiniteValues` guard is only recorded, and :meth:`StepGuard.settle`
tests all of them at once (one concatenation, x - x == 0, one reduction), computing a guard's own flags only
when that pass failed, to name it.  These tests pin what that must keep: the first failing guard is the one
named, with the indices of its failing parts; every kind of non-finite value is caught, and no finite one,
however large; mixed dtypes and plain bool flags go in the same read; and the pass costs the same few ops
however many guards are pending.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from drmoo.optim._guards import (
    NonFiniteStepError,
    StepGuard,
    finite_columns,
    finite_each,
    finite_entries,
    finite_scalars,
    finite_together,
)


def _guard() -> StepGuard:
    return StepGuard(capturable=False, device=torch.device("cpu"))


def _named(role: str) -> Callable[[list[int]], str]:
    """A guard's describe callback: its role and the indices of its failing parts."""
    return lambda bad: f"{role}: {bad}"


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def test_a_finite_step_passes_and_the_first_failing_guard_is_named_with_its_parts() -> None:
    guard = _guard()
    guard.require(finite_columns(torch.ones(4, 3)), _named("losses"))
    guard.require(finite_each(torch.ones(3), torch.ones(2)), _named("dual"))
    guard.settle()  # all finite: nothing raised, nothing pending
    assert guard.failure_so_far is None

    losses = torch.ones(4, 3)
    losses[2, 1] = float("nan")
    gram = torch.eye(3, dtype=torch.float64)
    gram[2, 2] = float("inf")
    guard.require(finite_each(torch.ones(3)), _named("dual"))
    guard.require(finite_columns(losses), _named("losses"))
    guard.require(finite_entries(torch.diagonal(gram)), _named("gram"))
    failing = guard.failure_so_far
    assert failing is not None and bool(failing)
    with pytest.raises(NonFiniteStepError, match=r"^losses: \[1\]$"):
        guard.settle()
    guard.settle()  # the failed guards were consumed: nothing left to read


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_every_non_finite_value_is_caught_and_no_finite_one(bad: float) -> None:
    big32 = torch.tensor([3.4e38, -3.4e38], dtype=torch.float32)  # x - x is 0 even where x + x overflows
    big64 = torch.tensor([1.7e308, -1.7e308, 5e-324], dtype=torch.float64)
    half = torch.tensor([65504.0], dtype=torch.float16)
    guard = _guard()
    guard.require(finite_each(big32, big64, half), _named("big"))
    guard.require(finite_scalars([torch.tensor(1e38), torch.tensor(2.0)]), _named("norms"))
    guard.settle()
    guard.require(finite_each(big32), _named("big"))
    guard.require(finite_scalars([torch.tensor(1.0), torch.tensor(bad)]), _named("norms"))
    with pytest.raises(NonFiniteStepError, match=r"^norms: \[1\]$"):
        guard.settle()
    guard.require(finite_together([torch.tensor(1.0), torch.tensor(bad, dtype=torch.float64)]), _named("lift"))
    with pytest.raises(NonFiniteStepError, match=r"^lift: \[0\]$"):
        guard.settle()


def test_bool_flags_and_values_share_the_read_and_keep_their_order() -> None:
    guard = _guard()
    guard.require(torch.tensor([True, False, True]), _named("flags"))
    guard.require(finite_entries(torch.tensor([math.nan])), _named("values"))
    with pytest.raises(NonFiniteStepError, match=r"^flags: \[1\]$"):
        guard.settle()
    guard.check(torch.tensor([True]), lambda _: ValueError("bad weights"))
    guard.require(finite_entries(torch.tensor([1.0, math.inf])), _named("values"))
    with pytest.raises(NonFiniteStepError, match=r"^values: \[1\]$"):
        guard.settle()


def test_the_pass_costs_the_same_few_ops_however_many_guards_are_pending() -> None:
    def settle_cost(guards: int) -> int:
        guard = _guard()
        values = [torch.ones(5) for _ in range(guards)]  # made before counting: the step computes them anyway
        with _CountOps() as counter:
            for value in values:
                guard.require(finite_entries(value), _named("v"))
            guard.settle()
        return counter.ops

    assert settle_cost(1) <= 4  # x - x, == 0, all, the read
    assert settle_cost(8) == settle_cost(2) <= 5  # + one concatenation


def test_an_immediate_or_capturable_guard_keeps_its_own_semantics() -> None:
    immediate = StepGuard(False, torch.device("cpu"), immediate=True)
    with pytest.raises(NonFiniteStepError, match=r"^x: \[0\]$"):
        immediate.require(finite_entries(torch.tensor([math.nan, 1.0])), _named("x"))
    capturable = StepGuard(True, torch.device("cpu"))
    with _CountOps():
        capturable.require(finite_entries(torch.tensor([1.0, 2.0])), _named("x"))
    assert capturable.found_inf is not None and not bool(capturable.found_inf)
    capturable.require(finite_columns(torch.tensor([[1.0, math.inf]])), _named("x"))
    assert bool(capturable.found_inf)  # no raise, no read: the step is skipped on the device
