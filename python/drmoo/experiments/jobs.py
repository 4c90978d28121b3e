"""Running a comparison's runs in worker processes: workers that die with their parent, progress from inside them.

``drmoo compare --jobs N`` trains N runs at once, each in a worker process.  Two things make that
usable:

* **Workers die with their parent.**  A worker holds a model, its data and torch's thread pools
  (about 0.8 GB for a ResNet18 run).  If the parent is killed outright (``kill -9``, the OOM
  killer), nothing would tell the workers, and they would train on forever.  On Linux each worker
  asks the kernel to send it SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``); elsewhere
  a watchdog thread notices that it was re-parented and exits.
* **Progress from inside every running job.**  The training loop draws its bar through
  :func:`progress_bar`.  In the parent process that is a tqdm bar.  In a worker it sends
  ``(job, step, total)`` to the parent over a queue, and the parent draws one bar per running job
  under the comparison's own bar, or, when stderr is not a terminal (CI logs), prints one line per
  job every :data:`LOG_INTERVAL_S` seconds instead of redrawing bars.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

from tqdm.auto import tqdm

__all__ = ["LOG_INTERVAL_S", "progress_bar", "run_in_workers"]

LOG_INTERVAL_S = 30.0  # progress lines when stderr is not a terminal: often enough to see life, rarely enough to read
_REPORT_INTERVAL_S = 0.5  # a worker sends at most this often (and always its last step): a queue, not a flood
_PR_SET_PDEATHSIG = 1  # linux/prctl.h

# Set in a worker process by _start_worker / _run_job: where its progress goes and which job it runs.
_progress_queue: Any = None
_current_job: int | None = None


class _ReportingBar:
    """What :func:`progress_bar` returns inside a worker: tqdm's interface, sending progress to the parent."""

    def __init__(self, total: int, initial: int, desc: str) -> None:
        self.total, self.n, self.desc = total, initial, desc
        self._sent = 0.0
        self._send(force=True)

    def _send(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._sent >= _REPORT_INTERVAL_S:
            self._sent = now
            try:
                _progress_queue.put_nowait((_current_job, self.n, self.total, self.desc))
            except (queue.Full, ValueError, OSError):  # the parent is gone or closed the queue: train on silently
                pass

    def update(self, steps: int = 1) -> None:
        self.n += steps
        self._send(force=self.n >= self.total)

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        """Accepted and ignored: the parent's bar shows the step count only."""

    def close(self) -> None:
        self._send(force=True)

    def __enter__(self) -> _ReportingBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_bar(*, total: int, initial: int, desc: str, disable: bool, **tqdm_options: Any) -> Any:
    """The training loop's progress bar: tqdm here, or, inside a comparison worker, a reporter to the parent."""
    if not disable and _progress_queue is not None and _current_job is not None:
        return _ReportingBar(total, initial, desc)
    return tqdm(total=total, initial=initial, desc=desc, disable=disable, **tqdm_options)


def _die_with_parent(parent: int) -> None:
    """Make this worker end when process ``parent`` ends, however it ends (SIGKILL included)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                if os.getppid() != parent:  # the parent died before prctl took effect
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass  # no prctl (an unusual libc): the watchdog below does the same, a second later at most

    def watchdog() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)  # re-parented: the comparison is gone, and so is anyone to report to

    threading.Thread(target=watchdog, name="drmoo-parent-watchdog", daemon=True).start()


def _start_worker(parent: int, threads: int, progress_queue: Any) -> None:
    """A worker's initializer: bound to its parent's life, its share of the cores, where progress goes."""
    global _progress_queue
    _die_with_parent(parent)
    import torch

    torch.set_num_threads(threads)  # the cores shared out, so that N jobs do not oversubscribe them
    _progress_queue = progress_queue


def _run_job(index: int, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    global _current_job
    _current_job = index
    try:
        return function(*args)
    finally:
        _current_job = None


class _JobProgress:
    """The parent's view of its workers' progress: one tqdm bar per running job, or periodic lines."""

    def __init__(self, total_jobs: int, jobs: int, names: Sequence[str], enabled: bool) -> None:
        self.enabled, self.names = enabled, list(names)
        self.interactive = enabled and sys.stderr.isatty()
        self.overall = tqdm(total=total_jobs, desc=f"compare ({jobs} jobs)", disable=not self.interactive,
                            position=0, dynamic_ncols=True)
        self.done = 0
        self.state: dict[int, tuple[int, int, str]] = {}  # running job -> (step, total, description)
        self.bars: dict[int, Any] = {}
        self.positions: dict[int, int] = {}  # running job -> its bar's line under the comparison's bar
        self.ended: set[int] = set()  # a report can arrive after its job's result: it draws no bar again
        self.free_positions = list(range(1, jobs + 1))
        self.last_line = time.monotonic()

    def report(self, job: int, step: int, total: int, desc: str) -> None:
        if not self.enabled or job is None or job in self.ended:
            return
        self.state[job] = (step, total, desc)
        if not self.interactive:
            return
        bar = self.bars.get(job)
        if bar is None:
            position = self.free_positions.pop(0) if self.free_positions else len(self.bars) + 1
            self.positions[job] = position
            bar = self.bars[job] = tqdm(total=total, initial=step, desc=desc, position=position, leave=False,
                                        dynamic_ncols=True)
        bar.total = total
        bar.update(step - bar.n)

    def finished(self, job: int) -> None:
        self.done += 1
        self.ended.add(job)
        self.state.pop(job, None)
        bar = self.bars.pop(job, None)
        if bar is not None:
            self.free_positions.append(self.positions.pop(job))
            self.free_positions.sort()
            bar.close()
        self.overall.update(1)
        if self.enabled and not self.interactive:
            self._line(f"compare: {self.names[job]} finished ({self.done}/{len(self.names)} done)")

    def tick(self) -> None:
        """Periodic lines when stderr is not a terminal: every running job's step count."""
        if not self.enabled or self.interactive or time.monotonic() - self.last_line < LOG_INTERVAL_S:
            return
        running = "; ".join(f"{desc} {step}/{total}" for step, total, desc in self.state.values())
        self._line(f"compare: {self.done}/{len(self.names)} done" + (f"; running: {running}" if running else ""))

    def _line(self, text: str) -> None:
        self.last_line = time.monotonic()
        print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.overall.close()


def run_in_workers(function: Callable[..., Any], calls: Sequence[tuple[Any, ...]], jobs: int,
                   names: Sequence[str], progress: bool = True) -> list[Any]:
    """``[function(*args) for args in calls]``, computed ``jobs`` at a time in worker processes.

    ``function`` must be importable by name (workers are spawned, not forked: forking a process that
    holds torch's thread pools can deadlock).  Each worker gets ``cores // jobs`` torch threads and
    dies with this process.  ``names`` label the calls in the progress display (``progress``: one
    bar per running job on a terminal, a line per job every :data:`LOG_INTERVAL_S` s otherwise).
    The first failure stops the rest (calls not yet started are cancelled) and is raised.
    """
    if len(names) != len(calls):
        raise ValueError(f"run_in_workers: {len(calls)} calls but {len(names)} names")
    results: list[Any] = [None] * len(calls)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    context = multiprocessing.get_context("spawn")  # no fork of a process that holds torch's thread pools
    progress_queue = context.Queue() if progress else None
    display = _JobProgress(len(calls), jobs, names, progress)
    try:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_start_worker,
                                 initargs=(os.getpid(), threads, progress_queue)) as pool:
            futures: dict[Future[Any], int] = {pool.submit(_run_job, index, function, args): index
                                               for index, args in enumerate(calls)}
            pending = set(futures)
            try:
                while pending:
                    done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                    _drain(progress_queue, display)
                    for future in done:
                        results[futures[future]] = future.result()
                        display.finished(futures[future])
                    display.tick()
            except BaseException as error:
                for future in futures:
                    future.cancel()
                if isinstance(error, KeyboardInterrupt):  # Ctrl-C, or drmoo compare's SIGTERM
                    _stop_workers(pool)
                raise
    finally:
        display.close()
        if progress_queue is not None:
            progress_queue.close()
            progress_queue.join_thread()
    return results


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """SIGTERM to every worker: a run in training saves its checkpoint after the step in flight and stops
    (its own handler), so that the pool's shutdown waits seconds, not for the runs to finish, and
    running the comparison again resumes them.  (Ctrl-C in a terminal reached them already.)"""
    processes = getattr(pool, "_processes", None) or {}  # pid -> process (the executor's own table)
    for process in list(processes.values()):
        try:
            process.terminate()
        except (OSError, ValueError):  # already gone
            pass


def _drain(progress_queue: Any, display: _JobProgress) -> None:
    if progress_queue is None:
        return
    while True:
        try:
            job, step, total, desc = progress_queue.get_nowait()
        except queue.Empty:
            return
        display.report(job, step, total, desc)
