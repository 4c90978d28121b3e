"""``environment.json`` is read bounded: ``drmoo report`` and ``--resume`` no longer parse a file of any
size (254 MB took 3 GB) nor compare its sessions pairwise (20,000 sessions took 350 s).  The trainer
never writes more than MAX_SESSIONS sessions; a file larger than MAX_ENVIRONMENT_BYTES is refused before
it is parsed, one listing more sessions after.  A link, FIFO or directory at its name is said to be one,
not taken for a run "trained by an older drmoo"."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from drmoo import store
from drmoo.experiments import environment
from drmoo.experiments.environment import (
    ENVIRONMENT,
    MAX_ENVIRONMENT_BYTES,
    MAX_SESSIONS,
    distinct_environments,
    read_environment,
    read_sessions,
)

from .conftest import run_cli


def _session(index: int) -> dict[str, Any]:
    """A session as the trainer writes one, on a machine of its own (``cpu_model`` differs)."""
    return {"from_step": index, "drmoo": "0.2.0", "torch": "2.14.1", "kernel_backend": "cpp", "device": "cpu",
            "torch_threads": 2, "world_size": 1, "cpu_model": f"CPU {index}", "cpu_isa": "AVX2"}


def _record(path: Path, sessions: int) -> None:
    path.write_text(json.dumps({"sessions": [_session(index) for index in range(sessions)]}))


@pytest.fixture
def bytes_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the store's reads from now on."""
    counts: list[int] = []
    read = os.read

    def counting(descriptor: int, size: int) -> bytes:
        data = read(descriptor, size)
        counts.append(len(data))
        return data

    monkeypatch.setattr(store.os, "read", counting)
    return counts


def test_twenty_thousand_sessions_are_refused_before_they_are_parsed(tmp_path: Path, bytes_read: list[int]) -> None:
    path = tmp_path / ENVIRONMENT
    _record(path, 20_000)
    assert path.stat().st_size > MAX_ENVIRONMENT_BYTES
    with pytest.raises(store.UsageError, match=f"more than the {MAX_ENVIRONMENT_BYTES} it may"):
        read_sessions(path)
    assert sum(bytes_read) <= MAX_ENVIRONMENT_BYTES  # refused by its size: nothing parsed
    assert read_environment(tmp_path) == []  # a resume starts a new history, as for any unreadable record
    assert sum(bytes_read) <= 2 * MAX_ENVIRONMENT_BYTES


def test_more_sessions_than_the_trainer_keeps_are_refused(tmp_path: Path) -> None:
    path = tmp_path / ENVIRONMENT
    path.write_text(json.dumps({"sessions": [{"from_step": 0, "torch": "2"}] * (MAX_SESSIONS + 1)}))
    assert path.stat().st_size < MAX_ENVIRONMENT_BYTES  # small, but not a record drmoo writes
    with pytest.raises(store.UsageError, match=f"lists {MAX_SESSIONS + 1} training sessions, more than the "
                                               f"{MAX_SESSIONS} drmoo keeps"):
        read_sessions(path)
    _record(path, MAX_SESSIONS)  # the most the trainer writes, each on its own machine, is read
    assert path.stat().st_size < MAX_ENVIRONMENT_BYTES and len(read_sessions(path)) == MAX_SESSIONS


def test_distinct_environments_take_one_key_per_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dict keyed by the fields that decide the floats: linear, where the pairwise scan was quadratic."""
    calls: list[int] = []
    key = environment._arithmetic_key

    def counted(session: dict[str, Any]) -> tuple[Any, ...]:
        calls.append(1)
        return key(session)

    monkeypatch.setattr(environment, "_arithmetic_key", counted)
    sessions = [_session(index) for index in range(MAX_SESSIONS)] + [_session(0), _session(1)]
    distinct = distinct_environments(sessions)
    assert len(calls) == len(sessions)
    assert distinct == [_session(index) for index in range(MAX_SESSIONS)]  # the first of each, in order


def _report(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> str:
    out = tmp_path / "report.md"
    code, err = run_cli(["report", "--runs", str(run), "--out", str(out)], capsys)
    assert code == 0, err
    return out.read_text()


def test_the_report_names_an_oversized_record_and_reads_a_full_one(trained_run: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    _record(trained_run / ENVIRONMENT, 20_000)
    assert f"more than the {MAX_ENVIRONMENT_BYTES} it may" in _report(trained_run, tmp_path, capsys)
    _record(trained_run / ENVIRONMENT, MAX_SESSIONS)
    assert f"{MAX_SESSIONS} sessions in {MAX_SESSIONS} environments" in _report(trained_run, tmp_path, capsys)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_the_report_says_a_record_that_is_no_regular_file_is_not_one(
        kind: str, trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = trained_run / ENVIRONMENT
    real = tmp_path / "elsewhere.json"
    real.write_bytes(path.read_bytes())
    path.unlink()
    {"symlink": lambda: path.symlink_to(real), "fifo": lambda: os.mkfifo(path), "directory": path.mkdir}[kind]()
    report = _report(trained_run, tmp_path, capsys)
    assert f"{ENVIRONMENT} is not a regular file" in report
    assert "older drmoo" not in report
    path.unlink() if kind != "directory" else path.rmdir()
    assert "trained by an older drmoo" in _report(trained_run, tmp_path, capsys)  # absent: an older run
