"""``sum_squares``: the ``cpp`` kernel against the pure-torch reference, and both against the exact sums.

The op is the NaN/Inf guard of a list of gradients in one call (features mode's lift through the trunk), so
besides the values (every dtype, odd sizes that leave every tail and chunk boundary of the kernel, strided
and expanded tensors, empty ones, a list of one) it must get the guard right: a NaN entry gives NaN, an
infinite one +Inf, anywhere in the tensor, and a finite float16 gradient whose sum of squares is far above
float16's range stays finite (accumulated in float32).  The comparisons use error bounds
(tests/kernels/error_bounds.py), not fitted tolerances.  It has a CPU kernel only: on a GPU drmoo's guard
calls torch._foreach_norm, already one fused launch, and the other backends expose the reference.
"""

from __future__ import annotations

import re

import error_bounds as eb  # tests/kernels/error_bounds.py: tests/kernels is on pytest's pythonpath (pyproject.toml)
import pytest
import torch
from torch import Tensor

from drmoo_kernels import reference
from drmoo_kernels.backends import cpp as cpp_backend
from drmoo_kernels.backends import cuda as cuda_backend
from drmoo_kernels.backends import triton as triton_backend

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# Around every boundary of the kernel: the 8-lane vectors and 4-vector steps (32 floats, 16 doubles; bfloat16 16
# values per load), the 4096-element chunks, the 65536-element tasks; 0-d, empty and multi-dimensional ones.
SHAPES: list[tuple[int, ...]] = [(), (0,), (1,), (7,), (31,), (33,), (3, 5), (1023,), (4095,), (4097,), (2, 3, 5, 7),
                                 (65535,), (65537,), (3, 0), (131_075,)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tensors(dtype: torch.dtype, seed: int, scale: float = 1.0) -> list[Tensor]:
    gen = _gen(seed)
    return [(scale * torch.randn(shape, generator=gen)).to(dtype) for shape in SHAPES]


def _result_dtype(tensors: list[Tensor]) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_values(tensors: list[Tensor], what: str) -> None:
    """cpp against the reference (any-order bounds) and against the exact sums (the kernel's own bound)."""
    got, want = cpp_backend.sum_squares(tensors), reference.sum_squares(tensors)
    dtype = _result_dtype(tensors)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape == (len(tensors),), (what, got, want)
    eb.assert_within(got, want, eb.sum_squares_difference_bound(tensors).to(dtype), f"{what}: cpp vs reference")
    exact = eb.exact_sum_squares(tensors)
    eb.assert_within(got.double(), exact, eb.cpp_sum_squares_error_bound(tensors, dtype), f"{what}: cpp vs exact")
    eb.assert_within(want.double(), exact, eb.sum_squares_error_bound(tensors), f"{what}: reference vs exact")


def test_cpp_backend_has_the_op() -> None:
    assert cpp_backend.availability() is None, cpp_backend.availability()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("drmoo::sum_squares", "CPU")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sum_squares_matches_reference_and_the_exact_sums(dtype: torch.dtype) -> None:
    for seed, scale in ((0, 1.0), (1, 1e-3), (2, 30.0)):
        _check_values(_tensors(dtype, seed, scale), f"{dtype} scale {scale}")


def test_a_single_tensor_and_mixed_dtypes() -> None:
    for dtype in DTYPES:
        _check_values([torch.randn(5003, generator=_gen(3)).to(dtype)], f"k = 1, {dtype}")
    mixed = [torch.randn(300, generator=_gen(4)).to(dtype) for dtype in DTYPES]
    _check_values(mixed, "every dtype in one list (float64 result)")
    _check_values(mixed[:3], "16- and 32-bit dtypes (float32 result)")


def test_empty_tensors_give_zero_and_an_empty_list_an_empty_result() -> None:
    empties = [torch.empty(0), torch.empty(3, 0, dtype=torch.float16), torch.empty(0, dtype=torch.float64)]
    got = cpp_backend.sum_squares(empties)
    assert got.dtype == torch.float64 and torch.equal(got, torch.zeros(3, dtype=torch.float64))
    for module in (cpp_backend, reference):
        for nothing in ([], ()):
            out = module.sum_squares(nothing)
            assert out.dtype == torch.float32 and out.shape == (0,) and out.device.type == "cpu"
    # The op itself cannot be dispatched without a tensor: the backends' functions answer an empty list.
    with pytest.raises(NotImplementedError, match="no tensor arguments"):
        torch.ops.drmoo.sum_squares([])


def test_non_contiguous_and_expanded_tensors() -> None:
    gen = _gen(5)
    base = torch.randn(300, 70, generator=gen)
    cases = [base.t(), base[::3, 1::2], base[:, 5], torch.randn(4, 1, generator=gen).expand(4, 9000),
             base.t().to(torch.bfloat16), base.double()[::2].t()]
    assert not any(t.is_contiguous() for t in cases)
    _check_values(cases, "strided")
    # An expanded tensor counts each of its (repeated) entries: 9000 times each of the four values.
    column = torch.tensor([[1.0], [2.0], [3.0], [0.5]])
    assert float(cpp_backend.sum_squares([column.expand(4, 9000)])[0]) == 9000.0 * (1 + 4 + 9 + 0.25)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_nan_gives_nan_and_an_infinity_gives_inf(dtype: torch.dtype) -> None:
    """The guard's contract, at positions in every part of the kernel: the vector body, the tail of a chunk,
    a later chunk and a later task, and in a tensor's very last element."""
    n = 70_003
    for position in (0, 40, 4100, 70_001, n - 1):
        for bad, expected in ((float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "inf")):
            tensors = [torch.randn(n, generator=_gen(6)).to(dtype), torch.randn(33, generator=_gen(7)).to(dtype)]
            tensors[0][position] = bad
            got = cpp_backend.sum_squares(tensors)
            want = reference.sum_squares(tensors)
            for out, name in ((got, "cpp"), (want, "reference")):
                if expected == "nan":
                    assert torch.isnan(out[0]), (name, position, out)
                else:
                    assert torch.isinf(out[0]) and out[0] > 0, (name, position, bad, out)
                assert torch.isfinite(out[1]), (name, out)  # the other tensors' sums are untouched
        both = torch.randn(n, generator=_gen(8)).to(dtype)
        both[position] = float("inf")
        both[(position + 17) % n] = float("nan")
        assert torch.isnan(cpp_backend.sum_squares([both])[0])


def test_half_precision_is_accumulated_in_float32() -> None:
    """A million float16 entries of 60000 (finite): the sum, 3.6e15, is far above float16's 65504 and exact enough in
    float32; what a guard accumulating in float16 would have refused as non-finite."""
    big = torch.full((1_000_003,), 60000.0, dtype=torch.float16)
    got = cpp_backend.sum_squares([big])
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    _check_values([big, big.to(torch.bfloat16)], "large half-precision values")
    # A float32 sum beyond float32's range overflows to +Inf, as an unscaled float32 norm would (documented).
    assert torch.isinf(cpp_backend.sum_squares([torch.full((4,), 1e20)])[0])
    assert torch.isfinite(cpp_backend.sum_squares([torch.full((4,), 1e20, dtype=torch.float64)])[0])


def test_a_tensor_of_three_million_entries() -> None:
    gen = _gen(9)
    tensors = [torch.randn(3_000_017, generator=gen), torch.randn(1_000_003, generator=gen).to(torch.bfloat16)]
    _check_values(tensors, "3M + 1M entries")


def test_past_32_bit_offsets() -> None:
    """A bfloat16 tensor of 2^31 + 5 entries (4.3 GB): three nonzero entries whose squares (2^12, 2^20, 2^24) add up
    exactly in float32, one beyond 2^31: a wrapped 32-bit offset (reading the wrong element, or missing the
    last one) changes the sum."""
    n = (1 << 31) + 5
    x = torch.zeros(n, dtype=torch.bfloat16)
    x[0], x[(1 << 31) + 1], x[-1] = 2.0**6, 2.0**12, 2.0**10
    got = cpp_backend.sum_squares([x])
    assert float(got[0]) == 2.0**12 + 2.0**24 + 2.0**20
    del x


def test_the_bounds_catch_a_dropped_element() -> None:
    """The any-order bound is no blanket: the sum without one element of 1023 (a chunk or tail boundary skipped)
    fails the check the tests use; the cpp result on the same tensors passes (the control)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        tensors = [torch.randn(1023, generator=_gen(10)).to(dtype), torch.randn(77, generator=_gen(11)).to(dtype)]
        want = reference.sum_squares(tensors)
        bound = eb.sum_squares_difference_bound(tensors).to(_result_dtype(tensors))
        eb.assert_within(cpp_backend.sum_squares(tensors), want, bound, "cpp (control)")
        dropped = [tensors[0].clone(), tensors[1]]
        dropped[0][511] = 0
        with pytest.raises(AssertionError, match="exceeds the error bound"):
            eb.assert_within(reference.sum_squares(dropped), want, bound, f"without element 511, {dtype}")


def test_opcheck() -> None:
    gen = _gen(12)
    cases = [
        [torch.randn(3, 4, generator=gen)],
        [torch.randn(37, generator=gen), torch.randn(5, 3, generator=gen).t(), torch.empty(0),
         torch.randn(11, generator=gen).to(torch.bfloat16), torch.tensor(2.0, dtype=torch.float16)],
        [torch.randn(9, generator=gen).double(), torch.randn(4, generator=gen)],
    ]
    for tensors in cases:
        torch.library.opcheck(torch.ops.drmoo.sum_squares.default, (tensors,))


def test_traces_under_torch_compile() -> None:
    def guard(tensors: list[Tensor]) -> Tensor:
        return torch.isfinite(cpp_backend.sum_squares(tensors)).all()

    tensors = [torch.randn(100, generator=_gen(13)), torch.randn(7, 3, generator=_gen(14))]
    compiled = torch.compile(guard, backend="aot_eager", fullgraph=True)
    assert bool(compiled(tensors)) and bool(guard(tensors))
    tensors[1][2, 1] = float("nan")
    assert not bool(compiled(tensors)) and not bool(guard(tensors))


def test_bad_arguments_are_clear_errors() -> None:
    """The backends' functions raise the documented TypeError / RuntimeError; a direct op call a RuntimeError
    (the stable ABI's only type) with the same message; a meta tensor among real ones reaches the fake kernel,
    which refuses it with the same check."""
    for module in (cpp_backend, reference):
        with pytest.raises(TypeError, match=r"drmoo\.sum_squares: tensors must be a list or tuple of tensors, got "
                                            r"Tensor"):
            module.sum_squares(torch.ones(3))
        with pytest.raises(TypeError, match=r"tensors\[1\] must be float32, float64, float16 or bfloat16, got "
                                            r"torch\.int64"):
            module.sum_squares([torch.ones(2), torch.arange(3)])
        with pytest.raises(TypeError, match=r"tensors\[0\] must be a Tensor, got float"):
            module.sum_squares([1.0])
        with pytest.raises(RuntimeError, match=r"tensors\[1\] is on meta but the other inputs are on cpu"):
            module.sum_squares([torch.ones(2), torch.ones(2, device="meta")])
    ops = torch.ops.drmoo
    direct = [
        (r"^drmoo\.sum_squares: tensors\[1\] must be float32, float64, float16 or bfloat16, got Long$",
         lambda: ops.sum_squares([torch.ones(2), torch.arange(3)])),
        (r"tensors\[1\] is on meta but the other inputs are on cpu$",
         lambda: ops.sum_squares([torch.ones(2), torch.ones(2, device="meta")])),
    ]
    for pattern, call in direct:
        with pytest.raises(RuntimeError) as raised:
            call()
        assert re.search(pattern, str(raised.value).splitlines()[0]), (pattern, str(raised.value))


def test_the_gpu_backends_expose_the_reference() -> None:
    """No CUDA or Triton kernel (drmoo's guard keeps torch._foreach_norm on a GPU): their modules keep the set of
    ops complete with the reference itself."""
    assert cuda_backend.sum_squares is reference.sum_squares
    assert triton_backend.sum_squares is reference.sum_squares
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("drmoo::sum_squares", "CUDA")
