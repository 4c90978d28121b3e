"""Adversarial evaluation: FGSM on the un-normalised [0, 1] input (paper §5.1)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["fgsm", "summed_task_loss"]


def summed_task_loss(logits: Sequence[Tensor], labels: Tensor) -> Tensor:
    """sum_i CE(logits_i, labels[:, i]) (batch mean): the attack objective of the paper."""
    return sum(F.cross_entropy(task_logits, labels[:, task]) for task, task_logits in enumerate(logits))


def fgsm(
    model: nn.Module,
    images: Tensor,
    labels: Tensor,
    eps: float,
    loss_fn: Callable[[Sequence[Tensor], Tensor], Tensor] = summed_task_loss,
) -> Tensor:
    """x_adv = clamp(x + eps * sign(grad_x sum_i loss_i(x)), 0, 1), with the model in eval mode.

    The model's mode is restored afterwards; parameters receive no gradient.
    """
    if eps < 0:
        raise ValueError(f"FGSM eps must be >= 0, got {eps}")
    if eps == 0:
        return images.detach().clone()
    was_training = model.training
    model.eval()
    try:
        attacked = images.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            loss = loss_fn(model(attacked), labels)
            (grad,) = torch.autograd.grad(loss, attacked)
        return torch.clamp(attacked.detach() + eps * grad.sign(), 0.0, 1.0)
    finally:
        model.train(was_training)
