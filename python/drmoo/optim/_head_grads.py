"""The heads' gradients of one step, kept apart until the step succeeds.

A step feeds ``.grad`` of the task-specific leaves (the heads) -- and, in direction mode, of the
shared parameters -- through its backward passes.  All or nothing: those gradients are kept apart
from what ``.grad`` held before the step and added to it only once the step returns; a step that
raises restores every ``.grad`` as it found it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from drmoo import distributed

from ._agreement import all_ranks_finite
from ._fsdp import is_sharded
from ._guards import FiniteValues, finite_scalars


class HeadGradients:
    """The ``.grad`` each leaf fed by the running step held before it (by the leaf's id)."""

    def __init__(self) -> None:
        self._before: dict[int, tuple[Tensor, Tensor | None]] = {}

    def set_aside(self, heads: Iterable[Tensor]) -> None:
        """Before a backward feeds ``heads``: keep their current ``.grad`` aside and start from None.

        The step's gradients then accumulate from zero; :meth:`commit` adds the kept gradients back,
        :meth:`roll_back` restores them.
        """
        for head in heads:
            if id(head) not in self._before:
                self._before[id(head)] = (head, head.grad)
                head.grad = None

    def commit(self, found_inf: Tensor | None, *, sum_over_ranks: bool, shared: Sequence[Tensor]) -> None:
        """The step succeeded: add the kept gradients back (a skipped capturable step adds 0).

        With ``sum_over_ranks`` (direction mode) under torch.distributed the step's head gradients are
        first summed over ranks (see :func:`sum_head_grads_over_ranks`), so that the kept gradients are
        added to the global batch's.
        """
        if found_inf is not None:
            with torch.no_grad():
                for head, _ in self._before.values():
                    if head.grad is not None:
                        head.grad = torch.where(found_inf, torch.zeros_like(head.grad), head.grad)
        if sum_over_ranks:
            sum_head_grads_over_ranks([head for head, _ in self._before.values()], shared)
        for head, before in self._before.values():
            if before is None:
                continue
            if head.grad is not None:
                with torch.no_grad():
                    before.add_(head.grad)  # accumulate in place, as autograd does into an existing .grad
            head.grad = before

    def roll_back(self) -> None:
        """The step failed: every ``.grad`` as it was before the step."""
        for head, before in self._before.values():
            head.grad = before


def fed_grads_finite(heads: Sequence[Tensor]) -> Tensor | FiniteValues | None:
    """[k] flags "head j's gradient is finite" of the heads fed (agreed on by every rank: one flag), None if none;
    on one process, as the values whose finiteness they are (the step tests them with its other guards at once).

    The shared parameters' Jacobian is checked through its Gram matrix, but the heads' ``.grad`` come
    from their own backward: an Inf there (a GradScaler's overflow in the heads only) must abandon the
    step too, or the balancer would advance eta, w and its count while the scaler skips the optimizer's
    step.  The heads' ``.grad`` hold this step's gradients only (set aside by :meth:`HeadGradients.set_aside`).
    """
    fed = [head.grad for head in heads if head.grad is not None]
    if not fed:
        return None
    if all(grad.numel() > 0 for grad in fed):
        # One max-abs per gradient in one foreach call (NaN and Inf propagate through a max, which cannot
        # overflow) instead of isfinite().all()'s ops per tensor: with m separate heads those were most of
        # the ops a features step added to plain training.  (An empty tensor has no max: the old form.)
        norms = finite_scalars(torch._foreach_norm(fed, float("inf")))
        if not distributed.is_distributed():
            return norms
        finite = norms.flags()
    else:
        finite = torch.stack([torch.isfinite(grad).all() for grad in fed])
    if distributed.is_distributed():  # every rank abandons the step, or none
        finite = all_ranks_finite(finite)
    return finite


def sum_head_grads_over_ranks(fed: Sequence[Tensor], shared: Sequence[Tensor]) -> None:
    """Direction mode under torch.distributed: the heads' gradients of this step, summed over ranks.

    Each rank fed its heads from its shard (the cotangents are already divided by the world size,
    ``MultiObjectiveOptimizer.dual_forward``), and DistributedDataParallel reduces none of them (its
    hooks do not fire for ``torch.autograd.grad``, and a DDP model runs the step inside ``no_sync()``):
    unsummed, every rank's torch optimizer would step its heads on its own shard and the replicas would
    drift apart.  The ``shared`` parameters, also kept aside in direction mode, are left out: their
    direction comes from the Jacobian, already summed over ranks; so are FSDP2-sharded heads, whose shards
    FSDP's own reduce-scatter already summed (:func:`drmoo.optim._fsdp.feed_sharded_heads`).  Only direction
    mode sums here: after ``step(closure)`` the caller steps the heads and sums them itself
    (:func:`drmoo.distributed.all_reduce_grads`, as the trainer does), so each head gradient is summed
    exactly once on either path.  The order of ``fed`` is the graph's, the same on every rank, as the
    collective needs.
    """
    if not distributed.is_distributed():
        return
    ids = {id(param) for param in shared}
    distributed.all_reduce_grads([head for head in fed if id(head) not in ids and not is_sharded([head])])
