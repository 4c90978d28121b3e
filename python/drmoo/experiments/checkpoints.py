"""A run's checkpoint as the experiments use it: which run it belongs to, and what a result records of it.

The file format -- a magic line, a one-line JSON header announcing the payload's size and SHA-256, the
``torch.save`` payload, checked in that order and unpickled with ``weights_only=True`` -- is the run
store's (:func:`drmoo.store.write_checkpoint_file`, :func:`drmoo.store.read_checkpoint_file`).  Here:
the header a run writes (its config and step), the check that a checkpoint belongs to the run
directory's ``config.json`` (every setting but :data:`~drmoo.experiments.run_config.RESUMABLE_FIELDS`),
and the provenance that binds a result such as ``eval.json`` to the weights it was computed from.
:func:`payload_budget` is what a run's checkpoint can legitimately weigh: the bound its readers give the
store, computed from the model and data it loads into and fixed caps, which neither the header (anyone
can write one with a matching hash) nor config.json can raise; a state holding entries beyond
:data:`STATE_KEYS` is refused.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from drmoo.store import (
    MAX_PAYLOAD_BYTES,
    CheckpointError,
    CheckpointFile,
    UsageError,
    read_checkpoint_file,
    read_checkpoint_header,
    write_checkpoint_file,
)

from .run_config import RunConfig, config_differences, read_run_config

__all__ = ["CHECKPOINT", "check_saved_optimizers", "checkpoint_provenance", "load_checkpoint", "max_recorded_steps",
           "payload_budget", "read_checkpoint", "result_matches_checkpoint", "runs_capturable", "write_checkpoint"]

CHECKPOINT = "checkpoint.pt"  # in the run directory
# Everything a run's checkpoint holds (training._save): an entry beyond these is refused, never loaded.
STATE_KEYS = frozenset({"model", "optimizer", "heads", "stream", "rng", "cuda_rng", "step", "epochs", "steps",
                        "config", "grad_scale", "pending_epoch"})


def write_checkpoint(path: Path, state: dict[str, Any], config: RunConfig) -> str:
    """``state`` behind a header with the run's config and the payload's size and SHA-256 (atomic); the hash."""
    return write_checkpoint_file(path, state, {"config": asdict(config), "step": state.get("step")})


# What a checkpoint holds beside the model's tensors, per unit (see payload_budget): generous, since a
# legitimate run must never be refused; an attacker's payload is still bounded by the run's size.
STATE_COPIES_PER_TASK = 2  # optimizer state per shared-parameter tensor: up to 4 + 2 m copies of the model
STATE_COPIES = 4
BYTES_PER_TRAINING_ROW = 16  # the index stream's permutation (int64) and slack
BYTES_PER_STEP_PER_TASK = 96  # a steps.csv row in the pickled state: w_i, eta_i keys and floats (~46 measured)
BYTES_PER_STEP = 1024  # the row's other fields, and an epoch row (~160 measured, ~200 + 40 m for an epoch's)
# The per-step rows a checkpoint may hold in all: a fixed cap, not the run's length (config.json, which
# anyone who can write the checkpoint can write too, would let a forged epochs x rows / batch raise it).
# The trainer refuses a run longer than the cap allows (max_recorded_steps): CelebA-40's paper run
# (63,600 steps, 40 tasks) needs 295 MiB of it at the estimate above, about 120 MiB in fact.
STEP_ROWS_BUDGET = 512 << 20
FIXED_BUDGET = 64 << 20  # RNG states, headers, pickle framing


def _bytes_per_step(tasks: int) -> int:
    return BYTES_PER_STEP + BYTES_PER_STEP_PER_TASK * tasks


def max_recorded_steps(tasks: int) -> int:
    """The longest run (in steps) whose per-step rows fit a checkpoint's :data:`STEP_ROWS_BUDGET`."""
    return STEP_ROWS_BUDGET // _bytes_per_step(tasks)


def payload_budget(model: nn.Module, tasks: int, training_rows: int) -> int:
    """The most payload bytes a checkpoint of this run can legitimately hold.

    The model's tensors (parameters and buffers) times the optimizer's copies of them (moments,
    tracking estimates: at most 4 + 2 ``tasks`` copies), the index stream over ``training_rows``
    rows, :data:`STEP_ROWS_BUDGET` for the per-step metrics and a fixed 64 MiB for the rest: what
    the code loads the checkpoint into, never what a run-directory file says (the run's length in
    config.json is as writable as the checkpoint).  A header announcing more is refused before
    anything is allocated, whatever hash it carries.
    """
    tensor_bytes: int = sum(t.numel() * t.element_size() for t in model.state_dict().values() if hasattr(t, "numel"))
    copies = STATE_COPIES + STATE_COPIES_PER_TASK * tasks
    return min(MAX_PAYLOAD_BYTES, (1 + copies) * tensor_bytes + BYTES_PER_TRAINING_ROW * training_rows
               + STEP_ROWS_BUDGET + FIXED_BUDGET)


def load_checkpoint(run_dir: Path, config: RunConfig | None = None,
                    max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> CheckpointFile:
    """The verified checkpoint of ``run_dir`` (header, state, payload SHA-256); see :func:`read_checkpoint`.

    ``max_payload_bytes``: what the run can hold (:func:`payload_budget`); drmoo's eval and resume
    pass it, other callers get the store's documented cap.
    """
    path = run_dir / CHECKPOINT
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: train the run first")
    expected = config if config is not None else read_run_config(run_dir)
    checkpoint = read_checkpoint_file(path, max_payload_bytes=max_payload_bytes)
    saved_config = checkpoint.header.get("config")
    if not isinstance(saved_config, dict):
        raise CheckpointError(f"{path}: refused: its header is corrupt or truncated")
    differences = config_differences(saved_config, expected)
    if differences:
        raise CheckpointError(f"{path}: refused: it belongs to a run with other settings than "
                              f"{run_dir / 'config.json'} ({'; '.join(differences)})")
    if checkpoint.state.get("config") != saved_config:
        raise CheckpointError(f"{path}: refused: its payload does not match its header")
    unknown = sorted(map(str, set(checkpoint.state) - STATE_KEYS))
    if unknown:
        raise CheckpointError(f"{path}: refused: its state holds entries drmoo never writes "
                              f"({', '.join(unknown)[:200]})")
    return checkpoint


# Parameter-group keys that describe how this process runs an optimizer, not the run: a resume may differ.
PROCESS_KEYS = frozenset({"capturable"})


def runs_capturable(device: str, amp: str) -> bool:
    """Whether the trainer builds the method's optimizer capturable (no host read inside its step): on a
    CUDA ``device``, unless ``amp`` is fp16, whose loss scaling needs the eager step's raise."""
    return device.partition(":")[0] == "cuda" and amp != "fp16"


def _capturable_difference(state: dict[str, Any]) -> str:
    """"" unless a saved parameter group is capturable where the run it was saved from could not be.

    A resume may change the device (a CUDA run continued on the CPU keeps its saved ``capturable: True``,
    which loading replaces by the process's own), and runs trained before CUDA runs were capturable saved
    False there; but a CPU or fp16 run never saved True.
    """
    saved_config = state.get("config")
    config: dict[str, Any] = saved_config if isinstance(saved_config, dict) else {}
    if runs_capturable(str(config.get("device")), str(config.get("amp"))):
        return ""
    for name in ("optimizer", "heads"):
        groups = state[name].get("param_groups") if isinstance(state.get(name), dict) else None
        for index, group in enumerate(groups if isinstance(groups, list) else []):
            if isinstance(group, dict) and group.get("capturable", False) is not False:
                return (f"its {name} state's parameter group {index} has capturable={group['capturable']!r}, but a "
                        f"run on {config.get('device')} with amp {config.get('amp')} saves capturable=False")
    return ""


def check_saved_optimizers(path: Path, state: dict[str, Any], live: dict[str, torch.optim.Optimizer]) -> None:
    """Refuse a checkpoint whose saved optimizers are not the ones the run's settings build.

    ``live`` maps each optimizer entry of ``state`` ("optimizer", "heads") to the optimizer the run
    built from ``config.json`` (not yet loaded): the saved ``state_dict`` must have its structure --
    the same top-level entries, parameter groups and state entries, none more -- and every
    hyperparameter of every group equal to the built one's.  The header and config.json are checked
    against each other before; this makes the payload agree with them too, so a re-signed checkpoint
    cannot resume with an lr of 1e30 or carry entries drmoo never writes.
    """
    for name, optimizer in live.items():
        saved, built = state.get(name), optimizer.state_dict()
        problem = _optimizer_difference(saved, built)
        if problem:
            raise CheckpointError(f"{path}: refused: its {name} state does not match the run's settings in "
                                  f"config.json ({problem[:300]})")
    problem = _capturable_difference(state)
    if problem:
        raise CheckpointError(f"{path}: refused: {problem}")


def _optimizer_difference(saved: Any, built: dict[str, Any]) -> str:
    """How a saved optimizer ``state_dict`` differs from ``built`` (a fresh one of the run's settings); ""."""
    if not isinstance(saved, dict) or set(saved) != set(built):
        keys = sorted(map(str, saved)) if isinstance(saved, dict) else type(saved).__name__
        return f"entries {keys}, expected {sorted(built)}"
    groups = saved["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(built["param_groups"]):
        return f"{len(groups) if isinstance(groups, list) else groups!r} parameter groups, expected " \
               f"{len(built['param_groups'])}"
    for index, (group, expected) in enumerate(zip(groups, built["param_groups"])):
        if not isinstance(group, dict) or set(group) != set(expected):
            keys = sorted(map(str, group)) if isinstance(group, dict) else type(group).__name__
            return f"parameter group {index} has the settings {keys}, expected {sorted(expected)}"
        for key, value in expected.items():
            if key not in PROCESS_KEYS and group[key] != value:
                return f"{key} is {group[key]!r} in parameter group {index}, the run's settings give {value!r}"
    entries = saved["state"]
    if not isinstance(entries, dict) or set(entries) != set(built["state"]):
        keys = sorted(map(str, entries)) if isinstance(entries, dict) else type(entries).__name__
        return f"state entries {keys}, expected {sorted(map(str, built['state']))}"
    for key, expected in built["state"].items():
        if isinstance(expected, dict) and (not isinstance(entries[key], dict) or set(entries[key]) != set(expected)):
            keys = sorted(map(str, entries[key])) if isinstance(entries[key], dict) else type(entries[key]).__name__
            return f"state entry {key!r} holds {keys}, expected {sorted(map(str, expected))}"
    return ""


def read_checkpoint(run_dir: str | Path, config: RunConfig | None = None,
                    max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> dict[str, Any]:
    """The state saved in a run directory's ``checkpoint.pt``, after checking it belongs to the run and is intact.

    The public way to read a run of ``drmoo train`` or ``drmoo compare`` (also importable as
    ``drmoo.experiments.read_checkpoint``)::

        from drmoo.experiments import read_checkpoint

        state = read_checkpoint("runs/multimnist2-double-clip-seed0")
        state["step"], state["model"]  # iterations done, the network's state_dict

    Args:
        run_dir: the run directory (it holds ``config.json`` and ``checkpoint.pt``).
        config: the run's settings to check the checkpoint against; default: ``run_dir/config.json``.
        max_payload_bytes: the largest checkpoint payload read when the run's own bound is not known
            (default :data:`MAX_PAYLOAD_BYTES`).

    Returns:
        The state as the trainer saved it: ``model`` (the network's ``state_dict``), ``heads`` (the
        task heads' SGD optimizer), ``optimizer`` (the method's), ``step`` (iterations done),
        ``epochs`` / ``steps`` (the rows of ``metrics.csv`` / ``steps.csv``), ``config`` (the run's
        settings as a dict), ``stream`` (data order and position), ``rng`` / ``cuda_rng``,
        ``grad_scale`` and ``pending_epoch`` (what an exact ``--resume`` needs).

    Raises:
        FileNotFoundError: the run has no checkpoint yet.
        drmoo.store.CheckpointError: the run store's checks fail
            (:func:`drmoo.store.read_checkpoint_file`: a regular file, drmoo's header, the
            announced size, the SHA-256, ``weights_only=True`` unpickling), or the header's config
            disagrees with ``config`` on a setting other than ``RESUMABLE_FIELDS``.
    """
    return load_checkpoint(Path(run_dir), config, max_payload_bytes).state


def checkpoint_provenance(checkpoint: CheckpointFile) -> dict[str, Any]:
    """What a result computed from ``checkpoint``'s weights records: the iterations and samples that trained
    them, and the checkpoint itself (step and payload SHA-256) so a later reader can tell it still describes it."""
    step, drawn = checkpoint.state["step"], checkpoint.state["stream"]["samples_drawn"]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (step, drawn)):
        raise ValueError("its step or samples drawn is not a count")
    return {"iterations": step, "samples_seen": drawn,
            "checkpoint": {"step": step, "payload_sha256": checkpoint.sha256}}


def result_matches_checkpoint(run_dir: Path, result: Any) -> bool:
    """Whether a saved result (eval.json) was computed from the checkpoint ``run_dir`` holds now."""
    recorded = result.get("checkpoint") if isinstance(result, dict) else None
    if not isinstance(recorded, dict):
        return False  # written by an older drmoo, or forged: not known to describe these weights
    try:
        header = read_checkpoint_header(run_dir / CHECKPOINT)
    except (UsageError, FileNotFoundError):
        return False
    return recorded.get("payload_sha256") == header["payload_sha256"] and recorded.get("step") == header.get("step")
