"""Bitwise reproducibility of the ops on CPU (docs/guarantees.md, "Determinism"); `drmoo train --resume` relies on it.

* Same inputs, same thread count: gram / combine / gram_step / dual_forward / dual_step / sum_squares return
  bitwise-identical results (and write identical parameters, w and eta) on every call, for the
  ``cpp`` and the ``reference`` backends.  The inputs are fresh copies each time (other addresses,
  so nothing depends on alignment or on a cached result).
* Across thread counts (1, 2, 3): the ``cpp`` kernels split every reduction into tasks whose size
  depends only on the problem size (not on the thread count), sum each task separately and combine
  the task sums in task order, so the results are bitwise identical for any thread count too.  The
  ``reference`` backend is plain torch (BLAS matmul, torch reductions): torch does not promise that
  across thread counts, so it is not asserted here.
* CUDA (when a GPU is present): repeated calls on the same GPU are bitwise identical (the kernels
  use no atomics; every reduction has a fixed order).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from drmoo_kernels import Divergence, reference
from drmoo_kernels.backends import cpp as cpp_backend
from drmoo_kernels.backends import cuda as cuda_backend

HAS_CUDA = torch.cuda.is_available()

# Sizes at which every cpp pass runs on several threads (each goes parallel only above ~1 MB of
# traffic or ~64K loss entries per thread), plus small ones that run inline.
JACOBIAN_SHAPES = [(5, 300_001), (13, 40_003), (3, 1_001)]
DUAL_SHAPES = [(50_000, 5), (4_097, 13), (7, 3)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _jacobian_inputs(tasks: int, n: int, seed: int, device: str) -> dict[str, object]:
    gen = _gen(seed)
    J = torch.randn(tasks, n, generator=gen)
    params = torch.randn(n, generator=gen)
    first = n // 3
    return {
        "J": J.to(device),
        "params": [params[:first].clone().to(device), params[first:].clone().view(1, -1).to(device)],
        "w": torch.softmax(torch.randn(tasks, generator=gen), 0).to(device),
        "z": (0.5 * torch.randn(tasks, generator=gen)).to(device),
        "mu": torch.tensor(0.8).to(device),
    }


def _dual_inputs(batch: int, tasks: int, seed: int, device: str) -> dict[str, object]:
    gen = _gen(seed)
    return {
        "losses": (2.0 * torch.rand(batch, tasks, generator=gen)).to(device),
        "eta": (0.5 * torch.rand(tasks, generator=gen) - 0.1).to(device),
        "weight": (0.5 + torch.rand(batch, tasks, generator=gen)).to(device),
        "w": torch.softmax(torch.randn(tasks, generator=gen), 0).to(device),
    }


def _fresh(inputs: dict[str, object]) -> dict[str, object]:
    """Deep copies in new memory: a call must not depend on where its inputs live."""
    out: dict[str, object] = {}
    for key, value in inputs.items():
        out[key] = [v.clone() for v in value] if isinstance(value, list) else value.clone()  # type: ignore[union-attr]
    return out


def _run_all(module, jac: dict[str, object], dual: dict[str, object]) -> list[Tensor]:
    """Every op once, on fresh copies; returns every output and every tensor written in place."""
    results: list[Tensor] = []
    a = _fresh(jac)
    results.append(module.gram(a["J"]))
    module.combine(a["J"], a["w"], a["params"], 0.05)
    results += a["params"]
    b = _fresh(jac)
    results += module.gram_step(b["J"], b["w"], b["params"], 0.1, 1.0, 0.5, 0.3, 1e-3, b["mu"], b["z"])
    results += [b["w"], *b["params"]]
    d = _fresh(jac)
    results.append(module.sum_squares([d["J"], *d["params"], d["w"], d["J"].t()]))
    c = _fresh(dual)
    for divergence in (Divergence("kl"), Divergence("cressie_read", 2.5)):
        results += module.dual_forward(c["losses"], c["eta"], 0.6, 1.3, divergence, c["weight"])
        eta = c["eta"].clone()
        results += module.dual_step(c["losses"], eta, c["w"], 0.6, 1.3, divergence, 0.1, 1.0, 0.5)
        results.append(eta)
    return results


def _assert_bitwise_equal(first: list[Tensor], second: list[Tensor], what: str) -> None:
    assert len(first) == len(second)
    for k, (a, b) in enumerate(zip(first, second)):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, k)
        assert torch.equal(a, b), f"{what}: output {k} differs (max |diff| {float((a - b).abs().max()):.3e})"


CPU_BACKENDS = [pytest.param(cpp_backend, id="cpp"), pytest.param(reference, id="reference")]


@pytest.mark.parametrize("module", CPU_BACKENDS)
@pytest.mark.parametrize("case", range(3))
def test_same_inputs_same_threads_give_bitwise_identical_results(module, case: int) -> None:
    if module is cpp_backend:
        assert cpp_backend.availability() is None, cpp_backend.availability()
    jac = _jacobian_inputs(*JACOBIAN_SHAPES[case], seed=10 + case, device="cpu")
    dual = _dual_inputs(*DUAL_SHAPES[case], seed=20 + case, device="cpu")
    first = _run_all(module, jac, dual)
    second = _run_all(module, jac, dual)
    _assert_bitwise_equal(first, second, "two identical calls")


@pytest.mark.parametrize("case", range(3))
def test_cpp_results_do_not_depend_on_the_thread_count(case: int) -> None:
    """The threads claim tasks dynamically; this also checks the task sums are combined in a fixed order."""
    assert cpp_backend.availability() is None, cpp_backend.availability()
    jac = _jacobian_inputs(*JACOBIAN_SHAPES[case], seed=30 + case, device="cpu")
    dual = _dual_inputs(*DUAL_SHAPES[case], seed=40 + case, device="cpu")
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):  # 3 on a 2-core machine: more threads than cores changes nothing either
            torch.set_num_threads(count)
            results.append(_run_all(cpp_backend, jac, dual))
    finally:
        torch.set_num_threads(threads)
    _assert_bitwise_equal(results[0], results[1], "1 vs 2 threads")
    _assert_bitwise_equal(results[0], results[2], "1 vs 3 threads")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("case", range(3))
def test_cuda_results_are_bitwise_reproducible(case: int) -> None:
    assert cuda_backend.availability() is None, cuda_backend.availability()
    jac = _jacobian_inputs(*JACOBIAN_SHAPES[case], seed=50 + case, device="cuda")
    dual = _dual_inputs(*DUAL_SHAPES[case], seed=60 + case, device="cuda")
    first = _run_all(cuda_backend, jac, dual)
    second = _run_all(cuda_backend, jac, dual)
    _assert_bitwise_equal(first, second, "two identical calls on the GPU")


def _double_clip_run(toy: Callable, backend: str, threads: int) -> list[Tensor]:
    from drmoo.optim import DoubleClipMGDA

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        problem = toy(num_tasks=3, dtype=torch.float32, seed=11)
        opt = DoubleClipMGDA(problem.shared, 3, lr=0.05, pref_lr=0.3, rho=1e-3, c2=0.4, f2=0.3, lam=0.8,
                             divergence="chi2", resample=True, backend=backend)
        heads = torch.optim.SGD([problem.H], lr=0.01)
        draw = problem.batches(seed=5)
        for _ in range(6):
            heads.zero_grad()
            opt.step(lambda: problem.losses(draw()))
            heads.step()
        return [*problem.snapshot(), opt.w.clone(), opt.eta.clone()]
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_an_optimizer_run_is_bitwise_reproducible(toy, backend: str) -> None:
    """Whole DoubleClipMGDA steps (ops + autograd), run twice from the same seed: identical parameters."""
    threads = torch.get_num_threads()
    _assert_bitwise_equal(_double_clip_run(toy, backend, threads), _double_clip_run(toy, backend, threads),
                          f"two DoubleClipMGDA runs ({backend})")
