"""SIGTERM to the launcher of ``drmoo train --nproc 2`` stops the whole run as it stops a single-process run.

The launcher (the ``drmoo train`` a user or a process manager started) runs torchrun as its child, and
torchrun runs the workers.  A SIGTERM to the launcher's pid alone (``kill PID``, ``Popen.terminate()``)
ended the launcher at once with 143 and no message, while torchrun and both workers went on training,
holding the run's lock: ``--resume`` was refused as "in use by another drmoo process".  Now the launcher
passes the signal on to torchrun, waits until its workers have saved their checkpoint and exited, and
exits with 143, so the run is resumable at once.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from drmoo import store
from drmoo.experiments import read_checkpoint

from .conftest import process_alive, run_cli

pytestmark = [
    pytest.mark.skipif(os.name != "posix", reason="POSIX signals"),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed "
                       "with gloo (torchrun on CPU)"),
]

# 64 training composites, global batch 16: 4 steps an epoch, each epoch's end saved; far more epochs than
# the test lets it run.
TINY_LONG_RUN = ["--method", "double-clip", "--input-size", "16", "--train-size", "64", "--test-size", "16",
                 "--batch-size", "16", "--epochs", "1000", "--quiet"]


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s children (/proc, else ps)."""
    tasks = Path(f"/proc/{pid}/task")
    if tasks.is_dir():
        found: list[int] = []
        for task in tasks.iterdir():
            try:
                found += [int(child) for child in (task / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                pass
        return found
    listing = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    return [int(child) for child, parent in (line.split() for line in listing.splitlines()) if int(parent) == pid]


def _wait_for(condition, what: str, limit_s: float) -> None:
    """Poll ``condition`` until true; fail naming ``what`` after ``limit_s`` (a bound, not a timing)."""
    end = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting: {what}")
        time.sleep(0.1)


def _signal_a_running_launcher(tmp_path: Path, signum: int) -> tuple[Path, int, list[int], str]:
    """Start a 2-process run, wait for its first saved epoch, send ``signum`` to the launcher's pid only and
    wait for the launcher and every process under it to end: (run directory, the launcher's status,
    torchrun's and the workers' pids, stderr).  Nothing is left running, whatever fails."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "drmoo", "train", "--nproc", "2", *TINY_LONG_RUN, "--cache-dir", str(cache),
               "--out", str(run)]
    with open(tmp_path / "stderr", "w+") as stderr:
        launcher = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=stderr)
        processes: list[int] = []
        try:
            # Progress: the first epoch is saved (and torchrun's two workers are training the next ones).
            _wait_for(lambda: (run / "checkpoint.pt").is_file() or launcher.poll() is not None,
                      "the first epoch's checkpoint", limit_s=120)
            assert launcher.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            torchrun = _children(launcher.pid)
            processes = torchrun + [worker for pid in torchrun for worker in _children(pid)]
            assert len(processes) == 3, processes  # torchrun and two workers
            launcher.send_signal(signum)  # the launcher's pid only
            status = launcher.wait(timeout=60)
            _wait_for(lambda: not any(process_alive(pid) for pid in processes), "torchrun and its workers to end",
                      limit_s=60)
        finally:
            if launcher.poll() is None:  # a failed test leaves nothing running
                launcher.kill()
                launcher.wait()
            for pid in processes:
                if process_alive(pid):
                    os.kill(pid, signal.SIGKILL)
        stderr.seek(0)
        return run, status, processes, stderr.read()


def _assert_saved_and_resumable(run: Path, err: str, capsys: pytest.CaptureFixture) -> None:
    """Each worker saved at the same step and said so; the lock is free; the run goes on from that step."""
    saved_steps = {int(step) for step in re.findall(r"stopped by signal 15 after step (\d+)", err)}
    assert len(saved_steps) == 1, err[-3000:]
    step = saved_steps.pop()
    assert read_checkpoint(run)["step"] == step > 0
    assert not (run / "train.lock").exists()  # each worker left, removing it
    with store.run_lock(run):  # and nothing holds it
        pass
    code, resume_err = run_cli(["train", "--resume", str(run), "--max-steps", str(step + 2), "--quiet"], capsys)
    assert code == 0, resume_err
    assert read_checkpoint(run)["step"] == step + 2
    rows = (run / "steps.csv").read_text().strip().splitlines()[1:]
    assert len(rows) == step + 2


def test_sigterm_to_the_launcher_stops_torchrun_and_its_workers(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    run, status, _, err = _signal_a_running_launcher(tmp_path, signal.SIGTERM)
    assert status == 143, err[-3000:]
    launcher_lines = [line for line in err.splitlines() if line.startswith("drmoo train: stopped by SIGTERM")]
    assert len(launcher_lines) == 1, err[-3000:]
    _assert_saved_and_resumable(run, err, capsys)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_launcher_still_stops_torchrun_and_its_workers(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    """SIGKILL cannot be handled: torchrun, in a session of its own, learns of the launcher's death from the
    kernel (a SIGTERM) and stops its workers as if the launcher had passed a SIGTERM on."""
    run, status, _, err = _signal_a_running_launcher(tmp_path, signal.SIGKILL)
    assert status == -signal.SIGKILL
    _assert_saved_and_resumable(run, err, capsys)
