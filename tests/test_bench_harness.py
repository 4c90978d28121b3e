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


def test_gpu_table_reports_the_device_time_and_its_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU each record gets one device time (CUDA events) and every figure of the table comes from it."""
    harness_module = _load("drmoo_bench_conftest_gpu", BENCH / "conftest.py")
    device_seconds = {"reference": 0.004, "cuda": 0.0001, "copy": 0.00008}

    def fake_events(fn: object, rounds: int = 50) -> float:
        return device_seconds[getattr(fn, "label", "copy")]

    monkeypatch.setattr(harness_module, "events_median_s", fake_events)
    harness = harness_module.Harness.__new__(harness_module.Harness)
    harness.peak_gb_per_s, harness._reference_device, harness._copy_device = 4000.0, {}, {}
    harness.device = torch.device("cpu")  # copy_device_seconds allocates its buffers there
    nbytes = 200_000_000
    extras = {}
    for backend in ("reference", "cuda"):
        def op() -> None:
            pass
        op.label = backend  # type: ignore[attr-defined]
        extras[backend] = {}
        harness._device_time(extras[backend], op, key="gram_step m=3", backend=backend, nbytes=nbytes,
                             reference_fn=None)
    cuda = extras["cuda"]
    assert cuda["device_median_s"] == 0.0001
    assert cuda["gb_per_s_device"] == pytest.approx(nbytes / 0.0001 / 1e9)  # 2000 GB/s
    assert cuda["fraction_of_device_bandwidth_device"] == pytest.approx(0.5)
    assert cuda["fraction_of_copy_bandwidth_device"] == pytest.approx(0.8)
    assert cuda["speedup_vs_reference_device"] == pytest.approx(40.0)

    run = _load("drmoo_bench_run_gpu", BENCH / "run.py")
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"datetime": "now", "benchmarks": [
        _record("gram_step", "cuda", 0.0003, m=3, n=11_200_000, gb_per_s=600.0, device_peak_gb_per_s=4000.0,
                fraction_of_device_bandwidth=0.15, **cuda),
    ]}))
    table = run.summarize(gpu)
    assert "CUDA events" in table and "Device peak memory bandwidth (clock x bus width): 4000 GB/s." in table
    # device time 0.1 ms, 2000 GB/s, half the peak, 0.8 of a copy_, 40x the reference; host median 0.45 ms
    assert table.splitlines()[-1] == ("| gram_step | m=3 n=11200000 | cuda | 0.100 ms | 2000.00 | 0.50 | 0.80 "
                                      "| 40.00 | 0.450 ms |")


def test_tasks_scaling_table_names_the_gpu_setting() -> None:
    scaling = _load("drmoo_tasks_scaling", BENCH / "tasks_scaling.py")
    record = {"trunk": "groupnorm", "heads": "separate", "batch": 256, "m": 40,
              "median_s": {"plain": 0.010, "features": 0.012}, "ratios": {"features": [1.1, 1.2, 1.3]},
              "step_peak_rss_gb": {"plain": 1.0, "features": 1.25}}
    shared = {**record, "heads": "shared", "batch": 32, "ratios": {"features": [1.05, 1.0, 1.1]},
              "step_peak_rss_gb": {}}
    data = {"command": "python bench/tasks_scaling.py --device cuda --batch 256", "machine": "NVIDIA H200 (CUDA 13.0)",
            "cores": 16, "torch": "2.11.0", "torchjd": "0.18.0", "rounds": 3, "device": "cuda",
            "image": 32, "load_start": "0", "load_end": "0", "trunks": ["groupnorm"],
            "variants": ["plain", "features"], "records": [record, shared]}
    table = scaling.table(data)
    assert table.startswith("# Step time and peak memory against the number of tasks (GPU)")
    assert "torch.cuda.max_memory_allocated()" in table and "wall-clock" in table
    assert "32 px, batch 256, m separate Linear(512, 1) heads joined by torch.cat" in table
    # the median of the per-round ratios (each against the plain steps around it) and their range
    assert "| 40 | 0.010 s, 1.00 GB | 0.012 s (1.20x [1.10-1.30]), 1.25 GB |" in table
    assert "32 px, batch 32, one shared Linear(512, m) head" in table
    assert "| 40 | 0.010 s | 0.012 s (1.05x [1.00-1.10]) |" in table
    cpu = scaling.table({**data, "device": "cpu"})
    assert "(CPU)" in cpu and "resident set size" in cpu and "time.process_time" in cpu


def test_tasks_scaling_interleaves_plain_around_every_variant_on_process_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """plain, v1, plain, v2, plain per round; each ratio is over the two plain steps around it; CPU time."""
    scaling = _load("drmoo_tasks_scaling_rounds", BENCH / "tasks_scaling.py")
    order: list[str] = []
    seconds = {"plain": 1.0, "features": 1.5, "parameters": 3.0}
    clock = [0.0]

    def make_step(variant: str, trunk: object, heads: object, num_tasks: int) -> object:
        def step(x: object, y: object) -> None:
            order.append(variant)
            clock[0] += seconds[variant]
        return step

    monkeypatch.setattr(scaling, "build", lambda *args, **kwargs: (None, None))
    monkeypatch.setattr(scaling, "make_step", make_step)
    monkeypatch.setattr(scaling, "batch", lambda *args, **kwargs: (None, None))
    monkeypatch.setattr(scaling.time, "process_time", lambda: clock[0])
    monkeypatch.setattr(scaling.time, "perf_counter", lambda: -1.0)  # a wall clock would give zero times
    times, ratios = scaling.time_interleaved("groupnorm", 2, ("features", "parameters"), 2)
    warmup = ["plain", "features", "parameters"]
    assert order == warmup + ["plain", "features", "plain", "parameters", "plain"] * 2
    assert ratios == {"features": [1.5, 1.5], "parameters": [3.0, 3.0]}
    assert times["plain"] == [1.0] * 6 and times["features"] == [1.5, 1.5]
    assert scaling.cell_variants(("plain", "parameters", "features"), 32, 100, all_cells=False) == ("plain", "features")
    assert scaling.cell_variants(("plain", "parameters"), 32, 40, all_cells=False) == ("plain", "parameters")


def test_tasks_scaling_batched_parameters_variant_takes_the_same_step() -> None:
    """``parameters-batched`` (the per-task passes vmapped, as TorchJD's autojac) moves the trunk as
    ``parameters`` does: same Jacobian, another way of computing it."""
    scaling = _load("drmoo_tasks_scaling_batched", BENCH / "tasks_scaling.py")
    torch.manual_seed(0)
    moved = {}
    for variant in ("parameters", "parameters-batched"):
        torch.manual_seed(0)
        trunk = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 512), torch.nn.Tanh())
        heads = torch.nn.ModuleList(torch.nn.Linear(512, 1) for _ in range(3))
        step = scaling.make_step(variant, trunk, heads, 3)
        x, y = scaling.batch(3, size=4)
        step(x, y)
        moved[variant] = [p.detach().clone() for p in trunk.parameters()]
    for a, b in zip(moved["parameters"], moved["parameters-batched"]):
        # One step moves an entry by lr * |g| with lr = 1e-3 and |g| = O(1): the strategies' float32 rounding
        # (~1e-7 of g) moves it by ~1e-10, a different direction by ~1e-4; 1e-6 tells the two apart.
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="parameters-batched"):
        scaling.make_step("parameters-vmap", trunk, heads, 3)


def test_rep_grad_baseline_is_mgda_on_the_representation() -> None:
    """The hand-written rep-grad baseline: trunk gradient = J^T (w_1 g_1 + w_2 g_2), w the min-norm weights of the
    gradients g_i w.r.t. z (closed form for m = 2, which Frank-Wolfe with exact line search reaches in one
    iteration); each head gets its own task's gradient."""
    scaling = _load("drmoo_tasks_scaling_rep_grad", BENCH / "tasks_scaling.py")
    torch.manual_seed(0)
    trunk = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 512), torch.nn.Tanh())
    heads = torch.nn.ModuleList(torch.nn.Linear(512, 1) for _ in range(2))
    x, y = scaling.batch(2, size=4)
    losses, rep = scaling.forward_of("rep-grad", trunk, heads, 2)(x, y)
    scaling.rep_grad_backward(losses, rep, list(heads.parameters()))
    got = [p.grad.clone() for p in (*trunk.parameters(), *heads.parameters())]

    for p in (*trunk.parameters(), *heads.parameters()):
        p.grad = None
    z = trunk(x)
    task_losses = torch.nn.functional.binary_cross_entropy_with_logits(
        torch.cat([head(z) for head in heads], dim=1), y, reduction="none").mean(0)
    g1, g2 = (torch.autograd.grad(loss, z, retain_graph=True)[0].flatten() for loss in task_losses)
    w1 = ((g2 - g1) @ g2 / (g1 - g2).square().sum()).clamp(0, 1)
    trunk_grads = torch.autograd.grad(w1 * task_losses[0] + (1 - w1) * task_losses[1], list(trunk.parameters()),
                                      retain_graph=True)
    head_grads = torch.autograd.grad(task_losses.sum(), list(heads.parameters()))
    # float32 sums of O(1) terms over 3,072 x 512 entries: rounding ~1e-6 relative; a wrong weight moves it by ~w1
    for a, b in zip(got, (*trunk_grads, *head_grads)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_tasks_scaling_runs_without_torchjd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without TorchJD its variants are left out, and the table says so, instead of a crash at the version lookup."""
    scaling = _load("drmoo_tasks_scaling_no_torchjd", BENCH / "tasks_scaling.py")
    assert scaling.installed_version("drmoo-no-such-package") is None
    monkeypatch.setattr(scaling, "installed_version", lambda package: None)
    out = tmp_path / "scaling"
    monkeypatch.setattr("sys.argv", ["tasks_scaling.py", "--trunks", "tiny", "--heads", "shared", "--batch", "2",
                                     "--tasks", "2", "--rounds", "1", "--no-memory", "--all-cells", "--variants",
                                     "plain", "torchjd-mgda", "--out", str(out)])
    scaling.main()
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["torchjd"] == "not installed" and data["left_out"] == ["torchjd-mgda"]
    assert data["command"].endswith(f"--out {out}")  # the Regenerate line rewrites these files, not the default's
    assert set(data["records"][0]["median_s"]) == {"plain"}
    assert "Left out: torchjd-mgda (TorchJD is not installed here)." in out.with_suffix(".md").read_text()
