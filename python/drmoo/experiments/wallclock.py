"""Seconds per iteration of every method on the Multi-MNIST model (paper Fig. 6), against two floors.

* The common floor is what any method that needs every task's gradient must pay: one forward pass
  plus m backward passes of the same model on one batch.
* A method's own, *algorithmic* floor is the forward and backward passes its algorithm does, and
  nothing else: Double-Clip as in the paper does a forward-only pass on its first batch and a
  forward + m backward passes on its second; Double-Loop D forward-only inner batches and three
  forward + m backward passes; FAMO one forward + one combined backward and a forward-only
  re-evaluation.  The passes are not written down here: they are *counted* on the method's own
  first (warm-up) iteration -- every call of the model, with or without an autograd graph, and
  every backward pass that reaches the shared parameters (a ``register_multi_grad_hook`` in
  ``"any"`` mode fires once per backward; the heads-only backward FAMO and Nash-MTL use to give
  the heads their raw gradient does not reach the trunk and is counted as the method's work) --
  and replayed by the floor (:func:`replay_passes`).  What a method takes beyond its own floor is
  the optimizer's own work: Gram matrices, solvers, the parameter update, host syncs.

Each method's iteration is ``optimizer.step(closure)`` plus the heads' SGD step, with the closure
drawing a fresh batch every call.  With ``api="balancer"`` it is instead the ``.grad``-writing API
on one batch, ``Adam.zero_grad(); balancer.backward(losses); Adam.step()`` over all parameters, and
every floor ends with the same ``Adam.step()`` (on gradients of the same shapes), so that the ratio
is ``balancer.backward + Adam.step`` over ``forward + m backward + Adam.step``.  The method, the
common floor and its own floor (when its passes differ from the common floor's) run interleaved,
one iteration each in turn, so that a busy spell of a shared machine slows every side of a ratio;
each ratio divides medians of the same run.

Inputs are random images of the experiment's size (timing does not depend on the pixels), made
once and kept on the device in a pool that the closure cycles through, as a prefetching data loader
would hand them over: generating a batch of 256 images of 128 px on the host and copying it to the
GPU takes tens of milliseconds, more than the model's passes on an H200, and timing it made every
ratio count batches drawn rather than the work of the algorithm.
"""

from __future__ import annotations

import itertools
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from drmoo.balancer import Balancer
from drmoo.models import MultiTaskResNet
from drmoo.optim import create
from drmoo.store import make_directory, write_csv, write_figure, write_text

from .environment import cpu_model
from .multimnist import EXPERIMENTS, method_hparams

__all__ = ["APIS", "CLOCKS", "ModelCall", "PassCounter", "describe_passes", "machine_name", "measure_iterations",
           "output_stem", "replay_passes", "resolve_clock", "write_outputs"]

# Distinct batches kept on the device (Double-Loop draws D + 3 = 8 per iteration with the paper's D).
POOL_SIZE = 8
COMMON_FLOOR_LABEL = "floor (1 fwd + m bwd)"
# step: optimizer.step(closure); balancer: drmoo.Balancer.backward(losses) + torch.optim.Adam.step()
APIS = ("step", "balancer")
BALANCER_FLOOR_LABEL = "floor (1 fwd + m bwd + Adam.step)"


@dataclass(frozen=True)
class ModelCall:
    """One forward pass of the model in an iteration, and the backward passes run over its graph."""

    graph: bool  # the forward kept its autograd graph (False: forward-only, under no_grad)
    backward: int  # backward passes through the shared parameters over this forward's graph


Passes = tuple[ModelCall, ...]


class PassCounter:
    """Counts forward passes (calls of the model, with or without a graph) and backward passes.

    ``forward()`` is called by the loss function at every model call.  A backward pass is any
    autograd run that computes a gradient of at least one shared parameter; it is attributed to
    the latest forward that kept a graph (the one it runs over).  Count inside ``with counter:``;
    outside it nothing is recorded and no hook is installed.
    """

    def __init__(self, shared: Sequence[Tensor]) -> None:
        self._shared = list(shared)
        self._calls: list[list[Any]] = []  # [graph, backward count]
        self._handle: Any = None

    def __enter__(self) -> PassCounter:
        self._calls = []
        self._handle = torch.autograd.graph.register_multi_grad_hook(self._shared, self._on_backward, mode="any")
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()
        self._handle = None

    @property
    def active(self) -> bool:
        return self._handle is not None

    def forward(self) -> None:
        if self.active:
            self._calls.append([torch.is_grad_enabled(), 0])

    def _on_backward(self, grad: Tensor) -> None:
        for call in reversed(self._calls):
            if call[0]:
                call[1] += 1
                return
        raise RuntimeError("a backward pass through the shared parameters with no forward pass recorded before it")

    @property
    def passes(self) -> Passes:
        return tuple(ModelCall(graph=bool(graph), backward=int(backward)) for graph, backward in self._calls)


def common_passes(num_tasks: int) -> Passes:
    """The common floor: one forward with its graph, m backward passes (one per task)."""
    return (ModelCall(graph=True, backward=num_tasks),)


def describe_passes(passes: Passes) -> str:
    """'2 fwd (1 no-grad) + 2 bwd' style."""
    forward_only = sum(not call.graph for call in passes)
    backward = sum(call.backward for call in passes)
    no_grad = f" ({forward_only} no-grad)" if forward_only else ""
    return f"{len(passes)} fwd{no_grad} + {backward} bwd"


def replay_passes(passes: Passes, num_tasks: int, draw: Callable[[], Tensor], shared: Sequence[Tensor]) -> None:
    """Exactly the given passes and nothing else: the floor of a method with these passes.

    ``draw()`` runs one forward pass on a fresh batch and returns the per-sample losses [B, m].
    A forward followed by k >= m backward passes runs one per task column (cycling); fewer than m
    backward passes run over the mean of all columns (a combined backward, as FAMO's).
    """
    for call in passes:
        with torch.set_grad_enabled(call.graph):
            losses = draw()
        for index in range(call.backward):
            target = losses[:, index % num_tasks].mean() if call.backward >= num_tasks else losses.mean()
            torch.autograd.grad(target, list(shared), retain_graph=index < call.backward - 1)


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()}, {torch.get_num_threads()} threads"


def output_stem(device: torch.device, batch_size: int) -> str:
    """File stem of bench-iter's outputs: ``wallclock`` on a CPU, ``gpu-<device>-b<batch>`` on a GPU.

    The GPU name follows bench/results' naming ("NVIDIA H200" -> ``gpu-nvidia-h200``); the batch
    size keeps the runs at several batch sizes side by side in one directory.
    """
    if device.type != "cuda":
        return "wallclock"
    name = "gpu-" + torch.cuda.get_device_name(device)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("(r)", "")).strip("-")
    return f"{slug}-b{batch_size}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS = ("auto", "wall", "cpu")


def resolve_clock(clock: str, device: torch.device) -> str:
    """``wall`` (elapsed seconds) or ``cpu`` (this process's CPU seconds); ``auto``: cpu on a CPU device.

    On a CPU shared with other work, elapsed time measures the other tenants as much as the
    method (on this project's 2-core machine the same floor took 0.16 s or 1.2 s); the process's
    CPU time counts only the work done.  A GPU's work is not on the host clock: wall time there.
    """
    if clock not in CLOCKS:
        raise ValueError(f"unknown clock {clock!r}; valid choices: {', '.join(CLOCKS)}")
    if clock == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu clock does not see the work of a {device.type} device; use --clock wall")
    if clock == "auto":
        return "cpu" if device.type == "cpu" else "wall"
    return clock


def _timed(*fns: Callable[[], Any], device: torch.device, warmup: int, repeats: int,
           clock: str = "wall") -> list[list[float]]:
    """Seconds per call of each function, the functions interleaved (a, b, a, b, ...).

    Interleaving puts every method's iterations next to floor passes measured at the same moment,
    so a busy spell of a shared machine slows both sides of the ratio instead of one.
    """
    now = time.process_time if clock == "cpu" else time.perf_counter
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times):
            _sync(device)
            start = now()
            fn()
            _sync(device)
            samples.append(now() - start)
    return times


def _method_iteration(
    optimizer: Any, heads: torch.optim.Optimizer, draw_batch: Callable[[], tuple[Tensor, ...]],
    losses_of: Callable[..., Tensor],
) -> Callable[[], None]:
    """One training iteration: the closure draws a fresh batch per call (and can replay the last one)."""
    last: list[Tensor] = []

    def closure(same_batch: bool = False) -> Tensor:
        if not same_batch:
            last[:] = list(draw_batch())
        return losses_of(*last)

    def iteration() -> None:
        heads.zero_grad(set_to_none=True)
        optimizer.step(closure)
        heads.step()

    return iteration


def _balancer_iteration(
    balancer: Balancer, optimizer: torch.optim.Optimizer, draw_batch: Callable[[], tuple[Tensor, ...]],
    losses_of: Callable[..., Tensor],
) -> Callable[[], None]:
    """One iteration of the .grad-writing API: one batch, the balanced direction into .grad, Adam's step."""

    def iteration() -> None:
        optimizer.zero_grad(set_to_none=True)
        balancer.backward(losses_of(*draw_batch()))
        optimizer.step()

    return iteration


def _with_optimizer_step(floor: Callable[[], None], optimizer: torch.optim.Optimizer,
                         params: Sequence[Tensor]) -> Callable[[], None]:
    """The floor followed by ``optimizer.step()`` over ``params`` with (zero) gradients in place: the
    optimizer's own cost, which the balancer API pays after every backward (zero gradients keep the
    model as it is; Adam's arithmetic does not depend on the values)."""
    grads = [torch.zeros_like(p) for p in params]

    def floor_and_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        floor()
        for param, grad in zip(params, grads):
            param.grad = grad
        optimizer.step()

    return floor_and_step


def _steady_passes(iteration: Callable[[], None], counter: PassCounter, probes: int, label: str) -> Passes:
    """The passes of ``iteration`` once past its first call, which runs uncounted: a step's one-time work
    (FAMO's check for heads passed as shared parameters takes m backward passes on its first step) is
    not part of the iteration the floors stand for.  Then ``probes`` counted calls must agree."""
    iteration()
    return _count_passes(iteration, counter, probes, label)


def _count_passes(iteration: Callable[[], None], counter: PassCounter, probes: int, label: str) -> Passes:
    """The passes of ``iteration``, counted over ``probes`` calls (warm-ups) that must all agree."""
    seen: list[Passes] = []
    for _ in range(probes):
        with counter:
            iteration()
        seen.append(counter.passes)
    if any(passes != seen[0] for passes in seen):
        raise ValueError(f"{label}: the passes differ between iterations ({[describe_passes(p) for p in seen]}); "
                         "one floor cannot stand for them")
    return seen[0]


def measure_iterations(
    experiment: str, methods: list[str], batch_size: int, input_size: int, device: torch.device,
    warmup: int = 1, repeats: int = 3, backend: str | None = None, progress: bool = True,
    capturable: bool | None = None, clock: str = "auto", api: str = "step",
) -> list[dict[str, Any]]:
    """Rows (method, its passes, seconds per iteration median/min, ratios to both floors), the common floor first.

    Each method's first iteration runs uncounted (one-time work), the next ``max(warmup, 1)`` are
    warm-ups whose passes are counted (they
    must agree); then ``repeats`` timed rounds of: one iteration, one common floor, one own floor.
    ``capturable`` (default: as the trainer runs the optimizers, True on CUDA) is passed to every
    optimizer.  ``clock``: see :func:`resolve_clock`.  ``api``: ``"step"`` (``optimizer.step(closure)``)
    or ``"balancer"`` (``drmoo.Balancer`` + Adam, the floors + ``Adam.step``; see the module docstring).
    """
    if api not in APIS:
        raise ValueError(f"unknown api {api!r}; valid choices: {', '.join(APIS)}")
    clock = resolve_clock(clock, device)
    if capturable is None:
        capturable = device.type == "cuda"
    num_tasks = EXPERIMENTS[experiment]
    torch.manual_seed(0)
    model = MultiTaskResNet([10] * num_tasks).to(device).train()
    shared = model.shared_parameters()
    counter = PassCounter(shared)
    generator = torch.Generator(device="cpu").manual_seed(0)
    pool = [(torch.rand(batch_size, 3, input_size, input_size, generator=generator).to(device),
             torch.randint(0, 10, (batch_size, num_tasks), generator=generator).to(device))
            for _ in range(POOL_SIZE)]
    cycle = itertools.cycle(pool)

    def draw_batch() -> tuple[Tensor, Tensor]:
        return next(cycle)

    def losses_of(images: Tensor, labels: Tensor) -> Tensor:
        counter.forward()
        return torch.stack([F.cross_entropy(z, labels[:, i], reduction="none")
                            for i, z in enumerate(model(images))], dim=1)

    def floor_of(passes: Passes) -> Callable[[], None]:
        return lambda: replay_passes(passes, num_tasks, lambda: losses_of(*draw_batch()), shared)

    common = common_passes(num_tasks)
    every_param = [p for p in model.parameters() if p.requires_grad]
    floor_optimizer = torch.optim.Adam(every_param, lr=1e-3)
    if api == "balancer":
        plain_floor_of = floor_of

        def floor_of(passes: Passes) -> Callable[[], None]:
            return _with_optimizer_step(plain_floor_of(passes), floor_optimizer, every_param)

    common_floor = floor_of(common)
    (all_floor_times,) = _timed(common_floor, device=device, warmup=warmup, repeats=repeats, clock=clock)
    rows: list[dict[str, Any]] = []
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    variants = _variants(methods) if api == "step" else [(f"{m} (balancer + Adam)", m, {}) for m in methods]
    for label, method, overrides in tqdm(variants, desc="bench-iter", disable=not progress):
        model.load_state_dict(initial)
        hparams = method_hparams(method, {"capturable": capturable, **overrides})
        if api == "step":
            optimizer = create(method, shared, num_tasks, backend=backend, **hparams)
            heads = torch.optim.SGD(model.task_parameters(), lr=1e-2)
            iteration = _method_iteration(optimizer, heads, draw_batch, losses_of)
        else:
            balancer = Balancer(method, shared, num_tasks, backend=backend, **hparams)
            optimizer = balancer.algorithm
            iteration = _balancer_iteration(balancer, torch.optim.Adam(every_param, lr=1e-3), draw_batch, losses_of)
        passes = _steady_passes(iteration, counter, max(warmup, 1), label)
        if passes == common:  # its own floor is the common one: no need to time it twice
            times, floor_times = _timed(iteration, common_floor, device=device, warmup=0, repeats=repeats,
                                        clock=clock)
            own_times = floor_times
        else:
            times, floor_times, own_times = _timed(iteration, common_floor, floor_of(passes), device=device,
                                                   warmup=0, repeats=repeats, clock=clock)
        all_floor_times += floor_times
        median, own_median = statistics.median(times), statistics.median(own_times)
        rows.append({
            "method": label, "passes": describe_passes(passes),
            "forward": len(passes), "forward_no_grad": sum(not c.graph for c in passes),
            "backward": sum(c.backward for c in passes),
            "median_s": median, "min_s": min(times),
            "floor_median_s": statistics.median(floor_times),
            "ratio_to_floor": median / statistics.median(floor_times),
            "own_floor_median_s": own_median, "own_floor_min_s": min(own_times),
            "ratio_to_own_floor": median / own_median,
            "backend": optimizer.backend, "capturable": optimizer.capturable, "clock": clock,
        })
    floor_median = statistics.median(all_floor_times)
    floor_label = COMMON_FLOOR_LABEL if api == "step" else BALANCER_FLOOR_LABEL
    floor_row = {"method": floor_label, "passes": describe_passes(common), "forward": 1, "forward_no_grad": 0,
                 "backward": num_tasks, "median_s": floor_median, "min_s": min(all_floor_times),
                 "floor_median_s": floor_median, "ratio_to_floor": 1.0, "own_floor_median_s": floor_median,
                 "own_floor_min_s": min(all_floor_times), "ratio_to_own_floor": 1.0, "clock": clock}
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


def _clock_setting(rows: list[dict[str, Any]]) -> str:
    clocks = {r.get("clock") for r in rows}
    if clocks == {"cpu"}:
        return "this process's CPU seconds (the work done, whatever else the machine runs)"
    if clocks == {"wall"}:
        return "elapsed seconds, the device synchronised before and after each timed call"
    return "n/a"


def _capturable_setting(rows: list[dict[str, Any]]) -> str:
    settings = {str(r["capturable"]) for r in rows if "capturable" in r}
    return "/".join(sorted(settings)) or "n/a"


FIELDS = ["method", "passes", "forward", "forward_no_grad", "backward", "median_s", "min_s", "floor_median_s",
          "ratio_to_floor", "own_floor_median_s", "own_floor_min_s", "ratio_to_own_floor", "backend", "capturable",
          "clock"]


def write_outputs(rows: list[dict[str, Any]], out: Path, title: str, stem: str = "wallclock") -> Path:
    """``<stem>.csv``, ``<stem>.md`` and ``<stem>.png`` in ``out``; returns the markdown table's path."""
    make_directory(out)
    write_csv(out / f"{stem}.csv", rows, fieldnames=FIELDS)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(8.5, 4.0), constrained_layout=True)
    names = [r["method"] for r in rows]
    positions = range(len(rows))
    axis.bar(positions, [r["median_s"] for r in rows], color=["0.6"] + ["C0"] * (len(rows) - 1),
             label="iteration (median)")
    axis.scatter(positions, [r["own_floor_median_s"] for r in rows], marker="_", s=400, color="C3", zorder=3,
                 label="its own floor: the passes of its algorithm (median)")
    for index, row in enumerate(rows):
        axis.text(index, row["median_s"], f"{row['ratio_to_floor']:.2f}x\n{row['ratio_to_own_floor']:.2f}x own",
                  ha="center", va="bottom", fontsize=7)
    axis.set_xticks(list(positions), names)
    axis.set_ylabel("seconds per iteration")
    axis.set_title(title, fontsize=9)
    axis.tick_params(axis="x", rotation=30, labelsize=8)
    axis.margins(y=0.18)
    axis.legend(fontsize=7, loc="upper left")
    write_figure(fig, out / f"{stem}.png", dpi=120)
    plt.close(fig)
    lines = [
        f"### {title}", "",
        "× floor: the median iteration over the median of the common floor (1 fwd + m bwd) timed beside it. "
        "× own floor: over the median of the passes the method's algorithm does (counted on its warm-up "
        "iterations: forward passes, forward-only ones among them, backward passes through the shared "
        "parameters), replayed alone beside it. Batches come from a pool on the device (no host-side data work). "
        f"Optimizers built with capturable={_capturable_setting(rows)}. Clock: {_clock_setting(rows)}.", "",
        "| method | passes (its own floor) | s / iteration (median) | min | × floor | own floor (median) | min | "
        "× own floor |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['method']} | {r['passes']} | {r['median_s']:.4f} | {r['min_s']:.4f} | {r['ratio_to_floor']:.2f} | "
              f"{r['own_floor_median_s']:.4f} | {r['own_floor_min_s']:.4f} | {r['ratio_to_own_floor']:.2f} |"
              for r in rows]
    path = out / f"{stem}.md"
    write_text(path, "\n".join(lines) + "\n")
    return path
