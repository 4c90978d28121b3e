"""Warnings of drmoo_kernels, in a module of their own: importing it must not import the compiled
ops' module (``_ops`` decorates a function with ``torch.compiler``, which imports torch._dynamo and,
through it, Triton when it is installed; ``import drmoo_kernels`` must stay light)."""

from __future__ import annotations

__all__ = ["KernelsUnavailableWarning"]


class KernelsUnavailableWarning(RuntimeWarning):
    """The compiled kernels cannot be used: ``drmoo_kernels._C`` (the CPU kernels: drmoo runs on the ~2x
    slower reference backend) or ``drmoo_kernels._C_cuda`` (the CUDA kernels, e.g. built for another torch).

    Issued once per process and extension, at the first use of a compiled backend, with the reason and the fix.
    Choosing ``DRMOO_BACKEND=reference`` (or ``backend="reference"``) never loads the extension and
    so never warns; ``warnings.filterwarnings("ignore", category=KernelsUnavailableWarning)`` silences it.
    """
