"""CelebA (paper §5.2): 8 binary attributes as tasks (or all 40), read from torchvision's on-disk layout.

Only three things under ``data_root`` (or ``data_root/celeba``, torchvision's base folder) are read:

* ``img_align_celeba/`` - the aligned JPEGs (178 x 218);
* ``list_attr_celeba.txt`` - line 1 the image count, line 2 the 40 attribute names, then
  ``filename v1 ... v40`` with values -1 / 1 (columns separated by any run of spaces);
* ``list_eval_partition.txt`` - ``filename split`` with 0 train / 1 valid / 2 test.

Nothing is downloaded and no checksum is checked.  Labels are ``(v + 1) / 2`` (1 = attribute
present).  Splits are the official partitions; ``train_size`` / ``test_size`` keep the first rows of
a split in file order (so every seed and method sees the same subset).

Images are decoded lazily, one batch at a time (CelebA has ~200k images, far too many to hold in
memory): ``train_images`` / ``valid_images`` / ``test_images`` are int64 tensors of row indices into
the annotation file, and :meth:`CelebA.images` turns a batch of them into float ``[B, 3, S, S]`` in
[0, 1].  Decoding: RGB, centre crop to a square (178 x 178 for the aligned faces, so faces are not
squashed), bilinear antialiased resize to ``input_size`` (paper: 128).  A batch is decoded by a
small thread pool (PIL releases the GIL while decoding).

Cache (optional, ``cache_dir``): decoded ``uint8 [3, S, S]`` images go into one sparse memory-mapped
file per (annotation file, image size), with a one-byte "filled" flag per image.  JPEG decoding
costs ~1-2 ms per image, as much as a GPU step for a batch of 256, while reading 48 KiB back from
the page cache is ~free; the full data set at 128 px takes ~10 GB of disk, so it is opt-in.  The flag
is written after the pixels, so an interrupted run leaves at worst an image decoded twice.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch import Tensor

from drmoo.store import make_directory, open_mapped_file, read_text

__all__ = ["ALL_ATTRIBUTES", "ATTRIBUTES", "MAX_IMAGE_PIXELS", "CelebA", "check_image_sizes", "find_celeba_root",
           "load_celeba", "read_attributes", "read_partitions"]

# Paper App. D: the 8 attributes used as tasks, in this order.
ATTRIBUTES: tuple[str, ...] = (
    "Bald", "Wearing_Hat", "Eyeglasses", "Receding_Hairline", "Narrow_Eyes", "Blond_Hair", "Bags_Under_Eyes",
    "Big_Nose",
)
# All 40 attributes of list_attr_celeba.txt, in the file's order: the tasks of the celeba40 experiment.
ALL_ATTRIBUTES: tuple[str, ...] = (
    "5_o_Clock_Shadow", "Arched_Eyebrows", "Attractive", "Bags_Under_Eyes", "Bald", "Bangs", "Big_Lips", "Big_Nose",
    "Black_Hair", "Blond_Hair", "Blurry", "Brown_Hair", "Bushy_Eyebrows", "Chubby", "Double_Chin", "Eyeglasses",
    "Goatee", "Gray_Hair", "Heavy_Makeup", "High_Cheekbones", "Male", "Mouth_Slightly_Open", "Mustache",
    "Narrow_Eyes", "No_Beard", "Oval_Face", "Pale_Skin", "Pointy_Nose", "Receding_Hairline", "Rosy_Cheeks",
    "Sideburns", "Smiling", "Straight_Hair", "Wavy_Hair", "Wearing_Earrings", "Wearing_Hat", "Wearing_Lipstick",
    "Wearing_Necklace", "Wearing_Necktie", "Young",
)
IMAGE_DIR = "img_align_celeba"
ATTR_FILE = "list_attr_celeba.txt"
PARTITION_FILE = "list_eval_partition.txt"
CACHE_SPOT_CHECKS = 16  # cached images decoded again and compared each time a cache is opened (~2 ms each)
# The largest image decoded, in pixels (2048 x 2048; the aligned faces are 178 x 218): its RGB array is at
# most 12 MiB, so one decode thread holds a few tens of MiB whatever a file's header announces.  PIL's
# own limit (decompression-bomb error past 179 Mpx, a warning past 89 Mpx) let an 81 Mpx face cost 1.2 GB.
MAX_IMAGE_PIXELS = 1 << 22
_JPEG_FRAMES = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
SPLITS = {"train": 0, "valid": 1, "test": 2}


def find_celeba_root(data_root: str | Path | None) -> Path:
    """The folder holding the three CelebA entries: ``data_root/celeba`` if it has them, else ``data_root``."""
    if data_root is None:
        raise FileNotFoundError(
            "CelebA needs --data-root: a folder with img_align_celeba/, list_attr_celeba.txt and "
            "list_eval_partition.txt (torchvision's layout, ROOT/celeba/... or ROOT/...); nothing is downloaded"
        )
    root = Path(data_root).expanduser()
    for candidate in (root / "celeba", root):
        if (candidate / ATTR_FILE).is_file():
            root = candidate
            break
    missing = [name for name in (IMAGE_DIR, ATTR_FILE, PARTITION_FILE) if not (root / name).exists()]
    if missing:
        raise FileNotFoundError(
            f"CelebA root {root} lacks {', '.join(missing)}; expected img_align_celeba/, list_attr_celeba.txt "
            "and list_eval_partition.txt there or under celeba/ (torchvision's layout)"
        )
    return root


def _bad_line(path: Path, number: int, problem: str) -> ValueError:
    return ValueError(f"{path}, line {number}: {problem}")


def read_attributes(path: Path, attributes: tuple[str, ...] = ATTRIBUTES) -> tuple[list[str], Tensor]:
    """File names and labels ``int64 [N, len(attributes)]`` in {0, 1} from ``list_attr_celeba.txt``.

    The columns are ``attributes``, in that order, whatever the file's order; a name the header lacks,
    or one named twice (two tasks of one attribute), is refused.
    """
    if not attributes or len(set(attributes)) != len(attributes):
        raise ValueError(f"attributes must be distinct names, at least one, got {list(attributes)!r}")
    lines = read_text(path, what="CelebA annotation file").splitlines()
    if len(lines) < 2:
        raise ValueError(f"{path}: expected a count line and a header line, the file has {len(lines)} line(s)")
    try:
        count = int(lines[0].strip())
    except ValueError:
        raise _bad_line(path, 1, f"expected the number of images, got {lines[0].strip()!r}") from None
    names = lines[1].split()
    absent = [name for name in attributes if name not in names]
    if absent:
        raise _bad_line(path, 2, f"the attribute header lacks {', '.join(absent)}")
    twice = [name for name in attributes if names.count(name) > 1]
    if twice:  # which column holds the labels would be a guess: the first one was taken silently
        raise _bad_line(path, 2, f"the attribute header names {', '.join(twice)} more than once")
    columns = [names.index(name) for name in attributes]
    files: list[str] = []
    rows: list[list[int]] = []
    for number, line in enumerate(lines[2:], start=3):
        fields = line.split()
        if not fields:
            continue  # a trailing blank line
        if len(fields) != len(names) + 1:
            raise _bad_line(path, number, f"expected a file name and {len(names)} values, got {len(fields)} fields")
        values = fields[1:]
        if any(value not in ("1", "-1") for value in values):
            bad = next(value for value in values if value not in ("1", "-1"))
            raise _bad_line(path, number, f"attribute values must be -1 or 1, got {bad!r}")
        files.append(fields[0])
        rows.append([1 if values[c] == "1" else 0 for c in columns])
    if len(files) != count:
        raise ValueError(f"{path}: line 1 announces {count} images but {len(files)} rows follow")
    if len(set(files)) != len(files):
        raise ValueError(f"{path}: some file names appear twice")
    return files, torch.tensor(rows, dtype=torch.int64).reshape(len(files), len(attributes))


def read_partitions(path: Path) -> dict[str, int]:
    """``filename -> split`` (0 train, 1 valid, 2 test) from ``list_eval_partition.txt``."""
    out: dict[str, int] = {}
    for number, line in enumerate(read_text(path, what="CelebA partition file").splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2 or fields[1] not in ("0", "1", "2"):
            raise _bad_line(path, number, f"expected 'filename split' with split 0, 1 or 2, got {line.strip()!r}")
        if fields[0] in out:  # the last line would win silently: an image could move from train into test
            raise _bad_line(path, number, f"{fields[0]} is listed a second time (first as split {out[fields[0]]})")
        out[fields[0]] = int(fields[1])
    return out


@dataclass
class CelebA:
    """CelebA splits as row indices (``*_images``) and {0, 1} labels ``[N, len(attributes)]``, one column per
    attribute in ``attributes``' order; images decoded per batch."""

    root: Path
    input_size: int
    files: list[str]
    train_images: Tensor
    train_labels: Tensor
    valid_images: Tensor
    valid_labels: Tensor
    test_images: Tensor
    test_labels: Tensor
    cache_path: Path | None = None
    attributes: tuple[str, ...] = ATTRIBUTES  # the tasks: the labels' columns, in order
    _cache: tuple[np.memmap, np.memmap] | None = field(default=None, repr=False)
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)

    @property
    def num_tasks(self) -> int:
        return self.train_labels.shape[1]

    def images(self, rows: Tensor) -> Tensor:
        """Row indices ``[B]`` -> float ``[B, 3, S, S]`` in [0, 1] (decoded now, or read from the cache)."""
        rows_list = [int(row) for row in rows.tolist()]
        self._open_cache()  # here, not inside the worker threads, so it is opened once
        if len(rows_list) < 16:
            pixels = [self._image(row) for row in rows_list]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                                thread_name_prefix="celeba-decode")
            pixels = list(self._pool.map(self._image, rows_list))
        return torch.stack(pixels).float().div_(255.0)

    def _image(self, row: int) -> Tensor:
        cache = self._open_cache()
        if cache is not None and cache[1][row]:
            return torch.from_numpy(np.array(cache[0][row]))
        pixels = decode(self.root / IMAGE_DIR / self.files[row], self.input_size)
        if cache is not None:
            cache[0][row] = pixels.numpy()
            cache[1][row] = 1  # after the pixels: a crash in between costs a re-decode, never a wrong image
        return pixels

    def _open_cache(self) -> tuple[np.memmap, np.memmap] | None:
        if self.cache_path is None:
            return None
        if self._cache is None:
            shape = (len(self.files), 3, self.input_size, self.input_size)
            make_directory(self.cache_path.parent, "cache directory")
            pixels, new_pixels = open_mapped_file(self.cache_path, math.prod(shape))  # sparse when new
            # flags of another pixel file must not vouch for new (zero) pixels: cleared with them
            flags, _ = open_mapped_file(self.cache_path.with_suffix(".filled"), len(self.files), clear=new_pixels)
            with pixels, flags:
                cache = (np.memmap(pixels, np.uint8, "r+", shape=shape),
                         np.memmap(flags, np.uint8, "r+", shape=(len(self.files),)))
            if not new_pixels:
                self._check_cache(*cache)
            self._cache = cache
        return self._cache

    def _check_cache(self, pixels: np.memmap, filled: np.memmap) -> None:
        """Decode ``CACHE_SPOT_CHECKS`` cached images again, chosen at random on each open, and compare.

        The cache's key notices a replaced JPEG, not an edited cache file: a mismatch (an edited or
        damaged cache) marks every image as not cached, so each is decoded again when it is used.
        An edit of a fraction f of the cached images escapes one open with probability about
        (1 - f) ** CACHE_SPOT_CHECKS.
        """
        rows = np.flatnonzero(filled)
        if rows.size == 0:
            return
        picked = np.random.default_rng(secrets.randbits(64)).choice(rows, min(CACHE_SPOT_CHECKS, rows.size),
                                                                     replace=False)
        for row in picked.tolist():
            if not np.array_equal(pixels[row], decode(self.root / IMAGE_DIR / self.files[row], self.input_size)):
                warnings.warn(f"the CelebA image cache {self.cache_path} does not hold the decoded {self.files[row]} "
                              "(edited or damaged): its images are decoded again", stacklevel=3)
                filled[:] = 0
                return

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": None, "_pool": None}  # reopened on use, never pickled

    def describe(self) -> str:
        return (f"CelebA {len(self.attributes)} attributes, {self.input_size}x{self.input_size}, "
                f"{len(self.train_images)} train / {len(self.test_images)} test images from {self.root}")


class ImageTooLarge(ValueError):
    """An image whose header announces more than :data:`MAX_IMAGE_PIXELS`: refused before it is decoded."""


def _oversize(path: Path, width: int, height: int) -> ImageTooLarge:
    return ImageTooLarge(f"CelebA image {path} is {width} x {height} = {width * height} pixels, more than the "
                      f"{MAX_IMAGE_PIXELS} drmoo decodes (the aligned faces are 178 x 218): replace it with the "
                      "data set's file")


def _jpeg_dimensions(handle: BinaryIO) -> tuple[int, int] | None:
    """(width, height) from a JPEG's frame header, reading only the segments before it; None if not a JPEG."""
    if handle.read(2) != b"\xff\xd8":
        return None
    while True:
        marker = handle.read(4)
        if len(marker) < 4 or marker[0] != 0xFF:
            return None
        if marker[1] in _JPEG_FRAMES:
            frame = handle.read(5)  # precision, height, width
            return (int.from_bytes(frame[3:5], "big"), int.from_bytes(frame[1:3], "big")) if len(frame) == 5 else None
        handle.seek(int.from_bytes(marker[2:4], "big") - 2, os.SEEK_CUR)


def check_image_sizes(paths: list[Path]) -> None:
    """Refuse (one line naming it) an image whose header announces more than :data:`MAX_IMAGE_PIXELS`.

    Run on every image a run uses before anything is written: a decompression bomb or an oversize
    face would otherwise fail (or cost its size in memory) mid-epoch, after the run directory exists.
    A JPEG's frame header is read directly (~50 us an image: ~10 s for all of CelebA's); any other
    format through PIL's header parser, its pixels never decoded.
    """
    from PIL import Image, UnidentifiedImageError

    for path in paths:
        with path.open("rb") as handle:
            dimensions = _jpeg_dimensions(handle)
        if dimensions is None:
            try:
                with Image.open(path) as opened:
                    dimensions = opened.size
            except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as error:
                raise ValueError(f"cannot decode CelebA image {path}: {error}") from None
        if dimensions[0] * dimensions[1] > MAX_IMAGE_PIXELS:
            raise _oversize(path, *dimensions)


def decode(path: Path, size: int) -> Tensor:
    """One image as uint8 ``[3, size, size]``: RGB, centre square crop, antialiased bilinear resize.

    An image of more than :data:`MAX_IMAGE_PIXELS` is refused from its header, before its pixels are
    allocated (a ValueError naming it, as for a file PIL cannot read or calls a decompression bomb).
    """
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise FileNotFoundError(f"CelebA image {path} is missing (listed in {ATTR_FILE})")
    try:
        with Image.open(path) as opened:
            if opened.size[0] * opened.size[1] > MAX_IMAGE_PIXELS:
                raise _oversize(path, *opened.size)
            image = opened.convert("RGB")
            width, height = image.size
            side = min(width, height)
            left, top = (width - side) // 2, (height - side) // 2
            # crop first: resize(box=...) would let the filter read pixels outside the box.  PIL's bilinear
            # filter widens its support when shrinking, so this is an antialiased resize.
            square = image.crop((left, top, left + side, top + side))
            square = square.resize((size, size), Image.Resampling.BILINEAR)
            array = np.asarray(square, dtype=np.uint8)
    except ImageTooLarge:
        raise
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as error:
        raise ValueError(f"cannot decode CelebA image {path}: {error}") from None
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def _split_rows(files: list[str], partitions: dict[str, int], partition_path: Path) -> dict[str, Tensor]:
    missing = [name for name in files if name not in partitions]
    if missing:
        raise ValueError(f"{partition_path} has no split for {len(missing)} image(s), e.g. {missing[0]}")
    split = torch.tensor([partitions[name] for name in files], dtype=torch.int64)
    return {name: torch.nonzero(split == code).flatten() for name, code in SPLITS.items()}


def _check_images_exist(root: Path, files: list[str]) -> None:
    # One directory listing up front, so a run never dies halfway through an epoch on a missing file.
    present = set(os.listdir(root / IMAGE_DIR))
    missing = [name for name in files if name not in present]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise FileNotFoundError(f"{len(missing)} CelebA image(s) listed in {ATTR_FILE} are missing from "
                                f"{root / IMAGE_DIR}: {shown}")


def load_celeba(
    data_root: str | Path | None, input_size: int = 128, train_size: int | None = None,
    test_size: int | None = None, cache_dir: str | Path | None = None, attributes: tuple[str, ...] = ATTRIBUTES,
) -> CelebA:
    """Read the annotations, pick the official splits (optionally their first rows), check the images exist.

    ``attributes``: the tasks, one label column each (the paper's 8 by default; ``ALL_ATTRIBUTES`` for all 40).
    """
    # an int: a float works but names the cache file "16.0px", and a bool would count as 0 or 1
    if isinstance(input_size, bool) or not isinstance(input_size, int) or input_size < 8:
        raise ValueError(f"input_size must be >= 8 and an int, got {input_size!r}")
    for name, size in (("train_size", train_size), ("test_size", test_size)):
        # a slice bound: -1 would drop the last image silently, True keep one, 0 blame the partition file
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"{name} must be None (the whole split) or an int >= 1, got {size!r}")
    root = find_celeba_root(data_root)
    files, labels = read_attributes(root / ATTR_FILE, tuple(attributes))
    rows = _split_rows(files, read_partitions(root / PARTITION_FILE), root / PARTITION_FILE)
    if train_size is not None:
        rows["train"] = rows["train"][:train_size]
    if test_size is not None:
        rows["test"] = rows["test"][:test_size]
    for name in ("train", "test"):
        if len(rows[name]) == 0:
            raise ValueError(f"{root / PARTITION_FILE} puts no image in the {name} split")
    # Only the splits a run reads are checked (no command reads the validation split).
    used = torch.cat([rows["train"], rows["test"]]).tolist()
    _check_images_exist(root, [files[i] for i in used])
    check_image_sizes([root / IMAGE_DIR / files[i] for i in used])
    cache_path = None
    if cache_dir is not None:
        # Keyed by the annotation file and every used image's name, size and modification time, so a
        # replaced JPEG gets a new cache instead of being served stale.
        key_hash = hashlib.sha1(f"{root.resolve()}|v2".encode())
        for path in [root / ATTR_FILE] + [root / IMAGE_DIR / files[i] for i in used]:
            info = path.stat()
            key_hash.update(f"|{path.name}|{info.st_size}|{info.st_mtime_ns}".encode())
        key = key_hash.hexdigest()[:16]
        cache_path = Path(cache_dir).expanduser() / "celeba" / f"{input_size}px-{key}.u8"
    return CelebA(root, input_size, files, rows["train"], labels[rows["train"]], rows["valid"],
                  labels[rows["valid"]], rows["test"], labels[rows["test"]], cache_path,
                  tuple(attributes))
