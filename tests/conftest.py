"""Shared fixtures: a small multi-task regression model with shared and task-specific parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor


def _import_triton_for_this_machine() -> None:
    """Without a GPU, triton must be imported in interpreter mode (TRITON_INTERPRET=1) before anything
    else imports it: triton fixes its mode at first import, and the Triton backend's tests run on the
    CPU through the interpreter.  The variable itself is put back; only the import's mode remains."""
    if torch.cuda.is_available():
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


_import_triton_for_this_machine()


class ToyProblem:
    """tanh(x A + c) -> one linear head per task (columns of H); squared error per sample and task.

    ``A`` and ``c`` are the shared parameters, ``H`` the task-specific ones (head i = column i).
    ``closure(seed)`` yields a fresh batch on every call from its own seeded generator, so two
    copies of the problem driven with the same seed see the same batch sequence.
    """

    def __init__(self, num_tasks: int = 3, dtype: torch.dtype = torch.float64, seed: int = 0,
                 batch_size: int = 32, rows: int = 256, hidden: int = 4, features: int = 5) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.num_tasks, self.batch_size = num_tasks, batch_size
        self.inputs = torch.randn(rows, features, generator=gen, dtype=dtype)
        self.targets = torch.randn(rows, num_tasks, generator=gen, dtype=dtype) + torch.arange(num_tasks, dtype=dtype)
        self.A = (0.5 * torch.randn(features, hidden, generator=gen, dtype=dtype)).requires_grad_()
        self.c = (0.1 * torch.randn(hidden, generator=gen, dtype=dtype)).requires_grad_()
        self.H = (0.5 * torch.randn(hidden, num_tasks, generator=gen, dtype=dtype)).requires_grad_()

    @property
    def shared(self) -> list[Tensor]:
        return [self.A, self.c]

    def losses(self, rows: Tensor) -> Tensor:
        hidden = torch.tanh(self.inputs[rows] @ self.A + self.c)
        return (hidden @ self.H - self.targets[rows]) ** 2

    def batches(self, seed: int) -> Callable[[], Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return lambda: torch.randint(0, self.inputs.shape[0], (self.batch_size,), generator=gen)

    def closure(self, seed: int) -> Callable[[], Tensor]:
        draw = self.batches(seed)
        return lambda: self.losses(draw())

    def snapshot(self) -> list[Tensor]:
        return [p.detach().clone() for p in (self.A, self.c, self.H)]


@pytest.fixture
def toy() -> Callable[..., ToyProblem]:
    return ToyProblem


def shared_data_dir() -> Path | None:
    """The project's shared test data (../shared/data beside the checkout, or $DRMOO_SHARED_DATA)."""
    candidates = [os.environ.get("DRMOO_SHARED_DATA"), Path(__file__).resolve().parents[2] / "shared" / "data"]
    for candidate in candidates:
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


@pytest.fixture
def wine_csv() -> Path:
    directory = shared_data_dir()
    path = directory / "winequality-white.csv" if directory else None
    if path is None or not path.is_file():
        pytest.skip("the UCI white-wine CSV is not in ../shared/data (set DRMOO_SHARED_DATA to its directory)")
    return path


def _import_file(path: Path, name: str) -> Any:
    """The module of the Python file PATH, imported under NAME (scripts/ and bench/ are not packages)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def load_script() -> Callable[[str], Any]:
    """Import ``scripts/NAME.py`` as a module (the scripts are not a package): ``load_script("sweep_rule")``."""
    return lambda name: _import_file(Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py", name)


@pytest.fixture
def load_bench() -> Callable[[str], Any]:
    """Import ``bench/NAME.py`` as a module, as ``drmoo_bench_NAME``: ``load_bench("op_count")``."""
    return lambda name: _import_file(Path(__file__).resolve().parents[1] / "bench" / f"{name}.py",
                                     f"drmoo_bench_{name}")


RankWorker = Callable[..., None]


def _run_ranks(worker: RankWorker, world: int, init_file: str, *args: Any) -> None:
    """Run ``worker(rank, world, init_file, *args)`` for every rank in ``world`` fresh interpreters.

    Not forked ones: once an earlier test of the session has started autograd's worker threads (any backward
    on a GPU, and some under torch 2.11 on the CPU), a forked child may not run a backward ("Unable to handle
    autograd's threading in combination with fork-based multiprocessing"; seen on an H200 and in CI's torch
    2.11 leg).  ``worker`` is a module-level function of a test file, loaded again by its path; ``args`` must
    be JSON values.  A worker that returned (its results saved, its process group destroyed) ends with
    ``os._exit(0)``, as a forked child always does: under torch 2.11 a fresh interpreter's finalization could
    still abort in gloo's teardown.  The ranks run from the init file's folder, so that a checkout's
    uncompiled top-level ``drmoo_kernels/`` does not shadow the installed one.
    """
    script = (
        "import importlib.util, json, os, sys\n"
        "spec = importlib.util.spec_from_file_location('drmoo_rank_worker', sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "getattr(module, sys.argv[2])(int(sys.argv[3]), *json.loads(sys.argv[4]))\n"
        "sys.stdout.flush()\n"
        "sys.stderr.flush()\n"
        "os._exit(0)\n"
    )
    arguments = json.dumps([world, init_file, *args])
    source = worker.__code__.co_filename
    workers = [subprocess.Popen([sys.executable, "-c", script, source, worker.__name__, str(rank), arguments],
                                stderr=subprocess.PIPE, text=True, cwd=Path(init_file).parent)
               for rank in range(world)]
    errors = [(process.communicate(timeout=600)[1], process.returncode) for process in workers]
    for rank, (stderr, code) in enumerate(errors):
        assert code == 0, f"rank {rank} failed (exit {code}):\n{stderr[-4000:]}"


@pytest.fixture
def run_ranks() -> Callable[..., None]:
    """:func:`_run_ranks`: ``run_ranks(worker, world, init_file, *args)`` runs a DDP test's ranks."""
    return _run_ranks


@pytest.fixture
def group_of_one(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of one rank in this process (torch.distributed code paths without spawning)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
