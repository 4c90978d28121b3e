"""What the six baselines share: (theta, eta) as one joint variable of the DR dual.

The paper runs every baseline (MGDA, MoDo, MoCo, SDMGrad, NashMTL, FAMO) on the dual objectives
L^i(theta, eta) with theta and eta updated *jointly*.  The per-task gradient of the joint vector
(theta, eta) is

    g_i = [ grad_theta L^i ; z^i e_i ]        with  z^i = dL^i/deta^i   (dL^i/deta^j = 0, j != i),

so for rows J (m x n, the theta parts) the joint Gram matrix is ``K_joint = J J^T + diag(z^2)``, the
cross product of two batches is ``J_1 J_2^T + diag(z_1 (.) z_2)``, and any combined direction
``sum_i w^i g_i`` has theta part ``J^T w`` and eta part ``z (.) w``.  Every baseline steps theta and
eta with the same learning rate along that joint direction (:meth:`JointBaseline.step_joint`; driven
by :class:`drmoo.Balancer`, the theta part goes into ``.grad`` and eta still takes the ``lr`` step).

This module holds the joint algebra and the parts of a step every baseline needs: a batch turned
into dual objectives, z and per-task gradients; one batched finiteness check before anything is
written (read with the step's other guards: one host read a step); one combined backward pass for the
methods that never need J (FAMO, NashMTL between weight updates); the stats every optimizer reports;
named presets; and ``state_dict`` validation for the methods' extra state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from drmoo import distributed
from drmoo.jacobian import copy_into_row, feed_head_grads, head_leaves, require_reached
from drmoo_kernels.reference import project_simplex

from ._accumulate import accumulated_rows
from ._base import MultiObjectiveOptimizer
from ._fsdp import feed_sharded_heads, is_sharded, sharded_combined_gradient, split_sharded_heads, sum_over_ranks
from ._guards import FiniteValues, finite_entries, flags_of
from ._hyperparameters import check_count, check_fraction, check_positive
from ._loss_scale import divide_, times
from ._state_dict import STATE_KEY
from .types import Closure

__all__ = [
    "JointBaseline",
    "TaskGradients",
    "all_finite",
    "check_count",
    "check_fraction",
    "common_defaults",
    "cross_gram",
    "finite_entries",
    "head_leaves",
    "joint_cross",
    "joint_gram",
    "joint_norm",
    "norm_f64",
    "project_simplex",
    "rows_finite",
    "simplex_step",
]

# Below this a Gram scale (a squared gradient norm) counts as zero: scaling by it would overflow.
TINY = 1e-30


def common_defaults(lam: float, divergence: str, **step_sizes: float) -> dict[str, Any]:
    """Validated hyperparameters every baseline has: step sizes / regularizers (>= 0), lam (> 0), f."""
    checked = {name: check_positive(name, value, allow_zero=True) for name, value in step_sizes.items()}
    return {**checked, "lam": check_positive("lam", lam), "divergence": divergence}


def joint_gram(gram: Tensor, z: Tensor) -> Tensor:
    """K_joint = J J^T + diag(z^2) in float64, from the theta Gram matrix and the eta gradients."""
    z64 = z.double()
    return gram.double() + torch.diag(z64 * z64)


def cross_gram(first: Tensor, second: Tensor) -> Tensor:
    """J_1 J_2^T (m x m) of two [m, n] Jacobians, accumulated like the ``gram`` op, as float64."""
    acc = torch.float64 if first.dtype == torch.float64 else torch.float32
    return (first.to(acc) @ second.to(acc).T).double()


def joint_cross(first: Tensor, z_first: Tensor, second: Tensor, z_second: Tensor) -> Tensor:
    """The joint cross product J_1 J_2^T + diag(z_1 (.) z_2) of two batches, float64."""
    return cross_gram(first, second) + torch.diag(z_first.double() * z_second.double())


def joint_norm(gram_joint: Tensor, weights: Tensor) -> Tensor:
    """||sum_i w^i g_i|| = sqrt(w^T K w) (clamped at 0 against rounding), float64."""
    w64 = weights.double()
    return torch.sqrt(torch.clamp(w64 @ (gram_joint.double() @ w64), min=0.0))


@dataclass
class TaskGradients:
    """One batch seen by a baseline: everything about (theta_t, eta_t) on it."""

    losses: Tensor  # per-sample losses [B, m], with their graph
    objective: Tensor  # [m] dual objectives L^i(theta_t, eta_t)
    z: Tensor  # [m] dL^i/deta^i: the eta block of the joint gradient is diag(z)
    cotangent: Tensor  # [B, m] d objective / d losses (the worst-case weights / B)
    jacobian: Tensor | None  # [m, n] rows grad_theta L^i (a reused buffer), None if not computed


class JointBaseline(MultiObjectiveOptimizer):
    """Base of the baselines: the joint (theta, eta) step, checks, stats, presets, extra state.

    Subclasses declare their extra optimizer state in :meth:`extra_state` (created at construction,
    saved under ``state["drmoo"]``, validated on load) and, like every drmoo optimizer, their paper
    hyperparameters in ``PRESETS`` (:meth:`MultiObjectiveOptimizer.preset`).
    """

    def __init__(self, params: Any, num_tasks: int, defaults: dict[str, Any], backend: str | None) -> None:
        super().__init__(params, num_tasks, defaults, backend)
        self._vectors: dict[str, Tensor] = {}
        self._batches_drawn = 0
        extra = self.extra_state()
        self._extra_keys = tuple(extra)
        self.state[STATE_KEY].update(extra)

    # ---------------------------------------------------------------------------------- state
    def extra_state(self) -> dict[str, Any]:
        """Initial values of the method's own state (beyond w, eta, step); tensors or ints."""
        return {}

    @property
    def state_dtype(self) -> torch.dtype:
        """dtype of the m-sized state the base class keeps (w, eta)."""
        return self.w.dtype

    def state_entries(self) -> dict[str, Any]:
        own = self.state[STATE_KEY]
        return {**super().state_entries(), **{key: own[key] for key in self._extra_keys}}

    @property
    def num_shared(self) -> int:
        """n, the number of shared parameter entries."""
        return sum(p.numel() for p in self._shared_params())

    # ---------------------------------------------------------------------------------- batches
    def begin_step(self) -> None:
        self._batches_drawn = 0

    def draw_batch(self, closure: Closure | None) -> TaskGradients:
        """One fresh batch (with graph): its losses, dual objective, z and cotangent at the current eta."""
        losses = self.draw_losses(closure, need_graph=True)
        self._batches_drawn += 1
        h = self.param_groups[0]
        objective, z, cotangent = self.dual_forward(losses.detach(), self.eta, h["lam"], 1.0)
        self.check_dual(objective, z)  # a NaN objective (finite weights) is a non-finite step too
        return TaskGradients(losses, objective, z, cotangent, None)

    def task_gradients(self, closure: Closure | None, slot: str, *, feed_heads: bool) -> TaskGradients:
        """A fresh batch and its per-task gradients J (m backward passes) into buffer ``slot``."""
        batch = self.draw_batch(closure)
        batch.jacobian = self.task_jacobian(batch.losses, batch.cotangent, slot, feed_heads=feed_heads)
        return batch

    def combined_gradient(self, batch: TaskGradients, task_weights: Tensor, slot: str) -> Tensor:
        """grad_theta sum_i c_i L^i in ONE backward pass; the heads get their raw gradient.

        The shared parameters' backward is restricted to them and its gradients are written into a
        flat buffer by one multi-tensor copy (as in ``task_jacobian``).  The heads then get the
        gradient of sum_i L^i (unweighted, the convention for every method) from a second backward
        restricted to the head leaves, which only traverses the graph above them.
        """
        shared = self._shared_params()
        features = self.features_engine
        # (the engine's: on FSDP2 shards the graph's leaves are FSDP's copies of the shared parameters, not heads)
        heads, sharded_heads = split_sharded_heads(self.jacobian_engine.heads(batch.losses, shared, feed_heads=True))
        scale = self.loss_scale  # fp16 gradient scaling (see MultiObjectiveOptimizer.loss_scale)
        weighted = times(batch.cotangent * task_weights.to(batch.cotangent.dtype), scale).to(batch.losses.dtype)
        reuse = self.take_graph_reuse()
        # The heads-as-shared check has no Jacobian to read; on FSDP2 shards (whose losses reach FSDP's copies, not
        # them) it does not run, as on the shards' columns of a Jacobian
        if features is None and not self.FORMS_JACOBIAN and not self._sharded():
            self._refuse_partly_shared_params_by_backward(batch.losses, batch.cotangent)
        if sharded_heads:  # FSDP2-sharded heads: the same raw gradient, through FSDP's own backward (graph kept)
            feed_sharded_heads(self, batch.losses, batch.cotangent, sharded_heads)
        if features is not None:
            # jacobian="features": the gradient w.r.t. z (a pass above z only); apply_direction lifts it
            # through the trunk.  Each rank keeps its samples' entries (combined_norm sums over ranks).
            flat = features.combined_gradient(self, batch.losses, weighted, slot, retain_graph=reuse or bool(heads))
        elif self._sharded():
            # FSDP2: this rank's shard of the combined gradient, reduce-scattered by FSDP (combined_norm sums over
            # ranks; apply_direction writes each shard from its own part)
            flat = sharded_combined_gradient(self, batch.losses, weighted, shared, retain_graph=reuse or bool(heads))
        else:
            flat = self._vector(slot)
            grads = torch.autograd.grad(batch.losses, shared, grad_outputs=weighted,
                                        retain_graph=reuse or bool(heads), allow_unused=True)
            require_reached(grads)
            copy_into_row(shared, flat, grads)
            del grads
        if heads:
            self.set_aside_head_grads(heads)
            # autograd.grad and an add into .grad (as every Jacobian pass feeds them), not backward(inputs=heads):
            # a backward runs the heads' AccumulateGrad hooks, which DistributedDataParallel's reducer counts on,
            # and a DDP model outside no_sync() then failed its next forward ("Expected to have finished
            # reduction in the prior iteration").
            feed_head_grads(batch.losses, heads, times(batch.cotangent, scale), retain_graph=reuse)
            self.check_head_grads(accumulated_rows(self, heads, True))
        divide_(flat, scale)
        if features is not None:
            if self.accumulation is not None:  # its norm and lift add the earlier micro-batches' c^T J_z
                self.accumulation.combined = (flat, task_weights)
            return flat
        if self._sharded():  # (accumulation is refused on sharded parameters)
            return flat
        distributed.all_reduce_sum_(flat)  # shard gradients -> the global batch's
        if self.accumulation is not None:  # the earlier micro-batches' part, from their rows
            self.accumulation.add_combined(flat, task_weights)
        return flat

    def combined_norm(self, combined: Tensor) -> Tensor:
        """||combined|| (0-d float64) of a :meth:`combined_gradient`; features mode: over all ranks' samples."""
        if self.features_engine is None and not self._sharded():
            return norm_f64(combined)
        square = torch.linalg.vector_norm(combined).double() ** 2
        if self.features_engine is None:  # FSDP2: this rank's shard of the gradient
            return torch.sqrt(sum_over_ranks(square))
        if self.accumulation is not None:  # closing an accumulation: + the earlier micro-batches' c^T K c
            square = self.accumulation.combined_square(square)
        return torch.sqrt(self.features_engine.products_over_ranks(square.reshape(1)))[0]

    def combined_finite(self, combined: Tensor, norm: Tensor) -> Tensor:
        """0-d bool: a :meth:`combined_gradient` is finite (features mode and FSDP2 shards: on every rank, read
        from its norm summed over ranks, so that all ranks agree before the one that failed raises)."""
        return all_finite(combined) if self.features_engine is None and not self._sharded() else torch.isfinite(norm)

    def _sharded(self) -> bool:
        """Whether the shared parameters are FSDP2-sharded (drmoo.optim._fsdp): each rank holds its shard's columns."""
        return is_sharded(self._shared_params())

    def task_cross(self, first: Tensor, z_first: Tensor, second: Tensor, z_second: Tensor) -> Tensor:
        """The joint cross product J_1 J_2^T + diag(z_1 (.) z_2) (:func:`joint_cross`); features rows (each rank
        holds its samples' columns) and FSDP-sharded rows (its shard's): the J part summed over ranks."""
        local = cross_gram(first, second)
        if self.features_engine is not None and self.accumulation is not None:  # one batch: + the earlier ones'
            local = self.accumulation.with_earlier_gram(local)
        cross = self.jacobian_engine.products_over_ranks(local)
        return cross + torch.diag(z_first.double() * z_second.double())

    def _vector(self, name: str) -> Tensor:
        shared = self._shared_params()
        vec = self._vectors.get(name)
        if vec is None or vec.numel() != self.num_shared:
            vec = torch.empty(self.num_shared, device=self.device, dtype=shared[0].dtype)
            self._vectors[name] = vec
        return vec

    # ----------------------------------------------------------------------------------- checks
    def raise_unless_finite(self, checks: Sequence[tuple[str, Tensor | FiniteValues]]) -> None:
        """One guard for all checks of a Jacobian (role, [m] bool 'task i finite', or the values whose
        finiteness they are: tested with the step's other guards at once), read with the step's others.

        NaN/Inf in a Jacobian row propagates into that row of any product computed from it (also
        through a zero weight: 0 * Inf = NaN), so checking the small products covers the big buffers.
        """
        if not checks:
            return

        def stacked() -> Tensor:
            return torch.stack([flags_of(flag).reshape(-1).to(torch.bool) for _, flag in checks])

        lazy = [flag for _, flag in checks if isinstance(flag, FiniteValues)]
        flags = (FiniteValues(tuple(value for flag in lazy for value in flag.values), stacked)
                 if len(lazy) == len(checks) else stacked())

        def describe(bad: list[int]) -> str:
            width = len(flags_of(checks[0][1]).reshape(-1))
            per_role = [(role, [i % width for i in bad if i // width == k]) for k, (role, _) in enumerate(checks)]
            listed = "; ".join(f"{role}: task(s) {tasks}" for role, tasks in per_role if tasks)
            return (f"non-finite gradients of the shared parameters ({listed}) in {self.failing_iteration}; "
                    "the step was abandoned and nothing was updated")

        self.require_finite(flags, describe)

    # ------------------------------------------------------------------------------------ steps
    def step_joint(self, jacobian: Tensor, z: Tensor, weights: Tensor) -> None:
        """theta -= lr * J^T w (the ``combine`` op; direction mode: into ``.grad``) and
        eta -= lr * z (.) w: the joint step, lr = the group's ``lr``."""
        self.apply_direction(jacobian, weights)
        self.step_eta(z, weights, self.hyper("lr"))

    def step_eta(self, z: Tensor, weights: Tensor, lr: Tensor | float) -> None:
        eta = self.eta
        self.commit_(eta, eta - (lr * z.double() * weights.double()).to(eta.dtype))

    def set_w(self, weights: Tensor) -> None:
        self.commit_(self.w, weights.to(self.w.dtype))

    def finish_step(
        self,
        batch: TaskGradients,
        weights: Tensor,
        theta_norm: Tensor,
        eta_part: Tensor,
        **extra: Tensor,
    ) -> Tensor:
        """Count the step and fill ``stats``; returns the per-task dual objectives of ``batch``.

        ``balanced_grad_norm`` = ||[J^T w ; z (.) w]|| on the batch of the parameter step, from the
        theta part's norm and the eta part z (.) w.
        """
        balanced = torch.sqrt(theta_norm.double() ** 2 + torch.sum(eta_part.double() ** 2))
        self.state[STATE_KEY]["step"] += 1
        self.stats = self._common_stats(batch.objective, balanced, theta_norm)
        self.stats.update(
            z=batch.z.detach(),
            step_weights=weights.detach().double().clone(),
            batches=torch.tensor(self._batches_drawn),
            **{key: value.detach() for key, value in extra.items()},
        )
        return batch.objective.detach()


def simplex_step(w: Tensor, gradient: Tensor, step_size: float) -> Tensor:
    """Pi(w - step_size * gradient) in float64 (the projected preference update)."""
    return project_simplex(w.double() - step_size * gradient.double())


def norm_f64(vector: Tensor) -> Tensor:
    """||vector|| as a 0-d float64, accumulated in the vector's own precision (float32 for the
    combined gradient): ``vector.double()`` first would copy an 11M-entry vector to float64, 78 ms
    of one CPU core.  The norm is a statistic (FAMO) or compared with a clipping bound (Nash-MTL),
    where float32's relative error is immaterial."""
    norm: Tensor = torch.linalg.vector_norm(vector)  # torch types the linalg functions as Any
    return norm.double()


def all_finite(vector: Tensor) -> Tensor:
    """0-d bool: every entry of a (long) vector is finite, in one read pass with no n-sized temporary.

    min and max are both finite exactly when every x_i is (an Inf is the min or the max, a NaN
    propagates to both: documented for ``torch.aminmax``).  ``isfinite(x).all()`` gives the same
    answer but builds n-sized temporaries, and the Inf-norm (max |x_i|) reduction is slow on some
    CPUs: for ResNet18's 11.2M shared entries on one core of an AMD EPYC (Zen 4), torch 2.14.1,
    ``aminmax`` takes 1.7 ms, ``vector_norm(ord=inf)`` 37 ms.
    """
    if vector.numel() == 0:  # no identity for min/max: nothing to check (a shape, not a tensor read)
        return torch.ones((), dtype=torch.bool, device=vector.device)
    low, high = torch.aminmax(vector)
    return torch.isfinite(low) & torch.isfinite(high)


def rows_finite(matrix: Tensor) -> Tensor:
    """[m] flags: row i of an m x m product finite (NaN/Inf in J row i reaches its row i)."""
    return torch.isfinite(matrix).all(dim=-1)
