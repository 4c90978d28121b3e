"""Floating-point error bounds of the drmoo ops: the tolerances of the kernel-vs-reference tests.

Why bounds and not fitted tolerances: a tolerance fitted to what one CPU's BLAS happens to return
fails on another CPU (issue 11: an AMD EPYC with AVX-512 rounds torch's float32 matmul differently
from the Intel CPU the old tolerances were fitted on).  A bound holds for every summation order,
so it holds on any CPU or GPU, and it is still far below what a real bug changes (see
``test_the_error_bounds_catch_planted_bugs`` in test_compiled_ops.py).

Model (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 2-3): every floating-point
operation returns (a op b)(1 + d) with |d| <= u, the unit roundoff of the dtype it runs in
(:func:`unit_roundoff`); gamma(k) = k u / (1 - k u) bounds k accumulated roundings.

*Sums and dot products.*  A sum of n terms computed in *any* order (left to right, blocked,
pairwise, split over threads/programs and combined, with or without fused multiply-adds) passes
each term through at most n - 1 additions, plus one rounding for its product, so
``|fl(sum x_k y_k) - sum x_k y_k| <= gamma(n) * sum |x_k y_k|``.  A split reduction - chunks of L
terms summed in precision u1, the P = ceil(n / L) chunk sums then added in precision u2 - has the
tighter ``gamma_u1(L) + gamma_u2(P) (1 + gamma_u1(L))`` (:func:`split_sum_factor`), but that needs the
kernel's L, and the reference's L (torch's BLAS) is unknown and differs between CPUs.  So the
tests use the any-order depth n for both sides (:func:`gram_error_bound`): the kernel and the
reference each lie within the bound of the exact Gram of the same (rounded) inputs, and their
difference within the sum of the two bounds.

*Elementwise functions.*  For the divergence functions the model is "accurate up to a small
perturbation of the argument and of the result": the computed f*'(u) lies in
f*'([u - e1, u + e1]) * [1 - e2, 1 + e2] with e1 = C u (|u| + s), e2 = C u (1 + |log f*'(u)|),
s the size of the constants added to u inside the formula and C = 8 (a few operations of at most a
couple of ulps each; pow/exp of a rounded argument amplify it by |log f*'|).  f*' is monotone
(f* is convex), so the set of possible values is the interval between its end points.

Everything is evaluated in float64 on the CPU; the bounds are returned as tensors of the outputs'
shapes, and :func:`assert_within` compares two results against one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from drmoo_kernels import Divergence

# The constant C of the elementwise-function model (see the module docstring).
FUNCTION_ULPS = 8.0


# ------------------------------------------------------------------------------------- basics
def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p of a floating dtype with p significand bits: 2^-24 float32, 2^-53 float64, 2^-8 bfloat16."""
    return float(torch.finfo(dtype).eps) / 2.0


def rounding_error(magnitude: Tensor | float, dtype: torch.dtype) -> Tensor | float:
    """Bound on |rnd(x) - x| when rounding x to ``dtype``, |x| <= ``magnitude`` or x within
    ``magnitude`` of an already rounded value: u |x| <= u magnitude / (1 - u) (|x| <= |rnd(x)| / (1 - u)),
    plus half the subnormal spacing, which bounds the (absolute) error below the smallest normal
    number (float16's is 6e-5: small parameters there are subnormal).  Two values that round
    differently can end up one unit in the last place apart, 2u |x| near the bottom of a binade, so
    a pair of these terms is nearly attained (ratios ~0.99 for bfloat16 parameters)."""
    info = torch.finfo(dtype)
    u = unit_roundoff(dtype)
    return u * magnitude / (1.0 - u) + float(info.tiny) * float(info.eps) / 2.0


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ops compute in: float64 for float64 inputs, float32 for every other float."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gamma(k: float | Tensor, u: float) -> float | Tensor:
    """gamma_k = k u / (1 - k u): the relative error of k accumulated roundings (needs k u < 1)."""
    if isinstance(k, Tensor):
        assert bool((k * u < 1).all()), "k u >= 1: the bound is vacuous"
        return k * u / (1.0 - k * u)
    assert k * u < 1, f"k u = {k * u} >= 1: the bound is vacuous"
    return k * u / (1.0 - k * u)


def split_sum_factor(n: int, chunk: int, u_chunk: float, u_combine: float) -> float:
    """Relative error factor of a split reduction of n products (see the module docstring).

    Chunks of ``chunk`` terms are summed in precision ``u_chunk`` (depth chunk: chunk - 1 additions
    and the product's rounding), then the ceil(n / chunk) chunk sums are added in ``u_combine``.
    With chunk = n (one chunk) it is the any-order bound gamma(n).
    """
    inner = gamma(min(chunk, max(n, 1)), u_chunk)
    partials = max(1, math.ceil(n / chunk))
    outer = gamma(partials, u_combine) if partials > 1 else 0.0
    return float(inner + outer * (1.0 + inner))


def _flat(jacobian: Tensor | Sequence[Tensor]) -> Tensor:
    """J as one [m, n] float64 CPU tensor (blocks concatenated along the columns)."""
    blocks = [jacobian] if isinstance(jacobian, Tensor) else list(jacobian)
    flat = [b.detach().reshape(b.shape[0], -1).to("cpu", torch.float64) for b in blocks]
    return flat[0] if len(flat) == 1 else torch.cat(flat, dim=1)


def assert_within(actual: Tensor, expected: Tensor, bound: Tensor | float, what: str) -> float:
    """Assert |actual - expected| <= bound elementwise (same dtype and shape); returns the worst ratio.

    NaN must match NaN.  The ratio max |actual - expected| / bound is what the tests' bounds leave
    to spare (1.0 = at the bound); the error message reports it and the worst entry.
    """
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    a = actual.detach().to("cpu", torch.float64)
    b = expected.detach().to("cpu", torch.float64)
    bound_t = torch.as_tensor(bound, dtype=torch.float64).expand_as(a) if a.dim() else torch.as_tensor(
        bound, dtype=torch.float64).reshape(())
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    assert torch.equal(nan_a, nan_b), f"{what}: NaN in different places"
    ok = ~nan_a
    if not bool(ok.any()):
        return 0.0
    same_inf = torch.isinf(a) & (a == b)
    diff = torch.where(same_inf, torch.zeros_like(a), (a - b).abs())[ok]
    limit = bound_t[ok]
    assert bool(torch.isfinite(limit).all()), f"{what}: the bound is not finite"
    ratio = torch.where(limit > 0, diff / limit, torch.where(diff > 0, torch.full_like(diff, math.inf), diff))
    worst = int(torch.argmax(ratio))
    worst_ratio = float(ratio[worst])
    assert worst_ratio <= 1.0, (
        f"{what}: |actual - expected| = {float(diff[worst]):.3e} exceeds the error bound {float(limit[worst]):.3e} "
        f"(ratio {worst_ratio:.3g}) at flat index {worst}; actual {float(a[ok][worst])!r}, "
        f"expected {float(b[ok][worst])!r}"
    )
    return worst_ratio


# --------------------------------------------------------------------------------------- Gram
def gram_error_bound(jacobian: Tensor | Sequence[Tensor], depth: int | None = None) -> Tensor:
    """Bound on |G_hat_ij - G_ij| for one implementation of J J^T: gamma(depth + 1) sum_k |J_ik| |J_jk|.

    G is the exact Gram of J's stored values (converting bfloat16/float16 to float32 is exact).
    ``depth`` is the longest chain of roundings one product goes through in the accumulation dtype
    (default n: any summation order); the +1 is the final rounding of the result to its dtype.
    """
    flat = _flat(jacobian)
    dtype = (jacobian if isinstance(jacobian, Tensor) else jacobian[0]).dtype
    n = flat.shape[1]
    u = unit_roundoff(acc_dtype(dtype))
    abs_gram = flat.abs() @ flat.abs().T
    return gamma((n if depth is None else depth) + 1, u) * abs_gram


# csrc/cpu/gram_cpu.cpp (chunk_columns): the CPU kernel sums chunks of at most 4096 columns in the
# math dtype and adds the chunk sums in float64.  Only used where a test holds that kernel to its
# own structural bound; if the chunking changes, this constant must follow.
CPP_GRAM_CHUNK_COLUMNS = 4096


def cpp_gram_error_bound(jacobian: Tensor | Sequence[Tensor]) -> Tensor:
    """Bound on |G_cpp - G| from the CPU kernel's split reduction (:func:`split_sum_factor`).

    Chunk sums over at most CPP_GRAM_CHUNK_COLUMNS columns in the math dtype (any order inside a
    chunk: vector lanes, several accumulators), added up in float64, rounded once to the output.
    """
    flat = _flat(jacobian)
    dtype = (jacobian if isinstance(jacobian, Tensor) else jacobian[0]).dtype
    u = unit_roundoff(acc_dtype(dtype))
    factor = split_sum_factor(flat.shape[1], CPP_GRAM_CHUNK_COLUMNS, u, unit_roundoff(torch.float64))
    return ((1.0 + factor) * (1.0 + u) - 1.0) * (flat.abs() @ flat.abs().T)


def gram_difference_bound(jacobian: Tensor | Sequence[Tensor]) -> Tensor:
    """Bound on |G_kernel - G_reference|: each within :func:`gram_error_bound` (any order) of the exact Gram."""
    return 2.0 * gram_error_bound(jacobian)


# -------------------------------------------------------------------------------- sum_squares
# csrc/cpu/gram_cpu.cpp (kSquaresChunk): the CPU kernel sums chunks of at most 4096 elements in the math
# dtype (vector lanes and a tail, added in float64) and adds the chunk sums in float64.  Only used where a
# test holds that kernel to its own structural bound; if the chunking changes, this constant must follow.
CPP_SUM_SQUARES_CHUNK = 4096


def exact_sum_squares(tensors: Sequence[Tensor]) -> Tensor:
    """The sums of squares of the tensors' stored values in float64 (the float64 products are exact for the
    16- and 32-bit dtypes; each sum is within gamma_64(n) of the exact one, far below the bounds here)."""
    return torch.stack([torch.sum(t.detach().to("cpu", torch.float64).reshape(-1) ** 2) for t in tensors])


def _squares_terms(tensors: Sequence[Tensor]) -> tuple[Tensor, list[int], list[float]]:
    """(exact sums, element counts, each tensor's math-dtype unit roundoff)."""
    return (exact_sum_squares(tensors), [t.numel() for t in tensors],
            [unit_roundoff(acc_dtype(t.dtype)) for t in tensors])


def _underflow(tensor: Tensor) -> float:
    """Absolute error the math dtype's subnormal range can add to a sum of ``tensor``'s squares: each product and
    each addition at most half its subnormal spacing (bfloat16 values below ~1e-19 square to float32 subnormals)."""
    info = torch.finfo(acc_dtype(tensor.dtype))
    return 2.0 * tensor.numel() * float(info.tiny) * float(info.eps)


def sum_squares_error_bound(tensors: Sequence[Tensor]) -> Tensor:
    """Bound on |s_hat_i - s_i| for one implementation of sum_squares, s_i the exact sum of tensors[i]'s squares.

    Any summation order in the tensor's math dtype: gamma(n_i + 1) s_i (n_i - 1 additions and the product's
    rounding on each term's path, plus the final rounding to the result's dtype, whose unit roundoff is at most
    the math dtype's); the terms are >= 0, so sum |x^2| is the sum itself.
    """
    exact, counts, units = _squares_terms(tensors)
    bounds = [gamma(n + 1, u) * float(s) + _underflow(t) for s, n, u, t in zip(exact, counts, units, tensors)]
    return torch.tensor(bounds, dtype=torch.float64)


def sum_squares_difference_bound(tensors: Sequence[Tensor]) -> Tensor:
    """Bound on |s_kernel - s_reference|: each within :func:`sum_squares_error_bound` (any order) of the exact sum."""
    return 2.0 * sum_squares_error_bound(tensors)


def cpp_sum_squares_error_bound(tensors: Sequence[Tensor], result_dtype: torch.dtype) -> Tensor:
    """Bound on |s_cpp - s| from the CPU kernel's split reduction: chunks of at most CPP_SUM_SQUARES_CHUNK terms
    in the math dtype (any order inside a chunk), their lanes and tail (at most 16 values) and the chunk sums
    added in float64, rounded once to ``result_dtype``."""
    exact, counts, units = _squares_terms(tensors)
    u64, u_out = unit_roundoff(torch.float64), unit_roundoff(result_dtype)
    bounds = []
    for s, n, u, tensor in zip(exact, counts, units, tensors):
        inner = gamma(min(CPP_SUM_SQUARES_CHUNK, max(n, 1)), u)
        outer = gamma(math.ceil(n / CPP_SUM_SQUARES_CHUNK) + 16, u64)
        factor = inner + outer * (1.0 + inner)
        bounds.append(((1.0 + factor) * (1.0 + u_out) - 1.0) * float(s) + _underflow(tensor))
    return torch.tensor(bounds, dtype=torch.float64)


# --------------------------------------------------------------------------------- gram_step
@dataclass
class GramStepBounds:
    """Bounds on |kernel - reference| for each output of gram_step (tensors of the outputs' shapes)."""

    gram: Tensor
    d_norm: Tensor
    alpha: Tensor  # the float32 alpha gram_step returns
    alpha_used: Tensor  # the float64 alpha both sides use for the step
    w: Tensor
    params: list[Tensor]


def d_norm_bound(gram_bound: Tensor, gram: Tensor, w: Tensor, d_norm: float) -> float:
    """Bound on |d_a - d_b| for d = sqrt(w^T G w) computed in float64 from two Grams within ``gram_bound``.

    |w^T G_a w - w^T G_b w| <= |w|^T E |w| (plus float64 rounding of the m x m products), and for
    a, b >= 0: |a - b| <= min(sqrt(|a^2 - b^2|), |a^2 - b^2| / b) with b = ``d_norm``, one side's value.
    """
    w64 = w.detach().to("cpu", torch.float64).abs()
    g64 = gram.detach().to("cpu", torch.float64).abs()
    m = w64.numel()
    squared = float(w64 @ gram_bound @ w64) + 2.0 * gamma(2 * m + 1, unit_roundoff(torch.float64)) * float(
        w64 @ g64 @ w64)
    bound = math.sqrt(squared)
    if d_norm > 0:
        bound = min(bound, squared / d_norm)
    return bound


def clip_bound(cap: float, budget: float, norm: float, norm_bound: float) -> float:
    """Bound on |clip(cap, budget, a) - clip(cap, budget, b)| for |a - b| <= norm_bound, b = ``norm``.

    clip(cap, budget, x) = min(cap, budget / x) (cap at x = 0) is 1-Lipschitz in budget / x, and
    |budget/a - budget/b| = budget |a - b| / (a b) with a >= norm - norm_bound.  When the norm may
    be 0, either value is possible: anything in [0, cap].
    """
    low = norm - norm_bound
    if low <= 0:
        return cap
    return min(cap, budget * norm_bound / (low * norm))


def w_next_bound(gram_bound: Tensor, gram: Tensor, w: Tensor, z: Tensor, mu: float, alpha: float,
                 alpha_bound: float, beta: float, rho: float, w_next: Tensor) -> Tensor:
    """Bound on |w_a - w_b| for w' = Pi(w - beta (alpha G w + mu z^2 w + rho w)) (float64, stored in w's dtype).

    The argument of the projection differs by at most beta (|Delta alpha| |G w| + alpha_max E |w|)
    per entry; the simplex projection is non-expansive in the 2-norm, so every entry of w' differs
    by at most that vector's 2-norm.  Add the float64 roundings (the products, the sort-based
    projection: O(m) operations each) and the final rounding to w's dtype on both sides.
    """
    w64 = w.detach().to("cpu", torch.float64)
    g64 = gram.detach().to("cpu", torch.float64)
    m = w64.numel()
    u64 = unit_roundoff(torch.float64)
    alpha_max = alpha + alpha_bound
    arg_diff = beta * (alpha_bound * (g64 @ w64).abs() + alpha_max * (gram_bound @ w64.abs()))
    z2 = z.detach().to("cpu", torch.float64) ** 2
    argument = w64 - beta * (alpha * (g64 @ w64) + mu * z2 * w64 + rho * w64)
    scale = float(argument.abs().max()) + 1.0 + beta * (alpha_max * float((g64.abs() @ w64.abs()).max())
                                                         + abs(mu) * float((z2 * w64.abs()).max()) + rho)
    rounding64 = 2.0 * gamma(4 * m + 16, u64) * scale
    spread = float(torch.linalg.vector_norm(arg_diff)) + rounding64
    stored = w_next.detach().to("cpu", torch.float64).abs()
    return spread + 2.0 * rounding_error(stored + spread, w.dtype)


def combine_bound(jacobian: Tensor | Sequence[Tensor], w: Tensor, params_before: Sequence[Tensor],
                  params_after: Sequence[Tensor], lr: float, lr_bound: float = 0.0) -> list[Tensor]:
    """Bound on |theta_a - theta_b| per parameter entry for theta' = theta - lr J^T w.

    Each side computes d_k = sum_i w_i J_ik (m terms, any order), lr * d_k and theta_k - lr d_k in
    the accumulation dtype, with lr and w rounded to it: gamma(m + 3) (|theta_k| + lr (|J|^T |w|)_k)
    from the exact value at its lr.  The two sides' lr differ by at most ``lr_bound`` (gram_step:
    gamma * |Delta alpha|), which moves theta by lr_bound |J^T w|_k.  Then each side rounds to the
    parameter's dtype (:func:`rounding_error`: relative, or absolute for subnormals), so
    |rnd(a) - rnd(b)| <= |a - b| + err(a) + err(b).  ``params_after`` (one side's result) gives the
    magnitude of the stored values.
    """
    flat = _flat(jacobian)
    dtype = (jacobian if isinstance(jacobian, Tensor) else jacobian[0]).dtype
    u = unit_roundoff(acc_dtype(dtype))
    m = flat.shape[0]
    w64 = w.detach().to("cpu", torch.float64)
    direction = w64 @ flat
    abs_direction = w64.abs() @ flat.abs()
    lr_max = abs(lr) + lr_bound
    bounds, offset = [], 0
    for before, after in zip(params_before, params_after):
        count = before.numel()
        theta = before.detach().to("cpu", torch.float64).reshape(-1)
        stored = after.detach().to("cpu", torch.float64).reshape(-1)
        d_abs = abs_direction[offset:offset + count]
        d_val = direction[offset:offset + count]
        math_diff = 2.0 * gamma(m + 3, u) * (theta.abs() + lr_max * d_abs) + lr_bound * d_val.abs()
        stored_error = 2.0 * rounding_error(stored.abs() + math_diff, before.dtype)
        bounds.append((math_diff + stored_error).reshape(before.shape))
        offset += count
    assert offset == flat.shape[1], "the parameters do not cover J's columns"
    return bounds


def gram_step_bounds(jacobian: Tensor | Sequence[Tensor], w: Tensor, params_before: Sequence[Tensor],
                     gamma_lr: float, c1: float, c2: float, beta: float, rho: float, mu: Tensor | float,
                     z: Tensor, reference_out: tuple[Tensor, Tensor, Tensor], w_reference: Tensor,
                     params_reference: Sequence[Tensor]) -> GramStepBounds:
    """Bounds on every output of gram_step (kernel vs reference), propagated from the Gram's bound.

    ``w`` and ``params_before`` are the inputs; ``reference_out`` (gram, d_norm, alpha),
    ``w_reference`` and ``params_reference`` the reference's results, which give the magnitudes.
    Gram -> d = sqrt(w^T G w) (:func:`d_norm_bound`) -> alpha = min(c1, c2 / d) (:func:`clip_bound`)
    -> w' (:func:`w_next_bound`) and theta' = theta - gamma alpha J^T w (:func:`combine_bound`).
    """
    gram_ref, d_ref, alpha_ref = reference_out
    e_gram = gram_difference_bound(jacobian)
    d = float(d_ref)
    e_d64 = d_norm_bound(e_gram, gram_ref, w, d)
    # d_norm is returned as float32 by both sides: one more rounding each.
    e_d = e_d64 + 2.0 * rounding_error(d + e_d64, torch.float32)
    alpha = float(alpha_ref)
    e_alpha_used = clip_bound(c1, c2, d, e_d64) + 2.0 * gamma(3, unit_roundoff(torch.float64)) * alpha
    e_alpha = e_alpha_used + 2.0 * rounding_error(alpha + e_alpha_used, torch.float32)
    mu_value = float(mu)
    e_w = w_next_bound(e_gram, gram_ref, w, z, mu_value, alpha, e_alpha_used, beta, rho, w_reference)
    e_params = combine_bound(jacobian, w, params_before, params_reference, gamma_lr * alpha,
                             lr_bound=gamma_lr * e_alpha_used)
    return GramStepBounds(gram=e_gram, d_norm=torch.tensor(e_d, dtype=torch.float64),
                          alpha=torch.tensor(e_alpha, dtype=torch.float64),
                          alpha_used=torch.tensor(e_alpha_used, dtype=torch.float64), w=e_w, params=e_params)


# --------------------------------------------------------------------------------------- dual
def _argument_shift(divergence: Divergence) -> tuple[float, float]:
    """(s, s_conj): the size of the constants added to u inside f*'(u), and the constant terms of f*(u)."""
    if divergence.name == "chi2":
        return 2.0, 1.0
    if divergence.name == "kl":
        return 1.0, 1.0
    if divergence.name == "cvar_smooth":
        a = divergence.param
        logs = abs(math.log(a / (1 - a))) + abs(math.log(a)) + abs(math.log1p(-a))
        return logs, (logs + 1.0) / a
    if divergence.name == "cressie_read":
        k = divergence.param
        # base = (k - 1) u + 1 = (k - 1)(u + 1 / (k - 1)); f* = (base^(k/(k-1)) - 1) / k
        return 2.0 / (k - 1.0), 1.0 / k + 1.0
    raise ValueError(f"no error model for divergence {divergence.name!r}")


def _conj_grad_interval(divergence: Divergence, u: Tensor, u_spread: Tensor, unit: float) -> tuple[Tensor, Tensor]:
    """[lo, hi] holding every computed f*'(u_hat) with |u_hat - u| <= u_spread (the model of the docstring)."""
    s, _ = _argument_shift(divergence)
    e1 = u_spread + FUNCTION_ULPS * unit * (u.abs() + u_spread + s)
    lo_arg, hi_arg = u - e1, u + e1
    lo, hi = divergence.conj_grad(lo_arg), divergence.conj_grad(hi_arg)
    mid = divergence.conj_grad(u)
    e2 = FUNCTION_ULPS * unit * (1.0 + torch.log(torch.clamp(hi.abs(), min=1e-300)).abs().clamp(max=1e3))
    e2 = torch.where(hi > 0, e2, torch.zeros_like(e2))
    return torch.minimum(lo, mid) * (1.0 - e2), torch.maximum(hi, mid) * (1.0 + e2)


def _conj_spread(divergence: Divergence, u: Tensor, u_spread: Tensor, unit: float) -> Tensor:
    """Bound on |f*_hat(u_a) - f*_hat(u_b)| for |u_a - u|, |u_b - u| <= u_spread.

    Mean value theorem with f*' monotone: the width of the argument interval times the larger |f*'|
    at its end points, plus each side's evaluation error (relative, and absolute from the constants).
    """
    s, s_conj = _argument_shift(divergence)
    e1 = u_spread + FUNCTION_ULPS * unit * (u.abs() + u_spread + s)
    lo, hi = divergence.conj_grad(u - e1), divergence.conj_grad(u + e1)
    slope = torch.maximum(lo.abs(), hi.abs())
    value = divergence.conj(u).abs()
    evaluation = FUNCTION_ULPS * unit * (value + slope * (u.abs() + s) + s_conj)
    return 2.0 * e1 * slope + 2.0 * evaluation


def _u_and_spread(losses: Tensor, eta: Tensor, eta_spread: Tensor | float, lam: float, scale: float,
                  unit: float) -> tuple[Tensor, Tensor]:
    """u = (loss - scale eta) / lam in float64, and the bound on |u_hat - u| of one side.

    Each side rounds scale and lam to the math dtype and computes scale * eta, the difference and
    the quotient: gamma(5) (|loss| + |scale eta|) / lam; an eta known only to within ``eta_spread``
    moves u by |scale| eta_spread / lam.
    """
    loss64 = losses.detach().to("cpu", torch.float64)
    eta64 = eta.detach().to("cpu", torch.float64)
    u = (loss64 - scale * eta64) / lam
    spread = gamma(5, unit) * (loss64.abs() + abs(scale) * eta64.abs()) / lam
    spread = spread + abs(scale) * torch.as_tensor(eta_spread, dtype=torch.float64) / lam
    return u, spread


@dataclass
class DualBounds:
    """Bounds on |kernel - reference| for each output of dual_forward / dual_step."""

    objective: Tensor | None
    z: Tensor
    weights: Tensor
    mu: Tensor | None = None
    eta: Tensor | None = None


def dual_forward_bounds(losses: Tensor, eta: Tensor, lam: float, scale: float, divergence: Divergence,
                        sample_weight: Tensor | None = None, eta_spread: Tensor | float = 0.0) -> DualBounds:
    """Bounds on objective, z = grad_eta and the weights of dual_forward (kernel vs reference).

    Per entry: u to within :func:`_u_and_spread`, then f*'(u) in the interval of the function
    model, times omega (rounded to the math dtype) and / B.  Per task: the batch means differ by
    the mean of the per-entry differences plus each side's summation error gamma(B) mean|.|
    (any order: the reference's float32 reduction, the kernels' float64 or float32 partials), then
    z = scale (1 - mean f*') and objective = lam mean(omega f*) + scale eta add a few roundings.
    ``eta_spread`` widens u for an eta that is itself only known to within it (dual_step's eta_{t+1}).
    """
    unit = unit_roundoff(acc_dtype(losses.dtype))
    batch = losses.shape[0]
    u, u_spread = _u_and_spread(losses, eta, eta_spread, lam, scale, unit)
    omega = (torch.ones_like(u) if sample_weight is None
             else sample_weight.detach().to("cpu", torch.float64))
    lo, hi = _conj_grad_interval(divergence, u, u_spread, unit)
    grad = divergence.conj_grad(u)
    # omega f*'(u): the interval's width, omega's rounding to the math dtype and the product's rounding.
    grad_diff = omega.abs() * (hi - lo) + 2.0 * gamma(2, unit) * omega.abs() * torch.maximum(hi.abs(), lo.abs())
    weights = grad_diff / batch + 2.0 * unit * (omega.abs() * hi.abs() / batch + grad_diff / batch)
    sum_error = gamma(batch + 1, unit)
    mean_grad_abs = (omega.abs() * torch.maximum(hi.abs(), lo.abs())).mean(dim=0)
    mean_grad = (omega * grad).mean(dim=0)
    mean_grad_diff = grad_diff.mean(dim=0) + 2.0 * sum_error * mean_grad_abs
    z = abs(scale) * mean_grad_diff + 2.0 * gamma(3, unit) * abs(scale) * (1.0 + mean_grad.abs() + mean_grad_diff)
    conj_diff = omega.abs() * _conj_spread(divergence, u, u_spread, unit) + 2.0 * gamma(2, unit) * (
        omega.abs() * divergence.conj(u).abs())
    mean_conj_abs = (omega.abs() * divergence.conj(u).abs()).mean(dim=0) + conj_diff.mean(dim=0)
    mean_conj_diff = conj_diff.mean(dim=0) + 2.0 * sum_error * mean_conj_abs
    eta64 = eta.detach().to("cpu", torch.float64)
    objective = lam * mean_conj_diff + abs(scale) * torch.as_tensor(eta_spread, dtype=torch.float64) + (
        2.0 * gamma(4, unit) * (lam * mean_conj_abs + abs(scale) * eta64.abs()))
    return DualBounds(objective=objective, z=z, weights=weights)


def dual_step_bounds(losses: Tensor, eta: Tensor, w: Tensor, lam: float, scale: float, divergence: Divergence,
                     gamma_lr: float, f1: float, f2: float, sample_weight: Tensor | None,
                     reference_out: tuple[Tensor, Tensor, Tensor], eta_reference: Tensor) -> DualBounds:
    """Bounds on z, mu, eta_{t+1} and the weights at eta_{t+1} of dual_step (kernel vs reference).

    z as in dual_forward; direction = z w (|Delta| <= |Delta z| w + roundings); its norm within the
    2-norm of that plus gamma(m + 1) of the norm; mu = min(f1, f2 / norm) (:func:`clip_bound`);
    eta_{t+1} = eta - gamma mu direction, rounded to eta's dtype; the weights at eta_{t+1} as in
    dual_forward with u widened by scale |Delta eta| / lam.  ``reference_out`` = (z, mu, weights)
    and ``eta_reference`` (the reference's eta_{t+1}) give the magnitudes.
    """
    unit = unit_roundoff(acc_dtype(losses.dtype))
    z_ref, mu_ref, _ = reference_out
    first = dual_forward_bounds(losses, eta, lam, scale, divergence, sample_weight)
    z64 = z_ref.detach().to("cpu", torch.float64)
    w64 = w.detach().to("cpu", torch.float64)
    m = z64.numel()
    direction = z64 * w64
    direction_diff = first.z * w64.abs() + 2.0 * unit * (direction.abs() + first.z * w64.abs())
    norm = float(torch.linalg.vector_norm(direction))
    norm_diff = float(torch.linalg.vector_norm(direction_diff)) + 2.0 * gamma(m + 2, unit) * (
        norm + float(torch.linalg.vector_norm(direction_diff)))
    mu_value = float(mu_ref)
    mu_diff = clip_bound(f1, f2, norm, norm_diff) + 2.0 * gamma(3, unit) * (mu_value + f1)
    mu_max = mu_value + mu_diff
    eta64 = eta.detach().to("cpu", torch.float64)
    step = gamma_lr * mu_value * direction
    step_diff = gamma_lr * (mu_diff * (direction.abs() + direction_diff) + mu_max * direction_diff)
    eta_math_diff = step_diff + 2.0 * gamma(4, unit) * (eta64.abs() + gamma_lr * mu_max * (direction.abs()
                                                                                         + direction_diff))
    eta_stored = eta_reference.detach().to("cpu", torch.float64).abs()
    eta_diff = eta_math_diff + 2.0 * rounding_error(eta_stored + eta_math_diff, eta.dtype)
    del step
    second = dual_forward_bounds(losses, eta_reference.to(torch.float64), lam, scale, divergence, sample_weight,
                                 eta_spread=eta_diff)
    return DualBounds(objective=None, z=first.z, weights=second.weights,
                      mu=torch.tensor(mu_diff, dtype=torch.float64), eta=eta_diff)


# ------------------------------------------------------------------------ the objective against its exact value
def _exact_conj(divergence: Divergence, u: Any) -> Any:
    """f*(u) in mpmath's arbitrary precision (the conjugates' closed forms, written without cancellation)."""
    import mpmath

    if divergence.name == "chi2":
        return mpmath.mpf(-1) if u < -2 else u + u * u / 4
    if divergence.name == "kl":
        return mpmath.expm1(u)
    if divergence.name == "cvar_smooth":
        alpha = mpmath.mpf(divergence.param)
        return mpmath.log1p(alpha * mpmath.expm1(u)) / alpha
    k = mpmath.mpf(divergence.param)
    base = 1 + (k - 1) * u
    return -1 / k if base <= 0 else (mpmath.power(base, k / (k - 1)) - 1) / k


def exact_dual_objective(losses: Tensor, eta: Tensor, lam: float, scale: float,
                         divergence: Divergence) -> tuple[list[float], list[float]]:
    """Per task, the dual objective lam mean_i f*((l_i - s eta) / lam) + s eta of the (rounded) inputs, computed
    in 60 digits, and the error bound (``scale`` must be 1) of a float computation of it (unit roundoff of
    ``losses``' math dtype):

        u_i = (l_i - s eta) / lam    relative error gamma(4): lam's rounding to the math dtype, s eta, the
                                     difference, the quotient (for s = 1, where s eta is exact; another s
                                     would need its error relative to s eta, not to u)
        f*(u_i)                      FUNCTION_ULPS roundings, and u_i's error times f*'s condition |u f*'/f*|
        lam f*(u_i), their mean      one rounding, then gamma(B + 1) of the sum of |terms| (any order)
        + s eta                      two roundings of |s eta| and one of the result

    Only a form without cancellation meets it where f*(u) ~ u is small (a large lam): a form "near 1, minus 1"
    has an absolute error of one rounding of 1, lam times that in the objective."""
    import mpmath

    if scale != 1.0:
        raise ValueError("exact_dual_objective's bound is derived for scale = 1 (s eta exact)")
    mpmath.mp.dps = 60
    unit = unit_roundoff(acc_dtype(losses.dtype))
    batch = losses.shape[0]
    exact, bounds = [], []
    for task in range(losses.shape[1]):
        shift = mpmath.mpf(scale) * mpmath.mpf(float(eta[task]))
        terms, spread = [], mpmath.mpf(0)
        for loss in losses[:, task].tolist():
            u = (mpmath.mpf(loss) - shift) / mpmath.mpf(lam)
            value = _exact_conj(divergence, u)
            slope = float(divergence.conj_grad(torch.tensor(float(u), dtype=torch.float64)))
            condition = abs(u * slope / value) if value != 0 else mpmath.mpf(1)  # f*(u) ~ u near 0
            terms.append(mpmath.mpf(lam) * value)
            spread += abs(terms[-1]) * (FUNCTION_ULPS + gamma(4, unit) / unit * condition + 1)
        total = mpmath.fsum(terms) / batch + shift
        bound = unit * (spread / batch + gamma(batch + 1, unit) / unit * mpmath.fsum(abs(t) for t in terms) / batch
                        + 3 * abs(shift) + abs(total))
        exact.append(float(total))
        bounds.append(float(bound))
    return exact, bounds
