"""Budgets on what one training step asks of the device: aten ops and host syncs (bench/launches.py).

The counts are exact (a ``TorchDispatchMode`` counting the ops a step dispatches, bench/op_count.py), so
they can be pinned like any other output: a change that adds host reads or launches to a step fails here
instead of showing up, much later, as a slower GPU step.  The budgets are the counts measured when they
were set (small trunk, m = 8, separate heads, the strategy a new optimizer picks), with headroom on the ops
(10% + 10) for refactors that move a few ops around, none on the syncs: every host sync is a stall on a GPU.
Features mode's budgets are those of ``jacobian_strategy="auto"`` (separate heads: the rows from one pass).
Lower a budget when a change lowers a count (the table is ``python bench/launches.py``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
NUM_TASKS = 8


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


launches = _load("drmoo_bench_launches", BENCH / "launches.py")
op_count = _load("drmoo_bench_op_count", BENCH / "op_count.py")

# (ops, syncs) of one steady-state step, measured at m = 8 (bench/results/launches.md, small trunk).
PLAIN_OPS = 90
BUDGETS: dict[tuple[str, str, str], tuple[int, int]] = {
    ("mgda", "features", "balancer"): (263, 5),
    ("double-clip", "features", "balancer"): (301, 6),
    ("double-loop", "features", "balancer"): (422, 16),
    ("famo", "features", "balancer"): (299, 5),
    ("modo", "features", "balancer"): (316, 11),
    ("nashmtl", "features", "balancer"): (2087, 5),
    ("sdmgrad", "features", "balancer"): (449, 11),
    ("mgda", "features", "step"): (259, 5),
    ("double-clip", "features", "step"): (314, 6),
    ("double-loop", "features", "step"): (503, 16),
    ("famo", "features", "step"): (295, 5),
    ("modo", "features", "step"): (330, 9),
    ("nashmtl", "features", "step"): (2083, 5),
    ("sdmgrad", "features", "step"): (463, 9),
    ("mgda", "parameters", "balancer"): (683, 4),
    ("double-clip", "parameters", "balancer"): (721, 5),
    ("double-loop", "parameters", "balancer"): (1253, 15),
    ("famo", "parameters", "balancer"): (294, 4),
    ("modo", "parameters", "balancer"): (512, 10),
    ("moco", "parameters", "balancer"): (693, 4),
    ("nashmtl", "parameters", "balancer"): (2507, 4),
    ("sdmgrad", "parameters", "balancer"): (645, 10),
    ("mgda", "parameters", "step"): (674, 4),
    ("double-clip", "parameters", "step"): (666, 5),
    ("double-loop", "parameters", "step"): (1364, 15),
    ("famo", "parameters", "step"): (285, 4),
    ("modo", "parameters", "step"): (1216, 8),
    ("moco", "parameters", "step"): (684, 4),
    ("nashmtl", "parameters", "step"): (2497, 4),
    ("sdmgrad", "parameters", "step"): (1336, 8),
}


def _ops_budget(ops: int) -> int:
    return int(ops * 1.1) + 10


def test_the_counter_sees_every_kind_of_host_read() -> None:
    """Scalar reads, value-dependent shapes and the Python reads that dispatch nothing on a CPU tensor."""
    t = torch.tensor([1.0, 0.0, 3.0])
    reads = [lambda: bool(t.all()), lambda: float(t[0]), lambda: t.sum().item(), lambda: t.tolist(),
             lambda: t.numpy(), lambda: torch.equal(t, t), lambda: t.nonzero(), lambda: t[t > 0]]
    for read in reads:
        with op_count.OpCounter() as counter:
            read()
        assert len(counter.syncs) == 1, counter.syncs
        assert counter.syncs[0].where.startswith("tests/test_step_budgets.py:")
    with op_count.OpCounter() as counter:
        (t * 2 + 1).sum().view(1)
    assert (counter.ops_total, counter.views, counter.syncs) == (3, 1, [])
    assert torch.Tensor.tolist is not None and t.tolist() == [1.0, 0.0, 3.0]  # the wrappers are gone


def test_plain_training_issues_no_sync_and_its_ops_are_the_floor() -> None:
    record = launches.count(launches.Variant("plain"), "small", "separate", NUM_TASKS)
    assert record["syncs"] == 0
    assert record["ops"] == PLAIN_OPS  # the floor every ratio of the table is taken against


@pytest.mark.parametrize("key", sorted(BUDGETS), ids=lambda key: "-".join(key))
def test_a_step_stays_within_its_ops_and_syncs_budget(key: tuple[str, str, str]) -> None:
    method, mode, api = key
    record = launches.count(launches.Variant(method, mode, api, launches.DEFAULT_STRATEGY), "small", "separate",
                            NUM_TASKS)
    ops, syncs = BUDGETS[key]
    assert record["syncs"] <= syncs, f"{key}: {record['syncs']} host syncs (budget {syncs}): {record['sync_origins']}"
    assert record["ops"] <= _ops_budget(ops), f"{key}: {record['ops']} ops (budget {_ops_budget(ops)})"
