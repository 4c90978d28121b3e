"""Adversarial evaluation: FGSM on the un-normalised [0, 1] input (paper §5.1).

Where the budget eps is measured (``eps_space``):

* ``pixel`` (the default): the step is ``eps`` in the [0, 1] pixel values the model receives;
  the model normalises with the ImageNet mean/std inside its forward.
* ``normalized``: ``eps`` is measured after ImageNet normalisation ((x - mean) / std), as in
  code that normalises the data before the model and attacks the normalised tensor.  The same
  perturbation in pixels is ``eps * std`` per channel (std = 0.229, 0.224, 0.225), about 4.4x
  smaller than ``pixel``'s.  The result is still clamped to the valid [0, 1] image.

The paper does not say which one it used.  ``pixel`` stays the default: it is the usual
convention of the adversarial-robustness literature, and results/fgsm-eps-space/README.md found
that a short CPU-trained checkpoint cannot tell which one reproduces the paper's curve (neither
does there; the decisive comparison needs well-trained models, e.g. the GPU ``medium`` runs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["EPS_SPACES", "fgsm", "pixel_step", "summed_task_loss"]

EPS_SPACES = ("pixel", "normalized")


def summed_task_loss(logits: Sequence[Tensor], labels: Tensor) -> Tensor:
    """sum_i CE(logits_i, labels[:, i]) (batch mean): the attack objective of the paper."""
    if not logits:
        raise ValueError("summed_task_loss needs the logits of at least one task, got none")
    # one label column per task: a missing column would fail deep in indexing, an extra one be ignored silently
    if labels.dim() != 2 or labels.shape[1] != len(logits):
        raise ValueError(f"summed_task_loss needs labels [B, m] with one column per task (m = {len(logits)}), got "
                         f"labels of shape {tuple(labels.shape)}")
    losses = [F.cross_entropy(task_logits, labels[:, task]) for task, task_logits in enumerate(logits)]
    total = losses[0]
    for loss in losses[1:]:  # added in task order, as sum() would
        total = total + loss
    return total


def pixel_step(model: nn.Module, eps_space: str) -> Tensor | None:
    """The per-channel factor that turns an ``eps_space`` budget into pixel units (None: 1).

    ``normalized`` reads the model's own normalisation (its ``std`` buffer, shape [1, C, 1, 1]),
    so the conversion always matches what the forward divides by.
    """
    if eps_space not in EPS_SPACES:
        raise ValueError(f"unknown eps space {eps_space!r}; valid choices: {', '.join(EPS_SPACES)}")
    if eps_space == "pixel":
        return None
    std = getattr(model, "std", None)
    if not isinstance(std, Tensor):
        raise ValueError(f"--eps-space normalized needs a model that normalises its input with a `std` buffer; "
                         f"{type(model).__name__} has none")
    return std.detach()


def fgsm(
    model: nn.Module,
    images: Tensor,
    labels: Tensor,
    eps: float,
    loss_fn: Callable[[Sequence[Tensor], Tensor], Tensor] = summed_task_loss,
    *,
    step_scale: Tensor | None = None,
) -> Tensor:
    """x_adv = clamp(x + eps * s * sign(grad_x sum_i loss_i(x)), 0, 1), with the model in eval mode.

    ``s`` is ``step_scale`` (broadcast against ``images``, e.g. :func:`pixel_step`'s per-channel
    std for a budget in normalised units) or 1.  The mode of the model and of each of its submodules
    is restored afterwards (a BatchNorm kept in eval mode stays so); parameters receive no gradient.
    """
    # NaN passes "< 0" and would turn every image into NaN; Inf makes inf * 0 = NaN where the gradient is 0
    if isinstance(eps, bool) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"FGSM eps must be >= 0 and finite, got {eps!r}")
    if eps == 0:
        return images.detach().clone()
    # model.train(flag) sets every submodule to flag: remember each one's own mode to restore it exactly
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        attacked = images.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            loss = loss_fn(model(attacked), labels)
            (grad,) = torch.autograd.grad(loss, attacked)
        step = eps * grad.sign()
        if step_scale is not None:
            step = step * step_scale.to(device=step.device, dtype=step.dtype)
        return torch.clamp(attacked.detach() + step, 0.0, 1.0)
    finally:
        for module, training in modes:
            module.training = training
