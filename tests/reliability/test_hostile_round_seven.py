"""Hostile input, round seven (attacks, metrics and the data loaders): one test per defect, named after it.

Each reproduction is the audit's: an FGSM budget of NaN, an attack that left a frozen BatchNorm training,
label columns that do not match the tasks, task names that do not match the columns, probabilities passed
as hard predictions, a float image size or seed in a Multi-MNIST recipe, a negative CelebA subset size,
an image listed twice in CelebA's partition file, a damaged gzip stream in an MNIST file, an MNIST header
announcing more than an idx file may hold, a CelebA header naming an attribute twice, a float CelebA image
size, and digit classes outside 0..9.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import Tensor, nn

from drmoo.attacks import fgsm, summed_task_loss
from drmoo.data.celeba import ALL_ATTRIBUTES, load_celeba, read_partitions
from drmoo.data.mnist import load_mnist
from drmoo.data.multimnist import MultiMnistRecipe
from drmoo.metrics import accuracy, balanced_accuracy, task_metrics


class TwoHeads(nn.Module):
    """A BatchNorm trunk and two 2-class heads on 3 x 2 x 2 images."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(12, 4)

    def forward(self, x: Tensor) -> list[Tensor]:
        z = self.fc(self.bn(x).flatten(1))
        return [z[:, :2], z[:, 2:]]


def attack_batch() -> tuple[TwoHeads, Tensor, Tensor]:
    torch.manual_seed(0)
    return TwoHeads(), torch.rand(5, 3, 2, 2), torch.randint(0, 2, (5, 2))


@pytest.mark.parametrize("eps", [float("nan"), float("inf"), True])
def test_fgsm_refuses_a_non_finite_budget(eps: float) -> None:
    # was: NaN passed the "eps < 0" check and returned all-NaN images (Inf: 0/1 images, NaN where grad = 0)
    model, images, labels = attack_batch()
    with pytest.raises(ValueError, match="FGSM eps must be >= 0 and finite, got "):
        fgsm(model, images, labels, eps)


def test_fgsm_restores_each_submodules_mode() -> None:
    # was: model.train(was_training) put a BatchNorm frozen in eval mode back into training mode
    model, images, labels = attack_batch()
    model.train()
    model.bn.eval()
    fgsm(model, images, labels, 0.1)
    assert model.training and not model.bn.training and model.fc.training


@pytest.mark.parametrize("columns", [1, 3])
def test_summed_task_loss_refuses_labels_that_do_not_match_the_tasks(columns: int) -> None:
    # was: one column too few failed deep in indexing (IndexError); one too many was ignored silently
    model, images, _ = attack_batch()
    with pytest.raises(ValueError, match=r"one column per task \(m = 2\).*\(5, " + str(columns)):
        summed_task_loss(model(images), torch.randint(0, 2, (5, columns)))
    with pytest.raises(ValueError, match="one column per task"):
        summed_task_loss(model(images), torch.randint(0, 2, (5,)))


def test_task_metrics_refuses_names_that_do_not_match_the_columns() -> None:
    # was: zip() dropped the third column from the names and auc_undefined_tasks; [] was replaced silently;
    # zero columns raised ZeroDivisionError
    labels = torch.tensor([[0, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 1]])
    scores = torch.randn(4, 3)
    for names in (["a", "b"], [], ["a", "b", "c", "d"]):
        with pytest.raises(ValueError, match=f"names must name the 3 task columns, got {len(names)}"):
            task_metrics(labels, labels, scores, names)
    with pytest.raises(ValueError, match="at least one task column"):
        task_metrics(torch.zeros(4, 0), torch.zeros(4, 0), torch.zeros(4, 0))
    assert task_metrics(labels, labels, scores, ["a", "b", "c"])["auc_undefined_tasks"] == ["c"]


def test_probabilities_passed_as_predictions_are_refused() -> None:
    # was: accuracy 0.0 (no probability equals a label), silently
    labels = torch.tensor([0, 1, 1, 0])
    with pytest.raises(ValueError, match=r"hard predictions in \{0, 1\}, got the value 0.2"):
        accuracy(labels, torch.tensor([0.2, 0.7, 0.9, 0.1]))
    with pytest.raises(ValueError, match="hard predictions"):
        balanced_accuracy(labels, torch.tensor([0, 2, 1, 0]))
    with pytest.raises(ValueError, match="hard predictions"):
        task_metrics(labels[:, None], labels[:, None].float() * 0.9, labels[:, None].float())
    assert accuracy(labels, torch.tensor([False, True, False, False])) == 0.75


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"input_size": 32.0}, "input_size must be an int >= 8, got 32.0"),
    ({"input_size": None}, "input_size must be an int >= 8, got None"),
    ({"seed": 1.5}, "seed must be an int, got 1.5"),
    ({"seed": True}, "seed must be an int, got True"),
])
def test_multimnist_recipe_refuses_non_integer_sizes_and_seeds(kwargs: dict, message: str) -> None:
    # was: accepted; generation then failed inside torch.empty / manual_seed (or '<' on None)
    with pytest.raises(ValueError, match=message):
        MultiMnistRecipe(**kwargs)


def small_celeba(root: Path, splits: list[int], partition_lines: list[str] | None = None) -> Path:
    """A CelebA tree of len(splits) 8 x 8 JPEGs in torchvision's layout."""
    images = root / "img_align_celeba"
    images.mkdir(parents=True)
    names = [f"{i + 1:06d}.jpg" for i in range(len(splits))]
    for name in names:
        Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(images / name)
    lines = [str(len(names)), " ".join(ALL_ATTRIBUTES)] + [name + " -1" * len(ALL_ATTRIBUTES) for name in names]
    (root / "list_attr_celeba.txt").write_text("\n".join(lines) + "\n")
    partitions = partition_lines or [f"{name} {split}" for name, split in zip(names, splits)]
    (root / "list_eval_partition.txt").write_text("\n".join(partitions) + "\n")
    return root


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"train_size": -1}, "train_size must be None .* got -1"), ({"test_size": 0}, "test_size must be None .* got 0"),
    ({"train_size": True}, "train_size must be None .* got True"),
    ({"test_size": 2.5}, "test_size must be None .* got 2.5"),
])
def test_celeba_refuses_subset_sizes_that_are_not_positive_ints(tmp_path: Path, kwargs: dict, message: str) -> None:
    # was: -1 silently dropped the last image of the split, True kept one, 2.5 failed in slicing
    root = small_celeba(tmp_path, [0, 0, 0, 2, 2])
    assert len(load_celeba(root, 8).train_images) == 3
    with pytest.raises(ValueError, match=message):
        load_celeba(root, 8, **kwargs)


def test_celeba_partition_file_listing_an_image_twice_is_refused(tmp_path: Path) -> None:
    # was: the last line won silently: 000001.jpg moved from the train split into the test split
    lines = ["000001.jpg 0", "000002.jpg 2", "000001.jpg 2"]
    root = small_celeba(tmp_path, [0, 2], lines)
    with pytest.raises(ValueError, match=r"line 3: 000001.jpg is listed a second time \(first as split 0\)"):
        read_partitions(root / "list_eval_partition.txt")
    with pytest.raises(ValueError, match="listed a second time"):
        load_celeba(root, 8)


def test_mnist_gzip_with_a_damaged_stream_names_the_file(tmp_path: Path) -> None:
    # was: zlib.error "Error -3 while decompressing data" escaped as a traceback
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, count in (("train", 4), ("t10k", 2)):
        for kind, shape in (("images-idx3", (count, 28, 28)), ("labels-idx1", (count,))):
            header = bytes([0, 0, 8, len(shape)]) + struct.pack(">" + "I" * len(shape), *shape)
            data = header + bytes(int(np.prod(shape)))
            (raw / f"{prefix}-{kind}-ubyte.gz").write_bytes(gzip.compress(data))
    assert load_mnist(tmp_path).train_images.shape == (4, 28, 28)
    damaged = bytearray((raw / "train-images-idx3-ubyte.gz").read_bytes())
    damaged[12:30] = bytes(byte ^ 0xFF for byte in damaged[12:30])  # inside the deflate stream, past the header
    (raw / "train-images-idx3-ubyte.gz").write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: cannot be read .*corrupt or truncated"):
        load_mnist(tmp_path)


def write_mnist(raw: Path, train_count: int = 4) -> None:
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, count in (("train", train_count), ("t10k", 2)):
        for kind, shape in (("images-idx3", (count, 28, 28)), ("labels-idx1", (count,))):
            header = bytes([0, 0, 8, len(shape)]) + struct.pack(">" + "I" * len(shape), *shape)
            (raw / f"{prefix}-{kind}-ubyte.gz").write_bytes(gzip.compress(header + bytes(int(np.prod(shape)))))


def test_mnist_idx_file_announcing_more_than_the_cap_is_refused_before_its_body_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # was: the whole decompressed stream was read into memory first (a small .gz can inflate to gigabytes)
    from drmoo.data import mnist

    write_mnist(tmp_path / "MNIST" / "raw", train_count=4)
    monkeypatch.setattr(mnist, "MAX_IDX_BYTES", 3 * 28 * 28)
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: its header announces 3,136 bytes of data "
                                         r"\(shape \(4, 28, 28\)\), more than the 2,352"):
        load_mnist(tmp_path)


def test_celeba_header_naming_an_attribute_twice_is_refused(tmp_path: Path) -> None:
    # was: the first of the two columns was used silently
    root = small_celeba(tmp_path, [0, 2])
    path = root / "list_attr_celeba.txt"
    lines = path.read_text().splitlines()
    names = lines[1].split()
    names[names.index("Young")] = "Smiling"  # "Smiling" twice, still 40 columns
    lines[1] = " ".join(names)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="line 2: the attribute header names Smiling more than once"):
        load_celeba(root, 8, attributes=("Smiling",))


@pytest.mark.parametrize("size", [16.0, True])
def test_celeba_refuses_an_input_size_that_is_not_an_int(tmp_path: Path, size: object) -> None:
    # was: 16.0 loaded and named its cache file "16.0px"; True failed as "must be >= 8, got True"
    root = small_celeba(tmp_path, [0, 2])
    with pytest.raises(ValueError, match=f"input_size must be >= 8 and an int, got {size!r}"):
        load_celeba(root, size)  # type: ignore[arg-type]


def test_attribute_labels_refuse_digit_classes_outside_0_to_9() -> None:
    # was: 12 and -1 were labelled by the predicates as if they were digits
    from drmoo.data.attributes import attribute_labels

    assert attribute_labels(torch.tensor([[3, 9]])).shape == (1, 8)
    with pytest.raises(ValueError, match=r"digit classes must be in 0\.\.9, got 12"):
        attribute_labels(torch.tensor([[3, 12]]))
    with pytest.raises(ValueError, match="got -1"):
        attribute_labels(torch.tensor([[-1, 2]]))
    with pytest.raises(TypeError, match=r"digit classes must be integers, got torch\.float32"):
        attribute_labels(torch.tensor([[3.0, 4.0]]))
