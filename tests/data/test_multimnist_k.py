"""Multi-MNIST-k (k digits on a sqrt(k) x sqrt(k) grid): geometry, labels, caching, validation split,
content checks and determinism, on small shapes; and that the 2- and 3-digit layouts stay what they were."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from drmoo.data import MultiMnistRecipe, load_mnist, load_multimnist
from drmoo.data.multimnist import CANVAS, GRID_DIGITS, GRID_STRIDE, POSITIONS, compose, grid_positions
from drmoo.store import read_checkpoint_file, write_checkpoint_file


def _data_tests() -> ModuleType:
    # the fabricated torchvision MNIST tree lives with the 2/3-digit tests (pytest's importlib mode: no package)
    path = Path(__file__).parent / "test_multimnist.py"
    spec = importlib.util.spec_from_file_location("multimnist_data_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def mnist_root(tmp_path: Path) -> Path:
    """A fabricated torchvision MNIST root: 30 training and 12 test digits of random pixels."""
    _data_tests()._mnist_tree(tmp_path / "mnist", compress=False)
    return tmp_path / "mnist"


def test_the_grid_layouts() -> None:
    """k = 4 and 9: row-major corners GRID_STRIDE = 14 apart, and a canvas that just holds the last digit."""
    assert GRID_DIGITS == (4, 9) and GRID_STRIDE == 14
    assert POSITIONS[4] == ((0, 0), (0, 14), (14, 0), (14, 14))
    assert POSITIONS[9] == tuple((14 * row, 14 * col) for row in range(3) for col in range(3))
    assert CANVAS[4] == 42 and CANVAS[9] == 56
    assert MultiMnistRecipe(digits=9, shift=2).canvas == 60
    for digits in (5, 8, 1, 0):
        with pytest.raises(ValueError, match="square number of digits >= 4"):
            grid_positions(digits)
    assert grid_positions(16)[-1] == (42, 42)  # the rule holds beyond the two built layouts


def test_the_two_and_three_digit_layouts_are_unchanged() -> None:
    """Guards the generalisation: the 2/3-digit entries of the shared tables are the layouts the cached data
    (and every committed result) were built with.  (Their generated caches were also checked byte-identical
    before and after it, recipes of both digit counts with and without shifts and a validation holdout.)"""
    assert POSITIONS[2] == ((0, 0), (8, 8)) and POSITIONS[3] == ((0, 0), (14, 7), (0, 14))
    assert CANVAS[2] == 36 and CANVAS[3] == 42


@pytest.mark.parametrize("digits", GRID_DIGITS)
def test_each_digit_fills_its_own_region(digits: int) -> None:
    """Only digit 3 is lit (all 255) and the others are black: every canvas is lit exactly on the union of
    the 28 x 28 regions at the positions whose label is 3, so each position is its region and its label."""
    count, available = 60, 10
    images = torch.zeros(available, 28, 28, dtype=torch.uint8)
    images[3] = 255
    labels = torch.arange(available)
    canvas, targets = compose(images, labels, count, digits, torch.Generator().manual_seed(0))
    side = CANVAS[digits]
    assert canvas.shape == (count, side, side) and targets.shape == (count, digits) and targets.dtype == torch.int64
    assert torch.equal(targets[:, 0], labels[torch.arange(count) % available])  # position 0 cycles the digits
    for j in range(count):
        mask = torch.zeros(side, side, dtype=torch.uint8)
        for (row, col), label in zip(POSITIONS[digits], targets[j].tolist()):
            if label == 3:
                mask[row : row + 28, col : col + 28] = 255
        assert torch.equal(canvas[j], mask), j
    assert bool((targets == 3).any(dim=0).all())  # every position held the lit digit at least once


@pytest.mark.parametrize("digits", GRID_DIGITS)
def test_overlaps_take_the_brighter_digit(digits: int) -> None:
    """Digit k is a flat 10 (k + 1): a pixel shows the brightest digit whose region covers it."""
    images = torch.stack([torch.full((28, 28), 10 * (k + 1), dtype=torch.uint8) for k in range(10)])
    canvas, targets = compose(images, torch.arange(10), 20, digits, torch.Generator().manual_seed(1))
    side = CANVAS[digits]
    for j in range(20):
        want = torch.zeros(side, side, dtype=torch.uint8)
        for (row, col), label in zip(POSITIONS[digits], targets[j].tolist()):
            region = want[row : row + 28, col : col + 28]
            torch.maximum(region, torch.tensor(10 * (label + 1), dtype=torch.uint8), out=region)
        assert torch.equal(canvas[j], want)


def test_generation_is_deterministic_cached_and_keyed(mnist_root: Path, tmp_path: Path) -> None:
    recipe = MultiMnistRecipe(digits=4, input_size=28, seed=3, train_size=50, test_size=20)
    first = load_multimnist(recipe, data_root=mnist_root, cache_dir=tmp_path / "a")
    again = load_multimnist(recipe, data_root=mnist_root, cache_dir=tmp_path / "b")  # generated afresh elsewhere
    for name in ("train_images", "train_labels", "test_images", "test_labels"):
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    assert first.train_images.shape == (50, 1, 28, 28) and first.train_labels.shape == (50, 4)
    assert first.num_tasks == 4 and "a 2x2 grid, fixed positions" in first.describe()
    (cached,) = (tmp_path / "a" / "multimnist").glob("*.pt")
    assert cached.name.startswith("4digit-28px-")
    stamp = cached.stat().st_mtime_ns
    hit = load_multimnist(recipe, data_root=mnist_root, cache_dir=tmp_path / "a")  # read back, not rewritten
    assert cached.stat().st_mtime_ns == stamp and torch.equal(hit.test_images, first.test_images)
    # another seed or another k is another cache entry with other composites
    other = load_multimnist(MultiMnistRecipe(digits=4, input_size=28, seed=4, train_size=50, test_size=20),
                            data_root=mnist_root, cache_dir=tmp_path / "a")
    nine = load_multimnist(MultiMnistRecipe(digits=9, input_size=28, seed=3, train_size=50, test_size=20),
                           data_root=mnist_root, cache_dir=tmp_path / "a")
    assert not torch.equal(other.train_labels, first.train_labels)
    assert nine.train_labels.shape == (50, 9) and "a 3x3 grid" in nine.describe()
    names = sorted(path.name.split("-")[0] for path in (tmp_path / "a" / "multimnist").glob("*.pt"))
    assert names == ["4digit", "4digit", "9digit"]


@pytest.mark.parametrize("digits", GRID_DIGITS)
def test_labels_are_the_digits_at_each_position(digits: int, mnist_root: Path, tmp_path: Path) -> None:
    """Composite j's label k is the class of the digit pasted at position k: the first position cycles through
    the split's digits, and every label is one of the split's (train from train digits, test from test)."""
    recipe = MultiMnistRecipe(digits=digits, input_size=28, train_size=70, test_size=25)
    data = load_multimnist(recipe, data_root=mnist_root, cache_dir=tmp_path)
    source = load_mnist(mnist_root)
    assert torch.equal(data.train_labels[:, 0], source.train_labels[torch.arange(70) % 30])
    assert torch.equal(data.test_labels[:, 0], source.test_labels[torch.arange(25) % 12])
    assert set(data.train_labels.flatten().tolist()) <= set(source.train_labels.tolist())
    assert set(data.test_labels.flatten().tolist()) <= set(source.test_labels.tolist())
    assert int(data.train_labels.min()) >= 0 and int(data.train_labels.max()) <= 9


def test_the_validation_split_never_touches_the_test_digits(mnist_root: Path, tmp_path: Path) -> None:
    """holdout = "validation": evaluation composites from the last 20 % of the training digits (6 of 30),
    training composites from the other 24; the test digits appear nowhere."""
    recipe = MultiMnistRecipe(digits=9, input_size=28, train_size=40, test_size=18, holdout="validation")
    data = load_multimnist(recipe, data_root=mnist_root, cache_dir=tmp_path)
    source = load_mnist(mnist_root)
    assert torch.equal(data.train_labels[:, 0], source.train_labels[:24][torch.arange(40) % 24])
    assert torch.equal(data.test_labels[:, 0], source.train_labels[24:][torch.arange(18) % 6])
    assert "validation: 24 train / 6 held-out training digits" in data.source
    assert set(data.test_labels.flatten().tolist()) <= set(source.train_labels[24:].tolist())
    test_run = load_multimnist(MultiMnistRecipe(digits=9, input_size=28, train_size=40, test_size=18),
                               data_root=mnist_root, cache_dir=tmp_path)
    assert torch.equal(test_run.test_labels[:, 0], source.test_labels[torch.arange(18) % 12])
    assert not torch.equal(test_run.test_images, data.test_images)


def _tamper(path: Path, edit: str) -> None:
    cached = read_checkpoint_file(path, what="test")
    state = dict(cached.state)
    if edit == "labels":
        state["test_labels"] = (state["test_labels"] + 1) % 10
    else:
        state["train_images"] = 255 - state["train_images"]
    write_checkpoint_file(path, state, cached.header)  # a well-formed file with a matching hash: only the content lies


@pytest.mark.parametrize("edit", ["labels", "images"])
def test_an_edited_cache_is_caught_and_regenerated(edit: str, mnist_root: Path, tmp_path: Path) -> None:
    recipe = MultiMnistRecipe(digits=4, input_size=28, seed=1, train_size=40, test_size=16)
    first = load_multimnist(recipe, data_root=mnist_root, cache_dir=tmp_path)
    (cached,) = (tmp_path / "multimnist").glob("*.pt")
    _tamper(cached, edit)
    with pytest.warns(UserWarning, match="not the (ones|composites) the recipe"):
        regenerated = load_multimnist(recipe, data_root=mnist_root, cache_dir=tmp_path)
    assert torch.equal(regenerated.test_labels, first.test_labels)
    assert torch.equal(regenerated.train_images, first.train_images)


def test_shifts_work_on_the_grid(mnist_root: Path, tmp_path: Path) -> None:
    """The grid layouts take the classic random shifts like the 2/3-digit ones (canvas grows by 2 shift)."""
    images = torch.zeros(10, 28, 28, dtype=torch.uint8)
    images[:, 0, 0] = 255  # a marker at each digit's top-left corner
    canvas, _ = compose(images, torch.arange(10), 200, 4, torch.Generator().manual_seed(0), shift=3)
    assert canvas.shape == (200, 48, 48)
    for j in range(200):  # four corners, each within 3 px of its grid position (+ the margin)
        corners = canvas[j].nonzero().tolist()
        assert len(corners) == 4
        for row, col in POSITIONS[4]:
            assert sum(row <= r <= row + 6 and col <= c <= col + 6 for r, c in corners) == 1
    data = load_multimnist(MultiMnistRecipe(digits=4, input_size=28, train_size=30, test_size=12, shift=3),
                           data_root=mnist_root, cache_dir=tmp_path)
    assert "a 2x2 grid, random shifts up to 3px" in data.describe()


@pytest.mark.parametrize("digits", [1, 5, 16, True, 4.0, "4"])
def test_bad_digit_counts_name_the_valid_ones(digits: object) -> None:
    with pytest.raises(ValueError, match=r"Multi-MNIST has 2, 3, 4 or 9 digits, got"):
        MultiMnistRecipe(digits=digits)  # type: ignore[arg-type]
