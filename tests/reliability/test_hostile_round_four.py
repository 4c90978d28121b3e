"""Issue 37 ("Hostile input, round four"): one test (or a family) per defect ID, the ID in its name.

Each reproduction is the audit's, shrunk to the tiny run of :mod:`tests.reliability.conftest`.
"""

from __future__ import annotations

import importlib.util
import json
import stat
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import Tensor

import drmoo
from drmoo import store
from drmoo.data import celeba as celeba_data
from drmoo.experiments.checkpoints import max_recorded_steps
from drmoo.experiments.robustness import check_distinct
from drmoo.experiments.run_config import RunConfig
from drmoo.optim import create

from .conftest import assert_one_line_refusal, resign_checkpoint, run_cli
from .test_store_hostile import assert_payload_over_budget_refused


def _celeba_data_tests() -> ModuleType:
    """tests/data/test_celeba.py, for its CelebA tree builder (pytest imports test files by path)."""
    path = Path(__file__).parents[1] / "data" / "test_celeba.py"
    spec = importlib.util.spec_from_file_location("celeba_data_tests", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------- SEC-8


def test_sec8_config_json_cannot_raise_the_checkpoint_payload_budget(trained_run: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """The budget used to grow with config.json's epochs x rows / batch, a file as writable as the
    checkpoint: epochs 100000 and batch 1 (here 2, for BatchNorm) let a 2 GiB payload of zeros with its
    true hash be read whole.
    The budget now comes from the model and data the run loads into and fixed caps only: the same
    forged config leaves it where it was, and a payload one MiB over it is refused unread."""
    forged = json.loads((trained_run / "config.json").read_text())
    forged.update(epochs=100_000, batch_size=2)
    # a resume asked to go far (a resumable setting, on the command line) cannot raise it either
    assert_payload_over_budget_refused(trained_run, forged, ["--epochs", "20000"], capsys)


def test_sec8_a_run_too_long_for_its_checkpoint_to_be_read_back_is_refused_before_it_starts(
        tiny_args, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The fixed budget for per-step rows bounds a run's length: one longer is refused up front (not after
    days of training, at a checkpoint its own resume would refuse)."""
    out = tmp_path / "long"
    code, err = run_cli(["train", "--out", str(out), *tiny_args("--epochs", "100000", "--batch-size", "2")], capsys)
    assert_one_line_refusal(code, err, "1600000 steps", "lower --epochs or --max-steps")
    assert not out.exists()
    assert max_recorded_steps(40) > 100 * 636  # CelebA-40's paper run fits: 100 epochs of 636 steps


# ------------------------------------------------------------------------------- DL-5


def test_dl5_a_read_only_report_is_refused_not_replaced(trained_run: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """rename(2) ignores the target's mode: a report someone made read-only (chmod 444) to keep it was
    replaced by the next ``report --out`` with a new 644 file.  Now it is refused with one line, kept."""
    out = tmp_path / "r.md"
    assert run_cli(["report", "--runs", str(trained_run), "--out", str(out)], capsys)[0] == 0
    kept = out.read_bytes()
    out.chmod(0o444)
    assert_one_line_refusal(*run_cli(["report", "--runs", str(trained_run), "--out", str(out)], capsys),
                            str(out), "read-only")
    assert out.read_bytes() == kept and stat.S_IMODE(out.stat().st_mode) == 0o444


def test_dl5_the_store_keeps_the_mode_of_a_file_it_replaces(tmp_path: Path) -> None:
    """A writable file replaced atomically keeps its permission bits (rename used to give it the new file's 644)."""
    path = tmp_path / "notes.md"
    path.write_text("old")
    path.chmod(0o600)
    store.write_text(path, "new")
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o400)
    with pytest.raises(store.UsageError, match="read-only"):
        store.write_text(path, "newer")
    assert path.read_text() == "new"


# ------------------------------------------------------------------------------- CR-20


def _claim_dimensions(jpeg: Path, width: int, height: int) -> None:
    """Rewrite a JPEG's frame header (SOF0) to announce ``width`` x ``height``: what a decompression
    bomb's header says, at the cost of a few bytes (the pixels are never there to decode)."""
    data = bytearray(jpeg.read_bytes())
    at = data.index(b"\xff\xc0") + 5  # marker, length (2), precision (1), then height and width
    data[at : at + 4] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    jpeg.write_bytes(bytes(data))


@pytest.mark.parametrize(("width", "height"), [(14_000, 13_000), (9_000, 9_000)],
                         ids=["over PIL's bomb limit", "81 Mpx under it"])
def test_cr20_an_oversize_celeba_image_is_one_line_before_the_run_directory(
        width: int, height: int, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A 14000 x 13000 JPEG in a valid tree was a 67-line DecompressionBombError traceback after --out was
    created; an 81 Mpx one under PIL's limit cost +1.2 GB per decode thread.  Both are now refused from
    their headers, with the file and its size named, before anything is written."""
    tree = _celeba_data_tests().make_celeba_tree(tmp_path / "data")
    _claim_dimensions(tree / "img_align_celeba" / "000001.jpg", width, height)
    out = tmp_path / "run"
    code, err = run_cli(["train", "--experiment", "celeba40", "--preset", "quick", "--max-steps", "1", "--input-size",
                         "16", "--batch-size", "8", "--quiet", "--data-root", str(tree), "--out", str(out)], capsys)
    assert_one_line_refusal(code, err, "000001.jpg", f"{width} x {height}", "pixels")
    assert not out.exists()


def test_cr20_decode_bounds_the_pixels_it_allocates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An image swapped for a larger one after the run started is refused by decode itself, from its
    header (a ValueError naming it), before its pixels are allocated; PIL's bomb error is one too."""
    tree = _celeba_data_tests().make_celeba_tree(tmp_path / "data")
    path = tree / "img_align_celeba" / "000001.jpg"
    assert tuple(celeba_data.decode(path, 8).shape) == (3, 8, 8)
    monkeypatch.setattr(celeba_data, "MAX_IMAGE_PIXELS", 16 * 32 - 1)
    with pytest.raises(ValueError, match=r"000001\.jpg.* 16 x 32 .*pixels"):
        celeba_data.decode(path, 8)
    monkeypatch.undo()
    _claim_dimensions(path, 14_000, 13_000)
    with pytest.raises(ValueError, match=r"000001\.jpg"):
        celeba_data.decode(path, 8)


# ------------------------------------------------------------------------------- U-16, U-14, U-15, SW-17


def test_u16_twenty_thousand_seeds_are_checked_in_linear_time(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``compare --seeds 0,...,19999`` spent > 90 s comparing every run with every other before any output.
    The check is now one pass (names counted, settings keyed): the whole command, up to its refusal of the
    --out below, takes seconds; one seed given twice among them is still found."""
    out = tmp_path / "a-file"
    out.write_text("not a directory")
    seeds = ",".join(map(str, range(20_000)))
    started = time.perf_counter()
    assert_one_line_refusal(*run_cli(["compare", "--methods", "mgda", "--seeds", seeds, "--out", str(out), "--quiet"],
                                     capsys), "is a file, not a directory")
    assert time.perf_counter() - started < 60
    configs = [RunConfig(experiment="multimnist2", method="mgda", preset="quick", seed=seed) for seed in range(20_000)]
    started = time.perf_counter()
    with pytest.raises(store.UsageError, match="mgda-seed7 twice"):
        check_distinct([*configs, configs[7]])
    assert time.perf_counter() - started < 10  # quadratic: 2 x 10^8 comparisons of settings


@pytest.mark.parametrize("command", ["eval", "compare"])
def test_u14_an_eps_given_twice_is_refused(command: str, trained_run: Path, tmp_path: Path, tiny_args,
                                           capsys: pytest.CaptureFixture) -> None:
    """``--eps 0,0`` evaluated the same column twice."""
    target = ["--run", str(trained_run)] if command == "eval" else [
        "--methods", "mgda", "--out", str(tmp_path / "c"), *tiny_args("--max-steps", "1")]
    assert_one_line_refusal(*run_cli([command, *target, "--eps", "0,0.01,0", "--quiet"], capsys),
                            "--eps", "0.0 is given twice")
    assert not (tmp_path / "c").exists()


def test_u15_a_hyperparameter_given_twice_is_refused(tmp_path: Path, tiny_args,
                                                     capsys: pytest.CaptureFixture) -> None:
    """``train --hp lam=0.3 --hp lam=0.9`` kept the last silently."""
    out = tmp_path / "run"
    assert_one_line_refusal(*run_cli(["train", "--hp", "lam=0.3", "--hp", "lam=0.9", "--out", str(out),
                                      *tiny_args("--max-steps", "1")], capsys), "--hp", "lam", "twice")
    assert not out.exists()


def test_u15_a_bool_is_not_a_number(tmp_path: Path, tiny_args, capsys: pytest.CaptureFixture) -> None:
    """``mgda[clip_c1=True]`` read the bool as 1 (Python's bool is an int; a float setting refuses it)."""
    out = tmp_path / "cmp"
    assert_one_line_refusal(*run_cli(["compare", "--methods", "mgda[clip_c1=True,clip_c2=0.5]", "--out", str(out),
                                      "--eps", "0", *tiny_args("--max-steps", "1")], capsys),
                            "clip_c1 must be a number, got True")
    assert not out.exists()
    with pytest.raises(ValueError, match="lr must be a number, got True"):
        create("mgda", [torch.nn.Parameter(torch.zeros(2))], 2, lr=True)


def test_u15_a_long_variant_is_refused_for_its_length(tmp_path: Path, tiny_args,
                                                      capsys: pytest.CaptureFixture) -> None:
    """A 1,960-character variant was refused as "not a short name without path separators"."""
    variant = "mgda[lam=0." + "1" * 1948 + "]"
    assert len(variant) == 1960
    assert_one_line_refusal(*run_cli(["compare", "--methods", variant, "--out", str(tmp_path / "c"), "--eps", "0",
                                      *tiny_args("--max-steps", "1")], capsys), "1960 characters", "at most 200")


def test_sw17_a_quoted_number_is_the_number(tmp_path: Path, tiny_args, capsys: pytest.CaptureFixture) -> None:
    """``mgda[lam=0.5],mgda[lam='0.5']``: the quoted number trains as the number (the optimizer reads it as
    one) but escaped the duplicate check: the same run twice, two rows.  Settings are compared as the
    optimizer takes them."""
    out = tmp_path / "cmp"
    code, err = run_cli(["compare", "--methods", "mgda[lam=0.5],mgda[lam='0.5']", "--out", str(out), "--eps", "0",
                         *tiny_args("--max-steps", "1")], capsys)
    assert_one_line_refusal(code, err)
    # the duplicate check compares the values the optimizer takes; a later change refuses the text itself
    assert "mgda[lam=0.5] and mgda[lam='0.5'] are the same settings" in err or "got the text '0.5'" in err, err
    assert not out.exists()


# ------------------------------------------------------------------------------- SW-26


_resign = resign_checkpoint


@pytest.mark.parametrize(("edit", "fragments"), [
    (lambda s: s["optimizer"]["param_groups"][0].update(lr=1e30), ("optimizer", "lr", "1e+30")),
    (lambda s: s["heads"]["param_groups"][0].update(lr=5.0), ("heads", "lr", "5.0")),
    (lambda s: s["optimizer"]["param_groups"][0].update(rho=0.5), ("optimizer", "rho", "0.5")),
    (lambda s: s["optimizer"]["state"]["drmoo"].update(extra=torch.zeros(3)), ("optimizer", "extra")),
    (lambda s: s["optimizer"]["state"].update({7: {"momentum_buffer": torch.zeros(3)}}), ("optimizer", "7")),
    (lambda s: s["heads"].update(extra=[1]), ("heads", "extra")),
], ids=["lr 1e30", "heads' lr", "rho", "extra drmoo entry", "extra parameter state", "extra top-level entry"])
def test_sw26_a_resigned_checkpoint_is_resumed_only_with_its_runs_settings(
        edit: Callable[[dict[str, Any]], None], fragments: tuple[str, ...], trained_run: Path,
        capsys: pytest.CaptureFixture) -> None:
    """lr 1e30 written into the checkpoint's param group (and re-signed) was resumed and trained with
    (dual objective 3.5e29 at step 2), then saved again; an extra optimizer-state entry was accepted.
    The saved optimizers are now compared with the ones config.json's settings build: every
    hyperparameter, every entry."""
    _resign(trained_run, edit)
    assert_one_line_refusal(*run_cli(["train", "--resume", str(trained_run), "--max-steps", "3", "--quiet"], capsys),
                            "refused", *fragments)
    assert store.read_checkpoint_file(trained_run / "checkpoint.pt").state["step"] == 1  # nothing trained on it


# ------------------------------------------------------------------------------- environment


def test_a_run_records_the_environment_of_each_training_session(trained_run: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """A retrain on another CPU diverged from the committed floats at step 9-20, and no file said where they
    were made.  Each session (the run, then each resume) now records what decides the floats."""
    [first] = json.loads((trained_run / "environment.json").read_text())["sessions"]
    assert first["from_step"] == 0
    assert first["torch"] == torch.__version__ and first["drmoo"] == drmoo.__version__
    assert first["torch_threads"] == torch.get_num_threads() and first["world_size"] == 1
    assert first["cpu_isa"] == torch.backends.cpu.get_cpu_capability() and first["cpu_model"]
    assert first["kernel_backend"] in ("cpp", "reference") and first["device"] == "cpu" and first["gpu"] is None
    assert run_cli(["train", "--resume", str(trained_run), "--max-steps", "2", "--quiet"], capsys)[0] == 0
    sessions = json.loads((trained_run / "environment.json").read_text())["sessions"]
    assert [s["from_step"] for s in sessions] == [0, 1]

    out = trained_run.parent / "report.md"
    assert run_cli(["report", "--runs", str(trained_run), "--out", str(out)], capsys)[0] == 0
    [line] = [line for line in out.read_text().splitlines() if line.startswith("- **environment**")]
    for fragment in (f"torch {torch.__version__}", f"{torch.get_num_threads()} threads", first["cpu_isa"],
                     f"{first['kernel_backend']} kernels", "2 sessions"):
        assert fragment in line, line


# ------------------------------------------------------------------------------- SW-25, U-15 (z), U-11


def _trunk_and_losses(tasks: int = 3) -> tuple[torch.nn.Linear, Tensor, Tensor]:
    """A linear trunk, its output z (with its graph) and per-sample losses of ``tasks`` linear heads on z."""
    torch.manual_seed(0)
    trunk, heads = torch.nn.Linear(4, 5), torch.nn.Linear(5, tasks)
    z = trunk(torch.randn(8, 4))
    return trunk, z, (heads(z) - 1.0) ** 2


@pytest.mark.parametrize("pieces", [lambda z: (z, z), lambda z: (z, z.view(8, 5)), lambda z: [z, z, z]],
                         ids=["the same tensor twice", "a view of it", "three copies"])
def test_sw25_a_feature_tensor_given_twice_is_refused(pieces: Callable[[Tensor], Any]) -> None:
    """``features=(z, z)`` doubled the shared gradient (x3 for three copies, x1.69 for Nash-MTL): each piece
    of z got the whole cotangent and autograd summed them.  A piece given twice, or overlapping another's
    memory, is now refused by both APIs before anything is computed."""
    trunk, z, losses = _trunk_and_losses()
    balancer = drmoo.Balancer("mgda", trunk.parameters(), 3, jacobian="features", lr=1e-3)
    with pytest.raises(ValueError, match=r"features\[1\] .*features\[0\]"):
        balancer.backward(losses, features=pieces(z))
    assert all(p.grad is None for p in trunk.parameters()) and balancer.steps_taken == 0
    optimizer = create("mgda", trunk.parameters(), 3, jacobian="features", lr=1e-3)
    before = [p.detach().clone() for p in trunk.parameters()]
    with pytest.raises(ValueError, match=r"features\[1\] .*features\[0\]"):
        optimizer.step(lambda: (losses, pieces(z)))
    assert all(torch.equal(a, b) for a, b in zip(before, trunk.parameters()))


def test_sw25_disjoint_pieces_of_z_still_count_once() -> None:
    """Two tensors that share no memory are two pieces: the check refuses duplicates, not tuples."""
    trunk, z, _ = _trunk_and_losses()
    second = trunk(torch.randn(8, 4))
    head_a, head_b = torch.nn.Linear(5, 1), torch.nn.Linear(5, 2)
    losses = torch.cat([head_a(z), head_b(second)], dim=1) ** 2
    drmoo.Balancer("mgda", trunk.parameters(), 3, jacobian="features", lr=1e-3).backward(losses, features=(z, second))
    assert all(p.grad is not None for p in trunk.parameters())


def test_u15_an_integer_z_is_named_for_its_dtype() -> None:
    """An int64 z was called "needs no grad" (true, but because integers cannot have a gradient)."""
    trunk, z, losses = _trunk_and_losses()
    optimizer = create("mgda", trunk.parameters(), 3, jacobian="features", lr=1e-3)
    with pytest.raises(TypeError, match=r"features\[0\] must be floating point, got torch.int64"):
        optimizer.step(lambda: (losses, z.detach().long()))


@pytest.mark.parametrize("entry", ["w", "eta"])
def test_u11_a_meta_state_entry_is_named(entry: str) -> None:
    """``load_state_dict`` with a meta ``w``/``eta`` failed with "Tensor.item() cannot be called on meta tensors"."""
    optimizer = create("mgda", [torch.nn.Parameter(torch.zeros(4))], 2)
    state = optimizer.state_dict()
    state["state"]["drmoo"][entry] = torch.empty(2, device="meta")
    with pytest.raises(ValueError, match=f"state_dict's {entry} is on the meta device"):
        optimizer.load_state_dict(state)


def test_u11_moco_after_add_param_group_tracks_the_new_group_from_zero() -> None:
    """MoCo after ``add_param_group`` failed with "requires_grad was toggled".  The tracked Jacobian now grows by
    the new group's columns, started at zero as every column was at construction, and the step trains both."""
    torch.manual_seed(0)
    first, second = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))
    x, x2 = torch.randn(8, 4), torch.randn(8, 3)

    def closure() -> Tensor:
        out = x @ first + x2 @ second
        return torch.stack([out**2, (out - 1) ** 2], 1)

    optimizer = create("moco", [first], 2, lr=0.1)
    optimizer.step(closure)
    tracked = optimizer.state["drmoo"]["tracking"].clone()
    optimizer.add_param_group({"params": [second]})
    before = second.detach().clone()
    optimizer.step(closure)
    assert optimizer.state["drmoo"]["tracking"].shape == (2, 7)
    assert not torch.equal(second, before)
    # the old columns went on from their estimate, the new ones from zero (one lerp: (1 - ema) of the gradient)
    assert not torch.equal(optimizer.state["drmoo"]["tracking"][:, :4], tracked)

