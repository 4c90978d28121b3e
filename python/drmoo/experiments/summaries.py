"""Aggregation over seeds, convergence plots and markdown tables for the experiments.

Also the comparison with the paper: our mean ± std over seeds and rank per column beside the
paper's numbers (:mod:`drmoo.experiments.paper_reference`), and Kendall's tau-b between the two
orderings of the methods.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from drmoo.store import read_json, write_figure

__all__ = ["aggregate_curves", "agreement_markdown", "fgsm_comparison", "kendall_tau_b", "mean_std", "mean_std_text",
           "plot_convergence", "ranks", "side_by_side", "summary_table", "training_progress"]


def aggregate_curves(records: list[dict[str, Any]], key: str = "balanced_grad_norm") -> list[dict[str, Any]]:
    """Mean, std, min and max of ``key`` over seeds, per (method, iteration), with mean samples."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        groups[(record["method"], int(record["iteration"]))].append(record)
    curves = []
    for (method, iteration), rows in sorted(groups.items()):
        values = [float(r[key]) for r in rows]
        mean, std = mean_std(values)
        curves.append({
            "method": method,
            "iteration": iteration,
            "samples": sum(int(r["samples"]) for r in rows) / len(rows),
            f"{key}_mean": mean,
            f"{key}_std": std,
            f"{key}_min": min(values),
            f"{key}_max": max(values),
            "seeds": len(values),
        })
    return curves


def style_norm_axes(axes: Sequence[Any]) -> None:
    """The two panels of a convergence plot (per iteration, per sample consumed): labels, log scale, legend."""
    for axis, label in zip(axes, ("iteration", "samples consumed")):
        axis.set_xlabel(label)
        axis.set_ylabel("balanced gradient norm ||∇L w||")
        axis.set_yscale("log")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)


def plot_convergence(
    curves: list[dict[str, Any]], path: Path, title: str, key: str = "balanced_grad_norm"
) -> None:
    """Two panels (vs iterations, vs samples consumed), one line per method, min-max band over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(c["method"] for c in curves))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for method in methods:
        rows = [c for c in curves if c["method"] == method]
        mean = [c[f"{key}_mean"] for c in rows]
        low = [c[f"{key}_min"] for c in rows]
        high = [c[f"{key}_max"] for c in rows]
        for axis, x_key in zip(axes, ("iteration", "samples")):
            xs = [c[x_key] for c in rows]
            (line,) = axis.plot(xs, mean, label=method, linewidth=1.4)
            if rows and rows[0]["seeds"] > 1:
                axis.fill_between(xs, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    axes[1].set_xscale("log")  # sample costs differ by 20x between methods (Double-Loop's inner draws)
    style_norm_axes(axes)
    seeds = max((c["seeds"] for c in curves), default=1)
    spread = ", band = min..max)" if seeds > 1 else ")"
    fig.suptitle(f"{title} (mean over {seeds} seed{'s' if seeds > 1 else ''}{spread}")
    write_figure(fig, path, dpi=120)
    plt.close(fig)


def summary_table(summary: dict[str, Any]) -> str:
    """Markdown: final / last-20 balanced gradient norm per method (mean ± std over seeds)."""
    seeds = summary["seeds"]
    lines = [
        f"### {summary['problem']}: balanced gradient norm after {summary['steps']} iterations "
        f"(batch {summary['batch_size']}, seeds {', '.join(map(str, seeds))})",
        "",
        "| method | first | final (mean ± std) | mean of last 20 | samples / iteration |",
        "|---|---:|---:|---:|---:|",
    ]
    for method, info in summary["methods"].items():
        first, final, last20 = (info[k] for k in (
            "first_balanced_grad_norm", "final_balanced_grad_norm", "mean_last20_balanced_grad_norm"
        ))
        lines.append(
            f"| {method} | {first['mean']:.4g} | {final['mean']:.4g} ± {final['std']:.2g} | "
            f"{last20['mean']:.4g} | {info['samples_per_iteration']} |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- ours beside the paper's


def kendall_tau_b(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b of two equally long sequences (ties in either corrected for); NaN when undefined.

    :func:`scipy.stats.kendalltau` with ``variant="b"``.  Undefined (NaN) with fewer than two items
    or when every pair is tied in x or in y.
    """
    if len(x) != len(y):
        raise ValueError(f"kendall_tau_b needs sequences of one length, got {len(x)} and {len(y)}")
    if len(x) < 2:
        return math.nan
    import warnings

    from scipy import stats

    with warnings.catch_warnings():  # a constant sequence: NaN is the answer, not a warning
        warnings.simplefilter("ignore")
        return float(stats.kendalltau(x, y, variant="b").statistic)


def ranks(values: dict[str, float]) -> dict[str, float]:
    """Rank of each key by value, 1 = the highest; ties share their mean rank; NaN values get no rank."""
    from scipy import stats

    finite = {key: value for key, value in values.items() if not math.isnan(value)}
    ordered = stats.rankdata([-value for value in finite.values()], method="average")
    return {key: float(rank) for key, rank in zip(finite, ordered)}


def _rank_text(rank: float | None) -> str:
    if rank is None:
        return "–"
    return f"{rank:.0f}" if float(rank).is_integer() else f"{rank:g}"


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value); NaN, NaN for none.  Every table's one copy."""
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1))


def mean_std_text(mean: float, std: float, seeds: int) -> str:
    """A table cell: ``mean ± std`` (2 decimals) over several seeds, the mean alone for one."""
    return f"{mean:.2f} ± {std:.2f}" if seeds > 1 else f"{mean:.2f}"


def side_by_side(
    experiment: str,
    columns: Sequence[tuple[Any, str]],
    per_seed: dict[str, dict[Any, list[float]]],
    header: str,
    extra: dict[str, dict[str, str]] | None = None,
) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """Our mean ± std over seeds and rank per column, the paper's value and rank beside it, and Kendall's tau.

    ``columns`` are (key, label) pairs: an FGSM eps or a metric key, and its heading.
    ``per_seed[method][key]`` holds one value (%) per seed.  ``extra[method]`` adds columns after
    the paper block (e.g. iterations, samples seen).  Ranks are over the methods of this
    comparison (1 = best, ties share the mean rank), ours by the mean over seeds and the paper's
    among the same methods; tau_b compares the two orderings per column over the methods both
    have.  Returns the markdown, one row per (method, column) for a CSV, and the agreement
    (per column tau_b, the number of methods it compares, and their mean).
    """
    from .paper_reference import reference_for

    reference = reference_for(experiment)
    methods = list(per_seed)
    stats = {m: {key: mean_std(per_seed[m].get(key, [])) for key, _ in columns} for m in methods}
    seeds = {m: {key: len(per_seed[m].get(key, [])) for key, _ in columns} for m in methods}
    our_ranks = {key: ranks({m: stats[m][key][0] for m in methods}) for key, _ in columns}
    paper: dict[Any, dict[str, float]] = {key: {} for key, _ in columns}
    if reference is not None:
        for key, _ in columns:
            for method in methods:
                value = reference.value(method, key)
                if value is not None:
                    paper[key][method] = value
    paper_ranks = {key: ranks(paper[key]) for key, _ in columns}
    in_paper = [(key, label) for key, label in columns if paper[key]]

    agreement_rows = []
    for key, label in in_paper:
        both = [m for m in methods if m in paper[key] and not math.isnan(stats[m][key][0])]
        tau = kendall_tau_b([paper[key][m] for m in both], [stats[m][key][0] for m in both]) if both else math.nan
        agreement_rows.append({"column": label, "key": key, "tau_b": tau, "methods": len(both)})
    finite = [row["tau_b"] for row in agreement_rows if not math.isnan(row["tau_b"])]
    agreement = {
        "experiment": experiment, "source": reference.source if reference else None,
        "reference": reference.title if reference else None, "per_column": agreement_rows,
        "mean_tau_b": sum(finite) / len(finite) if finite else math.nan,
    }

    extra_columns = list(dict.fromkeys(name for cells in (extra or {}).values() for name in cells))
    headings = [f"{label} (ours)" for _, label in columns] + [f"{label} (paper)" for _, label in in_paper]
    lines = [header, "", "| method | " + " | ".join(headings + extra_columns) + " |",
             "|---|" + "---:|" * (len(headings) + len(extra_columns))]
    rows = []
    for method in methods:
        cells = []
        for key, _ in columns:
            mean, std = stats[method][key]
            rank = our_ranks[key].get(method)
            if math.isnan(mean):
                cells.append("n/a")
            else:
                cells.append(f"{mean_std_text(mean, std, seeds[method][key])} ({_rank_text(rank)})")
            rows.append({"method": method, "column": key, "mean": mean, "std": std, "seeds": seeds[method][key],
                         "rank": rank, "paper": paper[key].get(method), "paper_rank": paper_ranks[key].get(method)})
        for key, _ in in_paper:
            value = paper[key].get(method)
            cells.append("–" if value is None else f"{value:.2f} ({_rank_text(paper_ranks[key].get(method))})")
        cells += [(extra or {}).get(method, {}).get(name, "") for name in extra_columns]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: ours, mean ± std over seeds; the paper's, one reported number; in brackets the rank among "
              "the methods of this table (1 = best, ties share the mean rank)."]
    if reference is None:
        lines.append(f"The paper reports no numbers for {experiment}.")
    else:
        lines += [f"Paper columns: {reference.title}; {reference.source}.", "", agreement_markdown(agreement)]
    return "\n".join(lines) + "\n", rows, agreement


def agreement_markdown(agreement: dict[str, Any]) -> str:
    """Kendall's tau_b between the paper's ordering of the methods and ours, one column per table column."""
    per_column = agreement["per_column"]
    if not per_column:
        return "No column of this comparison is in the paper: no agreement to measure.\n"

    def text(tau: float) -> str:
        return "n/a" if tau is None or math.isnan(tau) else f"{tau:+.2f}"

    lines = [
        "Agreement with the paper's ordering of the methods: Kendall's τ_b per column (+1 same order, "
        "-1 reversed, 0 unrelated).",
        "",
        "| | " + " | ".join(row["column"] for row in per_column) + " | mean |",
        "|---|" + "---:|" * (len(per_column) + 1),
        "| τ_b | " + " | ".join(text(row["tau_b"]) for row in per_column) + f" | {text(agreement['mean_tau_b'])} |",
        "| methods | " + " | ".join(str(row["methods"]) for row in per_column) + " | |",
    ]
    return "\n".join(lines) + "\n"


def training_progress(run_dir: Path) -> dict[str, int]:
    """Iterations run and training samples drawn (all batches of every iteration), from metrics.json.

    An "epoch" is ceil(N / B) iterations for every method, but the methods draw different numbers
    of batches per iteration (Double-Clip 2, Double-Loop 1 + its inner steps, ...), so the samples
    drawn are what compares their data budgets.  {} when the run has no metrics yet.
    """
    try:
        epochs = read_json(run_dir / "metrics.json", what="metrics file")
    except (OSError, ValueError):  # missing, unreadable or refused (a UsageError is a ValueError)
        return {}
    if not isinstance(epochs, list) or not epochs or not isinstance(epochs[-1], dict):
        return {}
    last = epochs[-1]
    progress = {}
    for name, key in (("iterations", "step"), ("samples_seen", "samples")):
        if isinstance(last.get(key), int) and not isinstance(last.get(key), bool):
            progress[name] = last[key]
    return progress


def fgsm_comparison(
    reports: list[dict[str, Any]], eps_values: Sequence[float], header: str, experiment: str
) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """Table 1 beside the paper: accuracy (%) under FGSM per method and eps, iterations and samples seen.

    ``reports`` are eval.json reports (``method``, ``results`` [{eps, mean_acc}]) with the
    ``iterations`` / ``samples_seen`` of :func:`training_progress` where known.
    """
    per_seed: dict[str, dict[Any, list[float]]] = {}
    budget: dict[str, dict[str, list[int]]] = {}
    for report in reports:
        row = report.get("label") or report["method"]  # a variant's label names its own row
        mine = per_seed.setdefault(row, {eps: [] for eps in eps_values})
        for result in report["results"]:
            for eps in eps_values:
                if math.isclose(result["eps"], eps, rel_tol=0.0, abs_tol=1e-12):
                    mine[eps].append(100 * result["mean_acc"])
        spent = budget.setdefault(row, {"iterations": [], "samples seen": []})
        for name, key in (("iterations", "iterations"), ("samples seen", "samples_seen")):
            if key in report:
                spent[name].append(int(report[key]))
    extra = {
        method: {name: (f"{round(sum(v) / len(v)):,}" if v else "n/a") for name, v in spent.items()}
        for method, spent in budget.items()
    }
    columns = [(eps, "Clean" if eps == 0 else f"{eps:g}") for eps in eps_values]
    table, rows, agreement = side_by_side(experiment, columns, per_seed, header, extra)
    for row in rows:  # robustness.csv's columns since before the paper block: method, eps, mean_acc, std_acc, seeds
        row["eps"] = row.pop("column")
        row["mean_acc"], row["std_acc"] = row.pop("mean"), row.pop("std")
        spent = budget[row["method"]]
        row["iterations"] = sum(spent["iterations"]) / len(spent["iterations"]) if spent["iterations"] else None
        row["samples_seen"] = sum(spent["samples seen"]) / len(spent["samples seen"]) if spent["samples seen"] else None
    return table, rows, agreement
