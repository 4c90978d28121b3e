"""Per-task rows of J_z as outer products, for linear heads (the features-mode ``"auto"`` strategy).

With one ``Linear(d, m)`` reading z [B, d] -- logits = z W^T + b -- or m ``Linear(d, 1)`` joined by ``torch.cat``
(W: their weights stacked), and a per-sample loss computed column by column from the logits, task i's loss
reaches z only through column i of the logits, so

    J_z[i] = d (sum_b c[b, i] L[b, i]) / dz = G[:, i] (outer) W[i],    G = d (sum_b,i c[b, i] L[b, i]) / d logits,

where G [B, m] comes from ONE backward pass through the loss.  For a shared head the generic path sends a
one-hot cotangent [m, B, m] through the loss and the head under vmap: Theta(m^2 B) loss work and an
[m B, m] x [m, d] product, Theta(m^2 B d) -- the step's largest term beyond a hundred tasks -- for rows of
Theta(m B d); for separate heads the one-pass split (:mod:`drmoo._head_split`) hooks every head's node, m
hooks a step.  The rows here are the same numbers: the per-task passes only ever add zeros to G[b, i] W[i, k].

:func:`linear_head` reads the structure off the graph (no backward, no value read): from the losses [B, m]
down, a chain of element-wise nodes (:func:`drmoo._head_split.elementwise_chain`), then either the linear
layer's ``addmm`` (or ``mm`` without a bias) or a ``torch.cat`` along the tasks of m such layers of width 1;
each layer's input is z itself (one piece, [B, d]), its weight a leaf reached through its transpose and its
bias, if any, a leaf.  Anything else returns None and the caller takes another path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ._head_split import _saved_dim, elementwise_chain

__all__ = ["LinearHead", "linear_head"]


@dataclass
class LinearHead:
    """The head's autograd node (its output: the logits [B, m]) and the weights W [m, d] of its m outputs."""

    node: Any
    weight: Tensor
    logits_grad: Tensor | None = None  # G [B, m] of the last rows_into (in the rows' dtype)

    def rows_into(self, losses: Tensor, cotangent: Tensor, out: Tensor, *, inputs: Sequence[Tensor],
                  retain_graph: bool) -> tuple[Tensor | None, ...]:
        """Fill ``out`` [m, B d] with the rows of J_z from one backward pass that stops at the head's parameters
        (``inputs``: the heads fed by this pass) or, with no ``inputs``, at the head's output; returns that
        pass's gradients of ``inputs``."""
        caught: list[Tensor] = []
        grad_outputs = cotangent.to(losses.dtype)
        if not inputs:
            # No head is fed: G is the gradient of the head's output, so the pass ends there.  Going on to z
            # would compute a gradient of z that nothing reads: for m separate heads m products and m - 1 sums
            # at z, every step (one product for a shared head).
            logits = torch.autograd.graph.GradientEdge(self.node, 0)
            (grad,) = torch.autograd.grad(losses, [logits], grad_outputs=grad_outputs, retain_graph=retain_graph,
                                          allow_unused=True)
            if grad is not None:
                caught.append(grad)
            grads: tuple[Tensor | None, ...] = ()
        else:
            def catch(grad_outputs: tuple[Tensor | None, ...]) -> None:
                grad = grad_outputs[0]
                if grad is not None:
                    caught.append(grad)

            handle = self.node.register_prehook(catch)
            try:
                grads = torch.autograd.grad(losses, list(inputs), grad_outputs=grad_outputs,
                                            retain_graph=retain_graph, allow_unused=True)
            finally:
                handle.remove()
        num_tasks, width = self.weight.shape
        with torch.no_grad():
            if not caught:  # the cotangent did not reach the head: every row is zero
                self.logits_grad = torch.zeros(out.shape[1] // width, num_tasks, dtype=out.dtype, device=out.device)
                out.zero_()
            else:
                self.logits_grad = caught[0].to(out.dtype)  # [B, m]
                torch.mul(self.logits_grad.T[:, :, None], self.weight.detach().to(out.dtype)[:, None, :],
                          out=out.view(num_tasks, -1, width))
        return grads

    def gram(self) -> Tensor:
        """The rows' Gram from their factors: (G^T G) (.) (W W^T), Theta(m^2 (B + d)) where the rows' own product
        is Theta(m^2 B d); exactly symmetric.  Its rounding error is within that of the rows' product: each
        factor's dot products are shorter (B and d terms against B d), and |J||J|^T factors the same way."""
        assert self.logits_grad is not None, "rows_into writes the rows (and G) first"
        G = self.logits_grad
        acc = torch.float64 if G.dtype == torch.float64 else torch.float32
        G, W = G.to(acc), self.weight.detach().to(acc)
        product = (G.T @ G) * (W @ W.T)
        return 0.5 * (product + product.T)


def linear_head(losses: Tensor, features: Sequence[Tensor]) -> LinearHead | None:
    """The linear head(s) between ``losses`` [B, m] and z (module docstring), or None."""
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
    if node.name() == "CatBackward0":  # separate heads: m Linear(d, 1) joined along the tasks
        if _saved_dim(node) not in (1, -1) or len(node.next_functions) != num_tasks:
            return None
        weights = [_linear_layer(piece, z, 1) for piece, _ in node.next_functions]
        if any(weight is None for weight in weights):
            return None
        with torch.no_grad():
            stacked = torch.cat([weight for weight in weights if weight is not None])  # [m, d]
        return LinearHead(node, stacked)
    weight = _linear_layer(node, z, num_tasks)
    return None if weight is None else LinearHead(node, weight)


def _linear_layer(node: Any, z: Tensor, outputs: int) -> Tensor | None:
    """The weight [outputs, d] when ``node`` is a linear layer of z itself (``addmm`` with a leaf bias, or ``mm``)
    with a leaf weight; else None."""
    if node is None:
        return None
    name = node.name()
    if name == "AddmmBackward0":
        bias_edge, input_edge, weight_edge = node.next_functions
        bias = getattr(bias_edge[0], "variable", None) if bias_edge[0] is not None else None
        if bias_edge[0] is not None and not (isinstance(bias, Tensor) and bias.shape == (outputs,)):
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
    if not isinstance(weight, Tensor) or list(weight.shape) != [outputs, z.shape[1]]:
        return None
    return weight


def _is_z(edge: tuple[Any, int], z: Tensor) -> bool:
    """Whether the autograd edge is z itself (its node and output, or its AccumulateGrad for a leaf z)."""
    node, output_nr = edge
    if node is None:
        return False
    if z.grad_fn is None:
        return getattr(node, "variable", None) is z
    return node is z.grad_fn and output_nr == z.output_nr
