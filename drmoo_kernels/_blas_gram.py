"""The Gram J J^T by the BLAS matrix product, where that beats the ``cpp`` kernel: many tasks.

The ``cpp`` kernel reads J once in cache-sized column chunks and forms the m x m products with a
register tile per pair of rows: the fastest at a few tasks, but its Theta(m^2 n) inner loop is not
blocked for many rows, and from about 64 tasks the BLAS product is faster, by more and more with m
(one thread, n = 16,384, AVX-512: 1.4x at m = 64, 3.6x at m = 200, 5.9x at m = 500).  Here J J^T is
computed in row blocks against the rows above them (the lower triangle, mirrored: about half of a full
product's work once m spans several blocks) and is exactly symmetric, as the kernel's is.  Its
arithmetic is the reference's (float32 products for float32 J, float64 for float64 J, accumulated by
BLAS in that dtype), so the ``gram`` contract and its reference tests are unchanged.  One difference from
the kernel: the same inputs give the same bits for the same thread count, but BLAS does not promise the
same bits across thread counts (its threads may split the dot products), as for the ``reference`` backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BLAS_MIN_TASKS", "blas_gram"]

# From this many tasks on, the cpp backend's gram runs here (the measured crossover lies between 48 and 64).
BLAS_MIN_TASKS = 64
_ROWS_PER_BLOCK = 128


def blas_gram(flat: Tensor) -> Tensor:
    """J J^T of ``flat`` [m, n], exactly symmetric, by BLAS in row blocks: float32 (float64 for float64 J).

    A float16 / bfloat16 J is widened to float32 first (one copy): a half-precision product would round every
    entry to J's dtype and overflow float16 where the contract's float32 result is finite."""
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    m = flat.shape[0]
    out = torch.empty(m, m, dtype=flat.dtype, device=flat.device)
    for start in range(0, m, _ROWS_PER_BLOCK):
        end = min(m, start + _ROWS_PER_BLOCK)
        torch.mm(flat[start:end], flat[:end].T, out=out[start:end, :end])  # rows start:end against rows 0:end
    lower = torch.tril(out)
    return lower + torch.tril(lower, -1).T
