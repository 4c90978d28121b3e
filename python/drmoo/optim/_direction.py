"""Applying a direction d = factor * J^T w given by rows w.r.t. the shared parameters: the one place where
``step`` (writes theta) and direction mode (``drmoo.Balancer``: adds d to ``.grad``) differ.

An eager step reads its NaN/Inf guards (once, all of them) before writing theta; direction mode
writes only ``.grad``, which a failing step restores, so it reads nothing here.  In a capturable
step the direction is formed first and zeroed if the step is skipped (0 * NaN would
be NaN: scaling lr by 0 is not enough), then written by the same op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from drmoo.jacobian import column_views

from ._engine import EngineHost
from ._loss_scale import is_unit, with_scale


def write_direction(host: EngineHost, jacobian: Tensor, w: Tensor, factor: Tensor | float,
                    buffers: dict[str, Tensor]) -> None:
    """``theta -= lr * factor * J^T w`` (lr = the group's ``lr``; the ``combine`` op), or in direction mode
    ``.grad += grad_scale * factor * J^T w``.  ``buffers`` keeps the capturable step's direction buffer."""
    if host.direction_mode:
        add_direction_to_grad(host, jacobian, w, factor)
        return
    lr = host.hyper("lr") if isinstance(factor, float) and factor == 1.0 else host.hyper("lr") * factor
    host.settle_guards()  # eager: theta is written below, so the step's guards are read first (one host read)
    found_inf = host.found_inf
    with torch.no_grad():
        if found_inf is None:
            host._ops.combine(jacobian, w, host._shared_params(), lr)
            return
        acc = torch.float64 if jacobian.dtype == torch.float64 else torch.float32
        # A persistent buffer: backends that cache per-address launch plans (triton) reuse theirs.
        direction = buffers.get("direction")
        if direction is None or direction.dtype != acc or direction.shape != (1, jacobian.shape[1]):
            direction = torch.empty(1, jacobian.shape[1], dtype=acc, device=jacobian.device)
            buffers["direction"] = direction
        torch.matmul(w.to(acc)[None, :], jacobian.to(acc), out=direction)
        direction.masked_fill_(found_inf, 0.0)
        one = torch.ones(1, dtype=acc, device=direction.device)
        host._ops.combine(direction, one, host._shared_params(), lr)


def add_direction_to_grad(host: EngineHost, jacobian: Tensor, w: Tensor, factor: Tensor | float) -> None:
    """Direction mode: every shared parameter's ``.grad`` += grad_scale * factor * (J^T w), as autograd
    accumulates (the step's contribution is kept apart like the heads' and committed only if the step
    succeeds; a skipped capturable step adds zeros)."""
    shared = host._shared_params()
    acc = torch.float64 if jacobian.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        direction = w.to(acc) @ jacobian.to(acc)  # [n], a fresh tensor: the .grad views keep it
        scale = with_scale(factor, host.grad_scale)
        if not is_unit(scale):
            direction.mul_(scale)
        found_inf = host.found_inf
        if found_inf is not None:
            direction.masked_fill_(found_inf, 0.0)
        host.set_aside_head_grads(shared)
        for param, view in zip(shared, column_views(shared, direction)):
            param.grad = view if view.dtype == param.dtype else view.to(param.dtype)
