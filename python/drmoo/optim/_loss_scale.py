"""The loss scale a step's backward passes run with, and the helpers that apply it without reading it.

Without a GradScaler the scale is the Python float ``1.0`` (or a trainer's own float) and the helpers take
the float path unchanged: nothing multiplies by 1.0.  Under ``torch.amp.GradScaler`` the scale is the
scaler's current value as a 0-d tensor on the step's device, never read on the host (a read stalls a GPU's
launch queue; the step's one read is its guards').  A scale is a power of two, so multiplying or dividing by
it is exact whichever way it is carried.  Reduced-precision tensors (fp16, bf16) are scaled in fp32: a CUDA
kernel casts a 0-d device operand to the other operand's dtype, and 2^16 (the default scale) is Inf in fp16,
where a Python float stays exact in the kernel's fp32 math.
"""

from __future__ import annotations

from torch import Tensor

LossScale = float | Tensor  # 1.0 without a scaler; a GradScaler's 0-d device tensor with one


def is_unit(scale: Tensor | float) -> bool:
    """Whether ``scale`` is the plain float 1.0, known without a host read (a tensor never counts as 1)."""
    return isinstance(scale, float) and scale == 1.0


def times(tensor: Tensor, scale: LossScale) -> Tensor:
    """``tensor * scale`` (``tensor`` itself for the float 1.0)."""
    if isinstance(scale, float):
        return tensor * scale if scale != 1.0 else tensor
    if tensor.element_size() < 4:
        return (tensor.float() * scale).to(tensor.dtype)
    return tensor * scale


def divide_(tensor: Tensor, scale: LossScale) -> Tensor:
    """``tensor /= scale`` in place (nothing for the float 1.0); returns ``tensor``."""
    if isinstance(scale, float):
        return tensor.div_(scale) if scale != 1.0 else tensor
    if tensor.element_size() < 4:
        return tensor.copy_(tensor.float() / scale)
    return tensor.div_(scale)


def with_scale(factor: Tensor | float, scale: LossScale) -> Tensor | float:
    """``factor * scale`` as a gain (``factor`` itself for the float 1.0)."""
    return factor if is_unit(scale) else factor * scale

