"""Issue 29, processes and scripts (CR-13, CR-14, CR-15, CR-17, U-12) and issue 28's progress under --jobs.

Each test says which defect it guards.  The worker tests run a real ``run_in_workers`` in a real
subprocess, with a short fake job (a module written to ``tmp_path``), and kill it with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .conftest import assert_one_line_refusal, process_alive, run_cli

REPO = Path(__file__).resolve().parents[2]
PYTHON_SOURCE = REPO / "python"

FAKE_JOBS = '''
import os
import time
from pathlib import Path

from drmoo.experiments.jobs import progress_bar


def forever(marker_dir):
    """Write this worker's pid, then wait for ever (as a long training run would)."""
    Path(marker_dir, f"{os.getpid()}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.2)


def counted(steps, pause):
    """A run of ``steps`` steps, each reported through the training loop's progress bar."""
    with progress_bar(total=steps, initial=0, desc=f"fake run of {steps}", disable=False) as bar:
        for _ in range(steps):
            time.sleep(pause)
            bar.update(1)
    return steps
'''


def _environment(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "fake_jobs.py").write_text(FAKE_JOBS)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(PYTHON_SOURCE), str(tmp_path)]),
            "OMP_NUM_THREADS": "1"}


def _wait_for(condition, what: str, limit_s: float = 120.0) -> None:
    """Poll ``condition`` until true; fail naming ``what`` after ``limit_s`` (a bound, not a timing)."""
    end = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting: {what}")
        time.sleep(0.1)


def test_workers_die_when_the_comparison_is_killed(tmp_path: Path) -> None:
    """CR-13: kill -9 of ``compare --jobs N`` left its workers (~0.8 GB each) running for ever.

    A parent running two workers through :func:`run_in_workers` is SIGKILLed; both workers must end.
    """
    markers = tmp_path / "pids"
    markers.mkdir()
    script = textwrap.dedent(f"""
        import fake_jobs
        from drmoo.experiments.jobs import run_in_workers
        if __name__ == "__main__":
            run_in_workers(fake_jobs.forever, [({str(markers)!r},), ({str(markers)!r},)], 2, ["a", "b"],
                           progress=False)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], env=_environment(tmp_path), cwd=tmp_path)
    try:
        _wait_for(lambda: len(list(markers.glob("*.pid"))) == 2 or parent.poll() is not None,
                  "both workers to start")
        assert parent.poll() is None, "the parent ended before its workers started"
        workers = [int(path.stem) for path in markers.glob("*.pid")]
        assert all(process_alive(pid) for pid in workers)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        _wait_for(lambda: not any(process_alive(pid) for pid in workers), f"workers {workers} to die with their parent")
    finally:
        end_fake_workers(parent, markers)


def end_fake_workers(parent: subprocess.Popen[bytes], markers: Path) -> None:
    """A test's clean-up: its parent process and the fake workers whose pids it recorded in ``markers``."""
    if parent.poll() is None:
        parent.kill()
    for path in markers.glob("*.pid"):
        try:
            os.kill(int(path.stem), signal.SIGKILL)  # only our own fake workers, by their recorded pid
        except ProcessLookupError:
            pass


def test_progress_from_inside_each_job_is_shown_when_not_a_terminal(tmp_path: Path) -> None:
    """Issue 28 item 6: ``compare --jobs`` showed 0/8 for minutes with no progress from inside the runs.

    With stderr not a terminal (CI), the parent prints periodic lines with each running job's step
    count as its worker reports it, and a line per finished job.
    """
    script = textwrap.dedent("""
        import fake_jobs
        from drmoo.experiments import jobs
        if __name__ == "__main__":
            jobs.LOG_INTERVAL_S = 0.0  # a line at every poll: the test reads them, not their timing
            print(jobs.run_in_workers(fake_jobs.counted, [(8, 0.3), (6, 0.3)], 2, ["first", "second"]))
    """)
    result = subprocess.run([sys.executable, "-c", script], env=_environment(tmp_path), cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[8, 6]"
    lines = result.stderr.splitlines()
    assert any("running:" in line and "fake run of 8" in line and "/8" in line for line in lines), result.stderr
    assert any("running:" in line and "fake run of 6" in line and "/6" in line for line in lines), result.stderr
    assert any("first finished" in line for line in lines) and any("second finished" in line for line in lines)
    assert "\r" not in result.stderr  # no redrawn bars in a log


def test_progress_bars_one_per_running_job_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 28 item 6: on a terminal the parent draws one bar per running job, under the comparison's bar."""
    from drmoo.experiments import jobs

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    display = jobs._JobProgress(3, 2, ["a", "b", "c"], enabled=True)
    try:
        display.report(0, 2, 10, "a seed 0")
        display.report(1, 5, 20, "b seed 0")
        assert {job: (bar.n, bar.total) for job, bar in display.bars.items()} == {0: (2, 10), 1: (5, 20)}
        assert sorted(display.positions.values()) == [1, 2]
        display.report(0, 7, 10, "a seed 0")
        assert display.bars[0].n == 7
        display.finished(0)
        display.report(0, 10, 10, "a seed 0")  # a late report of a finished job draws no bar again
        display.report(2, 1, 4, "c seed 0")
        assert set(display.bars) == {1, 2} and display.positions[2] == 1  # the freed line is reused
        assert display.overall.n == 1
    finally:
        display.close()


def test_training_loop_reports_through_progress_bar_in_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 28 item 6: the training loop's bar is drmoo.experiments.jobs.progress_bar, which reports to the
    parent inside a worker (and is tqdm elsewhere)."""
    import queue

    from drmoo.experiments import jobs, training

    assert training.progress_bar is jobs.progress_bar
    sent: queue.Queue = queue.Queue()
    monkeypatch.setattr(jobs, "_progress_queue", sent)
    monkeypatch.setattr(jobs, "_current_job", 3)
    with jobs.progress_bar(total=2, initial=0, desc="mgda seed 0", disable=False) as bar:
        bar.update(1)
        bar.set_postfix(loss="1.0")
        bar.update(1)
    reports = []
    while not sent.empty():
        reports.append(sent.get())
    assert reports[0] == (3, 0, 2, "mgda seed 0") and reports[-1] == (3, 2, 2, "mgda seed 0")


def _unusable_on_cpu_tensors() -> list[str]:
    """Backends refused for CPU tensors on this machine: cuda always (no GPU, or CPU tensors), triton without a
    GPU (with one, it would run under TRITON_INTERPRET only), and a name that is no backend."""
    from drmoo_kernels import why_unavailable

    return ["cuda", *(["triton"] if why_unavailable("triton") is not None else []), "bogus"]


@pytest.mark.parametrize("backend", _unusable_on_cpu_tensors())
def test_drmoo_backend_variable_is_checked_like_the_option(
        backend: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """CR-14: DRMOO_BACKEND=cuda|triton without a GPU gave a 10-frame traceback (only --backend was checked)."""
    monkeypatch.setenv("DRMOO_BACKEND", backend)
    out = tmp_path / "run"
    for argv in (["train", "--max-steps", "1", "--device", "cpu", "--out", str(out), "--quiet"],
                 ["synthetic", "--steps", "2", "--out", str(out), "--quiet"],
                 ["ablate", "--what", "lambda", "--experiment", "linear", "--steps", "2", "--out", str(out), "--quiet"],
                 ["compare", "--methods", "mgda", "--max-steps", "1", "--device", "cpu", "--out", str(out),
                  "--quiet"]):
        assert_one_line_refusal(*run_cli(argv, capsys), f"DRMOO_BACKEND={backend}")
        assert not out.exists()


def test_drmoo_backend_variable_and_option_share_one_validator() -> None:
    """CR-14: one validator for --backend and DRMOO_BACKEND, naming whichever chose the backend."""
    import torch

    from drmoo.experiments.devices import check_backend
    from drmoo.store import UsageError

    os.environ.pop("DRMOO_BACKEND", None)
    with pytest.raises(UsageError, match=r"^--backend cuda: "):
        check_backend("cuda", torch.device("cpu"))
    os.environ["DRMOO_BACKEND"] = "cuda"
    try:
        with pytest.raises(UsageError, match=r"^DRMOO_BACKEND=cuda: "):
            check_backend(None, torch.device("cpu"))
        check_backend("reference", torch.device("cpu"))  # an explicit --backend wins over the variable
    finally:
        del os.environ["DRMOO_BACKEND"]


def test_missing_data_root_is_refused_before_torchrun_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """CR-15: ``train --nproc 2 --data-root MISSING`` printed torchrun's ChildFailedError traceback."""
    import drmoo.cli as cli

    launched = []
    monkeypatch.setattr(cli, "_launch_torchrun", lambda nproc, argv: launched.append(argv) or 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    missing = tmp_path / "MISSING"
    assert_one_line_refusal(*run_cli(["train", "--nproc", "2", "--data-root", str(missing), "--out",
                                      str(tmp_path / "run"), "--quiet"], capsys), str(missing), "does not exist")
    assert_one_line_refusal(*run_cli(["train", "--nproc", "2", "--experiment", "celeba", "--data-root",
                                      str(missing), "--out", str(tmp_path / "run"), "--quiet"], capsys),
                            "CelebA root")
    assert launched == []
    assert not (tmp_path / "run").exists()


def test_missing_data_root_is_refused_before_compare_writes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """CR-15 / U-9: compare checks its data root before it creates --out."""
    out = tmp_path / "cmp"
    assert_one_line_refusal(*run_cli(["compare", "--methods", "mgda", "--data-root", str(tmp_path / "MISSING"),
                                      "--out", str(out), "--quiet"], capsys), "does not exist")
    assert not out.exists()


# --------------------------------------------------------------------------------------------- scripts


def _fake_program(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)
    return path


def _script_copy(tmp_path: Path, name: str) -> Path:
    """A checkout-like folder holding only scripts/NAME (the scripts cd to their checkout)."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True, exist_ok=True)
    target = checkout / "scripts" / name
    target.write_text((REPO / "scripts" / name).read_text())
    return target


def test_gpu_check_keeps_paths_with_spaces_whole(tmp_path: Path) -> None:
    """CR-17: scripts/gpu_check.sh broke when PYTHON or TMPDIR contained a space (unquoted ``bash -c``).

    A fake python in a folder with a space records its arguments; every drmoo command must reach it
    with the round trip's temporary folder (under a TMPDIR with a space) as one argument.
    """
    script = _script_copy(tmp_path, "gpu_check.sh")
    calls = tmp_path / "calls.txt"
    python = _fake_program(tmp_path / "my tools" / "python", f"""
printf '%s\\x1f' "$@" >> {str(calls)!r}; printf '\\n' >> {str(calls)!r}
[ "${{1:-}}" = "-" ] && cat > /dev/null
previous=""
for argument in "$@"; do  # drmoo eval --run DIR writes DIR/eval.json, train DIR/steps.csv: the script prints both
    [ "$previous" = "--run" ] && mkdir -p "$argument" && echo '{{}}' > "$argument/eval.json"
    case "$previous" in --out|--resume) mkdir -p "$argument" && echo 'step' > "$argument/steps.csv" ;; esac
    previous=$argument
done
exit 0
""")
    temporary = tmp_path / "tmp dir"
    temporary.mkdir()
    environment = {**os.environ, "PYTHON": str(python), "TMPDIR": str(temporary), "GPU_CHECK_BUDGET_S": "600"}
    environment.pop("OUT", None)
    result = subprocess.run(["bash", str(script)], cwd=tmp_path, env=environment, capture_output=True, text=True,
                            timeout=300)
    recorded = [line.rstrip("\x1f").split("\x1f") for line in calls.read_text().splitlines()]
    drmoo_calls = [argv for argv in recorded if argv[:2] == ["-m", "drmoo"]]
    assert result.returncode == 0, result.stdout + result.stderr
    # bench-iter twice, then the round trip (train, resume, eval)
    assert [argv[2] for argv in drmoo_calls] == ["bench-iter", "bench-iter", "train", "train", "eval"]
    run_dirs = [argv[argv.index(flag) + 1] for argv in drmoo_calls for flag in ("--out", "--resume", "--run")
                if flag in argv and argv[2] != "bench-iter"]
    assert len(run_dirs) == 3 and len(set(run_dirs)) == 1
    assert run_dirs[0].startswith(str(temporary) + os.sep) and run_dirs[0].endswith(os.sep + "run")
    # the eager-against-graphed train timing: its run folder, under the TMPDIR with a space, is one argument
    (timing,) = [argv for argv in recorded if argv[0] == "scripts/gpu_step_timing.py"]
    assert timing[timing.index("--out") + 1].startswith(str(temporary) + os.sep)


def test_test_oldest_says_that_the_wheel_is_missing(tmp_path: Path) -> None:
    """U-12: without a wheel in dist/, scripts/test_oldest.sh exited 2 with no message (``ls | head`` under
    pipefail) instead of reaching its own message."""
    script = _script_copy(tmp_path, "test_oldest.sh")
    venv = tmp_path / "venv"
    _fake_program(venv / "bin" / "python", "echo 'torch 2.11.0, triton 3.5.0'\n")
    _fake_program(venv / "bin" / "pip", "exit 0\n")
    environment = {**os.environ, "DRMOO_OLDEST_VENV": str(venv)}
    environment.pop("DRMOO_WHEEL", None)
    result = subprocess.run(["bash", str(script)], cwd=tmp_path, env=environment, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no drmoo wheel in dist/" in result.stderr


def test_demo_never_passes_an_empty_jobs(tmp_path: Path) -> None:
    """U-12: scripts/demo.sh passed ``--jobs ''`` when nproc is missing; it falls back to getconf, then to 1."""
    script = _script_copy(tmp_path, "demo.sh")
    _fake_program(script.parent / "setup_env.sh", "exit 0\n")
    calls = tmp_path / "drmoo-args.txt"
    venv = tmp_path / "venv"
    _fake_program(venv / "bin" / "drmoo", f"printf '%s\\n' \"$@\" > {str(calls)!r}\n")
    tools = tmp_path / "bin"  # a PATH with bash and dirname, without nproc or getconf
    tools.mkdir()
    for tool in ("bash", "dirname"):
        found = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        (tools / tool).symlink_to(found)
    environment = {**os.environ, "PATH": str(tools), "DRMOO_VENV": str(venv)}
    result = subprocess.run([str(tools / "bash"), str(script)], cwd=tmp_path, env=environment, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    arguments = calls.read_text().splitlines()
    assert arguments[arguments.index("--jobs") + 1] == "1"
