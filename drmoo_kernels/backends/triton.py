"""The ``triton`` backend: Triton kernels for the five ops of :mod:`drmoo_kernels.reference`.

Same signatures, return values and in-place semantics as the reference (read it for the math).
The kernels compute in float32, the contract for float32/bfloat16/float16 inputs; float64 inputs
(which the reference keeps in float64) run the reference itself.  CUDA tensors run compiled
kernels; CPU tensors run the same kernels through Triton's interpreter (numpy on the host - a
correctness path for tests, not a performance path).  Importing this module
does not import triton; the kernels are loaded on first use (see :mod:`drmoo_kernels.triton_kernels`).

Work split:

* ``dual_forward``: one program per block of task columns, each walking the batch once.
* ``dual_step``: a single program (the clip factor mu couples all tasks): pass 1 reduces z, the eta
  step happens in registers, pass 2 writes the weights at eta_{t+1}.
* ``gram``: split reduction over the columns of J into per-program m x m partials, then a sum;
  for m > 64 the m x m output is tiled in 64 x 64 blocks (a grid axis per tile coordinate).
* ``combine``: one launch per parameter tensor over its contiguous column range of J, walking the
  rows 64 at a time.
* ``gram_step``: ``gram``, the m x m work in float64 torch ops on the device (no host sync), and the
  ``combine`` pass with every load/store masked by the Gram's finiteness (the no-write guard).
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from .. import reference
from ..divergences import Divergence, get_divergence

__all__ = ["availability", "combine", "dual_forward", "dual_step", "gram", "gram_step"]

JacobianBlocks = Tensor | Sequence[Tensor]

# Elements per register tile.  On a GPU 4096 fp32 values keep a 4-warp program at 32 per thread;
# the interpreter pays Python overhead per tile operation, so there bigger tiles are much faster.
_GPU_TILE = 4096
_INTERPRETER_TILE = 1 << 16
_MAX_COLUMN_BLOCK = 64  # dual_forward: tasks per program
# gram/combine: rows per register tile.  A 64 x 64 float32 accumulator fits an 8-warp program's
# registers; 128 x 128 does not (ptxas spills it to local memory), so larger m is tiled.
_MAX_ROW_BLOCK = 64


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in {"1", "true", "on", "yes"}


def availability() -> str | None:
    """None when triton imports and there is a CUDA device or ``TRITON_INTERPRET=1``, else why not.

    Without a CUDA device and without the variable, triton is not even imported: an import here
    would fix triton in compiled mode for the rest of the process (see :mod:`..triton_kernels`),
    and a test that sets ``TRITON_INTERPRET=1`` later could no longer use the interpreter.
    """
    if importlib.util.find_spec("triton") is None:
        return "the 'triton' package is not installed"
    from .._compat import triton_version_problem  # the supported range (README), read without importing triton

    too_old = triton_version_problem()
    if too_old is not None:
        return too_old
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not _interpret_requested():
        return "there is no CUDA device (set TRITON_INTERPRET=1 to run the Triton kernels on the CPU, slowly)"
    try:
        from ..triton_kernels import triton_interpreted

        interpreted = triton_interpreted()
    except Exception as error:  # a broken install raises more than ImportError
        return f"triton failed to import ({type(error).__name__}: {error})"
    if not has_cuda and not interpreted:
        return (
            "there is no CUDA device, and TRITON_INTERPRET=1 came too late: triton was already imported in "
            "compiled mode (the variable must be set before the first 'import triton')"
        )
    return None


def _kernels(device: torch.device) -> ModuleType:
    from ..triton_kernels import load_kernels, triton_interpreted

    if device.type == "cpu" and not triton_interpreted():
        raise RuntimeError(
            "the triton backend got CPU tensors, but triton runs in compiled (GPU) mode in this process; "
            "CPU tensors need TRITON_INTERPRET=1 set before triton is first imported"
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"the triton backend runs on CUDA tensors (or CPU tensors, interpreted), not {device}")
    return load_kernels()


def _interpreted() -> bool:
    from ..triton_kernels import triton_interpreted

    return triton_interpreted()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(value: int) -> int:
    return 1 << max(0, int(value) - 1).bit_length()


# ---------------------------------------------------------------------------------- launch shapes
# One function per kernel decides its compile-time block sizes from the problem size; the launch
# code and the GPU code-generation test (tests/kernels/test_gpu_codegen.py) both use them, so the
# test compiles exactly the variants a GPU run would launch.
@dataclass(frozen=True)
class DualLaunch:
    """dual_forward / dual_step: BLOCK_B rows x BLOCK_M task columns per tile; ``programs`` on axis 0."""

    block_b: int
    block_m: int
    programs: int


@dataclass(frozen=True)
class GramLaunch:
    """gram_partial_kernel: BLOCK_M-row tiles (``row_tiles`` per axis) x BLOCK_N columns, ``num_warps`` warps."""

    block_m: int
    block_n: int
    use_dot: bool
    row_tiles: int
    num_warps: int

    @property
    def one_tile(self) -> bool:
        return self.row_tiles == 1


@dataclass(frozen=True)
class CombineLaunch:
    """combine_kernel: BLOCK_M rows at a time over BLOCK_N columns per program."""

    block_m: int
    block_n: int


def _tile_elements(interpreted: bool) -> int:
    return _INTERPRETER_TILE if interpreted else _GPU_TILE


def _dual_launch(batch: int, tasks: int, block_m: int, interpreted: bool) -> DualLaunch:
    """Rows per tile: the tile's element budget over its columns, at most the (padded) batch."""
    block_b = min(max(_tile_elements(interpreted) // block_m, 1), _pow2(batch))
    return DualLaunch(block_b, block_m, _cdiv(tasks, block_m))


def dual_forward_launch(batch: int, tasks: int, interpreted: bool) -> DualLaunch:
    return _dual_launch(batch, tasks, min(_pow2(tasks), _MAX_COLUMN_BLOCK), interpreted)


def dual_step_launch(batch: int, tasks: int, interpreted: bool) -> DualLaunch:
    # All tasks in one program: mu is a norm over every task.
    return _dual_launch(batch, tasks, _pow2(tasks), interpreted)


def gram_launch(tasks: int, interpreted: bool) -> GramLaunch:
    tile = _tile_elements(interpreted)
    block_m = min(_pow2(tasks), _MAX_ROW_BLOCK)
    use_dot = block_m >= 16
    if use_dot:
        block_n = max(16, tile // block_m)
    else:  # the broadcast product holds BLOCK_M x BLOCK_M x BLOCK_N values
        block_n = max(16, (tile if interpreted else 2 * tile) // (block_m * block_m))
    # A 64 x 64 float32 accumulator and its dot operands need 8 warps' registers: with 4, ptxas
    # spills (40-192 bytes of stack for fp32/bf16 on sm_90, tests/kernels/test_gpu_codegen.py).
    num_warps = 8 if block_m >= 64 else 4
    return GramLaunch(block_m, block_n, use_dot, _cdiv(tasks, block_m), num_warps)


def combine_launch(tasks: int, interpreted: bool) -> CombineLaunch:
    block_m = min(_pow2(tasks), _MAX_ROW_BLOCK)
    return CombineLaunch(block_m, max(16, _tile_elements(interpreted) // block_m))


def _divergence_constants(divergence: Divergence) -> tuple[float, float, float, float]:
    """P0..P3 of the kernels (see ``_kernels._conj_and_grad``), computed in double on the host."""
    if divergence.code == 2:
        alpha = float(divergence.param)
        return math.log1p(-alpha), math.log(alpha), math.log(alpha / (1.0 - alpha)), 1.0 / alpha
    if divergence.code == 3:
        k = float(divergence.param)
        return k - 1.0, 1.0 / (k - 1.0), 1.0 / k, 0.0
    return 0.0, 0.0, 0.0, 0.0


def _float64(*tensors: Tensor | None) -> bool:
    return any(t is not None and t.dtype == torch.float64 for t in tensors)


def _bump_version(tensor: Tensor) -> None:
    # Kernels write through raw pointers; tell autograd the tensor changed, as an in-place op would.
    torch.autograd.graph.increment_version(tensor)


def _check_dual_inputs(
    losses: Tensor, eta: Tensor, sample_weight: Tensor | None, divergence: Divergence | str
) -> tuple[Divergence, Tensor | None]:
    if losses.dim() != 2:
        raise ValueError(f"losses must be [B, m], got shape {tuple(losses.shape)}")
    batch, tasks = losses.shape
    if batch == 0:
        raise ValueError("empty batch (B = 0): the dual objective needs at least one sample")
    if tasks == 0:
        raise ValueError("losses have no task columns (m = 0)")
    if not losses.is_floating_point():
        raise TypeError(f"losses must be floating point, got {losses.dtype}")
    if eta.shape != (tasks,):
        raise ValueError(f"eta must have shape ({tasks},) to match losses {tuple(losses.shape)}, "
                         f"got {tuple(eta.shape)}")
    if eta.device != losses.device:
        raise ValueError(f"eta is on {eta.device} but losses are on {losses.device}")
    if sample_weight is not None:
        if sample_weight.shape != losses.shape:
            raise ValueError(
                f"sample_weight must have the shape of losses {tuple(losses.shape)}, got {tuple(sample_weight.shape)}"
            )
        if sample_weight.dtype == torch.bool or not sample_weight.is_floating_point():
            sample_weight = sample_weight.to(torch.float32)
        sample_weight = sample_weight.to(losses.device)
    return get_divergence(divergence), sample_weight


def dual_forward(
    losses: Tensor,
    eta: Tensor,
    lam: float,
    scale: float,
    divergence: Divergence,
    sample_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-task dual objective, its eta-gradient z and the per-sample loss cotangents (float32)."""
    divergence, sample_weight = _check_dual_inputs(losses, eta, sample_weight, divergence)
    if _float64(losses):
        return reference.dual_forward(losses, eta, lam, scale, divergence, sample_weight)
    device = losses.device
    kernels = _kernels(device)
    batch, tasks = losses.shape
    launch = dual_forward_launch(batch, tasks, _interpreted())
    objective = torch.empty(tasks, device=device, dtype=torch.float32)
    grad_eta = torch.empty(tasks, device=device, dtype=torch.float32)
    weights = torch.empty(batch, tasks, device=device, dtype=torch.float32)
    sw = losses if sample_weight is None else sample_weight
    eta_in = eta.contiguous()
    kernels.dual_forward_kernel[(launch.programs,)](
        losses, sw, eta_in, objective, grad_eta, weights,
        batch, tasks, losses.stride(0), losses.stride(1), sw.stride(0), sw.stride(1),
        float(batch), float(lam), float(scale), *_divergence_constants(divergence),
        CODE=divergence.code, HAS_SW=sample_weight is not None, BLOCK_B=launch.block_b, BLOCK_M=launch.block_m,
    )
    return objective, grad_eta, weights


def dual_step(
    losses: Tensor,
    eta: Tensor,
    w: Tensor,
    lam: float,
    scale: float,
    divergence: Divergence,
    gamma: float,
    f1: float,
    f2: float,
    sample_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Alg. 2 steps 1-3: z at eta_t, mu, eta_{t+1} (in place), weights at eta_{t+1}; one launch."""
    divergence, sample_weight = _check_dual_inputs(losses, eta, sample_weight, divergence)
    batch, tasks = losses.shape
    if w.shape != (tasks,):
        raise ValueError(f"w must have shape ({tasks},), got {tuple(w.shape)}")
    if _float64(losses):
        return reference.dual_step(losses, eta, w, lam, scale, divergence, gamma, f1, f2, sample_weight)
    device = losses.device
    kernels = _kernels(device)
    launch = dual_step_launch(batch, tasks, _interpreted())
    z = torch.empty(tasks, device=device, dtype=torch.float32)
    mu = torch.empty((), device=device, dtype=torch.float32)
    weights = torch.empty(batch, tasks, device=device, dtype=torch.float32)
    sw = losses if sample_weight is None else sample_weight
    # The kernel updates eta through its pointer; a strided eta goes through a contiguous copy.
    eta_work = eta if eta.is_contiguous() else eta.contiguous()
    kernels.dual_step_kernel[(launch.programs,)](
        losses, sw, eta_work, w.contiguous(), z, mu, weights,
        batch, tasks, losses.stride(0), losses.stride(1), sw.stride(0), sw.stride(1),
        float(batch), float(lam), float(scale), float(gamma), float(f1), float(f2),
        *_divergence_constants(divergence),
        CODE=divergence.code, HAS_SW=sample_weight is not None, ETA_F64=eta.dtype == torch.float64,
        BLOCK_B=launch.block_b, BLOCK_M=launch.block_m,
    )
    if eta_work is not eta:
        eta.copy_(eta_work)
    else:
        _bump_version(eta)
    return z, mu, weights


def _blocks(jacobian: JacobianBlocks) -> list[Tensor]:
    """J as [m, n_k] blocks whose columns are unit-stride (copying only a block that is not)."""
    raw = [jacobian] if isinstance(jacobian, Tensor) else list(jacobian)
    if not raw:
        raise ValueError("gram needs at least one block of J")
    tasks = raw[0].shape[0] if raw[0].dim() > 0 else 0
    out = []
    for block in raw:
        if block.dim() == 0 or block.shape[0] != tasks:
            raise ValueError(f"every block of J must have {tasks} rows, got shape {tuple(block.shape)}")
        flat = block.reshape(tasks, -1)
        if flat.shape[1] > 1 and flat.stride(1) != 1:
            flat = flat.contiguous()
        out.append(flat)
    if tasks == 0:
        raise ValueError("J has no rows (m = 0)")
    return out


def _gram_blocks(blocks: list[Tensor]) -> Tensor:
    tasks = blocks[0].shape[0]
    device = blocks[0].device
    kernels = _kernels(device)
    interpreted = _interpreted()
    launch = gram_launch(tasks, interpreted)
    block_n = launch.block_n
    # Enough programs to fill a GPU several times over; few in the interpreter, where each program
    # is a Python loop (still more than one, so the split reduction itself is exercised).
    max_programs = 4 if interpreted else 8 * torch.cuda.get_device_properties(device).multi_processor_count
    partials = []
    for block in blocks:
        n = block.shape[1]
        if n == 0:
            continue
        n_tiles = _cdiv(n, block_n)
        programs = min(n_tiles, max_programs)
        chunk = _cdiv(n_tiles, programs) * block_n
        programs = _cdiv(n, chunk)
        part = torch.empty(programs, tasks, tasks, device=device, dtype=torch.float32)
        kernels.gram_partial_kernel[(programs, launch.row_tiles, launch.row_tiles)](
            block, part, tasks, n, block.stride(0), chunk,
            BLOCK_M=launch.block_m, BLOCK_N=block_n, USE_DOT=launch.use_dot, ONE_TILE=launch.one_tile,
            num_warps=launch.num_warps,
        )
        partials.append(part)
    if not partials:
        return torch.zeros(tasks, tasks, device=device, dtype=torch.float32)
    return torch.cat(partials).sum(dim=0)


def gram(jacobian: JacobianBlocks) -> Tensor:
    """J J^T in float32, summed over the column blocks (split reduction over the columns)."""
    blocks = _blocks(jacobian)
    if _float64(*blocks):
        return reference.gram(blocks)
    return _gram_blocks(blocks)


def _segments(blocks: list[Tensor], params: Sequence[Tensor]) -> list[tuple[Tensor, int, Tensor]]:
    """(block, first column, parameter) for each parameter: the columns of J that update it."""
    counts = [p.numel() for p in params]
    columns = sum(b.shape[1] for b in blocks)
    if sum(counts) != columns:
        raise ValueError(f"J has {columns} columns but the parameters hold {sum(counts)} elements")
    if len(blocks) > 1 and [b.shape[1] for b in blocks] != counts:
        # Blocks that do not line up with the parameters: fall back to one flat copy of J.
        blocks = [torch.cat(blocks, dim=1)]
    if len(blocks) > 1:
        return [(b, 0, p) for b, p in zip(blocks, params)]
    segments, start = [], 0
    for param, count in zip(params, counts):
        segments.append((blocks[0], start, param))
        start += count
    return segments


def _combine_blocks(
    blocks: list[Tensor], w: Tensor, params: Sequence[Tensor], lr: float | Tensor, flag: Tensor | None
) -> None:
    tasks = blocks[0].shape[0]
    if w.shape != (tasks,):
        raise ValueError(f"w must have shape ({tasks},) to match J's {tasks} rows, got {tuple(w.shape)}")
    device = blocks[0].device
    kernels = _kernels(device)
    segments = _segments(blocks, params)
    launch = combine_launch(tasks, _interpreted())
    w_in = w.contiguous()
    lr_is_tensor = isinstance(lr, Tensor)
    lr_tensor = lr.reshape(()).to(device=device, dtype=torch.float32) if lr_is_tensor else w_in
    lr_value = 0.0 if lr_is_tensor else float(lr)
    for block, col0, param in segments:
        count = param.numel()
        if count == 0:
            continue
        if param.device != device:
            raise ValueError(f"a parameter is on {param.device} but J is on {device}")
        target = param if param.is_contiguous() else param.contiguous()
        kernels.combine_kernel[(_cdiv(count, launch.block_n),)](
            block, w_in, target, lr_tensor, w_in if flag is None else flag,
            tasks, count, block.stride(0), col0, lr_value,
            LR_IS_TENSOR=lr_is_tensor, HAS_FLAG=flag is not None, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        )
        if target is not param:
            param.copy_(target)
        else:
            _bump_version(param)


def combine(jacobian: JacobianBlocks, w: Tensor, params: Sequence[Tensor], lr: float | Tensor) -> None:
    """params -= lr * J^T w, one launch per parameter (float32 math, rounded on store)."""
    blocks = _blocks(jacobian)
    if _float64(*blocks, *params):
        reference.combine(blocks, w, params, lr)
        return
    _combine_blocks(blocks, w, params, lr, None)


def gram_step(
    jacobian: JacobianBlocks,
    w: Tensor,
    params: Sequence[Tensor],
    gamma: float,
    c1: float,
    c2: float,
    beta: float,
    rho: float,
    mu: Tensor | float,
    z: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Alg. 2 steps 4-5 (see the reference): nothing is written when the Gram is not finite."""
    blocks = _blocks(jacobian)
    if _float64(*blocks, *params):
        return reference.gram_step(blocks, w, params, gamma, c1, c2, beta, rho, mu, z)
    gram_matrix = _gram_blocks(blocks)
    # The m x m work is tiny: the reference's float64 torch ops on the device, no host synchronisation.
    finite, alpha, d_norm, w_next = reference.gram_step_small(gram_matrix, w, c1, c2, beta, rho, mu, z)
    _combine_blocks(blocks, w, params, (gamma * alpha).float(), finite.to(torch.int32))
    w.copy_(w_next)
    return gram_matrix, d_norm, alpha.float()
