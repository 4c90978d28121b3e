"""Step time and peak memory against the number of tasks m: plain training, drmoo's two Jacobians, TorchJD.

One command regenerates ``bench/results/tasks-scaling-cpu.{json,md}``::

    python bench/tasks_scaling.py                       # the committed grid (see --help for a smaller one)

and, on a GPU machine, ``bench/results/tasks-scaling-gpu-<device>.{json,md}``::

    python bench/tasks_scaling.py --device cuda --batch 256 --tasks 2 8 40 --rounds 20

Setting (issues 26, 35): torchvision's ResNet18 trunk (its classifier removed: z = the 512 pooled features)
with GroupNorm(32) -- and a second trunk with BatchNorm -- on 32 x 32 inputs, per-sample logistic losses,
SGD, one thread (CPU).  Two head layouts (``--heads``): m separate ``Linear(512, 1)`` heads joined by
``torch.cat`` (``separate``), and one shared ``Linear(512, m)`` (``shared``).  The default cells (batch, m):
batch 32 at m in {2, 3, 8, 40, 100, 200, 500}, and batch 256 at m = 40 (``--batch``/``--tasks`` give a
product instead); the variants that pass through the trunk once per task (parameters mode, TorchJD) run only
at batch 32 and m <= 40, and rep-grad (a loop over the tasks above z) up to m = 100 (``--all-cells``:
everywhere).  Variants, each one full training step (zero_grad,
forward, backward, optimizer step):

* ``plain``: ``losses.mean(0).sum().backward()`` (the floor: one forward, one backward);
* ``rep-grad``: a hand-written MGDA on the gradients w.r.t. the representation, as multi-task libraries write
  it (LibMTL's ``rep_grad``): the heads read ``z.detach().requires_grad_()``, one ``autograd.grad`` per task
  gives the m gradients w.r.t. it, Frank-Wolfe on their Gram gives the min-norm weights, and
  ``z.backward(sum_i w_i g_i)`` runs the trunk's one backward (:func:`rep_grad_backward`, about 20 lines):
  the baseline features mode is measured against at small m;
* ``parameters``: ``drmoo.Balancer("mgda", trunk, m)`` -- m backward passes through the trunk, J is m x n;
* ``features``: ``drmoo.Balancer("mgda", trunk, m, jacobian="features")``, ``backward(losses, features=z)``;
* ``features-double-clip``: the same with Double-Clip MGDA (the paper's method), and ``features-famo``,
  ``features-nashmtl``, ``features-modo``, ``features-sdmgrad``, ``features-double-loop``: every other method
  that has a features mode (MoCo refuses it), so that the target "features mode, every method, <= 1.3x
  plain" is measured for each (its own table: ratios and memory);
* ``features-unchecked`` (not in the default grid): ``features`` with ``check_trunk_gradients=False``, the
  lifted trunk gradients written without their NaN/Inf test -- as ``rep-grad`` writes them -- so that the two
  compare like for like;
* ``parameters-batched`` and ``parameters-loop`` (not in the default grid): ``parameters`` with the per-task
  passes vmapped into one (``jacobian_strategy = "batched"``, as TorchJD's autojac does) or run one by one
  (``"loop"``).  ``parameters`` itself takes the default, ``"auto"``: ``loop`` on the CPU, ``batched`` on a GPU,
  where it therefore runs what ``parameters-batched`` runs (``parameters-loop`` is the GPU's other strategy:
  m small passes, launch-bound);
* ``torchjd-mgda`` / ``torchjd-upgrad``: TorchJD's ``mtl_backward(losses, features=z)`` then
  ``jac_to_grad(trunk parameters, MGDA() / UPGrad())`` (the parameter-space Jacobian, like ``parameters``);
  left out, and the table says so, where TorchJD is not installed.

``--cuda-graph`` (a GPU) times every variant that a CUDA graph can capture three ways, in a table of its
own (``...-graph.{json,md}``): the eager step (synchronised wall clock), the host's time to issue it (the
clock read when the step's Python returns, before the synchronisation: the host-issue floor of an eager
step), and one replay of the whole step captured as a CUDA graph (the device's time alone).  plain and
``rep-grad`` are captured whole; drmoo's variants through :class:`drmoo.cuda_graph.GraphedStep` (its
optimizer's ``step(closure)`` with ``capturable=True``, the heads' SGD in the graph); TorchJD reads values
on the host inside its step and is left out.  ``--graph-stand-in`` runs the same code on the CPU with each
capture replaced by the eager step (the GPU check's dry run: it catches a crash or a skipped variant before
a GPU is spent on it; its times measure nothing).

On a GPU (``--device cuda``) every step is bracketed by ``torch.cuda.synchronize()``, and the memory
column is the peak of ``torch.cuda.max_memory_allocated()`` above what was allocated once the model was
built (in-process: the CUDA caching allocator counts exactly what a step allocates).

Time: the variants run *interleaved* with plain training in one process, after one warm-up step each:
a round is plain, v1, plain, v2, plain, ...; each step of a variant is divided by the mean of the two plain
steps around it, and the table gives the median of these ratios over the rounds (and their range).  On the
CPU a step's time is the process's CPU time (``time.process_time``, one thread): a loaded machine no longer
yields impossible ratios (wall clock gave 0.49x plain).  Load still slows memory and caches a little (beside
two training jobs a plain step took 0.34 s of CPU time, idle 0.31 s; TorchJD's step at m = 40 measured 341x
plain, idle 331x), so the table records the load averages at its start and end.  The CPU matters more: the
same grid measured TorchJD at 105x plain on the CPU of the 2026-11-27 table (plain steps of 0.065 s), so the
table names the CPU and its vector ISA.  On a GPU it is wall-clock time around the synchronised step.
Memory: each (trunk, heads, batch, m, variant) runs again in a fresh subprocess (build, 2 steps), which
reports the peak resident set size above the one it had once the model was built: the activations,
gradients, Jacobians and everything else a step allocates.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# "features" is MGDA's (the comparison with TorchJD's MGDA); the other features-* variants name their method.
FEATURES_METHODS = {"features": "mgda", "features-double-clip": "double-clip", "features-famo": "famo",
                    "features-nashmtl": "nashmtl", "features-modo": "modo", "features-sdmgrad": "sdmgrad",
                    "features-double-loop": "double-loop"}
VARIANTS = ("plain", "rep-grad", "parameters", *FEATURES_METHODS, "torchjd-mgda", "torchjd-upgrad")
TORCHJD_VARIANTS = ("torchjd-mgda", "torchjd-upgrad")  # measured where TorchJD is installed, else skipped
# Measurable with --variants, outside the default grid (the committed CPU table's command stays the same).
EXTRA_VARIANTS = ("parameters-batched", "parameters-loop", "features-unchecked")
# Features MGDA without the NaN/Inf test of the trunk's gradients (check_trunk_gradients=False): what the rep-grad
# baseline does, which tests nothing, so that the two compare like for like.
UNCHECKED = "features-unchecked"
# The parameters variants' jacobian_strategy: "parameters" takes the default ("auto": loop on the CPU, batched on a
# GPU -- there it runs what parameters-batched runs), the others pin one.
PARAMETERS_STRATEGIES = {"parameters": "auto", "parameters-batched": "batched", "parameters-loop": "loop"}
# The first table's columns (the comparison); every features variant goes to the second.
COMPARISON = ("plain", "rep-grad", "parameters", "parameters-loop", "parameters-batched", "features", UNCHECKED,
              "features-double-clip", "torchjd-mgda", "torchjd-upgrad")
# Variants a CUDA graph can capture (--cuda-graph): plain and rep-grad whole, drmoo's through GraphedStep.
# TorchJD reads values on the host inside its step (its MGDA solver), which capture forbids.
GRAPHABLE = ("plain", "rep-grad", *PARAMETERS_STRATEGIES, *FEATURES_METHODS, UNCHECKED)
REP_GRAD_ITERATIONS = 20  # Frank-Wolfe iterations of the rep-grad baseline's min-norm weights
TASKS = (2, 3, 8, 40, 100, 200, 500)
TRUNKS = ("groupnorm", "batchnorm")
# Not ResNet18: a two-layer stand-in (d = 512 as well) for the GPU check's dry run, where only the code paths count.
TINY = "tiny"
HEADS = ("separate", "shared")  # m Linear(512, 1) joined by torch.cat, or one Linear(512, m)
BATCH = 32
LARGE_BATCH = 256
IMAGE = 32
# The default grid's (batch, m) cells: every m at batch 32, and m = 40 at batch 256 (issue 35).
CELLS = tuple((BATCH, m) for m in TASKS) + ((LARGE_BATCH, 40),)
# Variants that take m passes through the trunk (or TorchJD's m x n Jacobian): only in the cells at batch 32
# and m <= 40 of the default grid (at m = 100 the Jacobian alone is 4.5 GB and a step takes seconds).
TRUNK_PER_TASK = (*PARAMETERS_STRATEGIES, "torchjd-mgda", "torchjd-upgrad")
PER_TASK_MAX = 40
# rep-grad's m gradient passes above z (a loop over the tasks, as LibMTL writes it): up to this m unless --all-cells
REP_GRAD_MAX = 100


def build(trunk_kind: str, num_tasks: int, seed: int = 0, device: str = "cpu",
          heads: str = "separate") -> tuple[Any, Any]:
    """(trunk, heads): ResNet18 with GroupNorm(32, c) or BatchNorm2d, fc removed; m Linear(512, 1) in a
    ModuleList (``heads="separate"``, joined by ``torch.cat``) or one Linear(512, m) (``"shared"``).
    ``trunk_kind="tiny"``: a strided convolution, GroupNorm, pooling and Linear(8, 512) (the dry run's)."""
    import torch

    torch.manual_seed(seed)
    trunk: Any
    if trunk_kind == TINY:
        trunk = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=4, padding=1), torch.nn.GroupNorm(4, 8),
                                    torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                    torch.nn.Linear(8, 512))
    else:
        import torchvision

        norm = (lambda channels: torch.nn.GroupNorm(32, channels)) if trunk_kind == "groupnorm" \
            else torch.nn.BatchNorm2d
        trunk = torchvision.models.resnet18(norm_layer=norm)
        trunk.fc = torch.nn.Identity()
    if heads == "separate":
        head_module: Any = torch.nn.ModuleList(torch.nn.Linear(512, 1) for _ in range(num_tasks))
    elif heads == "shared":
        head_module = torch.nn.Linear(512, num_tasks)
    else:
        raise ValueError(f"unknown head layout {heads!r}; valid: {', '.join(HEADS)}")
    return trunk.train().to(device), head_module.train().to(device)


def forward_of(variant: str, trunk: Any, heads: Any, num_tasks: int) -> Callable[[Any, Any], tuple[Any, Any]]:
    """``forward(x, y) -> (losses, z)`` for ``variant``: per-sample losses [B, m] (TorchJD: m task means).

    ``rep-grad``'s heads read ``z.detach().requires_grad_()``, returned as the second value in place of z
    (its backward needs both: :func:`rep_grad_backward` takes the trunk's z from ``rep.z``)."""
    import torch
    import torch.nn.functional as F

    separate = isinstance(heads, torch.nn.ModuleList)

    def logits_of(z: Any) -> Any:
        return torch.cat([head(z) for head in heads], dim=1) if separate else heads(z)

    def forward(x: Any, y: Any) -> tuple[Any, Any]:
        z = trunk(x)
        if variant.startswith("torchjd-"):  # one graph per task: mtl_backward runs a pass per task above z
            if not separate:
                logits = heads(z)
                return [F.binary_cross_entropy_with_logits(logits[:, task], y[:, task])
                        for task in range(num_tasks)], z
            return [F.binary_cross_entropy_with_logits(head(z)[:, 0], y[:, task])
                    for task, head in enumerate(heads)], z
        if variant == "rep-grad":
            rep = _Representation(z)
            return F.binary_cross_entropy_with_logits(logits_of(rep.detached), y, reduction="none"), rep
        return F.binary_cross_entropy_with_logits(logits_of(z), y, reduction="none"), z  # [B, m]

    return forward


class _Representation:
    """The trunk's output z and the detached leaf the heads read (the rep-grad baseline's split)."""

    def __init__(self, z: Any) -> None:
        self.z, self.detached = z, z.detach().requires_grad_()


def min_norm_weights(gram: Any, iterations: int = REP_GRAD_ITERATIONS) -> Any:
    """argmin of w^T G w over the simplex by Frank-Wolfe with exact line search; no host read."""
    import torch

    m = gram.shape[0]
    w = gram.new_full((m,), 1.0 / m)
    for _ in range(iterations):
        direction = torch.nn.functional.one_hot((gram @ w).argmin(), m).to(gram.dtype) - w
        slope, curvature = w @ gram @ direction, direction @ gram @ direction
        w = w + (-slope / curvature.clamp_min(torch.finfo(gram.dtype).tiny)).clamp(0, 1) * direction
    return w


def rep_grad_backward(losses: Any, rep: _Representation, head_parameters: list[Any]) -> None:
    """MGDA on the gradients w.r.t. the representation: the trunk gets sum_i w_i dL^i/dz, each head its task's."""
    import torch

    task_losses = losses.mean(0)
    grads = torch.stack([torch.autograd.grad(loss, rep.detached, retain_graph=True)[0] for loss in task_losses])
    flat = grads.flatten(1)
    weights = min_norm_weights(flat @ flat.T)
    task_losses.sum().backward(inputs=head_parameters)  # head i sees only task i's loss
    rep.z.backward(torch.einsum("i,i...->...", weights, grads))


def make_step(variant: str, trunk: Any, heads: Any, num_tasks: int, *,
              capturable: bool = False) -> Callable[[Any, Any], None]:
    """One training step of ``variant`` on a batch (x, y): zero_grad, forward, backward, SGD step.

    ``capturable``: zero the gradients in place (a CUDA graph's memory stays put) instead of dropping them.
    """
    import torch

    import drmoo

    shared = list(trunk.parameters())
    optimizer = torch.optim.SGD([*shared, *heads.parameters()], lr=1e-3)
    forward = forward_of(variant, trunk, heads, num_tasks)

    if variant == "plain":
        def backward(losses: Any, z: Any) -> None:
            losses.mean(0).sum().backward()
    elif variant == "rep-grad":
        head_parameters = list(heads.parameters())

        def backward(losses: Any, z: Any) -> None:
            rep_grad_backward(losses, z, head_parameters)
    elif variant in PARAMETERS_STRATEGIES or variant in FEATURES_METHODS or variant == UNCHECKED:
        method = FEATURES_METHODS.get(variant, "mgda")
        mode = "parameters" if variant in PARAMETERS_STRATEGIES else "features"
        with warnings.catch_warnings():  # the rate does not change a step's cost: no rate to choose here
            warnings.simplefilter("ignore", drmoo.optim.FeaturesRateWarning)
            balancer = drmoo.Balancer(drmoo.method_name(method), shared, num_tasks,
                                      jacobian="features" if mode == "features" else "parameters", lr=1e-3,
                                      check_trunk_gradients=variant != UNCHECKED)
        balancer.algorithm.jacobian_strategy = PARAMETERS_STRATEGIES.get(variant, "auto")

        def backward(losses: Any, z: Any) -> None:
            if mode == "features":
                balancer.backward(losses, features=z)
            else:
                balancer.backward(losses)
    elif variant in TORCHJD_VARIANTS:
        from torchjd.aggregation import MGDA, UPGrad
        from torchjd.autojac import jac_to_grad, mtl_backward

        aggregator = MGDA() if variant == "torchjd-mgda" else UPGrad()
        # One shared head: every task's pass to its head parameters crosses the same head graph, which the
        # first pass would free.
        retain = not isinstance(heads, torch.nn.ModuleList)

        def backward(losses: Any, z: Any) -> None:
            mtl_backward(losses, features=z, retain_graph=retain)  # the m per-task mean losses
            jac_to_grad(shared, aggregator)
    else:
        raise ValueError(f"unknown variant {variant!r}; valid: {', '.join((*VARIANTS, *EXTRA_VARIANTS))}")

    def step(x: Any, y: Any) -> None:
        optimizer.zero_grad(set_to_none=not capturable)
        losses, z = forward(x, y)
        backward(losses, z)
        optimizer.step()

    return step


def make_graphed_step(variant: str, trunk: Any, heads: Any, num_tasks: int, x: Any, y: Any, *,
                      stand_in: bool = False) -> Callable[[Any, Any], None]:
    """``variant``'s training step captured once as a CUDA graph (on the batch (x, y)), replayed per call.

    plain and rep-grad are captured whole (3 eager warm-up steps on a side stream first); drmoo's variants
    through :class:`drmoo.cuda_graph.GraphedStep` (their optimizer's ``step(closure)``, ``capturable=True``,
    the heads' SGD in the graph).  ``stand_in``: the same objects stepped eagerly (CPU, the dry run).
    A variant that cannot be captured raises ValueError naming why.
    """
    import torch

    import drmoo
    from drmoo.optim._features import OneBatchPerStep

    if variant not in GRAPHABLE:
        raise ValueError(f"{variant} cannot be captured as a CUDA graph (it reads values on the host in its step)")
    if variant in ("plain", "rep-grad"):
        step = make_step(variant, trunk, heads, num_tasks, capturable=True)
        return step if stand_in else _capture_whole(step, x, y)
    method = FEATURES_METHODS.get(variant, "mgda")
    mode = "parameters" if variant in PARAMETERS_STRATEGIES else "features"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", drmoo.optim.FeaturesRateWarning)
        optimizer = drmoo.optim.create(method, trunk.parameters(), num_tasks, jacobian=mode, lr=1e-3,
                                       capturable=True)
    optimizer.check_trunk_gradients = variant != UNCHECKED
    optimizer.jacobian_strategy = PARAMETERS_STRATEGIES.get(variant, "auto")
    head_sgd = torch.optim.SGD(heads.parameters(), lr=1e-3)
    forward = forward_of(variant, trunk, heads, num_tasks)

    def loss_fn(inputs: Any, targets: Any) -> Any:
        losses, z = forward(inputs, targets)
        return (losses, z) if mode == "features" else losses

    from drmoo.cuda_graph import GraphedStep, check_graphable

    if stand_in:
        try:  # GraphedStep's refusals (Double-Loop, ...), all but the one of the CPU device
            check_graphable(optimizer)
        except ValueError as error:
            if "CUDA device" not in str(error):
                raise

        def eager(inputs: Any, targets: Any) -> None:
            head_sgd.zero_grad(set_to_none=False)
            optimizer.step(OneBatchPerStep(lambda same_batch: loss_fn(inputs, targets), lambda: mode == "features"))
            head_sgd.step()
        return eager
    graphed = GraphedStep(optimizer, loss_fn, heads=head_sgd)

    def replay(inputs: Any, targets: Any) -> None:
        graphed.step_on(inputs, targets)

    for _ in range(graphed.warmup_steps + 1):  # the eager warm-up, then the capture
        replay(x, y)
    return replay


def _capture_whole(step: Callable[[Any, Any], None], x: Any, y: Any) -> Callable[[Any, Any], None]:
    """``step`` captured as one CUDA graph on static copies of (x, y); each call copies its batch in and replays."""
    import torch

    static_x, static_y = x.clone(), y.clone()
    side = torch.cuda.Stream(x.device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):  # torch's rule: warm up (workspaces, lazily built state) before capture
        for _ in range(3):
            step(static_x, static_y)
    torch.cuda.current_stream(x.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(static_x, static_y)

    def replay(inputs: Any, targets: Any) -> None:
        static_x.copy_(inputs, non_blocking=True)
        static_y.copy_(targets, non_blocking=True)
        graph.replay()

    return replay


def batch(num_tasks: int, seed: int = 1, *, size: int = BATCH, image: int = IMAGE,
          device: str = "cpu") -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 3, image, image, generator=generator)
    y = torch.randint(0, 2, (size, num_tasks), generator=generator).float()
    return x.to(device), y.to(device)


def _synchronize(device: str) -> None:
    """Wait for the device's queued work, so that a timer brackets the step's kernels, not their launch."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def time_interleaved(trunk_kind: str, num_tasks: int, variants: tuple[str, ...], rounds: int, *,
                     size: int = BATCH, image: int = IMAGE, device: str = "cpu",
                     heads: str = "separate") -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(seconds per step, ratios to plain) of each variant: one warm-up step each, then ``rounds`` rounds.

    A round runs plain, then each other variant with a plain step after it (plain, v1, plain, v2, plain,
    ...): each step of a variant gets the ratio of its time to the mean of the two plain steps around it,
    measured under the same load.  On the CPU a step's time is the process's CPU time
    (``time.process_time``: what the step computes, not the time other processes held the cores; one
    thread); on a GPU it is wall-clock time, the step bracketed by ``torch.cuda.synchronize()``.
    """
    on_gpu = device.startswith("cuda")
    clock = time.perf_counter if on_gpu else time.process_time
    steps = {}
    for variant in dict.fromkeys(("plain", *variants)):
        trunk, head_module = build(trunk_kind, num_tasks, device=device, heads=heads)
        steps[variant] = make_step(variant, trunk, head_module, num_tasks)
    x, y = batch(num_tasks, size=size, image=image, device=device)
    for step in steps.values():
        step(x, y)

    def timed(variant: str) -> float:
        _synchronize(device)
        start = clock()
        steps[variant](x, y)
        _synchronize(device)
        return clock() - start

    times: dict[str, list[float]] = {variant: [] for variant in steps}
    ratios: dict[str, list[float]] = {variant: [] for variant in steps if variant != "plain"}
    for _ in range(rounds):
        before = timed("plain")
        times["plain"].append(before)
        for variant in ratios:
            seconds = timed(variant)
            after = timed("plain")
            times[variant].append(seconds)
            times["plain"].append(after)
            ratios[variant].append(seconds / ((before + after) / 2))
            before = after
    return times, ratios


def time_graphed(trunk_kind: str, num_tasks: int, variants: tuple[str, ...], rounds: int, *,
                 size: int = BATCH, image: int = IMAGE, device: str = "cuda", heads: str = "separate",
                 stand_in: bool = False) -> dict[str, Any]:
    """Each capturable variant's eager step, its host-issue time and one replay of its captured graph.

    Per round and variant: an eager step timed from a drained queue to the end of its Python (``issue_s``)
    and to its synchronisation (``eager_s``), then one replay of the graph (``graph_s``).  ``graph_ratios``:
    a variant's replay over plain's replay in the same round.  Variants that cannot be captured are listed
    in ``skipped`` with the reason.  ``stand_in``: the CPU dry run's stand-ins (:func:`make_graphed_step`).
    """
    clock = time.process_time if stand_in else time.perf_counter
    skipped = {v: "reads values on the host inside its step (not capturable)" for v in variants if v not in GRAPHABLE}
    wanted = [v for v in dict.fromkeys(("plain", *variants)) if v in GRAPHABLE]
    x, y = batch(num_tasks, size=size, image=image, device=device)
    eager, graphed = {}, {}
    for variant in wanted:
        trunk, head_module = build(trunk_kind, num_tasks, device=device, heads=heads)
        eager[variant] = make_step(variant, trunk, head_module, num_tasks)
        eager[variant](x, y)  # warm-up
        trunk, head_module = build(trunk_kind, num_tasks, device=device, heads=heads)
        try:
            graphed[variant] = make_graphed_step(variant, trunk, head_module, num_tasks, x, y, stand_in=stand_in)
        except ValueError as error:  # GraphedStep refuses it (e.g. Double-Loop's host-drawn indices)
            skipped[variant] = str(error)
    times: dict[str, dict[str, list[float]]] = {key: {v: [] for v in graphed} for key in ("eager_s", "issue_s",
                                                                                            "graph_s")}
    graph_ratios: dict[str, list[float]] = {v: [] for v in graphed if v != "plain"}
    for _ in range(rounds):
        for variant in graphed:
            _synchronize(device)
            start = clock()
            eager[variant](x, y)
            times["issue_s"][variant].append(clock() - start)
            _synchronize(device)
            times["eager_s"][variant].append(clock() - start)
            start = clock()
            graphed[variant](x, y)
            _synchronize(device)
            times["graph_s"][variant].append(clock() - start)
        if "plain" in graphed:
            for variant in graph_ratios:
                graph_ratios[variant].append(times["graph_s"][variant][-1] / times["graph_s"]["plain"][-1])
    return {**times, "graph_ratios": graph_ratios, "skipped": skipped,
            "median_graph_s": {v: statistics.median(t) for v, t in times["graph_s"].items() if t}}


def graph_table(data: dict[str, Any]) -> str:
    """The markdown table of a ``--cuda-graph`` run: eager, host issue and graph replay per variant and cell."""
    stand_in = bool(data.get("stand_in"))
    lines = [f"# One training step, eager against one CUDA graph replay{' (CPU stand-in)' if stand_in else ''}", "",
             f"Regenerate: `{data['command']}`. Device: {data['machine']} (torch {data['torch']}); "
             f"{data['rounds']} rounds per cell. Per variant: the eager step (wall clock, synchronised), the host's "
             "time to issue it (the clock when its Python returns, before the synchronisation: the floor an eager "
             "step cannot go below however fast the device), and one replay of the whole step captured as a CUDA "
             "graph (the device's time alone); medians over the rounds, and the replay's ratio to plain's replay "
             "in the same round. plain and rep-grad are captured whole, drmoo's variants through "
             "`drmoo.cuda_graph.GraphedStep` (`step(closure)`, `capturable=True`).", ""]
    if stand_in:
        lines += ["**CPU stand-in** (the GPU check's dry run): every capture is replaced by the eager step; the "
                  "times measure nothing.", ""]
    for record in data["records"]:
        lines += [f"## {record['trunk']}, {record['heads']} heads, batch {record['batch']}, m = {record['m']}", "",
                  "| variant | eager | host issue | graph replay | replay / plain's replay |",
                  "|---|---:|---:|---:|---:|"]
        for variant, graph_times in record["graph_s"].items():
            ratios = record["graph_ratios"].get(variant)
            ratio = f"{statistics.median(ratios):.2f}x" if ratios else "1.00x" if variant == "plain" else "--"
            lines.append(f"| {variant} | {_ms(record['eager_s'][variant])} | {_ms(record['issue_s'][variant])} | "
                         f"{_ms(graph_times)} | {ratio} |")
        lines += [f"| {variant} | not captured: {why} | | | |" for variant, why in record["skipped"].items()]
        lines.append("")
    return "\n".join(lines)


def _ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:.2f} ms" if seconds else "--"


def cuda_peak_memory(trunk_kind: str, num_tasks: int, variant: str, *, size: int, image: int,
                     device: str, heads: str = "separate") -> tuple[int, int]:
    """(bytes allocated once the model is built, peak bytes allocated above that during 2 steps), on a GPU."""
    import torch

    trunk, head_module = build(trunk_kind, num_tasks, device=device, heads=heads)
    step = make_step(variant, trunk, head_module, num_tasks)
    x, y = batch(num_tasks, size=size, image=image, device=device)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(2):
        step(x, y)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del trunk, head_module, step, x, y
    torch.cuda.empty_cache()
    return base, peak


def resident_bytes() -> int:
    """The current resident set size of this process (Linux /proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def probe_memory(trunk_kind: str, num_tasks: int, variant: str, *, size: int = BATCH, image: int = IMAGE,
                 heads: str = "separate") -> tuple[int, int]:
    """(resident bytes once the model is built, peak resident bytes above it during 2 steps).

    The peak is sampled every millisecond by a thread (torch's kernels release the GIL) -- the
    process's own ``ru_maxrss`` is useless here: importing torch alone peaks higher than a step.
    """
    import threading

    trunk, head_module = build(trunk_kind, num_tasks, heads=heads)
    step = make_step(variant, trunk, head_module, num_tasks)
    x, y = batch(num_tasks, size=size, image=image)
    base = resident_bytes()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for _ in range(2):
        step(x, y)
    done.set()
    sampler.join()
    return base, max(peak[0], resident_bytes()) - base


def peak_memory(trunk_kind: str, num_tasks: int, variant: str, *, size: int = BATCH, image: int = IMAGE,
                heads: str = "separate") -> tuple[int, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "python"), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, __file__, "--probe-memory", trunk_kind, str(num_tasks), variant,
                          "--batch", str(size), "--image", str(image), "--heads", heads],
                         env=env, check=True, capture_output=True, text=True)
    base, peak = out.stdout.strip().splitlines()[-1].split()
    return int(base), int(peak)


def loadavg() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "?"


def cell_variants(variants: Sequence[str], size: int, num_tasks: int, *, all_cells: bool) -> tuple[str, ...]:
    """The variants measured in the (batch, m) cell: the per-task trunk passes (parameters, TorchJD) only at
    batch 32 and m <= 40 unless ``all_cells`` (seconds per step and GBs of Jacobian elsewhere)."""
    if all_cells:
        return tuple(variants)
    return tuple(v for v in variants if (v not in TRUNK_PER_TASK or (size == BATCH and num_tasks <= PER_TASK_MAX))
                 and (v != "rep-grad" or num_tasks <= REP_GRAD_MAX))


def table(data: dict[str, Any]) -> str:
    on_gpu = str(data.get("device", "cpu")).startswith("cuda")
    image = data.get("image", IMAGE)
    if on_gpu:
        setting = (f"Device: {data['machine']} (torch {data['torch']}, torchjd {data['torchjd']}); "
                   f"{data['rounds']} interleaved rounds per cell (plain, variant, plain, next variant, plain, ...), "
                   "each step's wall-clock time bracketed by `torch.cuda.synchronize()`; a variant's ratio is its "
                   "step's time over the mean of the two plain steps around it, the median over the rounds (the "
                   "range in brackets); then the step's memory: the peak of `torch.cuda.max_memory_allocated()` "
                   "above what was allocated once the model was built (2 steps). `parameters` takes the default "
                   "`jacobian_strategy` (auto), which on a GPU is `batched`: the strategy `parameters-batched` "
                   "pins; `parameters-loop` pins the per-task passes.")
    else:
        isa = f", {data['isa']}" if data.get("isa") else ""  # tables before the ISA was recorded lack it
        setting = (f"Machine: {data['machine']}{isa}, {data['cores']} cores, one thread "
                   f"(torch {data['torch']}, torchjd {data['torchjd']}); {data['rounds']} interleaved rounds per cell "
                   "(plain, variant, plain, next variant, plain, ...). Time = the process's CPU time "
                   "(`time.process_time`) of one step: what the step computes, not the time other processes held "
                   "the cores (a shared machine's load still slows memory and caches a little: see the load "
                   "averages below; ratios from another CPU differ more). A variant's ratio is its step's time "
                   "over the mean of the two plain steps around it, the median over the rounds (the range in "
                   "brackets); then, where measured, the step's memory: the peak resident set size above the "
                   "one the process had once the model was built "
                   "(a fresh process per cell, 2 steps, sampled every millisecond).")
    lines = [
        f"# Step time and peak memory against the number of tasks ({'GPU' if on_gpu else 'CPU'})",
        "",
        f"Regenerate: `{data['command']}`. {setting}",
        "",
        ("Host load" if on_gpu else "Load") + " while measuring (1/5/15-minute load averages): "
        f"start {data['load_start']}, end {data['load_end']}.",
        "",
    ]
    if data.get("left_out"):
        lines += [f"Left out: {', '.join(data['left_out'])} (TorchJD is not installed here).", ""]
    comparison = [v for v in data["variants"] if v in COMPARISON]
    every_method = [v for v in data["variants"] if v in FEATURES_METHODS]
    sections: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for record in data["records"]:
        key = (record["trunk"], record.get("heads", "separate"), record.get("batch", data.get("batch", BATCH)))
        sections.setdefault(key, []).append(record)
    for (trunk_kind, heads, size), records in sections.items():
        head_text = ("m separate Linear(512, 1) heads joined by torch.cat" if heads == "separate"
                     else "one shared Linear(512, m) head")
        columns = [v for v in comparison if any(v in r["median_s"] for r in records)]
        model = {"groupnorm": "ResNet18 with GroupNorm", "batchnorm": "ResNet18 with BatchNorm"}.get(
            trunk_kind, "the two-layer stand-in trunk (dry run)")
        lines += [f"## {model}, {image} px, batch {size}, {head_text}", "",
                  "Each cell: median seconds per step (the median ratio to plain [its range over the rounds]), "
                  "peak memory of the step above the built model where measured.", "",
                  "| m | " + " | ".join(columns) + " |",
                  "|---:|" + "---:|" * len(columns)]
        lines += [f"| {record['m']} | " + " | ".join(_cell(record, v, seconds=True) for v in columns) + " |"
                  for record in records]
        lines.append("")
        lines += _against_rep_grad(records, [v for v in columns if v.startswith("features")])
        methods = [v for v in every_method if any(v in r["median_s"] for r in records)]
        if len(methods) > 2:
            lines += ["Features mode, every method that has it (MoCo refuses it), measured in the same rounds: "
                      "each cell is the median ratio to plain [its range], and the step's peak memory.", "",
                      "| m | " + " | ".join(FEATURES_METHODS[v] for v in methods) + " |",
                      "|---:|" + "---:|" * len(methods)]
            lines += [f"| {record['m']} | " + " | ".join(_cell(record, v, seconds=False) for v in methods) + " |"
                      for record in records]
            lines.append("")
    return "\n".join(lines)


def _against_rep_grad(records: list[dict[str, Any]], variants: list[str]) -> list[str]:
    """The features variants against rep-grad, round by round: each round's ratio of the two steps' ratios to
    their plain steps (both measured in that round), the median [range] over the rounds; [] without rep-grad."""
    measured = [r for r in records if "rep-grad" in r.get("ratios", {})]
    if not variants or not measured:
        return []
    lines = ["Against rep-grad, round by round (each round's features ratio over its rep-grad ratio; the median "
             "[range] over the rounds):", "",
             "| m | " + " | ".join(variants) + " |", "|---:|" + "---:|" * len(variants)]
    for record in measured:
        cells = []
        for variant in variants:
            ours, theirs = record["ratios"].get(variant), record["ratios"]["rep-grad"]
            if not ours:
                cells.append("--")
                continue
            paired = [a / b for a, b in zip(ours, theirs)]
            cells.append(f"{statistics.median(paired):.3f}x [{min(paired):.2f}-{max(paired):.2f}]")
        lines.append(f"| {record['m']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _cell(record: dict[str, Any], variant: str, *, seconds: bool) -> str:
    """One variant's cell of one record: [seconds,] median ratio to plain [range], memory."""
    if variant not in record["median_s"]:
        return "--"
    median = record["median_s"][variant]
    memory = record.get("step_peak_rss_gb", {}).get(variant)
    mem = f", {memory:.2f} GB" if memory is not None else ""
    if variant == "plain":
        return f"{median:.3f} s{mem}"
    ratios = record["ratios"][variant]
    ratio = f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
    if seconds:
        return f"{median:.3f} s ({ratio}){mem}"
    return f"{ratio}{mem}"


def installed_version(package: str) -> str | None:
    """The installed version of ``package``, or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, nargs="+", default=None,
                        help=f"m values (with --batch: every pair; default: the cells {CELLS})")
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes (see --tasks)")
    parser.add_argument("--trunks", nargs="+", default=list(TRUNKS), choices=(*TRUNKS, TINY),
                        help=f"ResNet18 with GroupNorm / BatchNorm ({TINY}: a two-layer stand-in for dry runs)")
    parser.add_argument("--heads", nargs="+", default=list(HEADS), choices=HEADS)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=(*VARIANTS, *EXTRA_VARIANTS))
    parser.add_argument("--all-cells", action="store_true",
                        help=f"run {', '.join(TRUNK_PER_TASK)} in every cell (default: batch {BATCH}, m <= "
                             f"{PER_TASK_MAX} only)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu (the committed table), or cuda on a GPU machine")
    parser.add_argument("--image", type=int, default=IMAGE, help=f"image side in pixels (default {IMAGE})")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time each capturable variant eager, its host issue and one CUDA graph replay "
                             "(a table of its own, ...-graph.{json,md})")
    parser.add_argument("--graph-stand-in", action="store_true",
                        help="with --cuda-graph on the CPU: each capture replaced by the eager step (a dry run of "
                             "the code path; the times measure nothing)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output path without suffix (default bench/results/tasks-scaling-cpu, or "
                             "tasks-scaling-gpu-<device> with --device cuda)")
    parser.add_argument("--summary-only", type=Path, metavar="JSON", help="only rebuild the .md table of this JSON")
    parser.add_argument("--probe-memory", nargs=3, metavar=("TRUNK", "M", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.summary_only is not None:
        args.summary_only.with_suffix(".md").write_text(table(json.loads(args.summary_only.read_text())) + "\n")
        return
    import torch

    on_gpu = args.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device on this machine")
    if not on_gpu and args.device != "cpu":
        parser.error(f"--device must be cpu or cuda[:index], not {args.device!r}")
    if args.cuda_graph and not on_gpu and not args.graph_stand_in:
        parser.error("--cuda-graph needs --device cuda (on the CPU add --graph-stand-in for a dry run)")
    if args.graph_stand_in and (on_gpu or not args.cuda_graph):
        parser.error("--graph-stand-in is the CPU dry run of --cuda-graph: use it with --cuda-graph --device cpu")
    if args.tasks is None and args.batch is None:
        cells = list(CELLS)
    else:
        cells = [(size, m) for size in (args.batch or [BATCH]) for m in (args.tasks or list(TASKS))]
    if any(size < 1 for size, _ in cells) or args.image < 32:
        parser.error("--batch must be at least 1 and --image at least 32 (ResNet18 halves it five times)")
    out_given = args.out  # named in the Regenerate line when given: the command then rewrites the same files
    if args.out is None:
        slug = "cpu"
        if on_gpu:
            slug = "gpu-" + "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name(args.device).lower())
        args.out = RESULTS / f"tasks-scaling-{slug}{'-graph' if args.cuda_graph else ''}"
    torch.set_num_threads(1)
    if args.probe_memory:
        trunk_kind, m, variant = args.probe_memory
        print(*probe_memory(trunk_kind, int(m), variant, size=cells[0][0], image=args.image, heads=args.heads[0]))
        return
    torchjd = installed_version("torchjd")
    variants = list(args.variants)
    if torchjd is None and any(v in TORCHJD_VARIANTS for v in variants):
        print("torchjd is not installed: its variants are left out", flush=True)
        variants = [v for v in variants if v not in TORCHJD_VARIANTS]
    given = {"tasks": args.tasks, "batch": args.batch, "trunks": args.trunks, "heads": args.heads,
             "variants": args.variants, "rounds": [args.rounds], "device": [args.device], "image": [args.image]}
    defaults = {"tasks": None, "batch": None, "trunks": list(TRUNKS), "heads": list(HEADS), "variants": list(VARIANTS),
                "rounds": [3], "device": ["cpu"], "image": [IMAGE]}
    flags = [f"--{key} {' '.join(map(str, value))}" for key, value in given.items() if value != defaults[key]]
    flags += ["--all-cells"] * args.all_cells + ["--no-memory"] * args.no_memory + ["--cuda-graph"] * args.cuda_graph
    flags += ["--graph-stand-in"] * args.graph_stand_in
    flags += [f"--out {out_given}"] * (out_given is not None)
    data: dict[str, Any] = {
        # the grid's arguments, and --out where it was given
        "command": " ".join(["python bench/tasks_scaling.py", *flags]),
        "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "isa": torch.backends.cpu.get_cpu_capability(),  # AVX2 / AVX512: a ratio depends on the kernels it picks
        "torch": torch.__version__, "torchjd": torchjd or "not installed", "device": args.device, "image": args.image,
        "clock": "wall, synchronized" if on_gpu else "process CPU time",
        "rounds": args.rounds, "trunks": args.trunks, "heads": args.heads, "variants": variants,
        "left_out": [v for v in args.variants if v not in variants], "cuda_graph": args.cuda_graph,
        "stand_in": args.graph_stand_in, "cells": cells, "load_start": loadavg(), "records": [],
    }
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
        data["machine"] = names[0] if names else data["machine"]
    except OSError:
        pass
    if on_gpu:
        data["machine"] = f"{torch.cuda.get_device_name(args.device)} (CUDA {torch.version.cuda})"
    for trunk_kind in args.trunks:
        for heads in args.heads:
            for size, m in cells:
                here = cell_variants(variants, size, m, all_cells=args.all_cells)
                if args.cuda_graph:
                    graphed = time_graphed(trunk_kind, m, here, args.rounds, size=size, image=args.image,
                                           device=args.device, heads=heads, stand_in=args.graph_stand_in)
                    data["records"].append({"trunk": trunk_kind, "heads": heads, "batch": size, "m": m, **graphed})
                    print(trunk_kind, heads, size, m, {v: f"{statistics.median(r):.2f}x"
                                                       for v, r in graphed["graph_ratios"].items() if r}, flush=True)
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
                    args.out.with_suffix(".md").write_text(graph_table(data) + "\n")
                    continue
                times, ratios = time_interleaved(trunk_kind, m, here, args.rounds, size=size, image=args.image,
                                                 device=args.device, heads=heads)
                record = {"trunk": trunk_kind, "heads": heads, "batch": size, "m": m, "times_s": times,
                          "ratios": ratios, "median_s": {v: statistics.median(t) for v, t in times.items()},
                          "step_peak_rss_gb": {}, "load": loadavg()}
                if not args.no_memory:
                    record["model_rss_gb"] = {}
                    for variant in times:
                        if on_gpu:
                            base, peak = cuda_peak_memory(trunk_kind, m, variant, size=size, image=args.image,
                                                          device=args.device, heads=heads)
                        else:
                            base, peak = peak_memory(trunk_kind, m, variant, size=size, image=args.image, heads=heads)
                        record["model_rss_gb"][variant] = base / 1e9
                        record["step_peak_rss_gb"][variant] = peak / 1e9
                data["records"].append(record)
                print(trunk_kind, heads, size, m, {v: f"{statistics.median(r):.2f}x" for v, r in ratios.items()},
                      flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                data["load_end"] = loadavg()
                args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
                args.out.with_suffix(".md").write_text(table(data) + "\n")


if __name__ == "__main__":
    main()
