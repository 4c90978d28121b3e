"""The triton backend against the pure-torch reference, op by op and through DoubleClipMGDA.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/kernels/triton_setup.py
imports triton so; with a GPU, the compiled kernels run on CUDA tensors).

Shapes are small: the interpreter executes every tile operation in numpy from Python.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import triton_setup  # tests/kernels/triton_setup.py: tests/kernels is on pytest's pythonpath (pyproject.toml)

_setup = triton_setup.import_triton()
_INTERPRETED, DEVICE, _SKIP_REASON = _setup.interpreted, _setup.device, _setup.skip_reason
if _SKIP_REASON is not None:
    pytest.skip(_SKIP_REASON, allow_module_level=True)

import error_bounds as eb  # noqa: E402  (tests/kernels is on pytest's pythonpath)

from drmoo_kernels import Divergence, reference  # noqa: E402
from drmoo_kernels.backends import triton as tb  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _interpreter_flag() -> Iterator[None]:
    """TRITON_INTERPRET=1 for this module's tests only (the dispatcher's availability check reads it)."""
    yield from triton_setup.interpreter_flag(_INTERPRETED)


DIVERGENCES = [
    Divergence("chi2"),
    Divergence("kl"),
    Divergence("cvar_smooth", 0.2),
    Divergence("cressie_read", 3.0),
    Divergence("cressie_read", 1.5),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 2e-5, atol: float = 2e-6) -> None:
    """Outputs computed in float32 on both sides from the same inputs: float32-level agreement."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


def _stored_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Values rounded to their (possibly 16-bit) storage dtype: allow one unit in the last place."""
    assert actual.dtype == expected.dtype
    if actual.dtype == torch.float32:
        _close(actual, expected, rtol=1e-5, atol=1e-6)
    else:
        eps = torch.finfo(actual.dtype).eps
        torch.testing.assert_close(actual.float(), expected.float(), rtol=eps, atol=eps)


def _losses(batch: int, tasks: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    losses = (3.0 * torch.rand(batch, tasks, generator=gen)).to(dtype)
    weights = (0.2 + 1.6 * torch.rand(batch, tasks, generator=gen)).to(dtype)
    return losses.to(DEVICE), weights.to(DEVICE)


# ------------------------------------------------------------------------------------ dual ops
DUAL_SHAPES = [(1, 1), (7, 2), (33, 3), (130, 8)]


@pytest.mark.parametrize("divergence", DIVERGENCES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("batch", "tasks"), DUAL_SHAPES)
def test_dual_forward_matches_reference(divergence: Divergence, dtype: torch.dtype, batch: int, tasks: int) -> None:
    losses, sample_weight = _losses(batch, tasks, dtype, seed=batch * 10 + tasks)
    eta = torch.linspace(-0.5, 1.0, tasks, device=DEVICE)
    for weight in (None, sample_weight):
        got = tb.dual_forward(losses, eta, 0.6, 1.3, divergence, weight)
        want = reference.dual_forward(losses, eta, 0.6, 1.3, divergence, weight)
        bound = eb.dual_forward_bounds(losses, eta, 0.6, 1.3, divergence, weight)
        for name, a, b, e in zip(("objective", "z", "weights"), got, want, (bound.objective, bound.z, bound.weights)):
            eb.assert_within(a, b, e, name)


@pytest.mark.parametrize("divergence", DIVERGENCES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("batch", "tasks"), DUAL_SHAPES)
def test_dual_step_matches_reference(divergence: Divergence, dtype: torch.dtype, batch: int, tasks: int) -> None:
    losses, sample_weight = _losses(batch, tasks, dtype, seed=batch * 7 + tasks)
    w = torch.softmax(torch.linspace(0.0, 1.0, tasks), 0).to(DEVICE)
    for weight, f2 in ((None, 0.05), (sample_weight, 10.0)):  # a binding and a non-binding clip
        eta_got = torch.linspace(-0.3, 0.8, tasks, device=DEVICE)
        eta_want = eta_got.clone()
        eta_before = eta_got.clone()
        got = tb.dual_step(losses, eta_got, w, 0.6, 1.3, divergence, 0.1, 1.0, f2, weight)
        want = reference.dual_step(losses, eta_want, w, 0.6, 1.3, divergence, 0.1, 1.0, f2, weight)
        bound = eb.dual_step_bounds(losses, eta_before, w, 0.6, 1.3, divergence, 0.1, 1.0, f2, weight, want, eta_want)
        eb.assert_within(eta_got, eta_want, bound.eta, "eta")
        for name, a, b, e in zip(("z", "mu", "weights"), got, want, (bound.z, bound.mu, bound.weights)):
            eb.assert_within(a, b, e, name)


def test_dual_ops_many_tasks_and_strided_losses() -> None:
    # m = 40 (the benchmark's largest), a transposed (non-contiguous) loss matrix, bf16 eta.
    losses = _losses(40, 300, torch.float32, seed=5)[0].T
    eta = torch.linspace(-0.2, 0.4, 40, device=DEVICE)
    w = torch.full((40,), 1.0 / 40, device=DEVICE)
    divergence = Divergence("kl")
    for a, b in zip(tb.dual_forward(losses, eta, 0.8, 1.0, divergence),
                    reference.dual_forward(losses, eta, 0.8, 1.0, divergence)):
        _close(a, b)
    eta_got, eta_want = eta.to(torch.bfloat16), eta.to(torch.bfloat16)
    got = tb.dual_step(losses, eta_got, w, 0.8, 1.0, divergence, 0.5, 1.0, 0.5)
    want = reference.dual_step(losses, eta_want, w, 0.8, 1.0, divergence, 0.5, 1.0, 0.5)
    _stored_close(eta_got, eta_want)
    _close(got[0], want[0])
    _close(got[1], want[1])
    # One bf16 ulp of eta moves the weights by ~1%: check them at the eta the kernel actually stored.
    _close(got[2], reference.dual_forward(losses, eta_got, 0.8, 1.0, divergence)[2])


def test_empty_batch_is_a_clear_error() -> None:
    losses = torch.empty(0, 3, device=DEVICE)
    eta = torch.zeros(3, device=DEVICE)
    with pytest.raises(ValueError, match="empty batch"):
        tb.dual_forward(losses, eta, 0.6, 1.0, Divergence("chi2"))
    with pytest.raises(ValueError, match="empty batch"):
        tb.dual_step(losses, eta, torch.full((3,), 1 / 3, device=DEVICE), 0.6, 1.0, Divergence("chi2"), 0.1, 1.0, 0.5)
    assert torch.equal(eta, torch.zeros(3, device=DEVICE))


# ------------------------------------------------------------------------------- Jacobian ops
# 70 and 130 tasks: the Triton Gram tiles m > 64 into 64-row blocks (ragged last tile).
GRAM_CASES = [(1, 1), (2, 7), (3, 1000), (8, 1003), (3, 70001), (40, 517), (70, 211), (130, 97)]


def _jacobian(tasks: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tasks, n, generator=gen).to(dtype).to(DEVICE)


def _params(n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Parameters of odd sizes (a matrix, a vector, a scalar-ish tail) whose numels sum to n."""
    gen = torch.Generator().manual_seed(seed)
    if n < 10:
        sizes: list[tuple[int, ...]] = [(n,)]
    else:
        rows = max(1, n // 21)
        first = rows * 3
        sizes = [(rows, 3), (n - first - 1,), (1,)]
    return [torch.randn(size, generator=gen).to(dtype).to(DEVICE) for size in sizes]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tasks", "n"), GRAM_CASES)
def test_gram_matches_reference(dtype: torch.dtype, tasks: int, n: int) -> None:
    jac = _jacobian(tasks, n, dtype, seed=n + tasks)
    eb.assert_within(tb.gram(jac), reference.gram(jac), eb.gram_difference_bound(jac), "gram")


def test_gram_of_blocks_and_strided_views() -> None:
    jac = _jacobian(3, 1000, torch.float32, seed=1)
    blocks = [jac[:, :1], jac[:, 1:600].reshape(3, 599), jac[:, 600:].reshape(3, 20, 20)]
    eb.assert_within(tb.gram(blocks), reference.gram(blocks), eb.gram_difference_bound(blocks), "blocks")
    strided = _jacobian(1000, 3, torch.float32, seed=2).T  # columns not unit-stride
    eb.assert_within(tb.gram(strided), reference.gram(strided), eb.gram_difference_bound(strided), "strided")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tasks", "n"), GRAM_CASES)
def test_combine_matches_reference(dtype: torch.dtype, tasks: int, n: int) -> None:
    jac = _jacobian(tasks, n, dtype, seed=3 * n + tasks)
    w = torch.softmax(torch.linspace(-1.0, 1.0, tasks), 0).to(DEVICE)
    for lr in (0.3, torch.tensor(0.05, device=DEVICE)):
        got = _params(n, dtype, seed=n)
        want, before = [p.clone() for p in got], [p.clone() for p in got]
        tb.combine(jac, w, got, lr)
        reference.combine(jac, w, want, lr)
        for a, b, e in zip(got, want, eb.combine_bound(jac, w, before, want, float(lr))):
            eb.assert_within(a, b, e, "params")


def test_combine_blocks_noncontiguous_params_and_errors() -> None:
    jac = _jacobian(3, 1000, torch.float32, seed=4)
    w = torch.tensor([0.2, 0.5, 0.3], device=DEVICE)
    got = [torch.randn(20, 30, device=DEVICE).T, torch.randn(400, device=DEVICE)]  # first: a transposed view
    assert not got[0].is_contiguous()
    want = [p.clone() for p in got]
    aligned = [jac[:, :600], jac[:, 600:]]  # one block per parameter
    tb.combine(aligned, w, got, 0.1)
    reference.combine(aligned, w, want, 0.1)
    for a, b in zip(got, want):
        _stored_close(a, b)
    misaligned = [jac[:, :123], jac[:, 123:]]  # blocks that straddle the parameters
    tb.combine(misaligned, w, got, 0.1)
    reference.combine(misaligned, w, want, 0.1)
    for a, b in zip(got, want):
        _stored_close(a, b)
    before = [p.clone() for p in got]
    with pytest.raises(ValueError, match="columns"):
        tb.combine(jac, w, got[:1], 0.1)
    assert all(torch.equal(a, b) for a, b in zip(got, before))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tasks", "n"), GRAM_CASES)
def test_gram_step_matches_reference(dtype: torch.dtype, tasks: int, n: int) -> None:
    jac = _jacobian(tasks, n, dtype, seed=5 * n + tasks)
    z = torch.linspace(-0.5, 0.7, tasks, device=DEVICE)
    mu = torch.tensor(0.8, device=DEVICE)
    for c2 in (0.05, 1e6):  # alpha clipped by c2/||d||, and alpha = c1
        w_got = torch.softmax(torch.linspace(1.0, -1.0, tasks), 0).to(DEVICE)
        w_want = w_got.clone()
        got_params = _params(n, dtype, seed=2 * n)
        want_params = [p.clone() for p in got_params]
        w_before, params_before = w_got.clone(), [p.clone() for p in got_params]
        got = tb.gram_step(jac, w_got, got_params, 0.1, 1.0, c2, 0.3, 1e-3, mu, z)
        want = reference.gram_step(jac, w_want, want_params, 0.1, 1.0, c2, 0.3, 1e-3, mu, z)
        bound = eb.gram_step_bounds(jac, w_before, params_before, 0.1, 1.0, c2, 0.3, 1e-3, mu, z, want, w_want,
                                    want_params)
        eb.assert_within(got[0], want[0], bound.gram, "gram")
        eb.assert_within(got[1], want[1], bound.d_norm, "d_norm")
        eb.assert_within(got[2], want[2], bound.alpha, "alpha")
        eb.assert_within(w_got, w_want, bound.w, "w")
        for a, b, e in zip(got_params, want_params, bound.params):
            eb.assert_within(a, b, e, "params")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, in the interpreter
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gram_step_writes_nothing_when_the_gram_is_not_finite(bad: float) -> None:
    jac = _jacobian(3, 1003, torch.float32, seed=6)
    jac[1, 517] = bad
    w = torch.tensor([0.2, 0.5, 0.3], device=DEVICE)
    params = _params(1003, torch.float32, seed=7)
    w_before, params_before = w.clone(), [p.clone() for p in params]
    gram, d_norm, alpha = tb.gram_step(jac, w, params, 0.1, 1.0, 0.5, 0.3, 1e-3, 0.5, torch.ones(3, device=DEVICE))
    assert not bool(torch.isfinite(gram).all())
    assert bool(torch.isnan(d_norm)) and float(alpha) == 0.0
    assert torch.equal(w, w_before)
    assert all(torch.equal(a, b) for a, b in zip(params, params_before))
    ref = reference.gram_step(jac, w.clone(), [p.clone() for p in params], 0.1, 1.0, 0.5, 0.3, 1e-3, 0.5,
                              torch.ones(3, device=DEVICE))
    assert float(ref[2]) == 0.0 and bool(torch.isnan(ref[1]))


def test_float64_inputs_follow_the_reference() -> None:
    jac = _jacobian(3, 257, torch.float64, seed=8)
    _close(tb.gram(jac), reference.gram(jac), rtol=1e-12, atol=1e-12)
    losses = _losses(9, 3, torch.float64, seed=9)[0]
    eta = torch.zeros(3, device=DEVICE)
    for a, b in zip(tb.dual_forward(losses, eta, 0.6, 1.0, Divergence("kl")),
                    reference.dual_forward(losses, eta, 0.6, 1.0, Divergence("kl"))):
        _close(a, b, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- optimizer parity
@pytest.mark.parametrize(("tasks", "divergence", "resample"), [(3, "chi2", True), (1, "cvar_smooth(0.3)", False),
                                                               (2, "cressie_read(2)", True)])
def test_double_clip_parity_with_reference(toy, tasks: int, divergence: str, resample: bool) -> None:
    from drmoo.optim import DoubleClipMGDA

    runs = {}
    for backend in ("reference", "triton"):
        problem = toy(num_tasks=tasks, dtype=torch.float32, seed=11)
        for tensor in (problem.inputs, problem.targets):
            tensor.data = tensor.data.to(DEVICE)
        for param in (problem.A, problem.c, problem.H):
            param.data = param.data.to(DEVICE)
        opt = DoubleClipMGDA(problem.shared, tasks, lr=0.05, pref_lr=0.3, rho=1e-3, c2=0.4, f2=0.3, lam=0.8,
                             divergence=divergence, resample=resample, backend=backend)
        assert opt.backend == backend
        heads = torch.optim.SGD([problem.H], lr=0.01)
        draw = problem.batches(seed=5)
        closure = lambda p=problem, d=draw: p.losses(d().to(DEVICE))  # noqa: E731
        history = []
        for _ in range(12):
            heads.zero_grad()
            objective = opt.step(closure)
            heads.step()
            history.append((objective.clone(), opt.w.clone(), opt.eta.clone()))
        runs[backend] = (problem.snapshot(), history)
    (ref_params, ref_hist), (tri_params, tri_hist) = runs["reference"], runs["triton"]
    for (obj_r, w_r, eta_r), (obj_t, w_t, eta_t) in zip(ref_hist, tri_hist):
        torch.testing.assert_close(obj_t, obj_r, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(w_t, w_r, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(eta_t, eta_r, rtol=1e-4, atol=1e-5)
    for a, b in zip(tri_params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------ loading
def test_availability_here() -> None:
    assert tb.availability() is None


@pytest.mark.skipif(not _INTERPRETED, reason="checks the CPU-only behaviour")
def test_import_does_not_import_triton_and_reports_why() -> None:
    code = (
        "import sys, drmoo_kernels\n"
        "from drmoo_kernels.dispatch import why_unavailable\n"
        "reason = why_unavailable('triton')\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
        "assert 'TRITON_INTERPRET' in reason, reason\n"
        "assert 'triton' not in drmoo_kernels.available_backends()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("divergence", DIVERGENCES, ids=str)
def test_a_nan_loss_stays_nan_as_in_the_reference(divergence: Divergence) -> None:
    """A NaN loss makes its task's objective, z and weight NaN in the reference; Triton's maximum drops a NaN
    operand unless told to propagate it, which turned a NaN loss into finite values (and a finite eta step)."""
    losses = torch.tensor([[float("nan"), 1.0], [0.5, 0.2]], device=DEVICE)
    eta, w = torch.zeros(2, device=DEVICE), torch.full((2,), 0.5, device=DEVICE)
    expected, got = reference.dual_forward(losses.cpu(), eta.cpu(), 0.8, 1.0, divergence), \
        tb.dual_forward(losses, eta, 0.8, 1.0, divergence)
    for want, have in zip(expected, got):
        assert torch.equal(torch.isnan(want), torch.isnan(have.cpu())), (want, have)
    eta_ref, eta_got = eta.cpu().clone(), eta.clone()
    reference.dual_step(losses.cpu(), eta_ref, w.cpu(), 0.8, 1.0, divergence, 0.5, 1.0, 0.5)
    tb.dual_step(losses, eta_got, w, 0.8, 1.0, divergence, 0.5, 1.0, 0.5)
    assert torch.equal(torch.isnan(eta_ref), torch.isnan(eta_got.cpu())) and bool(torch.isnan(eta_got[0]))


def test_gram_step_with_a_nan_weight_reports_a_nan_norm() -> None:
    """A NaN in w: the reference's d_norm is NaN; max(quad, 0) read it as 0, a converged run's norm."""
    jacobian, params = torch.ones(2, 3, device=DEVICE), [torch.zeros(3, device=DEVICE)]
    w = torch.tensor([float("nan"), 0.5], device=DEVICE)
    _, d_norm, _ = tb.gram_step(jacobian, w, params, 0.1, 1.0, 1.0, 0.1, 0.0, 0.0, torch.ones(2, device=DEVICE))
    assert bool(torch.isnan(d_norm.cpu()).all())


def test_an_input_that_requires_grad_is_refused_in_grad_mode() -> None:
    """Triton's outputs are fresh buffers, detached: a gradient would silently stop there."""
    losses = torch.rand(4, 2, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"triton\.dual_forward: losses requires grad"):
        tb.dual_forward(losses, torch.zeros(2, device=DEVICE), 0.8, 1.0, Divergence("chi2"))
    with pytest.raises(RuntimeError, match=r"triton.gram: J\[1\] requires grad"):
        tb.gram([torch.rand(2, 3, device=DEVICE), torch.rand(2, 2, device=DEVICE, requires_grad=True)])


@pytest.mark.parametrize("divergence", [*DIVERGENCES, Divergence("cvar_smooth", 0.999)], ids=str)
@pytest.mark.parametrize("eta", [(0.3, -0.2), (2.5, 3.0)], ids=["u-positive", "u-negative"])
def test_the_dual_objective_is_within_its_error_bound_at_every_lambda(divergence: Divergence,
                                                                       eta: tuple[float, float]) -> None:
    """tests/kernels/test_conj_precision.py's test for the triton kernel (float32 math): against the objective's
    60-digit value, at lam from 0.05 to 1e30, within the bound of a cancellation-free evaluation."""
    generator = torch.Generator().manual_seed(7)
    losses = torch.rand(13, 2, generator=generator, dtype=torch.float64).float() + 1.0
    eta_tensor = torch.tensor(eta, dtype=torch.float32)
    for lam in (0.05, 1.0, 100.0, 1e4, 1e8, 1e12, 1e30):
        objective = tb.dual_forward(losses.to(DEVICE), eta_tensor.to(DEVICE), lam, 1.0, divergence)[0]
        exact, bounds = eb.exact_dual_objective(losses, eta_tensor, lam, 1.0, divergence)
        for task, (value, truth, bound) in enumerate(zip(objective.cpu().double().tolist(), exact, bounds)):
            assert abs(value - truth) <= bound, (
                f"lam={lam:g} task {task}: {value!r} against {truth!r} (bound {bound:.3g})")


@pytest.mark.parametrize("divergence", DIVERGENCES, ids=str)
def test_an_infinite_loss_gives_an_infinite_objective(divergence: Divergence) -> None:
    """u = +inf: f*(u) = +inf, as in the reference (Cressie-Read's log1p(inf) was inf * (inf / inf) = NaN)."""
    losses = torch.tensor([[1.0, float("inf")], [2.0, 1.5]], device=DEVICE)
    objective = tb.dual_forward(losses, torch.zeros(2, device=DEVICE), 0.8, 1.0, divergence)[0]
    assert torch.isfinite(objective[0]) and objective[1].item() == float("inf")
