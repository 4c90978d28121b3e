"""A run's checkpoint as the experiments use it: which run it belongs to, and what a result records of it.

The file format -- a magic line, a one-line JSON header announcing the payload's size and SHA-256, the
``torch.save`` payload, checked in that order and unpickled with ``weights_only=True`` -- is the run
store's (:func:`drmoo.store.write_checkpoint_file`, :func:`drmoo.store.read_checkpoint_file`).  Here:
the header a run writes (its config and step), the check that a checkpoint belongs to the run
directory's ``config.json`` (every setting but :data:`~drmoo.experiments.run_config.RESUMABLE_FIELDS`),
and the provenance that binds a result such as ``eval.json`` to the weights it was computed from.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from drmoo.store import (
    CheckpointError,
    CheckpointFile,
    UsageError,
    read_checkpoint_file,
    read_checkpoint_header,
    write_checkpoint_file,
)

from .run_config import RunConfig, config_differences, read_run_config

__all__ = ["CHECKPOINT", "checkpoint_provenance", "load_checkpoint", "read_checkpoint", "result_matches_checkpoint",
           "write_checkpoint"]

CHECKPOINT = "checkpoint.pt"  # in the run directory


def write_checkpoint(path: Path, state: dict[str, Any], config: RunConfig) -> str:
    """``state`` behind a header with the run's config and the payload's size and SHA-256 (atomic); the hash."""
    return write_checkpoint_file(path, state, {"config": asdict(config), "step": state.get("step")})


def load_checkpoint(run_dir: Path, config: RunConfig | None = None) -> CheckpointFile:
    """The verified checkpoint of ``run_dir`` (header, state, payload SHA-256); see :func:`read_checkpoint`."""
    path = run_dir / CHECKPOINT
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: train the run first")
    expected = config if config is not None else read_run_config(run_dir)
    checkpoint = read_checkpoint_file(path)
    saved_config = checkpoint.header.get("config")
    if not isinstance(saved_config, dict):
        raise CheckpointError(f"{path}: refused: its header is corrupt or truncated")
    differences = config_differences(saved_config, expected)
    if differences:
        raise CheckpointError(f"{path}: refused: it belongs to a run with other settings than "
                              f"{run_dir / 'config.json'} ({'; '.join(differences)})")
    if checkpoint.state.get("config") != saved_config:
        raise CheckpointError(f"{path}: refused: its payload does not match its header")
    return checkpoint


def read_checkpoint(run_dir: str | Path, config: RunConfig | None = None) -> dict[str, Any]:
    """The state saved in a run directory's ``checkpoint.pt``, after checking it belongs to the run and is intact.

    The public way to read a run of ``drmoo train`` or ``drmoo compare`` (also importable as
    ``drmoo.experiments.read_checkpoint``)::

        from drmoo.experiments import read_checkpoint

        state = read_checkpoint("runs/multimnist2-double-clip-seed0")
        state["step"], state["model"]  # iterations done, the network's state_dict

    Args:
        run_dir: the run directory (it holds ``config.json`` and ``checkpoint.pt``).
        config: the run's settings to check the checkpoint against; default: ``run_dir/config.json``.

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
    return load_checkpoint(Path(run_dir), config).state


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
