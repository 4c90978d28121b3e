"""Seconds per iteration of every method on the Multi-MNIST model (paper Fig. 6), against the floor.

The floor is what any method that needs every task's gradient must pay: one forward pass plus m
backward passes of the same model on one batch, measured alone in the same run.  Each method's
iteration is ``optimizer.step(closure)`` plus the heads' SGD step, with the closure drawing a
fresh batch every call (Double-Loop draws inner_steps + 3 batches, MoDo and SDMGrad 3, and so on).
Each method's ratio divides its median by the median of floor passes interleaved with its own
iterations (the floor row reports all floor passes of the run).
Inputs are random images of the experiment's size: timing does not depend on the pixels.
"""

from __future__ import annotations

import csv
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from drmoo.models import MultiTaskResNet
from drmoo.optim import create

from .multimnist import EXPERIMENTS, method_hparams

__all__ = ["machine_name", "measure_iterations"]


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {torch.get_num_threads()} threads"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(*fns: Any, device: torch.device, warmup: int, repeats: int) -> list[list[float]]:
    """Seconds per call of each function, the functions interleaved (a, b, a, b, ...).

    Interleaving puts every method's iterations next to floor passes measured at the same moment,
    so a busy spell of a shared machine slows both sides of the ratio instead of one.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            samples.append(time.perf_counter() - start)
    return times


def _method_iteration(optimizer: Any, heads: torch.optim.Optimizer, batch: Any, losses_of: Any) -> Any:
    """One training iteration: the closure draws a fresh batch per call (and can replay the last one)."""
    last: list[torch.Tensor] = []

    def closure(same_batch: bool = False) -> torch.Tensor:
        if not same_batch:
            last[:] = list(batch())
        return losses_of(*last)

    def iteration() -> None:
        heads.zero_grad(set_to_none=True)
        optimizer.step(closure)
        heads.step()

    return iteration


def measure_iterations(
    experiment: str, methods: list[str], batch_size: int, input_size: int, device: torch.device,
    warmup: int = 1, repeats: int = 3, backend: str | None = None, progress: bool = True,
) -> list[dict[str, Any]]:
    """Rows (method, seconds per iteration median/min, ratio to the floor) with the floor first."""
    num_tasks = EXPERIMENTS[experiment]
    torch.manual_seed(0)
    model = MultiTaskResNet([10] * num_tasks).to(device).train()
    generator = torch.Generator(device="cpu").manual_seed(0)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.rand(batch_size, 3, input_size, input_size, generator=generator).to(device)
        labels = torch.randint(0, 10, (batch_size, num_tasks), generator=generator).to(device)
        return images, labels

    def losses_of(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.stack([F.cross_entropy(z, labels[:, i], reduction="none")
                            for i, z in enumerate(model(images))], dim=1)

    def floor() -> None:
        losses = losses_of(*batch())
        shared = model.shared_parameters()
        for task in range(num_tasks):
            torch.autograd.grad(losses[:, task].mean(), shared, retain_graph=task < num_tasks - 1)

    (all_floor_times,) = _timed(floor, device=device, warmup=warmup, repeats=repeats)
    rows: list[dict[str, Any]] = []
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    for label, method, overrides in tqdm(_variants(methods), desc="bench-iter", disable=not progress):
        model.load_state_dict(initial)
        optimizer = create(method, model.shared_parameters(), num_tasks, backend=backend,
                           **method_hparams(method, overrides))
        heads = torch.optim.SGD(model.task_parameters(), lr=1e-2)
        iteration = _method_iteration(optimizer, heads, batch, losses_of)
        times, floor_times = _timed(iteration, floor, device=device, warmup=warmup, repeats=repeats)
        all_floor_times += floor_times
        rows.append({"method": label, "median_s": statistics.median(times), "min_s": min(times),
                     "ratio_to_floor": statistics.median(times) / statistics.median(floor_times),
                     "backend": optimizer.backend})
    floor_row = {"method": "floor (1 fwd + m bwd)", "median_s": statistics.median(all_floor_times),
                 "min_s": min(all_floor_times), "ratio_to_floor": 1.0}
    return [floor_row, *rows]


def _variants(methods: list[str]) -> list[tuple[str, str, dict[str, Any]]]:
    """(row label, method, hyperparameter overrides) for each row of the table.

    Double-Clip is measured twice: as the paper runs it (two independent batches, so one extra
    forward pass over the floor) and with ``resample=False`` (one batch: exactly the floor's
    1 forward + m backward passes plus the optimizer's own work, the like-for-like comparison
    behind DESIGN §6's 1.05x target).
    """
    rows: list[tuple[str, str, dict[str, Any]]] = []
    for method in methods:
        rows.append((method, method, {}))
        if method == "double-clip":
            rows.append(("double-clip (resample=False)", method, {"resample": False}))
    return rows


def write_outputs(rows: list[dict[str, Any]], out: Path, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fields = ["method", "median_s", "min_s", "ratio_to_floor", "backend"]
    with (out / "wallclock.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7.5, 3.8), constrained_layout=True)
    names = [r["method"] for r in rows]
    axis.bar(names, [r["median_s"] for r in rows], color=["0.6"] + ["C0"] * (len(rows) - 1))
    for index, row in enumerate(rows):
        axis.text(index, row["median_s"], f"{row['ratio_to_floor']:.2f}x", ha="center", va="bottom", fontsize=8)
    axis.set_ylabel("seconds per iteration (median)")
    axis.set_title(title, fontsize=9)
    axis.tick_params(axis="x", rotation=30, labelsize=8)
    fig.savefig(out / "wallclock.png", dpi=120)
    plt.close(fig)
    lines = [f"### {title}", "", "| method | s / iteration (median) | min | × floor |", "|---|---:|---:|---:|"]
    lines += [f"| {r['method']} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['ratio_to_floor']:.2f} |" for r in rows]
    (out / "wallclock.md").write_text("\n".join(lines) + "\n")
