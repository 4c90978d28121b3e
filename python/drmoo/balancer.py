"""``drmoo.Balancer``: any drmoo method's DR-balanced direction written into ``.grad``, for any torch optimizer.

.. code-block:: python

    balancer = drmoo.Balancer("double-clip", model.trunk.parameters(), num_tasks=2, lam=0.8, lr=1e-3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)     # any torch optimizer, any groups
    for x, ys in loader:
        optimizer.zero_grad()
        losses = per_sample_losses(model(x), ys)                   # [B, m], one column per task
        balancer.backward(losses)       # trunk .grad = the method's direction; heads: their task's DR gradient
        optimizer.step()

One implementation.  The balancer holds an instance of the method's optimizer class (registered in
:func:`drmoo.optim.available`) in *direction mode*: ``backward`` runs that class's own ``step``,
which computes the per-task dual objectives, the Jacobian, the weights, and updates eta, w and the
method's state (MoCo's tracked Jacobian, FAMO's logits, SDMGrad's momentum, ...) exactly as
``step(closure)`` does -- only the theta write ``theta -= lr * d`` becomes ``.grad += d`` (see
:mod:`drmoo.optim._base`, "Two ways to apply a step").  Hence, with ``torch.optim.SGD(lr=lr)`` (no
momentum, no weight decay) and the balancer's ``lr`` equal to SGD's, the trajectory is the one of
the method's ``step`` with that lr, to rounding (tested for every method).

What ``lr`` means here.  theta's step size is the torch optimizer's.  The balancer's ``lr``
hyperparameter is the step size of the dual variables eta (the baselines' joint (theta, eta) step
and Double-Clip's eta step gamma * mu * (z (.) w) both use it); Double-Loop's eta has its own
``dual_lr`` and its ``lr`` is unused.  Set it to the torch optimizer's (initial) learning rate for
the paper's coupling.  Schedule it, if wanted, with a torch LR scheduler on
:attr:`Balancer.algorithm` (a ``torch.optim.Optimizer``).

What ``.grad`` receives.  The shared parameters: the method's direction d (Double-Clip: the clipped
alpha * J^T w_t; Nash-MTL: clip * J^T alpha; the baselines: J^T w), *added* to any existing ``.grad``
as autograd accumulates.  Every other trainable leaf of the losses' graph (the heads): the gradient
of sum_i L^i, head i seeing only task i -- the same as ``step`` gives them.  A step that raises
leaves every ``.grad``, eta, w and the state as they were.

One batch or a closure.  ``backward(losses)`` (or ``backward((losses, sample_weight))``) is the
method's *single-batch form*: every batch the algorithm draws is this one -- Double-Clip as with
``resample=False``; MoDo's and SDMGrad's three batches and Double-Loop's ``inner_steps + 3`` batches
coincide (the Jacobians are computed on the one graph, which is kept until the last of them; MoDo's
and SDMGrad's draws share one eta, so their Jacobians are one matrix, computed once and reused: m
backward passes here, not 3m);
FAMO's logit update is its next-batch form (see :class:`drmoo.optim.FAMO`).  ``backward(closure)``
runs the method's multi-batch form instead: the closure is called as ``step`` calls it (fresh
batch per call).

Mixed precision.  Pass the losses *unscaled* (the dual objectives need their true values) and the
``torch.amp.GradScaler`` as ``backward(losses, scaler=scaler)``; then ``scaler.step(optimizer);
scaler.update()`` as usual.  The backward passes run on scaled cotangents (no fp16 underflow), the
method's quantities are computed from the unscaled gradients, and ``.grad`` (shared and heads) is
left scaled for ``scaler.step`` to unscale.  A non-finite step (an fp16 overflow) is then not an
error: nothing of the balancer changes, the shared parameters' ``.grad`` receive an Inf so that
the scaler skips the optimizer step and lowers its scale, and ``stats["found_inf"]`` is 1.

Data parallelism (torch.distributed, one process per device).  Every rank passes the losses of its
shard of the global batch (:func:`drmoo.distributed.shard`); ``backward`` -- the method's step in
direction mode -- all-reduces the dual statistics and the Jacobian (:mod:`drmoo.distributed`) and
sums the heads' gradients of the step over ranks, so that every ``.grad`` it writes is the global
batch's, the same on every rank, and the torch optimizer keeps the replicas identical.  The
balancer does its own communication: use the model as it is, or wrap it in
``DistributedDataParallel`` and run its forward and ``backward`` inside ``ddp_model.no_sync()``:
DDP's reducer must stay idle (where a backward pass accumulates into ``.grad``, e.g. FAMO's heads
pass, it would start a reduction of its own that never completes, and DDP raises at the next
forward).

torch.compile.  A compiled model (``torch.compile(model)``) works as it is: the balancer walks the
autograd graph that the compiled forward builds and runs its backward passes through it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from .jacobian import graph_leaves
from .optim import NonFiniteStepError, available, create
from .optim._base import MultiObjectiveOptimizer
from .optim._features import with_features

LossesInput = Tensor | tuple[Tensor, Tensor] | Callable[[], Any]

# Methods whose single-batch form runs several backward passes over the one graph of the losses
# (one per batch of the multi-batch algorithm): the graph is kept for all but the last.
_GRAPH_PASSES = {"modo": 3, "sdmgrad": 3, "double-loop": 3}


def _reaches(losses: Tensor, params: Iterable[Tensor]) -> bool:
    """Whether the autograd graph of ``losses`` leads to any of ``params`` (one walk, stops at the first)."""
    wanted = {id(p) for p in params}
    if losses.grad_fn is None:
        return id(losses) in wanted
    return any(id(leaf) in wanted for leaf in graph_leaves(losses))


class Balancer:
    """A drmoo method that writes its DR-balanced direction into ``.grad`` (see the module docstring).

    Args:
        method: a registry name of :func:`drmoo.optim.available` (``"double-clip"``, ``"mgda"``, ...).
        shared_params: the shared parameters (an iterable of tensors, or parameter groups).
        num_tasks: m, the number of columns of the per-sample losses.
        **hparams: the method's hyperparameters, as its optimizer class takes them (``lam``,
            ``divergence``, ``lr`` -- eta's step size here --, ``capturable``, ``backend``, ...).
    """

    def __init__(self, method: str, shared_params: Iterable[Any], num_tasks: int, **hparams: Any) -> None:
        if method not in available():
            raise ValueError(f"unknown method {method!r}; valid choices: {', '.join(available())}")
        self.method = method
        self._algorithm = create(method, shared_params, num_tasks, **hparams)
        self._algorithm.direction_mode = True

    # ------------------------------------------------------------------------------ accessors
    @property
    def algorithm(self) -> MultiObjectiveOptimizer:
        """The method's optimizer object (direction mode): its ``param_groups`` hold the
        hyperparameters; a torch LR scheduler on it schedules eta's step size ``lr``."""
        return self._algorithm

    @property
    def num_tasks(self) -> int:
        return self._algorithm.num_tasks

    @property
    def w(self) -> Tensor:
        """The method's preference vector (on the simplex)."""
        return self._algorithm.w

    @property
    def eta(self) -> Tensor:
        """The dual variables, one per task."""
        return self._algorithm.eta

    @property
    def stats(self) -> dict[str, Tensor]:
        """The last backward's statistics (as the method's ``step`` reports them)."""
        return self._algorithm.stats

    @property
    def steps_taken(self) -> int:
        return self._algorithm.steps_taken

    def state_dict(self) -> dict[str, Any]:
        """eta, w, the step count, the method's own state and hyperparameters (the method's optimizer
        ``state_dict``: a balancer and a ``step`` optimizer of the same method can load each other's)."""
        return self._algorithm.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by this method for the same problem (validated before anything changes)."""
        self._algorithm.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"Balancer({self.method!r}, num_tasks={self.num_tasks}, steps_taken={self.steps_taken})"

    # ------------------------------------------------------------------------------- backward
    def backward(self, losses: LossesInput, *, scaler: torch.amp.GradScaler | None = None,
                 features: Tensor | tuple[Tensor, ...] | None = None) -> Tensor:
        """Write the method's direction into the shared parameters' ``.grad`` (and the heads' DR
        gradients into theirs), updating eta, w and the method's state.

        Args:
            losses: per-sample losses ``[B, m]`` with their graph, or ``(losses, sample_weight)``
                (importance weights >= 0, ``[B, m]``) -- the single-batch form; or a closure that
                draws a fresh batch per call and returns either -- the method's multi-batch form.
            scaler: a ``torch.amp.GradScaler`` whose scale multiplies the backward passes and
                ``.grad`` (see the module docstring, "Mixed precision"); the losses stay unscaled.
            features: with ``jacobian="features"`` (required then, with losses): z, the trunk's output
                that every head reads (a tensor or a tuple of tensors); the closure form returns
                ``(losses, z)`` or ``(losses, z, sample_weight)`` instead (:mod:`drmoo.optim._features`).

        Returns the per-task dual objectives of the step (detached), as the method's ``step`` does.
        Raises ValueError/TypeError naming the problem for bad losses, and
        :class:`drmoo.optim.NonFiniteStepError` for NaN/Inf (without a scaler); nothing changes then.
        """
        algorithm = self._algorithm
        if isinstance(losses, (Tensor, tuple)):
            self._check_losses(losses)
            given = with_features(losses, features, algorithm.features_engine is not None)
            closure: Callable[[], Any] = lambda: given  # noqa: E731
            graph_reuses = _GRAPH_PASSES.get(self.method, 1) - 1
        elif callable(losses):
            with_features(None, features, algorithm.features_engine is not None)  # the closure returns z
            closure, graph_reuses = losses, 0
        else:
            raise TypeError(
                f"Balancer.backward takes per-sample losses [B, {self.num_tasks}] (a Tensor), a pair "
                f"(losses, sample_weight) or a closure; got {type(losses).__name__}"
            )
        scale = 1.0
        if scaler is not None:
            if not isinstance(scaler, torch.amp.GradScaler):
                raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
            if scaler.is_enabled():
                # scaler.scale() (public) also creates the scaler's state on our device, which
                # scaler.step() requires ("did not use scaler.scale(loss)" otherwise); a host read.
                one = torch.ones((), dtype=torch.float32, device=algorithm.device)
                scale = float(scaler.scale(one))
        algorithm.loss_scale = algorithm.grad_scale = scale
        algorithm.graph_reuses = graph_reuses
        try:
            # A step that raises has already restored every .grad (the optimizer's all-or-nothing step).
            objectives = algorithm.step(closure)
        except NonFiniteStepError:
            if scaler is None or not scaler.is_enabled():
                raise
            self._hand_overflow_to(scaler)
            return torch.full((self.num_tasks,), float("nan"))
        finally:
            algorithm.loss_scale = algorithm.grad_scale = 1.0
            algorithm.graph_reuses = 0
            algorithm.jacobian_memo = None
        return objectives

    def _check_losses(self, losses: Tensor | tuple[Tensor, Tensor]) -> None:
        """Refuse what the method would misread, before anything runs: the shape, a graph that does
        not reach the shared parameters.  (Values -- NaN/Inf, bad weights -- are checked by the step.)"""
        m = self.num_tasks
        if isinstance(losses, tuple):
            if len(losses) != 2:
                raise ValueError(
                    f"a tuple given to Balancer.backward must be (losses, sample_weight), got {len(losses)} items"
                )
            losses = losses[0]
        if not isinstance(losses, Tensor):
            raise TypeError(f"losses must be a Tensor of per-sample losses [B, {m}], got {type(losses).__name__}")
        if losses.dim() != 2 or losses.shape[1] != m:
            raise ValueError(
                f"losses must be per-sample losses of shape [B, {m}] (one column per task, not averaged over "
                f"the batch); got shape {tuple(losses.shape)}"
            )
        if not losses.requires_grad:
            raise ValueError(
                "losses have no autograd graph (computed under torch.no_grad(), detached, or from parameters "
                "that do not require grad); the balancer needs their gradients"
            )
        if not _reaches(losses, self._algorithm._shared_params()):
            raise ValueError(
                "the losses do not depend on the balancer's shared parameters: pass the parameters the "
                "losses are computed from (e.g. model.trunk.parameters()) to drmoo.Balancer"
            )

    def _hand_overflow_to(self, scaler: torch.amp.GradScaler) -> None:
        """A non-finite step under a GradScaler: the balancer changed nothing; an Inf in the shared
        parameters' ``.grad`` makes ``scaler.step`` skip the optimizer and ``scaler.update`` back off."""
        algorithm = self._algorithm
        with torch.no_grad():
            first = algorithm._shared_params()[0]
            if first.grad is None:
                first.grad = torch.zeros_like(first)
            first.grad.view(-1)[:1].fill_(float("inf"))
        algorithm.stats = {"found_inf": torch.ones((), dtype=torch.float32)}
