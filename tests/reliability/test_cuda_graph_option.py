"""``drmoo train --cuda-graph``: parsed, recorded in config.json, resumable, refused where it cannot run.

The graphed step itself needs a GPU (tests/optim/test_cuda_graph.py); here, on the CPU: the option's
parsing, its refusal on a CPU device (one line, nothing written), the run config's checks, a resume
that turns it on or off, a run's config.json replayed by ``--config`` with it, and the training
loop's refusal of an optimizer that cannot be captured (checked before anything is written).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from drmoo import cli
from drmoo.experiments.config_file import options_from_config_file
from drmoo.experiments.registry import get_experiment
from drmoo.experiments.run_config import RESUMABLE_FIELDS, RunConfig, config_differences
from drmoo.experiments.training import _build_run
from drmoo.store import UsageError

from .conftest import assert_one_line_refusal, run_cli


@pytest.mark.parametrize(("argv", "value"), [([], None), (["--cuda-graph"], True), (["--no-cuda-graph"], False)])
def test_the_option_parses_to_on_off_or_unset(argv: list[str], value: bool | None) -> None:
    assert cli.build_parser().parse_args(["train", *argv]).cuda_graph is value


def test_it_is_refused_on_the_cpu_in_one_line_before_anything_is_written(
        tmp_path: Path, tiny_args: Callable[..., list[str]], capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    code, err = run_cli(["train", "--cuda-graph", "--device", "cpu", "--max-steps", "1", "--out", str(out),
                         *tiny_args()], capsys)
    assert_one_line_refusal(code, err, "--cuda-graph needs a CUDA device", "cpu", "--no-cuda-graph")
    assert not out.exists()


def test_a_run_records_it_and_an_old_config_without_it_reads_as_off(trained_run: Path) -> None:
    saved = json.loads((trained_run / "config.json").read_text())
    assert saved["cuda_graph"] is False
    del saved["cuda_graph"]  # a config.json written before the option existed
    assert RunConfig.from_json(json.dumps(saved)).cuda_graph is False


@pytest.mark.parametrize(("changes", "named"), [
    ({"cuda_graph": True, "device": "cpu"}, "--cuda-graph needs a CUDA device"),
    ({"cuda_graph": True, "device": "cuda", "amp": "fp16"}, "--cuda-graph cannot run --amp fp16"),
    ({"cuda_graph": "yes"}, "cuda_graph must be true or false"),
])
def test_the_run_config_refuses_what_cannot_run(changes: dict, named: str) -> None:
    config = replace(RunConfig(experiment="multimnist2", method="mgda", preset="quick"), **changes)
    with pytest.raises(UsageError, match=named):
        config.validate()


def test_it_may_change_on_resume_like_the_device() -> None:
    assert "cuda_graph" in RESUMABLE_FIELDS
    base = RunConfig(experiment="multimnist2", method="mgda", preset="quick", device="cuda")
    assert config_differences(base, replace(base, cuda_graph=True)) == []  # same trajectory, up to rounding


def test_resume_keeps_it_off_or_turns_it_on_where_it_can_run(trained_run: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    before = (trained_run / "checkpoint.pt").read_bytes()
    code, err = run_cli(["train", "--resume", str(trained_run), "--cuda-graph", "--quiet"], capsys)
    assert_one_line_refusal(code, err, "--cuda-graph needs a CUDA device")
    assert (trained_run / "checkpoint.pt").read_bytes() == before
    code, err = run_cli(["train", "--resume", str(trained_run), "--no-cuda-graph", "--max-steps", "2", "--quiet"],
                        capsys)
    assert code == 0, err
    assert json.loads((trained_run / "config.json").read_text())["cuda_graph"] is False


@pytest.mark.parametrize(("value", "option"), [(True, "--cuda-graph"), (False, "--no-cuda-graph")])
def test_a_config_file_sets_it_as_the_flag(tmp_path: Path, value: bool, option: str) -> None:
    file = tmp_path / "settings.json"
    file.write_text(json.dumps({"experiment": "multimnist2", "method": "mgda", "preset": "quick",
                                "cuda_graph": value}))
    options, _ = options_from_config_file(file, [])
    assert option in options
    assert cli.build_parser().parse_args(["train", *options]).cuda_graph is value


@pytest.mark.parametrize(("method", "hparams", "named"), [
    ("double-loop", {}, "--cuda-graph: Double-Loop cannot be captured"),
    ("nashmtl", {"update_every": 2}, "--cuda-graph: Nash-MTL with update_every=2"),
    ("mgda", {}, "--cuda-graph: CUDA graph capture needs an optimizer built with capturable=True"),
])
def test_the_training_loop_refuses_an_optimizer_it_cannot_capture(method: str, hparams: dict, named: str,
                                                                  tmp_path: Path, reliability_cache: str) -> None:
    """Checked when the run is built, before the directory is touched.  (RunConfig.validate refuses a CPU
    device first; the config here skips it to reach the optimizer's check on the CPU, where the
    optimizers are not capturable.)"""
    config = RunConfig(experiment="multimnist2", method=method, preset="quick", input_size=16, train_size=32,
                       test_size=8, batch_size=16, cache_dir=reliability_cache, hparams=hparams, cuda_graph=True)
    with pytest.raises(UsageError, match=named):
        _build_run(config, tmp_path / "run", get_experiment("multimnist2").build, torch.device("cpu"), True)
    assert not (tmp_path / "run").exists()
