"""Every path of the CUDA kernels (csrc/cuda) against the pure-torch reference.

The kernels pick a code path from the shapes and the memory layout, so these cases are chosen to
take each one:

* gram pass, m <= 8: register accumulators for M = 2, 3, 4, 8 rows (m = 1..8), 16-byte loads with a
  scalar head (J's first column not 16-byte aligned) and a scalar tail (n not a multiple of the
  vector width), and the all-scalar path (a row stride that is not a multiple of 16 bytes);
* gram pass, m > 8: shared-memory tiles with cp.async (aligned rows) or plain loads (misaligned),
  one or several groups of 8 register tiles (m = 9 .. 70; 8 x 8 tiles, 4 x 4 for float64), row
  blocks that run past m, n = 0 and n smaller than one column chunk;
* update pass: a ResNet-like list of 62 parameters in one launch, 150 parameters in two launches,
  parameters whose columns of J are not 16-byte aligned relative to the parameter (scalar path),
  empty and non-contiguous parameters;
* gram_step: w, z, mu in other dtypes (read and written by the kernels in their own dtype), the
  no-write guard on both gram paths, identical results run to run (no float atomics);
* dual ops: the one-block kernel (B*m <= 16384, m <= 512) and the multi-block path, strided and
  low-precision eta / w.

Skipped without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from drmoo_kernels import reference
from drmoo_kernels.backends import cuda as cuda_backend
from drmoo_kernels.divergences import Divergence

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
MATH_TOL = {torch.float32: (2e-5, 2e-6), torch.bfloat16: (2e-5, 2e-6), torch.float16: (2e-5, 2e-6),
            torch.float64: (1e-11, 1e-13)}
STORE_TOL = {torch.float32: (2e-5, 2e-6), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 1e-3),
             torch.float64: (1e-11, 1e-13)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(actual: Tensor, expected: Tensor, tol: tuple[float, float]) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=tol[0], atol=tol[1], equal_nan=True)


def _gram_tol(dtype: torch.dtype, gram: Tensor) -> tuple[float, float]:
    """Sums over n terms in another order: |error| <= n * eps * max_i G_ii, about sqrt(n) * eps *
    max_i G_ii for random data; the absolute part is relative to the diagonal's scale."""
    scale = float(gram.diagonal().abs().max().clamp(min=1.0)) if gram.numel() else 1.0
    return (1e-11, 1e-12 * scale) if dtype == torch.float64 else (1e-4, 1e-4 * scale)


def _jacobian(tasks: int, n: int, dtype: torch.dtype, seed: int, layout: str = "contiguous") -> Tensor:
    """J [tasks, n] on the GPU:
    contiguous;
    offset:     starting 3 columns into a wider tensor (rows 16-byte aligned relative to each other,
                the first column not);
    odd_stride: a row stride of n + 1 elements (rows not 16-byte aligned: element-wise paths);
    padded:     aligned rows padded to a multiple of 8 elements, so that n need not be a multiple
                of the vector width (16-byte copies that read only part of their 16 bytes)."""
    gen = _gen(seed)
    if layout == "contiguous":
        return torch.randn(tasks, n, generator=gen).to(dtype).to(DEVICE)
    if layout == "offset":
        wide = torch.randn(tasks, n + 8 + 3, generator=gen).to(dtype).to(DEVICE)
        return wide[:, 3 : 3 + n]
    width = n + 1 if layout == "odd_stride" else 8 * (n // 8 + 1)
    assert layout in ("odd_stride", "padded")
    return torch.randn(tasks, width, generator=gen).to(dtype).to(DEVICE)[:, :n]


LAYOUTS = ["contiguous", "offset", "odd_stride", "padded"]
GRAM_TASKS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 40, 41, 70]
GRAM_COLUMNS = [0, 1, 3, 7, 33, 1029, 40_003]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tasks", GRAM_TASKS)
def test_gram_every_path(dtype: torch.dtype, tasks: int) -> None:
    for n in GRAM_COLUMNS:
        for k, layout in enumerate(LAYOUTS):
            J = _jacobian(tasks, n, dtype, seed=100 * n + 10 * tasks + k, layout=layout)
            want = reference.gram(J)
            _close(cuda_backend.gram(J), want, _gram_tol(dtype, want))


def _parameter_split(n: int, pieces: int, seed: int) -> list[int]:
    """`pieces` numels summing to n with odd sizes (so that most parameters start at a column of J
    that is not 16-byte aligned), some empty."""
    gen = _gen(seed)
    cuts = torch.sort(torch.randint(0, n + 1, (pieces - 1,), generator=gen)).values.tolist()
    bounds = [0, *cuts, n]
    return [bounds[k + 1] - bounds[k] for k in range(pieces)]


def _params(sizes: list[int], dtype: torch.dtype, seed: int) -> list[Tensor]:
    """Parameters of the given numels; every fifth one of more than 4 elements is a transposed
    (non-contiguous) 2-D view."""
    gen = _gen(seed)
    out = []
    for k, size in enumerate(sizes):
        values = torch.randn(size, generator=gen).to(dtype).to(DEVICE)
        if k % 5 == 4 and size > 4 and size % 2 == 0:
            out.append(values.view(2, size // 2).t())
        else:
            out.append(values)
    return out


def _clone(params: list[Tensor]) -> list[Tensor]:
    return [p.clone() if p.is_contiguous() else p.t().clone().t() for p in params]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pieces", [1, 62, 150])
@pytest.mark.parametrize("tasks", [1, 3, 8, 9, 40])
def test_combine_parameter_tables(dtype: torch.dtype, pieces: int, tasks: int) -> None:
    n = 300_007
    J = _jacobian(tasks, n, dtype, seed=pieces + tasks)
    w = torch.softmax(torch.randn(tasks, generator=_gen(tasks)), 0).to(DEVICE)
    sizes = _parameter_split(n, pieces, seed=pieces)
    got = _params(sizes, dtype, seed=7)
    want = _clone(got)
    assert [p.is_contiguous() for p in got] == [p.is_contiguous() for p in want]
    for lr in (0.05, torch.tensor(0.3, dtype=torch.float64, device=DEVICE), torch.tensor(0.2, device=DEVICE)):
        cuda_backend.combine(J, w, got, lr)
        reference.combine(J, w, want, lr)
    for a, b in zip(got, want):
        _close(a, b, STORE_TOL[dtype])


def _step_inputs(tasks: int, seed: int, w_dtype: torch.dtype, z_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    gen = _gen(seed)
    w = torch.softmax(torch.randn(tasks, generator=gen), 0).to(w_dtype).to(DEVICE)
    z = (0.5 * torch.randn(tasks, generator=gen)).to(z_dtype).to(DEVICE)
    return w, z


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tasks", [1, 2, 3, 5, 8, 9, 17, 40, 70])
def test_gram_step_every_path(dtype: torch.dtype, tasks: int) -> None:
    for n, pieces in ((0, 1), (5, 3), (4099, 7), (200_003, 62)):
        for layout in LAYOUTS:
            J = _jacobian(tasks, n, dtype, seed=n + tasks, layout=layout)
            sizes = _parameter_split(n, pieces, seed=n)
            for w_dtype, z_dtype, mu in ((torch.float32, torch.float32, torch.tensor(0.8, device=DEVICE)),
                                         (torch.float64, torch.bfloat16, 0.3),
                                         (torch.bfloat16, torch.float64,
                                          torch.tensor([0.5], dtype=torch.float64, device=DEVICE))):
                w, z = _step_inputs(tasks, seed=n + 1, w_dtype=w_dtype, z_dtype=z_dtype)
                for c1, c2, beta in ((1.0, 0.05, 0.5), (0.3, 1e6, 1e-3)):
                    w_got, w_want = w.clone(), w.clone()
                    p_got = _params(sizes, dtype, seed=n + 2)
                    p_want = _clone(p_got)
                    got = cuda_backend.gram_step(J, w_got, p_got, 0.1, c1, c2, beta, 1e-3, mu, z)
                    want = reference.gram_step(J, w_want, p_want, 0.1, c1, c2, beta, 1e-3, mu, z)
                    _close(got[0], want[0], _gram_tol(dtype, want[0]))
                    # The m x m step inherits the Gram's float32 summation error (~1e-5 relative in the
                    # reference's own matmul at n = 200003), in w times beta * alpha * |G w| (~2 here);
                    # float64 Grams agree to ~1e-12.
                    loose = n > 10_000 and dtype != torch.float64
                    for a, b in zip(got[1:], want[1:]):
                        _close(a, b, (1e-4, 1e-6) if loose else (1e-5, 1e-6))
                    w_tol = (1e-4, 1e-4) if loose else (1e-5, 1e-6)
                    _close(w_got, w_want, STORE_TOL[torch.bfloat16] if w_dtype == torch.bfloat16 else w_tol)
                    for a, b in zip(p_got, p_want):
                        _close(a, b, STORE_TOL[dtype])


@pytest.mark.parametrize("tasks", [3, 40])
def test_gram_step_is_deterministic(tasks: int) -> None:
    n = 1_000_003
    J = _jacobian(tasks, n, torch.float32, seed=5)
    w, z = _step_inputs(tasks, seed=6, w_dtype=torch.float32, z_dtype=torch.float32)
    mu = torch.tensor(0.7, device=DEVICE)
    sizes = _parameter_split(n, 62, seed=8)
    runs = []
    for _ in range(3):
        w_run = w.clone()
        params = _params(sizes, torch.float32, seed=9)
        out = cuda_backend.gram_step(J, w_run, params, 0.1, 1.0, 0.05, 0.5, 1e-3, mu, z)
        runs.append([*out, w_run, *params])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("tasks", [3, 9, 40])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gram_step_guard_on_every_gram_path(tasks: int, layout: str) -> None:
    n = 70_001
    J = _jacobian(tasks, n, torch.float32, seed=11, layout=layout)
    J[tasks - 1, n - 2] = float("inf")
    w, z = _step_inputs(tasks, seed=12, w_dtype=torch.float32, z_dtype=torch.float32)
    params = _params(_parameter_split(n, 62, seed=13), torch.float32, seed=14)
    before = _clone(params)
    w_before = w.clone()
    gram, d_norm, alpha = cuda_backend.gram_step(J, w, params, 0.1, 1.0, 0.5, 0.3, 1e-3, 0.5, z)
    assert not bool(torch.isfinite(gram).all())
    assert bool(torch.isnan(d_norm)) and float(alpha) == 0.0
    assert torch.equal(w, w_before)
    for p, q in zip(params, before):
        assert torch.equal(p, q)


@pytest.mark.parametrize("extra", [24, 5])
def test_tile_gram_past_32_bit_offsets(extra: int) -> None:
    """m = 9 (the shared-memory tile path) with 9 * n > 2^31 bfloat16 elements: row r holds (r + 1) / 4
    everywhere but in its last column (r + 1), so the exact Gram is known and every partial sum is an
    exact float32 value; a wrapped 32-bit offset or a lost tail column changes it.  n = 2^28 + 24 has
    16-byte aligned rows (cp.async), n = 2^28 + 5 does not (element-wise loads)."""
    tasks, n = 9, (1 << 28) + extra
    values = torch.arange(1, tasks + 1, dtype=torch.float64) / 4
    J = torch.empty(tasks, n, dtype=torch.bfloat16, device=DEVICE)
    for r in range(tasks):
        J[r].fill_(float(values[r]))
        J[r, -1] = float(4 * values[r])
    assert J.numel() > 2**31
    last = 4 * values
    exact = (n - 1) * torch.outer(values, values) + torch.outer(last, last)
    torch.testing.assert_close(cuda_backend.gram(J).double().cpu(), exact, rtol=1e-7, atol=0.0)
    del J
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ dual ops
# (B, m): one block (B*m <= 16384 and m <= 512) or the multi-block path.
DUAL_SHAPES = [(1, 1), (256, 8), (2048, 8), (2049, 8), (33, 40), (4096, 40), (1, 512), (3, 513), (20_000, 1)]
DIVERGENCES = [Divergence("chi2"), Divergence("kl"), Divergence("cvar_smooth", 0.2), Divergence("cressie_read", 3.5)]


def _losses(batch: int, tasks: int, dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor]:
    gen = _gen(seed)
    losses = (2.0 * torch.rand(batch, tasks, generator=gen)).to(dtype).to(DEVICE)
    weight = (0.5 + torch.rand(batch, tasks, generator=gen)).to(dtype).to(DEVICE)
    return losses, weight


def _strided(values: Tensor) -> Tensor:
    """The same values as a stride-2 view."""
    holder = torch.zeros(2 * values.numel(), dtype=values.dtype, device=values.device)
    holder[::2] = values
    return holder[::2]


@pytest.mark.parametrize("divergence", DIVERGENCES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_dual_ops_every_path(divergence: Divergence, dtype: torch.dtype) -> None:
    for k, (batch, tasks) in enumerate(DUAL_SHAPES):
        losses, weight = _losses(batch, tasks, dtype, seed=k)
        eta = (0.5 * torch.rand(tasks, generator=_gen(k + 1)) - 0.1).to(DEVICE)
        w = torch.softmax(torch.randn(tasks, generator=_gen(k + 2)), 0).to(DEVICE)
        eta_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        for sample_weight in (None, weight):
            got = cuda_backend.dual_forward(losses, eta.to(eta_dtype), 0.6, 1.3, divergence, sample_weight)
            want = reference.dual_forward(losses, eta.to(eta_dtype), 0.6, 1.3, divergence, sample_weight)
            for a, b in zip(got, want):
                _close(a, b, MATH_TOL[dtype])
            for gamma, f1, f2 in ((0.1, 1.0, 0.05), (0.5, 0.3, 10.0)):
                eta_got, eta_want = eta.to(eta_dtype, copy=True), eta.to(eta_dtype, copy=True)
                got = cuda_backend.dual_step(losses, eta_got, w, 0.7, 1.3, divergence, gamma, f1, f2, sample_weight)
                want = reference.dual_step(losses, eta_want, w, 0.7, 1.3, divergence, gamma, f1, f2, sample_weight)
                for a, b in zip(got, want):
                    _close(a, b, MATH_TOL[dtype])
                _close(eta_got, eta_want, MATH_TOL[dtype])


@pytest.mark.parametrize(("batch", "tasks"), [(256, 8), (4096, 8)])
@pytest.mark.parametrize("eta_dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_dual_step_strided_low_precision_eta_and_w(batch: int, tasks: int, eta_dtype: torch.dtype) -> None:
    losses, _ = _losses(batch, tasks, torch.float32, seed=3)
    eta = (0.5 * torch.rand(tasks, generator=_gen(4)) - 0.1).to(eta_dtype).to(DEVICE)
    w = torch.softmax(torch.randn(tasks, generator=_gen(5)), 0).to(eta_dtype).to(DEVICE)
    eta_got, eta_want = _strided(eta), eta.clone()
    w_got = _strided(w)
    assert eta_got.stride(0) == 2 and w_got.stride(0) == 2
    got = cuda_backend.dual_step(losses, eta_got, w_got, 0.6, 1.0, Divergence("kl"), 0.2, 1.0, 0.5)
    want = reference.dual_step(losses, eta_want, w, 0.6, 1.0, Divergence("kl"), 0.2, 1.0, 0.5)
    store = STORE_TOL[eta_dtype] if eta_dtype != torch.float64 else MATH_TOL[torch.float32]
    _close(eta_got, eta_want, store)
    for a, b in zip(got, want):
        _close(a, b, (1e-2, 1e-4) if eta_dtype != torch.float64 else MATH_TOL[torch.float32])
    forward = cuda_backend.dual_forward(losses, _strided(eta_want), 0.6, 1.0, Divergence("kl"))
    for a, b in zip(forward, reference.dual_forward(losses, eta_want, 0.6, 1.0, Divergence("kl"))):
        _close(a, b, MATH_TOL[torch.float32])
