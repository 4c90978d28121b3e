"""bench-iter: its rows, the passes it counts for each method's own floor, the floor's replay, its outputs.

The expected passes are written out from each optimizer's docstring (the algorithm it states), so
that a step doing more or fewer passes than its algorithm -- or a counter that miscounts -- fails.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from drmoo.experiments import wallclock
from drmoo.experiments.multimnist import method_hparams
from drmoo.experiments.wallclock import ModelCall, PassCounter, describe_passes, replay_passes
from drmoo.models import MultiTaskResNet
from drmoo.optim import available, create


def _expected(method: str, overrides: dict[str, Any], m: int) -> tuple[ModelCall, ...]:
    """Each method's passes per iteration as its docstring states them (m tasks, paper settings)."""
    with_jacobian = ModelCall(graph=True, backward=m)  # a batch with its graph and m backward passes
    forward_only = ModelCall(graph=False, backward=0)
    if method == "double-clip":
        # Algorithm 2: batch xi forward only (steps 1-2), batch xi_bar with m backward (step 3);
        # resample=False reuses the first batch, drawn with its graph.
        return (with_jacobian,) if overrides.get("resample") is False else (forward_only, with_jacobian)
    if method == "double-loop":
        # Algorithm 1: D forward-only inner batches (lines 3-6), then Y, Y_bar, Y_tilde (lines 9-11).
        return (forward_only,) * method_hparams(method)["inner_steps"] + (with_jacobian,) * 3
    if method in ("modo", "sdmgrad"):
        return (with_jacobian,) * 3  # three independent batches, 3m backward passes
    if method in ("mgda", "moco"):
        return (with_jacobian,)
    if method == "nashmtl":
        return (with_jacobian,)  # update_every = 1 (the paper's): every step solves for the weights
    if method == "famo":
        # one batch with ONE combined backward, then a forward-only re-evaluation of the same batch
        return (ModelCall(graph=True, backward=1), forward_only)
    raise AssertionError(f"no expectation written for {method}")


class _Problem:
    """A tiny ResNet multi-task problem with a pass counter wired into its loss function."""

    def __init__(self, num_tasks: int, batch_size: int = 2, input_size: int = 16) -> None:
        torch.manual_seed(0)
        self.num_tasks = num_tasks
        self.model = MultiTaskResNet([10] * num_tasks).train()
        self.shared = self.model.shared_parameters()
        self.counter = PassCounter(self.shared)
        generator = torch.Generator().manual_seed(0)
        self.batches = [(torch.rand(batch_size, 3, input_size, input_size, generator=generator),
                         torch.randint(0, 10, (batch_size, num_tasks), generator=generator)) for _ in range(3)]
        self.drawn = 0

    def draw_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.drawn += 1
        return self.batches[self.drawn % len(self.batches)]

    def losses_of(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.counter.forward()
        return torch.stack([F.cross_entropy(z, labels[:, i], reduction="none")
                            for i, z in enumerate(self.model(images))], dim=1)


@pytest.mark.parametrize("num_tasks", [2, 3])
@pytest.mark.parametrize(("label", "method", "overrides"), wallclock._variants(list(available())),
                         ids=lambda value: value if isinstance(value, str) else None)
def test_counted_passes_are_those_of_each_methods_algorithm(label: str, method: str, overrides: dict[str, Any],
                                                            num_tasks: int) -> None:
    problem = _Problem(num_tasks)
    optimizer = create(method, problem.shared, num_tasks, **method_hparams(method, overrides))
    heads = torch.optim.SGD(problem.model.task_parameters(), lr=1e-2)
    iteration = wallclock._method_iteration(optimizer, heads, problem.draw_batch, problem.losses_of)
    # The first step equals the steady state, except for FAMO's one-time check for heads passed as
    # shared parameters (m more backward passes over its batch's graph): bench-iter leaves it uncounted.
    first = wallclock._count_passes(iteration, problem.counter, 1, label)
    expected = _expected(method, overrides, num_tasks)
    if method == "famo":
        assert first == (ModelCall(graph=True, backward=1 + num_tasks), *expected[1:])
    else:
        assert first == expected
    passes = wallclock._steady_passes(iteration, problem.counter, 2, label)
    assert passes == expected
    # the counter is off outside `with`: no hook left behind, nothing recorded
    iteration()
    assert problem.counter.passes == passes and not problem.counter.active


@pytest.mark.parametrize("passes", [
    (ModelCall(True, 2),),
    (ModelCall(False, 0), ModelCall(True, 3)),
    (ModelCall(True, 1), ModelCall(False, 0)),
    (ModelCall(False, 0),) * 2 + (ModelCall(True, 3),) * 2,
])
def test_the_floor_replays_exactly_the_passes_it_is_given(passes: tuple[ModelCall, ...]) -> None:
    problem = _Problem(3)
    with problem.counter:
        replay_passes(passes, 3, lambda: problem.losses_of(*problem.draw_batch()), problem.shared)
    assert problem.counter.passes == passes


def test_a_backward_is_attributed_to_the_forward_whose_graph_it_runs_over() -> None:
    problem = _Problem(2)
    with problem.counter:
        kept = problem.losses_of(*problem.draw_batch())
        with torch.no_grad():
            problem.losses_of(*problem.draw_batch())  # a forward-only pass in between (FAMO's order, reversed)
        torch.autograd.grad(kept.sum(), problem.shared)
        # a backward restricted to the heads does not reach the shared parameters: not a trunk pass
        again = problem.losses_of(*problem.draw_batch())
        torch.autograd.backward(again.sum(), inputs=problem.model.task_parameters())
    assert problem.counter.passes == (ModelCall(True, 1), ModelCall(False, 0), ModelCall(True, 0))
    assert describe_passes(problem.counter.passes) == "3 fwd (1 no-grad) + 1 bwd"


def test_passes_that_vary_between_iterations_are_refused() -> None:
    problem = _Problem(2)
    optimizer = create("nashmtl", problem.shared, 2, update_every=2)  # m backward, then 1 combined one
    heads = torch.optim.SGD(problem.model.task_parameters(), lr=1e-2)
    iteration = wallclock._method_iteration(optimizer, heads, problem.draw_batch, problem.losses_of)
    expected = r"nash: the passes differ between iterations .*1 fwd \+ 2 bwd.*1 fwd \+ 1 bwd"
    with pytest.raises(ValueError, match=expected):
        wallclock._count_passes(iteration, problem.counter, 2, "nash")


def test_rows_carry_both_floors_and_double_clip_is_measured_with_and_without_the_second_batch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    created: list[tuple[str, bool | None]] = []
    real_create = wallclock.create

    def spy(method, params, num_tasks, **kwargs):
        optimizer = real_create(method, params, num_tasks, **kwargs)
        created.append((method, optimizer.param_groups[0].get("resample")))
        return optimizer

    monkeypatch.setattr(wallclock, "create", spy)
    rows = wallclock.measure_iterations("multimnist2", ["double-clip", "mgda"], batch_size=2, input_size=16,
                                        device=torch.device("cpu"), warmup=0, repeats=2, progress=False)
    assert [r["method"] for r in rows] == ["floor (1 fwd + m bwd)", "double-clip", "double-clip (resample=False)",
                                           "mgda"]
    # The paper's setting draws two batches; the extra row really runs the one-batch variant.
    assert created == [("double-clip", True), ("double-clip", False), ("mgda", None)]
    assert [r["passes"] for r in rows] == ["1 fwd + 2 bwd", "2 fwd (1 no-grad) + 2 bwd", "1 fwd + 2 bwd",
                                           "1 fwd + 2 bwd"]
    for row in rows:
        assert row["median_s"] >= row["min_s"] > 0 and row["own_floor_median_s"] >= row["own_floor_min_s"] > 0
        assert row["ratio_to_floor"] == pytest.approx(row["median_s"] / row["floor_median_s"])
        assert row["ratio_to_own_floor"] == pytest.approx(row["median_s"] / row["own_floor_median_s"])
    assert {r["clock"] for r in rows} == {"cpu"}  # auto: CPU seconds on a CPU device
    # MGDA's passes are the common floor's: its own floor is the common floor timed beside it
    assert rows[3]["own_floor_median_s"] == rows[3]["floor_median_s"]

    md = wallclock.write_outputs(rows, tmp_path, "title", stem="gpu-some-device-b2")
    assert md == tmp_path / "gpu-some-device-b2.md"
    assert {p.name for p in tmp_path.iterdir()} == {f"gpu-some-device-b2.{ext}" for ext in ("csv", "md", "png")}
    table = md.read_text()
    assert "| double-clip | 2 fwd (1 no-grad) + 2 bwd | " in table and "× own floor |" in table
    assert "capturable=False" in table  # as the trainer runs them on a CPU
    assert "Clock: this process's CPU seconds" in table
    with (tmp_path / "gpu-some-device-b2.csv").open(newline="") as handle:
        saved = list(csv.DictReader(handle))
    assert [r["method"] for r in saved] == [r["method"] for r in rows]
    assert float(saved[1]["ratio_to_own_floor"]) == pytest.approx(rows[1]["ratio_to_own_floor"])


def test_drmoo_report_shows_the_cpu_and_every_gpu_table_of_a_directory(tmp_path: Path) -> None:
    from drmoo.experiments.results_report import collect

    row = {"method": "floor (1 fwd + m bwd)", "passes": "1 fwd + 2 bwd", "median_s": 0.5, "min_s": 0.4,
           "ratio_to_floor": 1.0, "own_floor_median_s": 0.5, "own_floor_min_s": 0.4, "ratio_to_own_floor": 1.0,
           "backend": "cuda", "capturable": True}
    for stem in ("wallclock", "gpu-nvidia-h200-b256", "gpu-nvidia-h200-b32"):
        wallclock.write_outputs([row], tmp_path, f"title of {stem}", stem=stem)
    sections, skipped = collect([tmp_path])
    assert not skipped
    assert [s.tables[0].splitlines()[0] for s in sections] == [
        "### title of wallclock", "### title of gpu-nvidia-h200-b256", "### title of gpu-nvidia-h200-b32"]
    assert [[p.name for p in s.images] for s in sections] == [
        ["wallclock.png"], ["gpu-nvidia-h200-b256.png"], ["gpu-nvidia-h200-b32.png"]]


def test_output_names(monkeypatch: pytest.MonkeyPatch) -> None:
    assert wallclock.output_stem(torch.device("cpu"), 8) == "wallclock"  # the committed CPU layout
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert wallclock.output_stem(torch.device("cuda"), 256) == "gpu-nvidia-h200-b256"


def test_optimizers_are_built_capturable_as_the_trainer_builds_them_unless_told() -> None:
    def run(**kwargs: Any) -> list[dict[str, Any]]:
        return wallclock.measure_iterations("multimnist2", ["moco"], batch_size=2, input_size=16,
                                            device=torch.device("cpu"), warmup=0, repeats=1, progress=False, **kwargs)

    assert run()[1]["capturable"] is False  # the trainer: capturable on CUDA only
    assert run(capturable=True)[1]["capturable"] is True


def test_clock_choice() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert wallclock.resolve_clock("auto", cpu) == "cpu" and wallclock.resolve_clock("auto", cuda) == "wall"
    assert wallclock.resolve_clock("wall", cpu) == "wall"
    with pytest.raises(ValueError, match="does not see the work of a cuda device"):
        wallclock.resolve_clock("cpu", cuda)
    with pytest.raises(ValueError, match="unknown clock 'gpu'"):
        wallclock.resolve_clock("gpu", cpu)
    # the cpu clock counts work, not waiting: a sleep costs (almost) nothing on it
    import time

    (wall,) = wallclock._timed(lambda: time.sleep(0.05), device=cpu, warmup=0, repeats=1, clock="wall")
    (cpu_seconds,) = wallclock._timed(lambda: time.sleep(0.05), device=cpu, warmup=0, repeats=1, clock="cpu")
    assert wall[0] >= 0.05 and cpu_seconds[0] < 0.05


def test_the_balancer_api_is_timed_against_floors_that_end_with_adams_step() -> None:
    rows = wallclock.measure_iterations("multimnist2", ["double-clip", "modo"], batch_size=2, input_size=16,
                                        device=torch.device("cpu"), warmup=0, repeats=2, progress=False,
                                        api="balancer")
    assert [r["method"] for r in rows] == ["floor (1 fwd + m bwd + Adam.step)", "double-clip (balancer + Adam)",
                                           "modo (balancer + Adam)"]
    # One batch each (the single-batch form): Double-Clip's passes are the floor's, and so are MoDo's:
    # its three draws are one graph at one eta, so its Jacobian is computed once.
    assert [r["passes"] for r in rows] == ["1 fwd + 2 bwd", "1 fwd + 2 bwd", "1 fwd + 2 bwd"]
    assert all(r["median_s"] > 0 and r["ratio_to_floor"] > 0 for r in rows)
    with pytest.raises(ValueError, match="unknown api 'adam'"):
        wallclock.measure_iterations("multimnist2", ["mgda"], batch_size=2, input_size=16,
                                     device=torch.device("cpu"), api="adam")
