"""``drmoo report``: one markdown report from the result directories the other ``drmoo`` commands write.

Each directory given is walked; a directory is recognised by the files a command leaves in it:

====================  ==========================================================  ================
kind                  recognised by                                               written by
====================  ==========================================================  ================
ablation              ``ablation-<what>.json`` (+ ``.md``, ``.csv``, ``.png``)     ``drmoo ablate``
synthetic comparison  ``summary.json`` + ``summary.md`` (+ ``convergence.png``)    ``drmoo synthetic``
robustness comparison ``table.md`` + ``table.csv`` (+ ``robustness.png``)          ``drmoo compare``
wall-clock            ``wallclock.md`` (+ ``wallclock.csv``, ``.png``)             ``drmoo bench-iter``
kernel benchmarks     a ``*.md`` whose first line is ``# drmoo kernel benchmarks``  ``bench/run.py``
training run          ``config.json`` + ``metrics.csv`` (+ ``eval.json``)          ``drmoo train``
diverged run          ``config.json`` + ``diverged`` (the failed step)              ``drmoo train``
====================  ==========================================================  ================

A recognised directory is not descended into (a comparison's run sub-directories are its own
inputs); an unrecognised one is, and if nothing below it is recognised it is listed as skipped
with the reason.  Tables are embedded, PNGs linked with paths relative to the report.

The trees read are untrusted (shared, damaged, edited):

* **Nothing is followed through a link.**  The walk never descends into a symbolic link and every
  file is read through the run store, which refuses a link at a file's or its directory's name;
  a link is listed as skipped, its target never read.
* **Every side file is validated against its schema** (:data:`SCHEMAS`: ``config.json``,
  ``eval.json``, ``agreement.json``, ``summary.json``, ``ablation-*.json``) before anything is
  taken from it.  A directory whose file is malformed, unreadable or too large is one
  "skipped: why" line of the report; the rest of the report is written.
* **Sizes are capped.**  An embedded markdown file is at most :data:`MAX_EMBED_BYTES`, a CSV is
  streamed row by row keeping only the rows shown, a report at most :data:`MAX_REPORT_BYTES`.
* **Strings from the files are escaped** for markdown (titles, settings, hyperparameters).
* **A run's eval.json is shown only when it describes the checkpoint there now** (its recorded
  step and payload SHA-256); a stale one (the run was resumed since) is named, not shown.
* **The report replaces only a report drmoo wrote, unmodified**: every report ends with a line
  holding the SHA-256 of everything above it; an existing ``--out`` file is replaced only when that
  line is there and matches.  Any other file -- an input, a user's notes quoting a report, an edited
  report -- is refused, and so is an ``--out`` that resolves into a run directory.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from drmoo.store import (
    LOCK_FILE,
    UsageError,
    iter_csv,
    make_directory,
    read_bytes,
    read_head,
    read_json,
    read_text,
    regular_file_size,
    write_text,
)

from .checkpoints import CHECKPOINT, result_matches_checkpoint
from .environment import ENVIRONMENT, distinct_environments, read_sessions
from .run_config import upgrade_config_dict

__all__ = ["SCHEMAS", "Section", "collect", "render", "write_report"]

BENCH_PREFIX = "# drmoo kernel benchmarks"
MAX_DEPTH = 8  # deeper trees are not result layouts any command writes
MAX_EMBED_BYTES = 1 << 20  # one embedded markdown file: drmoo's tables are a few KB
MAX_REPORT_BYTES = 64 << 20  # the whole report, and the most of an existing --out file read to check it
MAX_TABLE_ROWS = 100_000  # rows of a comparison's table.csv (methods x eps: a few hundred)
DIVERGED = "diverged"  # the marker of a run that stopped at a non-finite step (= drmoo.experiments.training.DIVERGED)
LOOKED_FOR = ("ablation-*.json, summary.json + summary.md, table.md + table.csv, wallclock.md, gpu-*.md + .csv, "
              f"a '{BENCH_PREFIX}' .md, config.json + metrics.csv or {DIVERGED}")


@dataclass
class Section:
    """One recognised result: what it is, where, its provenance and the files to embed or link."""

    kind: str
    directory: Path
    title: str
    provenance: dict[str, str]
    tables: list[str] = field(default_factory=list)
    images: list[Path] = field(default_factory=list)
    links: list[Path] = field(default_factory=list)


class Malformed(ValueError):
    """A side file that is not what the command that names it writes: its directory is skipped with this reason."""


# ---------------------------------------------------------------------------- schemas
#
# A schema is a type or tuple of types (bool is never a number), a dict {key: schema} (a JSON object;
# keys in REQUIRED[...] must be there, the others may be absent or null, unknown keys are ignored), a
# one-element list [schema] (a JSON array of those) or MapOf(schema) (an object of any keys).


@dataclass(frozen=True)
class MapOf:
    values: Any


@dataclass(frozen=True)
class Required:
    schema: Any


NUMBER = (int, float)  # an integer too large for a float is refused (it cannot be formatted as a number)
SCALAR = (str, int, float, bool)
ANY_JSON = (str, int, float, bool, list, dict)
NUMBER_OR_NULL = (int, float, type(None))  # a metric: null is an undefined one (NaN)

SCHEMAS: dict[str, Any] = {
    "config.json": {"experiment": Required(str), "method": Required(str), "seed": Required(int),
                    "hparams": MapOf(ANY_JSON), "device": str, "backend": str, "preset": str, "epochs": int,
                    "max_steps": int, "batch_size": int, "input_size": int, "train_size": int, "test_size": int,
                    "weights": str, "jacobian_strategy": str, "jacobian": str, "amp": str, "label": str},
    "eval.json": {"results": Required([{"eps": Required(NUMBER), "mean_acc": Required(NUMBER),
                                        "task_acc": Required([NUMBER])}]),
                  "test_samples": Required(int), "experiment": Required(str), "method": Required(str),
                  "seed": Required(int), "eps_space": str, "checkpoint": {"step": int, "payload_sha256": str}},
    "agreement.json": {"per_column": [{"column": SCALAR, "tau_b": NUMBER}], "mean_tau_b": NUMBER,
                       "reference": SCALAR, "eps_space": SCALAR},
    "summary.json": {"problem": Required(str), "description": str, "steps": SCALAR, "batch_size": SCALAR,
                     "seeds": [SCALAR], "methods": MapOf({"hparams": MapOf(ANY_JSON)})},
    "environment.json": {"sessions": Required([{
        "from_step": Required(int), "drmoo": str, "torch": Required(str), "kernel_backend": str, "device": str,
        "torch_threads": int, "world_size": int, "cpu_model": str, "cpu_isa": str, "gpu": str, "cuda": str}])},
    DIVERGED: {"step": Required(int), "saved_step": int, "reason": str},
    "ablation-*.json": {"kind": Required(str), "what": SCALAR, "experiment": SCALAR, "machine": SCALAR,
                        "backend": SCALAR, "device": SCALAR, "torch": SCALAR, "settings": MapOf(ANY_JSON),
                        "grid": (MapOf([NUMBER]), [NUMBER])},
}


# eval.json's robustness block (drmoo.experiments.robust_eval), what robustness_tables reads of it.  Checked
# only when the file is shown (it describes the checkpoint there now): a stale file from an older drmoo is
# listed as not shown, whatever its robustness block holds.
METRICS_BLOCK = {"per_task": Required(MapOf([NUMBER_OR_NULL])), "mean": Required(MapOf(NUMBER))}
SHOWN_EVAL: dict[str, Any] = {
    "results": Required([{"metrics": METRICS_BLOCK, "metrics_temperature_scaled": METRICS_BLOCK}]),
    "robustness": {
        "run_ball": Required({"divergence": Required(str), "lam": Required(NUMBER)}),
        "clean": Required(METRICS_BLOCK),
        "temperature_scaled": Required(METRICS_BLOCK),
        "label_shift": Required({"family": Required(str), "points": Required([{
            "positive_rate_strength": NUMBER, "digit_factor": NUMBER, **METRICS_BLOCK}])}),
        "temperature_label_shift": {"points": Required([METRICS_BLOCK])},
        "noise": Required({"points": Required([{"sigma": Required(NUMBER), "temperature_scaled": METRICS_BLOCK,
                                                **METRICS_BLOCK}])}),
    },
}


def _check_shown_eval(report: dict[str, Any], name: str = "eval.json") -> None:
    """Raise :class:`Malformed` naming the key unless the tables of ``report`` (an eval.json that fits its
    schema) can be printed as they should: :data:`SHOWN_EVAL`'s types, and every per-task row as long as
    the run has tasks (``results[0].task_acc``), so that no value lands in another task's column."""
    from .robust_eval import METRICS, WEIGHTED_METRICS

    _validate(report, SHOWN_EVAL, name)
    tasks = len(report["results"][0]["task_acc"])

    def check_block(block: Any, where: str) -> None:
        if not isinstance(block, dict):
            return
        for key, values in block["per_task"].items():
            if values is not None and len(values) != tasks:
                raise Malformed(f"{where}.per_task.{key} has {len(values)} values, not one per task ({tasks}: "
                                f"{name}.results[0].task_acc)")

    for index, row in enumerate(report["results"]):
        if len(row["task_acc"]) != tasks:
            raise Malformed(f"{name}.results[{index}].task_acc has {len(row['task_acc'])} values, "
                            f"{name}.results[0].task_acc {tasks}")
        for key in ("metrics", "metrics_temperature_scaled"):
            check_block(row.get(key), f"{name}.results[{index}].{key}")
    block = report.get("robustness")
    if not isinstance(block, dict):
        return
    where = f"{name}.robustness"
    clean = block["clean"]
    for key in (*METRICS, *WEIGHTED_METRICS):  # the per-task table: a row for every metric the mean has
        if (key in clean["mean"] or key == "accuracy") and clean["per_task"].get(key) is None:
            raise Malformed(f"{where}.clean.per_task has no {key!r}")
    check_block(clean, f"{where}.clean")
    check_block(block["temperature_scaled"], f"{where}.temperature_scaled")
    shift = block["label_shift"]["points"]
    for index, point in enumerate(shift):
        if point.get("positive_rate_strength") is None and point.get("digit_factor") is None:
            raise Malformed(f"{where}.label_shift.points[{index}] has neither 'positive_rate_strength' "
                            "nor 'digit_factor'")
        check_block(point, f"{where}.label_shift.points[{index}]")
    scaled_shift = block.get("temperature_label_shift")
    if isinstance(scaled_shift, dict):
        if len(scaled_shift["points"]) != len(shift):
            raise Malformed(f"{where}.temperature_label_shift.points has {len(scaled_shift['points'])} points, "
                            f"{where}.label_shift.points {len(shift)}")
        for index, point in enumerate(scaled_shift["points"]):
            check_block(point, f"{where}.temperature_label_shift.points[{index}]")
    for index, point in enumerate(block["noise"]["points"]):
        check_block(point, f"{where}.noise.points[{index}]")
        check_block(point.get("temperature_scaled"), f"{where}.noise.points[{index}].temperature_scaled")


def _type_name(schema: Any) -> str:
    if isinstance(schema, Required):
        return _type_name(schema.schema)
    if isinstance(schema, dict) or isinstance(schema, MapOf):
        return "an object"
    if isinstance(schema, list):
        return f"a list of {_type_name(schema[0])}s"
    types = schema if isinstance(schema, tuple) else (schema,)
    names = {int: "integer", float: "number", str: "string", bool: "boolean", list: "list", dict: "object",
             type(None): "null"}
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) if isinstance(t, type) else _type_name(t)
                                     for t in types))


def _validate(value: Any, schema: Any, where: str) -> None:
    """Raise :class:`Malformed` naming ``where`` unless ``value`` fits ``schema``."""
    if isinstance(schema, Required):
        schema = schema.schema
    if isinstance(schema, tuple) and any(not isinstance(option, type) for option in schema):
        for option in schema:  # alternatives of which some are structures: the first that fits
            try:
                _validate(value, option, where)
                return
            except Malformed:
                continue
        raise Malformed(f"{where} is not {_type_name(schema)}")
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            raise Malformed(f"{where} is not an object")
        for key, item in schema.items():
            if value.get(key) is None:
                if isinstance(item, Required):
                    raise Malformed(f"{where} has no {key!r}")
                continue
            _validate(value[key], item, f"{where}.{key}")
        return
    if isinstance(schema, MapOf):
        if not isinstance(value, dict):
            raise Malformed(f"{where} is not an object")
        for key, item in value.items():
            if item is not None:
                _validate(item, schema.values, f"{where}.{key}")
        return
    if isinstance(schema, list):
        if not isinstance(value, list):
            raise Malformed(f"{where} is not a list")
        for index, item in enumerate(value):
            _validate(item, schema[0], f"{where}[{index}]")
        return
    types = schema if isinstance(schema, tuple) else (schema,)
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise Malformed(f"{where} is not {_type_name(schema)}")
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        try:  # a number is formatted as a float: an integer beyond the float range is no number to show
            float(value)
        except OverflowError:
            raise Malformed(f"{where} is an integer too large for a number (beyond ±1.8e308)") from None


def _load(path: Path, schema_name: str) -> dict[str, Any]:
    """A side file read through the store (bounded, no link followed) and validated against its schema."""
    data: dict[str, Any] = read_json(path, what="result file")  # _validate checks it is one
    _validate(data, SCHEMAS[schema_name], path.name)
    return data


# ---------------------------------------------------------------------------- files, without following links


def _lstat_mode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except OSError:
        return 0


def _is_file(path: Path) -> bool:
    """A regular file at ``path`` itself: a link, even to a file, is not one."""
    return stat.S_ISREG(_lstat_mode(path))


def _existing(directory: Path, *names: str) -> list[Path]:
    return [directory / name for name in names if _is_file(directory / name)]


def _files(directory: Path, pattern: str) -> list[Path]:
    """Regular files (not links) of ``directory`` whose name matches the glob ``pattern``, sorted."""
    return sorted(path for path in directory.glob(pattern) if _is_file(path))


def _embedded(path: Path) -> str:
    """A markdown file to embed: bounded by MAX_EMBED_BYTES (a larger one skips its directory)."""
    return read_text(path, MAX_EMBED_BYTES, what="table to embed")


_ESCAPED = re.compile(r"[\\`*\[\]<>|#!~]|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")
MAX_FIELD_CHARS = 300


def _escape(value: Any) -> str:
    """A string from a file, safe inside a markdown line: one line, markup characters backslash-escaped."""
    text = _CONTROL.sub(" ", str(value))
    if len(text) > MAX_FIELD_CHARS:
        text = text[:MAX_FIELD_CHARS] + "..."
    return _ESCAPED.sub(lambda match: "\\" + match.group(0), text)


def _code(value: Any) -> str:
    """``value`` as an inline code span that no backtick in it can close early (CommonMark's longer fence)."""
    text = _CONTROL.sub(" ", str(value))
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _compact(values: dict[str, Any]) -> str:
    return _escape(", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()))


NOT_RECORDED = "not recorded by this command"


# ---------------------------------------------------------------------------- recognisers


def _grid_text(grid: dict[str, list[float]] | list[float]) -> str:
    if isinstance(grid, list):
        return ", ".join(f"{v:g}" for v in grid)
    return _escape("; ".join(f"{method}: {', '.join(f'{v:g}' for v in values)}" for method, values in grid.items()))


def _ablations(directory: Path) -> list[Section]:
    sections = []
    for manifest_path in _files(directory, "ablation-*.json"):
        manifest = _load(manifest_path, "ablation-*.json")
        if manifest.get("kind") != "ablation":
            continue
        stem = manifest_path.with_suffix("")
        settings = manifest.get("settings") or {}
        shown = {k: v for k, v in settings.items() if v not in (None, {}, [], "")}
        table = stem.with_suffix(".md")
        sections.append(Section(
            kind="ablation", directory=directory,
            title=_escape(f"Ablation on {manifest.get('what')} ({manifest.get('experiment')})"),
            provenance={
                "machine": _escape(manifest.get("machine", NOT_RECORDED)),
                "backend": _escape(manifest.get("backend", NOT_RECORDED)),
                "device": _escape(manifest.get("device", NOT_RECORDED)),
                "torch": _escape(manifest.get("torch", NOT_RECORDED)),
                "grid": _grid_text(manifest.get("grid") or {}),
                "settings": _compact(shown),
            },
            tables=[_embedded(table)] if _is_file(table) else [],
            images=_existing(directory, f"{stem.name}.png"),
            links=_existing(directory, f"{stem.name}.csv", f"{stem.name}-curves.csv", manifest_path.name),
        ))
    return sections


def _synthetic(directory: Path) -> list[Section]:
    if not (_is_file(directory / "summary.json") and _is_file(directory / "summary.md")):
        return []
    summary = _load(directory / "summary.json", "summary.json")
    methods = summary.get("methods") or {}
    backends = {str((info or {}).get("hparams", {}).get("backend")) for info in methods.values()} - {"None"}
    return [Section(
        kind="synthetic comparison", directory=directory, title=_escape(f"Synthetic comparison: {summary['problem']}"),
        provenance={
            "machine": NOT_RECORDED + " (drmoo synthetic runs on the CPU)",
            "backend": _escape(", ".join(sorted(backends))) if backends else "automatic (" + NOT_RECORDED + ")",
            "problem": _escape(summary.get("description", summary["problem"])),
            "settings": _escape(f"{summary.get('steps')} iterations, batch {summary.get('batch_size')}, "
                                f"seeds {', '.join(map(str, summary.get('seeds') or []))}"),
            **{f"hyperparameters of {_escape(m)}": _compact((info or {}).get("hparams") or {})
               for m, info in methods.items()},
        },
        tables=[_embedded(directory / "summary.md")],
        images=_existing(directory, "convergence.png"),
        links=_existing(directory, "metrics.csv", "convergence.csv", "summary.json"),
    )]


def _run_configs(directory: Path) -> tuple[list[dict[str, Any]], list[str], list[Path]]:
    """The valid config.json of ``directory``'s run sub-directories (no link followed), the refused ones,
    and the run directories read."""
    configs, refused, runs = [], [], []
    for child in _subdirectories(directory)[0]:
        path = child / "config.json"
        if not _is_file(path):
            continue
        try:
            configs.append(_load(path, "config.json"))
            runs.append(child)
        except (ValueError, OSError) as error:
            refused.append(f"{child.name}/config.json ({error})")
    return configs, refused, runs


def _environment_text(session: dict[str, Any]) -> str:
    """One training session's environment (environment.json), as a report line shows it."""
    gpu = f"GPU {session['gpu']} (CUDA {session.get('cuda')})" if session.get("gpu") else "no GPU"
    return (f"drmoo {session.get('drmoo', '?')}, torch {session['torch']}, {session.get('kernel_backend', '?')} "
            f"kernels, {session.get('device', '?')}, {session.get('torch_threads', '?')} threads x "
            f"{session.get('world_size', 1)} process(es), CPU {session.get('cpu_model', '?')} "
            f"({session.get('cpu_isa', '?')}), {gpu}")


def _sessions(path: Path) -> list[dict[str, Any]]:
    """The sessions of a run's environment.json: read bounded (:func:`~drmoo.experiments.environment.read_sessions`)
    and checked against its schema."""
    sessions = read_sessions(path)
    _validate({"sessions": sessions}, SCHEMAS["environment.json"], path.name)
    return sessions


def _environments(runs: list[Path]) -> str:
    """Where the runs' training sessions ran (their environment.json), and whether a retrain is bitwise."""
    sessions, unread = [], []
    for run in runs:
        path = run / ENVIRONMENT
        if not _is_file(path):
            unread.append(f"{run.name}: none (trained by an older drmoo)" if not os.path.lexists(path) else
                          f"{run.name}: {ENVIRONMENT} is not a regular file (a symbolic link, FIFO, directory or "
                          "device): not read")
            continue
        try:
            sessions += _sessions(path)
        except (ValueError, OSError) as error:
            unread.append(f"{run.name}: {error}")
    distinct = distinct_environments(sessions)  # linear: a dict keyed by the fields that decide the floats
    parts = [_environment_text(session) for session in distinct[:3]]
    if len(distinct) > 3:
        parts.append(f"and {len(distinct) - 3} more")
    count = f"{len(sessions)} session{'s' if len(sessions) != 1 else ''}"
    if len(distinct) == 1:
        parts.append(f"{count}, all in this environment (a retrain here repeats the floats bit for bit)")
    elif distinct:
        parts.append(f"{count} in {len(distinct)} environments (a retrain agrees statistically, not bitwise)")
    if unread:
        parts.append("not recorded: " + "; ".join(unread[:5]) + ("; ..." if len(unread) > 5 else ""))
    # each part shortened on its own: three long environments do not cut off the count or what was not read
    return "; ".join(_escape(part) for part in parts)


def _run_provenance(configs: list[dict[str, Any]], runs: list[Path]) -> dict[str, str]:
    """Machine, backend and settings from the config.json of one or more training runs, and where they ran."""
    if not configs:
        return {"settings": "no run config.json found"}
    configs = [upgrade_config_dict(config) for config in configs]  # an older run's "jacobian": the strategy
    first = configs[0]
    backends = sorted({str(c.get("backend") or "automatic") for c in configs})
    keys = ("experiment", "preset", "epochs", "max_steps", "batch_size", "input_size", "train_size", "test_size",
            "weights", "jacobian_strategy", "amp")
    provenance = {
        "environment": _environments(runs),
        "backend": _escape(", ".join(backends)),
        "settings": _compact({k: first[k] for k in keys if first.get(k) is not None}),
    }
    for config in configs:
        provenance.setdefault(f"hyperparameters of {_escape(config.get('method'))}",
                              _compact(config.get("hparams") or {}))
    return provenance


def _agreement_text(agreement: dict[str, Any]) -> str:
    def tau(value: Any) -> str:
        return f"{value:+.2f}" if isinstance(value, (int, float)) and value == value else "n/a"

    columns = ", ".join(f"{_escape(row.get('column'))} {tau(row.get('tau_b'))}"
                        for row in agreement.get("per_column") or [])
    mean = tau(agreement.get("mean_tau_b"))
    return (f"Kendall's τ_b between the paper's ordering of the methods and ours: mean {mean} ({columns}); "
            f"against {_escape(agreement.get('reference'))}")


def _table_rows(path: Path) -> Iterator[dict[str, str]]:
    for number, row in enumerate(iter_csv(path, what="comparison table"), start=1):
        if number > MAX_TABLE_ROWS:
            raise Malformed(f"{path.name} has more than the {MAX_TABLE_ROWS} rows a comparison table holds")
        yield row


def _paper_block(directory: Path, experiment: str | None) -> tuple[str | None, dict[str, Any] | None]:
    """Ours beside the paper, rebuilt from table.csv for comparisons written without it (CelebA, older runs).

    table.csv keeps only the mean over seeds, so ours shows no spread here.
    """
    from .paper_reference import reference_for
    from .summaries import side_by_side

    reference = reference_for(experiment or "")
    if reference is None:
        return None, None
    per_seed: dict[str, dict[Any, list[float]]] = {}
    columns: dict[Any, str] = {}
    try:
        for row in _table_rows(directory / "table.csv"):
            method = row.get("method")
            if not method:
                continue
            if "eps" in row and "mean_acc" in row:  # Table 1 layout: one row per (method, eps)
                eps = float(row["eps"])
                columns.setdefault(eps, "Clean" if eps == 0 else f"{eps:g}")
                per_seed.setdefault(method, {}).setdefault(eps, []).append(float(row["mean_acc"]))
            else:  # Table 2 layout: one row per method, a column per metric
                for key, label in zip(reference.columns, reference.labels):
                    if row.get(key) not in (None, ""):
                        columns.setdefault(key, label)
                        per_seed.setdefault(method, {}).setdefault(key, []).append(float(row[key]))
    except (OSError, ValueError):  # unreadable, refused or not numbers: no rebuilt block
        return None, None
    if not per_seed:
        return None, None
    header = ("Beside the paper (rebuilt by `drmoo report` from table.csv: ours is the mean over seeds; "
              "ranks in brackets)")
    table, _, agreement = side_by_side(experiment or "", list(columns.items()), per_seed, header)
    return table, agreement


def _robustness(directory: Path) -> list[Section]:
    if not (_is_file(directory / "table.md") and _is_file(directory / "table.csv")):
        return []
    configs, refused, runs = _run_configs(directory)
    provenance = _run_provenance(configs, runs)
    if refused:
        provenance["run configs not read"] = _escape("; ".join(refused))
    tables = [_embedded(directory / "table.md")]
    agreement = _load(directory / "agreement.json", "agreement.json") if _is_file(directory / "agreement.json") \
        else None  # drmoo compare's paper block is already in table.md
    if agreement is None:
        block, agreement = _paper_block(directory, configs[0].get("experiment") if configs else None)
        if block is not None:
            tables.append(block)
    if agreement is not None and agreement.get("per_column"):
        provenance["paper agreement"] = _agreement_text(agreement)
    if agreement is not None and agreement.get("eps_space"):
        provenance["FGSM eps"] = f"{_escape(agreement['eps_space'])} units"
    return [Section(
        kind="robustness comparison", directory=directory, title=f"Robustness comparison: {_escape(directory.name)}",
        provenance=provenance, tables=tables,
        images=_existing(directory, "robustness.png"),
        links=_existing(directory, "table.csv", "agreement.json", "dr-table.csv", "dr-paired.csv"),
    )]


def _wallclock(directory: Path) -> list[Section]:
    # bench-iter writes wallclock.* on a CPU and gpu-<device>-b<batch>.* on a GPU (a .csv beside each)
    tables = [directory / "wallclock.md", *_files(directory, "gpu-*.md")]
    sections = []
    for table in tables:
        csv_path = table.with_suffix(".csv")
        if not _is_file(table) or not (table.name == "wallclock.md" or _is_file(csv_path)):
            continue
        backends: set[str] = set()
        if _is_file(csv_path):
            backends = {row.get("backend") or "" for row in iter_csv(csv_path, what="wall-clock table")} - {""}
        text = _embedded(table)
        title_line = text.splitlines()[0].lstrip("# ").strip() if text.strip() else ""
        sections.append(Section(
            kind="wall-clock", directory=directory, title="Wall-clock time per iteration",
            provenance={
                # bench-iter puts model, batch, input size and the machine in its title line
                "machine and settings": _escape(title_line) or NOT_RECORDED,
                "backend": _escape(", ".join(sorted(backends))) or NOT_RECORDED,
            },
            tables=[text], images=_existing(directory, table.with_suffix(".png").name),
            links=_existing(directory, csv_path.name),
        ))
    return sections


def _kernel_benchmarks(directory: Path) -> list[Section]:
    sections = []
    for path in _files(directory, "*.md"):
        try:  # only the head decides whether it is a benchmark file: other markdown is never read whole
            if not read_head(path, len(BENCH_PREFIX), what="markdown file").startswith(BENCH_PREFIX.encode()):
                continue
        except (OSError, ValueError):
            continue
        text = _embedded(path)
        first, _, rest = text.partition("\n")
        machine = first[len(BENCH_PREFIX):].lstrip(": ").strip()
        backends = sorted({cells[3].strip() for cells in (line.split("|") for line in rest.splitlines())
                           if len(cells) > 4 and cells[1].strip() not in ("op", "") and not cells[1].startswith("-")})
        sections.append(Section(
            kind="kernel benchmarks", directory=directory, title=f"Kernel benchmarks: {_escape(path.stem)}",
            provenance={"machine": _escape(machine) or NOT_RECORDED,
                        "backend": _escape(", ".join(backends)) or NOT_RECORDED},
            tables=[rest.strip() + "\n"], links=_existing(directory, path.with_suffix(".json").name, path.name),
        ))
    return sections


def _csv_table(path: Path, max_rows: int = 40) -> str:
    """A CSV as a markdown table (numbers to 4 significant digits), the last ``max_rows`` rows.

    Streamed: only the last ``max_rows`` rows are kept, whatever the file's length.
    """
    last: deque[dict[str, str]] = deque(maxlen=max_rows)
    count = 0
    for row in iter_csv(path, what="metrics table"):
        last.append(row)
        count += 1
    if not last:
        return ""

    def cell(value: str) -> str:
        try:
            number = float(value)
        except ValueError:
            return _escape(value)
        return _escape(value) if number.is_integer() and "." not in value else f"{number:.4g}"

    columns = list(last[0])
    lines = [f"`{path.name}`" + (f" (last {max_rows} of {count} rows)" if count > max_rows else ""), "",
             "| " + " | ".join(_escape(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c] or "") for c in columns) + " |" for row in last]
    return "\n".join(lines) + "\n"


def _training_run(directory: Path) -> list[Section]:
    # A run that diverged before its first epoch ended has no metrics.csv: its marker makes it a result too.
    diverged = _is_file(directory / DIVERGED)
    if not (_is_file(directory / "config.json") and (_is_file(directory / "metrics.csv") or diverged)):
        return []
    config = _load(directory / "config.json", "config.json")
    tables = [_csv_table(directory / "metrics.csv")] if _is_file(directory / "metrics.csv") else []
    provenance = _run_provenance([config], [directory])
    marker = _load(directory / DIVERGED, DIVERGED) if diverged else None
    if marker is not None:
        saved = marker.get("saved_step")
        provenance["diverged"] = _escape(
            f"at step {marker['step']}" + (f" (its state after step {saved} is saved)" if saved is not None else "")
            + (f": {marker['reason'][:300]}" if marker.get("reason") else ""))
    if _is_file(directory / "eval.json"):
        report = _load(directory / "eval.json", "eval.json")
        if not report["results"]:
            raise Malformed("eval.json.results is empty")
        if result_matches_checkpoint(directory, report):
            from .robustness import eval_table

            _check_shown_eval(report)
            tables.append(eval_table(report))
        else:  # computed from other weights (the run was resumed since), or by an older drmoo: never shown
            provenance["eval.json"] = ("not shown: it was not computed from the checkpoint this run holds now "
                                       "(stale; `drmoo eval` the run again)")
    return [Section(
        kind="training run", directory=directory,
        title=_escape(f"Training run: {config.get('experiment')}, {config.get('method')}, seed {config.get('seed')}"
                      + (f", diverged at step {marker['step']}" if marker is not None else "")),
        provenance=provenance, tables=[t for t in tables if t],
        images=_files(directory, "*.png"),
        links=_existing(directory, "metrics.csv", "steps.csv", "eval.json", "config.json", ENVIRONMENT, DIVERGED),
    )]


RECOGNISERS: tuple[Callable[[Path], list[Section]], ...] = (
    _ablations, _synthetic, _robustness, _wallclock, _kernel_benchmarks, _training_run,
)


# ---------------------------------------------------------------------------- walking


def _subdirectories(directory: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The sub-directories to walk (never through a link) and the entries skipped with why; raises OSError."""
    children, skipped = [], []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith((".", "__")):
                continue
            if entry.is_symlink():  # a link's target is never read, whatever it points to
                skipped.append((Path(entry.path), "skipped: a symbolic link (drmoo report never follows one)"))
            elif entry.is_dir(follow_symlinks=False):
                children.append(Path(entry.path))
    return sorted(children), skipped


def _recognise(directory: Path) -> list[Section]:
    """Every recogniser's sections of ``directory``; :class:`Malformed` / UsageError / OSError when a file is bad."""
    try:
        return [section for recognise in RECOGNISERS for section in recognise(directory)]
    except (KeyError, TypeError, IndexError, AttributeError, OverflowError) as error:  # a shape the schemas let through
        raise Malformed(f"a result file of an unexpected shape ({type(error).__name__}: {error})") from None


def _walk(directory: Path, depth: int) -> tuple[list[Section], list[tuple[Path, str]]]:
    try:
        sections = _recognise(directory)
        children, skipped = _subdirectories(directory)
    except (ValueError, OSError) as error:  # a malformed, unreadable or oversized file; an unlistable directory
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        return [], [(directory, f"skipped: {reason}")]
    if sections:
        return sections, skipped
    found: list[Section] = []
    if depth < MAX_DEPTH:
        for child in children:
            child_sections, child_skipped = _walk(child, depth + 1)
            found += child_sections
            skipped += child_skipped
    if found:
        return found, skipped
    # Nothing here or below: report this directory once, not each empty descendant.
    try:
        files = sorted(entry.name for entry in os.scandir(directory) if entry.is_file(follow_symlinks=False))
    except OSError:
        files = []
    held = f"it holds {len(files)} file(s)" + (f": {', '.join(files[:5])}{', ...' if len(files) > 5 else ''}"
                                              if files else "")
    depth_note = f" (not searched below depth {MAX_DEPTH})" if depth >= MAX_DEPTH and children else ""
    return [], [*skipped, (directory, f"no recognised results (looked for {LOOKED_FOR}); {held}{depth_note}")]


def collect(paths: Sequence[str | Path]) -> tuple[list[Section], list[tuple[Path, str]]]:
    """The recognised sections under ``paths`` (in the given order, each directory once) and the skipped paths.

    A path given twice, or inside another one given, adds nothing the second time.
    """
    sections: list[Section] = []
    skipped: list[tuple[Path, str]] = []
    shown: set[Path] = set()  # the directories whose sections an earlier path already collected
    listed: set[tuple[Path, str]] = set()  # (path, reason) of the skipped entries already listed
    for raw in paths:
        path = Path(raw)
        mode = _lstat_mode(path)
        if not mode:
            skipped.append((path, "does not exist"))
        elif stat.S_ISLNK(mode):
            skipped.append((path, "is a symbolic link: not followed (give the directory it points to)"))
        elif not stat.S_ISDIR(mode):
            skipped.append((path, "is not a directory (give the directory that holds it)"))
        else:
            found, missed = _walk(path, 0)
            sections += [section for section in found if section.directory.resolve() not in shown]
            shown.update(section.directory.resolve() for section in found)
            for entry, reason in missed:
                if (key := (entry.parent.resolve() / entry.name, reason)) not in listed:
                    listed.add(key)
                    skipped.append((entry, reason))
    return sections, skipped


# ---------------------------------------------------------------------------- rendering

_HEADING = re.compile(r"^#{1,6}\s+")


def _demote(markdown: str) -> str:
    """Embedded headings become level 4, below the report's section headings."""
    return "\n".join(_HEADING.sub("#### ", line) for line in markdown.strip().splitlines())


def _relative(target: Path, base: Path) -> str:
    link = Path(os.path.relpath(target.resolve(), base.resolve())).as_posix()
    # CommonMark's <...> form for awkward paths; characters that would end it or the line are escaped
    link = _CONTROL.sub("", link)
    if any(ch in link for ch in " ()<>[]`\\"):
        return "<" + re.sub(r"[<>\\]", lambda match: "\\" + match.group(0), link) + ">"
    return link


def _render_section(number: int, section: Section, base: Path) -> list[str]:
    lines = [f"## {number}. {section.title}", "",
             f"*{section.kind}* in {_code(_relative(section.directory, base))}", ""]
    lines += [f"- **{key}**: {value}" for key, value in section.provenance.items() if value]
    if section.links:
        lines.append("- **files**: " + " · ".join(f"[{_escape(p.name)}]({_relative(p, base)})" for p in section.links))
    lines.append("")
    for table in section.tables:
        lines += [_demote(table), ""]
    for image in section.images:
        lines += [f"![{section.title}]({_relative(image, base)})", ""]
    return lines


def render(sections: list[Section], skipped: list[tuple[Path, str]], base: Path, title: str,
           sources: Sequence[str | Path]) -> str:
    """The report's markdown; links are relative to ``base`` (the report's directory)."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# {_escape(title)}", "", f"Collected {stamp} {REPORT_MARK} "
             + ", ".join(_code(s) for s in sources) + ".", ""]
    if sections:
        lines += ["| # | kind | result | directory |", "|---:|---|---|---|"]
        lines += [f"| {i} | {s.kind} | {s.title} | {_code(_relative(s.directory, base))} |"
                  for i, s in enumerate(sections, 1)]
        lines.append("")
    else:
        lines += ["No recognised results were found.", ""]
    for number, section in enumerate(sections, 1):
        lines += _render_section(number, section, base)
    if skipped:
        lines += ["## Skipped", ""]
        lines += [f"- {_code(path)}: {_escape(reason)}" for path, reason in skipped]
        lines.append("")
    return "\n".join(lines)


REPORT_MARK = "by `drmoo report` from:"  # in the second paragraph of every report
SIGNATURE = "<!-- drmoo report sha256:{digest} -->"  # the last line: the SHA-256 of everything above it
_SIGNATURE = re.compile(rb"<!-- drmoo report sha256:([0-9a-f]{64}) -->\n?\Z")


def _signed(text: str) -> bytes:
    """The report's bytes followed by its signature line (what makes it replaceable by the next report)."""
    body = (text if text.endswith("\n") else text + "\n").encode()
    return body + SIGNATURE.format(digest=hashlib.sha256(body).hexdigest()).encode() + b"\n"


def _is_unmodified_report(out: Path) -> bool:
    """Whether ``out`` is a report drmoo wrote, as it wrote it: its last line is the SHA-256 of the rest.

    Read through the store (no link followed, regular file); one over MAX_REPORT_BYTES is not read.
    """
    try:
        if regular_file_size(out, what="existing --out file") > MAX_REPORT_BYTES:
            return False
        data = read_bytes(out, MAX_REPORT_BYTES, what="existing --out file")
    except (ValueError, OSError):
        return False
    match = _SIGNATURE.search(data)
    return match is not None and hashlib.sha256(data[: match.start()]).hexdigest() == match.group(1).decode()


def _inside_a_run(directory: Path) -> Path | None:
    """The run directory ``directory`` is in (itself or an ancestor holding a checkpoint or a lock), or None."""
    for candidate in (directory, *directory.parents):
        if any(os.path.lexists(candidate / name) for name in (CHECKPOINT, LOCK_FILE)):
            return candidate
    return directory if os.path.lexists(directory / "config.json") else None


def _check_output(out: Path, paths: Sequence[str | Path]) -> Path:
    """The report's path, resolved; refused when it is an input, inside a run, or a file drmoo did not write."""
    if str(out) == "":
        raise UsageError("--out is an empty path (an unset shell variable?)")
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; give the markdown file to write, e.g. {out / 'report.md'}")
    if out.suffix.lower() != ".md":
        raise UsageError(f"--out {out}: the report is markdown; give a file name ending in .md")
    # Resolved ('..' and links in the directories above), so RUN/sub/../r.md is seen to be in RUN
    resolved = out.parent.resolve() / out.name
    run = _inside_a_run(resolved.parent)
    if run is not None:
        raise UsageError(f"--out {out} is inside the run directory {run}; write the report elsewhere")
    if os.path.lexists(resolved) and not _is_unmodified_report(resolved):
        raise UsageError(f"--out {out} exists and is not a report drmoo wrote, unmodified (it may be one of the "
                         "results it reads, or an edited report): refusing to overwrite it; pick another --out")
    for path in paths:
        if Path(path).resolve() == resolved:
            raise UsageError(f"--out {out} is also given in --runs: pick another --out")
    return resolved


def write_report(paths: Sequence[str | Path], out: str | Path, title: str = "drmoo results") -> tuple[int, int]:
    """Collect ``paths`` into the markdown file ``out``; returns (sections written, paths skipped).

    ``out`` must not be an input: an existing file is replaced only when it is a report drmoo wrote,
    unmodified (its signature line matches).
    """
    if not paths:
        raise UsageError("no result directories given (--runs DIR [DIR ...])")
    if any(str(path) == "" for path in paths):
        raise UsageError("--runs holds an empty path (an unset shell variable?)")
    resolved = _check_output(Path(out), paths)
    sections, skipped = collect(list(dict.fromkeys(str(path) for path in paths)))
    data = _signed(render(sections, skipped, resolved.parent, title, paths))
    if len(data) > MAX_REPORT_BYTES:
        raise UsageError(f"the report would hold {len(data)} bytes, more than the {MAX_REPORT_BYTES} it may: "
                         "report fewer directories")
    make_directory(resolved.parent, "report's directory")
    write_text(resolved, data.decode())
    return len(sections), len(skipped)
