"""Whether two tensors share memory, decided from their layouts alone (no value is read).

Features mode refuses a piece of z given twice or overlapping another (:func:`drmoo.optim._features.as_pieces`,
SW-25), at every step.  Views of one storage are the hard case: ``z[:, :3]`` and ``z[:, 3:]`` interleave in
memory without sharing an element, and ``torch._C._overlaps`` calls them overlapping.  They were compared
element by element, with a host read (``bool(tensor)``) per step; whether two strided views meet is a property
of their layouts (storage offset, sizes, strides, element size), answered here in Python integers, exactly,
once per pair of layouts.
"""

from __future__ import annotations

import functools

from torch import Tensor

__all__ = ["views_overlap"]

# A view's memory in some unit (its element, or a byte): (its first unit, ((count, stride), ...)), the
# units it covers being first + sum_k i_k * stride_k for 0 <= i_k < count_k (dimensions of one index left out).
Layout = tuple[int, tuple[tuple[int, int], ...]]


def views_overlap(first: Tensor, second: Tensor) -> bool:
    """Whether ``first`` and ``second`` share a byte of memory: the same object, or views that meet in one storage.

    Tensors of different storages (the usual case) are told apart at once; views of one storage by
    :func:`_layouts_meet`, whose verdict is cached per pair of layouts (a training loop's steady steps
    repeat one), so a step issues no host read and, after the first, does no more than a dict lookup.
    """
    if first is second:
        return True
    if first.numel() == 0 or second.numel() == 0 or first.device != second.device or first.is_meta:
        return False
    if first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr():
        return False
    # One dtype: elements start on one grid of the element size, so two meet only where they coincide and
    # the element is the unit; views of other dtypes (``z.view(torch.int16)``) are compared byte by byte.
    unit = first.element_size() if first.element_size() == second.element_size() else 1
    return _layouts_meet(_layout(first, unit), _layout(second, unit))


def _layout(tensor: Tensor, unit: int) -> Layout:
    """``tensor``'s memory in ``unit`` bytes: its strides, and the element's own ``element_size() / unit`` units."""
    size = tensor.element_size()
    dims = [(count, stride * size // unit) for count, stride in zip(tensor.shape, tensor.stride())]
    dims.append((size // unit, 1))
    return int(tensor.storage_offset()) * size // unit, tuple((c, s) for c, s in dims if c > 1 and s != 0)


@functools.lru_cache(maxsize=256)
def _layouts_meet(first: Layout, second: Layout) -> bool:
    """Whether some unit is in both: first_0 + sum_k i_k a_k = second_0 + sum_l j_l b_l, every index in range.

    Counting second's indices from the other end (j_l -> count_l - 1 - j_l) turns it into: is
    ``target = second_0 - first_0 + sum_l (count_l - 1) b_l`` a sum of the non-negative coefficients a_k, b_l,
    each taken between 0 and count - 1 times?  That is bounded-knapsack reachability, solved exactly over
    the bits of one integer (bit v set: the sum v is reachable), each count split in powers of two (1, 2,
    4, ..., the rest: every multiplicity from 0 to the count, and no other).  Cost: O(target / 64) word
    operations per power, about the view's span in units (z of 32 x 512: 16,384 bits), once per pair.
    """
    (first_start, first_dims), (second_start, second_dims) = first, second
    target = second_start - first_start + sum((count - 1) * stride for count, stride in second_dims)
    terms = [(stride, count - 1) for count, stride in first_dims + second_dims]
    if target < 0 or target > sum(stride * times for stride, times in terms):
        return False  # the spans do not meet
    window = (1 << (target + 1)) - 1  # sums above target are of no use
    reachable = 1  # the empty sum
    for stride, times in terms:
        power = 1
        while times > 0:
            take = min(power, times)
            reachable |= (reachable << (stride * take)) & window
            times -= take
            power *= 2
    return bool(reachable >> target & 1)
