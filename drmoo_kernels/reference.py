"""The pure-torch reference of every drmoo op: the semantics each fused backend must reproduce.

Contracts (DESIGN §4).  m tasks, B samples, n shared parameters, J the [m, n] per-task gradients.

* ``dual_forward(losses[B,m], eta[m], lam, scale, divergence, sample_weight=None)``
  -> ``objective[m]``, ``grad_eta[m]`` (= z), ``weights[B,m]`` (= omega * f*'(u) / B, the cotangent
  of the losses), with u = (losses - scale*eta) / lam.
* ``dual_step(losses, eta, w, lam, scale, divergence, gamma, f1, f2, sample_weight=None)``
  -> ``z``, ``mu``, ``weights`` at the updated eta; updates ``eta`` in place (Alg. 2 steps 1-3).
* ``gram(J)`` -> J J^T; ``combine(J, w, params, lr)``: params -= lr * J^T w through views.
* ``gram_step(J, w, params, gamma, c1, c2, beta, rho, mu, z)`` -> ``gram``, ``d_norm``, ``alpha``;
  updates ``params`` and ``w`` in place (Alg. 2 steps 4-5).
* ``sum_squares(tensors)`` -> ``[k]``, entry i the sum of squares of ``tensors[i]``'s entries: the NaN/Inf
  guard of a list of gradients in one op (features mode's lift through the trunk).

Conventions: math in float32 for float32/bfloat16/float16 inputs (float64 inputs stay float64;
m x m work always in float64), scalar results as
0-d tensors on the inputs' device so that no step needs a host synchronisation.  ``J`` is either one
[m, n] tensor or a sequence of [m, n_k] blocks whose concatenation along dim 1 is J; ``params`` are
the tensors J's columns belong to, in order.

Every op checks its arguments first (:mod:`drmoo_kernels._checks`, shared by all backends) and
refuses bad ones before writing anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._checks import (
    check_combine,
    check_dual_forward,
    check_dual_step,
    check_gram,
    check_gram_step,
    check_sum_squares,
)
from .divergences import Divergence

__all__ = [
    "clip_factor",
    "combine",
    "dual_forward",
    "dual_step",
    "gram",
    "gram_step",
    "gram_step_small",
    "project_simplex",
    "sum_squares",
]

JacobianBlocks = Tensor | Sequence[Tensor]


def _acc(t: Tensor) -> Tensor:
    """The accumulation dtype: float32 for 16/32-bit floats, float64 kept as is."""
    return t if t.dtype == torch.float64 else t.float()


def _blocks(jacobian: JacobianBlocks) -> list[Tensor]:
    return [jacobian] if isinstance(jacobian, Tensor) else list(jacobian)


def _dual_terms(
    losses: Tensor,
    eta: Tensor,
    lam: float,
    scale: float,
    divergence: Divergence,
    sample_weight: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """u, f*'(u)*omega and omega (all float32 [B, m])."""
    u = (_acc(losses) - scale * eta.to(_acc(losses).dtype)) / lam
    omega = torch.ones_like(u) if sample_weight is None else sample_weight.to(u.dtype)
    return u, divergence.conj_grad(u) * omega, omega


def dual_forward(
    losses: Tensor,
    eta: Tensor,
    lam: float,
    scale: float,
    divergence: Divergence,
    sample_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-task dual objective, its eta-gradient z and the per-sample loss cotangents."""
    divergence = check_dual_forward(losses, eta, lam, scale, divergence, sample_weight)
    return _dual_forward(losses, eta, lam, scale, divergence, sample_weight)


def _dual_forward(
    losses: Tensor, eta: Tensor, lam: float, scale: float, divergence: Divergence, sample_weight: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    batch = losses.shape[0]
    u, weighted_ratio, omega = _dual_terms(losses, eta, lam, scale, divergence, sample_weight)
    objective = lam * (divergence.conj(u) * omega).mean(dim=0) + scale * eta.to(u.dtype)
    grad_eta = scale * (1.0 - weighted_ratio.mean(dim=0))
    return objective, grad_eta, weighted_ratio / batch


def clip_factor(cap: float, budget: float, norm: Tensor) -> Tensor:
    """min(cap, budget / norm), with cap where the norm vanishes (the paper's clipping rule)."""
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    return torch.where(norm > 0, torch.clamp(budget / safe, max=cap), torch.full_like(norm, cap))


def dual_step(
    losses: Tensor,
    eta: Tensor,
    w: Tensor,
    lam: float,
    scale: float,
    divergence: Divergence,
    gamma: float,
    f1: float,
    f2: float,
    sample_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Alg. 2 steps 1-3 on one batch: z at eta_t, mu, eta_{t+1} (in place), weights at eta_{t+1}."""
    divergence = check_dual_step(losses, eta, w, lam, scale, divergence, gamma, f1, f2, sample_weight)
    _, z, _ = _dual_forward(losses, eta, lam, scale, divergence, sample_weight)
    direction = z * w.to(z.dtype)
    mu = clip_factor(f1, f2, torch.linalg.vector_norm(direction))
    eta.sub_((gamma * mu * direction).to(eta.dtype))
    _, weighted_ratio, _ = _dual_terms(losses, eta, lam, scale, divergence, sample_weight)
    return z, mu, weighted_ratio / losses.shape[0]


def gram(jacobian: JacobianBlocks) -> Tensor:
    """J J^T (float32, or float64 for float64 J), summed over the column blocks."""
    check_gram(jacobian)
    return _gram(_blocks(jacobian))


def _gram(blocks: list[Tensor]) -> Tensor:
    out = None
    for block in blocks:
        flat = _acc(block.reshape(block.shape[0], -1))
        part = flat @ flat.T
        out = part if out is None else out + part
    assert out is not None, "gram needs at least one block"
    return out


def combine(jacobian: JacobianBlocks, w: Tensor, params: Sequence[Tensor], lr: float | Tensor) -> None:
    """params -= lr * J^T w, written through each parameter (float32 math, rounded on store).

    Every argument is checked before the first parameter is written (see :mod:`drmoo_kernels._checks`).
    """
    check_combine(jacobian, w, params, lr)
    _combine(jacobian, w, params, lr)


def _combine(jacobian: JacobianBlocks, w: Tensor, params: Sequence[Tensor], lr: float | Tensor) -> None:
    flat = torch.cat([_acc(b.reshape(b.shape[0], -1)) for b in _blocks(jacobian)], dim=1)
    direction = w.to(flat.dtype) @ flat
    offset = 0
    for param in params:
        count = param.numel()
        update = direction[offset : offset + count].view_as(param)
        param.copy_((_acc(param) - lr * update).to(param.dtype))
        offset += count


def gram_step(
    jacobian: JacobianBlocks,
    w: Tensor,
    params: Sequence[Tensor],
    gamma: float,
    c1: float,
    c2: float,
    beta: float,
    rho: float,
    mu: Tensor | float,
    z: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Alg. 2 steps 4-5: theta -= gamma*alpha*J^T w;  w <- Pi(w - beta(alpha G w + mu z^2 w + rho w)).

    ``d_norm`` = sqrt(w^T G w) and ``alpha`` = min(c1, c2/d_norm) use the incoming w.  If the Gram
    matrix is not finite (a NaN/Inf in J), nothing is written: alpha is returned as 0, ``params``
    and ``w`` keep their values, and the caller decides (drmoo's optimizers raise).  This guard
    needs no host synchronisation.
    """
    check_gram_step(jacobian, w, params, gamma, c1, c2, beta, rho, mu, z)
    gram_matrix = _gram(_blocks(jacobian))
    finite, alpha, d_norm, w_next = gram_step_small(gram_matrix, w, c1, c2, beta, rho, mu, z)
    blocks = [b.reshape(b.shape[0], -1) for b in _blocks(jacobian)]
    safe_blocks = [torch.where(finite, b, torch.zeros_like(b)) for b in blocks]
    _combine(safe_blocks, w, params, gamma * alpha)
    w.copy_(w_next)
    return gram_matrix, d_norm, alpha.float()


def gram_step_small(
    gram_matrix: Tensor, w: Tensor, c1: float, c2: float, beta: float, rho: float, mu: Tensor | float, z: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The m x m part of ``gram_step`` (float64, on the device, no host synchronisation).

    Returns ``finite`` (is the Gram finite), ``alpha`` (float64; 0 when not finite), the reported
    ``d_norm`` (float32; NaN when not finite) and the next preference vector in ``w``'s dtype (the
    incoming ``w`` when not finite).  Every backend's ``gram_step`` shares this piece.
    """
    finite = torch.isfinite(gram_matrix).all()
    safe_gram = torch.where(finite, gram_matrix, torch.zeros_like(gram_matrix)).double()
    w64 = w.double()
    gram_w = safe_gram @ w64
    d_norm = torch.sqrt(torch.clamp(w64 @ gram_w, min=0.0))
    alpha = torch.where(finite, clip_factor(c1, c2, d_norm), torch.zeros_like(d_norm))
    mu64 = torch.as_tensor(mu, dtype=torch.float64, device=w.device)
    pref_grad = alpha * gram_w + mu64 * z.double() ** 2 * w64 + rho * w64
    w_next = torch.where(finite, project_simplex(w64 - beta * pref_grad), w64).to(w.dtype)
    reported = torch.where(finite, d_norm, torch.full_like(d_norm, float("nan"))).float()
    return finite, alpha, reported, w_next


def sum_squares(tensors: Sequence[Tensor]) -> Tensor:
    """``[k]``: entry i is the sum of squares of ``tensors[i]``'s entries (any shape and strides; 0 when empty).

    Each sum is taken in its tensor's math dtype (float32 for float16, bfloat16 and float32; float64 for
    float64); the result is float64 when one of the tensors is float64, else float32.  A NaN entry makes its
    sum NaN and an infinite one +Inf, so an entry is finite exactly when its tensor is -- unless the sum
    overflows the result's dtype (float32: a norm above ~1.8e19), as an unscaled L2 norm would.  An empty
    list gives an empty float32 tensor on the CPU.
    """
    device, dtype = check_sum_squares(tensors)
    if device is None:
        return torch.zeros(0, dtype=dtype)
    sums = []
    for tensor in tensors:
        flat = _acc(tensor.reshape(-1))
        sums.append(torch.dot(flat, flat).to(dtype))
    return torch.stack(sums)


def project_simplex(v: Tensor) -> Tensor:
    """Euclidean projection of the last dimension onto the probability simplex (exact, sort-based).

    The input is first shifted by its maximum: projection onto {w >= 0, sum w = 1} is invariant to
    adding a constant to every coordinate, and the shift keeps the cumulative sums small so that
    huge entries (1e30) do not swallow the "- 1" of the threshold in floating point.

    Args:
        v: ``[..., m]``; each row along the last dimension is projected.
    """
    if v.shape[-1] == 0:
        raise ValueError("cannot project an empty vector onto the simplex")
    work = v.double()
    work = work - work.max(dim=-1, keepdim=True).values
    ordered = torch.sort(work, dim=-1, descending=True).values
    cumulative = torch.cumsum(ordered, dim=-1)
    ks = torch.arange(1, v.shape[-1] + 1, dtype=work.dtype, device=v.device)
    # Largest k with k*u_k - (S_k - 1) > 0; k = 1 always qualifies since u_1 = 0 after the shift.
    support = (ks * ordered - cumulative + 1.0) > 0
    # clamp: a NaN input has an empty support; it then yields NaN instead of an indexing error.
    k = (support * ks).amax(dim=-1, keepdim=True).clamp(min=1.0)
    threshold = (torch.gather(cumulative, -1, k.long() - 1) - 1.0) / k
    return torch.clamp(work - threshold, min=0.0).to(v.dtype)
