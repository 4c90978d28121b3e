"""Argument checks of the public drmoo ops: the one checker of every backend (reference, cpp, cuda,
triton) and of the fake kernels.

The ops are public, so they refuse bad arguments as torch's own ops do, before anything is written,
with a one-line message that starts ``drmoo.<op>:`` and names the argument: ``TypeError`` for
something that is not a tensor or not floating point, ``ValueError`` for a wrong shape, an
out-of-range value or memory shared where the op writes, ``RuntimeError`` for tensors on different
devices and for an in-place write that autograd forbids (as torch says it).  The compiled kernels
(csrc/checks.h) apply the same rules with the same messages to a direct ``torch.ops.drmoo.*`` call,
as a ``RuntimeError`` (the one exception type of torch's stable ABI); the fake kernels of
:mod:`drmoo_kernels._ops` call the functions here, so a call with ``meta`` or fake tensors is checked
like a real one (shapes, dtypes, devices; there are no values or addresses to check).

Bounds (DESIGN §1-2): ``lam`` and ``scale`` (lambda, the dual scale s), the clip caps and budgets
``c1, c2, f1, f2`` are finite and > 0; the step sizes ``gamma``, ``lr``, ``beta`` and ``rho`` and
the clip factor ``mu`` are finite and >= 0 (0 is a valid "no step"); importance weights are finite
and >= 0; the divergence's parameter lies where float32 keeps its meaning
(:mod:`drmoo_kernels.divergences`).

Memory: a tensor an op writes (``eta`` of ``dual_step``, ``w`` of ``gram_step``, the parameters) has no
two elements at one address (an expanded, stride-0 tensor) and shares no memory with another argument
-- parameters with each other, with J, w, z, lr or mu; eta with losses, w or sample_weight; w with J,
z or mu -- or an update would be applied twice, or read after it was written.  Two tensors share
memory when the byte ranges their elements span intersect (interleaved views of one buffer count
too: the conservative rule, the same in csrc/checks.h).

Tensor *values* (importance weights, a tensor ``lr`` or ``mu``) are read on the host for their
check -- except where that would cost a device synchronisation the caller cannot afford: while
torch.compile traces, while a CUDA graph is being captured, and inside :func:`trusted_arguments`,
which drmoo's optimizers enter around their own op calls (they check the weights themselves, skip a
bad step on the device when ``capturable=True``, and hand the ops only parameters they checked when
they were added, and buffers of their own).  The trust covers the optimizer's code only: the user's
closure runs under :func:`untrusted_arguments`, so the ops it calls check everything.  The compiled
CUDA kernels likewise never read tensor values on the host; the CPU kernels do.  The structural
checks (shapes, dtypes, devices) read no tensor value and always run.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .divergences import Divergence, get_divergence

__all__ = [
    "check_combine",
    "check_dual_forward",
    "check_dual_step",
    "check_gram",
    "check_gram_step",
    "check_positive",
    "check_sum_squares",
    "structural_checks_only",
    "trusted_arguments",
    "untrusted_arguments",
]

JacobianBlocks = Tensor | Sequence[Tensor]

_trust = threading.local()
_INF = float("inf")


def check_positive(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """``value`` as a float; ValueError naming ``name`` unless it is finite and > 0 (>= 0 with ``allow_zero``).

    The one rule for every positive scalar drmoo takes: the ops' arguments and the optimizers'
    hyperparameters (:mod:`drmoo.optim` applies it at construction and at every step).
    """
    if isinstance(value, bool):  # an int to float(), but True is no rate: mgda[clip_c1=True] read as 1
        raise ValueError(f"{name} must be a number, got {value!r}")
    if isinstance(value, (str, bytes)):  # float("0.8") would coerce a config file's text silently
        raise ValueError(f"{name} must be a number, got the text {value!r}: pass the number itself")
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor with several values
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not (number >= 0.0 if allow_zero else number > 0.0) or number == float("inf"):  # NaN fails both
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value!r}")
    return number


class _TrustedArguments:
    """The context of :func:`trusted_arguments` (a class: cheaper to enter than a generator, once per step)."""

    def __enter__(self) -> None:
        _trust.depth = getattr(_trust, "depth", 0) + 1

    def __exit__(self, *_: object) -> None:
        _trust.depth -= 1


class _UntrustedArguments:
    """The context of :func:`untrusted_arguments`: the trust of the enclosing code is set aside, then restored."""

    def __enter__(self) -> None:
        saved = getattr(_trust, "saved", None)
        if saved is None:
            saved = _trust.saved = []
        saved.append(getattr(_trust, "depth", 0))
        _trust.depth = 0

    def __exit__(self, *_: object) -> None:
        _trust.depth = _trust.saved.pop()


class _StructuralChecksOnly:
    """The context of :func:`structural_checks_only`."""

    def __enter__(self) -> None:
        _trust.structural = getattr(_trust, "structural", 0) + 1

    def __exit__(self, *_: object) -> None:
        _trust.structural -= 1


_TRUSTED_ARGUMENTS = _TrustedArguments()
_UNTRUSTED_ARGUMENTS = _UntrustedArguments()
_STRUCTURAL_CHECKS_ONLY = _StructuralChecksOnly()


def trusted_arguments() -> _TrustedArguments:
    """Within: the ops skip the checks that read tensor values or walk every parameter (see the module doc).

    For callers that checked those themselves once (drmoo's optimizers, around their own op calls);
    per thread, nestable.
    """
    return _TRUSTED_ARGUMENTS


def untrusted_arguments() -> _UntrustedArguments:
    """Within: every check applies again, even inside :func:`trusted_arguments` (per thread, nestable).

    drmoo's optimizers call the user's closure inside it: the trust they place in their own
    arguments must not extend to the ops the closure calls.
    """
    return _UNTRUSTED_ARGUMENTS


def structural_checks_only() -> _StructuralChecksOnly:
    """Within: only shapes, dtypes and devices are checked (per thread, nestable).

    For the fake kernels, whose tensors (``meta``, or fake ones while torch.compile traces) have no
    values to read and no memory whose addresses could be compared.
    """
    return _STRUCTURAL_CHECKS_ONLY


def _trusted() -> bool:
    return torch.compiler.is_compiling() or getattr(_trust, "depth", 0) > 0


def _structural_only() -> bool:
    return getattr(_trust, "structural", 0) > 0


def _values_readable(tensor: Tensor) -> bool:
    """Whether reading ``tensor``'s values on the host is allowed here (no trace, capture, trust or fake)."""
    if tensor.device.type == "meta" or _trusted() or _structural_only():
        return False
    return not (tensor.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _span(tensor: Tensor) -> tuple[int, int] | None:
    """The bytes [begin, end) that ``tensor``'s elements span; None without elements (csrc/checks.h layout_of)."""
    if tensor.numel() == 0:
        return None
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    begin = tensor.data_ptr()
    return begin, begin + (last + 1) * tensor.element_size()


def _shares_memory(first: Tensor, second: Tensor) -> bool:
    if first.device != second.device:  # addresses on different devices never refer to one memory
        return False
    a, b = _span(first), _span(second)
    return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]


def _alias_error(op: str, written_name: str, other_name: str) -> ValueError:
    return ValueError(
        f"drmoo.{op}: {written_name} shares memory with {other_name}; the op writes {written_name} while it reads "
        f"{other_name}: pass a copy (.clone()) of one of them"
    )


def _no_alias(op: str, written_name: str, written: Tensor, others: Sequence[tuple[str, Any]]) -> None:
    """``written`` (written in place) shares memory with none of ``others`` (name, tensor or other value)."""
    for other_name, other in others:
        if isinstance(other, Tensor) and _shares_memory(written, other):
            raise _alias_error(op, written_name, other_name)


def _shape(tensor: Tensor) -> str:
    return "[" + ", ".join(str(size) for size in tensor.shape) + "]"


def _tensor(op: str, name: str, value: Any, device: torch.device | None) -> Tensor:
    """A floating-point tensor on ``device`` (when given), else TypeError / RuntimeError naming it."""
    if not isinstance(value, Tensor):
        raise TypeError(f"drmoo.{op}: {name} must be a Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"drmoo.{op}: {name} must be float32, float64, float16 or bfloat16, got {value.dtype}")
    if device is not None and value.device != device:
        raise RuntimeError(f"drmoo.{op}: {name} is on {value.device} but the other inputs are on {device}")
    return value


def _vector(op: str, name: str, value: Any, m: int, device: torch.device) -> Tensor:
    vector = _tensor(op, name, value, device)
    if vector.dim() != 1 or vector.shape[0] != m:
        raise ValueError(f"drmoo.{op}: {name} must have shape [{m}] (one entry per task), got {_shape(vector)}")
    return vector


def _number(op: str, name: str, value: Any, *, allow_zero: bool = False) -> None:
    """:func:`check_positive` for an op's scalar argument; a plain float in range returns at once
    (every optimizer step passes a handful of them)."""
    if type(value) is float and (0.0 <= value if allow_zero else 0.0 < value) and value != _INF:
        return
    check_positive(f"drmoo.{op}: {name}", value, allow_zero=allow_zero)


def _scalar(op: str, name: str, value: Any, device: torch.device, *, allow_zero: bool) -> None:
    """A float, or a one-element floating tensor on ``device`` (its value checked where it may be read)."""
    if not isinstance(value, Tensor):
        _number(op, name, value, allow_zero=allow_zero)
        return
    _tensor(op, name, value, None)  # a 0-d tensor on the host is moved by the backends
    if value.numel() != 1:
        raise ValueError(f"drmoo.{op}: {name} must hold one value, got shape {_shape(value)}")
    if value.device != device and value.device.type != "cpu":
        raise RuntimeError(f"drmoo.{op}: {name} is on {value.device} but the other inputs are on {device}")
    if _values_readable(value):
        check_positive(f"drmoo.{op}: {name}", value.detach().reshape(()), allow_zero=allow_zero)


def refuse_autograd(backend: str, op: str, inputs: Sequence[tuple[str, Any]]) -> None:
    """A compiled backend's op has no autograd formula: in grad mode, an input that requires grad is refused
    (its outputs would carry no gradient back to it, silently).  ``inputs``: (name, tensor or list of tensors)."""
    if not torch.is_grad_enabled():
        return
    for name, value in inputs:
        for index, tensor in enumerate(value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(tensor, Tensor) and tensor.requires_grad:
                shown = name if not isinstance(value, (list, tuple)) else f"{name}[{index}]"
                raise RuntimeError(
                    f"drmoo_kernels.backends.{backend}.{op}: {shown} requires grad, but the compiled ops have no "
                    "autograd formula, so no gradient would reach it: call the op under torch.no_grad() (or on "
                    f"{shown}.detach()), or use drmoo_kernels.reference, which autograd differentiates"
                )


def _writable(op: str, name: str, tensor: Tensor) -> None:
    """``tensor`` may be written in place: its elements do not overlap, and autograd allows it."""
    if torch._debug_has_internal_overlap(tensor) == 1:  # 1: overlaps for sure (stride 0, as expand gives)
        raise ValueError(
            f"drmoo.{op}: {name} is written in place, but several of its elements share memory (an expanded "
            f"or stride-0 tensor, shape {_shape(tensor)}, strides {list(tensor.stride())}); pass {name}.clone()"
        )
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"drmoo.{op}: {name} is an inference tensor (made under torch.inference_mode()), which cannot be "
            f"written in place outside inference mode; pass {name}.clone(), or call the op in inference mode"
        )
    if tensor.requires_grad and torch.is_grad_enabled():
        leaf = "a leaf Variable that requires grad" if tensor.is_leaf else "a tensor that requires grad"
        raise RuntimeError(
            f"drmoo.{op}: {name} is {leaf}; the op writes it in place, which autograd cannot follow: call the op "
            "under torch.no_grad() (as an optimizer step does)"
        )


def _check_losses(
    op: str, losses: Any, eta: Any, lam: Any, scale: Any, divergence: Divergence | str, sample_weight: Any
) -> tuple[int, torch.device, Divergence]:
    """losses [B, m] (B, m >= 1), eta [m], lam, scale > 0, sample_weight [B, m] >= 0; returns (m, device, f)."""
    losses = _tensor(op, "losses", losses, None)
    if losses.dim() != 2:
        raise ValueError(f"drmoo.{op}: losses must be per-sample losses of shape [B, m], got {_shape(losses)}")
    batch, m = losses.shape
    if batch == 0:
        raise ValueError(f"drmoo.{op}: empty batch (B = 0): the dual objective needs at least one sample")
    if m == 0:
        raise ValueError(f"drmoo.{op}: losses have no task columns (m = 0)")
    device = losses.device
    _vector(op, "eta", eta, m, device)
    _number(op, "lam", lam)
    _number(op, "scale", scale)
    if sample_weight is not None:
        weights = _tensor(op, "sample_weight", sample_weight, device)
        if weights.shape != losses.shape:
            raise ValueError(
                f"drmoo.{op}: sample_weight must have the shape of losses {_shape(losses)}, got {_shape(weights)}"
            )
        if _values_readable(weights):
            low, high = torch.aminmax(weights.detach())  # NaN propagates into both
            if not (float(low) >= 0.0 and float(high) < float("inf")):
                raise ValueError(
                    f"drmoo.{op}: sample_weight (importance weights) must be finite and >= 0; it has negative, "
                    "NaN or Inf entries"
                )
    try:
        return m, device, get_divergence(divergence)
    except (TypeError, ValueError) as error:
        raise ValueError(f"drmoo.{op}: {error}") from None


def check_dual_forward(
    losses: Any, eta: Any, lam: Any, scale: Any, divergence: Divergence | str, sample_weight: Any
) -> Divergence:
    """The arguments of ``dual_forward``; returns the divergence object."""
    return _check_losses("dual_forward", losses, eta, lam, scale, divergence, sample_weight)[2]


def check_dual_step(
    losses: Any, eta: Any, w: Any, lam: Any, scale: Any, divergence: Divergence | str,
    gamma: Any, f1: Any, f2: Any, sample_weight: Any,
) -> Divergence:
    """The arguments of ``dual_step`` (eta is written in place); returns the divergence object."""
    m, device, div = _check_losses("dual_step", losses, eta, lam, scale, divergence, sample_weight)
    _vector("dual_step", "w", w, m, device)
    _number("dual_step", "gamma", gamma, allow_zero=True)
    _number("dual_step", "f1", f1)
    _number("dual_step", "f2", f2)
    if not _trusted():
        _writable("dual_step", "eta", eta)
        if not _structural_only():
            _no_alias("dual_step", "eta", eta, (("losses", losses), ("w", w), ("sample_weight", sample_weight)))
    return div


def check_gram(jacobian: Any, op: str = "gram") -> tuple[int, int, torch.device]:
    """J: one [m, ...] tensor or a non-empty sequence of [m, ...] blocks (trailing dims are columns).

    Returns (m, n, device).  A 1-D or 0-d J is refused: it has no task dimension.
    """
    blocks = [jacobian] if isinstance(jacobian, Tensor) else jacobian
    if not isinstance(blocks, (list, tuple)) or not blocks:
        raise TypeError(
            f"drmoo.{op}: J must be an [m, n] tensor or a non-empty list of [m, n_k] blocks, got "
            f"{type(jacobian).__name__}"
        )
    first = _tensor(op, "J", blocks[0], None)
    device, m, n = first.device, (first.shape[0] if first.dim() else 0), 0
    for index, block in enumerate(blocks):
        name = "J" if isinstance(jacobian, Tensor) else f"J[{index}]"
        block = _tensor(op, name, block, device)
        if block.dim() < 2:
            raise ValueError(
                f"drmoo.{op}: {name} must be the [m, n] per-task gradient matrix (one row per task), got shape "
                f"{_shape(block)}"
            )
        if block.shape[0] != m:
            raise ValueError(f"drmoo.{op}: every block of J must have {m} rows, but {name} has shape {_shape(block)}")
        if block.dtype != first.dtype:  # joined, they would be promoted: J's dtype would be none of the blocks'
            raise TypeError(f"drmoo.{op}: the blocks of J must share one dtype, but J[0] is {first.dtype} and "
                            f"{name} is {block.dtype}")
        n += block.numel() // m if m else 0
    if m == 0:
        raise ValueError(f"drmoo.{op}: J has no rows (m = 0 tasks)")
    return m, n, device


def _check_params(
    op: str, params: Any, n: int, device: torch.device, dtype: torch.dtype | None, inputs: Sequence[tuple[str, Any]]
) -> None:
    """Every parameter is checked before any is written: a floating tensor on J's device (in J's
    ``dtype`` when given), their sizes add up to J's columns, each writable in place, none sharing
    memory with another parameter or with ``inputs`` (the op's other tensor arguments, named).  For
    a trusted caller (an optimizer, whose parameters were checked when they were added) only the sizes."""
    if isinstance(params, Tensor) or not isinstance(params, (list, tuple)):
        raise TypeError(f"drmoo.{op}: params must be a list of tensors, got {type(params).__name__}")
    trusted = _trusted()
    if trusted:
        total = sum(map(Tensor.numel, params))
    else:
        total = 0
        for index, param in enumerate(params):
            _tensor(op, f"params[{index}]", param, device)
            if dtype is not None and param.dtype != dtype:
                raise TypeError(
                    f"drmoo.{op}: params[{index}] has dtype {param.dtype} but J has {dtype}; the compiled kernels "
                    "need the parameters in J's dtype"
                )
            total += param.numel()
    if total != n:
        raise ValueError(f"drmoo.{op}: J has {n} columns but the parameters hold {total} elements")
    if trusted:
        return
    for index, param in enumerate(params):
        _writable(op, f"params[{index}]", param)
    if _structural_only():
        return
    # The other arguments' spans, once (J may come as one block per parameter).
    others = [(name, span) for name, other in inputs
              if isinstance(other, Tensor) and other.device == device and (span := _span(other)) is not None]
    spans = []
    for index, param in enumerate(params):
        span = _span(param)
        if span is None:
            continue
        for name, other in others:
            if span[0] < other[1] and other[0] < span[1]:
                raise _alias_error(op, f"params[{index}]", name)
        spans.append((span, index))
    # Sorted by start, two spans intersect iff one starts before the furthest end so far.
    spans.sort()
    widest = None
    for span, index in spans:
        if widest is not None and span[0] < widest[0][1]:
            first, second = sorted((widest[1], index))
            if span == widest[0]:
                raise ValueError(
                    f"drmoo.{op}: params[{second}] is params[{first}] again (the same memory): it would be updated "
                    "twice"
                )
            raise ValueError(
                f"drmoo.{op}: params[{second}] and params[{first}] share memory (overlapping views of one tensor): "
                "the shared elements would be updated twice"
            )
        if widest is None or span[1] > widest[0][1]:
            widest = (span, index)


def _jacobian_inputs(jacobian: JacobianBlocks) -> list[tuple[str, Any]]:
    if isinstance(jacobian, Tensor):
        return [("J", jacobian)]
    return [(f"J[{index}]", block) for index, block in enumerate(jacobian)]


def check_combine(jacobian: Any, w: Any, params: Any, lr: Any, *, params_dtype_of_j: bool = False) -> None:
    """The arguments of ``combine`` (params are written in place); ``params_dtype_of_j``: the backend
    needs the parameters in J's dtype."""
    m, n, device = check_gram(jacobian, "combine")
    _vector("combine", "w", w, m, device)
    _scalar("combine", "lr", lr, device, allow_zero=True)
    dtype = _first_block(jacobian).dtype if params_dtype_of_j else None
    _check_params("combine", params, n, device, dtype, [*_jacobian_inputs(jacobian), ("w", w), ("lr", lr)])


def check_gram_step(
    jacobian: Any, w: Any, params: Any, gamma: Any, c1: Any, c2: Any, beta: Any, rho: Any, mu: Any, z: Any,
    *, params_dtype_of_j: bool = False,
) -> None:
    """The arguments of ``gram_step`` (params and w are written in place)."""
    op = "gram_step"
    m, n, device = check_gram(jacobian, op)
    _vector(op, "w", w, m, device)
    _vector(op, "z", z, m, device)
    _number(op, "gamma", gamma, allow_zero=True)
    _number(op, "c1", c1)
    _number(op, "c2", c2)
    _number(op, "beta", beta, allow_zero=True)
    _number(op, "rho", rho, allow_zero=True)
    _scalar(op, "mu", mu, device, allow_zero=True)
    dtype = _first_block(jacobian).dtype if params_dtype_of_j else None
    _check_params(op, params, n, device, dtype, [*_jacobian_inputs(jacobian), ("w", w), ("z", z), ("mu", mu)])
    if not _trusted():
        _writable(op, "w", w)
        if not _structural_only():
            _no_alias(op, "w", w, [*_jacobian_inputs(jacobian), ("z", z), ("mu", mu)])


def check_sum_squares(tensors: Any) -> tuple[torch.device | None, torch.dtype]:
    """The argument of ``sum_squares``: a list or tuple of floating tensors on one device (any shapes, strides
    and sizes; none is written).  Returns their device (None for an empty list) and the result's dtype:
    float64 when one of them is float64, else float32."""
    op = "sum_squares"
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"drmoo.{op}: tensors must be a list or tuple of tensors, got {type(tensors).__name__}")
    device: torch.device | None = None
    dtype = torch.float32
    for index, tensor in enumerate(tensors):
        checked = _tensor(op, f"tensors[{index}]", tensor, device)
        if device is None:
            device = checked.device
        if checked.dtype == torch.float64:
            dtype = torch.float64
    return device, dtype


def _first_block(jacobian: JacobianBlocks) -> Tensor:
    return jacobian if isinstance(jacobian, Tensor) else jacobian[0]
