"""Triton kernels behind :mod:`drmoo_kernels.backends.triton` (math in float32 whatever the input dtype).

This file imports triton at module level, so it is never imported by ``import drmoo_kernels``: the
loader in :mod:`drmoo_kernels.triton_kernels` executes it on first use, once per execution mode
(compiled for CUDA tensors, interpreted for CPU tensors under ``TRITON_INTERPRET``), because
``triton.jit`` fixes the mode of a kernel when it decorates it.

Divergence selection is a constexpr ``CODE`` (0 chi2, 1 kl, 2 cvar_smooth, 3 cressie_read, the
numbering of :attr:`drmoo_kernels.Divergence.code`); its parameter enters through the host-computed
constants ``P0..P3`` (see ``_divergence_constants`` in the backend) so the kernels do no transcendental
work on it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _log1p_unit(x):
    """log(1 + x) for x in [0, 1], accurate for tiny x (the rounding of 1 + x is divided back out)."""
    y = 1.0 + x
    denom = tl.where(y == 1.0, 1.0, y - 1.0)
    return tl.where(y == 1.0, x, tl.log(y) * (x / denom))


@triton.jit
def _expm1(u):
    """e^u - 1 without cancellation near 0 (Kahan's trick below |u| = 0.5, plain difference above)."""
    e = tl.exp(u)
    small = tl.abs(u) < 0.5
    # Only evaluate the logarithm where it is well defined and needed.
    e_small = tl.where(small, e, 2.0)
    denom = tl.where(e_small == 1.0, 1.0, tl.log(e_small))
    kahan = tl.where(e_small == 1.0, u, (e_small - 1.0) * (u / denom))
    return tl.where(small, kahan, e - 1.0)


@triton.jit
def _positive_pow(base, exponent):
    """base ** exponent for base >= 0 and exponent > 0 (0 maps to 0 without evaluating log 0)."""
    positive = base > 0.0
    safe = tl.where(positive, base, 1.0)
    return tl.where(positive, tl.exp2(exponent * tl.log2(safe)), 0.0)


@triton.jit
def _conj_grad(u, CODE: tl.constexpr, P0, P1, P2, P3):
    """f*'(u) >= 0.  cvar: P2 = log(alpha/(1-alpha)), P3 = 1/alpha.  cressie: P0 = k-1, P1 = 1/(k-1)."""
    if CODE == 0:
        grad = 0.5 * tl.maximum(u + 2.0, 0.0)
    elif CODE == 1:
        grad = tl.exp(u)
    elif CODE == 2:
        grad = tl.sigmoid(u + P2) * P3
    else:
        grad = _positive_pow(tl.maximum(P0 * u + 1.0, 0.0), P1)
    return grad


@triton.jit
def _conj_and_grad(u, CODE: tl.constexpr, P0, P1, P2, P3):
    """(f*(u), f*'(u)).  cvar: P0 = log(1-alpha), P1 = log(alpha); cressie: P2 = 1/k."""
    if CODE == 0:
        plus = tl.maximum(u + 2.0, 0.0)
        conj = 0.25 * plus * plus - 1.0
        grad = 0.5 * plus
    elif CODE == 1:
        conj = _expm1(u)
        grad = tl.exp(u)
    elif CODE == 2:
        # log((1 - alpha) + alpha e^u) as a log-sum-exp of log(1-alpha) and log(alpha) + u.
        b = u + P1
        hi = tl.maximum(b, P0)
        lo = tl.minimum(b, P0)
        conj = (hi + _log1p_unit(tl.exp(lo - hi))) * P3
        grad = tl.sigmoid(u + P2) * P3
    else:
        base = tl.maximum(P0 * u + 1.0, 0.0)
        grad = _positive_pow(base, P1)
        # base^(k/(k-1)) = base * base^(1/(k-1)): one power serves both values.
        conj = (base * grad - 1.0) * P2
    return conj, grad


@triton.jit
def dual_forward_kernel(
    loss_ptr, sw_ptr, eta_ptr, obj_ptr, z_ptr, weight_ptr,
    B, M, stride_lb, stride_lm, stride_sb, stride_sm,
    batch, lam, scale, P0, P1, P2, P3,
    CODE: tl.constexpr, HAS_SW: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """One program per block of task columns; it walks the whole batch once.

    weights[b, i] = omega f*'(u) / B (float32, contiguous [B, M]); objective and z from the column sums.
    """
    pid = tl.program_id(0)
    cols = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok = cols < M
    eta = tl.load(eta_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    shift = scale * eta
    conj_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    grad_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, B, BLOCK_B):
        rows = (start + tl.arange(0, BLOCK_B)).to(tl.int64)
        ok = (rows < B)[:, None] & col_ok[None, :]
        loss = tl.load(loss_ptr + rows[:, None] * stride_lb + cols[None, :] * stride_lm, mask=ok, other=0.0)
        u = (loss.to(tl.float32) - shift[None, :]) / lam
        conj, grad = _conj_and_grad(u, CODE, P0, P1, P2, P3)
        if HAS_SW:
            omega = tl.load(sw_ptr + rows[:, None] * stride_sb + cols[None, :] * stride_sm, mask=ok, other=0.0)
            omega = omega.to(tl.float32)
            conj = conj * omega
            grad = grad * omega
        conj = tl.where(ok, conj, 0.0)
        grad = tl.where(ok, grad, 0.0)
        conj_sum += tl.sum(conj, axis=0)
        grad_sum += tl.sum(grad, axis=0)
        tl.store(weight_ptr + rows[:, None] * M + cols[None, :], grad / batch, mask=ok)
    tl.store(obj_ptr + cols, lam * (conj_sum / batch) + shift, mask=col_ok)
    tl.store(z_ptr + cols, scale * (1.0 - grad_sum / batch), mask=col_ok)


@triton.jit
def _weighted_ratio_sum(
    loss_ptr, sw_ptr, shift, rows_base, cols, col_ok, B, stride_lb, stride_lm, stride_sb, stride_sm,
    batch, lam, P0, P1, P2, P3, weight_ptr, M,
    CODE: tl.constexpr, HAS_SW: tl.constexpr, STORE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Column sums of omega f*'((loss - shift) / lam) over the batch; with STORE also writes them / B."""
    grad_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, B, BLOCK_B):
        rows = (start + rows_base).to(tl.int64)
        ok = (rows < B)[:, None] & col_ok[None, :]
        loss = tl.load(loss_ptr + rows[:, None] * stride_lb + cols[None, :] * stride_lm, mask=ok, other=0.0)
        u = (loss.to(tl.float32) - shift[None, :]) / lam
        grad = _conj_grad(u, CODE, P0, P1, P2, P3)
        if HAS_SW:
            omega = tl.load(sw_ptr + rows[:, None] * stride_sb + cols[None, :] * stride_sm, mask=ok, other=0.0)
            grad = grad * omega.to(tl.float32)
        grad = tl.where(ok, grad, 0.0)
        grad_sum += tl.sum(grad, axis=0)
        if STORE:
            tl.store(weight_ptr + rows[:, None] * M + cols[None, :], grad / batch, mask=ok)
    return grad_sum


@triton.jit
def dual_step_kernel(
    loss_ptr, sw_ptr, eta_ptr, w_ptr, z_ptr, mu_ptr, weight_ptr,
    B, M, stride_lb, stride_lm, stride_sb, stride_sm,
    batch, lam, scale, gamma, f1, f2, P0, P1, P2, P3,
    CODE: tl.constexpr, HAS_SW: tl.constexpr, ETA_F64: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Alg. 2 steps 1-3 in a single program (mu couples every task, so all columns live in one block).

    Pass 1 reduces f*' at eta_t into z; the clipped eta step happens in registers and is stored in
    place; pass 2 writes the weights at eta_{t+1} (as stored, i.e. rounded to eta's dtype).
    """
    cols = tl.arange(0, BLOCK_M)
    col_ok = cols < M
    rows_base = tl.arange(0, BLOCK_B)
    eta = tl.load(eta_ptr + cols, mask=col_ok, other=0.0)
    grad_sum = _weighted_ratio_sum(
        loss_ptr, sw_ptr, scale * eta.to(tl.float32), rows_base, cols, col_ok, B,
        stride_lb, stride_lm, stride_sb, stride_sm, batch, lam, P0, P1, P2, P3, weight_ptr, M,
        CODE, HAS_SW, False, BLOCK_B, BLOCK_M,
    )
    z = scale * (1.0 - grad_sum / batch)
    z = tl.where(col_ok, z, 0.0)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    direction = z * w
    norm = tl.sqrt(tl.sum(direction * direction, axis=0))
    # clip_factor: min(f1, f2 / norm), and f1 where the norm vanishes.
    mu = tl.where(norm > 0.0, tl.minimum(f2 / tl.where(norm > 0.0, norm, 1.0), f1), f1)
    # eta.sub_((gamma mu direction).to(eta.dtype)), as torch does it: round the step to eta's dtype,
    # subtract in float32 (float64 for a float64 eta) and round the difference to eta's dtype.
    if ETA_F64:
        step = (gamma * mu * direction).to(tl.float64)
        eta_next = eta - step
    else:
        step = (gamma * mu * direction).to(eta.dtype).to(tl.float32)
        eta_next = (eta.to(tl.float32) - step).to(eta.dtype)
    tl.store(eta_ptr + cols, eta_next, mask=col_ok)
    tl.store(z_ptr + cols, z, mask=col_ok)
    tl.store(mu_ptr, mu)
    _weighted_ratio_sum(
        loss_ptr, sw_ptr, scale * eta_next.to(tl.float32), rows_base, cols, col_ok, B,
        stride_lb, stride_lm, stride_sb, stride_sm, batch, lam, P0, P1, P2, P3, weight_ptr, M,
        CODE, HAS_SW, True, BLOCK_B, BLOCK_M,
    )


@triton.jit
def gram_partial_kernel(
    j_ptr, part_ptr, M, N, stride_m, chunk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr, ONE_TILE: tl.constexpr,
):
    """Split reduction of J J^T over a grid (column chunks, row tiles, row tiles).

    Program (p, a, b) sums the products of row tile a with row tile b over the columns
    [p*chunk, (p+1)*chunk) into part[p, a rows, b rows] (part is [programs, M, M]).  ``chunk`` is a
    multiple of BLOCK_N.  Row tiles of at most 64 rows keep the BLOCK_M x BLOCK_M accumulator in
    registers for any m (a single 128-wide or wider accumulator spills); with ONE_TILE (m <= BLOCK_M)
    both operands are the same tile, loaded once.  Small task counts use a broadcast product (a dot
    needs 16-wide operands on GPUs, mostly padding for m <= 8); larger ones use an IEEE-precision
    dot so fp32 inputs are not rounded to tf32.
    """
    pid = tl.program_id(0)
    rows_a = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_b = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok_a = rows_a < M
    ok_b = rows_b < M
    off_a = rows_a.to(tl.int64)[:, None] * stride_m
    off_b = rows_b.to(tl.int64)[:, None] * stride_m
    first = pid.to(tl.int64) * chunk
    acc = tl.zeros([BLOCK_M, BLOCK_M], dtype=tl.float32)
    for offset in range(0, chunk, BLOCK_N):
        cols = first + offset + tl.arange(0, BLOCK_N)
        col_ok = (cols < N)[None, :]
        xa = tl.load(j_ptr + off_a + cols[None, :], mask=ok_a[:, None] & col_ok, other=0.0).to(tl.float32)
        if ONE_TILE:
            xb = xa
        else:
            xb = tl.load(j_ptr + off_b + cols[None, :], mask=ok_b[:, None] & col_ok, other=0.0).to(tl.float32)
        if USE_DOT:
            acc += tl.dot(xa, tl.trans(xb), input_precision="ieee")
        else:
            acc += tl.sum(xa[:, None, :] * xb[None, :, :], axis=2)
    out = part_ptr + pid.to(tl.int64) * M * M + rows_a[:, None] * M + rows_b[None, :]
    tl.store(out, acc, mask=ok_a[:, None] & ok_b[None, :])


@triton.jit
def combine_kernel(
    j_ptr, w_ptr, p_ptr, lr_ptr, flag_ptr, M, count, stride_m, col0, lr_value,
    LR_IS_TENSOR: tl.constexpr, HAS_FLAG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """p[c] -= lr * sum_i w[i] J[i, col0 + c] for c < count; p is one contiguous parameter.

    The rows are walked BLOCK_M at a time, so the register tile stays BLOCK_M x BLOCK_N for any m.
    With HAS_FLAG every load and store is masked by flag != 0 (the finiteness of the Gram): the
    no-write guard of gram_step happens on the device, without a host synchronisation.
    """
    pid = tl.program_id(0)
    cols = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < count
    if HAS_FLAG:
        col_ok = col_ok & (tl.load(flag_ptr) != 0)
    direction = tl.zeros([BLOCK_N], dtype=tl.float32)
    for row0 in range(0, M, BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        w = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(j_ptr + rows.to(tl.int64)[:, None] * stride_m + (col0 + cols)[None, :], mask=ok, other=0.0)
        direction += tl.sum(x.to(tl.float32) * w[:, None], axis=0)
    if LR_IS_TENSOR:
        lr = tl.load(lr_ptr).to(tl.float32)
    else:
        lr = lr_value
    param = tl.load(p_ptr + cols, mask=col_ok, other=0.0)
    tl.store(p_ptr + cols, (param.to(tl.float32) - lr * direction).to(param.dtype), mask=col_ok)
