"""Hostile input, round six (the kernel ops and the divergences): one test per defect, named after it.

The cpp Gram of a float16/bfloat16 J with many tasks was half precision; gram_step reported a NaN norm as 0;
inference tensors and J blocks of mixed dtypes got past the checks; the divergence call syntax took a wrong
keyword or an empty value, and a Divergence kept a text parameter.  (Triton's NaN propagation:
test_triton_ops.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drmoo_kernels import Divergence, get_divergence, reference
from drmoo_kernels._blas_gram import BLAS_MIN_TASKS
from drmoo_kernels.backends import cpp

BACKENDS = {"reference": reference, "cpp": cpp}


# --------------------------------------------------------------------- the cpp Gram of a half-precision J
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tasks", [BLAS_MIN_TASKS - 1, BLAS_MIN_TASKS, 2 * BLAS_MIN_TASKS + 3])
def test_the_cpp_gram_of_a_half_precision_jacobian_is_float32_at_every_task_count(
        dtype: torch.dtype, tasks: int) -> None:
    jacobian = torch.randn(tasks, 300, generator=torch.Generator().manual_seed(tasks)).to(dtype)
    got, want = cpp.gram(jacobian), reference.gram(jacobian)
    assert got.dtype == want.dtype == torch.float32
    # Both sum the same float32 products of exactly representable entries, in different orders: the float32
    # summation error bound, n * eps * sum |J_i||J_j| <= n * eps * max diag, is far below 1e-3 of the diagonal.
    bound = 300 * torch.finfo(torch.float32).eps * want.diagonal().max()
    torch.testing.assert_close(got, want, rtol=0, atol=float(bound))


def test_a_float16_gram_whose_entries_exceed_float16_stays_finite() -> None:
    jacobian = torch.full((BLAS_MIN_TASKS, 1000), 10.0, dtype=torch.float16)  # each entry of J J^T is 1e5
    assert torch.equal(cpp.gram(jacobian), torch.full((BLAS_MIN_TASKS, BLAS_MIN_TASKS), 1e5))


# ----------------------------------------------------------------------- gram_step with a NaN weight
@pytest.mark.parametrize("backend", BACKENDS)
def test_gram_step_reports_a_nan_norm_for_a_nan_weight(backend: str) -> None:
    w = torch.tensor([float("nan"), 0.5])
    _, d_norm, _ = BACKENDS[backend].gram_step(torch.ones(2, 3), w, [torch.zeros(3)], 0.1, 1.0, 1.0, 0.1, 0.0, 0.0,
                                               torch.ones(2))
    assert bool(torch.isnan(d_norm).all())


# ------------------------------------------------------------------------------- inference tensors
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_inference_parameter_is_refused_before_any_parameter_is_written(backend: str) -> None:
    with torch.inference_mode():
        frozen = torch.zeros(3)
    first = torch.zeros(2)
    with pytest.raises(RuntimeError, match=r"params\[1\] is an inference tensor"):
        BACKENDS[backend].combine(torch.ones(2, 5), torch.ones(2), [first, frozen], 0.1)
    assert torch.equal(first, torch.zeros(2)) and torch.equal(frozen, torch.zeros(3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_inference_w_is_refused_before_gram_step_writes_the_parameters(backend: str) -> None:
    with torch.inference_mode():
        w = torch.full((2,), 0.5)
    params = [torch.zeros(5)]
    with pytest.raises(RuntimeError, match="w is an inference tensor"):
        BACKENDS[backend].gram_step(torch.ones(2, 5), w, params, 0.1, 1.0, 1.0, 0.1, 0.0, 0.0, torch.ones(2))
    assert torch.equal(params[0], torch.zeros(5))


def test_inference_tensors_are_written_inside_inference_mode() -> None:
    with torch.inference_mode():
        params = [torch.zeros(5)]
        cpp.combine(torch.ones(2, 5), torch.ones(2), params, 0.5)
        assert torch.equal(params[0], torch.full((5,), -1.0))


# -------------------------------------------------------------------------- J blocks of mixed dtypes
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params_dtype", [torch.float32, torch.float64])
def test_jacobian_blocks_of_mixed_dtypes_are_refused_by_name(backend: str, params_dtype: torch.dtype) -> None:
    blocks = [torch.ones(2, 2), torch.ones(2, 3, dtype=torch.float64)]
    params = [torch.zeros(5, dtype=params_dtype)]
    with pytest.raises(TypeError, match=r"the blocks of J must share one dtype, but J\[0\] is torch.float32 and "
                                        r"J\[1\] is torch.float64"):
        BACKENDS[backend].combine(blocks, torch.ones(2), params, 0.1)
    assert torch.equal(params[0], torch.zeros(5, dtype=params_dtype))


# ------------------------------------------------------------------------------------ the divergences
@pytest.mark.parametrize(("spec", "message"), [
    ("cvar_smooth(k=0.2)", "takes alpha, not k"),
    ("cressie_read(alpha=3)", "takes k, not alpha"),
    ("cvar_smooth(alpha=)", "gives alpha= no value"),
    ("chi2(x=)", "takes no parameter"),
    ("kl(param=1)", "takes no parameter"),
    ("kl(0.5)", "takes no parameter"),
])
def test_a_divergence_spec_with_a_wrong_or_empty_parameter_is_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_divergence(spec)


def test_a_parameter_for_a_divergence_without_one_is_refused() -> None:
    with pytest.raises(ValueError, match="'kl' takes no parameter"):
        get_divergence("kl", 0.5)


@pytest.mark.parametrize(("spec", "expected"), [
    ("cvar_smooth(alpha=0.2)", Divergence("cvar_smooth", 0.2)),
    ("cvar_smooth(0.2)", Divergence("cvar_smooth", 0.2)),
    ("cressie_read(k=3)", Divergence("cressie_read", 3.0)),
    ("cvar_smooth()", get_divergence("cvar_smooth")),
    ("chi2", Divergence("chi2")),
])
def test_valid_divergence_specs_still_parse(spec: str, expected: Divergence) -> None:
    assert get_divergence(spec) == expected


@pytest.mark.parametrize("param", ["0.2", "abc", True, None])
def test_a_divergence_parameter_must_be_a_number(param: object) -> None:
    with pytest.raises(ValueError, match="must be a number"):
        Divergence("cvar_smooth", param)  # type: ignore[arg-type]


def test_a_numpy_parameter_is_kept_as_a_python_float() -> None:
    divergence = Divergence("cvar_smooth", np.float32(0.25))  # type: ignore[arg-type]
    assert type(divergence.param) is float and divergence.param == 0.25 and str(divergence) == "cvar_smooth(0.25)"


# ------------------------------------------------------------------- compiled ops and autograd
def test_a_compiled_op_refuses_an_input_that_requires_grad_in_grad_mode() -> None:
    """cpp's outputs carried requires_grad without an autograd kernel: backward left the input's .grad None."""
    losses = torch.rand(4, 2, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"cpp.dual_forward: losses requires grad, but the compiled ops have no "
                                           r"autograd formula"):
        cpp.dual_forward(losses, torch.zeros(2), 0.8, 1.0, Divergence("chi2"))
    jacobian = torch.rand(2, 5, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"cpp\.gram: J requires grad"):
        cpp.gram(jacobian)


def test_a_compiled_op_runs_on_the_same_inputs_without_grad_mode_or_detached() -> None:
    losses = torch.rand(4, 2, requires_grad=True)
    with torch.no_grad():
        inside = cpp.dual_forward(losses, torch.zeros(2), 0.8, 1.0, Divergence("chi2"))
    detached = cpp.dual_forward(losses.detach(), torch.zeros(2), 0.8, 1.0, Divergence("chi2"))
    for a, b in zip(inside, detached):
        assert torch.equal(a, b)


def test_the_reference_backend_still_differentiates() -> None:
    losses = torch.rand(4, 2, requires_grad=True)
    objective, _, _ = reference.dual_forward(losses, torch.zeros(2), 0.8, 1.0, Divergence("chi2"))
    objective.sum().backward()
    assert losses.grad is not None and bool(torch.isfinite(losses.grad).all())
