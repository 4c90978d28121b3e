"""Launch counts of the triton backend, and its multi-tensor ops on many odd-sized tensors.

Issue 13: the per-parameter ops (gram, combine, gram_step) must run in O(1) launches whatever the
number of parameter tensors (ResNet18 has 62), and the dual ops in one launch each.  Without a GPU
the kernels run in Triton's interpreter, which launches them exactly as a GPU run would (same grid,
same host code): here every launch of every kernel of ``drmoo_kernels.triton_kernels._kernels`` is
counted by wrapping the kernel objects, and every aten op by a ``TorchDispatchMode``.  A steady-state
call (the second with the same tensors) must also reuse its cached pointer tables: no table upload.

Correctness on the same many-tensor layouts is checked against the float64 math of the
reference, with tolerances from the float32 rounding-error bound of each sum (see ``_gram_bound``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import triton_setup  # tests/kernels/triton_setup.py: tests/kernels is on pytest's pythonpath (pyproject.toml)
from torch.utils._python_dispatch import TorchDispatchMode

_setup = triton_setup.import_triton()
_INTERPRETED, DEVICE, _SKIP_REASON = _setup.interpreted, _setup.device, _setup.skip_reason
if _SKIP_REASON is not None:
    pytest.skip(_SKIP_REASON, allow_module_level=True)

from triton.runtime.jit import KernelInterface  # noqa: E402

from drmoo_kernels import Divergence, reference  # noqa: E402
from drmoo_kernels._checks import trusted_arguments  # noqa: E402
from drmoo_kernels.backends import triton as tb  # noqa: E402
from drmoo_kernels.triton_kernels import interpreter_problem, load_kernels  # noqa: E402

U32 = torch.finfo(torch.float32).eps / 2  # unit roundoff of the kernels' float32 math


@pytest.fixture(autouse=True, scope="module")
def _interpreter_flag() -> Iterator[None]:
    yield from triton_setup.interpreter_flag(_INTERPRETED)


_IN_KERNEL = [False]  # set while a Triton kernel runs: the interpreter's own tensor work is not counted


class _CountingKernel:
    """Stands in for a Triton kernel object: ``kernel[grid](...)`` is counted, then launched."""

    def __init__(self, name: str, kernel: Any, launches: Counter[str]) -> None:
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launcher = self.kernel[grid]

        def launch(*args: Any, **kwargs: Any) -> Any:
            self.launches[self.name] += 1
            _IN_KERNEL[0] = True
            try:
                return launcher(*args, **kwargs)
            finally:
                _IN_KERNEL[0] = False

        return launch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # A jit function called from inside another kernel (a device function): not a launch.
        return self.kernel(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


class _AtenOps(TorchDispatchMode):
    """Counts the backend's aten ops that do device work (views only change metadata: not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not _IN_KERNEL[0] and not func.is_view:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Launch counts per kernel name, for every Triton kernel of the backend."""
    kernels = load_kernels()
    problem = interpreter_problem()  # its one-off probe launch happens now, not during a count
    if problem is not None:
        # e.g. the H200 image: Triton 3.6 with numpy 2.5 (both CI legs pin a numpy it runs with)
        pytest.skip(f"launches are counted in Triton's interpreter, which cannot run here: {problem}")
    counts: Counter[str] = Counter()
    names = [name for name, value in vars(kernels).items() if isinstance(value, KernelInterface)]
    assert {"dual_forward_kernel", "dual_step_kernel", "gram_partial_kernel", "combine_kernel"} <= set(names)
    for name in names:
        monkeypatch.setattr(kernels, name, _CountingKernel(name, getattr(kernels, name), counts))
    return counts


@pytest.fixture
def uploads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every pointer table uploaded to the device."""
    rows: list[int] = []
    upload = tb._upload_table

    def counting_upload(table_rows: list[tuple[int, int, int, int]], device: torch.device) -> torch.Tensor:
        rows.append(len(table_rows))
        return upload(table_rows, device)

    monkeypatch.setattr(tb, "_upload_table", counting_upload)
    # Tensors of an earlier test may have had the same addresses and sizes (their plans still fit).
    tb.clear_plan_cache()
    return rows


def _resnet_like_params(count: int, total: int, seed: int) -> list[torch.Tensor]:
    """``count`` contiguous parameters (matrices, conv-like 4-d weights, vectors) holding ``total`` elements."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1 + (7 * i) % 13 for i in range(count - 1)]
    sizes.append(total - sum(sizes))
    assert sizes[-1] > 0
    shapes = [(size,) if i % 3 else (1, size, 1, 1) for i, size in enumerate(sizes)]
    return [torch.randn(shape, generator=gen).to(DEVICE) for shape in shapes]


def _step_inputs(tasks: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    jac = torch.randn(tasks, n, generator=gen).to(DEVICE)
    w = torch.softmax(torch.linspace(1.0, -1.0, tasks), 0).to(DEVICE)
    return jac, w, torch.linspace(-0.5, 0.7, tasks, device=DEVICE), torch.tensor(0.8, device=DEVICE)


# ------------------------------------------------------------------------------- launch counts
@pytest.mark.parametrize("op", ["gram_step", "combine", "gram"])
def test_jacobian_ops_launch_a_fixed_number_of_kernels_for_any_parameter_count(
    op: str, launches: Counter[str], uploads: list[int]
) -> None:
    tasks, n = 3, 9000  # even one block is split over several programs
    per_count: dict[int, tuple[Counter[str], Counter[str]]] = {}
    for count in (1, 7, 62):
        jac, w, z, mu = _step_inputs(tasks, n, seed=count)
        params = _resnet_like_params(count, n, seed=count)
        # gram takes J as one block per parameter (the worst case for a per-tensor launch loop).
        blocks = list(jac.split([p.numel() for p in params], dim=1))

        def call(jac: torch.Tensor = jac, w: torch.Tensor = w, z: torch.Tensor = z, mu: torch.Tensor = mu,
                 params: list[torch.Tensor] = params, blocks: list[torch.Tensor] = blocks) -> None:
            if op == "gram_step":
                tb.gram_step(jac, w, params, 1e-3, 1.0, 0.5, 0.3, 1e-3, mu, z)
            elif op == "combine":
                tb.combine(jac, w, params, 1e-3)
            else:
                tb.gram(blocks)

        call()  # first call: builds and uploads the pointer tables
        assert 1 <= len(uploads) <= 2, uploads  # one table per launch
        uploads.clear()
        launches.clear()
        # Steady state, as an optimizer step calls the op: inside trusted_arguments, where the argument
        # checks that read tensor values on the host (a direct call's mu >= 0 check) are the step's own.
        with trusted_arguments(), _AtenOps() as aten:
            call()  # the same tensors again
        assert uploads == [], "a steady-state call uploaded a pointer table again"
        per_count[count] = (Counter(launches), aten.ops)
    expected = {
        "gram_step": {"gram_partial_kernel": 1, "gram_finalize_kernel": 1, "combine_kernel": 1},
        "combine": {"combine_kernel": 1},
        "gram": {"gram_partial_kernel": 1},
    }[op]
    # Besides the kernels: output allocations only (gram: and the sum of the partial Grams).
    allowed_aten = {"aten.empty", "aten.sum"} if op == "gram" else {"aten.empty"}
    for count, (triton_launches, aten_ops) in per_count.items():
        assert dict(triton_launches) == expected, (count, triton_launches)
        assert aten_ops == per_count[1][1], (count, aten_ops)  # no per-tensor torch work either
        assert set(aten_ops) <= allowed_aten, aten_ops


def test_dual_ops_are_one_launch_each(launches: Counter[str]) -> None:
    gen = torch.Generator().manual_seed(0)
    losses = (3.0 * torch.rand(256, 8, generator=gen)).to(DEVICE)
    eta = torch.zeros(8, device=DEVICE)
    w = torch.full((8,), 1.0 / 8, device=DEVICE)
    with _AtenOps() as aten:
        tb.dual_forward(losses, eta, 0.6, 1.0, Divergence("chi2"))
    assert dict(launches) == {"dual_forward_kernel": 1}
    assert set(aten.ops) <= {"aten.empty"}, aten.ops  # the outputs; no other device work
    launches.clear()
    with _AtenOps() as aten:
        tb.dual_step(losses, eta, w, 0.6, 1.0, Divergence("chi2"), 1e-3, 1.0, 0.5)
    assert dict(launches) == {"dual_step_kernel": 1}
    assert set(aten.ops) <= {"aten.empty"}, aten.ops


def test_mixed_parameter_dtypes_cost_one_launch_per_dtype_pair(launches: Counter[str]) -> None:
    jac, w, _, _ = _step_inputs(2, 700, seed=3)
    params = _resnet_like_params(9, 700, seed=4)
    params = [p.to(torch.bfloat16) if i % 2 else p for i, p in enumerate(params)]
    want = [p.clone() for p in params]
    tb.combine(jac, w, params, 0.3)
    reference.combine(jac, w, want, 0.3)
    assert dict(launches) == {"combine_kernel": 2}
    _assert_update_close(params, want, jac, w, 0.3)


# ---------------------------------------------------------------------- correctness, many tensors
def _gram_bound(blocks: list[torch.Tensor]) -> torch.Tensor:
    """|fl(G) - G| <= 2 n u (|J| |J|^T): two float32 sums of n products (kernel and reference)."""
    flat = torch.cat([b.reshape(b.shape[0], -1).double() for b in blocks], dim=1)
    return 2 * max(flat.shape[1], 1) * U32 * (flat.abs() @ flat.abs().T) + 1e-30


def _assert_gram_close(got: torch.Tensor, blocks: list[torch.Tensor]) -> None:
    flat = torch.cat([b.reshape(b.shape[0], -1).double() for b in blocks], dim=1)
    exact = flat @ flat.T
    error = (got.double() - exact).abs()
    bound = _gram_bound(blocks)
    assert bool((error <= bound).all()), f"Gram error {error.max():.3g} exceeds its bound where it is largest"


def _assert_update_close(
    got: list[torch.Tensor], want: list[torch.Tensor], jac: torch.Tensor, w: torch.Tensor, lr: float
) -> None:
    """p - lr J^T w, rounded to p's dtype: one rounding of the stored value, plus (m + 2) float32
    roundings of the dot product and the subtraction, relative to |p| + lr |w|^T |J|."""
    scale = lr * (w.abs().double() @ jac.abs().double())
    offset = 0
    for a, b in zip(got, want):
        count = a.numel()
        assert a.dtype == b.dtype and a.shape == b.shape
        size = scale[offset : offset + count].reshape(a.shape)
        offset += count
        ulp = torch.finfo(a.dtype).eps
        bound = ulp * b.double().abs() + (jac.shape[0] + 2) * 2 * U32 * (b.double().abs() + size) + ulp * 1e-30
        error = (a.double() - b.double()).abs()
        assert bool((error <= bound).all()), f"update error {error.max():.3g} exceeds its bound"


def _odd_params(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """13 parameters of odd sizes, one of them empty and one a transposed (strided) view."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 5), (7,), (0,), (1,), (11, 1, 3), (2, 17), (5,), (129,), (3, 3, 3), (1, 1), (31,), (6, 7), (13,)]
    params = [torch.randn(shape, generator=gen).to(dtype).to(DEVICE) for shape in shapes]
    params[11] = params[11].T.contiguous().T  # a [6, 7] view with strides (1, 6): not contiguous
    assert not params[11].is_contiguous()
    return params


# m = 70: two 64-row tiles per axis and gram_step's m x m part in torch ops (float32 only: the
# interpreter takes ~30 s per dtype there).
@pytest.mark.parametrize(("tasks", "dtype"), [(t, d) for t in (1, 3, 9) for d in (torch.float32, torch.bfloat16)]
                         + [(70, torch.float32)], ids=str)
def test_many_odd_tensors_match_the_reference(dtype: torch.dtype, tasks: int) -> None:
    params = _odd_params(seed=tasks, dtype=dtype)
    n = sum(p.numel() for p in params)
    gen = torch.Generator().manual_seed(100 + tasks)
    jac = torch.randn(tasks, n, generator=gen).to(dtype).to(DEVICE)
    w = torch.softmax(torch.linspace(1.0, -1.0, tasks), 0).to(DEVICE)
    # gram of one block per parameter (the empty one included), then of blocks that straddle them.
    per_param = list(jac.split([p.numel() for p in params], dim=1))
    _assert_gram_close(tb.gram(per_param), per_param)
    straddling = [jac[:, :10], jac[:, 10:11], jac[:, 11:11], jac[:, 11:200], jac[:, 200:]]
    _assert_gram_close(tb.gram(straddling), straddling)
    for blocks in (jac, per_param, straddling):
        got, want = [p.clone() for p in params], [p.clone() for p in params]
        tb.combine(blocks, w, got, 0.3)
        reference.combine(blocks, w, want, 0.3)
        _assert_update_close(got, want, jac.float(), w, 0.3)
    # gram_step: the Gram, alpha and the update against the reference's own float32 Gram.
    z, mu = torch.linspace(-0.5, 0.7, tasks, device=DEVICE), torch.tensor(0.8, device=DEVICE)
    for c2 in (0.05, 1e6):  # alpha clipped by c2 / ||d||, and alpha = c1
        got, want = [p.clone() for p in params], [p.clone() for p in params]
        w_got, w_want = w.clone(), w.clone()
        gram, d_norm, alpha = tb.gram_step(per_param, w_got, got, 0.1, 1.0, c2, 0.3, 1e-3, mu, z)
        _, ref_d, ref_alpha = reference.gram_step(per_param, w_want, want, 0.1, 1.0, c2, 0.3, 1e-3, mu, z)
        _assert_gram_close(gram, per_param)
        # d^2 = w^T G w moves by at most |w|^T bound |w|; d by that over (d + d_ref).
        d_slack = float(w.abs().double() @ _gram_bound(per_param) @ w.abs().double()) * 2
        assert abs(float(d_norm) - float(ref_d)) <= d_slack / (float(ref_d) + float(d_norm)) + 1e-6 * float(ref_d)
        # alpha = min(c1, c2 / d): relative error of d, plus the float32 rounding of the result.
        assert abs(float(alpha) - float(ref_alpha)) <= float(ref_alpha) * (
            abs(float(d_norm) - float(ref_d)) / float(ref_d) + 4 * U32)
        torch.testing.assert_close(w_got, w_want, rtol=1e-4, atol=1e-6)  # beta alpha G w: well inside 1e-4
        # The update at the alpha the kernel used (its error is checked above).
        want = [p.clone() for p in params]
        reference.combine(jac, w, want, 0.1 * float(alpha))
        _assert_update_close(got, want, jac.float(), w, 0.1 * float(alpha))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, in the interpreter
def test_many_tensors_non_finite_gram_writes_nothing() -> None:
    params = _odd_params(seed=5)
    n = sum(p.numel() for p in params)
    jac = torch.randn(4, n, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    jac[2, n - 3] = float("nan")  # in the last parameter's columns: every launch must still skip its writes
    w = torch.full((4,), 0.25, device=DEVICE)
    before, w_before = [p.clone() for p in params], w.clone()
    gram, d_norm, alpha = tb.gram_step(jac, w, params, 0.1, 1.0, 0.5, 0.3, 1e-3, 0.5, torch.ones(4, device=DEVICE))
    assert not bool(torch.isfinite(gram).all())
    assert bool(torch.isnan(d_norm)) and float(alpha) == 0.0
    assert torch.equal(w, w_before)
    assert all(torch.equal(a, b) for a, b in zip(params, before))


def test_plan_cache_follows_the_tensors(uploads: list[int]) -> None:
    """A plan is reused only for the same addresses and sizes: new tensors get a new, correct plan."""
    jac, w, _, _ = _step_inputs(3, 300, seed=9)
    first = _resnet_like_params(5, 300, seed=10)
    tb.combine(jac, w, first, 0.1)
    assert len(uploads) == 1
    tb.combine(jac, w, first, 0.1)
    assert len(uploads) == 1
    second = _resnet_like_params(5, 300, seed=11)  # same sizes, other addresses
    want = [p.clone() for p in second]
    tb.combine(jac, w, second, 0.1)
    reference.combine(jac, w, want, 0.1)
    assert len(uploads) == 2
    _assert_update_close(second, want, jac, w, 0.1)


def test_planted_bug_is_caught_by_the_gram_bound() -> None:
    """The bound is tight enough to see one dropped column of J."""
    blocks = list(torch.randn(3, 200, generator=torch.Generator().manual_seed(12)).to(DEVICE).split([70, 130], 1))
    good = tb.gram(blocks)
    _assert_gram_close(good, blocks)
    dropped = tb.gram([blocks[0], blocks[1][:, 1:]])
    with pytest.raises(AssertionError, match="Gram error"):
        _assert_gram_close(dropped, blocks)


def test_vector_load_hints_hold_for_every_table_entry() -> None:
    """ALIGN_* > 1 promises the compiler that every offset and stride is a multiple of a 16-byte
    vector: on a GPU a wrong promise is a misaligned-address fault, so check it for both layouts."""
    tb.clear_plan_cache()
    jac = torch.randn(3, 4 * 300, device=DEVICE)
    aligned = [torch.randn(4 * k, device=DEVICE) for k in (1, 7, 50, 242)]  # every size a multiple of 4
    odd = [torch.randn(size, device=DEVICE) for size in (5, 400, 795)]  # 5: every later column run is odd
    flat = torch.randn(1200, device=DEVICE)
    views = [flat[:5], flat[5:405], flat[405:]]  # parameters viewing one buffer at odd offsets
    # (params, J's runs vectorisable, the parameters' runs vectorisable): separate allocations
    # always start 16-byte aligned; views into one buffer start where their offset puts them.
    for params, j_vectors, p_vectors in ((aligned, True, True), (odd, False, True), (views, False, False)):
        blocks = tb._blocks(jac)
        plan = tb._combine_plan(blocks, tb._param_layout(blocks, params), 64, 4)
        gram_plan = tb._gram_plan(blocks, 64, 4)
        for launch in (*plan.launches, *gram_plan.launches):
            rows = launch.table.cpu()
            assert rows.shape[0] == launch.entries
            if launch.align_j > 1:
                assert bool((rows[:, :2] % launch.align_j == 0).all())
            if launch.align_p > 1:
                assert bool((rows[:, 2] % launch.align_p == 0).all())
        assert (plan.launches[0].align_j > 1) == j_vectors  # float32: 4 elements per vector
        assert (plan.launches[0].align_p > 1) == p_vectors
        assert gram_plan.launches[0].align_j == 4  # J itself: 1200 columns, row stride 1200
