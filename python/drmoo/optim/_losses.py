"""What a closure returned, checked: per-sample losses [B, m] and optional importance weights [B, m].

Every refusal names the problem and where the losses came from (``origin``: "the closure returned",
or the Balancer's own argument); the values themselves (NaN, Inf, negative weights) are checked by
the step, on the device (see ``MultiObjectiveOptimizer.draw_losses``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def check_losses(result: Any, *, num_tasks: int, device: torch.device, origin: str,
                 need_graph: bool) -> tuple[Tensor, Tensor | None]:
    """``(losses, sample_weight or None)`` from a closure's ``losses`` or ``(losses, sample_weight)``,
    their shapes, devices and dtypes checked (the weights detached); raises naming the problem."""
    losses, weights = (result if isinstance(result, tuple) and len(result) == 2 else (result, None))
    m = num_tasks
    if not isinstance(losses, Tensor):
        raise TypeError(f"the closure must return a Tensor of per-sample losses [B, {m}], got {type(losses).__name__}")
    if losses.dim() != 2:
        raise ValueError(
            f"{origin} losses of shape {tuple(losses.shape)}; expected per-sample losses "
            f"[B, {m}] (one column per task, not averaged over the batch)"
        )
    if losses.shape[1] != m:
        raise ValueError(
            f"{origin} losses for {losses.shape[1]} tasks (shape {tuple(losses.shape)}), but num_tasks={m} was given"
        )
    if losses.shape[0] == 0:
        raise ValueError(f"{origin} an empty batch (B = 0); the dual objective needs samples")
    if losses.device != device:
        raise ValueError(
            f"{origin} losses on {losses.device}, but the shared parameters are on {device}; "
            "compute the losses on the parameters' device"
        )
    if not losses.is_floating_point():
        raise TypeError(f"per-sample losses must be floating point, got {losses.dtype}")
    if need_graph and not losses.requires_grad:
        raise ValueError(
            f"{origin} losses with no autograd graph (computed under torch.no_grad(), "
            "detached, or from parameters that do not require grad); the optimizer needs their gradients"
        )
    if weights is None:
        return losses, None
    if not isinstance(weights, Tensor) or tuple(weights.shape) != tuple(losses.shape):
        shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(
            f"{origin} sample weights of shape {shape}; they must match the losses "
            f"{tuple(losses.shape)} (one importance weight per sample and task)"
        )
    if weights.device != losses.device:
        raise ValueError(f"{origin} sample weights on {weights.device}, but the losses are on {losses.device}")
    return losses, weights.detach()
