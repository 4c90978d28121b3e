"""Issue 18 through the command line: a hostile or careless user and a shared run directory.

One test (or a parametrized family) per defect ID of issue 18; each ID is in the test's name.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from drmoo import cli, store
from drmoo.cli import main
from drmoo.data.multimnist import MultiMnistRecipe, load_multimnist
from drmoo.experiments import training
from drmoo.experiments.checkpoints import read_checkpoint, write_checkpoint
from drmoo.experiments.run_config import RunConfig, read_run_config

from .conftest import assert_one_line_refusal, run_cli


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and p.name != "train.lock"}


@pytest.fixture(scope="module")
def two_step_template(tmp_path_factory: pytest.TempPathFactory, reliability_cache: str) -> Path:
    """A finished run of 2 steps (one epoch of the tiny data set)."""
    from .conftest import TINY_RUN

    run = tmp_path_factory.mktemp("two-step") / "run"
    assert main(["train", "--max-steps", "2", "--out", str(run), "--cache-dir", reliability_cache, *TINY_RUN]) == 0
    return run


# ------------------------------------------------------------------------------- security


def test_sec1_a_lock_planted_as_a_symlink_is_refused_and_its_target_kept(trained_run: Path, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (trained_run / "train.lock").unlink(missing_ok=True)
    (trained_run / "train.lock").symlink_to(victim)
    assert_one_line_refusal(*run_cli(["train", "--resume", str(trained_run), "--max-steps", "3", "--quiet"], capsys),
                            "train.lock", "symbolic link")
    assert victim.read_text() == "precious\n"
    assert read_checkpoint(trained_run)["step"] == 1


def test_sec2_synthetic_never_writes_through_a_planted_temporary(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    for name in ("runs/mgda-seed0.tmp", "metrics.tmp", "convergence.tmp"):
        (out / name).symlink_to(victim)
    assert main(["synthetic", "--problem", "linear", "--methods", "mgda", "--steps", "3", "--out", str(out),
                 "--quiet"]) == 0
    assert victim.read_text() == "precious\n"
    for name in ("runs/mgda-seed0.csv", "metrics.csv", "convergence.csv", "summary.json"):
        assert (out / name).is_file() and not (out / name).is_symlink()


def test_sec2_multimnist_cache_never_writes_through_a_planted_temporary(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    recipe = MultiMnistRecipe(digits=2, input_size=16, train_size=8, test_size=4)
    load_multimnist(recipe, cache_dir=tmp_path / "first")  # learn the cache file's name
    (cached,) = (tmp_path / "first" / "multimnist").glob("*.pt")
    cache = tmp_path / "cache" / "multimnist"
    cache.mkdir(parents=True)
    for suffix in (f".tmp{os.getpid()}", ".tmp"):  # the old predictable names
        (cache / cached.name).with_suffix(suffix).symlink_to(victim)
    load_multimnist(recipe, cache_dir=tmp_path / "cache")
    assert victim.read_text() == "precious\n"
    assert (cache / cached.name).is_file() and not (cache / cached.name).is_symlink()


# ------------------------------------------------------------------------------- data loss


def test_dl1_a_refused_shortening_resume_changes_nothing(two_step_template: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    shutil.copytree(two_step_template, run)
    before = _files(run)
    assert "done" in before
    assert_one_line_refusal(*run_cli(["train", "--resume", str(run), "--max-steps", "1", "--quiet"], capsys),
                            "can only extend")
    assert _files(run) == before  # the finished marker and config.json included


def test_dl1_a_resume_whose_state_does_not_load_changes_nothing(trained_run: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    state = read_checkpoint(trained_run)
    state["heads"] = {"not": "a state dict"}  # hash-consistent: rewritten with drmoo's own writer
    write_checkpoint(trained_run / "checkpoint.pt", state, read_run_config(trained_run))
    before = _files(trained_run)
    assert_one_line_refusal(*run_cli(["train", "--resume", str(trained_run), "--max-steps", "2", "--quiet"],
                                     capsys), "refused")
    assert _files(trained_run) == before


@pytest.mark.parametrize("target", ["table.md", "run config.json"])
def test_dl2_report_refuses_to_overwrite_its_inputs(trained_template: Path, tmp_path: Path, target: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    compare = tmp_path / "cmp"
    compare.mkdir()
    shutil.copytree(trained_template, compare / "double-clip-seed0")
    (compare / "table.md").write_text("| our table |\n")
    (compare / "table.csv").write_text("method\nx\n")
    out = compare / "table.md" if target == "table.md" else compare / "double-clip-seed0" / "config.json"
    before = out.read_bytes()
    code, err = run_cli(["report", "--runs", str(compare), "--out", str(out)], capsys)
    assert_one_line_refusal(code, err, "--out")
    assert out.read_bytes() == before


def test_dl2_report_replaces_its_own_earlier_report(trained_template: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    assert main(["report", "--runs", str(trained_template), "--out", str(out)]) == 0
    assert main(["report", "--runs", str(trained_template), "--out", str(out)]) == 0


def test_dl2_a_grown_report_is_refused_without_reading_it(trained_template: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A 256 MiB sparse file (a few KB on disk) must not be read (it used to be read up to 1 GiB).  Since
    issue 29 (DL-4) an earlier report is replaced only when unmodified (its signature line matches):
    one grown past the report cap is refused from its size alone, without a byte read."""
    from drmoo.experiments import results_report

    out = tmp_path / "report.md"
    assert main(["report", "--runs", str(trained_template), "--out", str(out)]) == 0
    with out.open("r+b") as handle:
        handle.truncate(256 << 20)
    real_read, read = os.read, [0]

    def counting_read(descriptor: int, size: int) -> bytes:
        data = real_read(descriptor, size)
        read[0] += len(data)
        return data

    monkeypatch.setattr(os, "read", counting_read)
    with pytest.raises(store.UsageError, match="not a report drmoo wrote"):
        results_report._check_output(out, [str(trained_template)])  # no longer the report drmoo wrote
    assert read[0] == 0


# ------------------------------------------------------------------------------- crashes


def test_cr2_a_deeply_nested_config_json_is_one_line(trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    (trained_run / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    assert_one_line_refusal(*run_cli(["eval", "--run", str(trained_run), "--quiet"], capsys), "config.json")


@pytest.mark.parametrize("header", ['{"payload_bytes": 1e999, "payload_sha256": "00", "config": {}}',
                                   '{"a":' * 5000 + "1" + "}" * 5000])
def test_cr2_a_crafted_checkpoint_header_is_one_line(trained_run: Path, header: str,
                                                     capsys: pytest.CaptureFixture) -> None:
    (trained_run / "checkpoint.pt").write_bytes(store.CHECKPOINT_MAGIC + header.encode() + b"\n" + b"PK\x03\x04")
    assert_one_line_refusal(*run_cli(["eval", "--run", str(trained_run), "--quiet"], capsys), "refused", "header")


def _refuse_writes(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def refuse(*_: object) -> tuple[int, str]:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(store, "_create_temporary", refuse)


def test_cr3_eval_in_a_read_only_run_prints_the_table_then_one_line(trained_run: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture) -> None:
    _refuse_writes(monkeypatch, errno.EROFS)
    argv = ["eval", "--run", str(trained_run), "--eps", "0,0.05", "--quiet"]
    code = main(argv)
    refused = capsys.readouterr()
    assert_one_line_refusal(code, refused.err, "eval.json", "read-only file system", "not saved")
    assert not (trained_run / "eval.json").exists()
    monkeypatch.undo()  # the same evaluation where it can be saved: its table is what the refused one printed
    assert main(argv) == 0
    table = capsys.readouterr().out.replace(f"wrote {trained_run / 'eval.json'}\n", "")
    assert "| eps | task 1 | task 2 | mean |" in table and "| 0.05 |" in table, table
    assert refused.out == table


def test_cr3_report_into_a_read_only_place_is_one_line(trained_template: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    _refuse_writes(monkeypatch, errno.EACCES)
    code, err = run_cli(["report", "--runs", str(trained_template), "--out", str(tmp_path / "r.md")], capsys)
    assert_one_line_refusal(code, err, "r.md", "permission denied")


def test_cr4_a_full_disk_while_saving_is_one_line_and_keeps_the_old_checkpoint(
        trained_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    old = (trained_run / "checkpoint.pt").read_bytes()
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.os, "fdopen", lambda fd, mode: Full(real_fdopen(fd, mode)))
    assert_one_line_refusal(*run_cli(["train", "--resume", str(trained_run), "--max-steps", "2", "--quiet"], capsys),
                            "no space left on device")
    assert (trained_run / "checkpoint.pt").read_bytes() == old
    assert not [p for p in trained_run.iterdir() if p.name.endswith(store.TEMP_SUFFIX)]


def test_cr4_a_full_disk_while_caching_multimnist_warns_and_trains_from_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _refuse_writes(monkeypatch, errno.ENOSPC)
    recipe = MultiMnistRecipe(digits=2, input_size=16, train_size=8, test_size=4)
    with pytest.warns(UserWarning, match="no space left on device"):
        data = load_multimnist(recipe, cache_dir=tmp_path / "cache")
    assert data.train_images.shape == (8, 1, 16, 16)


@pytest.mark.parametrize("argv", [["train", "--max-steps", str(10**20)], ["train", "--batch-size", str(10**20)],
                                  ["train", "--input-size", str(10**20)], ["train", "--train-size", str(10**20)],
                                  ["train", "--seed", str(10**20)],
                                  ["synthetic", "--steps", str(10**20), "--out", "X"]])
def test_cr5_counts_past_their_bound_name_the_option(argv: list[str], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    argv = [a if a != "X" else str(tmp_path / "o") for a in argv]
    if argv[0] == "train":
        argv += ["--out", str(tmp_path / "o")]
    assert_one_line_refusal(*run_cli(argv, capsys), argv[1])
    assert not (tmp_path / "o").exists()


def test_cr5_an_ablation_grid_past_its_bound_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert_one_line_refusal(*run_cli(["ablate", "--what", "batch", "--experiment", "linear", "--grid", "1e20",
                                      "--out", str(tmp_path / "o"), "--quiet"], capsys), "--grid")
    assert not (tmp_path / "o").exists()


def test_cr6_an_unavailable_backend_is_one_line_before_anything_is_written(
        tmp_path: Path, tiny_args: Callable[..., list[str]], capsys: pytest.CaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the cuda backend would be available")
    out = tmp_path / "run"
    assert_one_line_refusal(*run_cli(["train", "--backend", "cuda", "--out", str(out), *tiny_args()], capsys),
                            "--backend cuda")
    assert not out.exists()


def test_cr7_a_pathologically_nested_hp_value_is_one_line(tmp_path: Path, tiny_args: Callable[..., list[str]],
                                                          capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    code, err = run_cli(["train", "--hp", "lam=" + "~" * 5000 + "1", "--out", str(out), *tiny_args()], capsys)
    assert_one_line_refusal(code, err, "lam")
    assert not out.exists()


def test_cr8_nproc_validates_before_launching_torchrun(tmp_path: Path, tiny_args: Callable[..., list[str]],
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(cli, "_launch_torchrun", lambda *a: pytest.fail("torchrun launched before validation"))
    for bad in (["--lr", "nan"], ["--hp", "lam=-1"]):
        code, err = run_cli(["train", "--nproc", "2", *bad, "--out", str(tmp_path / "run"), *tiny_args()], capsys)
        assert_one_line_refusal(code, err)


def test_cr9_an_empty_eval_json_is_re_evaluated_by_compare(trained_template: Path, tmp_path: Path,
                                                            tiny_args: Callable[..., list[str]]) -> None:
    out = tmp_path / "cmp"
    out.mkdir()
    shutil.copytree(trained_template, out / "double-clip-seed0")
    (out / "double-clip-seed0" / "eval.json").write_text("{}")
    assert main(["compare", "--methods", "double-clip", "--seeds", "0", "--eps", "0", "--max-steps", "1",
                 "--out", str(out), *tiny_args()]) == 0
    assert json.loads((out / "double-clip-seed0" / "eval.json").read_text())["results"][0]["eps"] == 0


def test_cr9_a_garbage_reused_synthetic_csv_is_recomputed(tmp_path: Path) -> None:
    argv = ["synthetic", "--problem", "linear", "--methods", "mgda", "--steps", "3", "--out", str(tmp_path), "--quiet"]
    assert main(argv) == 0
    (tmp_path / "runs" / "mgda-seed0.csv").write_text("garbage\n1,2,3\n")
    assert main(argv) == 0
    assert len((tmp_path / "runs" / "mgda-seed0.csv").read_text().splitlines()) == 4  # header + 3 iterations


def test_cr9_a_float_seed_in_config_json_is_refused(trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    config = json.loads((trained_run / "config.json").read_text())
    config["seed"] = 0.0
    (trained_run / "config.json").write_text(json.dumps(config))
    assert_one_line_refusal(*run_cli(["eval", "--run", str(trained_run), "--quiet"], capsys), "--seed")


@pytest.mark.parametrize("forge", ["stream order", "stream position", "step", "pending epoch"])
def test_cr9_a_forged_but_hash_consistent_state_is_refused(trained_run: Path, forge: str,
                                                           capsys: pytest.CaptureFixture) -> None:
    state = read_checkpoint(trained_run)
    if forge == "stream order":
        state["stream"]["order"] = torch.zeros_like(state["stream"]["order"]) + 10**6
    elif forge == "stream position":
        state["stream"]["position"] = -5
    elif forge == "step":
        state["step"] = -1
    else:
        state["pending_epoch"] = 99
    write_checkpoint(trained_run / "checkpoint.pt", state, read_run_config(trained_run))
    assert_one_line_refusal(*run_cli(["train", "--resume", str(trained_run), "--max-steps", "3", "--quiet"], capsys),
                            "refused")


# ------------------------------------------------------------------------------- silent wrong results


def test_sw1_sw2_compare_re_evaluates_when_the_checkpoint_changed(trained_template: Path, tmp_path: Path,
                                                                  tiny_args: Callable[..., list[str]]) -> None:
    out = tmp_path / "cmp"
    compare = ["compare", "--methods", "double-clip", "--seeds", "0", "--eps", "0", "--out", str(out), *tiny_args()]
    assert main([*compare, "--max-steps", "1"]) == 0
    run = out / "double-clip-seed0"
    old = json.loads((run / "eval.json").read_text())
    assert old["iterations"] == 1 and old["checkpoint"]["step"] == 1
    assert main(["train", "--resume", str(run), "--max-steps", "2", "--quiet"]) == 0  # eval.json now stale
    assert main([*compare, "--max-steps", "2"]) == 0
    new = json.loads((run / "eval.json").read_text())
    header = store.read_checkpoint_header(run / "checkpoint.pt")
    assert new["iterations"] == 2 and new["checkpoint"] == {"step": 2, "payload_sha256": header["payload_sha256"]}
    rows = store.read_csv(out / "table.csv")
    assert {float(row["iterations"]) for row in rows} == {2.0}  # the table shows the weights it evaluated


def test_sw2_eval_takes_its_budget_from_the_checkpoint_not_metrics_json(trained_run: Path) -> None:
    (trained_run / "metrics.json").write_text(json.dumps([{"epoch": 9, "step": 999, "samples": 12345}]))
    assert main(["eval", "--run", str(trained_run), "--eps", "0", "--quiet"]) == 0
    report = json.loads((trained_run / "eval.json").read_text())
    assert report["iterations"] == 1 and report["samples_seen"] == read_checkpoint(trained_run)["stream"][
        "samples_drawn"]


def _edit_train_images(tensors: dict[str, torch.Tensor]) -> None:
    tensors["train_images"] = 255 - tensors["train_images"]  # every composite inverted: right shape and dtype


def _zero_test_labels(tensors: dict[str, torch.Tensor]) -> None:
    tensors["test_labels"] = torch.zeros_like(tensors["test_labels"])  # issue 18's 100 % accuracy, labels in 0..9


def _swap_two_test_labels(tensors: dict[str, torch.Tensor]) -> None:
    labels = tensors["test_labels"].clone()
    labels[0], labels[1] = labels[1].clone(), labels[0].clone()  # the smallest label edit that changes anything
    tensors["test_labels"] = labels


@pytest.mark.parametrize("damage", ["zeroed labels, plain torch.save", "zeroed labels, drmoo format",
                                    "two labels swapped, drmoo format", "inverted images, drmoo format",
                                    "5x5 images, drmoo format", "labels 42"])
def test_sw3_a_damaged_multimnist_cache_is_rebuilt_not_trusted(tmp_path: Path, damage: str) -> None:
    """Edits written in drmoo's own format (a valid header and SHA-256, labels still in 0..9) are
    caught too: the labels are recomputed and composites rebuilt from the digits on every read."""
    recipe = MultiMnistRecipe(digits=2, input_size=16, train_size=8, test_size=4)
    fresh = load_multimnist(recipe, cache_dir=tmp_path)
    (path,) = (tmp_path / "multimnist").glob("*.pt")
    cached = store.read_checkpoint_file(path)
    tensors = dict(cached.state)
    if damage == "zeroed labels, plain torch.save":
        _zero_test_labels(tensors)
        torch.save(tensors, path)
    else:
        if damage.startswith("5x5"):
            tensors["train_images"] = torch.zeros(8, 1, 5, 5, dtype=torch.uint8)
        elif damage.startswith("zeroed"):
            _zero_test_labels(tensors)
        elif damage.startswith("two labels"):
            _swap_two_test_labels(tensors)
        elif damage.startswith("inverted"):
            _edit_train_images(tensors)
        else:
            tensors["test_labels"] = torch.full_like(tensors["test_labels"], 42)
        store.write_checkpoint_file(path, tensors, {k: v for k, v in cached.header.items()
                                                    if k not in ("payload_bytes", "payload_sha256", "format")})
        assert store.read_checkpoint_file(path).header["key"] == cached.header["key"]  # a well-formed cache
    with pytest.warns(UserWarning, match="regenerating"):
        again = load_multimnist(recipe, cache_dir=tmp_path)
    assert torch.equal(again.test_labels, fresh.test_labels) and torch.equal(again.train_images, fresh.train_images)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt entry replaced the edited one and is trusted again
        assert torch.equal(load_multimnist(recipe, cache_dir=tmp_path).test_labels, fresh.test_labels)


def test_sw3_an_unedited_cache_is_read_not_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The content check must not reject drmoo's own cache (then every read would rebuild it)."""
    from drmoo.data import multimnist

    for recipe in (MultiMnistRecipe(digits=3, input_size=20, train_size=300, test_size=70, shift=3),
                   MultiMnistRecipe(digits=2, input_size=28, holdout="validation")):
        fresh = load_multimnist(recipe, cache_dir=tmp_path)
        monkeypatch.setattr(multimnist, "_generate", lambda *_: pytest.fail("a valid cache was regenerated"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = load_multimnist(recipe, cache_dir=tmp_path)
        monkeypatch.undo()
        assert torch.equal(again.train_images, fresh.train_images) and torch.equal(again.test_labels,
                                                                                   fresh.test_labels)


@pytest.mark.parametrize("argv", [
    ["compare", "--seeds", "0,0,0", "--methods", "mgda"], ["compare", "--methods", "mgda,mgda"],
    ["synthetic", "--seeds", "0,0", "--methods", "mgda"], ["ablate", "--what", "lambda", "--experiment", "linear",
                                                           "--grid", "0.5,0.5"],
    ["bench-iter", "--methods", "mgda,mgda"],
])
def test_sw5_repeated_seeds_methods_or_values_are_refused(argv: list[str], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    code, err = run_cli([*argv, "--out", str(tmp_path / "o")], capsys)
    assert_one_line_refusal(code, err)
    assert "twice" in err or "more than once" in err or "repeats a seed" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv", [["train", "--resume", ""], ["train", "--out", ""], ["compare", "--out", ""],
                                  ["eval", "--run", ""], ["report", "--runs", "x", "--out", ""],
                                  ["synthetic", "--out", ""]])
def test_sw6_empty_paths_are_refused(argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert_one_line_refusal(*run_cli([*argv, "--quiet"] if argv[0] != "report" else argv, capsys), "empty")
    assert list(tmp_path.iterdir()) == []  # nothing written in the current directory either


def test_sw9_extending_epochs_past_a_max_steps_cap_is_refused_not_a_silent_no_op(
        trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    before = _files(trained_run)
    assert_one_line_refusal(*run_cli(["train", "--resume", str(trained_run), "--epochs", "2", "--quiet"], capsys),
                            "nothing to train", "--max-steps 1")
    assert _files(trained_run) == before


def test_sw12_a_nan_in_a_reused_run_csv_never_reaches_summary_json(tmp_path: Path) -> None:
    argv = ["synthetic", "--problem", "linear", "--methods", "mgda", "--steps", "3", "--out", str(tmp_path), "--quiet"]
    assert main(argv) == 0
    csv_path = tmp_path / "runs" / "mgda-seed0.csv"
    lines = csv_path.read_text().splitlines()
    header = lines[0].split(",")
    last = lines[-1].split(",")
    last[header.index("balanced_grad_norm")] = "nan"
    csv_path.write_text("\n".join([*lines[:-1], ",".join(last)]) + "\n")
    assert main(argv) == 0
    text = (tmp_path / "summary.json").read_text()
    summary = json.loads(text, parse_constant=lambda token: pytest.fail(f"non-standard JSON token {token}"))
    assert math.isfinite(summary["methods"]["mgda"]["final_balanced_grad_norm"]["mean"])


# ------------------------------------------------------------------------------- order and messages


@pytest.mark.parametrize("bad", [["--lr", "nan"], ["--hp", "lam=-1"], ["--jacobian", "sideways"],
                                 ["--backend", "bogus"], ["--data-root", "/nonexistent/mnist"],
                                 ["--weights", "/nonexistent/weights.pt"]])
def test_u1_refusals_come_before_anything_is_written(bad: list[str], tmp_path: Path,
                                                     tiny_args: Callable[..., list[str]],
                                                     capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    code, err = run_cli(["train", *bad, "--out", str(out), *tiny_args()], capsys)
    assert_one_line_refusal(code, err)
    assert not out.exists()


def test_u1_synthetic_unknown_problem_creates_no_output(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert_one_line_refusal(*run_cli(["synthetic", "--problem", "foo", "--out", str(tmp_path / "o")], capsys), "foo")
    assert not (tmp_path / "o").exists()


def test_u5_a_checkpoint_linked_to_dev_zero_is_named_as_such(trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    (trained_run / "checkpoint.pt").unlink()
    (trained_run / "checkpoint.pt").symlink_to("/dev/zero")  # issue 29: a link is not even opened
    assert_one_line_refusal(*run_cli(["eval", "--run", str(trained_run), "--quiet"], capsys), "symbolic link")


def test_u5_a_utf8_bom_wine_csv_is_read(tmp_path: Path) -> None:
    from drmoo.experiments.problems import WINE_COLUMNS, load_wine_table

    rows = [";".join(WINE_COLUMNS)]
    rows += [";".join(str(0.1 * (i + j)) for j in range(len(WINE_COLUMNS))) for i in range(12)]
    (tmp_path / "winequality-white.csv").write_bytes(b"\xef\xbb\xbf" + "\n".join(rows).encode())
    _names, table = load_wine_table(tmp_path)
    assert table.shape == (12, len(WINE_COLUMNS))


def test_library_train_refuses_an_empty_run_dir() -> None:
    config = RunConfig(experiment="multimnist2", method="mgda", preset="quick")
    with pytest.raises(store.UsageError, match="empty path"):
        training.train(config, "", lambda c: (None, None))  # type: ignore[arg-type]


def _fabricated_celeba_tree(folder: Path) -> Path:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
    from test_celeba import make_celeba_tree  # the tests' fabricated CelebA tree

    return make_celeba_tree(folder)


def test_sw4_a_replaced_celeba_jpeg_is_not_served_stale_from_the_cache(tmp_path: Path) -> None:
    from PIL import Image

    from drmoo.data.celeba import load_celeba

    tree = _fabricated_celeba_tree(tmp_path / "data")
    cache = tmp_path / "cache"
    first = load_celeba(tree, input_size=16, cache_dir=cache).images(torch.tensor([0]))
    replaced = tree / "img_align_celeba" / "000001.jpg"
    Image.fromarray(__import__("numpy").full((32, 16, 3), 7, dtype="uint8")).save(replaced, quality=95)
    os.utime(replaced, ns=(replaced.stat().st_atime_ns, replaced.stat().st_mtime_ns + 10**9))
    again = load_celeba(tree, input_size=16, cache_dir=cache).images(torch.tensor([0]))
    assert not torch.equal(first, again) and float(again.max()) < 0.1  # the new, dark image


def test_sw4_an_edited_celeba_image_cache_is_decoded_again_not_served(tmp_path: Path) -> None:
    """The cache file itself edited (its key only notices replaced JPEGs): cached images are decoded
    again and compared on every open, so the edit is caught and the true images are served."""
    import numpy as np

    from drmoo.data.celeba import load_celeba

    tree = _fabricated_celeba_tree(tmp_path / "data")
    cache = tmp_path / "cache"
    rows = torch.arange(10)
    want = load_celeba(tree, input_size=16, cache_dir=cache).images(rows)
    (pixels,) = (cache / "celeba").glob("16px-*.u8")
    edited = np.memmap(pixels, np.uint8, "r+")
    edited[:] = 255 - edited  # every cached image inverted; the fill flags still vouch for them
    edited.flush()
    del edited
    again = load_celeba(tree, input_size=16, cache_dir=cache)
    with pytest.warns(UserWarning, match="edited or damaged"):
        assert torch.equal(again.images(rows), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # re-decoded and cached again: the next open trusts it
        assert torch.equal(load_celeba(tree, input_size=16, cache_dir=cache).images(rows), want)


def test_u5_a_negative_grid_value_is_refused_by_its_check(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, err = run_cli(["ablate", "--what", "lambda", "--experiment", "linear", "--grid", "-1,0.5",
                         "--out", str(tmp_path / "o")], capsys)
    assert_one_line_refusal(code, err, "--grid", "-1")
    assert "expected one argument" not in err


def test_u5_celeba_eval_refuses_eps_instead_of_evaluating_clean(trained_run: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    config = json.loads((trained_run / "config.json").read_text())
    config["experiment"] = "celeba"  # refused before the run is loaded: the check needs only the experiment
    (trained_run / "config.json").write_text(json.dumps(config))
    assert_one_line_refusal(*run_cli(["eval", "--run", str(trained_run), "--eps", "0.5", "--quiet"], capsys),
                            "--eps", "clean")


def test_u2_a_gpu_run_continues_on_a_cpu_with_device_cpu(trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the saved cuda device would not be refused")
    config = read_run_config(trained_run)
    config.device = "cuda"  # as a run trained on a GPU machine records it
    (trained_run / "config.json").write_text(config.to_json())
    state = read_checkpoint(trained_run, config)
    state["config"] = asdict(config)
    write_checkpoint(trained_run / "checkpoint.pt", state, config)
    code, err = run_cli(["train", "--resume", str(trained_run), "--max-steps", "2", "--quiet"], capsys)
    assert_one_line_refusal(code, err, "--device cpu")
    assert main(["train", "--resume", str(trained_run), "--max-steps", "2", "--device", "cpu", "--quiet"]) == 0
    assert read_checkpoint(trained_run)["step"] == 2
    assert json.loads((trained_run / "config.json").read_text())["device"] == "cpu"


@pytest.mark.parametrize("argv", [["train", "--train-size", "1"], ["train", "--batch-size", "1", "--train-size", "8"],
                                  ["bench-iter", "--batch-size", "1", "--repeats", "1"]])
def test_u3_a_batch_of_one_for_batchnorm_names_the_option(argv: list[str], tmp_path: Path, reliability_cache: str,
                                                          capsys: pytest.CaptureFixture) -> None:
    extra = (["--input-size", "16", "--test-size", "8", "--cache-dir", reliability_cache, "--quiet"]
             if argv[0] == "train" else ["--input-size", "16", "--methods", "mgda", "--device", "cpu", "--quiet"])
    out = tmp_path / "o"
    code, err = run_cli([*argv, *extra, "--out", str(out)], capsys)
    assert_one_line_refusal(code, err, "--batch-size", "BatchNorm")
    assert not out.exists()
