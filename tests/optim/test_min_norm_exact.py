"""The exact min-norm solver against an exhaustive enumeration of the faces of the simplex, in exact
rational arithmetic, over Gram matrices whose task gradient norms differ by up to ~1e8.

The instances are built so that float64 holds them exactly: G = diag(2^e) A with small integer A,
so every entry of K = G G^T is an integer times a power of two, computed without rounding.  The
reference then solves the problem posed by *that* K exactly (fractions.Fraction): for every
nonempty support S, the equality-constrained problem min w^T K w s.t. sum w = 1, w = 0 off S
(one KKT system), keeping the solutions that satisfy all the KKT conditions of the simplex problem
(w >= 0, (K w)_j >= w^T K w for every j).  The minimizer lies in the relative interior of the face
spanned by an affinely independent subset of the gradients (Caratheodory), whose KKT system is
nonsingular, so the enumeration always finds it; every KKT point of this convex problem is optimal.

Tolerances, from the conditioning of the problem.  Write d_i = ||g_i||, p = G^T w the combined
gradient, f = ||p||^2 = w^T K w.  Rounding a minimizer w* to float64 (relative error eps = 2^-53
per entry) moves p by at most eps * sum_i w*_i d_i; since w* is a minimizer, the first-order change
of f along the simplex is >= 0, so the rounded minimizer's excess is at most
(eps * sum_i w*_i d_i)^2 -- the floor that no float64 answer can beat.  A backward-stable solve of
the scaled face system (mgda.py; condition number kappa, set by the angles between the gradients,
not by their norms) loses a factor c kappa on that: excess <= (c kappa eps sum_i w_i d_i)^2.  For
f* > 0 that is a relative excess of (c kappa eps)^2 (sum_i w_i d_i)^2 / f*, negligible unless
the gradients cancel almost exactly.  The tests therefore assert

    f(w) - f*  <=  1e-12 * f*  +  (1e4 * eps * sum_i w_i d_i)^2,

w the solver's answer (when the minimizer is not unique, the floor of the one it returned).  The
second term only matters when f* is within ~1e-24 of (sum_i w_i d_i)^2, e.g. f* = 0 when the
origin is in the hull; c kappa <= 1e4 has room to spare (measured: <= 81 over thousands of
instances, <= 1 for m = 2).  The old solver (1e-12 ridge, absolute tie tolerance) failed this on
more than half of the instances, with relative excesses up to ~1e3 and weights off by 0.5.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from drmoo.optim.mgda import _min_norm_by_active_set, _min_norm_by_faces, min_norm_weights, min_norm_weights_on_host

EPS = 2.0**-53
RELATIVE_EXCESS = 1e-12
ROUNDING_FLOOR_FACTOR = 1e4

Matrix = list[list[Fraction]]


# ------------------------------------------------------------------------------ the exact reference
def _solve_exact(system: Matrix, rhs: list[Fraction]) -> list[Fraction] | None:
    """Gaussian elimination over the rationals; None for a singular system."""
    size = len(rhs)
    rows = [row[:] + [value] for row, value in zip(system, rhs, strict=True)]
    for col in range(size):
        pivot = next((r for r in range(col, size) if rows[r][col] != 0), None)
        if pivot is None:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(size):
            if r != col and rows[r][col] != 0:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col], strict=True)]
    return [rows[i][size] / rows[i][i] for i in range(size)]


def exact_min_norm(K: Matrix) -> tuple[Fraction, list[list[Fraction]]]:
    """(f*, every optimal w that is a KKT point of some face), by enumerating the 2^m - 1 faces."""
    m = len(K)
    optimal: list[tuple[Fraction, list[Fraction]]] = []
    for mask in range(1, 2**m):
        support = [i for i in range(m) if mask >> i & 1]
        size = len(support)
        system = [[K[i][j] for j in support] + [Fraction(1)] for i in support] + [[Fraction(1)] * size + [Fraction(0)]]
        solution = _solve_exact(system, [Fraction(0)] * size + [Fraction(1)])
        if solution is None or any(value < 0 for value in solution[:size]):
            continue
        w = [Fraction(0)] * m
        for i, value in zip(support, solution[:size], strict=True):
            w[i] = value
        Kw = [sum((K[j][i] * w[i] for i in support), Fraction(0)) for j in range(m)]
        value = sum((w[j] * Kw[j] for j in range(m)), Fraction(0))
        if all(Kw[j] >= value for j in range(m)):
            optimal.append((value, w))
    assert optimal, "the enumeration must find the minimizer"
    best = min(value for value, _ in optimal)
    assert all(value == best for value, _ in optimal), "every KKT point of a convex problem is optimal"
    return best, [w for _, w in optimal]


def exact_value(K: Matrix, w: Tensor) -> Fraction:
    """w^T K w in exact arithmetic, for w rescaled exactly onto the simplex (its float sum is ~1)."""
    weights = [Fraction(float(x)) for x in w.tolist()]
    total = sum(weights, Fraction(0))
    weights = [x / total for x in weights]
    m = len(K)
    return sum((weights[i] * K[i][j] * weights[j] for i in range(m) for j in range(m)), Fraction(0))


# ------------------------------------------------------------------------------ the instances
@st.composite
def exact_grams(draw: st.DrawFn, min_tasks: int = 2, max_tasks: int = 5) -> tuple[Tensor, Matrix]:
    """K = G G^T with G = 2^E diag(2^e) A, A small integers; every entry exact in float64.

    e_i in [-26, 0] spreads the task gradient norms over ~1e8 (2^26 = 6.7e7, times the ratio of
    the integer rows' own norms); E in [-40, 40] moves the whole problem across 24 decades (the
    solver must be scale invariant).  Optionally the joint (theta, eta) structure of the DR dual
    (G = [J | diag(z)]) and duplicated tasks (ties) are drawn.
    """
    m = draw(st.integers(min_tasks, max_tasks))
    n = draw(st.integers(1, 6))
    entry = st.integers(-64, 64)
    A = [[draw(entry) for _ in range(n)] for _ in range(m)]
    if draw(st.booleans()):  # the joint structure: one private coordinate per task (z_i e_i)
        z = [draw(entry) for _ in range(m)]
        A = [row + [z[i] if j == i else 0 for j in range(m)] for i, row in enumerate(A)]
    exponents = [draw(st.integers(-26, 0)) for _ in range(m)]
    if draw(st.booleans()) and m >= 3:  # a duplicated task (an exact tie)
        A[-1], exponents[-1] = A[0][:], exponents[0]
    overall = draw(st.integers(-40, 40))
    exact = [
        [sum((Fraction(a) * b for a, b in zip(A[i], A[j], strict=True)), Fraction(0)) * Fraction(2) ** (
            exponents[i] + exponents[j] + 2 * overall) for j in range(m)] for i in range(m)
    ]
    G = torch.tensor(A, dtype=torch.float64) * torch.tensor([2.0 ** (e + overall) for e in exponents],
                                                            dtype=torch.float64)[:, None]
    K = G @ G.T
    assert [[Fraction(x) for x in row] for row in K.tolist()] == exact, "the instance must be exact in float64"
    return K, exact


def assert_exact(K: Tensor, exact: Matrix, w: Tensor) -> None:
    m = K.shape[0]
    assert w.shape == (m,) and w.dtype == torch.float64
    assert bool(torch.isfinite(w).all()) and float(w.min()) >= 0.0
    assert abs(float(w.sum()) - 1.0) <= 4 * m * EPS
    best, optima = exact_min_norm(exact)
    value = exact_value(exact, w)
    norms = [math.sqrt(float(exact[i][i])) for i in range(m)]
    spread = sum(x * d for x, d in zip(w.tolist(), norms, strict=True))  # sum_i w_i d_i >= ||p||
    floor = (ROUNDING_FLOOR_FACTOR * EPS * spread) ** 2
    excess = value - best
    assert excess >= 0, "nothing on the simplex beats the exact minimum"
    allowed = RELATIVE_EXCESS * best + Fraction(floor)
    assert excess <= allowed, (
        f"excess {float(excess):.3e} over f* = {float(best):.3e} "
        f"(relative {float(excess / best) if best else math.inf:.3e}); allowed {float(allowed):.3e}"
    )
    unique = all(opt == optima[0] for opt in optima)
    if unique:
        # A unique minimizer's weights: their error is kappa * eps (kappa of the scaled optimal face,
        # bounded for these small-integer instances); measured <= 5e-15, the old solver was off by
        # up to 0.5.  1e-10 leaves kappa up to ~1e5.
        reference = torch.tensor([float(x) for x in optima[0]], dtype=torch.float64)
        assert float((w - reference).abs().max()) <= 1e-10, (w.tolist(), reference.tolist())


# ------------------------------------------------------------------------------ the tests
SOLVERS = {
    "public": lambda K, start: min_norm_weights(K, start),
    "faces": lambda K, start: _min_norm_by_faces(K, start),
    # m <= 5 needs far fewer than the default 500 active-set steps (measured: <= 10); 64 keeps it fast
    "active_set": lambda K, start: _min_norm_by_active_set(K, start, max_iter=64),
    # the eager step's: the same walk in numpy on the host, stopped once exact
    "active_set_on_host": lambda K, start: torch.from_numpy(min_norm_weights_on_host(K.numpy(), start.numpy())),
}


@pytest.mark.parametrize("solver", sorted(SOLVERS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instance=exact_grams(), start_seed=st.integers(0, 2**16))
def test_min_norm_matches_the_exhaustive_enumeration(solver: str, instance: tuple[Tensor, Matrix],
                                                     start_seed: int) -> None:
    K, exact = instance
    m = K.shape[0]
    assume(solver == "public" or m >= 3)
    gen = torch.Generator().manual_seed(start_seed)
    start = torch.rand(m, generator=gen, dtype=torch.float64) if start_seed % 2 else torch.ones(m, dtype=torch.float64)
    assert_exact(K, exact, SOLVERS[solver](K, start / start.sum()))


def exact_gram(A: list[list[int]], exponents: list[int]) -> tuple[Tensor, Matrix]:
    """K = G G^T, G = diag(2^e) A, in float64 (exact) and in rationals."""
    m = len(A)
    exact = [[sum((Fraction(a) * b for a, b in zip(A[i], A[j], strict=True)), Fraction(0))
              * Fraction(2) ** (exponents[i] + exponents[j]) for j in range(m)] for i in range(m)]
    G = torch.tensor(A, dtype=torch.float64) * torch.tensor([2.0**e for e in exponents], dtype=torch.float64)[:, None]
    K = G @ G.T
    assert [[Fraction(x) for x in row] for row in K.tolist()] == exact
    return K, exact


def certified_minimum(K: Matrix, support: list[int]) -> Fraction:
    """f* from an exact KKT certificate on one face: the exact minimizer of that face must be
    feasible and satisfy every KKT condition (then it is the global minimizer of this convex
    problem).  For m too large to enumerate the faces."""
    m, size = len(K), len(support)
    system = [[K[i][j] for j in support] + [Fraction(1)] for i in support] + [[Fraction(1)] * size + [Fraction(0)]]
    solution = _solve_exact(system, [Fraction(0)] * size + [Fraction(1)])
    assert solution is not None, "the solver's face must be affinely independent"
    assert all(value >= 0 for value in solution[:size]), "the face's minimizer must be on the simplex"
    w = [Fraction(0)] * m
    for i, value in zip(support, solution[:size], strict=True):
        w[i] = value
    Kw = [sum((K[j][i] * w[i] for i in support), Fraction(0)) for j in range(m)]
    value = sum((w[j] * Kw[j] for j in range(m)), Fraction(0))
    assert all(Kw[j] >= value for j in range(m)), "the face's minimizer must satisfy the KKT conditions"
    return value


@pytest.mark.parametrize("m, n, joint", [(11, 4, False), (16, 40, False), (24, 6, True), (40, 12, False),
                                         (40, 60, True)])
def test_active_set_is_exact_for_many_tasks(m: int, n: int, joint: bool) -> None:
    """m > 10 (the active-set path, CelebA has m = 40): the default min_norm_weights against an
    exact certificate, gradient norms spread over ~1e8, and the whole problem scaled by 2^+-30."""
    gen = torch.Generator().manual_seed(1000 * m + n)
    for overall in (-30, 0, 30):
        A = torch.randint(-64, 65, (m, n), generator=gen).tolist()
        if joint:  # the DR dual's joint Gram: G = [J | diag(z)]
            z = torch.randint(-64, 65, (m,), generator=gen).tolist()
            A = [row + [z[i] if j == i else 0 for j in range(m)] for i, row in enumerate(A)]
        exponents = [overall + int(e) for e in torch.randint(-26, 1, (m,), generator=gen)]
        K, exact = exact_gram(A, exponents)
        w = min_norm_weights(K, torch.full((m,), 1.0 / m, dtype=torch.float64))
        assert bool(torch.isfinite(w).all()) and float(w.min()) >= 0.0
        best = certified_minimum(exact, [i for i in range(m) if float(w[i]) > 0])
        value = exact_value(exact, w)
        norms = [math.sqrt(float(exact[i][i])) for i in range(m)]
        spread = sum(x * d for x, d in zip(w.tolist(), norms, strict=True))
        excess = value - best
        assert 0 <= excess <= RELATIVE_EXCESS * best + Fraction((ROUNDING_FLOOR_FACTOR * EPS * spread) ** 2), (
            float(excess / best) if best else float(excess))


@pytest.mark.parametrize("m", [3, 5, 12])
def test_a_zero_gradient_is_the_minimizer(m: int) -> None:
    """A task whose gradient is exactly zero: w = e_i, value 0 (the scaled form divides by d_i)."""
    gen = torch.Generator().manual_seed(m)
    G = torch.randn(m, 7, generator=gen, dtype=torch.float64)
    G[m - 2] = 0.0
    K = G @ G.T
    start = torch.full((m,), 1.0 / m, dtype=torch.float64)
    expected = torch.zeros(m, dtype=torch.float64)
    expected[m - 2] = 1.0
    assert torch.equal(min_norm_weights(K, start), expected)
    assert torch.equal(_min_norm_by_faces(K, start), expected)
    assert torch.equal(_min_norm_by_active_set(K, start), expected)


def test_ties_go_to_the_optimum_nearest_the_start() -> None:
    """g1 = g2: w = (t, 0.5 - t, 0.5) is optimal for every t in [0, 0.5]; the faces path returns
    the optimal vertex nearest the start (the warm start of MGDA), the active set a feasible one."""
    G = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64) * 1e-5
    K = G @ G.T
    to_second = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    to_first = torch.tensor([0.6, 0.1, 0.3], dtype=torch.float64)
    assert torch.allclose(_min_norm_by_faces(K, to_second), torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64))
    assert torch.allclose(_min_norm_by_faces(K, to_first), torch.tensor([0.5, 0.0, 0.5], dtype=torch.float64))
    w = _min_norm_by_active_set(K, to_second)
    assert float(w[0] + w[1]) == pytest.approx(0.5, abs=1e-15) and float(w[2]) == pytest.approx(0.5, abs=1e-15)


def test_the_active_set_stopped_early_is_still_feasible() -> None:
    """Cut at any step count, the active set returns a point of the simplex whose value never
    increases with more steps (every step is a descent step), and it stops moving once exact."""
    gen = torch.Generator().manual_seed(40)
    scales = 10 ** torch.empty(40, 1, dtype=torch.float64).uniform_(-4, 4, generator=gen)
    G = torch.randn(40, 12, generator=gen, dtype=torch.float64) * scales
    K = G @ G.T
    start = torch.full((40,), 1.0 / 40, dtype=torch.float64)
    values = []
    for steps in (1, 2, 5, 10, 20, 40, 80, 160):
        w = _min_norm_by_active_set(K, start, max_iter=steps)
        assert float(w.min()) >= 0.0 and float(w.sum()) == pytest.approx(1.0, abs=1e-14)
        values.append(float(w @ K @ w))
    assert all(later <= earlier + 1e-12 * values[0] for earlier, later in itertools.pairwise(values))
    assert torch.equal(_min_norm_by_active_set(K, start, max_iter=160), _min_norm_by_active_set(K, start, max_iter=500))


class _NoHostReads(TorchDispatchMode):
    """Fail on every operator that reads a tensor's value on the host (a device sync on a GPU)."""

    READS = frozenset({torch.ops.aten._local_scalar_dense, torch.ops.aten.item, torch.ops.aten.is_nonzero,
                       torch.ops.aten.nonzero, torch.ops.aten.masked_select, torch.ops.aten.equal})

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        assert func.overloadpacket not in self.READS, f"{func} reads a tensor's value on the host"
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("m", [2, 3, 10, 11, 40])
def test_no_host_reads_on_any_path(m: int) -> None:
    """Closed form, faces and active set: no .item()/bool()/nonzero, so no sync and capturable."""
    G = torch.randn(m, 9, generator=torch.Generator().manual_seed(m), dtype=torch.float64)
    start = torch.full((m,), 1.0 / m, dtype=torch.float64)
    with _NoHostReads():
        w = min_norm_weights(G @ G.T, start, max_iter=8)
    assert w.shape == (m,)


@pytest.mark.parametrize("m, n", [(11, 3), (24, 50), (40, 12)])
def test_early_exit_returns_exactly_the_fixed_count_answer(m: int, n: int) -> None:
    """Eagerly the active set stops once exact (host reads allowed); the iterate is frozen from
    then on, so the answer is bit-for-bit that of all ``max_iter`` steps."""
    gen = torch.Generator().manual_seed(7 * m + n)
    scales = 10 ** torch.empty(m, 1, dtype=torch.float64).uniform_(-4, 4, generator=gen)
    G = torch.randn(m, n, generator=gen, dtype=torch.float64) * scales
    K = G @ G.T
    start = torch.full((m,), 1.0 / m, dtype=torch.float64)
    assert torch.equal(min_norm_weights(K, start, early_exit=True), min_norm_weights(K, start))
    # The host's walk (an eager MGDA step's): the same iterates up to the rounding of another LAPACK's solves,
    # each backward stable on O(1)-entry scaled systems: weights agree to ~kappa * eps; 1e-9 leaves kappa ~1e6.
    on_host = min_norm_weights_on_host(K.numpy(), start.numpy())
    assert float((torch.from_numpy(on_host) - min_norm_weights(K, start)).abs().max()) <= 1e-9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [2, 3, 10, 11, 40])
def test_on_cuda_without_a_sync_and_as_on_the_cpu(m: int) -> None:
    """On the GPU: no device-to-host synchronisation (torch's sync debug mode raises on one), and
    the same minimizer as on the CPU (another LAPACK, so up to rounding, not bit for bit)."""
    gen = torch.Generator().manual_seed(m)
    scales = 10 ** torch.empty(m, 1, dtype=torch.float64).uniform_(-4, 4, generator=gen)
    G = torch.randn(m, 2 * m + 3, generator=gen, dtype=torch.float64) * scales
    K = G @ G.T
    start = torch.full((m,), 1.0 / m, dtype=torch.float64)
    expected = min_norm_weights(K, start)
    K_cuda, start_cuda = K.cuda(), start.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        w = min_norm_weights(K_cuda, start_cuda, max_iter=200)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    w = w.cpu()
    value, best = float(w @ K @ w), float(expected @ K @ expected)
    assert abs(value - best) <= 1e-10 * best
    assert float((w - expected).abs().max()) <= 1e-8
