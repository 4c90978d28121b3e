"""drmoo train with ``--hp jacobian=features`` (issue 26): the trainer's closure hands the optimizer the
trunk's output z beside the losses, so a method variant such as ``double-clip[jacobian=features]`` trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drmoo.cli import main
from drmoo.experiments.checkpoints import read_checkpoint

TINY = ["--input-size", "16", "--train-size", "48", "--test-size", "16", "--batch-size", "16", "--quiet"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def _train(run: Path, cache_dir: str, method: str, *hparams: str) -> dict[str, torch.Tensor]:
    extra = [arg for hp in hparams for arg in ("--hp", hp)]
    assert main(["train", "--method", method, "--max-steps", "3", "--out", str(run), "--cache-dir", cache_dir,
                 *extra, *TINY]) == 0
    return read_checkpoint(run)["model"]


@pytest.mark.parametrize("method", ["double-clip", "double-loop", "mgda", "modo", "sdmgrad", "nashmtl", "famo"])
def test_a_features_variant_trains_and_records_its_mode(tmp_path: Path, cache_dir: str, method: str) -> None:
    """Without the closure's z the optimizer refuses the step (features mode needs z), so this fails on a
    trainer that returns only the losses."""
    _train(tmp_path / "run", cache_dir, method, "jacobian=features")
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["hparams"]["jacobian"] == "features"


def test_features_mode_follows_parameters_mode_when_w_stays_uniform(tmp_path: Path, cache_dir: str) -> None:
    """MGDA with pref_lr = 0 keeps w uniform, so both modes move theta by the same direction (J^T w by the
    chain rule), the per-sample weights and eta being exact in both: three steps agree to float32 rounding
    (one rounding of each summation order per step, far below the 1e-5 relative bound used here)."""
    by_params = _train(tmp_path / "parameters", cache_dir, "mgda", "pref_lr=0")
    by_features = _train(tmp_path / "features", cache_dir, "mgda", "pref_lr=0", "jacobian=features")
    assert by_params.keys() == by_features.keys()
    for name, value in by_params.items():
        if value.is_floating_point():
            torch.testing.assert_close(by_features[name], value, rtol=1e-5, atol=1e-6, msg=name)
    initial = _train(tmp_path / "none", cache_dir, "mgda", "pref_lr=0", "lr=0")
    moved = any(not torch.equal(initial[name], value) for name, value in by_params.items()
                if value.is_floating_point() and "running" not in name)
    assert moved, "the comparison must be of trained weights, not of the initial ones"


@pytest.mark.parametrize("method", ["double-clip", "double-loop", "modo", "sdmgrad", "mgda"])
def test_features_mode_draws_one_batch_with_a_graph_per_step(tmp_path: Path, cache_dir: str, method: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """MoDo, SDMGrad and Double-Loop draw several batches with a graph per step, which features mode
    refuses (their z's columns are different samples): `compare` stopped at the first such row.  The
    trainer now hands them the step's first draw again (their single-batch form); the draws without a
    graph stay fresh, so Double-Clip and MGDA draw as many batches as in parameters mode."""
    from drmoo.experiments import training
    from drmoo.experiments.multimnist import method_hparams

    drawn = [0]
    original = training.IndexStream.__call__

    def counting(self: training.IndexStream) -> torch.Tensor:
        drawn[0] += 1
        return original(self)

    monkeypatch.setattr(training.IndexStream, "__call__", counting)
    _train(tmp_path / "run", cache_dir, method, "jacobian=features")
    inner = int(method_hparams("double-loop")["inner_steps"])
    per_step = {"double-clip": 2, "double-loop": inner + 1, "modo": 1, "sdmgrad": 1, "mgda": 1}[method]
    assert drawn[0] == 3 * per_step


def test_moco_refuses_features_mode_in_the_trainer(tmp_path: Path, cache_dir: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    extra = ["--hp", "jacobian=features"]
    assert main(["train", "--method", "moco", "--max-steps", "1", "--out", str(tmp_path / "run"),
                 "--cache-dir", cache_dir, *extra, *TINY]) != 0
    assert "MoCo" in capsys.readouterr().err
