"""Warnings of drmoo_kernels, in a module of their own: importing it must not import the compiled
ops' module (``_ops`` decorates a function with ``torch.compiler``, which imports torch._dynamo and,
through it, Triton when it is installed; ``import drmoo_kernels`` must stay light)."""

from __future__ import annotations

__all__ = ["KernelsUnavailableWarning"]


class KernelsUnavailableWarning(RuntimeWarning):
    """The compiled kernels (``drmoo_kernels._C``) cannot be used: drmoo runs on the ~2x slower reference backend.

    Issued once per process, at the first use of a compiled backend, with the reason and the fix.
    Choosing ``DRMOO_BACKEND=reference`` (or ``backend="reference"``) never loads the extension and
    so never warns; ``warnings.filterwarnings("ignore", category=KernelsUnavailableWarning)`` silences it.
    """
