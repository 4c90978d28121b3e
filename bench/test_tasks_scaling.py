"""pytest-benchmark form of ``bench/tasks_scaling.py``: one training step per (trunk, m, variant).

By default (``python bench/run.py -k tasks``) a small grid -- the GroupNorm ResNet18 trunk, m in {2, 40},
plain / ``jacobian="parameters"`` / ``jacobian="features"`` -- so that the kernel benchmarks stay
affordable; ``DRMOO_BENCH_TASKS_GRID=full`` runs the issue's grid (both trunks, m in {2, 3, 8, 40},
TorchJD included).  The committed table ``bench/results/tasks-scaling-cpu.md`` comes from the script,
which interleaves the variants (same-load ratios) and measures the step's memory.

Each record's ``extra_info``: ``op`` = ``tasks_step``, ``backend`` = the variant, ``trunk``, ``m`` and
``ratio_to_plain`` (this variant's minimum over plain's, plain measured first in the same session).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

_SPEC = importlib.util.spec_from_file_location("tasks_scaling", Path(__file__).with_name("tasks_scaling.py"))
assert _SPEC is not None and _SPEC.loader is not None
scaling = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(scaling)

FULL = os.environ.get("DRMOO_BENCH_TASKS_GRID") == "full"
TRUNKS = scaling.TRUNKS if FULL else ("groupnorm",)
TASKS = scaling.TASKS if FULL else (2, 40)
VARIANTS = scaling.VARIANTS if FULL else ("plain", "parameters", "features")
_PLAIN: dict[tuple[str, int], float] = {}


@pytest.mark.parametrize("variant", VARIANTS)  # plain first: the ratios need it
@pytest.mark.parametrize("tasks", TASKS)
@pytest.mark.parametrize("trunk", TRUNKS)
def test_tasks_step(benchmark: Any, trunk: str, tasks: int, variant: str) -> None:
    torch.set_num_threads(1)
    model, heads = scaling.build(trunk, tasks)
    step = scaling.make_step(variant, model, heads, tasks)
    x, y = scaling.batch(tasks)
    benchmark.pedantic(step, args=(x, y), rounds=3, warmup_rounds=1, iterations=1)
    fastest = benchmark.stats.stats.min
    if variant == "plain":
        _PLAIN[(trunk, tasks)] = fastest
    plain = _PLAIN.get((trunk, tasks))
    benchmark.extra_info.update(op="tasks_step", backend=variant, trunk=trunk, m=tasks,
                                ratio_to_plain=None if plain is None else fastest / plain)
