"""scripts/small_controls.py's training times count every process of a resumed run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def test_a_resumed_run_counts_the_time_of_every_process(load_script: Any) -> None:
    controls = load_script("small_controls")
    uninterrupted = [{"wall_time_s": t} for t in (30.0, 60.0, 90.0)]
    assert controls.training_seconds(uninterrupted) == 90.0
    # killed after epoch 2 (60 s), resumed by a new process whose clock starts again
    resumed = [{"wall_time_s": t} for t in (30.0, 60.0, 31.0)]
    assert controls.training_seconds(resumed) == 91.0
    twice = [{"wall_time_s": t} for t in (30.0, 5.0, 12.0, 7.0)]
    assert controls.training_seconds(twice) == 30.0 + 12.0 + 7.0


def test_the_committed_resumed_run_is_counted_whole(load_script: Any) -> None:
    """mgda-seed1 of Multi-MNIST-9 was resumed at epoch 30: its last row says 76 s of 1,297."""
    epochs = json.loads((ROOT / "results/multimnist-k-small/multimnist9/mgda-seed1/metrics.json").read_text())
    assert epochs[-1]["wall_time_s"] < 100
    assert 1290 < load_script("small_controls").training_seconds(epochs) < 1300
