"""The robustness metrics in ``drmoo compare``: mean ± std over seeds per row and paired differences.

Every task-averaged number of a run's eval.json robustness block (:mod:`drmoo.experiments.robust_eval`)
becomes one column, named ``<where>:<metric>``: ``clean:cvar_0.05``, ``T:ece`` (with the fitted
temperature), ``eps=0.03:mean_loss`` (under FGSM), ``label=2:accuracy`` (label shift at that strength or
digit factor), ``noise=0.2:cvar_0.1`` (pixel noise of that sigma); a shift's column with the clean split's
temperature carries ``T@`` (``T@noise=0.2:cvar_0.1``).  ``dr-table.csv`` holds every column's
mean ± std over seeds per row, ``dr-paired.csv`` the reference row minus every other row per column
(:func:`drmoo.experiments.paired_stats.paired_differences`), and also minus every row with its fitted
temperature (rows ``<row>+T``: that row's ``T:`` and ``T@`` numbers paired with the reference's unscaled ones, what a
recalibration of the other row gives without the reference's training); table.md shows the clean and
temperature-scaled summary columns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from drmoo.store import remove_file, write_csv

from .paired_stats import paired_differences, paired_markdown
from .summaries import mean_std

__all__ = ["SHOWN", "dr_columns", "dr_comparison", "unscaled_column"]

# the columns table.md shows (dr-table.csv and dr-paired.csv hold every column)
SHOWN = ("clean:mean_loss", "clean:cvar_0.05", "clean:robust_run", "clean:robust_chi2_0.8", "clean:ece",
         "clean:misclassified_loss", "clean:worst_class_accuracy", "clean:weighted_robust_run", "T:mean_loss",
         "T:cvar_0.05", "T:ece")
_PERCENT = ("accuracy", "balanced_accuracy", "worst_class_accuracy", "ece")


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _means(prefix: str, block: Any) -> dict[str, float]:
    if not isinstance(block, dict) or not isinstance(block.get("mean"), dict):
        return {}
    return {f"{prefix}:{key}": _number(value) for key, value in block["mean"].items()}


def dr_columns(report: dict[str, Any]) -> dict[str, float]:
    """Every task-averaged robustness number of one eval.json report, by column name ({} for a report
    written before drmoo measured them); a metric in % (accuracies, ECE) is given in %."""
    block = report.get("robustness")
    if not isinstance(block, dict):
        return {}
    columns = {**_means("clean", block.get("clean")), **_means("T", block.get("temperature_scaled"))}
    for result in report.get("results", []):
        if isinstance(result, dict) and "metrics" in result:
            where = f"eps={_number(result.get('eps')):g}"
            columns.update(_means(where, result["metrics"]))
            columns.update(_means(f"T@{where}", result.get("metrics_temperature_scaled")))
    for shift, prefix in (("label_shift", ""), ("temperature_label_shift", "T@")):
        for point in block.get(shift, {}).get("points", []):
            strength = point.get("positive_rate_strength", point.get("digit_factor"))
            columns.update(_means(f"{prefix}label={_number(strength):g}", point))
    for point in block.get("noise", {}).get("points", []):
        where = f"noise={_number(point.get('sigma')):g}"
        columns.update(_means(where, point))
        columns.update(_means(f"T@{where}", point.get("temperature_scaled")))
    return {name: 100 * value if name.split(":")[1] in _PERCENT else value for name, value in columns.items()}


def _label(report: dict[str, Any]) -> str:
    return str(report.get("label") or report["method"])


def _with_temperature_rows(per_seed: dict[str, dict[str, dict[int, float]]]
                           ) -> dict[str, dict[str, dict[int, float]]]:
    """``per_seed`` and, per row, a row ``<row>+T``: its temperature-scaled numbers under the clean columns'
    names, so that the reference's clean numbers are paired with every row's recalibrated ones (and its own)."""
    scaled = {f"{label}+T": {unscaled_column(column): seeds for column, seeds in values.items()
                             if column.startswith(("T:", "T@"))} for label, values in per_seed.items()}
    return {**per_seed, **{label: values for label, values in scaled.items() if values}}


def unscaled_column(column: str) -> str:
    """The column a temperature-scaled one pairs with: ``T:ece`` -> ``clean:ece``, ``T@noise=0.3:ece`` ->
    ``noise=0.3:ece``."""
    return "clean:" + column[2:] if column.startswith("T:") else column[2:]


def dr_comparison(reports: Sequence[dict[str, Any]], reference: str, out: Path) -> str:
    """Write ``out/dr-table.csv`` and ``out/dr-paired.csv`` (when ``reference`` and another row are there)
    from the reports' robustness blocks; return table.md's part (empty when no report has the block)."""
    per_seed: dict[str, dict[str, dict[int, float]]] = {}
    for report in reports:
        mine = per_seed.setdefault(_label(report), {})
        for column, value in dr_columns(report).items():
            if not math.isnan(value):
                mine.setdefault(column, {})[int(report["seed"])] = value
    columns = list(dict.fromkeys(column for row in per_seed.values() for column in row))
    if not columns:
        remove_file(out / "dr-table.csv")
        remove_file(out / "dr-paired.csv")
        return ""
    rows = []
    for label, values in per_seed.items():
        for column in columns:
            mean, std = mean_std(list(values.get(column, {}).values()))
            rows.append({"method": label, "column": column, "mean": mean, "std": std,
                         "seeds": len(values.get(column, {}))})
    write_csv(out / "dr-table.csv", rows)
    shown = [column for column in SHOWN if column in columns]
    lines = ["Robustness metrics, mean over tasks (mean ± std over seeds; losses in nats, worst-class accuracy and "
             "ECE in %; `T:` with the temperature cross-fitted on the other half of the test set). Every column, "
             "under FGSM and each shift too: dr-table.csv.", "",
             "| row | " + " | ".join(shown) + " |", "|---|" + "---:|" * len(shown)]
    for label, values in per_seed.items():
        cells = []
        for column in shown:
            seeds = list(values.get(column, {}).values())
            mean, std = mean_std(seeds)
            cells.append("n/a" if not seeds else f"{mean:.4f} ± {std:.4f}" if len(seeds) > 1 else f"{mean:.4f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    if reference in per_seed and len(per_seed) > 1:
        paired = paired_differences(_with_temperature_rows(per_seed), reference, columns)
        write_csv(out / "dr-paired.csv", paired)
        text += "\n" + paired_markdown([row for row in paired if row["column"] in shown], {c: c for c in shown},
                                       unit="nats or %", sense="higher")
    else:
        remove_file(out / "dr-paired.csv")
    return text
