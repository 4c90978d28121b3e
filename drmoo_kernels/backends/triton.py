"""The ``triton`` backend: Triton kernels for the five Jacobian and dual ops of :mod:`drmoo_kernels.reference`.

Same signatures, return values and in-place semantics as the reference (read it for the math).
The kernels compute in float32, the contract for float32/bfloat16/float16 inputs; float64 inputs
(which the reference keeps in float64) run the reference itself.  CUDA tensors run compiled
kernels; CPU tensors run the same kernels through Triton's interpreter (numpy on the host - a
correctness path for tests, not a performance path).  Importing this module
does not import triton; the kernels are loaded on first use (see :mod:`drmoo_kernels.triton_kernels`).

Work split (one launch per op for any number of tensors; see "multi-tensor launches" below):

* ``dual_forward``: one program per block of task columns, each walking the batch once.
* ``dual_step``: a single program (the clip factor mu couples all tasks): pass 1 reduces z, the eta
  step happens in registers, pass 2 writes the weights at eta_{t+1}.
* ``gram``: split reduction over the columns of J into per-program m x m partials, then a sum;
  for m > 64 the m x m output is tiled in 64 x 64 blocks (a grid axis per tile coordinate).  The
  programs cover every block of J through one pointer table.
* ``combine``: one program per run of columns of J (inside one parameter), walking the rows 64 at
  a time; every parameter tensor is reached through the same pointer table.
* ``gram_step``: three launches, no host sync: the ``gram`` partials; one program that sums them and
  does the m x m work in float64 (``gram_finalize_kernel``, m <= 64; above that the reference's
  torch ops); the ``combine`` pass with every load/store masked by the Gram's finiteness (the
  no-write guard), using the incoming w that the finalize kernel saved before updating it.
"""

from __future__ import annotations

import importlib.util
import math
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from types import ModuleType

import torch
from torch import Tensor

from .. import _checks, reference
from ..divergences import Divergence

__all__ = ["availability", "combine", "dual_forward", "dual_step", "gram", "gram_step", "sum_squares"]

JacobianBlocks = Tensor | Sequence[Tensor]

# Elements per register tile.  On a GPU 4096 fp32 values keep a 4-warp program at 32 per thread;
# the interpreter pays Python overhead per tile operation, so there bigger tiles are much faster.
_GPU_TILE = 4096
_DUAL_GPU_TILE = 2048
_COMBINE_MAX_COLUMNS = 1024
# gram_step: partial Grams summed inside the one-program finalize kernel up to this many values
# (512 KB); more are summed by torch first (one extra launch).
_FINALIZE_MAX_PARTIALS = 1 << 17
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
    if interpreted:
        from ..triton_kernels import interpreter_problem

        return interpreter_problem()
    return None


_KERNELS_FOR: dict[str, ModuleType] = {}  # device type -> the kernel module, once its checks passed
_MODE: list[bool] = []  # [interpreted], fixed for the process once triton is imported


def _kernels(device: torch.device) -> ModuleType:
    module = _KERNELS_FOR.get(device.type)
    if module is not None:
        return module
    from ..triton_kernels import interpreter_problem, load_kernels

    if device.type == "cpu" and not _interpreted():
        raise RuntimeError(
            "the triton backend got CPU tensors, but triton runs in compiled (GPU) mode in this process; "
            "CPU tensors need TRITON_INTERPRET=1 set before triton is first imported"
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"the triton backend runs on CUDA tensors (or CPU tensors, interpreted), not {device}")
    if device.type == "cpu":
        problem = interpreter_problem()
        if problem is not None:
            raise RuntimeError(problem)
    module = _KERNELS_FOR[device.type] = load_kernels()
    return module


def _interpreted() -> bool:
    if not _MODE:
        from ..triton_kernels import triton_interpreted

        _MODE.append(triton_interpreted())
    return _MODE[0]


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
    num_warps: int


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
    """combine_kernel: BLOCK_M rows at a time over BLOCK_N columns per loop step, ``num_warps`` warps."""

    block_m: int
    block_n: int
    num_warps: int


def _tile_elements(interpreted: bool) -> int:
    return _INTERPRETER_TILE if interpreted else _GPU_TILE


def _dual_launch(batch: int, tasks: int, block_m: int, interpreted: bool, per_thread: int = 8) -> DualLaunch:
    """Rows per tile: the tile's element budget over its columns, at most the (padded) batch.

    The divergence math keeps about ten values per element live (loss, weight, u, f*, f*', 64-bit
    addresses...), so the dual kernels get half the Jacobian kernels' budget, spread over 8 warps:
    8 elements per thread.  4096 elements on 4 warps used all 255 registers and spilled up to
    472 bytes with Triton 3.6 (issue 11; tests/kernels/test_gpu_codegen.py checks every variant).
    """
    gpu_budget = _DUAL_GPU_TILE * per_thread // 8  # 8 warps of 32 threads
    budget = _INTERPRETER_TILE if interpreted else gpu_budget
    block_b = min(max(budget // block_m, 1), _pow2(batch))
    num_warps = 8 if block_b * block_m >= gpu_budget else 4
    return DualLaunch(block_b, block_m, _cdiv(tasks, block_m), num_warps)


# Elements per thread of dual_forward's tile, by divergence code: cvar_smooth's f* takes two forms (log1p of
# alpha expm1(u) near 0, a log-sum-exp elsewhere: divergences.CVAR_NEAR_U) and keeps more values live; at 8 per
# thread Triton 3.6 spilled 8 bytes on sm_90.
_FORWARD_PER_THREAD = {2: 4}


def dual_forward_launch(batch: int, tasks: int, interpreted: bool, code: int = 0) -> DualLaunch:
    return _dual_launch(batch, tasks, min(_pow2(tasks), _MAX_COLUMN_BLOCK), interpreted,
                        _FORWARD_PER_THREAD.get(code, 8))


def dual_step_launch(batch: int, tasks: int, interpreted: bool) -> DualLaunch:
    # All tasks in one program: mu is a norm over every task.
    return _dual_launch(batch, tasks, _pow2(tasks), interpreted)


def gram_launch(tasks: int, interpreted: bool) -> GramLaunch:
    tile = _tile_elements(interpreted)
    block_m = min(_pow2(tasks), _MAX_ROW_BLOCK)
    use_dot = block_m >= 16
    if interpreted:
        block_n = max(16, tile // (block_m if use_dot else block_m * block_m))
    elif use_dot:
        # 64-row tiles: 32 columns per step.  With 64, ptxas spilled 8 bytes (Triton 3.6: the bf16
        # two-tile and, before the multi-tensor kernels, the fp32 one-tile variant).
        block_n = 32 if block_m >= _MAX_ROW_BLOCK else max(16, tile // block_m)
    else:  # the broadcast product holds BLOCK_M x BLOCK_M x BLOCK_N values (m = 1: capped at one tile)
        block_n = min(tile, max(16, 2 * tile // (block_m * block_m)))
    # A 64 x 64 float32 accumulator and its dot operands need 8 warps' registers: with 4, ptxas
    # spills (40-192 bytes of stack for fp32/bf16 on sm_90, tests/kernels/test_gpu_codegen.py).
    num_warps = 8 if block_m >= 64 else 4
    return GramLaunch(block_m, block_n, use_dot, _cdiv(tasks, block_m), num_warps)


def combine_launch(tasks: int, interpreted: bool) -> CombineLaunch:
    block_m = min(_pow2(tasks), _MAX_ROW_BLOCK)
    if interpreted:
        return CombineLaunch(block_m, max(16, _INTERPRETER_TILE // block_m), 4)
    # Half the Gram's budget, 64 to 1024 columns: at 4096 (m = 1) and 2048 (m = 2) columns the
    # full-tile and tail paths together spilled (Triton 3.8: 88 and 8 bytes), and so did 64 rows x
    # 32 columns (Triton 3.6: 8 bytes).
    block_n = max(64, min(_COMBINE_MAX_COLUMNS, _GPU_TILE // 2 // block_m))
    return CombineLaunch(block_m, block_n, 4)


@dataclass(frozen=True)
class FinalizeLaunch:
    """gram_finalize_kernel: one program, the m x m Gram in a BLOCK_M tile, BLOCK_P partials per step."""

    block_m: int
    block_p: int
    num_warps: int


def gram_finalize_launch(tasks: int) -> FinalizeLaunch | None:
    """The launch shape of gram_step's m x m kernel; None above 64 tasks (torch ops do that part)."""
    if tasks > _MAX_ROW_BLOCK:
        return None
    block_m = _pow2(tasks)
    # 64 x 64 in float32 and float64 needs 8 warps' registers (4 warps: 255 registers, 8 bytes spilled).
    return FinalizeLaunch(block_m, max(1, _DUAL_GPU_TILE // (block_m * block_m)), 8 if block_m >= 32 else 4)


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


def _bump_version(tensor: Tensor | list[Tensor]) -> None:
    # Kernels write through raw pointers; tell autograd the tensors changed, as an in-place op would.
    torch.autograd.graph.increment_version(tensor)


def dual_forward(
    losses: Tensor,
    eta: Tensor,
    lam: float,
    scale: float,
    divergence: Divergence,
    sample_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-task dual objective, its eta-gradient z and the per-sample loss cotangents (float32)."""
    _checks.refuse_autograd("triton", "dual_forward",
                            [("losses", losses), ("eta", eta), ("sample_weight", sample_weight)])
    divergence = _checks.check_dual_forward(losses, eta, lam, scale, divergence, sample_weight)
    if _float64(losses):
        return reference.dual_forward(losses, eta, lam, scale, divergence, sample_weight)
    device = losses.device
    kernels = _kernels(device)
    batch, tasks = losses.shape
    launch = dual_forward_launch(batch, tasks, _interpreted(), divergence.code)
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
    _checks.refuse_autograd("triton", "dual_step", [("losses", losses), ("w", w), ("sample_weight", sample_weight)])
    divergence = _checks.check_dual_step(losses, eta, w, lam, scale, divergence, gamma, f1, f2, sample_weight)
    batch, tasks = losses.shape
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
        # The kernels address every block as an element offset from one base pointer, which needs
        # the block's address to be a whole number of elements (always so for torch allocations).
        if (flat.shape[1] > 1 and flat.stride(1) != 1) or flat.data_ptr() % flat.element_size():
            flat = flat.contiguous()
        out.append(flat)
    if tasks == 0:
        raise ValueError("J has no rows (m = 0)")
    return out


# ------------------------------------------------------------------------- multi-tensor launches
# gram and combine take J as any number of blocks and the parameters as any number of tensors, and
# still launch once (once per distinct dtype pair, in practice once): a plan lists, per launch, an
# entry table (int64 [entries, 4], one entry per program) whose rows are runs of at most ``chunk``
# columns inside one block of J and, for combine, inside one parameter, as element offsets from a
# base tensor of the launch (see _kernels.py).  Plans are cached by everything they depend on
# (addresses, sizes, strides, dtypes, launch shape), so a steady-state optimizer step, whose
# tensors do not move, finds its plan and makes no host-to-device copy.
_PROGRAMS_PER_SM = 8  # programs in flight per SM for the Jacobian kernels (each loops over its chunk)
_INTERPRETER_PROGRAMS = 4  # the interpreter runs programs one by one: few, but more than one
_PLAN_CACHE_SIZE = 64
_FLOAT32 = struct.Struct("<f")
_ALIGN_BYTES = 16  # one vector load


@dataclass(frozen=True)
class TableLaunch:
    """One launch: the tensors behind its base pointers (by index), its entry table, its alignment."""

    j_index: int  # into the blocks of J: the tensor passed as j_ptr
    p_index: int  # into the parameter targets: the tensor passed as p_ptr (combine; -1 for gram)
    table: Tensor  # int64 [entries, 4] on the device
    entries: int
    first_entry: int  # gram: the row of the partials buffer that this launch's entry 0 writes
    align_j: int
    align_p: int


@dataclass(frozen=True)
class MultiTensorPlan:
    launches: tuple[TableLaunch, ...]
    entries: int  # over all launches (gram: rows of the partials buffer)


_PLANS: OrderedDict[tuple[object, ...], MultiTensorPlan] = OrderedDict()
_SM_COUNTS: dict[int, int] = {}


def _max_programs(device: torch.device, interpreted: bool) -> int:
    if interpreted or device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _PROGRAMS_PER_SM * _SM_COUNTS[index]


def _cached_plan(key: tuple[object, ...], build: Callable[[], MultiTensorPlan]) -> MultiTensorPlan:
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = build()
        if len(_PLANS) > _PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


def clear_plan_cache() -> None:
    """Forget every cached multi-tensor plan (their tables are freed with them)."""
    _PLANS.clear()


def _upload_table(rows: list[tuple[int, int, int, int]], device: torch.device) -> Tensor:
    if device.type == "cuda":
        host = torch.tensor(rows, dtype=torch.int64, pin_memory=True)
        return host.to(device, non_blocking=True)
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _alignment(itemsize: int, values: list[int]) -> int:
    """Elements per 16-byte vector when every value is a multiple of it, else 1."""
    align = max(_ALIGN_BYTES // itemsize, 1)
    return align if all(v % align == 0 for v in values) else 1


def _offset(tensor: Tensor, base: Tensor) -> int:
    """Elements from base's address to tensor's (same dtype; both addresses are whole elements)."""
    return (tensor.data_ptr() - base.data_ptr()) // tensor.element_size()


def _block_key(blocks: list[Tensor]) -> tuple[object, ...]:
    return tuple((b.data_ptr(), b.shape[1], b.stride(0), b.dtype) for b in blocks)


def _chunk(column_counts: list[int], block_n: int, max_programs: int) -> int:
    """Columns per program: a multiple of BLOCK_N, so that about max_programs programs cover them."""
    tiles = sum(_cdiv(n, block_n) for n in column_counts)
    return max(1, _cdiv(tiles, max_programs)) * block_n


def _gram_plan(blocks: list[Tensor], block_n: int, max_programs: int) -> MultiTensorPlan:
    tasks = blocks[0].shape[0]
    key = ("gram", tasks, block_n, max_programs, blocks[0].device, _block_key(blocks))

    def build() -> MultiTensorPlan:
        live = [i for i, b in enumerate(blocks) if b.shape[1] > 0]
        chunk = _chunk([blocks[i].shape[1] for i in live], block_n, max_programs)
        launches, first = [], 0
        for dtype in dict.fromkeys(blocks[i].dtype for i in live):
            group = [i for i in live if blocks[i].dtype == dtype]
            base = blocks[group[0]]
            rows = []
            for i in group:
                block, offset = blocks[i], _offset(blocks[i], base)
                stride = block.stride(0) if tasks > 1 else 0  # one row: the stride is never used
                n = block.shape[1]
                rows += [(offset + c0, stride, min(chunk, n - c0), 0) for c0 in range(0, n, chunk)]
            align = _alignment(base.element_size(), [v for r in rows for v in r[:2]])
            launches.append(TableLaunch(group[0], -1, _upload_table(rows, base.device), len(rows), first, align, 1))
            first += len(rows)
        return MultiTensorPlan(tuple(launches), first)

    return _cached_plan(key, build)


def _combine_plan(
    blocks: list[Tensor], layout: ParamLayout, block_n: int, max_programs: int
) -> MultiTensorPlan:
    tasks = blocks[0].shape[0]
    targets = layout.targets
    key = ("combine", tasks, block_n, max_programs, blocks[0].device, _block_key(blocks), layout.key)

    def build() -> MultiTensorPlan:
        # Checked here, on a cache miss only: a hit has the very addresses checked before, and
        # CPU and CUDA allocations never share an address (CUDA's unified virtual addressing).
        device = blocks[0].device
        for target in targets:
            if target.device != device:
                raise ValueError(f"a parameter is on {target.device} but J is on {device}")
            if target.data_ptr() % target.element_size():  # never so for torch's own allocations
                raise ValueError("a parameter's address is not a multiple of its element size")
        # Pieces: the intersections of J's blocks with the parameters, in column order.
        pieces: list[tuple[int, int, int, int, int]] = []  # (block, column, target, element, count)
        block_index, column = 0, 0
        for target_index, target in enumerate(targets):
            element, remaining = 0, target.numel()
            while remaining > 0:
                available = blocks[block_index].shape[1] - column
                if available == 0:
                    block_index, column = block_index + 1, 0
                    continue
                take = min(available, remaining)
                pieces.append((block_index, column, target_index, element, take))
                column, element, remaining = column + take, element + take, remaining - take
        chunk = _chunk([p[4] for p in pieces], block_n, max_programs)
        launches = []
        groups = dict.fromkeys((blocks[p[0]].dtype, targets[p[2]].dtype) for p in pieces)
        for j_dtype, p_dtype in groups:
            group = [p for p in pieces if blocks[p[0]].dtype == j_dtype and targets[p[2]].dtype == p_dtype]
            j_base, p_base = blocks[group[0][0]], targets[group[0][2]]
            rows = []
            for b, c, t, e, count in group:
                block = blocks[b]
                j_start = _offset(block, j_base) + c
                p_start = _offset(targets[t], p_base) + e
                stride = block.stride(0) if tasks > 1 else 0
                rows += [(j_start + c0, stride, p_start + c0, min(chunk, count - c0)) for c0 in range(0, count, chunk)]
            align_j = _alignment(j_base.element_size(), [v for r in rows for v in r[:2]])
            align_p = _alignment(p_base.element_size(), [r[2] for r in rows])
            launches.append(TableLaunch(group[0][0], group[0][2], _upload_table(rows, j_base.device), len(rows), 0,
                                        align_j, align_p))
        return MultiTensorPlan(tuple(launches), sum(launch.entries for launch in launches))

    return _cached_plan(key, build)


def _gram_partials(blocks: list[Tensor]) -> Tensor | None:
    """[entries, m, m] float32 partial Grams (one per program), or None when J has no columns."""
    tasks = blocks[0].shape[0]
    device = blocks[0].device
    kernels = _kernels(device)
    interpreted = _interpreted()
    launch = gram_launch(tasks, interpreted)
    plan = _gram_plan(blocks, launch.block_n, _max_programs(device, interpreted))
    if plan.entries == 0:
        return None
    partials = torch.empty(plan.entries, tasks, tasks, device=device, dtype=torch.float32)
    for part in plan.launches:
        out = partials if part.first_entry == 0 else partials[part.first_entry :]
        kernels.gram_partial_kernel[(part.entries, launch.row_tiles, launch.row_tiles)](
            blocks[part.j_index], part.table, out, tasks,
            BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, USE_DOT=launch.use_dot, ONE_TILE=launch.one_tile,
            ALIGN_J=part.align_j, num_warps=launch.num_warps,
        )
    return partials


def _gram_blocks(blocks: list[Tensor]) -> Tensor:
    partials = _gram_partials(blocks)
    if partials is None:
        tasks = blocks[0].shape[0]
        return torch.zeros(tasks, tasks, device=blocks[0].device, dtype=torch.float32)
    return partials[0] if partials.shape[0] == 1 else partials.sum(dim=0)


def gram(jacobian: JacobianBlocks) -> Tensor:
    """J J^T in float32, summed over the column blocks (split reduction over the columns), one launch."""
    _checks.refuse_autograd("triton", "gram", [("J", jacobian)])
    _checks.check_gram(jacobian)
    blocks = _blocks(jacobian)
    if _float64(*blocks):
        return reference.gram(blocks)
    return _gram_blocks(blocks)


@dataclass(frozen=True)
class ParamLayout:
    """The parameters as the Jacobian kernels see them, checked against J before anything is written."""

    live: list[Tensor]  # the non-empty parameters, in order
    targets: list[Tensor]  # what the kernel writes: ``live``, with a contiguous copy of any strided one
    key: tuple[object, ...]  # addresses, sizes and dtypes of the targets (the plan cache's key)
    has_float64: bool


_DTYPE = attrgetter("dtype")


def _param_layout(blocks: list[Tensor], params: Sequence[Tensor]) -> ParamLayout:
    """One pass of cheap C-level attribute reads over the parameters (this runs on every step)."""
    params = list(params)
    numels = tuple(map(Tensor.numel, params))
    columns = sum(b.shape[1] for b in blocks)
    if sum(numels) != columns:
        raise ValueError(f"J has {columns} columns but the parameters hold {sum(numels)} elements")
    dtypes = tuple(map(_DTYPE, params))
    if 0 in numels or not all(map(Tensor.is_contiguous, params)):
        # The kernel writes each parameter through its address as one contiguous run: a strided
        # parameter is updated in a contiguous copy, written back afterwards.
        kept = [i for i, count in enumerate(numels) if count > 0]
        live = [params[i] for i in kept]
        targets = [p if p.is_contiguous() else p.contiguous() for p in live]
        numels, dtypes = tuple(numels[i] for i in kept), tuple(dtypes[i] for i in kept)
    else:
        live = targets = params
    key = (tuple(map(Tensor.data_ptr, targets)), numels, dtypes)
    return ParamLayout(live, targets, key, torch.float64 in dtypes)


def _combine_blocks(
    blocks: list[Tensor],
    w: Tensor,
    layout: ParamLayout,
    lr: float | Tensor,
    flag: Tensor | None,
    plan: MultiTensorPlan | None = None,
) -> None:
    tasks = blocks[0].shape[0]
    if w.shape != (tasks,):
        raise ValueError(f"w must have shape ({tasks},) to match J's {tasks} rows, got {tuple(w.shape)}")
    device = blocks[0].device
    kernels = _kernels(device)
    launch = combine_launch(tasks, _interpreted())
    if plan is None:
        plan = _combine_plan(blocks, layout, launch.block_n, _max_programs(device, _interpreted()))
    w_in = w.contiguous()
    lr_is_tensor = isinstance(lr, Tensor)
    lr_tensor = lr.reshape(()).to(device=device, dtype=torch.float32) if isinstance(lr, Tensor) else w_in
    lr_value = 0.0 if isinstance(lr, Tensor) else float(lr)
    targets = layout.targets
    for part in plan.launches:
        kernels.combine_kernel[(part.entries,)](
            blocks[part.j_index], targets[part.p_index], part.table, w_in, lr_tensor,
            w_in if flag is None else flag, tasks, lr_value,
            LR_IS_TENSOR=lr_is_tensor, HAS_FLAG=flag is not None, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
            ALIGN_J=part.align_j, ALIGN_P=part.align_p,
        )
    if targets is not layout.live:
        for param, target in zip(layout.live, targets):
            if target is not param:
                param.copy_(target)
    _bump_version(layout.live)


def combine(jacobian: JacobianBlocks, w: Tensor, params: Sequence[Tensor], lr: float | Tensor) -> None:
    """params -= lr * J^T w in one launch for any number of parameters (float32 math, rounded on store)."""
    _checks.refuse_autograd("triton", "combine", [("J", jacobian), ("w", w)])
    _checks.check_combine(jacobian, w, params, lr)
    blocks = _blocks(jacobian)
    layout = _param_layout(blocks, params)
    if layout.has_float64 or _float64(*blocks):
        reference.combine(blocks, w, params, lr)
        return
    _combine_blocks(blocks, w, layout, lr, None)


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
    _checks.refuse_autograd("triton", "gram_step", [("J", jacobian), ("z", z)])
    _checks.check_gram_step(jacobian, w, params, gamma, c1, c2, beta, rho, mu, z)
    blocks = _blocks(jacobian)
    layout = _param_layout(blocks, params)  # raises on a size mismatch, before anything is written
    if layout.has_float64 or _float64(*blocks):
        return reference.gram_step(blocks, w, params, gamma, c1, c2, beta, rho, mu, z)
    tasks = blocks[0].shape[0]
    finalize = gram_finalize_launch(tasks)
    if finalize is None or w.shape != (tasks,) or z.shape != (tasks,):
        # Many tasks (or shapes the reference will reject): the m x m work as the reference's
        # float64 torch ops on the device, no host synchronisation.
        gram_matrix = _gram_blocks(blocks)
        finite, alpha, d_norm, w_next = reference.gram_step_small(gram_matrix, w, c1, c2, beta, rho, mu, z)
        _combine_blocks(blocks, w, layout, (gamma * alpha).float(), finite.to(torch.int32))
        w.copy_(w_next)
        return gram_matrix, d_norm, alpha.float()
    device = blocks[0].device
    # The finalize kernel writes w: the combine plan (and its device check) comes before it.
    plan = _combine_plan(blocks, layout, combine_launch(tasks, _interpreted()).block_n,
                         _max_programs(device, _interpreted()))
    partials = _gram_partials(blocks)
    if partials is None:
        partials = torch.zeros(1, tasks, tasks, device=device, dtype=torch.float32)
    elif partials.numel() > _FINALIZE_MAX_PARTIALS:
        # One program would read them all: let torch's reduction (the whole GPU) sum them first.
        partials = partials.sum(dim=0, keepdim=True)
    gram_matrix = torch.empty(tasks, tasks, device=device, dtype=torch.float32)
    outputs = torch.empty(3, device=device, dtype=torch.float32)  # d_norm as reported, alpha, gamma alpha
    flag = torch.empty((), device=device, dtype=torch.int32)
    w_prev = torch.empty(tasks, device=device, dtype=torch.float32)
    w_work = w if w.is_contiguous() else w.contiguous()
    mu_is_tensor = isinstance(mu, Tensor)
    mu_tensor = mu.reshape(()).to(device) if isinstance(mu, Tensor) else outputs
    _kernels(device).gram_finalize_kernel[(1,)](
        partials, partials.shape[0], gram_matrix, w_work, w_prev, z.contiguous(), mu_tensor, outputs, flag, tasks,
        *_split(gamma), *_split(c1), *_split(c2), *_split(beta), *_split(rho), *_split(0.0 if mu_is_tensor else mu),
        MU_IS_TENSOR=mu_is_tensor, BLOCK_M=finalize.block_m, BLOCK_P=finalize.block_p, num_warps=finalize.num_warps,
    )
    # The update uses the incoming w, saved by the kernel before it wrote the next one.
    _combine_blocks(blocks, w_prev, layout, outputs[2], flag, plan)
    if w_work is not w:
        w.copy_(w_work)
    else:
        _bump_version(w)
    return gram_matrix, outputs[0], outputs[1]


def _split(value: float | Tensor) -> tuple[float, float]:
    """A double as float32 hi + lo (the kernel adds them back in float64: ~48 significant bits)."""
    value = float(value)
    hi = _to_float32(value)
    if not math.isfinite(hi):
        return hi, 0.0
    return hi, _to_float32(value - hi)


def _to_float32(value: float) -> float:
    try:
        rounded: float = _FLOAT32.unpack(_FLOAT32.pack(value))[0]  # struct's "<f": one float
        return rounded
    except OverflowError:  # beyond float32's range: rounds to infinity
        return math.copysign(math.inf, value)


# No Triton kernel: drmoo's own NaN/Inf guard of a list of gradients calls torch._foreach_norm on a GPU (one
# fused launch already); the reference keeps the backend's set of ops complete.
sum_squares = reference.sum_squares
