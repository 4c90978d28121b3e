"""Never lose work (issue 12): compare extends instead of deleting, one trainer per run directory,
durable atomic writes, the epoch saved before its evaluation, the MNIST cache keyed by content."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from drmoo import store
from drmoo.cli import main
from drmoo.data import mnist
from drmoo.experiments import evaluation, training
from drmoo.experiments.checkpoints import read_checkpoint, write_checkpoint
from drmoo.experiments.run_config import RunConfig

from .conftest import assert_one_line_refusal, run_cli


def _steps(run: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((run / "steps.csv").open()))


def _compare_dir_from(template: Path, tmp_path: Path) -> Path:
    """A compare output directory whose double-clip seed-0 run is the finished template run."""
    out = tmp_path / "cmp"
    out.mkdir()
    shutil.copytree(template, out / "double-clip-seed0")
    return out


def test_compare_extends_a_finished_run_when_only_max_steps_grew(trained_template: Path, tmp_path: Path,
                                                                  tiny_args: Callable[..., list[str]]) -> None:
    out = _compare_dir_from(trained_template, tmp_path)
    first_step = _steps(out / "double-clip-seed0")[0]
    assert main(["compare", "--methods", "double-clip", "--seeds", "0", "--eps", "0", "--max-steps", "2",
                 "--out", str(out), *tiny_args()]) == 0
    run = out / "double-clip-seed0"
    assert read_checkpoint(run)["step"] == 2
    rows = _steps(run)
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert rows[0] == first_step  # step 1 is the old run's own record (resumed), not a retrained one
    assert json.loads((run / "config.json").read_text())["max_steps"] == 2 and (run / "done").is_file()


def test_compare_refuses_a_run_with_other_settings_and_keeps_it(trained_template: Path, tmp_path: Path,
                                                                 tiny_args: Callable[..., list[str]],
                                                                 capsys: pytest.CaptureFixture) -> None:
    out = _compare_dir_from(trained_template, tmp_path)
    run = out / "double-clip-seed0"
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    code, err = run_cli(["compare", "--methods", "double-clip", "--seeds", "0", "--eps", "0", "--max-steps", "1",
                         "--lr", "0.123", "--out", str(out), *tiny_args()], capsys)
    assert_one_line_refusal(code, err, "other settings", "lr", "it is kept")
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert after == before  # nothing deleted, nothing rewritten


def test_compare_refuses_to_shorten_a_finished_run(trained_template: Path, tmp_path: Path,
                                                   tiny_args: Callable[..., list[str]],
                                                   capsys: pytest.CaptureFixture) -> None:
    # The template ran 1 step of a 2-step epoch; asking compare for 1 epoch and max 1 step is the same
    # run, but a run trained further than asked is kept, not cut down or retrained.
    out = _compare_dir_from(trained_template, tmp_path)
    assert main(["compare", "--methods", "double-clip", "--seeds", "0", "--eps", "0", "--max-steps", "2",
                 "--out", str(out), *tiny_args()]) == 0
    run = out / "double-clip-seed0"
    assert (run / "done").is_file()
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    code, err = run_cli(["compare", "--methods", "double-clip", "--seeds", "0", "--eps", "0", "--max-steps", "1",
                         "--out", str(out), *tiny_args()], capsys)
    assert_one_line_refusal(code, err, "trained 2 already", "only extend")
    assert read_checkpoint(run)["step"] == 2
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert after == before  # config.json (max_steps 2) and the done marker included: nothing rewritten or deleted


def test_second_trainer_on_the_same_directory_is_refused(tmp_path: Path, tiny_args: Callable[..., list[str]],
                                                         capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(  # another process holding the directory's lock, as a running trainer does
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
         "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode()); print('locked', flush=True); "
         "time.sleep(120)",
         str(run / store.LOCK_FILE)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        code, err = run_cli(["train", "--method", "mgda", "--max-steps", "1", "--out", str(run), *tiny_args()],
                            capsys)
    finally:
        holder.kill()
        holder.wait()
    assert_one_line_refusal(code, err, "in use by another drmoo process", f"pid {holder.pid}")
    assert sorted(p.name for p in run.iterdir()) == [store.LOCK_FILE]  # nothing of this run was written


def test_lock_is_released_when_the_trainer_ends(tmp_path: Path) -> None:
    with store.run_lock(tmp_path):
        with pytest.raises(store.RunLockedError, match="in use by another drmoo process"):
            with store.run_lock(tmp_path):  # a second open file description: as another process would
                pass
    with store.run_lock(tmp_path):  # released: the next trainer gets it
        pass


def test_atomic_write_is_per_process_and_fsynced_before_the_rename(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    def replace(source: str | Path, target: str | Path, **at: int) -> None:  # renameat in the directory's fd
        directory = os.readlink(f"/proc/self/fd/{at['src_dir_fd']}") if at else ""
        events.append(("replace", os.path.join(directory, source)))
        real_replace(source, target, **at)

    monkeypatch.setattr(store.os, "fsync", fsync)
    monkeypatch.setattr(store.os, "replace", replace)
    write_checkpoint(tmp_path / "checkpoint.pt", {"step": 3, "config": {}},
                     RunConfig(experiment="multimnist2", method="mgda", preset="quick"))
    kinds = [kind for kind, _ in events]
    assert kinds == ["fsync", "replace", "fsync"], events  # file data durable, renamed, then the directory
    temporary = events[1][1]
    assert events[0][1] == temporary and f".{os.getpid()}." in Path(temporary).name
    assert events[2][1] == str(tmp_path)
    assert not Path(temporary).exists() and (tmp_path / "checkpoint.pt").is_file()


def test_the_epoch_is_saved_before_its_evaluation(tmp_path: Path, tiny_args: Callable[..., list[str]],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    real_accuracy = training.accuracy

    def unreadable_test_split(*args: object, **kwargs: object) -> list[float]:
        raise OSError("unreadable test image")

    monkeypatch.setattr(training, "accuracy", unreadable_test_split)
    with pytest.raises(OSError, match="unreadable test image"):
        main(["train", "--max-steps", "1", "--out", str(run), *tiny_args()])
    state = read_checkpoint(run)
    assert state["step"] == 1 and state["pending_epoch"] == 1  # the epoch's training is on disk
    assert not (run / "done").exists()

    monkeypatch.setattr(training, "accuracy", real_accuracy)
    assert main(["train", "--resume", str(run), "--quiet"]) == 0  # evaluates the pending epoch, nothing retrained
    epochs = json.loads((run / "metrics.json").read_text())
    assert [(e["epoch"], e["step"]) for e in epochs] == [(1, 1)] and 0 <= epochs[0]["test_acc"] <= 1
    assert [int(r["step"]) for r in _steps(run)] == [1] and (run / "done").is_file()
    assert read_checkpoint(run)["pending_epoch"] is None


def _write_idx(path: Path, array: torch.Tensor) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.dim()) + struct.pack(">" + "I" * array.dim(), *array.shape)
    path.write_bytes(header + array.to(torch.uint8).numpy().tobytes())  # uncompressed: the size is the shape's


def _mnist_root(root: Path, images: torch.Tensor, labels: torch.Tensor) -> Path:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, count in (("train", images.shape[0]), ("t10k", images.shape[0])):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", images[:count])
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels[:count])
    return root


def test_mnist_cache_key_follows_the_files_content(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (6, 28, 28), generator=generator)
    labels = torch.arange(6) % 10
    other = images.clone()
    other[0, 0, 0] = (int(images[0, 0, 0]) + 1) % 256  # one pixel differs; every file keeps its size
    first = _mnist_root(tmp_path / "a", images, labels)
    same = _mnist_root(tmp_path / "b", images, labels)
    changed = _mnist_root(tmp_path / "c", other, labels)
    def sizes(root: Path) -> dict[str, int]:
        return {p.name: p.stat().st_size for p in (root / "MNIST" / "raw").iterdir()}

    assert sizes(first) == sizes(changed)  # same names and sizes: only the content tells them apart
    assert mnist.digit_source_fingerprint(first) == mnist.digit_source_fingerprint(same)
    assert mnist.digit_source_fingerprint(first) != mnist.digit_source_fingerprint(changed)


def test_mnist_labels_outside_0_to_9_are_refused(tmp_path: Path) -> None:
    images = torch.zeros(4, 28, 28, dtype=torch.uint8)
    labels = torch.tensor([1, 2, 200, 3])
    root = _mnist_root(tmp_path, images, labels)
    with pytest.raises(ValueError, match=r"label 200 at position 2 is not a digit 0\.\.9"):
        mnist.load_mnist(root)


def test_metrics_json_is_strict_json(tmp_path: Path, tiny_args: Callable[..., list[str]],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(training, "accuracy", lambda *args, **kwargs: [math.nan, math.nan])
    run = tmp_path / "run"
    assert main(["train", "--max-steps", "1", "--out", str(run), *tiny_args()]) == 0
    text = (run / "metrics.json").read_text()
    epochs = json.loads(text, parse_constant=lambda token: pytest.fail(f"non-standard JSON token {token}"))
    assert epochs[0]["test_acc"] is None and epochs[0]["test_acc_1"] is None and "NaN" not in text


def test_eval_json_is_strict_json(trained_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(evaluation, "task_accuracies", lambda *args, **kwargs: [math.nan, 0.5])
    assert main(["eval", "--run", str(trained_run), "--eps", "0", "--quiet"]) == 0
    text = (trained_run / "eval.json").read_text()
    report = json.loads(text, parse_constant=lambda token: pytest.fail(f"non-standard JSON token {token}"))
    assert report["results"][0]["task_acc"] == [None, 0.5] and report["results"][0]["mean_acc"] is None
