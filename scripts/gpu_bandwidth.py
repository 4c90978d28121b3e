"""Achieved bandwidth of gram_step and latency of the dual ops on one CUDA device, in < 60 s.

    PYTHONPATH=python:. python scripts/gpu_bandwidth.py [--out DIR] [--budget-s 55]

(build the CUDA kernels first: ``python setup.py build_ext --inplace``; without them the ``cuda``
rows say why they are missing.)  Prints one markdown table per op and, with ``--out``, writes
``gpu_bandwidth.md`` and ``gpu_bandwidth.json`` there.

gram_step, float32, n = 11.2M split into 62 ResNet-like parameter tensors, m in {3, 8, 40}:
bytes = 2*m*n*4 + 2*n*4 (J read twice, the parameters read and written).  Two timings, each the
median of >= 20 calls after warm-up:

* ``events``: CUDA events around each call, calls issued back to back (the device stays busy as
  long as the host enqueues faster than the device runs: the steady state of a training loop);
* ``wall``:   host clock around one call followed by ``torch.cuda.synchronize()`` (what
  bench/run.py measures; includes the launch latency and the synchronisation).

The fraction of peak divides bytes/s by the device's theoretical bandwidth (2 x memory clock x
bus width, bench/conftest.py's ``device_peak_gb_per_s``); a same-run ``copy_`` gives the
practical ceiling.  dual_step / dual_forward at B = 256, m = 8 report the same two timings plus
``graph``: the device time per call from replaying 20 calls captured in one CUDA graph (no host
overhead at all), when the backend can be captured.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
for entry in (str(REPO / "python"), str(REPO)):
    if entry not in sys.path:
        sys.path.insert(0, entry)

from drmoo_kernels import Divergence, backend_module, why_unavailable  # noqa: E402

N_PARAMS = 11_200_000
TASKS = (3, 8, 40)
DUAL_B, DUAL_M = 256, 8
ROUNDS = 25
WARMUP = 3
BACKENDS = ("cuda", "triton", "reference")


def peak_gb_per_s() -> float | None:
    """bench/conftest.py's device_peak_gb_per_s when importable, else the same formula here."""
    path = REPO / "bench" / "conftest.py"
    try:
        spec = importlib.util.spec_from_file_location("_drmoo_bench_conftest", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.device_peak_gb_per_s()
    except Exception:  # pytest or the bench plugins may be missing: the same formula here
        props = torch.cuda.get_device_properties()
        clock_khz = getattr(props, "memory_clock_rate", 0)
        bus_bits = getattr(props, "memory_bus_width", 0)
        return 2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None


def parameter_split(n: int) -> list[int]:
    """The benchmark's ResNet-like split (bench/test_kernels.py): 21 large tensors, 41 small ones."""
    small = [64 * (1 + i % 8) for i in range(41)]
    rest = n - sum(small)
    weights = [1.25**i for i in range(21)]
    large = [max(1, int(rest * w / sum(weights))) for w in weights]
    large[-1] += rest - sum(large)
    return large + small


def events_ms(fn: Callable[[], Any], rounds: int = ROUNDS) -> float:
    """Median device time of one call, calls issued back to back (CUDA events around each)."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rounds)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs)


def wall_ms(fn: Callable[[], Any], rounds: int = ROUNDS) -> float:
    """Median host time of one call followed by a device synchronisation."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graph_ms(fn: Callable[[], Any], calls: int = 20, replays: int = 10) -> float | None:
    """Device time per call from replaying `calls` calls captured in one CUDA graph; None if the
    backend cannot be captured (e.g. it synchronises)."""
    try:
        for _ in range(WARMUP):
            fn()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / calls)
        return statistics.median(times)
    except Exception:  # capture is optional information
        torch.cuda.synchronize()
        return None


def copy_gb_per_s(nbytes: int) -> float:
    """Same-run device copy: dst.copy_(src) moving `nbytes` (half read, half written)."""
    src = torch.rand(nbytes // 8, device="cuda")
    dst = torch.empty_like(src)
    ms = events_ms(lambda: dst.copy_(src))
    return nbytes / (ms * 1e-3) / 1e9


def time_gram_step(module: Any, tasks: int, sizes: list[int]) -> tuple[float, float]:
    """(events ms, wall ms) of one gram_step call of ``module`` on fresh float32 inputs."""
    J = torch.randn(tasks, sum(sizes), device="cuda") * 1e-3
    params = [torch.randn(k, device="cuda") for k in sizes]
    w = torch.full((tasks,), 1.0 / tasks, device="cuda")
    z = torch.randn(tasks, device="cuda")
    mu = torch.tensor(0.5, device="cuda")

    def step() -> Any:
        # tiny gamma: the parameters stay where they are over all rounds
        return module.gram_step(J, w, params, 1e-9, 1.0, 0.5, 1e-3, 1e-3, mu, z)

    return events_ms(step), wall_ms(step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder for gpu_bandwidth.{md,json}")
    parser.add_argument("--budget-s", type=float, default=55.0, help="stop starting new cases after this")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bandwidth: no CUDA device", file=sys.stderr)
        return 2
    began = time.perf_counter()
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    peak = peak_gb_per_s()
    backends = {}
    for name in BACKENDS:
        reason = why_unavailable(name)
        backends[name] = backend_module(name) if reason is None else reason
    records: list[dict[str, Any]] = []
    lines = [f"# drmoo kernels on {device} (torch {torch.__version__}, CUDA {torch.version.cuda})", ""]
    lines.append(f"Peak bandwidth (2 x clock x bus width): {peak:.0f} GB/s" if peak else "Peak bandwidth: unknown")
    lines.append("")

    # ------------------------------------------------------------------ dual ops latency
    lines += [f"## dual ops, float32, B = {DUAL_B}, m = {DUAL_M} (chi2)", "",
              "| op | backend | events us | wall us | graph us (device only) |", "|---|---|---|---|---|"]
    losses = 3.0 * torch.rand(DUAL_B, DUAL_M, device="cuda")
    eta = torch.zeros(DUAL_M, device="cuda")
    w = torch.full((DUAL_M,), 1.0 / DUAL_M, device="cuda")
    chi2 = Divergence("chi2")
    for op in ("dual_forward", "dual_step"):
        for name, module in backends.items():
            row: dict[str, Any] = {"op": op, "B": DUAL_B, "m": DUAL_M, "backend": name}
            if isinstance(module, str):
                row["skipped"] = module
            elif time.perf_counter() - began > args.budget_s:
                row["skipped"] = "time budget"
            else:
                if op == "dual_forward":
                    def call(ops: Any = module) -> Any:
                        return ops.dual_forward(losses, eta, 0.6, 1.0, chi2)
                else:
                    def call(ops: Any = module) -> Any:
                        return ops.dual_step(losses, eta, w, 0.6, 1.0, chi2, 1e-6, 1.0, 0.5)
                try:
                    row["events_us"] = events_ms(call) * 1e3
                    row["wall_us"] = wall_ms(call) * 1e3
                except Exception as error:  # report it and go on with the other backends
                    row["skipped"] = f"error: {type(error).__name__}: {str(error)[:200]}"
                else:
                    graph = graph_ms(call)
                    row["graph_us"] = None if graph is None else graph * 1e3
            records.append(row)
            lines.append(_dual_line(row))
    lines.append("")

    # ------------------------------------------------------------------ gram_step bandwidth
    sizes = parameter_split(N_PARAMS)
    copy_rate = copy_gb_per_s(2 * 3 * N_PARAMS * 4 + 2 * N_PARAMS * 4)
    copy_fraction = f" = {copy_rate / peak:.2f} of peak" if peak else ""
    lines += [f"Same-run device copy: {copy_rate:.0f} GB/s{copy_fraction}", ""]
    lines += ["## gram_step, float32, n = 11.2M in 62 tensors", "",
              "| m | backend | events ms | GB/s | of peak | of copy | wall ms | GB/s (wall) | of peak (wall) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for tasks in TASKS:
        nbytes = 2 * tasks * N_PARAMS * 4 + 2 * N_PARAMS * 4
        for name, module in backends.items():
            row = {"op": "gram_step", "m": tasks, "n": N_PARAMS, "backend": name, "bytes": nbytes}
            if isinstance(module, str):
                row["skipped"] = module
            elif time.perf_counter() - began > args.budget_s:
                row["skipped"] = "time budget"
            else:
                try:
                    ms, wms = time_gram_step(module, tasks, sizes)
                except Exception as error:  # report it and go on with the other backends
                    row["skipped"] = f"error: {type(error).__name__}: {str(error)[:200]}"
                    records.append(row)
                    lines.append(_gram_line(row))
                    continue
                finally:
                    torch.cuda.empty_cache()
                row.update(events_ms=ms, gb_per_s=nbytes / (ms * 1e-3) / 1e9, wall_ms=wms,
                           gb_per_s_wall=nbytes / (wms * 1e-3) / 1e9)
                row["fraction_of_peak"] = row["gb_per_s"] / peak if peak else None
                row["fraction_of_peak_wall"] = row["gb_per_s_wall"] / peak if peak else None
                row["fraction_of_copy"] = row["gb_per_s"] / copy_rate
            records.append(row)
            lines.append(_gram_line(row))

    lines += ["", f"Finished in {time.perf_counter() - began:.1f} s."]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_bandwidth.md").write_text(text + "\n")
        payload = {"device": device, "torch": torch.__version__, "peak_gb_per_s": peak,
                   "copy_gb_per_s": copy_rate, "records": records}
        (args.out / "gpu_bandwidth.json").write_text(json.dumps(payload, indent=1) + "\n")
    return 0


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _gram_line(row: dict[str, Any]) -> str:
    if "skipped" in row:
        return f"| {row['m']} | {row['backend']} | skipped: {row['skipped']} | | | | | | |"
    return (f"| {row['m']} | {row['backend']} | {row['events_ms']:.3f} | {row['gb_per_s']:.0f} | "
            f"{_fmt(row['fraction_of_peak'], '.2f')} | {row['fraction_of_copy']:.2f} | {row['wall_ms']:.3f} | "
            f"{row['gb_per_s_wall']:.0f} | {_fmt(row['fraction_of_peak_wall'], '.2f')} |")


def _dual_line(row: dict[str, Any]) -> str:
    if "skipped" in row:
        return f"| {row['op']} | {row['backend']} | skipped: {row['skipped']} | | |"
    return (f"| {row['op']} | {row['backend']} | {row['events_us']:.1f} | {row['wall_us']:.1f} | "
            f"{_fmt(row['graph_us'], '.1f')} |")


if __name__ == "__main__":
    sys.exit(main())
