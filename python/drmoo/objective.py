"""The DR-MOO dual objective as a differentiable function of per-sample losses and dual variables."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from drmoo_kernels import Divergence, get_divergence
from drmoo_kernels._checks import check_positive
from drmoo_kernels.reference import dual_forward

__all__ = ["dual_objective", "worst_case_weights"]


def _check(losses: Tensor, eta: Tensor, lam: float, scale: float, sample_weight: Tensor | None) -> None:
    if not isinstance(losses, Tensor) or losses.dim() != 2:
        shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
        raise ValueError(f"losses must be per-sample losses of shape [B, m], got {shape}")
    batch, m = losses.shape
    if batch == 0:
        raise ValueError("losses is an empty batch (B = 0)")
    if not losses.is_floating_point():
        raise TypeError(f"losses must be floating point, got {losses.dtype}")
    if not isinstance(eta, Tensor) or tuple(eta.shape) != (m,):
        shape = tuple(eta.shape) if isinstance(eta, Tensor) else type(eta).__name__
        raise ValueError(f"eta must have shape [m] = [{m}] to match losses [B, m], got {shape}")
    check_positive("lam (the divergence regularization lambda)", lam)
    check_positive("scale (the dual scale s)", scale)
    if not eta.is_floating_point():
        raise TypeError(f"eta must be floating point, got {eta.dtype}")
    if not bool(torch.isfinite(eta.detach()).all()):
        raise ValueError("eta (the dual variables) contains NaN or Inf")
    if sample_weight is not None:
        if not isinstance(sample_weight, Tensor) or tuple(sample_weight.shape) != (batch, m):
            shape = tuple(sample_weight.shape) if isinstance(sample_weight, Tensor) else type(sample_weight).__name__
            raise ValueError(f"sample_weight must have the shape of losses {tuple(losses.shape)}, got {shape}")
        weights = sample_weight.detach()
        if not bool((torch.isfinite(weights) & (weights >= 0)).all()):
            raise ValueError("sample_weight (the importance weights) must be finite and >= 0; it has negative, "
                             "NaN or Inf entries")
    if not bool(torch.isfinite(losses.detach()).all()):
        raise ValueError("losses contain NaN or Inf")


class _DualObjective(torch.autograd.Function):
    """Forward: the reference dual_forward.  Backward: its closed-form gradients (DESIGN §1)."""

    @staticmethod
    def forward(
        losses: Tensor, eta: Tensor, lam: float, scale: float, divergence: Divergence,
        sample_weight: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        return dual_forward(losses, eta, lam, scale, divergence, sample_weight)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
        losses, eta = inputs[0], inputs[1]
        _, grad_eta, weights = output
        ctx.save_for_backward(grad_eta, weights)
        ctx.dtypes = (losses.dtype, eta.dtype)
        ctx.mark_non_differentiable(grad_eta, weights)

    @staticmethod
    def backward(ctx: Any, grad_objective: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        grad_eta, weights = ctx.saved_tensors
        grad_losses = (weights * grad_objective.unsqueeze(0)).to(ctx.dtypes[0])
        return grad_losses, (grad_eta * grad_objective).to(ctx.dtypes[1]), None, None, None, None


def dual_objective(
    losses: Tensor,
    eta: Tensor,
    lam: float,
    divergence: str | Divergence = "chi2",
    scale: float = 1.0,
    sample_weight: Tensor | None = None,
) -> Tensor:
    r"""Per-task DR dual objectives of per-sample losses.

    :math:`L^i = \lambda\,\mathrm{mean}_b[\omega_b^i f^*((\ell_b^i - s\eta^i)/\lambda)] + s\eta^i`.

    Its gradients, with :math:`u_b^i = (\ell_b^i - s\eta^i)/\lambda`, are
    :math:`\partial L^i/\partial \ell_b^i = \omega_b^i f^{*\prime}(u_b^i) / B` and
    :math:`\partial L^i/\partial \eta^i = s\,(1 - \mathrm{mean}_b\,\omega_b^i f^{*\prime}(u_b^i))`.

    Args:
        losses: per-sample losses :math:`\ell` ``[B, m]`` (differentiable; gradients flow to theta through
            them).
        eta: dual variables :math:`\eta` ``[m]`` (differentiable).
        lam: :math:`\lambda > 0`.
        divergence: a name (``drmoo_kernels.DIVERGENCE_NAMES``) or a :class:`~drmoo_kernels.Divergence`.
        scale: :math:`s`, the dual scale of the rescaled objective.
        sample_weight: importance weights :math:`\omega` ``[B, m]`` (None = all 1).

    Returns:
        The objectives :math:`L` ``[m]``, in float32.
    """
    _check(losses, eta, lam, scale, sample_weight)
    outputs: tuple[Tensor, Tensor, Tensor] = _DualObjective.apply(  # apply is typed Any: forward's result
        losses, eta, float(lam), float(scale), get_divergence(divergence), sample_weight
    )
    return outputs[0]


def worst_case_weights(
    losses: Tensor, eta: Tensor, lam: float, divergence: str | Divergence = "chi2", scale: float = 1.0
) -> Tensor:
    r"""The worst-case density ratios :math:`f^{*\prime}((\ell - s\eta)/\lambda)` of the dual's inner maximum.

    Args:
        losses: per-sample losses :math:`\ell` ``[B, m]`` (read only: no gradient flows through the result).
        eta: dual variables :math:`\eta` ``[m]``.
        lam: :math:`\lambda > 0`.
        divergence: a name (``drmoo_kernels.DIVERGENCE_NAMES``) or a :class:`~drmoo_kernels.Divergence`.
        scale: :math:`s`, the dual scale of the rescaled objective.

    Returns:
        The weights ``[B, m]``, each column's mean about 1 at the optimal :math:`\eta`.
    """
    _check(losses, eta, lam, scale, None)
    _, _, weights = dual_forward(losses.detach(), eta.detach(), float(lam), float(scale), get_divergence(divergence))
    return weights * losses.shape[0]
