"""bench-iter's rows: the floor first, every method, and Double-Clip both as the paper runs it and on one batch."""

from __future__ import annotations

import torch

from drmoo.experiments import wallclock


def test_double_clip_is_measured_with_and_without_the_second_batch(monkeypatch) -> None:
    created: list[tuple[str, bool | None]] = []
    real_create = wallclock.create

    def spy(method, params, num_tasks, **kwargs):
        optimizer = real_create(method, params, num_tasks, **kwargs)
        created.append((method, optimizer.param_groups[0].get("resample")))
        return optimizer

    monkeypatch.setattr(wallclock, "create", spy)
    rows = wallclock.measure_iterations("multimnist2", ["double-clip", "mgda"], batch_size=2, input_size=16,
                                        device=torch.device("cpu"), warmup=0, repeats=1, progress=False)
    assert [r["method"] for r in rows] == ["floor (1 fwd + m bwd)", "double-clip", "double-clip (resample=False)",
                                           "mgda"]
    # The paper's setting draws two batches; the extra row really runs the one-batch variant.
    assert created == [("double-clip", True), ("double-clip", False), ("mgda", None)]
    assert all(r["median_s"] > 0 and r["ratio_to_floor"] > 0 for r in rows)
