"""Issue 38, the demo: the cores it uses, what a SIGTERM does to it and to ``drmoo compare``, its torch build.

* ``OMP_NUM_THREADS=1`` (common on clusters) made ``nproc`` say 1 and the demo's eight runs go one at a
  time: the job count comes from the cores the process may use, whatever OMP_NUM_THREADS says.
* SIGTERM exited 130 (SIGINT's status) and advised ``drmoo train --resume`` where rerunning the very
  command resumes: now 143, and the advice is to rerun it; ``compare --jobs N`` tells its workers to save
  and stop instead of waiting for their runs to end.
* Without a GPU the demo first tries torch's CPU-only build at the pinned versions.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from drmoo.experiments import training

from .conftest import run_cli
from .test_cli_processes import _environment, _fake_program, _script_copy, _wait_for, end_fake_workers

REPO = Path(__file__).resolve().parents[2]


def _cores_without_omp() -> str:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("OMP_")}
    return subprocess.run(["nproc"], env=environment, capture_output=True, text=True, check=True).stdout.strip()


def _demo_with_fake_drmoo(tmp_path: Path, drmoo_body: str) -> tuple[Path, Path, dict[str, str]]:
    """scripts/demo.sh in a checkout-like folder, its set-up a no-op and its drmoo a fake."""
    script = _script_copy(tmp_path, "demo.sh")
    _fake_program(script.parent / "setup_env.sh", "exit 0\n")
    venv = tmp_path / "venv"
    _fake_program(venv / "bin" / "drmoo", drmoo_body)
    return script, venv, {**os.environ, "DRMOO_VENV": str(venv)}


def test_the_demo_runs_one_job_per_core_whatever_omp_num_threads_says(tmp_path: Path) -> None:
    calls = tmp_path / "drmoo-args.txt"
    script, _, environment = _demo_with_fake_drmoo(tmp_path, f"printf '%s\\n' \"$@\" > {str(calls)!r}\n")
    result = subprocess.run(["bash", str(script)], cwd=tmp_path, env={**environment, "OMP_NUM_THREADS": "1",
                            "OMP_THREAD_LIMIT": "1"}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    arguments = calls.read_text().splitlines()
    assert arguments[arguments.index("--jobs") + 1] == _cores_without_omp()


def test_sigterm_stops_the_demo_with_143_after_the_comparison_saved(tmp_path: Path) -> None:
    """The SIGTERM reaches the comparison at once (not after it ends), the script waits for it to save and
    exits 143 advising to run the same command again."""
    started, saved = tmp_path / "started", tmp_path / "saved"
    body = textwrap.dedent(f"""
        trap 'sleep 0.5; touch {str(saved)!r}; exit 143' TERM   # a run saving its checkpoint, then ending
        touch {str(started)!r}
        while :; do sleep 0.1; done
    """)
    script, _, environment = _demo_with_fake_drmoo(tmp_path, body)
    demo = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: started.exists() or demo.poll() is not None, "the fake comparison to start")
        demo.send_signal(signal.SIGTERM)
        _, stderr = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 143, stderr
    assert saved.exists(), "the script ended before the comparison had saved"
    assert "run the same command (bash scripts/demo.sh) again to resume" in stderr


def test_training_interrupted_keeps_its_signal_and_run_across_processes(tmp_path: Path) -> None:
    """A comparison worker's interruption reaches the parent pickled: the signal and the run must survive."""
    error = training.TrainingInterrupted(signal.SIGTERM, 7, tmp_path / "run")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.signum, copy.step, copy.run_dir) == (signal.SIGTERM, 7, tmp_path / "run")
    assert str(copy) == str(error) and f"drmoo train --resume {tmp_path / 'run'}" in str(copy)


@pytest.mark.parametrize(("sent", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_training_exits_with_its_own_status(sent: signal.Signals, status: int, tmp_path: Path,
                                                            tiny_args: Callable[..., list[str]],
                                                            capsys: pytest.CaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``train`` advises --resume; ``compare`` advises rerunning itself (it resumes its runs)."""
    original = training.IndexStream.__call__
    draws = [0]

    def draw_then_signal(self: training.IndexStream) -> object:
        draws[0] += 1
        if draws[0] == 2:  # the second step's batch: inside the training loop, which saves and stops
            os.kill(os.getpid(), sent)
        return original(self)

    monkeypatch.setattr(training.IndexStream, "__call__", draw_then_signal)
    code, err = run_cli(["train", "--method", "mgda", "--out", str(tmp_path / "run"), *tiny_args()], capsys)
    assert code == status, err
    assert f"stopped by signal {int(sent)}" in err and "drmoo train --resume" in err

    draws[0] = 0
    code, err = run_cli(["compare", "--methods", "mgda", "--eps", "0", "--out", str(tmp_path / "cmp"),
                         *tiny_args()], capsys)
    assert code == status, err
    assert "rerun the same command to resume" in err and "drmoo train --resume" not in err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


FAKE_STOPPABLE = '''
import os
import signal
import time
from pathlib import Path


def until_terminated(marker_dir):
    """A run that, on SIGTERM, saves (a marker) and stops, as the training loop does."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    Path(marker_dir, f"{os.getpid()}.pid").write_text("")
    while not stop:
        time.sleep(0.05)
    Path(marker_dir, f"{os.getpid()}.saved").write_text("")
    return "stopped"
'''


def test_sigterm_to_a_comparison_tells_its_workers_to_save_and_stop(tmp_path: Path) -> None:
    """Only the parent gets the SIGTERM (a plain ``kill PID``): its workers are told, save, and the parent
    exits promptly with 143 instead of waiting for their runs to end."""
    markers = tmp_path / "markers"
    markers.mkdir()
    (tmp_path / "fake_stoppable.py").write_text(FAKE_STOPPABLE)
    script = textwrap.dedent(f"""
        import sys
        import fake_stoppable
        from drmoo.cli import _catch_sigterm, _Terminated
        from drmoo.experiments.jobs import run_in_workers
        if __name__ == "__main__":
            _catch_sigterm()
            try:
                run_in_workers(fake_stoppable.until_terminated, [({str(markers)!r},), ({str(markers)!r},)], 2,
                               ["a", "b"], progress=False)
            except _Terminated:
                sys.exit(143)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], env=_environment(tmp_path), cwd=tmp_path)
    try:
        _wait_for(lambda: len(list(markers.glob("*.pid"))) == 2 or parent.poll() is not None, "both workers")
        assert parent.poll() is None, "the parent ended before its workers started"
        parent.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert parent.wait(timeout=60) == 143
        assert time.monotonic() - start < 60
        assert len(list(markers.glob("*.saved"))) == 2, "a worker was not told to save and stop"
    finally:
        end_fake_workers(parent, markers)


def _setup_env_copy(tmp_path: Path, gpu: bool) -> tuple[Path, Path, dict[str, str]]:
    """scripts/setup_env.sh with a fake venv (pip records its arguments and refuses the CPU index), a fake
    wheel build, and nvidia-smi listing a GPU or none."""
    script = _script_copy(tmp_path, "setup_env.sh")
    checkout = script.parents[1]
    (checkout / "requirements-dev.txt").write_text((REPO / "requirements-dev.txt").read_text())
    _fake_program(script.parent / "build_wheel.sh", 'mkdir -p dist && touch dist/drmoo-0-cp310-abi3-any.whl\n')
    calls = tmp_path / "pip-calls.txt"
    venv = tmp_path / "venv"
    _fake_program(venv / "bin" / "python", "echo 'reference, cpp'\n")
    _fake_program(venv / "bin" / "pip", f"""printf '%s ' "$@" >> {str(calls)!r}; echo >> {str(calls)!r}
case " $* " in *" --index-url "*) exit 1 ;; esac
exit 0
""")
    tools = tmp_path / "tools"
    _fake_program(tools / "nvidia-smi", "echo 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n" if gpu else "exit 9\n")
    environment = {**os.environ, "DRMOO_VENV": str(venv), "DRMOO_SETUP": "demo",
                   "DRMOO_CPU_TORCH_INDEX": "file:///nowhere/cpu", "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
    return script, calls, environment


@pytest.mark.parametrize("gpu", [False, True])
def test_the_demo_tries_torchs_cpu_build_where_no_gpu_is_visible(gpu: bool, tmp_path: Path) -> None:
    script, calls, environment = _setup_env_copy(tmp_path, gpu)
    result = subprocess.run(["bash", str(script)], cwd=tmp_path, env=environment, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    pip_calls = calls.read_text().splitlines()
    cpu_calls = [call for call in pip_calls if "--index-url file:///nowhere/cpu" in call]
    if gpu:
        assert not cpu_calls and "CPU-only" not in result.stdout
    else:
        # The pins of requirements-dev.txt, as CPU builds; refused here, so the PyPI build follows.
        pins = dict(line.split("==") for line in (REPO / "requirements-dev.txt").read_text().splitlines()
                    if line.startswith(("torch==", "torchvision==")))
        wanted = f"torch=={pins['torch']}+cpu torchvision=={pins['torchvision']}+cpu"
        assert len(cpu_calls) == 1 and wanted in cpu_calls[0], pip_calls
        assert "is not available from file:///nowhere/cpu here: installing PyPI's build" in result.stdout
        assert pip_calls.index(cpu_calls[0]) < next(i for i, call in enumerate(pip_calls) if " -c " in f" {call}")
