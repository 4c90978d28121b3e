"""Multi-MNIST generation: placement, labels, determinism, cache, and the MNIST readers."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from drmoo.data import MultiMnistRecipe, load_mnist, load_multimnist
from drmoo.data.multimnist import CANVAS, POSITIONS, compose


def stamp_digits(count: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Digit k is a 28x28 image whose every pixel is 10 * (k + 1): placement is readable off the canvas."""
    images = torch.stack([torch.full((28, 28), 10 * (k + 1), dtype=torch.uint8) for k in range(count)])
    return images, torch.arange(count)


@pytest.mark.parametrize("digits", [2, 3])
def test_digits_are_placed_where_the_recipe_says(digits: int) -> None:
    images, labels = stamp_digits()
    canvas, targets = compose(images, labels, 10, digits, torch.Generator().manual_seed(0))
    assert canvas.shape == (10, CANVAS[digits], CANVAS[digits]) and targets.shape == (10, digits)
    assert torch.equal(targets[:, 0], labels)  # composite j carries digit j at position 0
    for j in range(10):
        for k, (row, col) in enumerate(POSITIONS[digits]):
            window = canvas[j, row : row + 28, col : col + 28]
            value = 10 * (int(targets[j, k]) + 1)
            # overlap is the pixel-wise max, so every pixel of the window is at least the digit's value
            assert int(window.min()) >= value
            # the digit's own corner pixel is not covered by the others unless they are brighter
            corner = int(canvas[j, row, col])
            assert corner >= value
        assert int(canvas[j].max()) == 10 * (int(targets[j].max()) + 1)
    if digits == 2:  # top-left and bottom-right: the top-right and bottom-left 8x8 corners stay empty
        assert int(canvas[:, :8, 28:].max()) == 0 and int(canvas[:, 28:, :8].max()) == 0


def test_generation_is_deterministic_and_cached(tmp_path: Path) -> None:
    recipe = MultiMnistRecipe(digits=2, input_size=20, seed=3, train_size=50, test_size=20)
    first = load_multimnist(recipe, cache_dir=tmp_path / "a")
    again = load_multimnist(recipe, cache_dir=tmp_path / "b")  # generated afresh elsewhere
    assert torch.equal(first.train_images, again.train_images) and torch.equal(first.test_labels, again.test_labels)
    other = load_multimnist(MultiMnistRecipe(digits=2, input_size=20, seed=4, train_size=50, test_size=20),
                            cache_dir=tmp_path / "a")
    assert not torch.equal(first.train_labels, other.train_labels)
    cached = list((tmp_path / "a" / "multimnist").glob("*.pt"))
    assert len(cached) == 2
    assert first.train_images.shape == (50, 1, 20, 20) and first.train_images.dtype == torch.uint8
    batch = first.images(first.train_images[:4])
    assert batch.shape == (4, 3, 20, 20) and 0.0 <= float(batch.min()) and float(batch.max()) <= 1.0
    # a corrupt cache file is regenerated, not fatal
    for path in cached:
        path.write_bytes(b"not a tensor file")
    with pytest.warns(UserWarning, match="ignoring the cache file"):
        regenerated = load_multimnist(recipe, cache_dir=tmp_path / "a")
    assert torch.equal(regenerated.train_images, first.train_images)


def test_embedded_digits_are_real_shuffled_and_split() -> None:
    digits = load_mnist(None)
    assert digits.train_images.shape == (4000, 28, 28) and digits.test_images.shape == (1000, 28, 28)
    # shuffled: the first 50 training labels are not one class (the file is sorted by class)
    assert len(set(digits.train_labels[:50].tolist())) > 5
    assert set(digits.test_labels.tolist()) == set(range(10))


def _write_idx(path: Path, array: np.ndarray, compress: bool, truncate: int = 0) -> None:
    header = bytes([0, 0, 8, array.ndim]) + struct.pack(">" + "I" * array.ndim, *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    data = data[: len(data) - truncate] if truncate else data
    if compress:
        with gzip.open(str(path) + ".gz", "wb") as handle:
            handle.write(data)
    else:
        path.write_bytes(data)


def _mnist_tree(root: Path, compress: bool, truncate_file: str | None = None) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, count in (("train", 30), ("t10k", 12)):
        images, labels = rng.integers(0, 256, (count, 28, 28)), rng.integers(0, 10, count)
        cut = 100 if truncate_file == f"{prefix}-images-idx3-ubyte" else 0
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", images, compress, cut)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels, compress)


@pytest.mark.parametrize("compress", [False, True])
def test_torchvision_idx_layout(tmp_path: Path, compress: bool) -> None:
    _mnist_tree(tmp_path, compress)
    digits = load_mnist(tmp_path)
    assert digits.train_images.shape == (30, 28, 28) and digits.test_labels.shape == (12,)
    data = load_multimnist(MultiMnistRecipe(digits=3, input_size=42), data_root=tmp_path, cache_dir=tmp_path / "c")
    assert data.train_labels.shape == (30, 3) and data.test_images.shape == (12, 1, 42, 42)


def test_broken_data_roots_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_mnist(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        load_mnist(tmp_path / "empty")
    _mnist_tree(tmp_path / "cut", compress=False, truncate_file="t10k-images-idx3-ubyte")
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte: truncated"):
        load_mnist(tmp_path / "cut")
    _mnist_tree(tmp_path / "bad", compress=False)
    (tmp_path / "bad" / "MNIST" / "raw" / "train-labels-idx1-ubyte").write_bytes(b"\x00\x00\x0d\x01garbage")
    with pytest.raises(ValueError, match="train-labels-idx1-ubyte: not an idx file"):
        load_mnist(tmp_path / "bad")


def test_bad_recipes() -> None:
    with pytest.raises(ValueError, match="2, 3, 4 or 9 digits"):
        MultiMnistRecipe(digits=5)
    with pytest.raises(ValueError, match="input_size"):
        MultiMnistRecipe(input_size=4)


def marker_digits(count: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Digit k is black but for one pixel at its top-left corner: the canvas shows where each digit went."""
    images = torch.zeros(count, 28, 28, dtype=torch.uint8)
    images[:, 0, 0] = 255
    return images, torch.arange(count)


def test_shifted_composites_move_every_digit_independently_and_unbiased() -> None:
    images, labels = marker_digits()
    shift, count = 4, 3000
    canvas, targets = compose(images, labels, count, 3, torch.Generator().manual_seed(0), shift=shift)
    assert canvas.shape == (count, CANVAS[3] + 2 * shift, CANVAS[3] + 2 * shift) and targets.shape == (count, 3)
    # With 3 digits the corners' reachable boxes are disjoint, so each corner says which digit it is.
    offsets = torch.zeros(count, 3, 2, dtype=torch.long)
    for j in range(count):
        corners = canvas[j].nonzero().tolist()
        assert len(corners) == 3
        for k, (row, col) in enumerate(POSITIONS[3]):
            mine = [(r, c) for r, c in corners
                    if row <= r <= row + 2 * shift and col <= c <= col + 2 * shift]
            assert len(mine) == 1, (j, k, corners)
            offsets[j, k] = torch.tensor(mine[0]) - torch.tensor([row + shift, col + shift])
    assert int(offsets.min()) == -shift and int(offsets.max()) == shift
    for k in range(3):  # every one of the 81 offsets occurs, and they average to ~0 (no edge bias)
        assert len({tuple(o) for o in offsets[:, k].tolist()}) == (2 * shift + 1) ** 2
        assert offsets[:, k].double().mean(0).abs().max() < 0.25
    assert not torch.equal(offsets[:, 0], offsets[:, 1])  # independent per digit


def test_more_composites_than_digits_cycle_the_first_position() -> None:
    images, labels = stamp_digits(10)
    canvas, targets = compose(images, labels, 25, 2, torch.Generator().manual_seed(0), shift=2)
    assert canvas.shape == (25, 40, 40)
    assert torch.equal(targets[:, 0], labels[torch.arange(25) % 10])
    # every digit is pasted whole: the window of the first digit holds its value everywhere
    full = stamp_digits(10)[0].fill_(255)
    canvas, _ = compose(full, labels, 25, 2, torch.Generator().manual_seed(1), shift=2)
    assert int((canvas > 0).sum(dim=(1, 2)).min()) >= 28 * 28
    with pytest.raises(ValueError, match="empty digit split"):
        compose(images[:0], labels[:0], 3, 2, torch.Generator())


def test_unshifted_composites_are_the_fixed_layout() -> None:
    images, labels = stamp_digits()
    fixed, fixed_targets = compose(images, labels, 10, 2, torch.Generator().manual_seed(5))
    again, again_targets = compose(images, labels, 10, 2, torch.Generator().manual_seed(5), shift=0)
    assert torch.equal(fixed, again) and torch.equal(fixed_targets, again_targets)


def test_recipe_sizes_above_the_digit_count_and_shifts(tmp_path: Path) -> None:
    _mnist_tree(tmp_path, compress=False)  # 30 train / 12 test digits
    recipe = MultiMnistRecipe(digits=2, input_size=20, train_size=100, test_size=30, shift=4)
    data = load_multimnist(recipe, data_root=tmp_path, cache_dir=tmp_path / "c")
    digits = load_mnist(tmp_path)
    assert data.train_labels.shape == (100, 2) and data.test_images.shape == (30, 1, 20, 20)
    assert torch.equal(data.train_labels[:, 0], digits.train_labels[torch.arange(100) % 30])
    assert "random shifts up to 4px" in data.describe() and recipe.canvas == 44
    unshifted = load_multimnist(MultiMnistRecipe(digits=2, input_size=20, train_size=100, test_size=30),
                                data_root=tmp_path, cache_dir=tmp_path / "c")
    assert not torch.equal(unshifted.train_images, data.train_images)  # a separate cache entry
    assert "fixed positions" in unshifted.describe()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"shift": -1}, "shift must be an int in"), ({"shift": 15}, "shift must be an int in"),
    ({"shift": True}, "shift must be an int in"), ({"train_size": 0}, "train_size must be None"),
    ({"test_size": 2.5}, "test_size must be None"),
])
def test_bad_sizes_and_shifts(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MultiMnistRecipe(**kwargs)
