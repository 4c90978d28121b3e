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
def loop_bound_probe_kernel(out_ptr, n):
    """Self-check of the interpreter (``triton_kernels.interpreter_problem``): a loop with a runtime bound."""
    total = 0
    for _ in range(0, n):
        total += 1
    tl.store(out_ptr, total)


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
    """base ** exponent for base >= 0 and exponent > 0 (0 maps to 0 without evaluating log 0; NaN stays NaN)."""
    positive = base > 0.0
    safe = tl.where(positive, base, 1.0)
    return tl.where(positive, tl.exp2(exponent * tl.log2(safe)), base * 0.0)  # 0 at 0, NaN at NaN (base >= 0)


@triton.jit
def _conj_grad(u, CODE: tl.constexpr, P0, P1, P2, P3):
    """f*'(u) >= 0.  cvar: P2 = log(alpha/(1-alpha)), P3 = 1/alpha.  cressie: P0 = k-1, P1 = 1/(k-1)."""
    if CODE == 0:
        grad = 0.5 * tl.maximum(u + 2.0, 0.0, propagate_nan=tl.PropagateNan.ALL)
    elif CODE == 1:
        grad = tl.exp(u)
    elif CODE == 2:
        grad = tl.sigmoid(u + P2) * P3
    else:
        grad = _positive_pow(tl.maximum(P0 * u + 1.0, 0.0, propagate_nan=tl.PropagateNan.ALL), P1)
    return grad


@triton.jit
def _log1p(x):
    """log(1 + x) for x >= -1, accurate for tiny x (Kahan: the rounding of 1 + x is divided back out);
    -inf at x = -1."""
    y = 1.0 + x
    edge = (y == 1.0) | (y == 0.0) | (y == float("inf"))  # no log of 0, no inf / inf (NaN is none of them)
    log_y = tl.log(tl.where(edge, 1.0, y))
    denom = tl.where(edge, 1.0, y - 1.0)
    inner = tl.where(y == float("inf"), y, log_y * (x / denom))
    return tl.where(y == 1.0, x, tl.where(y == 0.0, -float("inf"), inner))


@triton.jit
def _conj_and_grad(u, CODE: tl.constexpr, P0, P1, P2, P3):
    """(f*(u), f*'(u)).  cvar: P0 = log(1-alpha), P1 = log(alpha), P3 = 1/alpha; cressie: P0 = k-1,
    P1 = 1/(k-1), P2 = 1/k.  f*(u) without cancellation near u = 0 (see divergences.py)."""
    if CODE == 0:
        plus = tl.maximum(u + 2.0, 0.0, propagate_nan=tl.PropagateNan.ALL)
        v = tl.maximum(u, -2.0, propagate_nan=tl.PropagateNan.ALL)
        conj = v * (1.0 + 0.25 * v)  # 0.25 (u + 2)^2 - 1
        grad = 0.5 * plus
    elif CODE == 1:
        conj = _expm1(u)
        grad = tl.exp(u)
    elif CODE == 2:
        # Near 0 (|u| <= divergences.CVAR_NEAR_U): log1p(alpha expm1(u)) / alpha; elsewhere log((1 - alpha) +
        # alpha e^u) as a log-sum-exp of log(1-alpha) and log(alpha) + u (NaN takes this branch).
        near = tl.abs(u) <= 1.0
        small = _log1p(_expm1(tl.where(near, u, 0.0)) / P3) * P3
        b = u + P1
        hi = tl.maximum(b, P0, propagate_nan=tl.PropagateNan.ALL)
        lo = tl.minimum(b, P0, propagate_nan=tl.PropagateNan.ALL)
        conj = tl.where(near, small, (hi + _log1p(tl.exp(lo - hi))) * P3)
        grad = tl.sigmoid(u + P2) * P3
    else:
        base = tl.maximum(P0 * u + 1.0, 0.0, propagate_nan=tl.PropagateNan.ALL)
        grad = _positive_pow(base, P1)
        # expm1(k/(k-1) log1p((k-1) u)) / k, k/(k-1) = 1 + 1/(k-1); (k-1) u <= -1 gives -inf, then -1/k.
        x = tl.maximum(P0 * u, -1.0, propagate_nan=tl.PropagateNan.ALL)
        conj = _expm1((1.0 + P1) * _log1p(x)) * P2
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


# ------------------------------------------------------------------------------------ Jacobian ops
# Multi-tensor launches: J may come as several blocks and the parameters as many tensors, yet each
# op is one launch.  The host builds an "entry table" (int64, 4 per entry, one entry per program;
# see ``_MultiTensorPlan`` in the backend): each entry names a run of at most ``chunk`` columns that
# lies in one block of J (and, for combine, in one parameter), as element offsets from a base
# pointer (the first tensor of the launch) - so one kernel reaches every tensor, and the number of
# launches does not depend on how many tensors there are.  ALIGN_* (1, or the elements in 16 bytes)
# says that every offset and row stride in the table is a multiple of it: the host checked, and
# the hint lets the compiler vectorise the loads.


@triton.jit
def _gram_columns(
    acc, base_a, base_b, ok_a, ok_b, offset, count,
    MASK_COLS: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr, ONE_TILE: tl.constexpr,
):
    """acc + the products of the two row tiles over columns [offset, offset + BLOCK_N).

    Without MASK_COLS every column is in range: the masks are then constant along the columns,
    which is what lets the compiler turn the loads into 16-byte vector loads.
    """
    cols = offset + tl.arange(0, BLOCK_N)
    if MASK_COLS:
        col_ok = cols < count
    else:
        col_ok = tl.full([BLOCK_N], True, tl.int1)
    xa = tl.load(base_a + cols[None, :], mask=ok_a[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    if ONE_TILE:
        xb = xa
    else:
        xb = tl.load(base_b + cols[None, :], mask=ok_b[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    if USE_DOT:
        acc += tl.dot(xa, tl.trans(xb), input_precision="ieee")
    else:
        acc += tl.sum(xa[:, None, :] * xb[None, :, :], axis=2)
    return acc


@triton.jit
def gram_partial_kernel(
    j_ptr, table_ptr, part_ptr, M,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr, ONE_TILE: tl.constexpr,
    ALIGN_J: tl.constexpr,
):
    """Split reduction of J J^T over a grid (table entries, row tiles, row tiles).

    Entry p = (offset of J[0, c0] from j_ptr, row stride, columns, unused).  Program (p, a, b) sums
    the products of row tile a with row tile b over the entry's columns into part[p, a rows, b rows]
    (part is [entries, M, M]): whole BLOCK_N-column tiles first, then the ragged tail.  Row tiles of
    at most 64 rows keep the BLOCK_M x BLOCK_M accumulator in registers for any m (a single 128-wide
    or wider accumulator spills); with ONE_TILE (m <= BLOCK_M) both operands are the same tile,
    loaded once.  Small task counts use a broadcast product (a dot needs 16-wide operands on GPUs,
    mostly padding for m <= 8); larger ones use an IEEE-precision dot so fp32 inputs are not
    rounded to tf32.
    """
    pid = tl.program_id(0)
    entry = table_ptr + pid.to(tl.int64) * 4
    start = tl.load(entry)
    stride = tl.load(entry + 1)
    count = tl.load(entry + 2)
    if ALIGN_J > 1:
        start = tl.multiple_of(start, ALIGN_J)
        stride = tl.multiple_of(stride, ALIGN_J)
    rows_a = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_b = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok_a = rows_a < M
    ok_b = rows_b < M
    base_a = j_ptr + start + rows_a.to(tl.int64)[:, None] * stride
    base_b = j_ptr + start + rows_b.to(tl.int64)[:, None] * stride
    acc = tl.zeros([BLOCK_M, BLOCK_M], dtype=tl.float32)
    whole = count - count % BLOCK_N
    for offset in range(0, whole, BLOCK_N):
        acc = _gram_columns(acc, base_a, base_b, ok_a, ok_b, offset, count, False, BLOCK_N, USE_DOT, ONE_TILE)
    if whole < count:
        acc = _gram_columns(acc, base_a, base_b, ok_a, ok_b, whole, count, True, BLOCK_N, USE_DOT, ONE_TILE)
    out = part_ptr + pid.to(tl.int64) * M * M + rows_a[:, None] * M + rows_b[None, :]
    tl.store(out, acc, mask=ok_a[:, None] & ok_b[None, :])


@triton.jit
def _combine_columns(
    j_base, p_base, w_ptr, stride, M, lr, offset, count, allowed,
    HAS_FLAG: tl.constexpr, MASK_COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """p[c] -= lr * sum_i w[i] J[i, c] for the columns [offset, offset + BLOCK_N) of one entry."""
    cols = offset + tl.arange(0, BLOCK_N)
    if MASK_COLS:
        col_ok = cols < count
    else:  # constant along the columns: vector loads (see _gram_columns)
        col_ok = tl.full([BLOCK_N], True, tl.int1)
    if HAS_FLAG:
        col_ok = col_ok & allowed
    direction = tl.zeros([BLOCK_N], dtype=tl.float32)
    for row0 in range(0, M, BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        w = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(j_base + rows.to(tl.int64)[:, None] * stride + cols[None, :], mask=ok, other=0.0)
        direction += tl.sum(x.to(tl.float32) * w[:, None], axis=0)
    param = tl.load(p_base + cols, mask=col_ok, other=0.0)
    tl.store(p_base + cols, (param.to(tl.float32) - lr * direction).to(param.dtype), mask=col_ok)


@triton.jit
def combine_kernel(
    j_ptr, p_ptr, table_ptr, w_ptr, lr_ptr, flag_ptr, M, lr_value,
    LR_IS_TENSOR: tl.constexpr, HAS_FLAG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ALIGN_J: tl.constexpr, ALIGN_P: tl.constexpr,
):
    """p[c] -= lr * sum_i w[i] J[i, c] over one table entry's columns (one program per entry).

    Entry = (offset of J[0, c0] from j_ptr, J's row stride, offset of the parameter element that
    column c0 updates from p_ptr, columns).  The rows are walked BLOCK_M at a time, so the register
    tile stays BLOCK_M x BLOCK_N for any m.  With HAS_FLAG every load and store is masked by
    flag != 0 (the finiteness of the Gram): the no-write guard of gram_step happens on the device,
    without a host synchronisation.
    """
    pid = tl.program_id(0)
    entry = table_ptr + pid.to(tl.int64) * 4
    j_start = tl.load(entry)
    stride = tl.load(entry + 1)
    p_start = tl.load(entry + 2)
    count = tl.load(entry + 3)
    if ALIGN_J > 1:
        j_start = tl.multiple_of(j_start, ALIGN_J)
        stride = tl.multiple_of(stride, ALIGN_J)
    if ALIGN_P > 1:
        p_start = tl.multiple_of(p_start, ALIGN_P)
    if HAS_FLAG:
        allowed = tl.load(flag_ptr) != 0
    else:
        allowed = 1
    if LR_IS_TENSOR:
        lr = tl.load(lr_ptr).to(tl.float32)
    else:
        lr = lr_value
    j_base = j_ptr + j_start
    p_base = p_ptr + p_start
    whole = count - count % BLOCK_N
    for offset in range(0, whole, BLOCK_N):
        _combine_columns(j_base, p_base, w_ptr, stride, M, lr, offset, count, allowed,
                         HAS_FLAG, False, BLOCK_M, BLOCK_N)
    if whole < count:
        _combine_columns(j_base, p_base, w_ptr, stride, M, lr, whole, count, allowed,
                         HAS_FLAG, True, BLOCK_M, BLOCK_N)


@triton.jit
def _split_double(hi, lo):
    """A double passed as two float32 scalars (hi + lo: ~48 significant bits; launches pass floats as fp32)."""
    return tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64)


@triton.jit
def gram_finalize_kernel(
    part_ptr, parts, gram_ptr, w_ptr, w_prev_ptr, z_ptr, mu_ptr, out_ptr, flag_ptr, M,
    gamma_hi, gamma_lo, c1_hi, c1_lo, c2_hi, c2_lo, beta_hi, beta_lo, rho_hi, rho_lo, mu_hi, mu_lo,
    MU_IS_TENSOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """gram_step's m x m part (reference.gram_step_small) in one program, for m <= BLOCK_M <= 64.

    The Gram is the float32 sum of the ``parts`` partials [parts, M, M] (stored to gram_ptr); then,
    in float64: finite = all(isfinite(G)); d = sqrt(w^T G w); alpha = min(c1, c2 / d) (c1 at d = 0,
    0 when not finite); w <- Pi(w - beta (alpha G w + mu z^2 w + rho w)) written in place (kept when
    not finite), the incoming w saved to w_prev (float32: what the combine pass must use).
    out = (d as reported: NaN when not finite, alpha, gamma alpha) in float32; flag = finite.

    The simplex projection Pi is the sort-based one of the reference without the sort: for each j,
    S_j and K_j are the sum and the count of the entries >= u_j; the largest K_j with
    K_j u_j - S_j + 1 > 0 is the reference's support size (ties share one value of that test).
    """
    rows = tl.arange(0, BLOCK_M)
    ok_r = rows < M
    ok = ok_r[:, None] & ok_r[None, :]
    offsets = rows[:, None] * M + rows[None, :]
    # BLOCK_P partials per step, so that the loop is a few wide loads rather than one per partial.
    acc = tl.zeros([BLOCK_P, BLOCK_M, BLOCK_M], dtype=tl.float32)
    for p0 in range(0, parts, BLOCK_P):
        which = p0 + tl.arange(0, BLOCK_P)
        ptrs = part_ptr + which.to(tl.int64)[:, None, None] * M * M + offsets[None, :, :]
        acc += tl.load(ptrs, mask=(which < parts)[:, None, None] & ok[None, :, :], other=0.0)
    g = tl.sum(acc, axis=0)
    tl.store(gram_ptr + offsets, g, mask=ok)
    # |x| <= FLT_MAX is false for inf and for NaN.
    bad = tl.sum(tl.where(ok & ~(tl.abs(g) <= 3.4028234663852886e38), 1, 0), axis=1)
    finite = tl.sum(bad, axis=0) == 0
    safe = tl.where(finite & ok, g, 0.0).to(tl.float64)
    w_in = tl.load(w_ptr + rows, mask=ok_r, other=0.0)
    tl.store(w_prev_ptr + rows, w_in.to(tl.float32), mask=ok_r)
    w = w_in.to(tl.float64)
    gw = tl.sum(safe * w[None, :], axis=1)
    d = tl.sqrt(tl.maximum(tl.sum(w * gw, axis=0), 0.0, propagate_nan=tl.PropagateNan.ALL))
    c1 = _split_double(c1_hi, c1_lo)
    c2 = _split_double(c2_hi, c2_lo)
    clip = tl.where(d > 0.0, tl.minimum(c2 / tl.where(d > 0.0, d, 1.0), c1), c1)
    alpha = tl.where(finite, clip, 0.0)
    if MU_IS_TENSOR:
        mu = tl.load(mu_ptr).to(tl.float64)
    else:
        mu = _split_double(mu_hi, mu_lo)
    z = tl.load(z_ptr + rows, mask=ok_r, other=0.0).to(tl.float64)
    rho = _split_double(rho_hi, rho_lo)
    pref_grad = alpha * gw + mu * (z * z) * w + rho * w
    v = tl.where(ok_r, w - _split_double(beta_hi, beta_lo) * pref_grad, -1.0e300)
    u = v - tl.max(v, axis=0)
    at_least = (u[:, None] >= u[None, :]) & ok_r[:, None]  # [i, j]: u_i counts towards j
    sums = tl.sum(tl.where(at_least, u[:, None], 0.0), axis=0)
    counts = tl.sum(tl.where(at_least, 1.0, 0.0).to(tl.float64), axis=0)
    support = (counts * u - sums + 1.0 > 0.0) & ok_r
    size = tl.max(tl.where(support, counts, 0.0), axis=0)
    total = tl.max(tl.where(support & (counts == size), sums, -1.0e300), axis=0)
    size = tl.maximum(size, 1.0)
    projected = tl.maximum(u - (total - 1.0) / size, 0.0, propagate_nan=tl.PropagateNan.ALL)
    w_next = tl.where(finite, projected, w)
    if w_ptr.dtype.element_ty == tl.float64:
        tl.store(w_ptr + rows, w_next, mask=ok_r)
    else:  # torch rounds float64 to 16-bit floats through float32, too
        tl.store(w_ptr + rows, w_next.to(tl.float32).to(w_ptr.dtype.element_ty), mask=ok_r)
    tl.store(out_ptr, tl.where(finite, d, float("nan")).to(tl.float32))
    tl.store(out_ptr + 1, alpha.to(tl.float32))
    tl.store(out_ptr + 2, (_split_double(gamma_hi, gamma_lo) * alpha).to(tl.float32))
    tl.store(flag_ptr, finite.to(tl.int32))
