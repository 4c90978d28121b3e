"""pytest-benchmark harness for the drmoo kernels: machine, same-run baselines, derived figures.

Every record's ``extra_info`` carries: the op and its shape, the backend, the device and machine, the
bytes the op must move, the achieved GB/s, ``speedup_vs_reference`` (reference time / this time,
both measured in this run) and ``fraction_of_copy_bandwidth`` (achieved GB/s over the GB/s of a
torch ``copy_`` moving the same number of bytes, also measured in this run).  The times are the
minimum over the rounds; ``*_median`` fields repeat the figures with medians.

On a GPU every record also carries the op's *device time*: the median of ``EVENT_ROUNDS`` calls issued back
to back after a warm-up, each bracketed by CUDA events (``device_median_s``), and the figures derived from
it (``*_device``: GB/s, fraction of the device's peak and of a same-run ``copy_`` timed the same way, speedup
over the reference's device time).  That is the number the GPU table reports (bench/run.py): one per shape,
the same measure as scripts/gpu_bandwidth.py's ``events`` column.  The host-clock times (each call followed
by a synchronisation, so they include launch latency) stay in the JSON.

Helpers are fixtures (not importable modules) because the project runs pytest with
``--import-mode=importlib``.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import drmoo_kernels

# The interpreter is a correctness path: never benchmark triton on CPU tensors.
_DEVICE_BACKENDS = {"cpu": ("reference", "cpp"), "cuda": ("reference", "cuda", "triton")}
# Measured time per record (after one warm-up call), at least _MIN_ROUNDS rounds.  DRMOO_BENCH_BUDGET_S
# shortens it where device time is scarce (a GPU op takes microseconds: 0.25 s is still many rounds).
_BUDGET_S = float(os.environ.get("DRMOO_BENCH_BUDGET_S", "1.0"))
_MIN_ROUNDS = 3
_MAX_ROUNDS = 200
EVENT_ROUNDS = 50  # device-time samples per GPU record (after EVENT_WARMUP calls)
EVENT_WARMUP = 3


def bench_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def machine_description() -> str:
    """The GPU's name, or the CPU model from /proc/cpuinfo with the number of usable cores."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def device_peak_gb_per_s() -> float | None:
    """The GPU's theoretical memory bandwidth (DDR: 2 transfers per clock x bus width), None on CPU.

    H100 SXM: 2 x 2.619 GHz x 5120 bit / 8 = 3.35 TB/s, the datasheet figure.  DESIGN §6's GPU target
    (80% of device bandwidth) is a fraction of this number.
    """
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties()
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9


def machine_slug() -> str:
    """A file name for the results: 'cpu-<model>-<cores>c' or 'gpu-<name>'."""
    if torch.cuda.is_available():
        text = "gpu-" + torch.cuda.get_device_name()
    else:
        text = "cpu-" + machine_description().split(",")[0] + f"-{os.cpu_count()}c"
    return re.sub(r"[^a-z0-9]+", "-", text.lower().replace("(r)", "")).strip("-")


def bench_backends() -> list[str]:
    """Available backends that make sense for the benchmark device, the reference first."""
    allowed = _DEVICE_BACKENDS[bench_device().type]
    return [name for name in drmoo_kernels.available_backends() if name in allowed]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def events_median_s(fn: Callable[[], Any], rounds: int = EVENT_ROUNDS) -> float:
    """Median device seconds of one call of ``fn``: calls issued back to back, CUDA events around each."""
    for _ in range(EVENT_WARMUP):
        fn()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]
             for _ in range(rounds)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return float(statistics.median(start.elapsed_time(end) for start, end in pairs)) / 1e3


def _timed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn followed by a device synchronisation, so that asynchronous GPU work is inside the timing."""
    if not torch.cuda.is_available():
        return fn

    def run() -> Any:
        out = fn()
        torch.cuda.synchronize()
        return out

    return run


class Harness:
    """Runs one benchmark record and fills its extra_info with the same-run comparisons.

    Figures use the *minimum* over the rounds (and the median too, as ``*_median``): on a shared
    machine other processes only ever add time, so the minimum is the stabler estimate of what the
    op itself costs.  The copy baseline is re-measured next to every record for the same reason.
    """

    def __init__(self) -> None:
        self.device = bench_device()
        self.machine = machine_description()
        self.peak_gb_per_s = device_peak_gb_per_s()
        self._reference: dict[str, tuple[float, float]] = {}  # key -> (min, median)
        self._baselines: dict[str, tuple[float, float]] = {}  # name -> (min, median) over all measurements
        self._reference_device: dict[str, float] = {}  # key -> the reference's device seconds (GPU)
        self._copy_device: dict[int, float] = {}  # bytes -> a copy_'s device seconds (GPU)

    def baseline_seconds(self, name: str, fn: Callable[[], Any], budget_share: float = 0.25) -> tuple[float, float]:
        """(min, median) time of a same-run baseline ``fn``, re-measured on every call.

        Each call times ``fn`` over a share of the record budget; the minimum kept is the best over
        every call with this ``name`` (a baseline measured once could land on a busy moment of a
        shared machine and make every ratio next to it look better than it is).
        """
        run = _timed(fn)
        run()  # warm-up
        once = _min_median(run, 1)[0]
        best, median = _min_median(run, max(_MIN_ROUNDS, int(_rounds(once) * budget_share)))
        old = self._baselines.get(name)
        self._baselines[name] = (best, median) if old is None else (min(best, old[0]), median)
        return self._baselines[name]

    def copy_seconds(self, nbytes: int) -> tuple[float, float]:
        """(min, median) time of ``dst.copy_(src)`` moving ``nbytes`` in all (half read, half written)."""
        count = max(1, nbytes // 8)  # float32 elements per side: read count*4 + write count*4
        src = torch.rand(count, device=self.device)
        dst = torch.empty_like(src)
        return self.baseline_seconds(f"copy {nbytes}", lambda: dst.copy_(src))

    def copy_device_seconds(self, nbytes: int) -> float:
        """Device seconds of ``dst.copy_(src)`` moving ``nbytes`` (CUDA events; measured once per size)."""
        if nbytes not in self._copy_device:
            count = max(1, nbytes // 8)
            src = torch.rand(count, device=self.device)
            dst = torch.empty_like(src)
            self._copy_device[nbytes] = events_median_s(lambda: dst.copy_(src))
        return self._copy_device[nbytes]

    def run(
        self,
        benchmark: Any,
        fn: Callable[[], Any],
        *,
        key: str,
        backend: str,
        nbytes: int,
        info: dict[str, Any],
        reference_fn: Callable[[], Any] | None = None,
    ) -> None:
        """Benchmark ``fn``; ``key`` names the case (same key, same work) across backends.

        The reference figures of the same key come from its own record (the cases are ordered so
        that it runs first), else from ``reference_fn`` timed here.
        """
        run = _timed(fn)
        run()  # warm-up: compilation, caches, first-touch page faults
        once = _min_median(run, 1)[0]
        benchmark.pedantic(run, rounds=_rounds(once), iterations=1, warmup_rounds=0)
        if benchmark.stats is None:  # timings off (a plain `pytest bench/`): the op ran, nothing to record
            return
        stats = benchmark.stats.stats
        best, median = stats.min, stats.median
        if backend == "reference":
            self._reference[key] = (best, median)
        elif key not in self._reference and reference_fn is not None:
            ref_run = _timed(reference_fn)
            ref_run()
            self._reference[key] = _min_median(ref_run, _rounds(_min_median(ref_run, 1)[0]))
        ref = self._reference.get(key)
        benchmark.extra_info.update(info)
        benchmark.extra_info.update(
            backend=backend,
            device=str(self.device),
            machine=self.machine,
            case=key,
            bytes=nbytes,
            reference_min_s=None if ref is None else ref[0],
            speedup_vs_reference=None if ref is None else ref[0] / best,
            speedup_vs_reference_median=None if ref is None else ref[1] / median,
        )
        if nbytes > 0:
            copy_min, copy_median = self.copy_seconds(nbytes)
            benchmark.extra_info.update(
                gb_per_s=nbytes / best / 1e9,
                gb_per_s_median=nbytes / median / 1e9,
                copy_gb_per_s=nbytes / copy_min / 1e9,
                fraction_of_copy_bandwidth=copy_min / best,
                fraction_of_copy_bandwidth_median=copy_median / median,
            )
            if self.peak_gb_per_s is not None:
                benchmark.extra_info.update(
                    device_peak_gb_per_s=self.peak_gb_per_s,
                    fraction_of_device_bandwidth=nbytes / best / 1e9 / self.peak_gb_per_s,
                )
        if self.device.type == "cuda":
            self._device_time(benchmark.extra_info, fn, key=key, backend=backend, nbytes=nbytes,
                              reference_fn=reference_fn)

    def _device_time(self, extra: dict[str, Any], fn: Callable[[], Any], *, key: str, backend: str, nbytes: int,
                     reference_fn: Callable[[], Any] | None) -> None:
        """The record's device time and the figures derived from it (the module docstring's ``*_device``)."""
        seconds = events_median_s(fn)
        if backend == "reference":
            self._reference_device[key] = seconds
        elif key not in self._reference_device and reference_fn is not None:
            self._reference_device[key] = events_median_s(reference_fn)
        reference_seconds = self._reference_device.get(key)
        extra.update(
            device_median_s=seconds,
            event_rounds=EVENT_ROUNDS,
            speedup_vs_reference_device=None if reference_seconds is None else reference_seconds / seconds,
        )
        if nbytes > 0:
            extra.update(gb_per_s_device=nbytes / seconds / 1e9,
                         fraction_of_copy_bandwidth_device=self.copy_device_seconds(nbytes) / seconds)
            if self.peak_gb_per_s is not None:
                extra.update(fraction_of_device_bandwidth_device=nbytes / seconds / 1e9 / self.peak_gb_per_s)


def _min_median(fn: Callable[[], Any], rounds: int) -> tuple[float, float]:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples), statistics.median(samples)


def _rounds(once_s: float) -> int:
    return int(min(_MAX_ROUNDS, max(_MIN_ROUNDS, _BUDGET_S / max(once_s, 1e-6))))


@pytest.fixture(scope="session")
def harness() -> Harness:
    return Harness()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every benchmark that takes ``backend`` runs once per backend of :func:`bench_backends`."""
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", bench_backends())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run each case's reference record right before the other backends of the same case.

    Then every record's speedup uses the reference record of this run, and the big tensors of one
    shape are built once for all backends.
    """

    def case(item: pytest.Item) -> str:
        params = getattr(getattr(item, "callspec", None), "params", {})
        rest = sorted((k, repr(v)) for k, v in params.items() if k != "backend")
        return f"{getattr(item, 'originalname', item.name)}{rest}"

    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(case(item), index)

    def order(item: pytest.Item) -> tuple[int, int]:
        params = getattr(getattr(item, "callspec", None), "params", {})
        return first_seen[case(item)], 0 if params.get("backend") == "reference" else 1

    items.sort(key=order)
