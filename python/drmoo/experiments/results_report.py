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
====================  ==========================================================  ================

A recognised directory is not descended into (a comparison's run sub-directories are its own
inputs); an unrecognised one is, and if nothing below it is recognised it is listed as skipped
with the reason.  Tables are embedded, PNGs linked with paths relative to the report.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from drmoo.store import UsageError, make_directory, read_csv, read_head, read_json, read_text, write_text

from .checkpoints import CHECKPOINT

__all__ = ["Section", "collect", "render", "write_report"]

BENCH_PREFIX = "# drmoo kernel benchmarks"
MAX_DEPTH = 8  # deeper trees are not result layouts any command writes
LOOKED_FOR = ("ablation-*.json, summary.json + summary.md, table.md + table.csv, wallclock.md, gpu-*.md + .csv, "
              f"a '{BENCH_PREFIX}' .md, config.json + metrics.csv")


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


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = read_json(path, what="result file")
    except (OSError, ValueError):
        return None  # unreadable or half-written: the directory is treated as not holding that result
    return data if isinstance(data, dict) else None


def _existing(directory: Path, *names: str) -> list[Path]:
    return [directory / name for name in names if (directory / name).is_file()]


def _compact(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


NOT_RECORDED = "not recorded by this command"


# ---------------------------------------------------------------------------- recognisers


def _grid_text(grid: dict[str, list[float]] | list[float]) -> str:
    if isinstance(grid, list):
        return ", ".join(f"{v:g}" for v in grid)
    return "; ".join(f"{method}: {', '.join(f'{v:g}' for v in values)}" for method, values in grid.items())


def _ablations(directory: Path) -> list[Section]:
    sections = []
    for manifest_path in sorted(directory.glob("ablation-*.json")):
        manifest = _read_json(manifest_path)
        if manifest is None or manifest.get("kind") != "ablation":
            continue
        stem = manifest_path.with_suffix("")
        settings = manifest.get("settings", {})
        shown = {k: v for k, v in settings.items() if v not in (None, {}, [], "")}
        table = stem.with_suffix(".md")
        sections.append(Section(
            kind="ablation", directory=directory,
            title=f"Ablation on {manifest.get('what')} ({manifest.get('experiment')})",
            provenance={
                "machine": str(manifest.get("machine", NOT_RECORDED)),
                "backend": str(manifest.get("backend", NOT_RECORDED)),
                "device": str(manifest.get("device", NOT_RECORDED)),
                "torch": str(manifest.get("torch", NOT_RECORDED)),
                "grid": _grid_text(manifest.get("grid", {})),
                "settings": _compact(shown),
            },
            tables=[read_text(table)] if table.is_file() else [],
            images=_existing(directory, f"{stem.name}.png"),
            links=_existing(directory, f"{stem.name}.csv", f"{stem.name}-curves.csv", manifest_path.name),
        ))
    return sections


def _synthetic(directory: Path) -> list[Section]:
    summary = _read_json(directory / "summary.json")
    if summary is None or "problem" not in summary or not (directory / "summary.md").is_file():
        return []
    methods = summary.get("methods", {})
    backends = {str(info.get("hparams", {}).get("backend")) for info in methods.values()} - {"None"}
    return [Section(
        kind="synthetic comparison", directory=directory, title=f"Synthetic comparison: {summary['problem']}",
        provenance={
            "machine": NOT_RECORDED + " (drmoo synthetic runs on the CPU)",
            "backend": ", ".join(sorted(backends)) if backends else "automatic (" + NOT_RECORDED + ")",
            "problem": str(summary.get("description", summary["problem"])),
            "settings": f"{summary.get('steps')} iterations, batch {summary.get('batch_size')}, "
                        f"seeds {', '.join(map(str, summary.get('seeds', [])))}",
            **{f"hyperparameters of {m}": _compact(info.get("hparams", {})) for m, info in methods.items()},
        },
        tables=[read_text(directory / "summary.md")],
        images=_existing(directory, "convergence.png"),
        links=_existing(directory, "metrics.csv", "convergence.csv", "summary.json"),
    )]


def _run_configs(directory: Path) -> list[dict[str, Any]]:
    configs = []
    for path in sorted(directory.glob("*/config.json")):
        config = _read_json(path)
        if config is not None:
            configs.append(config)
    return configs


def _run_provenance(configs: list[dict[str, Any]]) -> dict[str, str]:
    """Machine, backend and settings from the config.json of one or more training runs."""
    if not configs:
        return {"settings": "no run config.json found"}
    first = configs[0]
    backends = sorted({str(c.get("backend") or "automatic") for c in configs})
    keys = ("experiment", "preset", "epochs", "max_steps", "batch_size", "input_size", "train_size", "test_size",
            "weights", "jacobian", "amp")
    provenance = {
        "machine": f"device {first.get('device', '?')} (machine model " + NOT_RECORDED + ")",
        "backend": ", ".join(backends),
        "settings": _compact({k: first[k] for k in keys if first.get(k) is not None}),
    }
    for config in configs:
        provenance.setdefault(f"hyperparameters of {config.get('method')}", _compact(config.get("hparams", {})))
    return provenance


def _agreement_text(agreement: dict[str, Any]) -> str:
    def tau(value: Any) -> str:
        return f"{value:+.2f}" if isinstance(value, (int, float)) and value == value else "n/a"

    columns = ", ".join(f"{row.get('column')} {tau(row.get('tau_b'))}" for row in agreement.get("per_column", []))
    mean = tau(agreement.get("mean_tau_b"))
    return (f"Kendall's τ_b between the paper's ordering of the methods and ours: mean {mean} ({columns}); "
            f"against {agreement.get('reference')}")


def _paper_block(directory: Path, experiment: str | None) -> tuple[str | None, dict[str, Any] | None]:
    """Ours beside the paper, rebuilt from table.csv for comparisons written without it (CelebA, older runs).

    table.csv keeps only the mean over seeds, so ours shows no spread here.
    """
    from .paper_reference import reference_for
    from .summaries import side_by_side

    reference = reference_for(experiment or "")
    if reference is None:
        return None, None
    try:
        rows = read_csv(directory / "table.csv", what="comparison table")
    except (OSError, ValueError):
        return None, None
    per_seed: dict[str, dict[Any, list[float]]] = {}
    columns: dict[Any, str] = {}
    for row in rows:
        method = row.get("method")
        if not method:
            continue
        try:
            if "eps" in row and "mean_acc" in row:  # Table 1 layout: one row per (method, eps)
                eps = float(row["eps"])
                columns.setdefault(eps, "Clean" if eps == 0 else f"{eps:g}")
                per_seed.setdefault(method, {}).setdefault(eps, []).append(float(row["mean_acc"]))
            else:  # Table 2 layout: one row per method, a column per metric
                for key, label in zip(reference.columns, reference.labels):
                    if row.get(key) not in (None, ""):
                        columns.setdefault(key, label)
                        per_seed.setdefault(method, {}).setdefault(key, []).append(float(row[key]))
        except ValueError:
            return None, None
    if not per_seed:
        return None, None
    header = ("Beside the paper (rebuilt by `drmoo report` from table.csv: ours is the mean over seeds; "
              "ranks in brackets)")
    table, _, agreement = side_by_side(experiment or "", list(columns.items()), per_seed, header)
    return table, agreement


def _robustness(directory: Path) -> list[Section]:
    if not ((directory / "table.md").is_file() and (directory / "table.csv").is_file()):
        return []
    configs = _run_configs(directory)
    provenance = _run_provenance(configs)
    tables = [read_text(directory / "table.md")]
    agreement = _read_json(directory / "agreement.json")  # drmoo compare's paper block is already in table.md
    if agreement is None:
        block, agreement = _paper_block(directory, configs[0].get("experiment") if configs else None)
        if block is not None:
            tables.append(block)
    if agreement is not None and agreement.get("per_column"):
        provenance["paper agreement"] = _agreement_text(agreement)
    if agreement is not None and agreement.get("eps_space"):
        provenance["FGSM eps"] = f"{agreement['eps_space']} units"
    return [Section(
        kind="robustness comparison", directory=directory, title=f"Robustness comparison: {directory.name}",
        provenance=provenance, tables=tables,
        images=_existing(directory, "robustness.png"),
        links=_existing(directory, "table.csv", "agreement.json"),
    )]


def _wallclock(directory: Path) -> list[Section]:
    # bench-iter writes wallclock.* on a CPU and gpu-<device>-b<batch>.* on a GPU (a .csv beside each)
    tables = [directory / "wallclock.md", *sorted(directory.glob("gpu-*.md"))]
    sections = []
    for table in tables:
        if not table.is_file() or not (table.name == "wallclock.md" or table.with_suffix(".csv").is_file()):
            continue
        backends: set[str] = set()
        if table.with_suffix(".csv").is_file():
            backends = {row.get("backend") or "" for row in read_csv(table.with_suffix(".csv"))} - {""}
        text = read_text(table)
        title_line = text.splitlines()[0].lstrip("# ").strip() if text.strip() else ""
        sections.append(Section(
            kind="wall-clock", directory=directory, title="Wall-clock time per iteration",
            provenance={
                # bench-iter puts model, batch, input size and the machine in its title line
                "machine and settings": title_line or NOT_RECORDED,
                "backend": ", ".join(sorted(backends)) or NOT_RECORDED,
            },
            tables=[text], images=_existing(directory, table.with_suffix(".png").name),
            links=_existing(directory, table.with_suffix(".csv").name),
        ))
    return sections


def _kernel_benchmarks(directory: Path) -> list[Section]:
    sections = []
    for path in sorted(directory.glob("*.md")):
        try:
            text = read_text(path)
        except (OSError, ValueError):  # unreadable, not UTF-8 or refused by the store
            continue
        first, _, rest = text.partition("\n")
        if not first.startswith(BENCH_PREFIX):
            continue
        machine = first[len(BENCH_PREFIX):].lstrip(": ").strip()
        backends = sorted({cells[3].strip() for cells in (line.split("|") for line in rest.splitlines())
                           if len(cells) > 4 and cells[1].strip() not in ("op", "") and not cells[1].startswith("-")})
        sections.append(Section(
            kind="kernel benchmarks", directory=directory, title=f"Kernel benchmarks: {path.stem}",
            provenance={"machine": machine or NOT_RECORDED, "backend": ", ".join(backends) or NOT_RECORDED},
            tables=[rest.strip() + "\n"], links=_existing(directory, path.with_suffix(".json").name, path.name),
        ))
    return sections


def _csv_table(path: Path, max_rows: int = 40) -> str:
    """A CSV as a markdown table (numbers to 4 significant digits), the last ``max_rows`` rows."""
    rows = read_csv(path)
    if not rows:
        return ""

    def cell(value: str) -> str:
        try:
            number = float(value)
        except ValueError:
            return value
        return value if number.is_integer() and "." not in value else f"{number:.4g}"

    columns = list(rows[0])
    lines = [f"`{path.name}`" + (f" (last {max_rows} of {len(rows)} rows)" if len(rows) > max_rows else ""), "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c] or "") for c in columns) + " |" for row in rows[-max_rows:]]
    return "\n".join(lines) + "\n"


def _training_run(directory: Path) -> list[Section]:
    config = _read_json(directory / "config.json")
    if config is None or not (directory / "metrics.csv").is_file():
        return []
    tables = [_csv_table(directory / "metrics.csv")]
    report = _read_json(directory / "eval.json")
    if report is not None and report.get("results"):
        from .robustness import eval_table

        tables.append(eval_table(report))
    return [Section(
        kind="training run", directory=directory,
        title=f"Training run: {config.get('experiment')}, {config.get('method')}, seed {config.get('seed')}",
        provenance=_run_provenance([config]), tables=[t for t in tables if t],
        images=sorted(directory.glob("*.png")),
        links=_existing(directory, "metrics.csv", "steps.csv", "eval.json", "config.json"),
    )]


RECOGNISERS: tuple[Callable[[Path], list[Section]], ...] = (
    _ablations, _synthetic, _robustness, _wallclock, _kernel_benchmarks, _training_run,
)


# ---------------------------------------------------------------------------- walking


def _walk(directory: Path, depth: int) -> tuple[list[Section], list[tuple[Path, str]]]:
    sections = [s for recognise in RECOGNISERS for s in recognise(directory)]
    if sections:
        return sections, []
    children = sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    found: list[Section] = []
    skipped: list[tuple[Path, str]] = []
    if depth < MAX_DEPTH:
        for child in children:
            child_sections, child_skipped = _walk(child, depth + 1)
            found += child_sections
            skipped += child_skipped
    if found:
        return found, skipped
    # Nothing here or below: report this directory once, not each empty descendant.
    files = sorted(p.name for p in directory.iterdir() if p.is_file())
    held = f"it holds {len(files)} file(s)" + (f": {', '.join(files[:5])}{', ...' if len(files) > 5 else ''}"
                                              if files else "")
    depth_note = f" (not searched below depth {MAX_DEPTH})" if depth >= MAX_DEPTH and children else ""
    return [], [(directory, f"no recognised results (looked for {LOOKED_FOR}); {held}{depth_note}")]


def collect(paths: Sequence[str | Path]) -> tuple[list[Section], list[tuple[Path, str]]]:
    """The recognised sections under ``paths`` (in the given order) and the skipped paths with reasons."""
    sections: list[Section] = []
    skipped: list[tuple[Path, str]] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            skipped.append((path, "does not exist"))
        elif not path.is_dir():
            skipped.append((path, "is not a directory (give the directory that holds it)"))
        else:
            found, missed = _walk(path, 0)
            sections += found
            skipped += missed
    return sections, skipped


# ---------------------------------------------------------------------------- rendering

_HEADING = re.compile(r"^#{1,6}\s+")


def _demote(markdown: str) -> str:
    """Embedded headings become level 4, below the report's section headings."""
    return "\n".join(_HEADING.sub("#### ", line) for line in markdown.strip().splitlines())


def _relative(target: Path, base: Path) -> str:
    link = Path(os.path.relpath(target.resolve(), base.resolve())).as_posix()
    return f"<{link}>" if any(ch in link for ch in " ()") else link  # CommonMark form for awkward paths


def _render_section(number: int, section: Section, base: Path) -> list[str]:
    lines = [f"## {number}. {section.title}", "", f"*{section.kind}* in `{_relative(section.directory, base)}`", ""]
    lines += [f"- **{key}**: {value}" for key, value in section.provenance.items() if value]
    if section.links:
        lines.append("- **files**: " + " · ".join(f"[{p.name}]({_relative(p, base)})" for p in section.links))
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
    lines = [f"# {title}", "", f"Collected {stamp} {REPORT_MARK} "
             + ", ".join(f"`{s}`" for s in sources) + ".", ""]
    if sections:
        lines += ["| # | kind | result | directory |", "|---:|---|---|---|"]
        lines += [f"| {i} | {s.kind} | {s.title} | `{_relative(s.directory, base)}` |"
                  for i, s in enumerate(sections, 1)]
        lines.append("")
    else:
        lines += ["No recognised results were found.", ""]
    for number, section in enumerate(sections, 1):
        lines += _render_section(number, section, base)
    if skipped:
        lines += ["## Skipped", ""]
        lines += [f"- `{path}`: {reason}" for path, reason in skipped]
        lines.append("")
    return "\n".join(lines)


REPORT_MARK = "by `drmoo report` from:"  # in the second paragraph of every report: a file drmoo may replace
REPORT_HEAD_BYTES = 4096  # where REPORT_MARK is looked for: only this much of an existing --out file is read


def _check_output(out: Path, paths: Sequence[str | Path]) -> None:
    """Refuse an output that is an input: inside a run directory, or an existing file drmoo report did not write."""
    if str(out) == "":
        raise UsageError("--out is an empty path (an unset shell variable?)")
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; give the markdown file to write, e.g. {out / 'report.md'}")
    if out.suffix.lower() != ".md":
        raise UsageError(f"--out {out}: the report is markdown; give a file name ending in .md")
    if (out.parent / CHECKPOINT).exists() or (out.parent / "config.json").exists():
        raise UsageError(f"--out {out} is inside a run directory; write the report elsewhere")
    if os.path.lexists(out):
        try:
            head = read_head(out, REPORT_HEAD_BYTES, what="existing --out file").decode(errors="replace")
        except (UsageError, FileNotFoundError):
            head = ""
        if REPORT_MARK not in head:
            raise UsageError(f"--out {out} exists and is not a report drmoo report wrote (it may be one of the "
                             "results it reads): refusing to overwrite it; pick another --out")
    resolved = out.resolve()
    for path in paths:
        if Path(path).resolve() == resolved:
            raise UsageError(f"--out {out} is also given in --runs: pick another --out")


def write_report(paths: Sequence[str | Path], out: str | Path, title: str = "drmoo results") -> tuple[int, int]:
    """Collect ``paths`` into the markdown file ``out``; returns (sections written, paths skipped).

    ``out`` must not be an input: an existing file is replaced only when drmoo report wrote it.
    """
    if not paths:
        raise UsageError("no result directories given (--runs DIR [DIR ...])")
    if any(str(path) == "" for path in paths):
        raise UsageError("--runs holds an empty path (an unset shell variable?)")
    out = Path(out)
    _check_output(out, paths)
    sections, skipped = collect(paths)
    text = render(sections, skipped, out.parent, title, paths)
    make_directory(out.parent, "report's directory")
    write_text(out, text)
    return len(sections), len(skipped)
