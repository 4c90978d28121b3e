"""Security: a run directory's checkpoint is trusted only after checks (issue 12, "Security").

A crafted checkpoint.pt must never run code on ``drmoo eval --run`` or ``drmoo train --resume``; a
corrupt, truncated or foreign checkpoint is refused with one line.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from pathlib import Path

import pytest
import torch

from drmoo.experiments.checkpoints import read_checkpoint
from drmoo.experiments.run_config import read_run_config
from drmoo.store import CHECKPOINT_MAGIC, CheckpointError

from .conftest import assert_one_line_refusal, run_cli


class _RunsShell:
    """Pickles as a call to os.system (what an attacker would put in a shared run directory)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return (os.system, (self.command,))


def _payload_start(path: Path) -> int:
    data = path.read_bytes()
    return data.index(b"\n", len(CHECKPOINT_MAGIC)) + 1


def test_pickle_that_calls_os_system_is_refused_and_not_executed(trained_run: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    marker = tmp_path / "pwned"
    checkpoint = trained_run / "checkpoint.pt"
    torch.save({"model": _RunsShell(f"touch {marker}")}, checkpoint)  # what torch.save makes of it
    torch.load(checkpoint, weights_only=False)  # the payload is live: plain unpickling runs it
    assert marker.exists()
    marker.unlink()

    assert_one_line_refusal(*run_cli(["eval", "--run", str(trained_run), "--quiet"], capsys),
                            "refused", "not a drmoo checkpoint")
    assert_one_line_refusal(*run_cli(["train", "--resume", str(trained_run), "--quiet"], capsys), "refused")
    assert not marker.exists()


def test_crafted_payload_behind_a_valid_header_and_hash_is_refused_and_not_executed(
        trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # An attacker who knows the format writes a correct header, hash and config: the payload is still
    # unpickled with weights_only=True, which refuses anything but tensors and plain containers.
    marker = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save({"model": _RunsShell(f"touch {marker}")}, buffer)
    payload = buffer.getvalue()
    config = json.loads((trained_run / "config.json").read_text())
    header = json.dumps({"format": 1, "config": config, "payload_bytes": len(payload),
                         "payload_sha256": hashlib.sha256(payload).hexdigest()})
    (trained_run / "checkpoint.pt").write_bytes(CHECKPOINT_MAGIC + header.encode() + b"\n" + payload)

    assert_one_line_refusal(*run_cli(["eval", "--run", str(trained_run), "--quiet"], capsys),
                            "refused", "more than tensors")
    assert_one_line_refusal(*run_cli(["train", "--resume", str(trained_run), "--quiet"], capsys), "refused")
    assert not marker.exists()


def test_two_hundred_flipped_bytes_are_refused(trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    checkpoint = trained_run / "checkpoint.pt"
    data = bytearray(checkpoint.read_bytes())
    start = _payload_start(checkpoint)
    for position in random.Random(0).sample(range(start, len(data)), 200):
        data[position] ^= 0xFF
    checkpoint.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        read_checkpoint(trained_run)
    assert_one_line_refusal(*run_cli(["eval", "--run", str(trained_run), "--quiet"], capsys), "SHA-256", "corrupt")


@pytest.mark.parametrize("keep", ["most of the payload", "part of the header"])
def test_truncated_checkpoint_is_refused(trained_run: Path, keep: str, capsys: pytest.CaptureFixture) -> None:
    checkpoint = trained_run / "checkpoint.pt"
    data = checkpoint.read_bytes()
    cut = int(0.6 * len(data)) if keep == "most of the payload" else len(CHECKPOINT_MAGIC) + 20
    checkpoint.write_bytes(data[:cut])
    code, err = run_cli(["train", "--resume", str(trained_run), "--quiet"], capsys)
    assert_one_line_refusal(code, err, "refused", "truncated")


def test_checkpoint_that_disagrees_with_config_json_is_refused(trained_run: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    config_path = trained_run / "config.json"
    original = config_path.read_text()
    config = json.loads(original)
    config["hparams"]["lam"] = 2 * config["hparams"]["lam"]  # edited, or a checkpoint from another run
    config_path.write_text(json.dumps(config))
    code, err = run_cli(["eval", "--run", str(trained_run), "--quiet"], capsys)
    assert_one_line_refusal(code, err, "refused", "other settings", "hparams")
    code, err = run_cli(["train", "--resume", str(trained_run), "--max-steps", "2", "--quiet"], capsys)
    assert_one_line_refusal(code, err, "refused", "other settings", "hparams")
    config_path.write_text(original)
    assert read_checkpoint(trained_run)["step"] == 1  # nothing was trained on top of the refused checkpoint


def test_checkpoint_round_trip_and_extension_fields(trained_run: Path) -> None:
    state = read_checkpoint(trained_run)
    assert state["step"] == 1 and set(state) >= {"model", "optimizer", "heads", "stream", "rng", "config"}
    config = read_run_config(trained_run)
    config.max_steps, config.epochs = 5, 3  # how far the run goes: a resume may change it
    assert read_checkpoint(trained_run, config)["step"] == 1
    config.seed = 1
    with pytest.raises(CheckpointError, match="seed"):
        read_checkpoint(trained_run, config)
