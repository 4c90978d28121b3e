"""The compiled backends (``cpp`` on CPU, ``cuda`` on GPU) against the pure-torch reference.

Every op, every divergence, float32/bfloat16/float16/float64, odd sizes, with and without sample
weights; opcheck on the op schemas; the no-write guard of gram_step; and DoubleClipMGDA run with
``backend="cpp"``/``"cuda"`` against ``backend="reference"``.  The cpp tests need the extension to
be built (CI builds it) and fail, not skip, without it; the cuda tests skip when there is no GPU.

The op-by-op comparisons use floating-point error bounds (tests/kernels/error_bounds.py), not
tolerances fitted to one machine: kernel and reference each lie within the bound of the exact
result, on any CPU or GPU, and ``test_the_error_bounds_catch_planted_bugs`` shows the bounds are
still tight enough to catch a dropped column or a perturbed weight.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import error_bounds as eb  # tests/kernels/error_bounds.py: tests/kernels is on pytest's pythonpath (pyproject.toml)
import pytest
import torch
from torch import Tensor

from drmoo_kernels import reference
from drmoo_kernels.backends import cpp as cpp_backend
from drmoo_kernels.backends import cuda as cuda_backend
from drmoo_kernels.divergences import Divergence

HAS_CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (the cuda backend runs on GPU tensors)")

BACKENDS = [
    pytest.param(("cpp", cpp_backend, "cpu"), id="cpp"),
    pytest.param(("cuda", cuda_backend, "cuda"), id="cuda", marks=cuda_only),
]

DIVERGENCES = [
    Divergence("chi2"),
    Divergence("kl"),
    Divergence("cvar_smooth", 0.2),
    Divergence("cressie_read", 2.0),
    Divergence("cressie_read", 3.5),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]



def _close(actual: Tensor, expected: Tensor, tol: tuple[float, float]) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=tol[0], atol=tol[1], equal_nan=True)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _losses(batch: int, tasks: int, dtype: torch.dtype, device: str, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    gen = _gen(seed)
    losses = (2.0 * torch.rand(batch, tasks, generator=gen)).to(dtype)
    eta = 0.5 * torch.rand(tasks, generator=gen) - 0.1
    weight = (0.5 + torch.rand(batch, tasks, generator=gen)).to(dtype)
    return losses.to(device), eta.to(device), weight.to(device)


def _jacobian(tasks: int, n: int, dtype: torch.dtype, device: str, seed: int) -> Tensor:
    return torch.randn(tasks, n, generator=_gen(seed)).to(dtype).to(device)


def _params(n: int, dtype: torch.dtype, device: str, seed: int) -> list[Tensor]:
    """Parameters whose numels add up to n: odd-sized pieces, a 2-D one, and an empty one."""
    flat = torch.randn(n, generator=_gen(seed)).to(dtype).to(device)
    if n < 8:
        return [flat.clone()]
    first, second = n // 3, n // 5
    rest = n - first - second
    return [flat[:first].clone(), flat[first:first + second].clone().view(1, second),
            flat[:0].clone(), flat[first + second:].clone().view(rest)]


# ------------------------------------------------------------------------------------- loading
def test_cpp_backend_is_available() -> None:
    # CI builds the extension; a missing build is a failure here, not a skip.
    assert cpp_backend.availability() is None, cpp_backend.availability()


def test_cuda_availability_reports_why() -> None:
    reason = cuda_backend.availability()
    if HAS_CUDA and torch._C._dispatch_has_kernel_for_dispatch_key("drmoo::gram", "CUDA"):
        assert reason is None
    else:
        assert isinstance(reason, str) and reason


def test_dispatch_lists_cpp_and_picks_it_for_cpu() -> None:
    from drmoo_kernels.dispatch import available_backends, resolve_backend

    assert "cpp" in available_backends()
    assert resolve_backend(None, "cpu") == "cpp"


# ------------------------------------------------------------------------------------- opcheck
def _opcheck_cases(device: str) -> list[tuple[object, tuple]]:
    losses, eta, weight = _losses(13, 3, torch.float32, device, seed=0)
    w = torch.tensor([0.2, 0.3, 0.5], device=device)
    J = _jacobian(3, 37, torch.float32, device, seed=1)
    params = _params(37, torch.float32, device, seed=2)
    z = torch.tensor([0.3, -0.2, 0.1], device=device)
    mu = torch.tensor(0.7, device=device)
    lr = torch.tensor(0.05, dtype=torch.float64, device=device)
    ops = torch.ops.drmoo
    return [
        (ops.dual_forward.default, (losses, eta, 0.6, 1.0, 1, 0.0, None)),
        (ops.dual_forward.default, (losses, eta, 0.6, 1.5, 2, 0.2, weight)),
        (ops.dual_step.default, (losses, eta.clone(), w, 0.6, 1.0, 0, 0.0, 0.1, 1.0, 0.5, None)),
        (ops.dual_step.default, (losses, eta.clone(), w, 0.8, 2.0, 3, 2.5, 0.1, 1.0, 0.5, weight)),
        (ops.gram.default, (J,)),
        (ops.combine.default, (J, w, [p.clone() for p in params], lr)),
        (ops.gram_step.default, (J, w.clone(), [p.clone() for p in params], 0.1, 1.0, 0.5, 0.3, 1e-3, mu, z)),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend) -> None:
    _, module, device = backend
    assert module.availability() is None
    for op, args in _opcheck_cases(device):
        torch.library.opcheck(op, args)


def test_ops_trace_under_torch_compile() -> None:
    def step(losses: Tensor, eta: Tensor, w: Tensor, J: Tensor, params: list[Tensor]) -> Tensor:
        z, mu, _ = cpp_backend.dual_step(losses, eta, w, 0.6, 1.0, Divergence("kl"), 0.1, 1.0, 0.5)
        gram, _, _ = cpp_backend.gram_step(J, w, params, 0.1, 1.0, 0.5, 0.3, 1e-3, mu, z)
        return gram

    losses, eta, _ = _losses(16, 3, torch.float32, "cpu", seed=3)
    J = _jacobian(3, 50, torch.float32, "cpu", seed=4)
    states = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        e, w, params = eta.clone(), torch.full((3,), 1 / 3), _params(50, torch.float32, "cpu", seed=5)
        gram = fn(losses, e, w, J, params)
        states.append((gram, e, w, params))
    (g0, e0, w0, p0), (g1, e1, w1, p1) = states
    for a, b in zip([g0, e0, w0, *p0], [g1, e1, w1, *p1]):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------ dual ops
DUAL_SHAPES = [(1, 1), (7, 2), (256, 8), (1023, 3), (33, 40), (2500, 5)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("divergence", DIVERGENCES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dual_forward_matches_reference(backend, divergence: Divergence, dtype: torch.dtype) -> None:
    _, module, device = backend
    for k, (batch, tasks) in enumerate(DUAL_SHAPES):
        losses, eta, weight = _losses(batch, tasks, dtype, device, seed=10 + k)
        for sample_weight in (None, weight):
            for scale in (1.0, 1.7):
                got = module.dual_forward(losses, eta, 0.6, scale, divergence, sample_weight)
                want = reference.dual_forward(losses, eta, 0.6, scale, divergence, sample_weight)
                bound = eb.dual_forward_bounds(losses, eta, 0.6, scale, divergence, sample_weight)
                for name, a, b, e in zip(("objective", "z", "weights"), got, want,
                                         (bound.objective, bound.z, bound.weights)):
                    eb.assert_within(a, b, e, f"{name} {(batch, tasks)}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("divergence", DIVERGENCES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dual_step_matches_reference(backend, divergence: Divergence, dtype: torch.dtype) -> None:
    _, module, device = backend
    eta_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for k, (batch, tasks) in enumerate(DUAL_SHAPES):
        losses, eta, weight = _losses(batch, tasks, dtype, device, seed=20 + k)
        eta = eta.to(eta_dtype)
        w = torch.softmax(torch.randn(tasks, generator=_gen(k)), 0).to(device)
        for sample_weight in (None, weight):
            # f2 small enough that the clip is active for some shapes, f1 binding for others.
            for gamma, f1, f2 in ((0.1, 1.0, 0.05), (0.5, 0.3, 10.0)):
                eta_got, eta_want = eta.clone(), eta.clone()
                got = module.dual_step(losses, eta_got, w, 0.7, 1.3, divergence, gamma, f1, f2, sample_weight)
                want = reference.dual_step(losses, eta_want, w, 0.7, 1.3, divergence, gamma, f1, f2, sample_weight)
                bound = eb.dual_step_bounds(losses, eta, w, 0.7, 1.3, divergence, gamma, f1, f2, sample_weight,
                                            want, eta_want)
                for name, a, b, e in zip(("z", "mu", "weights"), got, want, (bound.z, bound.mu, bound.weights)):
                    eb.assert_within(a, b, e, f"{name} {(batch, tasks)}")
                eb.assert_within(eta_got, eta_want, bound.eta, f"eta {(batch, tasks)}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("eta_dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_dual_step_rounds_eta_to_its_dtype(backend, eta_dtype: torch.dtype) -> None:
    _, module, device = backend
    losses, eta, _ = _losses(64, 4, torch.float32, device, seed=30)
    eta = eta.to(eta_dtype)
    w = torch.full((4,), 0.25, device=device)
    eta_got, eta_want = eta.clone(), eta.clone()
    got = module.dual_step(losses, eta_got, w, 0.6, 1.0, Divergence("kl"), 0.2, 1.0, 0.5)
    want = reference.dual_step(losses, eta_want, w, 0.6, 1.0, Divergence("kl"), 0.2, 1.0, 0.5)
    assert eta_got.dtype == eta_dtype
    # The update itself is float32 math (the losses are float32); eta's dtype only rounds it, and
    # the bound's last step is that rounding (the weights then see eta to within it).
    bound = eb.dual_step_bounds(losses, eta, w, 0.6, 1.0, Divergence("kl"), 0.2, 1.0, 0.5, None, want, eta_want)
    eb.assert_within(eta_got, eta_want, bound.eta, "eta")
    for name, a, b, e in zip(("z", "mu", "weights"), got, want, (bound.z, bound.mu, bound.weights)):
        eb.assert_within(a, b, e, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dual_ops_accept_strided_losses_and_any_weight_dtype(backend) -> None:
    _, module, device = backend
    losses, eta, weight = _losses(40, 6, torch.float32, device, seed=31)
    strided = losses.t().contiguous().t()  # column-major view
    weight64 = weight.double()
    got = module.dual_forward(strided, eta, 0.6, 1.0, Divergence("kl"), weight64)
    want = reference.dual_forward(losses, eta, 0.6, 1.0, Divergence("kl"), weight64)
    bound = eb.dual_forward_bounds(losses, eta, 0.6, 1.0, Divergence("kl"), weight64)
    for a, b, e in zip(got, want, (bound.objective, bound.z, bound.weights)):
        eb.assert_within(a, b, e, "strided losses, float64 weights")


@pytest.mark.parametrize("backend", BACKENDS)
def test_dual_ops_handle_extreme_losses(backend) -> None:
    _, module, device = backend
    losses = torch.tensor([[0.0, 500.0, -50.0], [1e4, 3.0, 0.5]], device=device)
    eta = torch.zeros(3, device=device)
    for divergence in (Divergence("cvar_smooth", 0.1), Divergence("chi2"), Divergence("cressie_read", 3.0)):
        got = module.dual_forward(losses, eta, 0.5, 1.0, divergence)
        want = reference.dual_forward(losses, eta, 0.5, 1.0, divergence)
        bound = eb.dual_forward_bounds(losses, eta, 0.5, 1.0, divergence)
        for a, b, e in zip(got, want, (bound.objective, bound.z, bound.weights)):
            eb.assert_within(a, b, e, str(divergence))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_is_a_clear_error(backend) -> None:
    _, module, device = backend
    losses = torch.empty(0, 3, device=device)
    eta, w = torch.zeros(3, device=device), torch.full((3,), 1 / 3, device=device)
    with pytest.raises(ValueError, match="empty batch"):
        module.dual_forward(losses, eta, 0.6, 1.0, Divergence("chi2"))
    with pytest.raises(ValueError, match="empty batch"):
        module.dual_step(losses, eta, w, 0.6, 1.0, Divergence("chi2"), 0.1, 1.0, 0.5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_are_clear_errors(backend) -> None:
    _, module, device = backend
    losses, eta, _ = _losses(8, 3, torch.float32, device, seed=32)
    w = torch.full((3,), 1 / 3, device=device)
    kl = Divergence("kl")
    with pytest.raises(ValueError, match=r"eta must have shape \[3\]"):
        module.dual_forward(losses, eta[:2], 0.6, 1.0, kl)
    with pytest.raises(ValueError, match="sample_weight must have the shape"):
        module.dual_forward(losses, eta, 0.6, 1.0, kl, torch.ones(8, 2, device=device))
    with pytest.raises(ValueError, match=r"losses must be per-sample losses of shape \[B, m\]"):
        module.dual_forward(losses[:, 0], eta, 0.6, 1.0, kl)
    with pytest.raises(TypeError, match="losses must be float32"):
        module.dual_forward(losses.long(), eta, 0.6, 1.0, kl)
    with pytest.raises(ValueError, match="lam must be finite and > 0"):
        module.dual_forward(losses, eta, 0.0, 1.0, kl)
    with pytest.raises(ValueError, match=r"w must have shape \[3\]"):
        module.dual_step(losses, eta, w[:1], 0.6, 1.0, kl, 0.1, 1.0, 0.5)
    J = _jacobian(3, 10, torch.float32, device, seed=33)
    params = _params(10, torch.float32, device, seed=34)
    with pytest.raises(ValueError, match="J has 10 columns but the parameters hold 9"):
        module.combine(J, w, [torch.zeros(9, device=device)], 0.1)
    with pytest.raises(TypeError, match="J's dtype"):
        module.combine(J, w, [p.double() for p in params], 0.1)
    with pytest.raises(ValueError, match=r"z must have shape \[3\]"):
        module.gram_step(J, w, params, 0.1, 1.0, 0.5, 0.3, 1e-3, 0.5, torch.zeros(2, device=device))
    with pytest.raises(ValueError, match="J has no rows"):
        module.gram(J[:0])
    if device == "cpu":
        other = "cuda" if HAS_CUDA else "meta"
        with pytest.raises(RuntimeError, match="runs on cpu tensors"):
            module.gram(J.to(other))


@pytest.mark.parametrize("backend", BACKENDS)
def test_error_messages_spell_out_shapes_devices_and_dtypes(backend) -> None:
    """Every check of csrc/checks.h that names a shape, device or dtype, called on the op itself.

    The C++ side formats these values into plain strings (checks.h says why: a message streamed by
    c10::str inside the extension crashed the interpreter on a torch 2.11 image instead of raising).
    A direct ``torch.ops.drmoo.*`` call gets a RuntimeError on every device: the CPU kernels are
    built on torch's stable ABI, which can raise nothing else, and the CUDA kernels do the same; the
    backends' wrappers raise the documented ValueError/TypeError before calling the ops.
    """
    _, module, device = backend
    assert module.availability() is None
    ops = torch.ops.drmoo
    losses, eta, _ = _losses(8, 3, torch.float32, device, seed=35)
    J = _jacobian(3, 10, torch.float32, device, seed=36)
    w, z = torch.full((3,), 1 / 3, device=device), torch.zeros(3, device=device)
    params = [torch.zeros(10, device=device)]
    one = torch.tensor(0.1, device=device)
    cases: list[tuple[type[Exception], str, Callable[[], object]]] = [
        (RuntimeError, r"drmoo\.dual_forward: eta must have shape \[3\] \(one entry per task\), got \[2\]$",
         lambda: ops.dual_forward(losses, eta[:2], 0.6, 1.0, 1, 0.0, None)),
        (RuntimeError, r"eta must have shape \[3\] \(one entry per task\), got \[3, 1\]$",
         lambda: ops.dual_forward(losses, eta[:, None], 0.6, 1.0, 1, 0.0, None)),
        (RuntimeError, r"sample_weight must have the shape of losses \[8, 3\], got \[8, 2\]$",
         lambda: ops.dual_forward(losses, eta, 0.6, 1.0, 1, 0.0, torch.ones(8, 2, device=device))),
        (RuntimeError, r"losses must be per-sample losses of shape \[B, m\], got \[8\]$",
         lambda: ops.dual_forward(losses[:, 0], eta, 0.6, 1.0, 1, 0.0, None)),
        (RuntimeError, r"losses must be per-sample losses of shape \[B, m\], got \[\]$",
         lambda: ops.dual_forward(losses[0, 0], eta, 0.6, 1.0, 1, 0.0, None)),
        (RuntimeError, r"losses must be float32, float64, float16 or bfloat16, got Long$",
         lambda: ops.dual_forward(losses.long(), eta, 0.6, 1.0, 1, 0.0, None)),
        (RuntimeError, r"eta must be float32, float64, float16 or bfloat16, got Int$",
         lambda: ops.dual_forward(losses, eta.int(), 0.6, 1.0, 1, 0.0, None)),
        (RuntimeError, r"drmoo\.dual_step: w must have shape \[3\] \(one entry per task\), got \[1, 3\]$",
         lambda: ops.dual_step(losses, eta.clone(), w[None], 0.6, 1.0, 1, 0.0, 0.1, 1.0, 0.5, None)),
        (RuntimeError, r"drmoo\.gram: J must be the \[m, n\] per-task gradient matrix, got shape \[10\]$",
         lambda: ops.gram(J[0])),
        (RuntimeError, r"J must be the \[m, n\] per-task gradient matrix, got shape \[3, 2, 5\]$",
         lambda: ops.gram(J.view(3, 2, 5))),
        (RuntimeError, r"drmoo\.combine: params\[0\] has dtype Double but J has Float; the compiled kernels",
         lambda: ops.combine(J, w, [p.double() for p in params], one)),
        (RuntimeError, r"drmoo\.combine: lr must hold one value, got shape \[2\]$",
         lambda: ops.combine(J, w, params, torch.ones(2, device=device))),
        (RuntimeError, r"drmoo\.gram_step: mu must hold one value, got shape \[2, 1\]$",
         lambda: ops.gram_step(J, w.clone(), params, 0.1, 1.0, 0.5, 0.3, 1e-3, torch.ones(2, 1, device=device), z)),
        (RuntimeError, r"drmoo\.gram_step: z must have shape \[3\] \(one entry per task\), got \[4\]$",
         lambda: ops.gram_step(J, w.clone(), params, 0.1, 1.0, 0.5, 0.3, 1e-3, one, torch.zeros(4, device=device))),
    ]
    if device == "cuda":  # a second device type is only at hand with a GPU
        cases += [
            (RuntimeError, r"drmoo\.combine: params\[0\] is on cpu but J is on cuda:\d+$",
             lambda: ops.combine(J, w, [torch.zeros(10)], one)),
            (RuntimeError, r"drmoo\.dual_forward: eta is on cpu but the other inputs are on cuda:\d+$",
             lambda: ops.dual_forward(losses, eta.cpu(), 0.6, 1.0, 1, 0.0, None)),
        ]
    for error, pattern, call in cases:
        with pytest.raises(error) as raised:
            call()
        # The first line: torch appends the C++ source location after the message.
        assert re.search(pattern, str(raised.value).splitlines()[0]), (pattern, str(raised.value))


# ------------------------------------------------------------------------------------ gram ops
# 13, 14 and 40 take the blocked CPU path (m >= 12: 2 x 4 blocks; 13 and 14 leave every remainder shape).
GRAM_TASKS = [1, 2, 3, 8, 13, 14, 40]
GRAM_COLUMNS = [1, 7, 1023, 100003]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tasks", GRAM_TASKS)
def test_gram_matches_reference(backend, dtype: torch.dtype, tasks: int) -> None:
    _, module, device = backend
    for n in GRAM_COLUMNS:
        J = _jacobian(tasks, n, dtype, device, seed=40 + n)
        eb.assert_within(module.gram(J), reference.gram(J), eb.gram_difference_bound(J), f"gram n={n}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gram_of_blocks_and_strided_rows(backend) -> None:
    _, module, device = backend
    J = _jacobian(4, 3001, torch.float32, device, seed=41)
    want, bound = reference.gram(J), eb.gram_difference_bound(J)
    eb.assert_within(module.gram([J[:, :1000], J[:, 1000:1001], J[:, 1001:]]), want, bound, "blocks")
    wide = _jacobian(4, 5000, torch.float32, device, seed=42)
    view = wide[:, 17:3017]  # rows further apart than their length
    eb.assert_within(module.gram(view), reference.gram(view), eb.gram_difference_bound(view), "strided rows")
    transposed = J.t().contiguous().t()
    eb.assert_within(module.gram(transposed), want, bound, "column-major J")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tasks", GRAM_TASKS)
def test_combine_matches_reference(backend, dtype: torch.dtype, tasks: int) -> None:
    _, module, device = backend
    for n in GRAM_COLUMNS:
        J = _jacobian(tasks, n, dtype, device, seed=50 + n)
        w = torch.softmax(torch.randn(tasks, generator=_gen(n)), 0).to(device)
        for lr in (0.05, torch.tensor(0.3, dtype=torch.float64, device=device)):
            before = _params(n, dtype, device, seed=n)
            got, want = [p.clone() for p in before], [p.clone() for p in before]
            module.combine(J, w, got, lr)
            reference.combine(J, w, want, lr)
            for a, b, e in zip(got, want, eb.combine_bound(J, w, before, want, float(lr))):
                eb.assert_within(a, b, e, f"params n={n} lr={float(lr)}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_combine_writes_through_non_contiguous_params(backend) -> None:
    _, module, device = backend
    J = _jacobian(3, 60, torch.float32, device, seed=51)
    w = torch.tensor([0.5, 0.25, 0.25], device=device)
    base_got = torch.randn(10, 6, generator=_gen(52)).to(device)
    base_before, base_want = base_got.clone(), base_got.clone()
    module.combine(J, w, [base_got.t()], 0.1)  # a transposed (non-contiguous) view
    reference.combine(J, w, [base_want.t()], 0.1)
    (bound,) = eb.combine_bound(J, w, [base_before.t()], [base_want.t()], 0.1)
    eb.assert_within(base_got.t(), base_want.t(), bound, "transposed parameter")


def _gram_step_inputs(tasks: int, n: int, dtype: torch.dtype, device: str, seed: int):
    gen = _gen(seed)
    J = _jacobian(tasks, n, dtype, device, seed)
    w = torch.softmax(torch.randn(tasks, generator=gen), 0).to(device)
    z = (0.5 * torch.randn(tasks, generator=gen)).to(device)
    mu = torch.tensor(0.8, device=device)
    return J, w, z, mu


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tasks", GRAM_TASKS)
def test_gram_step_matches_reference(backend, dtype: torch.dtype, tasks: int) -> None:
    _, module, device = backend
    for n in GRAM_COLUMNS:
        J, w, z, mu = _gram_step_inputs(tasks, n, dtype, device, seed=60 + n)
        # c2 small: alpha = c2/||d|| (the clip binds); c2 large: alpha = c1.  beta big enough that
        # the projection clips some coordinates to 0.
        for c1, c2, beta in ((1.0, 0.05, 0.5), (0.3, 1e6, 1e-3)):
            w_got, w_want = w.clone(), w.clone()
            before = _params(n, dtype, device, seed=n)
            p_got, p_want = [p.clone() for p in before], [p.clone() for p in before]
            got = module.gram_step(J, w_got, p_got, 0.1, c1, c2, beta, 1e-3, mu, z)
            want = reference.gram_step(J, w_want, p_want, 0.1, c1, c2, beta, 1e-3, mu, z)
            bound = eb.gram_step_bounds(J, w, before, 0.1, c1, c2, beta, 1e-3, mu, z, want, w_want, p_want)
            where = f"n={n} c2={c2}"
            eb.assert_within(got[0], want[0], bound.gram, f"gram {where}")
            eb.assert_within(got[1], want[1], bound.d_norm, f"d_norm {where}")
            eb.assert_within(got[2], want[2], bound.alpha, f"alpha {where}")
            eb.assert_within(w_got, w_want, bound.w, f"w {where}")
            for a, b, e in zip(p_got, p_want, bound.params):
                eb.assert_within(a, b, e, f"params {where}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gram_step_float_mu_and_zero_gradient(backend) -> None:
    _, module, device = backend
    J = torch.zeros(3, 11, device=device)
    w, z = torch.tensor([0.6, 0.3, 0.1], device=device), torch.tensor([1.0, -2.0, 0.5], device=device)
    w_got, w_want = w.clone(), w.clone()
    p_got, p_want = _params(11, torch.float32, device, 1), _params(11, torch.float32, device, 1)
    got = module.gram_step(J, w_got, p_got, 0.1, 0.7, 0.5, 0.2, 1e-3, 0.25, z)
    want = reference.gram_step(J, w_want, p_want, 0.1, 0.7, 0.5, 0.2, 1e-3, 0.25, z)
    for a, b in zip([*got, w_got, *p_got], [*want, w_want, *p_want]):
        _close(a, b, (1e-6, 1e-7))
    assert float(got[2]) == pytest.approx(0.7)  # ||d|| = 0: alpha falls back to c1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gram_step_writes_nothing_when_the_gram_is_not_finite(backend, bad: float, dtype: torch.dtype) -> None:
    _, module, device = backend
    J, w, z, mu = _gram_step_inputs(3, 5003, dtype, device, seed=70)
    J[1, 4321] = bad
    params = _params(5003, dtype, device, seed=71)
    before = [p.clone() for p in params]
    w_before = w.clone()
    gram, d_norm, alpha = module.gram_step(J, w, params, 0.1, 1.0, 0.5, 0.3, 1e-3, mu, z)
    assert not bool(torch.isfinite(gram).all())
    assert bool(torch.isnan(d_norm)) and float(alpha) == 0.0
    assert torch.equal(w, w_before)
    for p, q in zip(params, before):
        assert torch.equal(p, q)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_n_gram_step(backend) -> None:
    _, module, device = backend
    n = 3_000_017
    J, w, z, mu = _gram_step_inputs(3, n, torch.float32, device, seed=80)
    p_got, p_want = _params(n, torch.float32, device, seed=81), _params(n, torch.float32, device, seed=81)
    w_got, w_want = w.clone(), w.clone()
    before = [p.clone() for p in p_got]
    got = module.gram_step(J, w_got, p_got, 0.1, 1.0, 0.5, 0.3, 1e-3, mu, z)
    want = reference.gram_step(J, w_want, p_want, 0.1, 1.0, 0.5, 0.3, 1e-3, mu, z)
    bound = eb.gram_step_bounds(J, w, before, 0.1, 1.0, 0.5, 0.3, 1e-3, mu, z, want, w_want, p_want)
    for name, a, b, e in zip(("gram", "d_norm", "alpha"), got, want, (bound.gram, bound.d_norm, bound.alpha)):
        eb.assert_within(a, b, e, name)
    eb.assert_within(w_got, w_want, bound.w, "w")
    for a, b, e in zip(p_got, p_want, bound.params):
        eb.assert_within(a, b, e, "params")
    # Against the reference's float32 matmul only the any-order bound gamma(n) (~0.2 of
    # sum |J_i||J_j| at this n) holds on every CPU.  The cpp kernel is also held to its own bound
    # against the exact Gram: float32 chunk sums of at most 4096 columns added in float64,
    # ~2.5e-4 of sum |J_i||J_j|.  (The float64 "exact" Gram is itself within gamma_64(n) of it.)
    if device == "cpu":
        exact = J.double() @ J.double().T
        limit = eb.cpp_gram_error_bound(J) + eb.gram_error_bound(J.double())
        eb.assert_within(got[0].double(), exact, limit, "gram vs the exact Gram")


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_jacobian_past_32_bit_offsets(backend) -> None:
    """J with m * n > 2^31 elements (bfloat16, 4.3 GB): every offset into row 1 past 2^31 must be right.

    The values repeat a pattern of 7 multiples of 1/4 and the last column holds 8, so the exact Gram
    and update are known in closed form, and a wrapped 32-bit offset (reading the wrong column, or
    missing the last one) changes them.
    """
    _, module, device = backend
    n = (1 << 30) + 3
    pattern = torch.tensor([-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0]) / 4
    J = torch.empty(2, n, dtype=torch.bfloat16, device=device)
    J[0].fill_(1.0)
    whole = 7 * (n // 7)
    J[1, :whole].view(-1, 7).copy_(pattern.to(torch.bfloat16))
    J[1, whole:].copy_(pattern[: n - whole].to(torch.bfloat16))
    J[1, -1] = 8.0
    assert J.numel() > 2**31
    counts = [n // 7 + (1 if k < n % 7 else 0) for k in range(7)]
    last = float(pattern[(n - 1) % 7])
    row_sum = sum(c * float(v) for c, v in zip(counts, pattern)) - last + 8.0
    row_sq = sum(c * float(v) ** 2 for c, v in zip(counts, pattern)) - last**2 + 64.0
    exact = torch.tensor([[float(n), row_sum], [row_sum, row_sq]], dtype=torch.float64)
    torch.testing.assert_close(module.gram(J).double().cpu(), exact, rtol=1e-6, atol=0.0)

    # params -= 2 * (0.5 J0 + 0.25 J1) = -(1 + J1 / 2): exact in bfloat16 for these values.
    param = torch.zeros(n, dtype=torch.bfloat16, device=device)
    module.combine(J, torch.tensor([0.5, 0.25], device=device), [param], 2.0)
    step = 1 << 26
    for start in range(0, n, step):
        expected = -(1.0 + J[1, start : start + step].float() / 2)
        assert torch.equal(param[start : start + step].float(), expected), f"columns {start}..{start + step}"
    assert float(param[-1]) == -5.0
    del J, param


def _must_fail(planted: Tensor, expected: Tensor, bound: Tensor, what: str) -> None:
    with pytest.raises(AssertionError, match="exceeds the error bound"):
        eb.assert_within(planted, expected, bound, what)


def test_the_error_bounds_catch_planted_bugs() -> None:
    """The bounds are no blanket: a result with a real bug in it fails the check the tests use.

    Each case builds the result a buggy kernel would return (with the reference on tampered inputs)
    and checks it against the reference with the bound of the test above; the cpp kernel's result on
    the same inputs passes (the control).  The Gram bound is worst-case, gamma(n) of
    sum |J_i||J_j|: in float32 it catches a single dropped column at n ~ 1000 (shown here) but not at
    n ~ 1e5, where only bugs that move the sums by ~1% of their magnitude are caught; in float64 it
    catches one column out of 1e5.
    """
    # Gram: one column of J dropped (a chunk boundary skipped, an off-by-one in the tail).
    for tasks, n, dtype in ((8, 1023, torch.float32), (3, 100_003, torch.float64), (40, 517, torch.float32)):
        J = _jacobian(tasks, n, dtype, "cpu", seed=100 + n)
        want, bound = reference.gram(J), eb.gram_difference_bound(J)
        eb.assert_within(cpp_backend.gram(J), want, bound, "cpp gram (control)")
        dropped = J.clone()
        dropped[:, n // 2] = 0
        _must_fail(reference.gram(dropped), want, bound, f"gram without column {n // 2}, {dtype}")

    # combine: one task's weight off by 0.1% (a stale or mis-normalised w).
    J = _jacobian(8, 1023, torch.float32, "cpu", seed=110)
    w = torch.softmax(torch.randn(8, generator=_gen(111)), 0)
    before = _params(1023, torch.float32, "cpu", seed=112)
    got, want, planted = ([p.clone() for p in before] for _ in range(3))
    cpp_backend.combine(J, w, got, 0.05)
    reference.combine(J, w, want, 0.05)
    bounds = eb.combine_bound(J, w, before, want, 0.05)
    for a, b, e in zip(got, want, bounds):
        eb.assert_within(a, b, e, "cpp combine (control)")
    w_bad = w.clone()
    w_bad[3] *= 1.001
    reference.combine(J, w_bad, planted, 0.05)
    _must_fail(torch.cat([p.reshape(-1) for p in planted]), torch.cat([p.reshape(-1) for p in want]),
               torch.cat([e.reshape(-1) for e in bounds]), "combine with w[3] * 1.001")

    # gram_step: the mu z^2 w term left out of the w update (mu not passed on from the dual step);
    # alpha from a c2 0.1% off.  (Leaving out the rho w term, 1e-4 here, is below the w bound,
    # 7e-4: at n = 1023 the worst-case Gram bound, propagated, is coarser than that.)
    J, w, z, mu = _gram_step_inputs(8, 1023, torch.float32, "cpu", seed=120)
    before = _params(1023, torch.float32, "cpu", seed=121)

    def run(impl: Callable, mu_value: Tensor, c2: float) -> tuple:
        w_out, p_out = w.clone(), [p.clone() for p in before]
        out = impl(J, w_out, p_out, 0.1, 1.0, c2, 0.5, 1e-3, mu_value, z)
        return out, w_out, p_out

    want, w_want, p_want = run(reference.gram_step, mu, 0.05)
    bound = eb.gram_step_bounds(J, w, before, 0.1, 1.0, 0.05, 0.5, 1e-3, mu, z, want, w_want, p_want)
    got, w_got, p_got = run(cpp_backend.gram_step, mu, 0.05)
    eb.assert_within(w_got, w_want, bound.w, "cpp w (control)")
    eb.assert_within(got[2], want[2], bound.alpha, "cpp alpha (control)")
    _, w_planted, _ = run(reference.gram_step, torch.zeros_like(mu), 0.05)
    _must_fail(w_planted, w_want, bound.w, "w without the mu z^2 w term")
    planted, _, p_planted = run(reference.gram_step, mu, 0.05 * 1.001)
    _must_fail(planted[2], want[2], bound.alpha, "alpha with c2 * 1.001")
    _must_fail(torch.cat([p.reshape(-1) for p in p_planted]), torch.cat([p.reshape(-1) for p in p_want]),
               torch.cat([e.reshape(-1) for e in bound.params]), "theta stepped with c2 * 1.001")
    for a, b, e in zip(p_got, p_want, bound.params):
        eb.assert_within(a, b, e, "cpp theta (control)")

    # dual_forward: one sample of 256 left out of the batch means.
    losses, eta, _ = _losses(256, 5, torch.float32, "cpu", seed=130)
    kl = Divergence("kl")
    want = reference.dual_forward(losses, eta, 0.6, 1.0, kl)
    bound = eb.dual_forward_bounds(losses, eta, 0.6, 1.0, kl)
    got = cpp_backend.dual_forward(losses, eta, 0.6, 1.0, kl)
    eb.assert_within(got[1], want[1], bound.z, "cpp z (control)")
    eb.assert_within(got[0], want[0], bound.objective, "cpp objective (control)")
    planted = reference.dual_forward(losses[1:], eta, 0.6, 1.0, kl)
    _must_fail(planted[1], want[1], bound.z, "z without sample 0")
    _must_fail(planted[0], want[0], bound.objective, "objective without sample 0")

    # dual_step: the eta step 0.1% too long.
    w = torch.full((5,), 0.2)
    eta_want, eta_got, eta_planted = eta.clone(), eta.clone(), eta.clone()
    want = reference.dual_step(losses, eta_want, w, 0.6, 1.0, kl, 0.5, 1.0, 10.0)
    bound = eb.dual_step_bounds(losses, eta, w, 0.6, 1.0, kl, 0.5, 1.0, 10.0, None, want, eta_want)
    cpp_backend.dual_step(losses, eta_got, w, 0.6, 1.0, kl, 0.5, 1.0, 10.0)
    eb.assert_within(eta_got, eta_want, bound.eta, "cpp eta (control)")
    reference.dual_step(losses, eta_planted, w, 0.6, 1.0, kl, 0.5 * 1.001, 1.0, 10.0)
    _must_fail(eta_planted, eta_want, bound.eta, "eta with gamma * 1.001")


# ---------------------------------------------------------------------------- optimizer parity
def _run_double_clip(toy: Callable, backend: str, device: str, tasks: int, divergence: str, resample: bool,
                     dtype: torch.dtype):
    from drmoo.optim import DoubleClipMGDA

    problem = toy(num_tasks=tasks, dtype=dtype, seed=11)
    for tensor in (problem.inputs, problem.targets):
        tensor.data = tensor.data.to(device)
    for param in (problem.A, problem.c, problem.H):
        param.data = param.data.to(device)
    opt = DoubleClipMGDA(problem.shared, tasks, lr=0.05, pref_lr=0.3, rho=1e-3, c2=0.4, f2=0.3, lam=0.8,
                         divergence=divergence, resample=resample, backend=backend)
    assert opt.backend == backend
    heads = torch.optim.SGD([problem.H], lr=0.01)
    draw = problem.batches(seed=5)
    history = []
    for _ in range(12):
        heads.zero_grad()
        objective = opt.step(lambda: problem.losses(draw().to(device)))
        heads.step()
        history.append((objective.clone(), opt.w.clone(), opt.eta.clone(), opt.stats["alpha"].clone()))
    return problem.snapshot(), history


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("tasks", "divergence", "resample", "dtype"), [
    (3, "chi2", True, torch.float32),
    (1, "cvar_smooth(0.3)", False, torch.float32),
    (2, "cressie_read(2)", True, torch.float64),
    (4, "cressie_read(3)", True, torch.float64),
])
def test_double_clip_parity_with_reference(toy, backend, tasks: int, divergence: str, resample: bool,
                                           dtype: torch.dtype) -> None:
    name, _, device = backend
    ref_params, ref_hist = _run_double_clip(toy, "reference", device, tasks, divergence, resample, dtype)
    got_params, got_hist = _run_double_clip(toy, name, device, tasks, divergence, resample, dtype)
    tol = (1e-4, 1e-5) if dtype == torch.float32 else (1e-9, 1e-11)
    for got, ref in zip(got_hist, ref_hist):
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1])
    for a, b in zip(got_params, ref_params):
        torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1])
