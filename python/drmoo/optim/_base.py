"""What every drmoo optimizer shares: the closure protocol, input checks, per-task Jacobians, state.

The closure protocol.  ``optimizer.step(closure)`` calls ``closure()`` as often as its algorithm
needs; every call must draw a *fresh* batch and return the per-sample losses ``[B, m]`` (one column
per task) with their autograd graph - or a pair ``(losses, sample_weight)`` with importance weights
omega ``[B, m]`` >= 0 (e.g. CelebA's label balancing), which then enter every expectation of the
dual objective.  The optimizer, not the user, turns those losses into the DR dual objective, its
weights and its per-task gradients.

Shared vs task-specific parameters.  The parameters handed to the optimizer are the *shared* ones
and go through the multi-objective update.  Every other trainable leaf that takes part in the losses
(e.g. one head per task) receives, in its ``.grad``, the gradient of the sum of the task dual
objectives from the batch used for the parameter step - head i therefore sees task i only - and is
stepped by the user's own optimizer (paper: SGD, lr 1e-2) after ``step`` returns.  Zero those grads
before ``step`` as usual.

State.  The preference vector ``w`` (on the simplex) and the dual variables ``eta`` live in
``optimizer.state["drmoo"]`` so that ``state_dict()`` / ``load_state_dict()`` round-trip them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from drmoo import distributed
from drmoo.distributed import all_reduce_max
from drmoo.jacobian import STRATEGIES, task_jacobian
from drmoo_kernels import Divergence, backend_module, get_divergence, resolve_backend

Closure = Callable[[], Tensor]
ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]

STATE_KEY = "drmoo"


class NonFiniteStepError(ValueError):
    """A step met a NaN/Inf (losses, dual quantities or gradients) and was abandoned: nothing changed.

    A ``ValueError``, so callers that treat it as bad input keep working; mixed-precision training
    catches it to skip an overflowing step, as a gradient scaler would.
    """


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    """Reject non-finite, negative (or zero) hyperparameters with a message naming them."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    bad = not (number >= 0.0 if allow_zero else number > 0.0) or number != number or number == float("inf")
    if bad:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value!r}")
    return number


class MultiObjectiveOptimizer(torch.optim.Optimizer):
    """Base class: validated closure calls, per-task Jacobians into flat buffers, w/eta state.

    Subclasses implement :meth:`step`.  The hyperparameters are global to the algorithm (the update
    direction couples every shared parameter), so parameter groups must agree on all of them; they
    are read from the first group, which is where LR schedulers write too.
    """


    def __init__(self, params: ParamsT, num_tasks: int, defaults: dict[str, Any], backend: str | None) -> None:
        if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1:
            raise ValueError(f"num_tasks must be a positive int, got {num_tasks!r}")
        defaults = dict(defaults)
        defaults["divergence"] = str(get_divergence(defaults["divergence"]))
        super().__init__(params, defaults)
        self.num_tasks = num_tasks
        shared = self._shared_params()
        if not shared:
            raise ValueError("the optimizer got no parameters that require grad")
        devices = {p.device for p in shared}
        dtypes = {p.dtype for p in shared}
        if len(devices) > 1 or len(dtypes) > 1:
            raise ValueError(
                "all shared parameters must have one device and dtype (they share one flat gradient "
                f"buffer); got devices {sorted(map(str, devices))} and dtypes {sorted(map(str, dtypes))}"
            )
        self.device = shared[0].device
        self.backend = resolve_backend(backend, self.device)
        self._ops = backend_module(self.backend)
        self._buffers: dict[str, Tensor] = {}
        # importance weights omega [B, m] of the most recent closure call (None = uniform)
        self.batch_weight: Tensor | None = None
        # Gradient scaling for fp16 (as torch.amp.GradScaler does for losses): every backward runs on
        # cotangents times loss_scale, so small fp16 gradients do not underflow; the shared-parameter
        # gradients are divided back before use.  The heads' .grad stay scaled: divide them before
        # stepping the heads (the trainer does).  An overflow surfaces as NonFiniteStepError.
        self.loss_scale: float = 1.0
        self._jacobian_strategy = "loop"
        self.stats: dict[str, Tensor] = {}
        # w and eta in float32 (float64 when the parameters are float64): they are tiny, and the
        # dual variables need the precision whatever the model's dtype.
        state_dtype = torch.float64 if shared[0].dtype == torch.float64 else torch.float32
        self.state[STATE_KEY] = {
            "w": torch.full((num_tasks,), 1.0 / num_tasks, device=self.device, dtype=state_dtype),
            "eta": torch.zeros(num_tasks, device=self.device, dtype=state_dtype),
            "step": 0,
        }

    # ----------------------------------------------------------------------------------- params
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        first = self.param_groups[0]
        for key, value in param_group.items():
            if key == "params" or key not in first:
                continue
            if first[key] != value:
                raise ValueError(
                    f"hyperparameter {key!r} differs between parameter groups ({first[key]!r} vs "
                    f"{value!r}); drmoo optimizers need the same hyperparameters in every group"
                )

    def _shared_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    @property
    def jacobian_strategy(self) -> str:
        """How per-task gradients are computed: ``"loop"`` (default) or ``"batched"``."""
        return self._jacobian_strategy

    @jacobian_strategy.setter
    def jacobian_strategy(self, value: str) -> None:
        if value not in STRATEGIES:
            raise ValueError(f"unknown Jacobian strategy {value!r}; valid choices: {', '.join(STRATEGIES)}")
        self._jacobian_strategy = value

    # ------------------------------------------------------------------------------------ state
    @property
    def w(self) -> Tensor:
        """Current preference vector (on the probability simplex)."""
        return self.state[STATE_KEY]["w"]

    @property
    def eta(self) -> Tensor:
        """Current dual variables, one per task."""
        return self.state[STATE_KEY]["eta"]

    @property
    def steps_taken(self) -> int:
        return int(self.state[STATE_KEY]["step"])

    def hyper(self, key: str) -> Any:
        """A global hyperparameter (read from the first parameter group)."""
        return self.param_groups[0][key]

    @property
    def divergence(self) -> Divergence:
        return get_divergence(self.hyper("divergence"))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if STATE_KEY not in state_dict.get("state", {}):
            raise ValueError(f"state_dict has no {STATE_KEY!r} entry: it was not saved by a drmoo optimizer")
        saved = state_dict["state"][STATE_KEY]
        for key in ("w", "eta"):
            if tuple(saved[key].shape) != (self.num_tasks,):
                raise ValueError(
                    f"state_dict's {key} has shape {tuple(saved[key].shape)}, but this optimizer has "
                    f"num_tasks={self.num_tasks}"
                )
        super().load_state_dict(state_dict)
        # Non-parameter state is copied by reference and not moved by torch: own and place it.
        own = self.state[STATE_KEY]
        self.state[STATE_KEY] = {
            key: value.detach().clone().to("cpu" if key == "rng_state" else self.device)
            if isinstance(value, Tensor) else value
            for key, value in own.items()
        }

    # ---------------------------------------------------------------------------------- closure
    def draw_losses(self, closure: Closure | None, *, need_graph: bool) -> Tensor:
        """Call the closure once and check what it returned; raises naming the problem."""
        if closure is None:
            raise ValueError(
                f"{type(self).__name__}.step needs a closure that draws a fresh batch and returns "
                "per-sample losses [B, num_tasks]"
            )
        result = closure()
        losses, weights = (result if isinstance(result, tuple) and len(result) == 2 else (result, None))
        m = self.num_tasks
        if not isinstance(losses, Tensor):
            raise TypeError(
                f"the closure must return a Tensor of per-sample losses [B, {m}], got {type(losses).__name__}"
            )
        if losses.dim() != 2:
            raise ValueError(
                f"the closure returned losses of shape {tuple(losses.shape)}; expected per-sample losses "
                f"[B, {m}] (one column per task, not averaged over the batch)"
            )
        if losses.shape[1] != m:
            raise ValueError(
                f"the closure returned losses for {losses.shape[1]} tasks (shape {tuple(losses.shape)}), "
                f"but the optimizer was built with num_tasks={m}"
            )
        if losses.shape[0] == 0:
            raise ValueError("the closure returned an empty batch (B = 0); the dual objective needs samples")
        if not losses.is_floating_point():
            raise TypeError(f"per-sample losses must be floating point, got {losses.dtype}")
        if need_graph and not losses.requires_grad:
            raise ValueError(
                "the closure returned losses with no autograd graph (computed under torch.no_grad(), "
                "detached, or from parameters that do not require grad); the optimizer needs their "
                "gradients"
            )
        if weights is not None:
            if not isinstance(weights, Tensor) or tuple(weights.shape) != tuple(losses.shape):
                shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
                raise ValueError(
                    f"the closure returned sample weights of shape {shape}; they must match the losses "
                    f"{tuple(losses.shape)} (one importance weight per sample and task)"
                )
            if not bool((torch.isfinite(weights) & (weights >= 0)).all()):
                raise ValueError("the closure returned sample weights that are negative, NaN or Inf")
            weights = weights.detach()
        self.batch_weight = weights
        # One host sync per closure call: a NaN must stop the step before anything is updated
        # (on every rank: the flags are agreed on, so no rank waits forever in a collective).
        finite = torch.isfinite(losses.detach()).all(dim=0)
        if distributed.is_distributed():
            finite = all_reduce_max((~finite).to(torch.int32)) == 0
        if not bool(finite.all()):
            bad = [i for i, ok in enumerate(finite.tolist()) if not ok]
            raise NonFiniteStepError(
                f"non-finite (NaN or Inf) per-sample losses for task(s) {bad} at step {self.steps_taken}; "
                "the step was abandoned and nothing was updated"
            )
        return losses

    # --------------------------------------------------------------------------------- jacobian
    def _buffer(self, name: str) -> Tensor:
        shared = self._shared_params()
        n = sum(p.numel() for p in shared)
        buf = self._buffers.get(name)
        if buf is None or buf.shape != (self.num_tasks, n):
            buf = torch.empty(self.num_tasks, n, device=self.device, dtype=shared[0].dtype)
            self._buffers[name] = buf
        return buf

    def task_jacobian(self, losses: Tensor, cotangent: Tensor, slot: str, *, feed_heads: bool) -> Tensor:
        """Rows i = gradient of the shared parameters of sum_b cotangent[b, i] * losses[b, i].

        The rows land in the preallocated flat buffer ``slot`` (one per role, reused across steps)
        through :func:`drmoo.jacobian.task_jacobian` with strategy ``self.jacobian_strategy``
        (``"loop"``: no copy, the parameters' ``.grad`` are views of the buffer; ``"batched"``: one
        vmapped backward).  With ``feed_heads`` every other leaf also accumulates its gradient (the
        heads' gradients for the user's optimizer); otherwise only the shared parameters are touched.
        """
        scale = self.loss_scale
        jacobian = task_jacobian(losses, cotangent * scale if scale != 1.0 else cotangent, self._shared_params(),
                                 self._buffer(slot), strategy=self.jacobian_strategy, feed_heads=feed_heads)
        if scale != 1.0:
            jacobian.div_(scale)
        return distributed.all_reduce_sum_(jacobian)  # shard Jacobians -> the global batch's

    def dual_forward(self, losses: Tensor, eta: Tensor, lam: float, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """The ``dual_forward`` op on the latest batch (with its importance weights), over all ranks.

        Returns the per-task objective, z and the loss cotangents.  Under torch.distributed the
        objective and z are averaged over ranks and the cotangents divided by the world size, so
        that they are those of the global batch (see :mod:`drmoo.distributed`).
        """
        objective, z, cotangent = self._ops.dual_forward(losses, eta, lam, scale, self.divergence, self.batch_weight)
        if distributed.is_distributed():
            distributed.all_reduce_mean(objective, z)
            cotangent = cotangent / distributed.world_size()
        return objective, z, cotangent

    def apply_direction(self, jacobian: Tensor, w: Tensor, lr: Tensor | float) -> None:
        """theta -= lr * J^T w through the shared parameters (the ``combine`` op)."""
        with torch.no_grad():
            self._ops.combine(jacobian, w, self._shared_params(), lr)

    def _overflow_hint(self) -> str:
        if self.divergence.name == "kl":
            return " (kl weights exp((loss - eta)/lam) overflow for large losses: raise lam or use cvar_smooth)"
        return ""

    def check_dual(self, *dual_quantities: Tensor) -> None:
        """The dual step's outputs (z, weights' means) must be finite before anything is written."""
        finite = torch.stack([torch.isfinite(q).all() for q in dual_quantities]).all()
        if not bool(finite):
            raise NonFiniteStepError(
                f"non-finite dual quantities (the worst-case weights f*'((loss - eta)/lam) overflowed) at step "
                f"{self.steps_taken}; the step was abandoned and nothing was updated{self._overflow_hint()}"
            )

    def check_jacobian(self, gram: Tensor, role: str) -> None:
        """A non-finite Gram diagonal means a non-finite gradient entry (NaN/Inf propagate into it)."""
        finite = torch.isfinite(torch.diagonal(gram))
        if not bool(finite.all()):
            bad = [i for i, ok in enumerate(finite.tolist()) if not ok]
            hint = self._overflow_hint()
            raise NonFiniteStepError(
                f"non-finite gradients of the shared parameters for task(s) {bad} ({role}) at step "
                f"{self.steps_taken}; the step was abandoned and nothing was updated{hint}"
            )

    def _common_stats(self, objective: Tensor, balanced: Tensor, theta_norm: Tensor) -> dict[str, Tensor]:
        return {
            "w": self.w.detach().clone(),
            "eta": self.eta.detach().clone(),
            "dual_objective": objective.detach(),
            "balanced_grad_norm": balanced.detach().float(),
            "theta_grad_norm": theta_norm.detach().float(),
        }
