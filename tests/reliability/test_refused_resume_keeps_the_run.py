"""A resume refused because a file it must write cannot be written changes nothing in the run.

It had already removed ``eval.json`` and ``done`` and rewritten ``config.json`` with the refused
command's settings when ``environment.json`` (a read-only file, a directory in its place, a full disk)
or a later file (a read-only checkpoint) refused the write.  Every file the session writes or removes
is now checked first, and config.json and environment.json are written together or not at all.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from drmoo import store
from drmoo.store import TEMP_SUFFIX

from .conftest import assert_one_line_refusal, run_cli

KEPT = ("eval.json", "done", "config.json", "environment.json", "checkpoint.pt", "metrics.csv", "steps.csv")


def _finished_with_eval(run: Path) -> dict[str, bytes]:
    """The run's files as bytes, after giving it an ``eval.json`` (its content is not read by a resume)."""
    (run / "eval.json").write_text('{"results": []}\n')
    assert (run / "done").is_file()
    return {name: (run / name).read_bytes() for name in KEPT if (run / name).is_file()}


def _resume_refused(run: Path, tiny_args: Callable[..., list[str]], capsys: pytest.CaptureFixture,
                    *named: str) -> None:
    code, err = run_cli(["train", "--resume", str(run), *tiny_args("--max-steps", "3", "--epochs", "5")], capsys)
    assert_one_line_refusal(code, err, *named)


def _assert_unchanged(run: Path, before: dict[str, bytes]) -> None:
    for name, data in before.items():
        assert (run / name).read_bytes() == data, f"{name} changed"
    assert not [name for name in os.listdir(run) if name.endswith(TEMP_SUFFIX)]  # no temporary left behind


def test_a_directory_in_place_of_environment_json(trained_run: Path, tiny_args: Callable[..., list[str]],
                                                  capsys: pytest.CaptureFixture) -> None:
    (trained_run / "environment.json").unlink()
    (trained_run / "environment.json").mkdir()
    before = _finished_with_eval(trained_run)
    _resume_refused(trained_run, tiny_args, capsys, str(trained_run / "environment.json"), "it is a directory")
    _assert_unchanged(trained_run, before)
    assert (trained_run / "environment.json").is_dir()


def test_a_read_only_environment_json(trained_run: Path, tiny_args: Callable[..., list[str]],
                                      capsys: pytest.CaptureFixture) -> None:
    (trained_run / "environment.json").chmod(0o444)  # drmoo reads the mode bits: refused as root too
    before = _finished_with_eval(trained_run)
    _resume_refused(trained_run, tiny_args, capsys, str(trained_run / "environment.json"), "read-only")
    _assert_unchanged(trained_run, before)


def test_a_full_disk_while_writing_environment_json(trained_run: Path, tiny_args: Callable[..., list[str]],
                                                    capsys: pytest.CaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    create = store._create_temporary

    def full_disk(directory: int, name: str, path: Path) -> tuple[int, str]:
        if name == "environment.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return create(directory, name, path)

    monkeypatch.setattr(store, "_create_temporary", full_disk)
    before = _finished_with_eval(trained_run)
    _resume_refused(trained_run, tiny_args, capsys, str(trained_run / "environment.json"), "no space left on device")
    _assert_unchanged(trained_run, before)


def test_a_read_only_checkpoint_is_refused_before_anything_is_written(
        trained_run: Path, tiny_args: Callable[..., list[str]], capsys: pytest.CaptureFixture) -> None:
    """The checkpoint is written after training: the resume must not train, then fail, having removed the markers."""
    (trained_run / "checkpoint.pt").chmod(0o444)
    before = _finished_with_eval(trained_run)
    _resume_refused(trained_run, tiny_args, capsys, str(trained_run / "checkpoint.pt"), "read-only")
    _assert_unchanged(trained_run, before)


def test_write_files_writes_none_when_one_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("old a")
    (tmp_path / "b.json").mkdir()
    with pytest.raises(store.UsageError, match=r"b\.json: it is a directory"):
        store.write_files({tmp_path / "a.json": b"new a", tmp_path / "b.json": b"new b"})
    assert (tmp_path / "a.json").read_text() == "old a"
    assert sorted(os.listdir(tmp_path)) == ["a.json", "b.json"]
    store.write_files({tmp_path / "a.json": b"new a", tmp_path / "c.json": b"c"})
    assert (tmp_path / "a.json").read_text() == "new a" and (tmp_path / "c.json").read_text() == "c"
