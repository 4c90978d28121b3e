"""Multi-MNIST: 2, 3, 4 or 9 MNIST digits overlapped on one canvas, one classification task per digit.

Recipe (deterministic from ``seed``).  Each 28 x 28 digit is pasted with its top-left corner at
the (row, column) positions below and overlapping pixels take the maximum:

* 2 digits, canvas 36 x 36: top-left (0, 0) and bottom-right (8, 8) - a fixed diagonal offset;
* 3 digits, canvas 42 x 42: top-left (0, 0), bottom-centre (14, 7) and top-right (0, 14);
* k = 4 or 9 digits (Multi-MNIST-k, drmoo's many-task benchmark, not in the paper): a sqrt(k) x
  sqrt(k) grid with ``GRID_STRIDE`` = 14 pixels between neighbours, in row-major order - digit
  (r, c) at (14 r, 14 c), so neighbours overlap by half a digit as the 3-digit layout's top row
  does; canvas 42 x 42 for 4 digits, 56 x 56 for 9.

The 2- and 3-digit layouts are two more entries of the same tables (``POSITIONS``, ``CANVAS``):
every digit count is generated, cached and checked by the one code path below.

Task k's label is the class of the digit at position k.  Composite j of a split uses digit
``j mod N`` of that split (N digits) at position 0 and independently drawn digits of the same
split at the other positions, so train composites are built from train digits only, and a split
may hold more composites than digits (each digit then leads ``count / N`` composites, paired with
different partners).

``shift > 0`` adds the classic Multi-MNIST random shifts (Sabour et al., 2017: every digit moved
by up to 4 pixels in each direction): the canvas grows by ``shift`` on every side and each digit
is pasted at its position above plus an independent offset drawn uniformly from
``[-shift, shift]`` per axis, so no digit is ever cut off and the offsets are unbiased.
``shift = 0`` is the fixed layout above.

The canvas is resized (bilinear, antialiased) to ``input_size`` and kept as one uint8 channel;
:meth:`MultiMnist.images` repeats it to 3 channels in [0, 1] for the ResNet.  Generated tensors
are cached on disk, keyed by the recipe, the seed and the digit source, and checked against the
digits on every read (see ``_verify_content``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import Tensor

from drmoo.store import UsageError, available_memory, make_directory, read_checkpoint_file, write_checkpoint_file

from .mnist import DigitSplits, digit_source_fingerprint, load_mnist

__all__ = ["GRID_DIGITS", "GRID_STRIDE", "HOLDOUTS", "POSITIONS", "VALIDATION_FRACTION", "MultiMnist",
           "MultiMnistRecipe", "check_allocatable", "compose", "default_cache_dir", "grid_positions", "holdout_splits",
           "load_multimnist"]

DIGIT_SIDE = 28  # an MNIST digit is 28 x 28
GRID_STRIDE = 14  # Multi-MNIST-k: half a digit between grid neighbours (the 3-digit layout's top-row spacing)
GRID_DIGITS = (4, 9)  # the grid layouts drmoo builds: 2 x 2 and 3 x 3


def grid_positions(digits: int) -> tuple[tuple[int, int], ...]:
    """Top-left corners of ``digits`` digits on a sqrt(digits) x sqrt(digits) grid, row-major, GRID_STRIDE apart."""
    side = math.isqrt(digits)
    if side < 2 or side * side != digits:
        raise ValueError(f"a Multi-MNIST grid needs a square number of digits >= 4, got {digits}")
    return tuple((row * GRID_STRIDE, col * GRID_STRIDE) for row in range(side) for col in range(side))


MAX_SHIFT = 14  # half a digit: beyond that a "shift" is a different layout
POSITIONS: dict[int, tuple[tuple[int, int], ...]] = {
    2: ((0, 0), (8, 8)),
    3: ((0, 0), (14, 7), (0, 14)),
    **{digits: grid_positions(digits) for digits in GRID_DIGITS},
}
# The canvas side without shifts (shift s adds 2 s): the layout's extent, 36, 42, 42 and 56.
CANVAS: dict[int, int] = {
    digits: max(max(row, col) for row, col in corners) + DIGIT_SIDE for digits, corners in POSITIONS.items()
}


HOLDOUTS = ("test", "validation")
VALIDATION_FRACTION = 0.2  # holdout "validation": the last 20 % of the training digits, never trained on


def default_cache_dir() -> Path:
    """``$DRMOO_CACHE``, or ``~/.cache/drmoo`` when it is unset or empty (as XDG treats an empty variable:
    an empty path would otherwise put the cache into whatever directory the command runs in)."""
    return Path(os.environ.get("DRMOO_CACHE") or Path.home() / ".cache" / "drmoo")


@dataclass(frozen=True)
class MultiMnistRecipe:
    """Everything that determines the generated tensors."""

    digits: int = 2
    input_size: int = 128
    seed: int = 0
    train_size: int | None = None  # None: one composite per digit of the split; may exceed the digits
    test_size: int | None = None
    shift: int = 0  # random shift of every digit, up to this many pixels per axis (0: fixed layout)
    holdout: str = "test"  # what the "test" split is made of: "test" digits, or "validation" training digits

    def __post_init__(self) -> None:
        if isinstance(self.digits, bool) or not isinstance(self.digits, int) or self.digits not in POSITIONS:
            counts = [str(digits) for digits in POSITIONS]
            raise ValueError(f"Multi-MNIST has {', '.join(counts[:-1])} or {counts[-1]} digits, got {self.digits!r}")
        # an int, not a float or bool: 32.0 or a seed of 1.5 would otherwise fail inside torch mid-generation
        if isinstance(self.input_size, bool) or not isinstance(self.input_size, int) or self.input_size < 8:
            raise ValueError(f"input_size must be an int >= 8, got {self.input_size!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        for name in ("train_size", "test_size"):
            size = getattr(self, name)
            if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise ValueError(f"{name} must be None (one composite per digit) or an int >= 1, got {size!r}")
        if isinstance(self.shift, bool) or not isinstance(self.shift, int) or not 0 <= self.shift <= MAX_SHIFT:
            raise ValueError(f"shift must be an int in [0, {MAX_SHIFT}] pixels, got {self.shift!r}")
        if self.holdout not in HOLDOUTS:
            raise ValueError(f"holdout must be one of {', '.join(HOLDOUTS)}, got {self.holdout!r}")

    @property
    def canvas(self) -> int:
        """Side of the canvas before resizing."""
        return CANVAS[self.digits] + 2 * self.shift


def compose(
    images: Tensor, labels: Tensor, count: int, digits: int, generator: torch.Generator, shift: int = 0
) -> tuple[Tensor, Tensor]:
    """``count`` canvases [count, C, C] uint8 (C = CANVAS[digits] + 2 shift) and their labels [count, digits].

    ``count`` may exceed the number of digits (position 0 cycles through them).  The partner
    digits are drawn first and the shifts after them, so ``shift = 0`` draws exactly what the
    fixed layout always drew.
    """
    if images.shape[0] < 1:
        raise ValueError("cannot compose Multi-MNIST images from an empty digit split")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not 0 <= shift <= MAX_SHIFT:
        raise ValueError(f"shift must be in [0, {MAX_SHIFT}], got {shift}")
    chosen, offsets = _draw_layout(count, images.shape[0], digits, generator, shift)
    return _paste(images, chosen, offsets, digits, shift), torch.stack([labels[index] for index in chosen], dim=1)


def _draw_layout(
    count: int, available: int, digits: int, generator: torch.Generator, shift: int
) -> tuple[list[Tensor], list[Tensor | None]]:
    """The random part of :func:`compose`: per position, the digit index of every composite and its
    [count, 2] shift (None for the fixed layout), drawn in compose's order: partners, then shifts."""
    chosen = [torch.arange(count) % available] + [
        torch.randint(0, available, (count,), generator=generator) for _ in range(digits - 1)
    ]
    offsets: list[Tensor | None] = [
        torch.randint(-shift, shift + 1, (count, 2), generator=generator) if shift else None for _ in chosen
    ]
    return chosen, offsets


def _paste(images: Tensor, chosen: list[Tensor], offsets: list[Tensor | None], digits: int, shift: int) -> Tensor:
    """The canvases of a layout (any subset of its composites: pasting is per composite)."""
    side = CANVAS[digits] + 2 * shift
    count = chosen[0].shape[0]
    canvas = torch.zeros(count, side, side, dtype=torch.uint8)
    for (row, col), index, offset_of in zip(POSITIONS[digits], chosen, offsets):
        if offset_of is None:
            window = canvas[:, row : row + 28, col : col + 28]
            torch.maximum(window, images[index], out=window)
            continue
        # Paste the digits that share an offset together: at most (2 shift + 1)^2 groups.
        for offset in torch.unique(offset_of, dim=0).tolist():
            rows = (offset_of == torch.tensor(offset)).all(dim=1).nonzero().squeeze(1)
            top, left = row + shift + offset[0], col + shift + offset[1]
            window = canvas[rows, top : top + 28, left : left + 28]
            canvas[rows, top : top + 28, left : left + 28] = torch.maximum(window, images[index[rows]])
    return canvas


def _resize(canvas: Tensor, size: int, chunk: int = 2048) -> Tensor:
    if size == canvas.shape[-1]:
        return canvas.unsqueeze(1).clone()
    out = torch.empty(canvas.shape[0], 1, size, size, dtype=torch.uint8)
    for start in range(0, canvas.shape[0], chunk):
        part = canvas[start : start + chunk].unsqueeze(1).float()
        scaled = F.interpolate(part, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        out[start : start + chunk] = scaled.round().clamp(0, 255).to(torch.uint8)
    return out


@dataclass
class MultiMnist:
    """Generated Multi-MNIST splits: uint8 images [N, 1, S, S] and int64 labels [N, digits]."""

    recipe: MultiMnistRecipe
    train_images: Tensor
    train_labels: Tensor
    test_images: Tensor
    test_labels: Tensor
    source: str

    @property
    def num_tasks(self) -> int:
        return self.recipe.digits

    @staticmethod
    def images(batch: Tensor) -> Tensor:
        """uint8 [B, 1, S, S] -> float [B, 3, S, S] in [0, 1] (the grey channel repeated)."""
        return (batch.float() / 255.0).expand(-1, 3, -1, -1)

    def describe(self) -> str:
        r = self.recipe
        layout = f"random shifts up to {r.shift}px" if r.shift else "fixed positions"
        if r.digits in GRID_DIGITS:
            side = math.isqrt(r.digits)
            layout = f"a {side}x{side} grid, {layout}"
        return (f"Multi-MNIST {r.digits} digits, {r.input_size}x{r.input_size}, {self.train_images.shape[0]} train / "
                f"{self.test_images.shape[0]} test composites ({layout}) from {self.source}, seed {r.seed}")


def holdout_splits(recipe: MultiMnistRecipe, digits: DigitSplits) -> tuple[Tensor, Tensor, Tensor, Tensor, str]:
    """The digits the train and the evaluation composites are made of, and the source's description.

    ``holdout = "validation"`` never touches the test digits: the evaluation composites come from
    the last ``VALIDATION_FRACTION`` of the training digits and the training composites from the
    rest, so hyperparameters can be chosen without looking at the test set.
    """
    if recipe.holdout == "test":
        return digits.train_images, digits.train_labels, digits.test_images, digits.test_labels, digits.source
    count = digits.train_labels.shape[0]
    held = max(1, round(VALIDATION_FRACTION * count))
    if held >= count:
        raise ValueError(f"a validation split needs at least 2 training digits, the source has {count}")
    keep = count - held
    return (digits.train_images[:keep], digits.train_labels[:keep], digits.train_images[keep:],
            digits.train_labels[keep:], f"{digits.source}; validation: {keep} train / {held} held-out training digits")


class CachedSplits(TypedDict):
    """What a Multi-MNIST cache file holds: the generated splits and their digit source."""

    source: str
    train_images: Tensor
    train_labels: Tensor
    test_images: Tensor
    test_labels: Tensor


def _generate(recipe: MultiMnistRecipe, digits: DigitSplits) -> CachedSplits:
    generator = torch.Generator().manual_seed(recipe.seed)
    train_images, train_labels, test_images, test_labels, source = holdout_splits(recipe, digits)
    composed: dict[str, tuple[Tensor, Tensor]] = {}
    for split, images, labels, size in (
        ("train", train_images, train_labels, recipe.train_size),
        ("test", test_images, test_labels, recipe.test_size),
    ):
        count = images.shape[0] if size is None else size
        canvas, targets = compose(images, labels, count, recipe.digits, generator, recipe.shift)
        composed[split] = (_resize(canvas, recipe.input_size), targets)
    return CachedSplits(source=source, train_images=composed["train"][0], train_labels=composed["train"][1],
                        test_images=composed["test"][0], test_labels=composed["test"][1])


def load_multimnist(
    recipe: MultiMnistRecipe, data_root: str | Path | None = None, cache_dir: str | Path | None = None
) -> MultiMnist:
    """Generate (or read from the cache) the Multi-MNIST splits of ``recipe``."""
    fingerprint = digit_source_fingerprint(data_root)
    # version 4: sizes above the digit count give more composites (version 3 capped them), shifts;
    # version 5: the run store's verified format (header with this key and the payload's SHA-256)
    key_text = json.dumps({**asdict(recipe), "source": fingerprint, "version": 5}, sort_keys=True)
    key = hashlib.sha1(key_text.encode()).hexdigest()[:16]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache / "multimnist" / f"{recipe.digits}digit-{recipe.input_size}px-{key}.pt"
    tensors: CachedSplits | None = None
    digits = load_mnist(data_root)  # also on a hit: the cached content is checked against the digits
    counts = _split_counts(recipe, digits)
    check_allocatable(recipe, counts)
    if os.path.lexists(path):
        try:
            # size (at most what the recipe's tensors take) and SHA-256 checked before anything is unpickled
            cached = read_checkpoint_file(path, what="Multi-MNIST cache file",
                                          max_payload_bytes=_payload_bound(recipe, counts))
            if cached.header.get("key") != key_text:
                raise ValueError("it was written for another recipe")
            tensors = _checked(cached.state, recipe)
            _verify_content(tensors, recipe, digits)
        except (ValueError, KeyError, TypeError) as error:  # a damaged, altered or oversized cache is rebuilt
            tensors = None
            warnings.warn(f"ignoring the cache file {path} ({error}); regenerating", stacklevel=2)
    if tensors is None:
        tensors = _generate(recipe, digits)
        try:
            make_directory(path.parent, "cache directory")
            write_checkpoint_file(path, tensors, {"kind": "multimnist-cache", "key": key_text})
        except UsageError as error:  # a full disk or read-only cache: train from memory, say why it is not kept
            warnings.warn(f"the Multi-MNIST data is not cached ({error})", stacklevel=2)
    return MultiMnist(recipe, tensors["train_images"], tensors["train_labels"], tensors["test_images"],
                      tensors["test_labels"], tensors["source"])


CACHE_KEYS = frozenset({"source", "train_images", "train_labels", "test_images", "test_labels"})
CACHE_SLACK_BYTES = 1 << 20  # the pickle's framing, the source string and the zip directory


def _split_counts(recipe: MultiMnistRecipe, digits: DigitSplits) -> tuple[int, int]:
    """How many train and test composites ``recipe`` makes of ``digits``."""
    train_images, _, test_images, _, _ = holdout_splits(recipe, digits)
    return (train_images.shape[0] if recipe.train_size is None else recipe.train_size,
            test_images.shape[0] if recipe.test_size is None else recipe.test_size)


def _tensor_bytes(recipe: MultiMnistRecipe, counts: Sequence[int]) -> int:
    """The bytes of the generated tensors: uint8 images [N, 1, S, S] and int64 labels [N, digits] per split."""
    return sum(counts) * (recipe.input_size**2 + 8 * recipe.digits)


def _payload_bound(recipe: MultiMnistRecipe, counts: tuple[int, int]) -> int:
    """The most a cache file of ``recipe`` can legitimately hold: its tensors and a little framing."""
    return _tensor_bytes(recipe, counts) + CACHE_SLACK_BYTES


def check_allocatable(recipe: MultiMnistRecipe, counts: Sequence[int], what: str = "Multi-MNIST") -> None:
    """Refuse (one line, before any allocation) composites whose tensors cannot fit in this machine's memory.

    ``counts``: the composites of each set ``recipe`` makes, the training set's first.  Generation holds
    a set's unresized canvases and the resized images at once, and training adds the index stream
    (8 bytes a training row): that is what is compared with the memory available now.  ``what`` names
    the data in the message (the MNIST attributes are composed as Multi-MNIST's).
    """
    canvas = recipe.canvas**2 * max(counts)
    needed = _tensor_bytes(recipe, counts) + canvas + 8 * counts[0]
    available = available_memory()
    if available is not None and needed > available:
        raise UsageError(
            f"{what} with {counts[0]} train and {sum(counts[1:])} evaluation composites of {recipe.input_size} px "
            f"needs about {needed / 2**30:.1f} GiB of memory, more than the {available / 2**30:.1f} GiB available: "
            "lower --train-size / --test-size / --input-size")


def _checked(tensors: dict[str, object], recipe: MultiMnistRecipe) -> CachedSplits:
    """Cached splits that fit ``recipe``: uint8 [N, 1, S, S] images, int64 [N, digits] labels in 0..9, nothing else.

    A key drmoo does not write is refused: it would be loaded into memory on every run for nothing.
    """
    unknown = sorted(map(str, set(tensors) - CACHE_KEYS))
    if unknown:
        raise ValueError(f"it holds entries drmoo never writes ({', '.join(unknown)[:200]})")
    if not isinstance(tensors.get("source"), str):
        raise ValueError("it records no digit source")
    for split in ("train", "test"):
        images, labels = tensors.get(f"{split}_images"), tensors.get(f"{split}_labels")
        if not isinstance(images, Tensor) or not isinstance(labels, Tensor):
            raise ValueError(f"its {split} split is not a pair of tensors")
        count = images.shape[0] if images.dim() else 0
        wanted = recipe.train_size if split == "train" else recipe.test_size
        if (images.dtype != torch.uint8 or tuple(images.shape[1:]) != (1, recipe.input_size, recipe.input_size)
                or count < 1 or (wanted is not None and count != wanted)):
            raise ValueError(f"its {split} images are {images.dtype} {tuple(images.shape)}, not uint8 "
                             f"[{wanted or 'N'}, 1, {recipe.input_size}, {recipe.input_size}]")
        if labels.dtype != torch.int64 or tuple(labels.shape) != (count, recipe.digits):
            raise ValueError(f"its {split} labels are {labels.dtype} {tuple(labels.shape)}, not int64 "
                             f"[{count}, {recipe.digits}]")
        if labels.numel() and not (0 <= int(labels.min()) and int(labels.max()) <= 9):
            raise ValueError(f"its {split} labels leave 0..9")
    return tensors  # type: ignore[return-value]  # every key and its type were checked above


SPOT_CHECKED_COMPOSITES = 64  # per split, rebuilt from the digits and compared on every cache read


def _verify_content(tensors: CachedSplits, recipe: MultiMnistRecipe, digits: DigitSplits) -> None:
    """Raise ValueError unless the cached tensors are what ``recipe`` generates from ``digits``.

    The payload's SHA-256 only detects damage: anyone can write an edited cache in drmoo's format
    with a matching hash.  So the content is checked against its source.  Every label is
    recomputed (replaying the recipe's random draws costs a few milliseconds; a label edit, such as
    zeroing them, is always caught) and ``SPOT_CHECKED_COMPOSITES`` composites per split, chosen
    afresh at random on each read, are rebuilt from their digits and compared pixel for pixel
    (rebuilding them all would cost what the cache saves).  An image edit that touches a fraction f
    of a split's composites escapes one read with probability about (1 - f) ** 64.
    """
    generator = torch.Generator().manual_seed(recipe.seed)  # the draws of _generate, in its order
    pick = torch.Generator().manual_seed(secrets.randbits(63))  # unpredictable: which composites are rebuilt
    train_images, train_labels, test_images, test_labels, source = holdout_splits(recipe, digits)
    if tensors["source"] != source:
        raise ValueError(f"it records the digit source {tensors['source']!r}, not {source!r}")
    for split, images, labels, size, cached_images, cached_labels in (
        ("train", train_images, train_labels, recipe.train_size, tensors["train_images"], tensors["train_labels"]),
        ("test", test_images, test_labels, recipe.test_size, tensors["test_images"], tensors["test_labels"]),
    ):
        count = images.shape[0] if size is None else size
        chosen, offsets = _draw_layout(count, images.shape[0], recipe.digits, generator, recipe.shift)
        if not torch.equal(cached_labels, torch.stack([labels[index] for index in chosen], dim=1)):
            raise ValueError(f"its {split} labels are not the ones the recipe gives its digits")
        rows = torch.randperm(count, generator=pick)[:SPOT_CHECKED_COMPOSITES]
        canvas = _paste(images, [index[rows] for index in chosen],
                        [None if offset is None else offset[rows] for offset in offsets], recipe.digits, recipe.shift)
        if not torch.equal(_resize(canvas, recipe.input_size), cached_images[rows]):
            raise ValueError(f"its {split} images are not the composites the recipe builds from its digits")
