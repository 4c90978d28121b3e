"""Per-task rows of J_z as outer products, for one shared linear head (the features-mode ``"auto"`` strategy).

With one ``Linear(d, m)`` reading z [B, d] -- logits = z W^T + b -- and a per-sample loss computed column by
column from the logits, task i's loss reaches z only through column i of the logits, so

    J_z[i] = d (sum_b c[b, i] L[b, i]) / dz = G[:, i] (outer) W[i],    G = d (sum_b,i c[b, i] L[b, i]) / d logits,

where G [B, m] comes from ONE backward pass through the loss.  The generic path sends a one-hot cotangent
[m, B, m] through the loss and the head under vmap: Theta(m^2 B) loss work and an [m B, m] x [m, d] product,
Theta(m^2 B d) -- the step's largest term beyond a hundred tasks -- for rows of Theta(m B d).  The rows here are
the same numbers: the per-task passes only ever add zeros to G[b, i] W[i, k].

:func:`linear_head` reads the structure off the graph (no backward, no value read): from the losses [B, m]
down, a chain of element-wise nodes (:func:`drmoo._head_split.elementwise_chain`), then the linear layer's
``addmm`` (or ``mm`` without a bias) whose input is z itself (one piece, [B, d]), whose weight is a leaf
[m, d] reached through its transpose and whose bias, if any, a leaf [m].  Anything else returns None and the
caller takes another path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ._head_split import elementwise_chain

__all__ = ["LinearHead", "linear_head"]


@dataclass
class LinearHead:
    """The shared head's autograd node (its output: the logits) and its weight W [m, d]."""

    node: Any
    weight: Tensor

    def rows_into(self, losses: Tensor, cotangent: Tensor, out: Tensor, *, inputs: Sequence[Tensor],
                  retain_graph: bool) -> tuple[Tensor | None, ...]:
        """Fill ``out`` [m, B d] with the rows of J_z from one backward pass that stops at the head's parameters
        (``inputs``: the heads, or z when no head is fed); returns that pass's gradients of ``inputs``."""
        caught: list[Tensor] = []

        def catch(grad_outputs: tuple[Tensor | None, ...]) -> None:
            grad = grad_outputs[0]
            if grad is not None:
                caught.append(grad)

        handle = self.node.register_prehook(catch)
        try:
            grads = torch.autograd.grad(losses, list(inputs), grad_outputs=cotangent.to(losses.dtype),
                                        retain_graph=retain_graph, allow_unused=True)
        finally:
            handle.remove()
        num_tasks, width = self.weight.shape
        with torch.no_grad():
            if not caught:  # the cotangent did not reach the head: every row is zero
                out.zero_()
            else:
                logits_grad = caught[0].to(out.dtype)  # [B, m]
                torch.mul(logits_grad.T[:, :, None], self.weight.detach().to(out.dtype)[:, None, :],
                          out=out.view(num_tasks, -1, width))
        return grads


def linear_head(losses: Tensor, features: Sequence[Tensor]) -> LinearHead | None:
    """The shared linear head between ``losses`` [B, m] and z (module docstring), or None."""
    if losses.dim() != 2 or losses.grad_fn is None or len(features) != 1 or features[0].dim() != 2:
        return None
    z = features[0]
    rows, num_tasks = losses.shape
    if z.shape[0] != rows:
        return None
    walked = elementwise_chain(losses, lambda below, output_nr: _is_z((below, output_nr), z))
    if walked is None:
        return None
    _, node = walked
    name = node.name()
    if name == "AddmmBackward0":
        bias_edge, input_edge, weight_edge = node.next_functions
        bias = getattr(bias_edge[0], "variable", None) if bias_edge[0] is not None else None
        if bias_edge[0] is not None and not (isinstance(bias, Tensor) and bias.shape == (num_tasks,)):
            return None  # a bias computed from something (z, perhaps): not a plain linear layer
    elif name == "MmBackward0":
        input_edge, weight_edge = node.next_functions
    else:
        return None
    if not _is_z(input_edge, z):
        return None
    transpose = weight_edge[0]
    if transpose is None or transpose.name() != "TBackward0":
        return None
    (leaf, _), = transpose.next_functions
    weight = getattr(leaf, "variable", None)
    if not isinstance(weight, Tensor) or list(weight.shape) != [num_tasks, z.shape[1]]:
        return None
    return LinearHead(node, weight)


def _is_z(edge: tuple[Any, int], z: Tensor) -> bool:
    """Whether the autograd edge is z itself (its node and output, or its AccumulateGrad for a leaf z)."""
    node, output_nr = edge
    if node is None:
        return False
    if z.grad_fn is None:
        return getattr(node, "variable", None) is z
    return node is z.grad_fn and output_nr == z.output_nr
