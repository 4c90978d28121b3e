"""Shared helpers of the bad-input suite: one tiny trained run (copied per test) and a CLI runner."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from drmoo import store
from drmoo.cli import main

# A tiny Multi-MNIST run: 16 px, 32 training / 8 test composites, batch 16 (2 steps per epoch).
TINY_RUN = ["--input-size", "16", "--train-size", "32", "--test-size", "8", "--batch-size", "16", "--quiet"]


def resign_checkpoint(run: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a run's checkpoint state and write it back with a matching header and hash (what anyone can)."""
    path = run / "checkpoint.pt"
    checkpoint = store.read_checkpoint_file(path)
    edit(checkpoint.state)
    store.write_checkpoint_file(path, checkpoint.state, {
        k: v for k, v in checkpoint.header.items() if k not in ("format", "payload_bytes", "payload_sha256")})


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """``drmoo ARGV`` in process: (exit status, stderr); argparse's SystemExit counts as a status."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = int(exit_.code) if exit_.code is not None else 0
    return code, capsys.readouterr().err


def assert_one_line_refusal(code: int, err: str, *fragments: str) -> None:
    """Exit status 2, exactly one line on stderr (no traceback), naming the problem."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="session")
def reliability_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("reliability-cache"))


@pytest.fixture(scope="session")
def trained_template(tmp_path_factory: pytest.TempPathFactory, reliability_cache: str) -> Path:
    """One finished 1-step double-clip run, trained once per session; tests work on copies."""
    run = tmp_path_factory.mktemp("template") / "run"
    assert main(["train", "--max-steps", "1", "--out", str(run), "--cache-dir", reliability_cache, *TINY_RUN]) == 0
    return run


@pytest.fixture
def trained_run(trained_template: Path, tmp_path: Path) -> Path:
    """A private copy of the trained template run."""
    copy = tmp_path / "run"
    shutil.copytree(trained_template, copy)
    return copy


@pytest.fixture
def tiny_args(reliability_cache: str) -> Callable[..., list[str]]:
    def build(*extra: str) -> list[str]:
        return [*TINY_RUN, "--cache-dir", reliability_cache, *extra]

    return build


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper counts as dead): /proc, else ps."""
    if Path("/proc/self/stat").exists():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return False
    else:
        state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
        if not state:
            return False
    return not state.startswith(("Z", "X"))
