"""SW-25's duplicate-features check decides overlap from the views' layouts (drmoo.optim._overlap): checked
here against the definition -- the sets of bytes the two views cover, enumerated -- on every kind of view of
one storage (slices, steps, transposes, expanded dimensions, other dtypes, random ``as_strided`` layouts)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import Tensor

from drmoo.optim._overlap import _layouts_meet, views_overlap


def covered_bytes(tensor: Tensor) -> set[int]:
    """Every byte of the storage that ``tensor`` covers, by enumeration (the definition)."""
    size = tensor.element_size()
    starts = {(int(tensor.storage_offset()) + sum(i * s for i, s in zip(index, tensor.stride()))) * size
              for index in itertools.product(*(range(n) for n in tensor.shape))}
    return {start + byte for start in starts for byte in range(size)}


def defined_overlap(first: Tensor, second: Tensor) -> bool:
    return first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr() and bool(
        covered_bytes(first) & covered_bytes(second))


Z = torch.zeros(6, 8)
NAMED = {
    "column slices": (Z[:, :3], Z[:, 3:], False),
    "row slices": (Z[:2], Z[2:], False),
    "even and odd rows": (Z[::2], Z[1::2], False),
    "even and odd columns": (Z[:, ::2], Z[:, 1::2], False),
    "a row and a column": (Z[0], Z[:, 0], True),
    "a row's tail and a column": (Z[0, 1:], Z[:, 0], False),
    "z and its transpose": (Z, Z.t(), True),
    "z and a reshaped view": (Z, Z.view(8, 6), True),
    "an expanded element and another": (Z[0, 0].expand(3, 4), Z[0, 1:], False),
    "an expanded element and itself": (Z[0, 0].expand(3, 4), Z[:, 0], True),
    "half a float, as int16": (Z.view(torch.int16)[0, 1::2], Z[0, 1:], True),
    "bytes of one float and the next": (Z.view(torch.uint8)[0, :4], Z[0, 1:], False),
    "float64 pairs and a float32 odd column": (Z.view(torch.float64)[:, 0], Z[:, 1], True),
    "an empty slice": (Z[:, :0], Z, False),
}


@pytest.mark.parametrize(("first", "second", "expected"), NAMED.values(), ids=list(NAMED))
def test_named_layouts(first: Tensor, second: Tensor, expected: bool) -> None:
    assert defined_overlap(first, second) is expected  # the case is what its name says
    assert views_overlap(first, second) is expected and views_overlap(second, first) is expected


def test_random_strided_views_of_one_storage_agree_with_the_definition() -> None:
    base = torch.zeros(96)
    views = {torch.float32: base, torch.int16: base.view(torch.int16), torch.uint8: base.view(torch.uint8),
             torch.float64: base.view(torch.float64)}
    rng = random.Random(0)

    def random_view() -> Tensor:
        source = views[rng.choice(list(views))]
        while True:
            shape = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]  # (empty views: NAMED)
            stride = [rng.randint(0, 9) for _ in shape]
            offset = rng.randint(0, 30)
            last = offset + sum((n - 1) * s for n, s in zip(shape, stride))
            if last < source.numel():
                return source.as_strided(shape, stride, offset)

    verdicts = []
    for _ in range(3000):
        first, second = random_view(), random_view()
        expected = defined_overlap(first, second)
        assert views_overlap(first, second) is expected, (first.shape, first.stride(), first.storage_offset(),
                                                          first.dtype, second.shape, second.stride(),
                                                          second.storage_offset(), second.dtype)
        verdicts.append(expected)
    assert 0.1 < sum(verdicts) / len(verdicts) < 0.9  # both answers were exercised


def test_other_storages_the_same_object_and_another_device() -> None:
    z = torch.zeros(4, 5)
    assert views_overlap(z, z) and not views_overlap(z, z.clone())
    assert not views_overlap(torch.zeros(4, 5, device="meta"), torch.zeros(4, 5, device="meta"))


def test_a_layout_is_decided_once() -> None:
    """A steady training loop repeats one layout: its verdict is looked up, not computed again."""
    z = torch.zeros(32, 512)
    views_overlap(z[:, :7], z[:, 7:])
    before = _layouts_meet.cache_info()
    for _ in range(3):
        assert not views_overlap(torch.zeros(32, 512)[:, :7], z[:, 7:])  # another storage: no layout at all
        fresh = torch.zeros(32, 512)
        assert not views_overlap(fresh[:, :7], fresh[:, 7:])
    after = _layouts_meet.cache_info()
    assert (after.hits - before.hits, after.misses - before.misses) == (3, 0)
