"""How per-task gradients are taken, apart from how a method combines them: the Jacobian engines' interface.

Every method writes its algorithm over "a Jacobian": rows, one per task (``task_jacobian``), their
m x m products (the Gram, cross products), and ``apply_direction(rows, c, factor)``, the theta step
along ``factor * c^T rows``.  An engine supplies those three for one choice of coordinates:

* :class:`~drmoo.optim._parameters.ParametersJacobian` (``jacobian="parameters"``, the paper's):
  rows w.r.t. the shared parameters theta, J_theta [m, n];
* :class:`~drmoo.optim._features.FeaturesJacobian` (``jacobian="features"``): rows w.r.t. the
  shared representation z, J_z [m, B*d], and the lift of c^T J_z to theta by one backward pass.

The engines see the optimizer they serve only through :class:`EngineHost` (what a step exposes to
them), never through the optimizer's class: the dependency points from the optimizer to its engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any, Protocol

from torch import Tensor

from ._guards import FiniteValues
from ._hyperparameters import check_flag
from ._loss_scale import LossScale, is_unit


class EarlierMicroBatches(Protocol):
    """In a step closing a gradient accumulation (:mod:`drmoo.optim._accumulate`), what features mode adds for
    the micro-batches before the last: their Gram, and their part of the lifted direction."""

    def with_earlier_gram(self, gram: Tensor) -> Tensor: ...

    def add_lifted(self, grads: list[Tensor], rows: Tensor, coefficients: Tensor, gain: Tensor | float) -> None: ...


class EngineHost(Protocol):
    """What an engine reads from, and asks of, the optimizer whose step it serves."""

    num_tasks: int
    # fp16: every backward runs on cotangents times loss_scale; direction mode's .grad carries grad_scale
    loss_scale: LossScale
    grad_scale: LossScale
    direction_mode: bool  # drmoo.Balancer: the step adds its direction to .grad instead of writing theta
    check_trunk_gradients: bool  # features mode: NaN/Inf-test the lifted trunk gradients before writing them
    _ops: ModuleType  # the backend's ops (gram, combine, ...)

    @property
    def jacobian_strategy(self) -> str:
        """``"loop"`` or ``"batched"`` (see :func:`drmoo.jacobian.task_jacobian`)."""
        ...

    @property
    def accumulation(self) -> EarlierMicroBatches | None:
        """The accumulated micro-batches this step closes (``Balancer.backward(..., accumulate=True)``), or None."""
        ...

    @property
    def found_inf(self) -> Tensor | None:
        """In a capturable step, the 0-d bool "this step is skipped"; None otherwise."""
        ...

    @property
    def failing_iteration(self) -> str:
        """How a failing step's messages name it."""
        ...

    def hyper(self, key: str) -> Any:
        """A global hyperparameter (the first parameter group's)."""
        ...

    def _shared_params(self) -> list[Tensor]:
        """The shared parameters (those that require grad), in the groups' order."""
        ...

    def take_graph_reuse(self) -> bool:
        """Whether the backward about to run must keep the losses' graph."""
        ...

    def set_aside_head_grads(self, heads: Iterable[Tensor]) -> None:
        """Keep ``heads``' ``.grad`` apart before the step feeds them (committed once it succeeds)."""
        ...

    def require_finite(self, flags: Tensor | FiniteValues, describe: Callable[[list[int]], str]) -> None:
        """Stop the step (eager) or mark it skipped (capturable) unless every flag is True."""
        ...

    def settle_guards(self) -> None:
        """Eager: read the step's guards (one host read) before a write that cannot be undone."""
        ...


class JacobianEngine(Protocol):
    """One way of taking per-task gradients (see the module docstring)."""

    def unpack(self, result: Any, *, need_graph: bool) -> Any:
        """A closure's result as the parameters-mode closure returns it (``losses`` or ``(losses, weights)``),
        after taking what this engine needs from it (features mode: z)."""
        ...

    def heads(self, losses: Tensor, shared: Sequence[Tensor], *, feed_heads: bool) -> list[Tensor]:
        """The task-specific leaves whose ``.grad`` the step feeds (none unless ``feed_heads``), after
        checking what this engine needs of the losses' graph."""
        ...

    def task_jacobian(self, host: EngineHost, losses: Tensor, cotangent: Tensor, slot: str, *,
                      heads: Sequence[Tensor], feed_heads: bool) -> Tensor:
        """The global batch's rows [m, width]: row i = d (sum_b cotangent[b, i] losses[b, i]) / d(coordinates),
        in buffer ``slot`` (reused across steps); ``heads`` accumulate their gradients in the same passes."""
        ...

    def gram(self, ops: Any, rows: Tensor) -> Tensor:
        """J J^T of this engine's rows [m, width] (the backend module ``ops``' ``gram``, or a cheaper exact form)."""
        ...

    def products_over_ranks(self, small: Tensor) -> Tensor:
        """An m x m (or m) product of this engine's rows, as the global batch's (summed over ranks where the
        rows hold one rank's columns; unchanged where they are already the global batch's)."""
        ...

    def apply(self, host: EngineHost, rows: Tensor, coefficients: Tensor, factor: Tensor | float) -> None:
        """The theta step along ``factor * coefficients^T rows`` (``theta -= lr * d``, or ``.grad += d`` in
        direction mode)."""
        ...

    def end_step(self) -> None:
        """Forget what was held for the step (called when a step returns or raises)."""
        ...


def tests_trunk_gradients(host: EngineHost) -> bool:
    """Whether features mode's lift tests the trunk's gradients for NaN/Inf before writing them (one read of all
    of them, a few percent of a small-m step): unless the host turned the test off (``check_trunk_gradients``;
    every other guard of the step -- losses, rows, dual quantities, w -- still runs), and always under loss
    scaling, where an overflow is the scaler's signal to skip the step and lower its scale: the balancer must
    skip it too."""
    # getattr: an optimizer pickled before the setting existed has no attribute (the test was always on then);
    # check_flag: the attribute may be written after construction, and a string "false" would count as True.
    check = check_flag("check_trunk_gradients", getattr(host, "check_trunk_gradients", True))
    return check or not is_unit(host.loss_scale)
