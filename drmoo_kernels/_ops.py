"""The compiled ops: lazy loading, fake kernels, and the wrappers behind the ``cpp`` and ``cuda`` backends.

Two extensions (docs/install.md, "One build for every supported torch"):

* ``drmoo_kernels._C``: the op schemas (``csrc/ops.cpp``, ``STABLE_TORCH_LIBRARY(drmoo, ...)``) and the
  CPU kernels (``csrc/cpu``), built on torch's LibTorch stable ABI for the oldest supported torch:
  one build loads under that torch and every later one;
* ``drmoo_kernels._C_cuda``: the CUDA kernels (``csrc/cuda``), on the same stable ABI and target.

Each shared object names the torch it was built with and its stable-ABI target in plain bytes that
are read before it is loaded.  An older drmoo's ``_C_cuda`` was built on torch's regular C++ API and
carries no target: such a build loads only under the torch it was compiled with, and is refused with
a warning under another.  This module imports an extension only when a backend
asks for it, then registers a fake (meta) kernel per op so that the ops trace under ``torch.compile``
and pass ``torch.library.opcheck``.

The wrappers take the reference's arguments (a :class:`~drmoo_kernels.divergences.Divergence`, J as
one [m, n] tensor or a list of [m, n_k] blocks, ``mu``/``lr`` as a float or a tensor) and translate
them to the schemas' (``code, param`` for the divergence, 0-d tensors for ``mu``/``lr``).  Every
argument is validated first, in Python, by :mod:`drmoo_kernels._checks` (the same checks as the
reference backend's, raising ValueError/TypeError).  A caller of ``torch.ops.drmoo`` itself meets
the same rules: the kernels check shapes, dtypes, devices, the scalars' values, the divergence's
range and memory shared where they write (csrc/checks.h, before anything is written; a RuntimeError,
the one exception type of the stable ABI; the CPU kernels also the values of sample_weight, lr and mu,
which the CUDA kernels do not read on the host), and the fake kernels, which a call with ``meta``
tensors reaches, run the shapes, dtypes and devices checks of :mod:`drmoo_kernels._checks`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import mmap
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from . import _checks
from ._blas_gram import BLAS_MIN_TASKS, blas_gram
from ._warnings import KernelsUnavailableWarning, caller_stacklevel, only_asking_now
from .divergences import Divergence, divergence_from_code

__all__ = [
    "CompiledBackend", "KernelsUnavailableWarning", "availability", "built_with_torch", "load", "stable_abi_target",
]

JacobianBlocks = Tensor | Sequence[Tensor]
# What the ops' schemas (csrc/ops.cpp) return; torch types an op call's result as Any, hence the casts.
_Triple = tuple[Tensor, Tensor, Tensor]
OPS: tuple[str, ...] = ("dual_forward", "dual_step", "gram", "combine", "gram_step")
# Ops with a CPU kernel only: on a GPU the caller's torch op is already one fused launch (torch._foreach_norm).
CPU_ONLY_OPS: tuple[str, ...] = ("sum_squares",)
# The schemas and the CPU kernels, built on torch's stable ABI: one build serves every torch >= its target.
EXTENSION = "drmoo_kernels._C"
# The CUDA kernels, on the same stable ABI (an older drmoo's regular-ABI build: only the torch it was built with).
CUDA_EXTENSION = "drmoo_kernels._C_cuda"
# csrc/ops.cpp and csrc/cuda/module.cpp write these markers into their shared objects: the torch
# version of the headers, and the oldest torch whose stable ABI it uses (absent from an older drmoo's
# regular-ABI _C_cuda).
_BUILD_MARKER = b"drmoo-built-with-torch="
_STABLE_MARKER = b"drmoo-stable-abi-target="
_MARKER_VALUE = re.compile(rb"([0-9A-Za-z.+_-]{1,64});")
REBUILD = (
    "rebuild drmoo against the running torch: pip install --no-build-isolation --force-reinstall --no-deps . "
    "(from drmoo's source folder; a C++ compiler is needed)"
)

# Per extension: absent until its first load attempt; then the reason it is unusable, or None.
_load_reasons: dict[str, str | None] = {}


def _marker(path: str, marker: bytes) -> str | None:
    """The value written after ``marker`` in the file at ``path`` (read, not loaded); None if absent or unreadable."""
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            start = data.find(marker)
            if start < 0:
                return None
            start += len(marker)
            match = _MARKER_VALUE.match(data[start : start + 80])
    except (OSError, ValueError):
        return None
    return None if match is None else match.group(1).decode("ascii")


def built_with_torch(path: str) -> str | None:
    """The torch version the shared object at ``path`` was compiled against, read from its bytes (not loaded).

    None when the file holds no marker (a build older than the marker) or cannot be read.
    """
    return _marker(path, _BUILD_MARKER)


def stable_abi_target(path: str) -> str | None:
    """The oldest torch ("2.11") whose stable ABI the shared object at ``path`` was built for; None for a
    regular-ABI build (an older drmoo's _C_cuda, which loads only under the torch it was built with)."""
    return _marker(path, _STABLE_MARKER)


def _same_release(built: str, running: str) -> bool:
    """Whether two torch versions share major.minor.patch (the C++ ABI of a torch extension is per release)."""
    from ._compat import release

    return release(built)[:3] == release(running)[:3]


def _version_problem(extension: str, path: str, running: str) -> str | None:
    """Why the build at ``path`` must not be loaded under torch ``running``, judged from its markers; else None."""
    from ._compat import release

    built = built_with_torch(path)
    target = stable_abi_target(path)
    if target is not None:
        # torch's stable ABI is forward compatible: a build for target T loads under every torch >= T.
        if release(running)[:2] >= release(target)[:2]:
            return None
        return (
            f"{extension} was built for the stable ABI of torch >= {target} (against torch {built}), but torch "
            f"{running} is running; {REBUILD}"
        )
    if built is not None and not _same_release(built, running):
        return f"{extension} was built against torch {built}, but torch {running} is running; {REBUILD}"
    return None


def _installed(extension: str) -> bool:
    try:
        spec = importlib.util.find_spec(extension)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


@functools.cache
def _shadowed_build(extension: str) -> tuple[str, str] | None:
    """(this package's folder, the other build's file) when the drmoo_kernels this process imported lacks
    ``extension`` but another drmoo_kernels further down sys.path has it; else None.

    That is a source folder shadowing a compiled install: a checkout's top-level drmoo_kernels/ (never
    compiled there) found first because Python puts the working directory (``python -c``, ``python -m``)
    or the script's folder at the front of sys.path, ahead of the site-packages that hold the installed,
    compiled drmoo_kernels.  Folders that are this package itself (the link python/drmoo_kernels of a
    checkout, an editable install's path) do not count.
    """
    package = __name__.rpartition(".")[0]
    own_dir = os.path.dirname(os.path.abspath(__file__))
    own = os.path.realpath(own_dir)
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())  # "" is the working directory
        try:
            spec = importlib.machinery.PathFinder.find_spec(package, [folder])
            locations = [] if spec is None else list(spec.submodule_search_locations or [])
            if not locations or any(os.path.realpath(location) == own for location in locations):
                continue
            other = importlib.machinery.PathFinder.find_spec(extension, locations)
        except (ImportError, OSError, ValueError):
            continue
        if other is not None and other.origin is not None and os.path.isfile(other.origin):
            return own_dir, other.origin
    return None


def _shadow_problem(extension: str) -> str | None:
    """The reason to give when ``extension`` is missing here because this drmoo_kernels shadows a compiled one."""
    shadow = _shadowed_build(extension)
    if shadow is None:
        return None
    own_dir, other = shadow
    return (
        f"{extension} is not in {own_dir}, the drmoo_kernels this process imported, but the drmoo_kernels in "
        f"{os.path.dirname(other)} has it ({os.path.basename(other)}): the uncompiled folder "
        f"{os.path.dirname(own_dir)} comes first on sys.path (the working directory or the script's folder, e.g. "
        f"a drmoo checkout's root) and shadows the compiled package; run from another folder, or build the "
        f"kernels in place there (python setup.py build_ext --inplace, from the checkout's root)"
    )


def _find_load_problem(extension: str = EXTENSION) -> str | None:
    """Import ``extension`` unless its build cannot serve the running torch; None when it loaded, else the reason.

    A regular-ABI build for another torch is not even imported: its undefined symbols are the lucky
    case, a load that succeeds against a changed ABI can crash later.
    """
    running = str(torch.__version__)
    if not _installed(extension):
        shadowed = _shadow_problem(extension)
        if shadowed is not None:
            return shadowed
        if extension == CUDA_EXTENSION:
            return (
                f"drmoo was installed without its CUDA kernels ({extension}: built only where a GPU is visible at "
                f"build time, or with DRMOO_BUILD_CUDA=1 or TORCH_CUDA_ARCH_LIST set, and a CUDA toolkit)"
            )
        return (
            f"{extension} is not installed (drmoo was installed without its compiled kernels, e.g. by a plain "
            f"`pip install .`, which has no torch to compile against, or without a C++ compiler); to get them, "
            f"{REBUILD}"
        )
    path = importlib.util.find_spec(extension).origin  # type: ignore[union-attr]
    assert path is not None
    problem = _version_problem(extension, path, running)
    if problem is not None:
        return problem
    try:
        importlib.import_module(extension)
    except (ImportError, OSError) as error:
        built = built_with_torch(path)
        made_for = f"torch {built}" if built is not None else "an unknown torch version"
        return (
            f"{extension} failed to load under torch {running} (it was built against {made_for}): {error}; "
            f"{REBUILD}"
        )
    return None


def _load(extension: str) -> str | None:
    """Import ``extension`` once; its reason to be unusable (warned once) or None."""
    if extension not in _load_reasons:
        reason = _find_load_problem(extension)
        if reason is None and extension == EXTENSION:
            _register_fakes()
        # A build without CUDA kernels is a choice (no GPU at build time), not a failure: no warning --
        # unless a compiled drmoo_kernels that has them is shadowed by this one (_shadowed_build).
        if reason is not None and (extension == EXTENSION or _installed(extension) or _shadowed_build(extension)):
            kind = "compiled kernels" if extension == EXTENSION else "CUDA kernels"
            fallback = (
                "its pure-torch 'reference' backend (about 2x slower per optimizer step on the CPU)"
                if extension == EXTENSION else "the 'triton' or 'reference' backend on the GPU"
            )
            _pending_warnings[extension] = (
                f"drmoo's {kind} are not available, so drmoo falls back to {fallback}: {reason}. "
                f"(DRMOO_BACKEND=reference chooses that backend explicitly and silences this.)"
            )
        _load_reasons[extension] = reason
    warn_pending()
    return _load_reasons[extension]


# Each extension's failed load, until it is warned about: at once, or, when it was found while
# available_backends() only asked (_warnings.only_asking), at the first use after that.
_pending_warnings: dict[str, str] = {}


def warn_pending() -> None:
    """Issue the warnings of failed loads not issued yet, pointing at the user's line; not while only asking."""
    if _pending_warnings and not only_asking_now():
        for extension in list(_pending_warnings):
            warnings.warn(_pending_warnings.pop(extension), KernelsUnavailableWarning, stacklevel=caller_stacklevel())


def load() -> str | None:
    """Import ``drmoo_kernels._C`` (once) and register the fake kernels; ``None`` or why it failed.

    A failure is also reported once as a :class:`KernelsUnavailableWarning`: without the extension
    every step silently takes the reference backend (about 2x slower), which must not go unnoticed.
    """
    return _load(EXTENSION)


def load_cuda() -> str | None:
    """Import ``drmoo_kernels._C`` and then ``drmoo_kernels._C_cuda`` (once each); ``None`` or why not.

    The CUDA kernels register against the schemas that ``_C`` declares, so ``_C`` comes first.  A CUDA
    build for another torch is refused with one warning; a build without CUDA kernels is not a warning.
    """
    reason = load()
    return reason if reason is not None else _load(CUDA_EXTENSION)


def _has_kernel(op: str, dispatch_key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"drmoo::{op}", dispatch_key)


_availability_cache: dict[str, str | None] = {}


_Function = TypeVar("_Function", bound=Callable[..., Any])


def _assume_constant_result(fn: _Function) -> _Function:
    """``torch.compiler.assume_constant_result`` with its type: torch leaves it unannotated, and it
    returns ``fn`` itself (marked for dynamo)."""
    marked: _Function = torch.compiler.assume_constant_result(fn)  # type: ignore[no-untyped-call]  # see above
    return marked


@_assume_constant_result  # a fixed fact of the process: dynamo need not trace it
def availability(device_type: str) -> str | None:
    """``None`` when the compiled kernels for ``device_type`` ('cpu' or 'cuda') can run, else why not.

    Cached: every op call checks it, and the dispatcher queries behind it cost ~20 us.
    """
    if device_type not in _availability_cache:
        _availability_cache[device_type] = _find_availability(device_type)
    if _pending_warnings:  # found while available_backends() asked: this is the first use
        warn_pending()
    return _availability_cache[device_type]


def _find_availability(device_type: str) -> str | None:
    if device_type == "cuda":
        # Checked first: without a GPU the CUDA build (of whichever torch) is irrelevant and not loaded.
        if not torch.cuda.is_available():
            return "no CUDA device is available"
        reason = load_cuda()
    else:
        reason = load()
    if reason is not None:
        return reason
    key = "CUDA" if device_type == "cuda" else "CPU"
    ops = OPS if device_type == "cuda" else OPS + CPU_ONLY_OPS
    if not all(_has_kernel(op, key) for op in ops):
        extension = CUDA_EXTENSION if device_type == "cuda" else EXTENSION
        return f"{extension} registers no {key} kernels for {', '.join(ops)}"
    return None


# ------------------------------------------------------------------------------------ fake kernels
def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The math dtype of the kernels: float64 stays float64, other floats compute in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _register_fakes() -> None:
    """Kernels for ``meta`` and fake tensors: what each op returns, without computing it.

    They check their arguments with the backends' checker (:mod:`drmoo_kernels._checks`, shapes, dtypes
    and devices: such tensors have no values or memory to check), so that a direct op call that mixes
    a ``meta`` tensor with real ones -- which the dispatcher sends here -- is refused like any other,
    instead of returning uninitialized memory or skipping its in-place update.
    """

    def _dual_forward_fake(losses: Tensor, eta: Tensor, lam: float, scale: float, code: int, param: float,
                           sample_weight: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        with _checks.structural_checks_only():
            _checks.check_dual_forward(losses, eta, lam, scale, divergence_from_code(code, param), sample_weight)
        acc = _acc_dtype(losses.dtype)
        m = losses.shape[1]
        return losses.new_empty(m, dtype=acc), losses.new_empty(m, dtype=acc), losses.new_empty(losses.shape, dtype=acc)

    def _dual_step_fake(losses: Tensor, eta: Tensor, w: Tensor, lam: float, scale: float, code: int, param: float,
                        gamma: float, f1: float, f2: float, sample_weight: Tensor | None
                        ) -> tuple[Tensor, Tensor, Tensor]:
        with _checks.structural_checks_only():
            _checks.check_dual_step(
                losses, eta, w, lam, scale, divergence_from_code(code, param), gamma, f1, f2, sample_weight
            )
        acc = _acc_dtype(losses.dtype)
        m = losses.shape[1]
        weights = losses.new_empty(losses.shape, dtype=acc)
        return losses.new_empty(m, dtype=acc), losses.new_empty((), dtype=acc), weights

    def _gram_fake(J: Tensor) -> Tensor:
        with _checks.structural_checks_only():
            _flat_jacobian_checked("gram", J)
        m = J.shape[0]
        return J.new_empty((m, m), dtype=_acc_dtype(J.dtype))

    def _combine_fake(J: Tensor, w: Tensor, params: list[Tensor], lr: Tensor) -> None:
        with _checks.structural_checks_only():
            _flat_jacobian_checked("combine", J)
            _checks.check_combine(J, w, params, lr, params_dtype_of_j=True)
        return None

    def _gram_step_fake(J: Tensor, w: Tensor, params: list[Tensor], gamma: float, c1: float, c2: float, beta: float,
                        rho: float, mu: Tensor, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        with _checks.structural_checks_only():
            _flat_jacobian_checked("gram_step", J)
            _checks.check_gram_step(J, w, params, gamma, c1, c2, beta, rho, mu, z, params_dtype_of_j=True)
        m = J.shape[0]
        gram_matrix = J.new_empty((m, m), dtype=_acc_dtype(J.dtype))
        return gram_matrix, J.new_empty((), dtype=torch.float32), J.new_empty((), dtype=torch.float32)

    def _sum_squares_fake(tensors: list[Tensor]) -> Tensor:
        with _checks.structural_checks_only():
            device, dtype = _checks.check_sum_squares(tensors)
        if device is None:  # (unreachable through the dispatcher, which needs a tensor to choose a kernel)
            return torch.empty(0, dtype=dtype)
        return tensors[0].new_empty(len(tensors), dtype=dtype)

    # Registered by a call, not with the @register_fake(...) decorator: torch leaves the decorator's
    # type unannotated, which would leave these functions untyped.
    fakes: dict[str, Callable[..., Any]] = {"dual_forward": _dual_forward_fake, "dual_step": _dual_step_fake,
                                            "gram": _gram_fake, "combine": _combine_fake, "gram_step": _gram_step_fake,
                                            "sum_squares": _sum_squares_fake}
    for op, fake in fakes.items():
        torch.library.register_fake(f"drmoo::{op}", fake)


def _flat_jacobian_checked(op: str, jacobian: Tensor) -> None:
    """The ops' schemas take J as one [m, n] tensor (the wrappers flatten blocks): refuse any other rank."""
    _checks.check_gram(jacobian, op)
    if jacobian.dim() != 2:
        raise ValueError(f"drmoo.{op}: J must be the [m, n] per-task gradient matrix, got shape {list(jacobian.shape)}")


# ----------------------------------------------------------------------------------------- wrappers
# Per-call overhead matters: the optimizers call these ops once per step, often on small inputs,
# so the wrappers keep to cheap attribute checks and call the op overloads directly (resolving
# torch.ops.drmoo.<op> and its overload packet costs ~2-4 us per call).
_overloads: dict[str, torch._ops.OpOverload] = {}


def _op(name: str) -> torch._ops.OpOverload:
    """The ``drmoo::<name>`` overload (after :func:`load` succeeded), resolved once."""
    overload = _overloads.get(name)
    if overload is None:
        overload = _overloads[name] = getattr(torch.ops.drmoo, name).default
    return overload


def _require(device_type: str, op: str, names: tuple[str, ...], *tensors: Tensor | None) -> None:
    """Raise unless the backend is available and every given tensor is on ``device_type`` (and, in grad mode,
    none requires grad: the compiled ops have no autograd formula)."""
    if torch.is_grad_enabled():
        _checks.refuse_autograd("cpp" if device_type == "cpu" else "cuda", op, list(zip(names, tensors)))
    if availability(device_type) is None:
        for tensor in tensors:
            if tensor is not None and (not isinstance(tensor, Tensor) or tensor.device.type != device_type):
                break
        else:
            return  # the common case: nothing to report
    _raise_requirement(device_type, op, names, tensors)


def _raise_requirement(device_type: str, op: str, names: tuple[str, ...], tensors: tuple[Tensor | None, ...]) -> None:
    reason = availability(device_type)
    backend = "cpp" if device_type == "cpu" else "cuda"
    if reason is not None:
        raise RuntimeError(f"drmoo backend {backend!r} is not available: {reason}")
    for name, tensor in zip(names, tensors):
        if tensor is None:
            continue
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{op}: {name} must be a Tensor, got {type(tensor).__name__}")
        if tensor.device.type != device_type:
            raise RuntimeError(
                f"{op}: the {backend!r} backend runs on {device_type} tensors, but {name} is on {tensor.device}"
            )


def _flat_jacobian(jacobian: JacobianBlocks) -> Tensor:
    """J as one [m, n] tensor; a list of [m, n_k] blocks is concatenated (a copy)."""
    if isinstance(jacobian, Tensor):
        return jacobian if jacobian.dim() == 2 else jacobian.reshape(jacobian.shape[0], -1)
    blocks = [b.reshape(b.shape[0], -1) for b in jacobian]
    if not blocks:
        raise ValueError("J must be an [m, n] tensor or a non-empty list of [m, n_k] blocks")
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)


def _scalar_tensor(value: Tensor | float, device: torch.device) -> Tensor:
    """A 0-d tensor on ``device``; a float is created there (no host-to-device copy)."""
    if isinstance(value, Tensor):
        return value if value.device == device else value.to(device)
    return torch.scalar_tensor(float(value), dtype=torch.float64, device=device)


_FORWARD_NAMES = ("losses", "eta", "sample_weight")
_STEP_NAMES = ("losses", "eta", "w", "sample_weight")
_GRAM_NAMES = ("J",)
_COMBINE_NAMES = ("J", "w")
_GRAM_STEP_NAMES = ("J", "w", "z")


class CompiledBackend:
    """The ops of :mod:`drmoo_kernels.reference` (same signatures) for one device type.

    ``drmoo_kernels.backends.cpp`` and ``.cuda`` expose the bound methods of one instance each (``sum_squares``
    only the ``cpp`` one: it has no CUDA kernel).
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def availability(self) -> str | None:
        """None when the compiled kernels for this device type can run here, else the reason."""
        return availability(self.device_type)

    def dual_forward(
        self,
        losses: Tensor,
        eta: Tensor,
        lam: float,
        scale: float,
        divergence: Divergence | str,
        sample_weight: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Per-task dual objective, its eta-gradient z and the per-sample loss cotangents."""
        _require(self.device_type, "dual_forward", _FORWARD_NAMES, losses, eta, sample_weight)
        div = _checks.check_dual_forward(losses, eta, lam, scale, divergence, sample_weight)
        return cast(_Triple, _op("dual_forward")(
            losses, eta, float(lam), float(scale), div.code, float(div.param), sample_weight
        ))

    def dual_step(
        self,
        losses: Tensor,
        eta: Tensor,
        w: Tensor,
        lam: float,
        scale: float,
        divergence: Divergence | str,
        gamma: float,
        f1: float,
        f2: float,
        sample_weight: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Alg. 2 steps 1-3: z at eta_t, mu, eta_{t+1} (in place), weights at eta_{t+1}."""
        _require(self.device_type, "dual_step", _STEP_NAMES, losses, eta, w, sample_weight)
        div = _checks.check_dual_step(losses, eta, w, lam, scale, divergence, gamma, f1, f2, sample_weight)
        return cast(_Triple, _op("dual_step")(
            losses, eta, w, float(lam), float(scale), div.code, float(div.param), float(gamma), float(f1),
            float(f2), sample_weight,
        ))

    def gram(self, jacobian: JacobianBlocks) -> Tensor:
        """J J^T (float32, float64 for float64 J)."""
        _checks.check_gram(jacobian)
        flat = _flat_jacobian(jacobian)
        _require(self.device_type, "gram", _GRAM_NAMES, flat)
        if self.device_type == "cpu" and flat.shape[0] >= BLAS_MIN_TASKS:  # many tasks: BLAS is faster
            return blas_gram(flat)
        return cast(Tensor, _op("gram")(flat))

    def combine(self, jacobian: JacobianBlocks, w: Tensor, params: Sequence[Tensor], lr: float | Tensor) -> None:
        """params -= lr * J^T w, written in place through each parameter."""
        _checks.check_combine(jacobian, w, params, lr, params_dtype_of_j=True)
        flat = _flat_jacobian(jacobian)
        _require(self.device_type, "combine", _COMBINE_NAMES, flat, w)
        _op("combine")(flat, w, list(params), _scalar_tensor(lr, flat.device))

    def gram_step(
        self,
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
        """Alg. 2 steps 4-5 (Gram, clipped theta step, w update); writes nothing if the Gram is not finite."""
        _checks.check_gram_step(jacobian, w, params, gamma, c1, c2, beta, rho, mu, z, params_dtype_of_j=True)
        flat = _flat_jacobian(jacobian)
        _require(self.device_type, "gram_step", _GRAM_STEP_NAMES, flat, w, z)
        return cast(_Triple, _op("gram_step")(
            flat, w, list(params), float(gamma), float(c1), float(c2), float(beta), float(rho),
            _scalar_tensor(mu, flat.device), z,
        ))

    def sum_squares(self, tensors: Sequence[Tensor]) -> Tensor:
        """[k]: the sum of squares of each tensor's entries (float32; float64 when one tensor is float64)."""
        device, dtype = _checks.check_sum_squares(tensors)
        if device is None:  # no tensor by which the dispatcher could choose a kernel: the reference's answer
            return torch.zeros(0, dtype=dtype)
        _require(self.device_type, "sum_squares", ("tensors[0]",), tensors[0])
        return cast(Tensor, _op("sum_squares")(list(tensors)))
