"""Aggregation over seeds, convergence plots and markdown tables for the experiments."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["aggregate_curves", "plot_convergence", "summary_table"]


def aggregate_curves(records: list[dict[str, Any]], key: str = "balanced_grad_norm") -> list[dict[str, Any]]:
    """Mean, std, min and max of ``key`` over seeds, per (method, iteration), with mean samples."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        groups[(record["method"], int(record["iteration"]))].append(record)
    curves = []
    for (method, iteration), rows in sorted(groups.items()):
        values = [float(r[key]) for r in rows]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1))
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
    for axis, label in zip(axes, ("iteration", "samples consumed")):
        axis.set_xlabel(label)
        axis.set_ylabel("balanced gradient norm ||∇L w||")
        axis.set_yscale("log")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    seeds = max((c["seeds"] for c in curves), default=1)
    spread = ", band = min..max)" if seeds > 1 else ")"
    fig.suptitle(f"{title} (mean over {seeds} seed{'s' if seeds > 1 else ''}{spread}")
    fig.savefig(path, dpi=120)
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
