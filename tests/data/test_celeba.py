"""CelebA loader on a generated tree in torchvision's on-disk format: splits, labels, decoding, cache, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from drmoo.data import celeba
from drmoo.data.celeba import ATTRIBUTES, find_celeba_root, load_celeba

# The 40 names of the real list_attr_celeba.txt, in its order.
ALL_ATTRIBUTES = (
    "5_o_Clock_Shadow Arched_Eyebrows Attractive Bags_Under_Eyes Bald Bangs Big_Lips Big_Nose Black_Hair "
    "Blond_Hair Blurry Brown_Hair Bushy_Eyebrows Chubby Double_Chin Eyeglasses Goatee Gray_Hair Heavy_Makeup "
    "High_Cheekbones Male Mouth_Slightly_Open Mustache Narrow_Eyes No_Beard Oval_Face Pale_Skin Pointy_Nose "
    "Receding_Hairline Rosy_Cheeks Sideburns Smiling Straight_Hair Wavy_Hair Wearing_Earrings Wearing_Hat "
    "Wearing_Lipstick Wearing_Necklace Wearing_Necktie Young"
).split()
SPLITS = [0] * 24 + [1] * 6 + [2] * 10  # 24 train, 6 valid, 10 test


def tree_labels(count: int = len(SPLITS)) -> np.ndarray:
    """The -1/1 attribute table [count, 40] of the generated tree (seeded; Bald is rare)."""
    values = np.where(np.random.default_rng(0).random((count, 40)) < 0.4, 1, -1)
    bald = ALL_ATTRIBUTES.index("Bald")
    values[:, bald] = -1
    values[[0, 1], bald] = 1  # two bald faces, both in the training split: the test split has no positive
    return values


def make_celeba_tree(root: Path, width: int = 16, height: int = 32, nested: bool = True) -> Path:
    """A small CelebA in the real layout: portrait JPEGs (like 178 x 218) and both annotation files.

    Image i is a flat colour in its central square, (6 * i, 255 - 5 * i, 128), with a red band above
    and below (cut away by the loader's centre crop).  Returns the folder holding the files.
    """
    base = root / "celeba" if nested else root
    images = base / "img_align_celeba"
    images.mkdir(parents=True)
    values = tree_labels()
    names = [f"{i + 1:06d}.jpg" for i in range(len(SPLITS))]
    band = (height - width) // 2
    for i, name in enumerate(names):
        pixels = np.zeros((height, width, 3), dtype=np.uint8)
        pixels[:] = (255, 0, 0)
        pixels[band : band + width] = (6 * i, 255 - 5 * i, 128)
        Image.fromarray(pixels).save(images / name, quality=95, subsampling=0)  # 4:4:4: no colour bleeding
    # The real file: the count, the names with a trailing space, then values padded to width 2.
    lines = [str(len(names)), " ".join(ALL_ATTRIBUTES) + " "]
    lines += [name + " " + " ".join(f"{v:2d}" for v in row) for name, row in zip(names, values)]
    (base / "list_attr_celeba.txt").write_text("\n".join(lines) + "\n")
    (base / "list_eval_partition.txt").write_text("".join(f"{n} {s}\n" for n, s in zip(names, SPLITS)))
    return base


def expected_labels() -> torch.Tensor:
    values = tree_labels()
    columns = [ALL_ATTRIBUTES.index(name) for name in ATTRIBUTES]
    return torch.from_numpy((values[:, columns] + 1) // 2).long()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return make_celeba_tree(tmp_path)


def test_the_generated_tree_has_the_real_spacing(tree: Path) -> None:
    lines = (tree / "list_attr_celeba.txt").read_text().splitlines()
    assert lines[0] == "40" and lines[1].startswith("5_o_Clock_Shadow Arched_Eyebrows") and lines[1].endswith(" ")
    assert "  1" in lines[2] or " -1" in lines[2]  # values separated by one or two spaces
    assert len(lines[2].split()) == 41


def test_splits_labels_and_lazy_images(tree: Path) -> None:
    data = load_celeba(tree.parent, input_size=16)
    labels = expected_labels()
    assert data.num_tasks == 8 and data.root == tree
    assert data.train_images.tolist() == list(range(24))
    assert data.valid_images.tolist() == list(range(24, 30))
    assert data.test_images.tolist() == list(range(30, 40))
    assert torch.equal(data.train_labels, labels[:24]) and torch.equal(data.test_labels, labels[30:])
    assert int(data.test_labels[:, ATTRIBUTES.index("Bald")].sum()) == 0
    batch = data.images(data.test_images[:3])
    assert batch.shape == (3, 3, 16, 16) and batch.dtype == torch.float32
    for k, row in enumerate(range(30, 33)):
        want = torch.tensor([6 * row, 255 - 5 * row, 128]) / 255
        # the red bands are cropped away: every pixel is the central colour (up to JPEG error)
        assert torch.allclose(batch[k], want.view(3, 1, 1).expand(3, 16, 16), atol=12 / 255)
    smaller = load_celeba(tree, input_size=8).images(data.test_images[:1])  # crop, then resize 16 -> 8
    assert smaller.shape == (1, 3, 8, 8)
    assert torch.allclose(smaller[0], batch[0, :, :8, :8], atol=4 / 255)


def test_root_may_be_the_celeba_folder_itself(tmp_path: Path) -> None:
    flat = make_celeba_tree(tmp_path, nested=False)
    assert find_celeba_root(tmp_path) == flat
    nested = make_celeba_tree(tmp_path / "other")
    assert find_celeba_root(tmp_path / "other") == nested
    assert find_celeba_root(nested) == nested


def test_subsets_keep_the_first_rows_and_a_big_batch_uses_the_pool(tree: Path) -> None:
    data = load_celeba(tree, input_size=16, train_size=5, test_size=3)
    assert data.train_images.tolist() == [0, 1, 2, 3, 4] and data.test_images.tolist() == [30, 31, 32]
    everything = torch.arange(40)
    pooled = data.images(everything)  # >= 16 rows: decoded by the thread pool
    one_by_one = torch.cat([data.images(everything[i : i + 1]) for i in range(40)])
    assert torch.equal(pooled, one_by_one)


def test_cache_serves_decoded_images_without_decoding_again(tree: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    first = load_celeba(tree, input_size=16, cache_dir=cache)
    want = first.images(torch.tensor([0, 5, 31]))
    assert len(list((cache / "celeba").glob("16px-*.u8"))) == 1

    decoded: list[str] = []
    real_decode = celeba.decode

    def counting_decode(path: Path, size: int) -> torch.Tensor:
        decoded.append(path.name)
        return real_decode(path, size)

    monkeypatch.setattr(celeba, "decode", counting_decode)
    again = load_celeba(tree, input_size=16, cache_dir=cache)  # a new process would see the same files
    assert torch.equal(again.images(torch.tensor([0, 5, 31])), want)
    # opening the cache decodes a random sample of its images to check them (here all three), nothing more
    assert sorted(decoded) == sorted(again.files[row] for row in (0, 5, 31))
    decoded.clear()
    assert torch.equal(again.images(torch.tensor([0, 5, 31])), want) and decoded == []  # served from the cache
    again.images(torch.tensor([1]))  # not cached yet
    assert decoded == [again.files[1]]


def test_missing_data_root_or_annotation_file(tree: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="needs --data-root"):
        load_celeba(None)
    (tree / "list_eval_partition.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks list_eval_partition\.txt"):
        load_celeba(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"lacks img_align_celeba, list_attr_celeba\.txt"):
        load_celeba(tmp_path / "empty")


def _rewrite_line(path: Path, number: int, text: str) -> None:
    lines = path.read_text().splitlines()
    lines[number - 1] = text
    path.write_text("\n".join(lines) + "\n")


def test_malformed_attribute_lines_name_the_file_and_line(tree: Path) -> None:
    attr = tree / "list_attr_celeba.txt"
    original = attr.read_text()
    row = original.splitlines()[4]
    _rewrite_line(attr, 5, row.replace("-1", " 0", 1))
    with pytest.raises(ValueError, match=r"list_attr_celeba.txt, line 5: attribute values must be -1 or 1, got '0'"):
        load_celeba(tree)
    attr.write_text(original)
    _rewrite_line(attr, 7, row.rsplit(" ", 1)[0])
    with pytest.raises(ValueError, match=r"list_attr_celeba.txt, line 7: expected a file name and 40 values, got 40"):
        load_celeba(tree)
    attr.write_text(original)
    _rewrite_line(attr, 1, "forty")
    with pytest.raises(ValueError, match=r"list_attr_celeba.txt, line 1: expected the number of images"):
        load_celeba(tree)
    _rewrite_line(attr, 1, "41")
    with pytest.raises(ValueError, match="announces 41 images but 40 rows follow"):
        load_celeba(tree)
    attr.write_text(original.replace("Wearing_Hat", "Wearing_Cap"))
    with pytest.raises(ValueError, match=r"line 2: the attribute header lacks Wearing_Hat"):
        load_celeba(tree)


def test_malformed_or_incomplete_partition_file(tree: Path) -> None:
    partition = tree / "list_eval_partition.txt"
    original = partition.read_text()
    _rewrite_line(partition, 3, "000003.jpg 7")
    with pytest.raises(ValueError, match=r"list_eval_partition.txt, line 3: expected 'filename split'"):
        load_celeba(tree)
    partition.write_text("".join(original.splitlines(keepends=True)[:-1]))
    with pytest.raises(ValueError, match=r"has no split for 1 image\(s\), e.g. 000040.jpg"):
        load_celeba(tree)


def test_missing_image_is_reported_before_training(tree: Path) -> None:
    (tree / "img_align_celeba" / "000007.jpg").unlink()
    with pytest.raises(FileNotFoundError, match=r"1 CelebA image\(s\) .* missing .*: 000007.jpg"):
        load_celeba(tree)


def test_corrupt_or_vanished_image_names_the_file(tree: Path) -> None:
    data = load_celeba(tree, input_size=16)
    (tree / "img_align_celeba" / "000003.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match=r"cannot decode CelebA image .*000003.jpg"):
        data.images(torch.tensor([0, 1, 2]))
    (tree / "img_align_celeba" / "000004.jpg").unlink()  # deleted after loading
    with pytest.raises(FileNotFoundError, match=r"CelebA image .*000004.jpg is missing"):
        data.images(torch.tensor([3]))


def test_bad_input_size(tree: Path) -> None:
    with pytest.raises(ValueError, match="input_size must be >= 8"):
        load_celeba(tree, input_size=4)


def test_all_forty_attributes_in_the_files_order(tree: Path) -> None:
    """celeba40's tasks: every column of list_attr_celeba.txt, in its order, with the labels of the file."""
    assert celeba.ALL_ATTRIBUTES == tuple(ALL_ATTRIBUTES) and set(ATTRIBUTES) < set(celeba.ALL_ATTRIBUTES)
    data = load_celeba(tree, input_size=16, attributes=celeba.ALL_ATTRIBUTES)
    every = torch.from_numpy((tree_labels() + 1) // 2).long()
    assert data.num_tasks == 40 and data.attributes == celeba.ALL_ATTRIBUTES
    assert torch.equal(data.train_labels, every[:24]) and torch.equal(data.test_labels, every[30:])
    assert data.describe().startswith("CelebA 40 attributes, 16x16, 24 train / 10 test images")
    # the paper's 8 are the same columns picked out of the 40, and the default is still those 8
    eight = load_celeba(tree, input_size=16)
    assert eight.attributes == ATTRIBUTES and eight.describe().startswith("CelebA 8 attributes")
    columns = [celeba.ALL_ATTRIBUTES.index(name) for name in ATTRIBUTES]
    assert torch.equal(eight.train_labels, data.train_labels[:, columns])
    # any order of any subset: the columns follow the order asked for
    picked = load_celeba(tree, input_size=16, attributes=("Young", "Bald"))
    assert torch.equal(picked.test_labels, every[30:][:, [39, 4]])


@pytest.mark.parametrize(("attributes", "message"), [
    (("Bald", "Bald"), "attributes must be distinct names"), ((), "attributes must be distinct names"),
    (("Bald", "Has_Tail"), "line 2: the attribute header lacks Has_Tail"),
])
def test_bad_attribute_lists_are_refused(tree: Path, attributes: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_celeba(tree, input_size=16, attributes=attributes)
