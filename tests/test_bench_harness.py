"""The benchmark harness's own arithmetic: device peak bandwidth and the markdown summary of a run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_peak_bandwidth_is_clock_times_bus_width(monkeypatch: pytest.MonkeyPatch) -> None:
    harness = _load("drmoo_bench_conftest", BENCH / "conftest.py")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # An H100 SXM reports a 2619 MHz HBM3 clock on a 5120-bit bus: 3.35 TB/s on the datasheet.
    props = SimpleNamespace(memory_clock_rate=2_619_000, memory_bus_width=5120)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *args: props)
    assert harness.device_peak_gb_per_s() == pytest.approx(3352.3, abs=0.1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *args: SimpleNamespace())
    assert harness.device_peak_gb_per_s() is None  # a torch without the fields: no made-up figure
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert harness.device_peak_gb_per_s() is None


def _record(op: str, backend: str, seconds: float, **info: object) -> dict:
    return {"stats": {"min": seconds, "median": seconds * 1.5},
            "extra_info": {"op": op, "backend": backend, "machine": "test machine", **info}}


def test_summary_table_carries_the_same_run_ratios(tmp_path: Path) -> None:
    run = _load("drmoo_bench_run", BENCH / "run.py")
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"datetime": "now", "benchmarks": [
        _record("gram_step", "reference", 0.5, m=3, n=11_200_000, gb_per_s=0.7, speedup_vs_reference=1.0,
                fraction_of_copy_bandwidth=0.06),
        _record("gram_step", "cpp", 0.025, m=3, n=11_200_000, gb_per_s=14.3, speedup_vs_reference=20.0,
                fraction_of_copy_bandwidth=1.2),
        _record("double_clip_step", "cpp", 0.09, m=3, n=11_202_408, B=32, speedup_vs_reference=3.1,
                step_over_floor=1.5),
    ]}))
    table = run.summarize(cpu)
    assert "peak fraction" not in table  # a CPU run has no device peak
    assert "| gram_step | m=3 n=11200000 | cpp | 25.000 ms | 37.500 ms | 14.30 | 20.00 | 1.20 |" in table
    step_row = ("| double_clip_step | B=32 m=3 n=11202408 | cpp | 90.000 ms | 135.000 ms | - "
                "| 3.10 (step/floor 1.50) | - |")
    assert step_row in table

    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"datetime": "now", "benchmarks": [
        _record("gram_step", "cuda", 0.0002, m=3, n=11_200_000, gb_per_s=2800.0, speedup_vs_reference=6.0,
                fraction_of_copy_bandwidth=0.95, device_peak_gb_per_s=3352.0, fraction_of_device_bandwidth=0.84),
    ]}))
    table = run.summarize(gpu)
    assert "Device peak memory bandwidth (clock x bus width): 3352 GB/s." in table
    assert table.splitlines()[-1].endswith("| 6.00 | 0.95 | 0.84 |")
