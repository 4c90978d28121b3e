"""Issue 29 ("Hostile input, round three"): the run store trusts no path and no size.

One test (or a family) per defect ID; each ID is in the test's name.  Sizes are made with sparse
files (``truncate``): a "1 GiB" file costs a few KB of disk, and the store must refuse it before it
allocates memory for it, which ``tracemalloc`` checks.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from drmoo import store
from drmoo.cli import main
from drmoo.data import multimnist
from drmoo.data.multimnist import MultiMnistRecipe, load_multimnist
from drmoo.experiments.checkpoints import payload_budget
from drmoo.experiments.multimnist import build_multimnist
from drmoo.experiments.robustness import preference_trace
from drmoo.experiments.run_config import read_run_config
from drmoo.store import CHECKPOINT_MAGIC, CheckpointError, UsageError

from .conftest import assert_one_line_refusal, run_cli

MiB = 1 << 20


def _sparse_checkpoint(path: Path, payload_bytes: int, header: dict[str, object]) -> None:
    """A checkpoint whose payload is ``PK\\x03\\x04`` then zeros (sparse), behind a self-consistent header.

    The header's size and SHA-256 match the payload, so only a bound the header cannot set refuses it.
    """
    digest = hashlib.sha256(b"PK\x03\x04")
    zeros, left = bytes(4 * MiB), payload_bytes - 4
    while left:
        part = min(left, len(zeros))
        digest.update(zeros[:part])
        left -= part
    text = json.dumps({**header, "format": 1, "payload_bytes": payload_bytes, "payload_sha256": digest.hexdigest()})
    with path.open("wb") as handle:
        handle.write(CHECKPOINT_MAGIC + text.encode() + b"\n" + b"PK\x03\x04")
        handle.truncate(len(CHECKPOINT_MAGIC) + len(text) + 1 + payload_bytes)


def _peak_bytes(call: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        call()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


# ------------------------------------------------------------------------------- SEC-4


def test_sec4_a_sparse_payload_with_a_matching_hash_is_refused_before_it_is_read(
        trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    """The SHA-256 sits in the header anyone can write: a sparse payload of zeros with its true hash used to
    be read whole (peak RSS 2.6 GB for 1 GiB).  The bound now comes from the run's model and data:
    a payload one MiB over it is refused before a byte of it is allocated."""
    header = store.read_checkpoint_header(trained_run / "checkpoint.pt")
    assert_payload_over_budget_refused(trained_run, header["config"], ["--max-steps", "3"], capsys)


def assert_payload_over_budget_refused(run: Path, config: dict[str, object], resume_options: list[str],
                                       capsys: pytest.CaptureFixture) -> None:
    """A sparse payload one MiB over the budget of ``run``'s model and data, behind a header holding
    ``config`` (config.json holds it too), is refused by eval and by a resume with ``resume_options``."""
    model, data = build_multimnist(read_run_config(run))
    budget = payload_budget(model, tasks=2, training_rows=data.train_labels.shape[0])
    (run / "config.json").write_text(json.dumps(config))
    _sparse_checkpoint(run / "checkpoint.pt", budget + MiB, {"config": config, "step": 1})
    result: list[tuple[int, str]] = []
    peak = _peak_bytes(lambda: result.append(run_cli(["eval", "--run", str(run), "--quiet"], capsys)))
    assert_one_line_refusal(*result[0], "refused", "more than")
    assert peak < 32 * MiB, peak  # the payload was never allocated
    assert_one_line_refusal(*run_cli(["train", "--resume", str(run), *resume_options, "--quiet"], capsys),
                            "refused", "more than")


def test_sec4_the_store_streams_a_checkpoint_into_one_buffer_without_joining_chunks(tmp_path: Path) -> None:
    """A verified payload costs one buffer of its size (plus the tensors it holds), not chunks + their join."""
    state = {"weights": torch.zeros(8 * MiB, dtype=torch.uint8)}
    store.write_checkpoint_file(tmp_path / "c.pt", state, {})
    loaded: list[store.CheckpointFile] = []
    peak = _peak_bytes(lambda: loaded.append(store.read_checkpoint_file(tmp_path / "c.pt")))
    assert torch.equal(loaded[0].state["weights"], state["weights"])
    assert peak < 12 * MiB, peak  # the old reader held the 1 MiB chunks and their 8 MiB join at once: > 16 MiB
    with pytest.raises(CheckpointError, match="more than the 1048576"):
        store.read_checkpoint_file(tmp_path / "c.pt", max_payload_bytes=MiB)


def test_sec4_a_real_run_fits_its_budget_with_room(trained_run: Path) -> None:
    """The bound must never refuse a legitimate checkpoint: the tiny run's payload is far below it."""
    size = store.read_checkpoint_header(trained_run / "checkpoint.pt")["payload_bytes"]
    model, data = build_multimnist(read_run_config(trained_run))
    assert size < payload_budget(model, tasks=2, training_rows=data.train_labels.shape[0]) / 4


def test_sec4_a_checkpoint_state_with_an_extra_entry_is_refused(trained_run: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """A hash-valid checkpoint could carry any extra tensor; it was loaded into memory with the run's state."""
    path = trained_run / "checkpoint.pt"
    checkpoint = store.read_checkpoint_file(path)
    store.write_checkpoint_file(path, {**checkpoint.state, "extra": torch.zeros(10)}, {
        k: v for k, v in checkpoint.header.items() if k not in ("format", "payload_bytes", "payload_sha256")})
    assert_one_line_refusal(*run_cli(["eval", "--run", str(trained_run), "--quiet"], capsys),
                            "refused", "entries drmoo never writes")
    assert_one_line_refusal(*run_cli(["train", "--resume", str(trained_run), "--max-steps", "3", "--quiet"],
                                     capsys), "refused", "entries drmoo never writes")


def _tiny_recipe() -> MultiMnistRecipe:
    return MultiMnistRecipe(digits=2, input_size=16, train_size=32, test_size=8)


def test_sec4_a_multimnist_cache_with_an_extra_tensor_is_rebuilt(tmp_path: Path) -> None:
    """An extra key passed every content check and cost its size in memory on every train."""
    recipe = _tiny_recipe()
    load_multimnist(recipe, cache_dir=tmp_path)
    [path] = list((tmp_path / "multimnist").iterdir())
    cached = store.read_checkpoint_file(path)
    store.write_checkpoint_file(path, {**cached.state, "extra": torch.zeros(1000)}, {
        k: v for k, v in cached.header.items() if k not in ("format", "payload_bytes", "payload_sha256")})
    with pytest.warns(UserWarning, match="entries drmoo never writes"):
        load_multimnist(recipe, cache_dir=tmp_path)
    assert "extra" not in store.read_checkpoint_file(path).state  # rebuilt without it


def test_sec4_an_oversized_multimnist_cache_is_refused_before_it_is_read(tmp_path: Path) -> None:
    recipe = _tiny_recipe()
    load_multimnist(recipe, cache_dir=tmp_path)
    [path] = list((tmp_path / "multimnist").iterdir())
    _sparse_checkpoint(path, 64 * MiB, {k: v for k, v in store.read_checkpoint_header(path).items()
                                        if k not in ("format", "payload_bytes", "payload_sha256")})
    caught: list[warnings.WarningMessage] = []

    def load() -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            load_multimnist(recipe, cache_dir=tmp_path)
        caught.extend(seen)

    peak = _peak_bytes(load)
    assert any("more than" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert peak < 32 * MiB, peak


# ------------------------------------------------------------------------------- SEC-6


def test_sec6_a_symlink_at_a_run_directory_name_in_a_comparison_redirects_nothing(
        tmp_path: Path, tiny_args: Callable[..., list[str]], capsys: pytest.CaptureFixture) -> None:
    """`ln -s VICTIM CMP/double-clip-seed0; drmoo compare --out CMP` wrote the whole run into VICTIM."""
    victim = tmp_path / "victim"
    victim.mkdir()
    compare = tmp_path / "cmp"
    compare.mkdir()
    (compare / "double-clip-seed0").symlink_to(victim)
    code, err = run_cli(["compare", "--methods", "double-clip", "--max-steps", "1", "--eps", "0",
                         "--out", str(compare), *tiny_args()], capsys)
    assert_one_line_refusal(code, err, "symbolic link")
    assert list(victim.iterdir()) == []


@pytest.mark.parametrize("operation", ["write", "read", "remove", "lock"])
def test_sec6_no_store_operation_goes_through_a_linked_directory(tmp_path: Path, operation: str) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "config.json").write_text('{"mine": 1}')
    (tmp_path / "run").symlink_to(victim)
    with pytest.raises(UsageError, match="symbolic link"):
        if operation == "write":
            store.write_text(tmp_path / "run" / "config.json", "{}")
        elif operation == "read":
            store.read_json(tmp_path / "run" / "config.json")
        elif operation == "remove":
            store.remove_file(tmp_path / "run" / "config.json")
        else:
            with store.run_lock(tmp_path / "run"):
                pass
    assert [p.name for p in victim.iterdir()] == ["config.json"]
    assert (victim / "config.json").read_text() == '{"mine": 1}'


def test_sec6_the_stale_sweep_touches_only_the_stores_own_temporaries(tmp_path: Path) -> None:
    """The sweep deleted any `.NAME.<digits>.tmp` of a dead pid: a user's `.draft.99999.tmp` is theirs."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    mine = tmp_path / f".draft.{child.pid}.tmp"
    ours = tmp_path / f".config.json.{child.pid}.0123456789abcdef.drmoo-tmp"
    for path in (mine, ours):
        path.write_text("x")
    with store.run_lock(tmp_path):
        pass
    assert mine.exists() and not ours.exists()


# ------------------------------------------------------------------------------- DL-3


def test_dl3_train_refuses_a_non_empty_directory_that_holds_no_run(
        tmp_path: Path, tiny_args: Callable[..., list[str]], capsys: pytest.CaptureFixture) -> None:
    """Only checkpoint.pt marked a run: `drmoo train --out D` replaced D's config.json and metrics.csv."""
    directory = tmp_path / "D"
    directory.mkdir()
    files = {"config.json": '{"my":"config"}\n', "metrics.csv": "my,data\n", ".draft.99999.tmp": "draft\n"}
    for name, text in files.items():
        (directory / name).write_text(text)
    code, err = run_cli(["train", "--max-steps", "1", "--out", str(directory), *tiny_args()], capsys)
    assert_one_line_refusal(code, err, "holds no drmoo run")
    assert {p.name: p.read_text() for p in directory.iterdir()} == files


def test_dl3_compare_refuses_a_non_empty_directory_that_holds_no_run(
        tmp_path: Path, tiny_args: Callable[..., list[str]], capsys: pytest.CaptureFixture) -> None:
    directory = tmp_path / "D"
    directory.mkdir()
    (directory / "table.md").write_text("my notes\n")
    code, err = run_cli(["compare", "--methods", "double-clip", "--max-steps", "1", "--eps", "0",
                         "--out", str(directory), *tiny_args()], capsys)
    assert_one_line_refusal(code, err, "holds no drmoo run")
    assert [p.name for p in directory.iterdir()] == ["table.md"]


def test_dl3_an_empty_or_drmoo_directory_is_still_accepted(trained_run: Path, tmp_path: Path,
                                                           tiny_args: Callable[..., list[str]]) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["train", "--max-steps", "1", "--out", str(tmp_path / "empty"), *tiny_args()]) == 0
    assert main(["train", "--resume", str(trained_run), "--max-steps", "2", "--quiet"]) == 0


# ------------------------------------------------------------------------------- SEC-7


def test_sec7_compare_streams_steps_csv_keeping_only_w(tmp_path: Path) -> None:
    """preference_trace read the whole steps.csv into a list of dicts (~18x its size in memory)."""
    rows = 60_000
    with (tmp_path / "steps.csv").open("w") as handle:
        handle.write("step,epoch,dual_objective,train_acc,balanced_grad_norm,step_s,w_1,w_2,eta_1,eta_2\n")
        for step in range(1, rows + 1):
            w = 0.25 + 0.5 * (step % 7) / 6
            handle.write(f"{step},1,0.693147,0.5,1.2345678,0.0123,{w:.6f},{1 - w:.6f},0.1,0.2\n")
    size = (tmp_path / "steps.csv").stat().st_size
    traces: list[object] = []
    peak = _peak_bytes(lambda: traces.append(preference_trace(tmp_path)))
    last = 0.25 + 0.5 * (rows % 7) / 6
    assert traces[0] == {"final": [pytest.approx(last), pytest.approx(1 - last)], "low": [0.25, 0.25],
                         "high": [0.75, 0.75]}
    assert peak < size / 2, (peak, size)  # was several times the file's size


def test_sec7_a_csv_row_longer_than_the_cap_is_refused(tmp_path: Path) -> None:
    (tmp_path / "m.csv").write_text("a,b\n" + "1," + "9" * (store.MAX_CSV_ROW_BYTES + 10) + "\n")
    with pytest.raises(UsageError, match="longer than"):
        list(store.iter_csv(tmp_path / "m.csv"))
    (tmp_path / "ok.csv").write_text("a,b\n1,2\n3,4\n")
    assert store.read_csv(tmp_path / "ok.csv") == [{"a": "1", "b": "2"}, {"a": "3", "b": "4"}]


# ------------------------------------------------------------------------------- SW-16 / SW-22


def test_sw16_resume_drops_the_eval_json_of_the_old_weights(trained_run: Path) -> None:
    assert main(["eval", "--run", str(trained_run), "--eps", "0", "--quiet"]) == 0
    assert (trained_run / "eval.json").exists()
    assert main(["train", "--resume", str(trained_run), "--max-steps", "2", "--quiet"]) == 0
    assert not (trained_run / "eval.json").exists()


def test_sw22_a_comparison_without_paired_rows_removes_a_stale_paired_csv(
        tmp_path: Path, tiny_args: Callable[..., list[str]]) -> None:
    compare = tmp_path / "cmp"
    argv = ["compare", "--methods", "double-clip", "--max-steps", "1", "--eps", "0", "--out", str(compare),
            *tiny_args()]
    assert main(argv) == 0
    (compare / "paired.csv").write_text("row,eps,mean_diff\nmgda,0.0,1.5\n")  # an earlier, larger comparison's
    assert main(argv) == 0  # one row: no paired differences
    assert not (compare / "paired.csv").exists()


# ------------------------------------------------------------------------------- SW-21 / CR-18


def test_sw21_an_empty_drmoo_cache_is_unset(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """DRMOO_CACHE="" put the cache into the current directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DRMOO_CACHE", "")
    assert multimnist.default_cache_dir() == tmp_path / ".cache" / "drmoo"
    monkeypatch.setenv("DRMOO_CACHE", str(tmp_path / "c"))
    assert multimnist.default_cache_dir() == tmp_path / "c"


def test_cr18_a_train_size_beyond_memory_is_one_line_before_allocating(
        tmp_path: Path, tiny_args: Callable[..., list[str]], capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--train-size 100000000 is inside the bounds and tried to allocate 129.6 GB, then gave a traceback."""
    monkeypatch.setattr(multimnist, "available_memory", lambda: 8 << 30, raising=False)  # any machine alike
    argv = ["train", "--max-steps", "1", "--out", str(tmp_path / "run"), *tiny_args("--train-size", "100000000")]
    result: list[tuple[int, str]] = []
    peak = _peak_bytes(lambda: result.append(run_cli(argv, capsys)))
    assert_one_line_refusal(*result[0], "memory", "--train-size")
    assert peak < 256 * MiB
    assert not (tmp_path / "run").exists()
