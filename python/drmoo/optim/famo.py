"""FAMO (Liu et al., NeurIPS 2023) on the DR dual: balanced log-loss decrease with O(m) state."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from drmoo.jacobian import column_views, copy_into_row

from ._base import batch_rows, configure_jacobian
from ._fsdp import local_views
from ._hyperparameters import HYPERPARAMETER_CHECKS, check_flag, check_positive
from ._joint import JointBaseline, TaskGradients, common_defaults
from ._state_dict import STATE_KEY
from .types import Closure, ParamsT

ReevaluateFn = Closure  # the same protocol: per-sample losses, or (losses, sample_weight)


def _accepts_same_batch(closure: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(closure).parameters.values()
    except (TypeError, ValueError):  # builtins / C callables without a signature: let the call tell
        return True
    return any(p.name == "same_batch" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


class FAMO(JointBaseline):
    r"""FAMO -- fast adaptive multitask optimization -- with (theta, eta) joint.

    Logits xi in R^m (0 at start) define task priorities p = softmax(xi).  One call of :meth:`step`:

    .. code-block:: text

        input: lr (theta and eta), pref_lr (the logits' Adam LR), logit_decay (gamma), loss_floor
               (l*), famo_eps (eps), lambda (lam), f (divergence)
        state: theta, eta (0), xi = 0 and its Adam moments, w (the last combination weights)

        batch xi_t (closure call 1) at (theta_t, eta_t): dual objectives L^i, z = dL/deta
        D_i = max(L^i - l*_i, 0) + eps
        [next-batch form: the logit update of step t-1 (below) runs here, with L' = this L]
        p = softmax(xi)
        c_i = (p_i / D_i) / sum_j (p_j / D_j)                    # a convex combination
        d_theta = grad_theta sum_i c_i L^i                       # ONE backward pass
        theta_{t+1} = theta_t - lr * d_theta;   eta_{t+1} = eta_t - lr * z (.) c
        L'^i = the dual objectives on the SAME batch at (theta_{t+1}, eta_{t+1}), no gradients
               (same-batch form; see below for the next-batch form)
        D'_i = max(L'^i - l*_i, 0) + eps;  delta = log D - log D'  # per-task log-decrease
        xi.grad = p (.) (delta - p^T delta)                      # = (d softmax / d xi)^T delta
        xi <- Adam step (betas 0.9, 0.999, eps 1e-8) on xi.grad + gamma * xi   (coupled weight decay)

    (c is the gradient direction of sum_i p_i log D_i up to the factor 1/sum_j p_j/D_j.)

    Differences from the authors' implementation (Cranial-XIX/FAMO: ``famo.py`` and ``FAMO`` in
    ``methods/weight_methods.py``), each decided:

    * c, the logits' gradient and their Adam (betas, eps, coupled weight decay gamma) are the same:
      the official code backpropagates sum_i p_i log(D_i) / c, whose gradient is the direction
      above, and its ``update`` sets xi.grad as above.
    * The clip (deliberate, not reproduced).  ``famo.py`` clips the shared parameters' gradient to
      norm ``max_norm = 1`` after the backward (famo.py line 69).  The repository's experiments go
      through ``WeightMethod.backward`` of ``methods/weight_methods.py``, which runs the same clip
      *before* ``loss.backward()`` (after the trainer's ``zero_grad``), where it does nothing.  Here
      no clip: the paper's update, for which the DR paper's learning rates were chosen.
    * The floor (deliberate).  Official ``D_i = L^i - l*_i + 1e-8``, unguarded: a loss below ``l*`` takes
      the log of a negative number (NaN).  Here D is clamped at eps and ``below_floor`` says so.
    * The parameter step (the DR setting).  theta and eta take a plain gradient step of size
      ``lr`` here; the official class leaves the step to the caller's optimizer (Adam in its demo).

    The logit update's L': two forms.  FAMO's algorithm (the paper's, and the authors' trainers)
    takes L' on the batch it just stepped on, recomputed at the new parameters -- the *same-batch
    form*, used when the re-evaluation can be had:

    * the closure takes a keyword ``same_batch``: ``closure()`` draws a fresh batch as for every
      drmoo optimizer, ``closure(same_batch=True)`` recomputes the per-sample losses of the batch
      the previous call drew (FAMO calls it under ``torch.no_grad()``); or
    * ``step(closure, reevaluate=fn)``: ``fn()`` recomputes them.
    If the re-evaluated losses are non-finite or misshaped, theta and eta are restored and the step
    raises.

    With a plain closure (the one every drmoo optimizer takes), and always under
    :class:`drmoo.Balancer` (whose user's optimizer steps theta only after ``backward``), the update
    is the *next-batch form*: step t+1 first updates the logits with L' = the dual objectives of
    ITS batch at (theta_{t+1}, eta_{t+1}) -- a fresh batch, not step t's -- and then forms its
    weights c from them.  It costs no re-evaluation (one forward per step instead of two); delta
    then also carries the difference between the two batches, a zero-mean noise for i.i.d. batches.
    This is our choice for the single-closure API, not the paper's algorithm: pass a ``same_batch``
    closure for the paper's form.  The pending update (D of the last batch) is in ``state_dict``.

    The lower bound l* (``loss_floor``).  D_i must stay positive.  By weak duality (take the
    worst-case distribution equal to the nominal one, f(1) = 0), L^i(theta, eta) >= mean_b l^i_b
    for every eta, on every batch: a lower bound of the per-sample losses is a lower bound of the
    dual objective, whatever eta.  Hence the rule: l* = a lower bound of the per-sample losses,
    default 0 for nonnegative losses (cross-entropy, squared error); pass a number, or one per
    task, for losses that can be negative.  Should a dual objective still fall below l* (a wrong
    bound), D is clamped at eps and ``stats["below_floor"]`` says so (no host sync in the step).
    Do not schedule a learning rate on, or monitor, the FAMO scalar: :meth:`step` returns the
    per-task dual objectives.

    Cost per step: 1 closure call (one fresh batch, B samples) + (same-batch form) 1 re-evaluation
    of it (a forward without graph), one backward pass (plus a backward through the heads only,
    which get their raw gradient), O(m) state: the logits and their Adam moments (in
    ``state_dict``); in the same-batch form theta is copied once per step (n entries, freed at its
    end) so that a failed re-evaluation can restore it.

    ``stats``: ``w`` (= c, on the simplex), ``eta``, ``dual_objective`` (before the step),
    ``dual_objective_after`` (same-batch form), ``balanced_grad_norm`` = ||[d_theta ; z (.) c]||, ``theta_grad_norm``
    = ||d_theta||, ``logits`` (updated), ``below_floor``, ``z``, ``step_weights``, ``batches``.

    Learning-rate scale.  ``lr`` multiplies the gradient of a convex combination of the task
    objectives, unnormalised, as in SGD on a weighted loss; it does not transfer to Double-Clip's
    clipped step.

    Presets: ``multimnist`` (defaults: lr 1e-4, pref_lr 2.5e-3, gamma 1e-2), ``celeba``
    (pref_lr 5e-6).  The paper gives no synthetic settings for FAMO.

    Feature space (``jacobian="features"``).  FAMO's inputs are the
    dual objectives' values, not gradients, and its step is already one backward pass: its weights c
    and its theta step are the same in both modes (the step's backward runs to z, then through the
    trunk).  Only the reported ``theta_grad_norm`` / ``balanced_grad_norm`` become z-space norms.
    The mode is accepted so that every method takes the same closure ``(losses, z)``.

    Args:
        params: the shared parameters.
        num_tasks: m.
        lr: step of theta and eta.
        pref_lr: Adam LR of the logits.
        logit_decay: gamma, Adam's weight decay on the logits.
        loss_floor: l* (a number or one per task).
        famo_eps: eps in D.
        lam: lambda > 0.
        divergence: f.
        capturable: no host read in :meth:`step` (see :mod:`drmoo.optim`, "Capturable steps").
        backend: kernel backend (see :mod:`drmoo_kernels.dispatch`).
        jacobian: ``"parameters"`` (the paper's: per-task gradients w.r.t. the shared parameters, m
            backward passes through the trunk) or ``"features"`` (w.r.t. the representation z: m
            passes through the heads, one through the trunk; see "Feature space" above).  Its theta
            step is the exact gradient of sum_i c_i L^i either way (only the weights are taken in z),
            so its rates carry over.
        jacobian_strategy: how the per-task gradients are computed (:mod:`drmoo.jacobian`): ``"auto"``
            (default: the fewest kernel launches on a GPU, the least memory traffic on the CPU),
            ``"loop"`` (one backward per task) or ``"batched"`` (one vmapped backward); the same gradients
            up to rounding.  Also the ``jacobian_strategy`` attribute, which may be set later.
    """

    FORMS_JACOBIAN: ClassVar[bool] = False  # (the heads-as-shared check takes m backward passes, once)
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "multimnist": {"lr": 1e-4, "pref_lr": 2.5e-3, "logit_decay": 1e-2, "lam": 0.8},
        "celeba": {"lr": 1e-4, "pref_lr": 5e-6, "logit_decay": 1e-2, "lam": 0.8},
    }
    ADAM_BETAS = (0.9, 0.999)
    ADAM_EPS = 1e-8

    def __init__(
        self,
        params: ParamsT,
        num_tasks: int,
        *,
        lr: float = 1e-4,
        pref_lr: float = 2.5e-3,
        logit_decay: float = 1e-2,
        loss_floor: float | Sequence[float] = 0.0,
        famo_eps: float = 1e-8,
        lam: float = 0.8,
        divergence: str = "chi2",
        capturable: bool = False,
        backend: str | None = None,
        jacobian: str = "parameters",
        jacobian_strategy: str = "auto",
    ) -> None:
        # One number is broadcast to every task (stored as a 1-tuple); otherwise one per task.
        floors = HYPERPARAMETER_CHECKS["loss_floor"]("loss_floor", loss_floor)
        defaults = {
            **common_defaults(lam, divergence, lr=lr, pref_lr=pref_lr, logit_decay=logit_decay),
            "loss_floor": floors,
            "famo_eps": check_positive("famo_eps", famo_eps),
            "capturable": check_flag("capturable", capturable),
        }
        super().__init__(params, num_tasks, defaults, backend)
        self.jacobian_engine = configure_jacobian(self, jacobian, jacobian_strategy)
        if len(floors) not in (1, num_tasks):
            raise ValueError(f"loss_floor has {len(floors)} values, but num_tasks={num_tasks}")
        self._floor_cache: tuple[tuple[float, ...], Tensor] | None = None

    def extra_state(self) -> dict[str, Any]:
        zeros = torch.zeros(self.num_tasks, device=self.device, dtype=torch.float64)
        # adam_steps is a 0-d tensor on the device (as torch.optim.Adam's capturable step): a
        # skipped capturable step must not advance Adam's bias correction, decided on the device.
        # pending / pending_distance: the next-batch form's logit update waiting for the next step
        # (pending = 1 after such a step; D_i of the batch it stepped on).
        return {"logits": zeros, "adam_exp_avg": zeros.clone(), "adam_exp_avg_sq": zeros.clone(),
                "adam_steps": torch.zeros((), device=self.device, dtype=torch.float64),
                "pending": torch.zeros((), device=self.device, dtype=torch.float64),
                "pending_distance": torch.ones(self.num_tasks, device=self.device, dtype=torch.float64)}

    def validate_state_dict(self, state_dict: Any) -> None:
        """The base checks, and ``loss_floor`` with one value or one per task of this optimizer.

        Args:
            state_dict: what was handed to :meth:`load_state_dict`.
        """
        super().validate_state_dict(state_dict)
        for group in state_dict["param_groups"]:
            floors = HYPERPARAMETER_CHECKS["loss_floor"]("loss_floor", group["loss_floor"])
            if len(floors) not in (1, self.num_tasks):
                raise ValueError(f"state_dict's loss_floor has {len(floors)} values, but this FAMO has "
                                 f"num_tasks={self.num_tasks}")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a FAMO state; one saved when ``adam_steps`` was an int is accepted (made a tensor), one
        saved before the next-batch form existed gets no pending logit update.

        Args:
            state_dict: a ``state_dict()`` of a FAMO optimizer for the same problem.
        """
        saved = state_dict.get("state", {}).get(STATE_KEY) if isinstance(state_dict, dict) else None
        if isinstance(saved, dict):
            upgraded = dict(saved)
            steps = saved.get("adam_steps")
            if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0:
                upgraded["adam_steps"] = torch.tensor(float(steps), dtype=torch.float64)
            if "pending" not in saved and "pending_distance" not in saved:
                upgraded["pending"] = torch.zeros((), dtype=torch.float64)
                upgraded["pending_distance"] = torch.ones(self.num_tasks, dtype=torch.float64)
            state_dict = {**state_dict, "state": {**state_dict["state"], STATE_KEY: upgraded}}
        super().load_state_dict(state_dict)

    def _loss_floor(self) -> Tensor:
        """l* as an [m] float64 tensor on the device, made once per value (no copy inside a step)."""
        floors = self.param_groups[0]["loss_floor"]
        if self._floor_cache is None or self._floor_cache[0] != floors:
            if len(floors) not in (1, self.num_tasks):
                raise ValueError(f"loss_floor has {len(floors)} values, but num_tasks={self.num_tasks}")
            values = torch.tensor(floors, dtype=torch.float64).expand(self.num_tasks).to(self.device)
            self._floor_cache = (floors, values)
        return self._floor_cache[1]

    def step(  # type: ignore[override]
        self, closure: Closure | None = None, reevaluate: ReevaluateFn | None = None
    ) -> Tensor:
        """One FAMO iteration: one fresh batch, and the logit update -- on a re-evaluation of that
        batch (same-batch form) or deferred to the next step (next-batch form).  See the class docstring.

        Args:
            closure: draws a fresh batch and returns its per-sample losses ``[B, m]`` with their graph,
                or ``(losses, sample_weight)`` -- or an iterable of micro-batches that make the batch, for the
                whole batch's step without its whole graph in memory (the closure protocol of
                :mod:`drmoo.optim`, :data:`drmoo.optim.Closure`); required (None raises ValueError).
            reevaluate: recomputes the per-sample losses of the batch ``closure`` just drew, at the
                stepped parameters (same-batch form); None = ``closure(same_batch=True)`` when the closure
                takes that keyword, else the next-batch form.
        """
        h = self.param_groups[0]
        state = self.state[STATE_KEY]
        if reevaluate is None and closure is not None and not self.direction_mode and _accepts_same_batch(closure):
            reevaluate = lambda: closure(same_batch=True)  # type: ignore[call-arg]  # noqa: E731
        self.begin_step()
        batch = self.draw_batch(closure)

        floor = self._loss_floor()
        eps = h["famo_eps"]
        gap = batch.objective.double() - floor
        below_floor = (gap < 0).any()
        distance = torch.clamp(gap, min=0.0) + eps
        logits, deferred_update = state["logits"], None
        if reevaluate is None:
            # Next-batch form: the previous step's logit update, its L' being this batch's dual
            # objectives at (theta_t, eta_t).  Computed now, committed with the rest of the step.
            previous = torch.softmax(logits, dim=0)
            decrease = torch.log(state["pending_distance"]) - torch.log(distance)
            logit_grad = previous * (decrease - previous @ decrease)
            deferred_update = self._adam_update(logit_grad, active=state["pending"] > 0)
            logits = deferred_update["logits"]
        priorities = torch.softmax(logits, dim=0)
        inverse = priorities / distance
        weights = inverse / inverse.sum()

        combined = self.combined_gradient(batch, weights, "d")
        theta_norm = self.combined_norm(combined)
        finite = self.combined_finite(combined, theta_norm).expand(self.num_tasks)
        self.raise_unless_finite([("sum_i c_i grad L^i", finite)])
        one = torch.ones(1, dtype=torch.float64, device=self.device)
        extra_stats: dict[str, Tensor] = {}
        if reevaluate is None:
            self.apply_direction(combined[None, :], one)
            self.step_eta(batch.z, weights, h["lr"])
            self._commit_adam(deferred_update)
            self.commit_(state["pending_distance"], distance)
            self.commit_(state["pending"], torch.ones_like(state["pending"]))
        else:
            objective_after = self._step_and_reevaluate(batch, combined, weights, reevaluate)
            distance_after = torch.clamp(objective_after.double() - floor, min=0.0) + eps
            decrease = torch.log(distance) - torch.log(distance_after)
            self._commit_adam(self._adam_update(priorities * (decrease - priorities @ decrease)))
            self.commit_(state["pending"], torch.zeros_like(state["pending"]))
            extra_stats["dual_objective_after"] = objective_after.detach()

        self.set_w(weights)
        return self.finish_step(
            batch, weights, theta_norm, batch.z.double() * weights,
            logits=state["logits"].clone(), below_floor=below_floor, **extra_stats,
        )

    def _step_and_reevaluate(self, batch: TaskGradients, combined: Tensor, weights: Tensor,
                             reevaluate: ReevaluateFn) -> Tensor:
        """Same-batch form: step theta and eta, re-evaluate the batch there (no graph) and return its
        dual objectives; theta and eta are restored if the re-evaluation fails or is non-finite."""
        h = self.param_groups[0]
        shared = self._shared_params()
        if self._sharded():  # FSDP2: each rank keeps (and writes back) its own shards (drmoo.optim._fsdp)
            shared = local_views(shared)
            backup = [part.detach().clone() for part in shared]
        else:  # theta before the step, for its roll-back: one multi-tensor copy into a kept flat buffer
            theta_before = self._vector("theta_before")
            copy_into_row(shared, theta_before, [p.detach() for p in shared])
            backup = column_views(shared, theta_before)
        eta_backup = self.eta.clone()
        stepped = (batch_rows(self, batch.losses), self.num_tasks)  # (micro-batches: the whole batch's rows)
        with self.deferred_writes():  # restored below if the step fails: the guards are read after the re-evaluation
            self.apply_direction(combined[None, :], torch.ones(1, dtype=torch.float64, device=self.device))
            self.step_eta(batch.z, weights, h["lr"])
        try:
            with torch.no_grad():
                after = self.draw_losses(reevaluate, need_graph=False)
            if tuple(after.shape) != stepped:
                raise ValueError(
                    f"the re-evaluated losses have shape {tuple(after.shape)}, but the batch stepped on had "
                    f"{stepped}: closure(same_batch=True) / reevaluate() must recompute "
                    "the same batch"
                )
            self.settle_guards()  # eager: the step's one host read (its guards so far, the re-evaluation's too)
        except BaseException:
            with torch.no_grad():
                for p, saved in zip(shared, backup):
                    p.copy_(saved)
                self.eta.copy_(eta_backup)
            raise
        found_inf = self.found_inf  # set throughout a capturable step, None in an eager one
        if found_inf is not None:  # a non-finite re-evaluation (or earlier NaN): theta and eta back, on the device
            with torch.no_grad():
                for p, saved in zip(shared, backup):
                    p.copy_(torch.where(found_inf, saved, p))
                self.eta.copy_(torch.where(found_inf, eta_backup, self.eta))
        objective_after, _, _ = self.dual_forward(after, self.eta, h["lam"], 1.0)
        return objective_after

    def _adam_update(self, gradient: Tensor, active: Tensor | None = None) -> dict[str, Tensor]:
        """Adam with coupled (L2) weight decay on the logits, as ``torch.optim.Adam`` computes it:
        the new logits and moments (not written; ``active`` False keeps the current ones)."""
        h, state = self.param_groups[0], self.state[STATE_KEY]
        beta1, beta2 = self.ADAM_BETAS
        logits = state["logits"]
        gradient = gradient + h["logit_decay"] * logits
        steps = state["adam_steps"] + 1.0
        exp_avg = beta1 * state["adam_exp_avg"] + (1.0 - beta1) * gradient
        exp_avg_sq = beta2 * state["adam_exp_avg_sq"] + (1.0 - beta2) * gradient * gradient
        denominator = torch.sqrt(exp_avg_sq) / torch.sqrt(1.0 - beta2**steps) + self.ADAM_EPS
        values = {"logits": logits - (h["pref_lr"] / (1.0 - beta1**steps)) * exp_avg / denominator,
                  "adam_exp_avg": exp_avg, "adam_exp_avg_sq": exp_avg_sq, "adam_steps": steps}
        if active is not None:
            values = {key: torch.where(active, value, state[key]) for key, value in values.items()}
        return values

    def _commit_adam(self, values: dict[str, Tensor] | None) -> None:
        """Write the Adam update in place (masked in a capturable step: the state keeps its storage)."""
        assert values is not None
        state = self.state[STATE_KEY]
        for key, value in values.items():
            self.commit_(state[key], value)
