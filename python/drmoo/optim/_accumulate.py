"""Gradient accumulation that gives the full-batch step: k micro-batches, ONE step of the method.

``drmoo.Balancer.backward(losses, accumulate=True)`` on every micro-batch but the last, then
``backward(losses)`` on the last, takes the step the method takes on the concatenated batch: the same
``.grad`` (shared parameters and heads), the same eta, w and state update, one dual step
(``steps_taken`` + 1), to the rounding of a different summation order.
The optimizers' ``step(closure)`` runs the same machinery when a closure returns its batch in
micro-batches (:mod:`drmoo.optim._micro_batches`).

Why it can be exact.  What a step of MGDA, MoDo, SDMGrad, MoCo, Nash-MTL or FAMO reads from its batch
is taken at the step's starting point (theta_t, eta_t), which does not move while micro-batches come:

* the per-task dual statistics, means over the batch: objective^i = mean_b[omega lam f*(u_b^i)] + eta^i
  and z^i = 1 - mean_b[omega v_b^i] -- the full batch's are the micro-batches' means weighted by their
  row counts B_k, whatever their sizes;
* the per-task gradients J[i] = sum_b (omega v_b^i / B) grad l_b^i, v_b^i = f*'((l_b^i - eta^i)/lam) a
  function of the sample's own loss and eta_t -- a sum over samples, so each micro-batch's part is
  taken by its own backward passes (with the cotangent omega v_b, the 1/B applied once B is known) and
  its graph freed at once;
* the heads' gradients (the same sums with the weights v_b, unweighted over tasks).

A micro-batch's part is reduced as it comes (:func:`reduce_micro_batch`): its dual sums, its m
backward passes into one [m, n] running sum (the Jacobian of parameters mode), and the heads' sums,
kept apart from their ``.grad`` until the step.  The last micro-batch runs the method's own step,
whose ``dual_forward`` and task gradients then return the full batch's (:class:`Accumulation`): the
Gram, the weights, the direction and the dual update are computed once, from the whole batch.

Cost: m backward passes per micro-batch (every method, FAMO included, whose own step takes one
combined backward: its weights depend on the whole batch's objective, known only at the last) and
one [m, n] buffer besides the method's own; the memory of one micro-batch's graph.

Features mode (``jacobian="features"``).  The method's algebra runs on J_z, the rows w.r.t. the
micro-batch's z, whose columns are its own samples: the full batch's J_z is the micro-batches' side
by side, so its Gram (and every m x m product of one batch's rows) is the sum of theirs.  Each
micro-batch keeps the m x m Gram of its J_z rows and, as its [m, n] part, those rows lifted through
the trunk one by one (g_i = (dz/dtheta)^T J_z[i], m backward passes instead of features mode's one:
the step's weights are not known yet).  The last micro-batch's step adds the earlier Grams to its own
(:meth:`Accumulation.with_earlier_gram`, also in the norm of a combined z-gradient), and the lift of
its direction c^T J_z adds c^T (the earlier g_i) / B (:meth:`Accumulation.add_lifted`): the same
Gram, weights and trunk ``.grad`` as one backward on the whole batch.  On FSDP-sharded shared
parameters it is refused.

Methods that cannot be exact this way are refused in accumulate mode (their class's
``ACCUMULATE_REFUSAL``): Double-Clip takes its gradients at eta_{t+1}, and Double-Loop at inner
iterates of eta, which depend on the whole batch's losses -- each micro-batch's per-sample weights are
known only after the last one, when its graph is gone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from drmoo.jacobian import copy_into_row, require_reached

from ._engine import EngineHost, JacobianEngine
from ._fsdp import is_sharded, refuse_accumulating_sharded_heads
from ._guards import StepGuard


class FeaturesOfStep(Protocol):
    """What accumulation reads of features mode's engine: the z of the micro-batch being reduced."""

    features: tuple[Tensor, ...] | None

__all__ = ["Accumulation", "accumulate_refusal", "accumulated_rows", "full_batch", "reduce_micro_batch"]


class AccumulationHost(EngineHost, Protocol):
    """What accumulation reads from, and asks of, the optimizer it serves (no import of the optimizer's class)."""

    accumulation: Accumulation | None
    jacobian_engine: JacobianEngine
    device: torch.device
    _guard: StepGuard | None  # the running step's guards (a micro-batch installs its own: reduce_micro_batch)

    @property
    def steps_taken(self) -> int: ...

    @property
    def features_engine(self) -> FeaturesOfStep | None: ...

    @property
    def eta(self) -> Tensor: ...

    def draw_losses(self, closure: Callable[[], Any] | None, *, need_graph: bool) -> Tensor: ...

    def dual_forward(self, losses: Tensor, eta: Tensor, lam: float, scale: float) -> tuple[Tensor, Tensor, Tensor]: ...

    def check_dual(self, *dual_quantities: Tensor) -> None: ...

# What the first micro-batch's shared parameters looked like, to notice an optimizer step taken between two
# micro-batches of one accumulated step (param._version: a host-side counter, no device read).
ParamVersions = tuple[int, ...]


def accumulate_refusal(optimizer: AccumulationHost, whole_batch: str = "pass the whole batch to one backward"
                       ) -> str | None:
    """Why ``optimizer`` cannot accumulate micro-batches exactly (a one-line reason and what to do, the
    alternative worded by ``whole_batch`` for the form the user wrote), or None.

    Every method takes its step's gradients at (theta_t, eta_t) but those whose class says why not in
    ``ACCUMULATE_REFUSAL`` (Double-Clip, Double-Loop)."""
    name = type(optimizer).__name__
    if is_sharded(optimizer._shared_params()):
        return (f"{name} cannot accumulate micro-batches on FSDP-sharded shared parameters: each micro-batch's "
                f"m per-task trunk gradients would be kept across the sharded trunk's backward passes; {whole_batch}, "
                "or keep the trunk replicated (DDP)")
    reason = getattr(type(optimizer), "ACCUMULATE_REFUSAL", None)
    if reason is not None:
        return (f"{name} cannot accumulate micro-batches exactly: {reason}; {whole_batch} (torch.cat of the "
                "micro-batches' losses keeps their graphs), or use a method that accumulates (mgda, modo, "
                "sdmgrad, moco, nashmtl, famo)")
    return None


class Accumulation:
    """The micro-batches of one step reduced so far (parameters mode): sums over their samples.

    ``objective`` and ``z`` hold sum_k B_k * (the micro-batch's mean), float64; ``jacobian`` holds
    sum_b omega v_b^i grad l_b^i [m, n] (the full batch's J times B); ``heads`` the heads' gradients
    in the same form, by the head's id.  Under torch.distributed B counts the rows of this rank's
    shards (every rank's are equal: checked with each micro-batch), and the sums are the global
    batch's divided by the world size, as ``dual_forward``'s cotangents are.
    """

    def __init__(self, versions: ParamVersions) -> None:
        self.versions = versions
        self.rows = 0
        self.objective: Tensor | None = None
        self.z: Tensor | None = None
        self.jacobian: Tensor | None = None
        self.heads: dict[int, tuple[Tensor, Tensor]] = {}
        # Features mode: sum_k J_z,k J_z,k^T (float64, this rank's columns; the full batch's Gram times B^2),
        # and the step's combined z-gradient with the task weights it was taken with (see FeaturesAccumulation).
        self.features_gram: Tensor | None = None
        self.combined: tuple[Tensor, Tensor] | None = None
        self.micro_batches = 0
        # Set for the step that closes the accumulation (the last micro-batch's rows are then known).
        self.total_rows = 0
        self.heads_added = False
        # A micro-batch overflowed under a GradScaler: the step that closes the accumulation is skipped.
        self.found_inf = False

    def add(self, rows: int, objective: Tensor, z: Tensor, jacobian: Tensor,
            heads: dict[int, tuple[Tensor, Tensor]], features_gram: Tensor | None = None) -> None:
        """Add one micro-batch's part (``rows`` samples): the means ``objective``, ``z``; the sums ``jacobian``,
        ``heads``; in features mode the Gram of its rows w.r.t. its z (taken with the same cotangents)."""
        if features_gram is not None:
            gram = features_gram.double()
            self.features_gram = gram if self.features_gram is None else self.features_gram + gram
        weighted_objective, weighted_z = rows * objective.double(), rows * z.double()
        if self.jacobian is None:
            self.objective, self.z, self.jacobian = weighted_objective, weighted_z, jacobian.clone()
        else:
            assert self.objective is not None and self.z is not None
            self.objective += weighted_objective
            self.z += weighted_z
            self.jacobian += jacobian
        for key, (head, grad) in heads.items():
            if key in self.heads:
                self.heads[key][1].add_(grad)
            else:
                self.heads[key] = (head, grad)
        self.rows += rows
        self.micro_batches += 1

    # ------------------------------------------------------------------- the step that closes it
    def close_with(self, rows: int) -> None:
        """The last micro-batch has ``rows`` samples: the full batch's statistics can be formed."""
        self.total_rows = self.rows + rows
        self.heads_added = False

    def full_batch(self, objective: Tensor, z: Tensor, cotangent: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The last micro-batch's ``dual_forward`` outputs turned into the full batch's: its objective and z
        joined to the earlier micro-batches' (weighted by rows), its cotangents v_b / B_last rescaled to
        v_b / B (so that its backward passes give its share of the full batch's gradients)."""
        assert self.objective is not None and self.z is not None
        last, total = cotangent.shape[0], self.total_rows
        joined_objective = ((self.objective + last * objective.double()) / total).to(objective.dtype)
        joined_z = ((self.z + last * z.double()) / total).to(z.dtype)
        return joined_objective, joined_z, cotangent * (last / total)

    def add_jacobian(self, jacobian: Tensor) -> None:
        """The last micro-batch's rows (taken with :meth:`full_batch`'s cotangents) += the earlier ones' / B."""
        assert self.jacobian is not None
        jacobian.add_(self.jacobian.to(jacobian.dtype), alpha=1.0 / self.total_rows)

    def add_combined(self, combined: Tensor, task_weights: Tensor) -> None:
        """A combined gradient sum_i c_i grad L^i of the last micro-batch += the earlier ones' c^T J / B."""
        assert self.jacobian is not None
        acc = torch.float64 if self.jacobian.dtype == torch.float64 else torch.float32
        earlier = task_weights.to(acc) @ self.jacobian.to(acc)
        combined.add_(earlier.to(combined.dtype), alpha=1.0 / self.total_rows)

    # ------------------------------------------------------------- features mode (jacobian="features")
    def with_earlier_gram(self, gram: Tensor) -> Tensor:
        """The last micro-batch's Gram of J_z rows (taken with the full batch's cotangents) + the earlier ones':
        their z coordinates are disjoint, so the full batch's Gram is the sum (this rank's columns)."""
        assert self.features_gram is not None
        return gram + (self.features_gram / self.total_rows**2).to(gram.dtype)

    def combined_square(self, square: Tensor) -> Tensor:
        """||c^T J_z||^2 of the last micro-batch's combined z-gradient (``combined``) + the earlier ones',
        c^T K c (this rank's columns)."""
        assert self.features_gram is not None and self.combined is not None
        weights = self.combined[1].double()
        return square + (weights @ self.features_gram @ weights / self.total_rows**2).to(square.dtype)

    def add_lifted(self, grads: list[Tensor], rows: Tensor, coefficients: Tensor, gain: Tensor | float) -> None:
        """The lift of ``gain * coefficients^T rows`` through the last micro-batch's trunk (``grads``, one per
        shared parameter, this rank's) += the earlier micro-batches' part, ``gain * c^T G / B`` from their
        lifted rows G.  ``rows`` may be the step's combined z-gradient (one row): its task weights are
        then those it was taken with."""
        assert self.jacobian is not None
        acc = torch.float64 if self.jacobian.dtype == torch.float64 else torch.float32
        weights = coefficients.to(acc)
        if self.combined is not None and rows.shape[0] == 1 and rows.data_ptr() == self.combined[0].data_ptr():
            weights = weights[0] * self.combined[1].to(acc)
        earlier = (weights * (gain / self.total_rows)) @ self.jacobian.to(acc)
        offset = 0
        for index, grad in enumerate(grads):
            part = earlier[offset: offset + grad.numel()].view_as(grad)
            grads[index] = grad + part.to(grad.dtype)
            offset += grad.numel()

    def add_heads(self) -> list[Tensor]:
        """The earlier micro-batches' head gradients / B into the heads' ``.grad`` (once per step); returns
        the heads so written (the step sets them aside first and checks them with its own)."""
        if self.heads_added:
            return []
        self.heads_added = True
        written = []
        with torch.no_grad():
            for head, grad in self.heads.values():
                share = grad.div(self.total_rows)
                if head.grad is None:
                    head.grad = share.to(head.dtype)
                else:
                    head.grad.add_(share.to(head.grad.dtype))
                written.append(head)
        return written


def shared_versions(shared: list[Tensor]) -> ParamVersions:
    """The shared parameters' in-place write counters (an optimizer step bumps them)."""
    return tuple(param._version for param in shared)


def full_batch(accumulation: Accumulation | None,
               outputs: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``dual_forward``'s outputs, or in a step closing ``accumulation`` the full batch's
    (:meth:`Accumulation.full_batch`)."""
    return outputs if accumulation is None else accumulation.full_batch(*outputs)


def accumulated_rows(host: AccumulationHost, fed: Sequence[Tensor], feed_heads: bool,
                     jacobian: Tensor | None = None) -> list[Tensor]:
    """In a step closing an accumulation: the earlier micro-batches' rows added to ``jacobian`` (the last
    one's, when given: not again for a memoized draw), and, where this draw feeds the heads, their head
    gradients added too (set aside first, so that a failing step restores them).  Returns the heads to
    check: ``fed`` (the heads this draw fed) and any others so written."""
    accumulation = host.accumulation
    if accumulation is None:
        return list(fed)
    if jacobian is not None and host.features_engine is None:  # features rows: their Gram and lift take it
        accumulation.add_jacobian(jacobian)
    if not feed_heads:
        return list(fed)
    host.set_aside_head_grads(head for head, _ in accumulation.heads.values())
    fed_ids = {id(head) for head in fed}
    return [*fed, *(head for head in accumulation.add_heads() if id(head) not in fed_ids)]


def reduce_micro_batch(host: AccumulationHost, given: Tensor | tuple[Tensor, ...],
                       accumulation: Accumulation) -> Tensor:
    """Reduce one micro-batch (what a closure returns: losses or (losses, sample_weight)) into
    ``accumulation`` at the step's starting point: its dual means, its m backward passes (graph freed),
    its heads' gradients.  Nothing of ``host``'s state changes (eta, w, counters).  Returns the
    micro-batch's per-task dual objectives (detached).  A micro-batch that raises adds nothing.

    Its NaN/Inf guards (the losses, the dual statistics) are read together, once, before anything is kept,
    as a step's are: outside a step each would be read where it is met (two host reads per micro-batch).
    Within a step (a closure's micro-batches, :mod:`drmoo.optim._micro_batches`) they join the step's own
    guards, read in the step's one host read before anything is written: the accumulation is the step's, and
    leaves with it if the step fails (k micro-batches read the host once, not k times)."""
    step_guard = host._guard
    if step_guard is not None:
        reduced = _reduce_guarded(host, given)
        accumulation.add(*reduced)
        return reduced[1].detach()
    guard = host._guard = StepGuard(False, host.device, host.steps_taken)
    try:
        reduced = _reduce_guarded(host, given)
        guard.settle()  # the micro-batch's one host read
    except Exception:
        guard.settle()  # a guard met before the error failed: the micro-batch stopped there, as if read at once
        raise
    finally:
        host._guard = step_guard
    accumulation.add(*reduced)
    return reduced[1].detach()


# What one micro-batch adds to an Accumulation (its arguments to Accumulation.add), once its guards pass.
ReducedMicroBatch = tuple[int, Tensor, Tensor, Tensor, dict[int, tuple[Tensor, Tensor]], Tensor | None]


def _reduce_guarded(host: AccumulationHost, given: Tensor | tuple[Tensor, ...]) -> ReducedMicroBatch:
    """:func:`reduce_micro_batch`'s work, its guards left pending: what :meth:`Accumulation.add` takes."""
    losses = host.draw_losses(lambda: given, need_graph=True)
    objective, z, cotangent = host.dual_forward(losses.detach(), host.eta, host.hyper("lam"), 1.0)
    host.check_dual(objective, z)
    rows = losses.shape[0]
    engine = host.jacobian_engine
    shared = host._shared_params()
    heads = engine.heads(losses, shared, feed_heads=True)
    refuse_accumulating_sharded_heads(heads)  # their kept gradients would never reach the shards (drmoo.optim._fsdp)
    kept = [(head, head.grad) for head in heads]
    for head in heads:
        head.grad = None
    features_gram = None
    try:
        jacobian = engine.task_jacobian(host, losses, cotangent * rows, "accumulate", heads=heads, feed_heads=True)
        head_sums = {id(head): (head, head.grad.detach()) for head in heads if head.grad is not None}
        features = host.features_engine
        if features is not None:  # J_z: its Gram, then each row lifted through the trunk (m backward passes)
            features_gram = engine.gram(host._ops, jacobian).detach().clone()
            jacobian = lift_rows(features.features, jacobian, shared)
    finally:
        for head, grad in kept:
            head.grad = grad
        engine.end_step()  # features mode: this micro-batch's z is forgotten (the next one brings its own)
    return rows, objective, z, jacobian, head_sums, features_gram


def lift_rows(features: Sequence[Tensor] | None, rows: Tensor, shared: Sequence[Tensor]) -> Tensor:
    """Each row of J_z (w.r.t. the pieces of z, flattened) lifted through the trunk to the shared parameters:
    [m, n], row i = (dz/dtheta)^T J_z[i], by m backward passes (the trunk's graph freed by the last)."""
    assert features is not None
    out = torch.empty(rows.shape[0], sum(param.numel() for param in shared), dtype=shared[0].dtype,
                      device=shared[0].device)
    for task in range(rows.shape[0]):
        cotangents, offset = [], 0
        for piece in features:
            cotangents.append(rows[task, offset: offset + piece.numel()].view_as(piece).to(piece.dtype))
            offset += piece.numel()
        grads = torch.autograd.grad(list(features), list(shared), grad_outputs=cotangents,
                                    retain_graph=task < rows.shape[0] - 1, allow_unused=True)
        require_reached(grads)
        copy_into_row(shared, out[task], grads)
    return out
