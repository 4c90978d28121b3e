"""drmoo train / eval / compare on tiny Multi-MNIST runs: every method, exact resume, outputs."""

from __future__ import annotations

import csv
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from drmoo.cli import main
from drmoo.experiments import training
from drmoo.experiments.checkpoints import read_checkpoint
from drmoo.experiments.run_config import RunConfig
from drmoo.optim import available

TINY = ["--input-size", "16", "--train-size", "48", "--test-size", "16", "--batch-size", "16", "--quiet"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("method", sorted(available()))
def test_train_then_eval_every_method(tmp_path: Path, cache_dir: str, method: str,
                                      capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / method
    assert main(["train", "--method", method, "--max-steps", "2", "--out", str(run), "--cache-dir", cache_dir,
                 *TINY]) == 0
    assert (run / "done").is_file() and (run / "checkpoint.pt").is_file()
    steps = list(csv.DictReader((run / "steps.csv").open()))
    assert [int(r["step"]) for r in steps] == [1, 2]
    assert all(float(r["balanced_grad_norm"]) >= 0 for r in steps)
    config = json.loads((run / "config.json").read_text())
    assert config["method"] == method and config["input_size"] == 16
    assert main(["eval", "--run", str(run), "--eps", "0,0.05", "--quiet"]) == 0
    report = json.loads((run / "eval.json").read_text())
    assert [r["eps"] for r in report["results"]] == [0.0, 0.05]
    assert all(0.0 <= a <= 1.0 for r in report["results"] for a in r["task_acc"])
    assert "| 0.05 |" in capsys.readouterr().out


def _model_state(run: Path) -> dict[str, torch.Tensor]:
    state = read_checkpoint(run)
    return {**state["model"], "w": state["optimizer"]["state"]["drmoo"]["w"],
            "eta": state["optimizer"]["state"]["drmoo"]["eta"]}


@pytest.mark.parametrize("method", ["double-clip", "double-loop"])
def test_resume_after_an_interrupt_equals_an_uninterrupted_run(tmp_path: Path, cache_dir: str, method: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    common = ["train", "--method", method, "--cache-dir", cache_dir, "--epochs", "2", *TINY]
    straight = tmp_path / "straight"
    assert main([*common, "--out", str(straight)]) == 0

    # Interrupt with a real SIGINT in the middle of the 4th optimizer step's data draws.
    interrupted = tmp_path / "interrupted"
    calls_before_signal = {"double-clip": 7, "double-loop": 26}[method]
    original = training.IndexStream.__call__
    count = [0]

    def draw_then_signal(self: training.IndexStream) -> torch.Tensor:
        count[0] += 1
        if count[0] == calls_before_signal:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self)

    monkeypatch.setattr(training.IndexStream, "__call__", draw_then_signal)
    assert main([*common, "--out", str(interrupted)]) == 130
    monkeypatch.setattr(training.IndexStream, "__call__", original)
    stopped_at = read_checkpoint(interrupted)["step"]
    assert stopped_at == 4 and not (interrupted / "done").exists()

    assert main(["train", "--resume", str(interrupted), "--quiet"]) == 0
    want, got = _model_state(straight), _model_state(interrupted)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key
    assert (interrupted / "metrics.csv").read_text() .count("\n") == (straight / "metrics.csv").read_text().count("\n")


def test_train_refuses_to_overwrite_and_resume_needs_a_run(tmp_path: Path, cache_dir: str,
                                                          capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "r"
    assert main(["train", "--max-steps", "1", "--out", str(run), "--cache-dir", cache_dir, *TINY]) == 0
    assert main(["train", "--max-steps", "1", "--out", str(run), "--cache-dir", cache_dir, *TINY]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "nothing"), "--quiet"]) == 2
    assert "cannot resume" in capsys.readouterr().err
    assert main(["train", "--method", "adamw", "--out", str(tmp_path / "x"), *TINY]) == 2
    assert "unknown method 'adamw'" in capsys.readouterr().err
    assert main(["eval", "--run", str(tmp_path / "nothing"), "--quiet"]) == 2


def test_compare_writes_table_one_and_reuses_finished_runs(tmp_path: Path, cache_dir: str,
                                                          capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cmp"
    args = ["compare", "--methods", "double-clip,mgda", "--seeds", "0,1", "--max-steps", "1", "--eps", "0,0.03",
            "--out", str(out), "--cache-dir", cache_dir, *TINY]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| method | Clean (ours) | 0.03 (ours) |" in printed and "| double-clip |" in printed and " ± " in printed
    rows = list(csv.DictReader((out / "table.csv").open()))
    expected = {(m, e) for m in ("double-clip", "mgda") for e in (0, 0.03)}
    assert {(r["method"], float(r["eps"])) for r in rows} == expected
    assert all(int(r["seeds"]) == 2 for r in rows)
    assert (out / "robustness.png").read_bytes()[:4] == b"\x89PNG"
    stamp = (out / "mgda-seed1" / "checkpoint.pt").stat().st_mtime_ns
    assert main(args) == 0
    assert (out / "mgda-seed1" / "checkpoint.pt").stat().st_mtime_ns == stamp


def test_compare_reuses_finished_runs_shared_without_their_checkpoints(tmp_path: Path, cache_dir: str,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """Committed results keep no checkpoint.pt.  `compare` over them stopped with "checkpoint.pt does not
    exist: train the run first" (their eval.json could not be checked against weights); it now reuses a
    finished run's eval.json that records its checkpoint, changes no file of the run, and says in the
    table which results were not checked.  A run whose eval.json records no checkpoint is still refused."""
    out = tmp_path / "cmp"
    args = ["compare", "--methods", "mgda", "--seeds", "0,1", "--max-steps", "1", "--eps", "0,0.03",
            "--out", str(out), "--cache-dir", cache_dir, "--quiet", *TINY]
    assert main(args) == 0
    first_table = list(csv.DictReader((out / "table.csv").open()))
    (out / "mgda-seed0" / "checkpoint.pt").unlink()  # as a clone of committed results has it
    before = {path.name: path.read_bytes() for path in (out / "mgda-seed0").iterdir()}
    capsys.readouterr()
    assert main(args) == 0
    assert {path.name: path.read_bytes() for path in (out / "mgda-seed0").iterdir()} == before
    assert list(csv.DictReader((out / "table.csv").open())) == first_table
    table = (out / "table.md").read_text()
    assert "without their weights" in table and "mgda seed 0" in table and "mgda seed 1" not in table
    # an eval.json that does not say which checkpoint it evaluated is not reused without one
    report = json.loads((out / "mgda-seed0" / "eval.json").read_text())
    del report["checkpoint"]
    (out / "mgda-seed0" / "eval.json").write_text(json.dumps(report))
    assert main(args) != 0
    assert "checkpoint.pt does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("method", sorted(available()))
def test_a_capturable_step_skipped_on_the_device_stops_the_run_as_an_eager_one_does(
        tmp_path: Path, cache_dir: str, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the trainer steps with capturable=True, which skips a NaN step on the device instead of
    raising; the run must still stop at that step (as on the CPU), not train on applying nothing."""
    from drmoo.experiments.multimnist import build_multimnist, method_hparams
    from drmoo.optim import NonFiniteStepError

    original = training.per_sample_losses
    steps_done = [0]

    def nan_from_the_second_step(logits, labels):
        losses = original(logits, labels)
        return losses * float("nan") if steps_done[0] >= 1 else losses

    monkeypatch.setattr(training, "per_sample_losses", nan_from_the_second_step)
    hparams = {**method_hparams(method), "capturable": True}  # what the trainer picks on CUDA, here on the CPU
    config = RunConfig(experiment="multimnist2", method=method, preset="quick", input_size=16,
                                train_size=48, test_size=16, batch_size=16, max_steps=3, cache_dir=cache_dir,
                                hparams=hparams)
    after_last_good_step: dict[str, torch.Tensor] = {}

    def build(run_config: RunConfig):
        model, data = build_multimnist(run_config)
        original_step = torch.optim.SGD.step

        def count_head_steps(self, *args, **kwargs):  # the heads' SGD step ends every good trainer step
            out = original_step(self, *args, **kwargs)
            steps_done[0] += 1
            after_last_good_step.update({n: p.detach().clone() for n, p in model.named_parameters()})
            return out

        monkeypatch.setattr(torch.optim.SGD, "step", count_head_steps)
        return model, data

    with pytest.raises(NonFiniteStepError, match=r"step 2 met a non-finite .* skipped on the device \(1 skipped"):
        training.train(config, tmp_path / "run", build, progress=False)
    assert steps_done[0] == 1  # the heads never stepped on the skipped step
    assert after_last_good_step and all(torch.isfinite(p).all() for p in after_last_good_step.values())
