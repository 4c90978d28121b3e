"""``jacobian="parameters"`` (the paper's): per-task gradients with respect to the shared parameters theta.

Row i of J_theta [m, n] is the gradient of sum_b cotangent[b, i] * losses[b, i] w.r.t. every shared
parameter, flattened in the parameters' order.  The rows land in a preallocated flat buffer per role
(reused across steps) through :func:`drmoo.jacobian.task_jacobian` (``"loop"``: one backward per task,
the parameters' ``.grad`` being views of the buffer; ``"batched"``: one vmapped backward).  Under
torch.distributed each rank's rows are its shard's, summed into the global batch's at once: every
product of them (the Gram, ...) is then the global batch's as it stands.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from drmoo import distributed
from drmoo.jacobian import feed_head_grads, head_leaves, task_jacobian

from ._direction import write_direction
from ._engine import EngineHost
from ._fsdp import add_sharded_direction, is_sharded, sharded_task_jacobian, unsharded_copies
from ._guards import finite_each
from ._loss_scale import divide_, times


class ParametersJacobian:
    """The parameters-mode engine of one optimizer (implements :class:`~drmoo.optim._engine.JacobianEngine`).

    Holds only buffers, which a pickled / deep-copied optimizer does not carry (the next step rebuilds them).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}
        self.sharded = False  # FSDP2-sharded shared parameters: the rows hold this rank's columns (_fsdp)

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._buffers = {}
        self.sharded = False

    def unpack(self, result: Any, *, need_graph: bool) -> Any:
        return result

    def heads(self, losses: Tensor, shared: Sequence[Tensor], *, feed_heads: bool) -> list[Tensor]:
        if not feed_heads:
            return []
        # FSDP2: the graph's leaves are the unsharded copies of the shared parameters, not the shards
        # (FSDP2-sharded heads are among them, as their unsharded copies: the step tells them apart and feeds them
        # through FSDP's own backward, drmoo.optim._fsdp.split_sharded_heads)
        return head_leaves(losses, [*shared, *unsharded_copies(shared)] if is_sharded(shared) else shared)

    def _buffer(self, slot: str, shared: Sequence[Tensor], rows: int) -> Tensor:
        n = sum(p.numel() for p in shared)
        buf = self._buffers.get(slot)
        if buf is None or buf.shape != (rows, n) or buf.dtype != shared[0].dtype or buf.device != shared[0].device:
            buf = torch.empty(rows, n, device=shared[0].device, dtype=shared[0].dtype)
            self._buffers[slot] = buf
        return buf

    def task_jacobian(self, host: EngineHost, losses: Tensor, cotangent: Tensor, slot: str, *,
                      heads: Sequence[Tensor], feed_heads: bool) -> Tensor:
        shared = host._shared_params()
        self.sharded = is_sharded(shared)
        if self.sharded:  # this rank's columns, reduce-scattered by FSDP (drmoo.optim._fsdp)
            if feed_heads and heads:
                feed_head_grads(losses, heads, cotangent, retain_graph=True)
            return sharded_task_jacobian(host, losses, cotangent, shared)
        scale = host.loss_scale
        scaled = times(cotangent, scale)
        jacobian = task_jacobian(losses, scaled, shared, self._buffer(slot, shared, host.num_tasks),
                                 strategy=host.jacobian_strategy, feed_heads=feed_heads,
                                 retain_graph=host.take_graph_reuse())
        divide_(jacobian, scale)
        return distributed.all_reduce_sum_(jacobian)  # shard Jacobians -> the global batch's

    def gram(self, ops: Any, rows: Tensor) -> Tensor:
        return cast(Tensor, ops.gram(rows))

    def products_over_ranks(self, small: Tensor) -> Tensor:
        # the rows are already the global batch's, or (FSDP2) its columns held by this rank: summed then
        return distributed.all_reduce_sum_(small) if self.sharded else small

    def apply(self, host: EngineHost, rows: Tensor, coefficients: Tensor, factor: Tensor | float) -> None:
        """``factor * rows^T coefficients`` into theta (or ``.grad``), once the coefficients are known finite.

        The rows are guarded where they are made (their Gram's diagonal: each row's norm is finite), so a
        finite w and factor make a finite direction (each entry is at most m max|w| |factor| max|J|).  A
        NaN w (a solver fed an overflowing Gram, MoCo's tracked estimate) would otherwise reach theta:
        it is guarded with the step's others, in the one host read before the first write."""
        guarded = (coefficients,) if isinstance(factor, float) else (coefficients, factor)
        host.require_finite(finite_each(*guarded), lambda _: (
            f"non-finite task weights (or step factor) in {host.failing_iteration}: {coefficients.tolist()}; "
            "the step was abandoned and nothing was updated"))
        shared = host._shared_params()
        if is_sharded(shared):  # this rank's columns (a Jacobian's, or FAMO's / Nash-MTL's one combined row)
            add_sharded_direction(host, rows, coefficients, factor, shared)
            return
        write_direction(host, rows, coefficients, factor, self._buffers)

    def end_step(self) -> None:
        pass
