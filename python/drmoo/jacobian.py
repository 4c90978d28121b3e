"""Per-task gradients of the shared parameters, written straight into a flat [m, n] buffer.

Given per-sample losses ``[B, m]`` (with their graph) and the cotangents ``[B, m]`` of the DR dual
objective (the weights v/B), row i of the Jacobian is the gradient of the shared parameters of
sum_b cotangent[b, i] * losses[b, i], i.e. grad_theta L^i.  Two strategies:

* ``loop`` - m backward passes over the one forward graph.  While task i's pass runs, each shared
  parameter's ``.grad`` *is* a view of row i, so autograd accumulates into the buffer with no copy.
* ``batched`` - one vmapped backward (``is_grads_batched``) producing all m rows at once, then one
  copy into the buffer.  Faster when the per-pass overhead dominates (small models, many tasks);
  more memory, and an operator without a batching rule makes torch fall back to a loop.

With ``feed_heads`` every other leaf of the graph (the task-specific heads) also accumulates the
gradient of sum_i L^i in its ``.grad`` - head i sees only task i - in the same passes (``loop``) or
one extra pass (``batched``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["STRATEGIES", "head_leaves", "task_jacobian"]

STRATEGIES: tuple[str, ...] = ("loop", "batched")


def head_leaves(losses: Tensor, shared: Sequence[Tensor]) -> list[Tensor]:
    """The trainable leaves the losses depend on, other than the shared parameters (the heads).

    Found by walking the autograd graph: a backward restricted to these leaves runs only the part
    of the graph between the losses and the heads, which is what makes "the heads get their raw
    gradient" cheap for the methods whose shared-parameter backward uses task weights.
    """
    shared_ids = {id(p) for p in shared}
    if losses.grad_fn is None:
        return [losses] if losses.requires_grad and id(losses) not in shared_ids else []
    leaves: list[Tensor] = []
    leaf_ids: set[int] = set()
    # The visited nodes are held here, not just their ids.  A graph node's Python object is a
    # wrapper that torch may create on access and free when dropped (torch 2.11 does; 2.14 keeps
    # it alive); once freed, its id is reused by the next wrapper, which would then count as
    # "seen" and cut off its whole subtree -- the heads silently got no gradient on torch 2.11.
    visited: dict[int, Any] = {}
    stack = [losses.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited[id(node)] = node
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if isinstance(variable, Tensor):
            if id(variable) not in shared_ids and id(variable) not in leaf_ids:
                leaf_ids.add(id(variable))
                leaves.append(variable)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _column_views(shared: Sequence[Tensor], row: Tensor) -> list[Tensor]:
    views, offset = [], 0
    for param in shared:
        views.append(row[offset : offset + param.numel()].view_as(param))
        offset += param.numel()
    return views


def _backward_into(shared: Sequence[Tensor], row: Tensor, losses: Tensor, cotangent: Tensor, *,
                   retain_graph: bool, feed_heads: bool) -> None:
    """One backward pass whose shared-parameter gradients accumulate into ``row`` (a [n] view)."""
    saved = [p.grad for p in shared]
    try:
        for param, view in zip(shared, _column_views(shared, row)):
            param.grad = view
        torch.autograd.backward(
            losses, grad_tensors=cotangent, retain_graph=retain_graph, inputs=None if feed_heads else list(shared)
        )
    finally:
        for param, grad in zip(shared, saved):
            param.grad = grad


def task_jacobian(
    losses: Tensor,
    cotangent: Tensor,
    shared: Sequence[Tensor],
    out: Tensor,
    *,
    strategy: str = "loop",
    feed_heads: bool = True,
) -> Tensor:
    """Fill ``out`` [m, n] with the per-task gradients of ``shared``; returns ``out``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown Jacobian strategy {strategy!r}; valid choices: {', '.join(STRATEGIES)}")
    num_tasks = losses.shape[1]
    n = sum(p.numel() for p in shared)
    if tuple(out.shape) != (num_tasks, n):
        raise ValueError(f"Jacobian buffer has shape {tuple(out.shape)}, expected ({num_tasks}, {n})")
    cotangent = cotangent.to(losses.dtype)
    out.zero_()
    if strategy == "loop":
        for task in range(num_tasks):
            task_cotangent = torch.zeros_like(cotangent)
            task_cotangent[:, task] = cotangent[:, task]
            _backward_into(shared, out[task], losses, task_cotangent,
                           retain_graph=task < num_tasks - 1, feed_heads=feed_heads)
        return out

    # batched: grad_outputs[i] is the cotangent restricted to column i.
    eye = torch.eye(num_tasks, dtype=cotangent.dtype, device=cotangent.device)
    batched_cotangent = eye[:, None, :] * cotangent[None, :, :]
    grads = torch.autograd.grad(
        losses, list(shared), grad_outputs=batched_cotangent, is_grads_batched=True,
        retain_graph=feed_heads, allow_unused=True, materialize_grads=True,
    )
    offset = 0
    for param, grad in zip(shared, grads):
        out[:, offset : offset + param.numel()].copy_(grad.reshape(num_tasks, -1))
        offset += param.numel()
    if feed_heads:  # one more pass for the heads; the shared gradients of it go to a scratch row
        scratch = torch.zeros(n, dtype=out.dtype, device=out.device)
        _backward_into(shared, scratch, losses, cotangent, retain_graph=False, feed_heads=True)
    return out
