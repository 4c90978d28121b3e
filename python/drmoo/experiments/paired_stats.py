"""Paired comparisons over seeds: the reference method minus each other method, per table column.

Seeds are paired in drmoo's comparisons: one seed fixes the data order, the composites and the
initialisation for every method, so the difference of two methods on the same seed removes the
seed's own luck.  For each other row and column: the mean difference over the common seeds, its
95 % confidence interval from Student's t with n - 1 degrees of freedom (mean ± t_{0.975, n-1} ·
sd / √n; with one seed there is no interval), and the seeds on which the reference wins.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["holm_adjusted", "paired_differences", "paired_markdown", "paired_p_value", "t_quantile"]


def t_quantile(probability: float, dof: int) -> float:
    """The ``probability`` quantile of Student's t with ``dof`` degrees of freedom (:func:`scipy.stats.t.ppf`)."""
    if not 0 < probability < 1:
        raise ValueError(f"probability must be in (0, 1), got {probability!r}")
    if isinstance(dof, bool) or not isinstance(dof, int) or dof < 1:
        raise ValueError(f"dof must be an integer >= 1, got {dof!r}")
    from scipy import stats

    return float(stats.t.ppf(probability, dof))


def paired_differences(
    per_seed: Mapping[str, Mapping[Any, Mapping[int, float]]], reference: str, columns: Sequence[Any]
) -> list[dict[str, Any]]:
    """``reference`` minus every other row, per column, over the seeds both have.

    ``per_seed[row][column][seed]`` is one value.  Returns one dict per (other row, column) with
    ``mean``, ``ci_low``, ``ci_high`` (NaN with fewer than two seeds), ``wins`` / ``ties`` (seeds
    where the reference is higher / equal) and ``seeds``.
    """
    if reference not in per_seed:
        raise ValueError(f"the reference row {reference!r} is not in the comparison ({', '.join(per_seed)})")
    rows = []
    for other in per_seed:
        if other == reference:
            continue
        for column in columns:
            mine, theirs = per_seed[reference].get(column, {}), per_seed[other].get(column, {})
            seeds = sorted(set(mine) & set(theirs))
            differences = [mine[seed] - theirs[seed] for seed in seeds]
            n = len(differences)
            mean = sum(differences) / n if n else math.nan
            low = high = math.nan
            if n >= 2:
                sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
                half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
                low, high = mean - half, mean + half
            rows.append({"reference": reference, "other": other, "column": column, "mean": mean, "ci_low": low,
                         "ci_high": high, "wins": sum(d > 0 for d in differences),
                         "ties": sum(d == 0 for d in differences), "seeds": n})
    return rows


# Decimal places of a paired table's column: 2, unless the column holds differences below 0.01, which 2 would print
# as 0.00 or with one digit (losses in nats differ by thousandths): then enough for their first significant digit,
# up to 4.
DECIMALS, MAX_DECIMALS = 2, 4


def shown_decimals(rows: Sequence[Mapping[str, Any]]) -> int:
    """The decimal places one column's cells are printed with: the first significant digit of its smallest
    non-zero mean or interval half-width, at least :data:`DECIMALS` and at most :data:`MAX_DECIMALS` (exact
    zeros -- a method that trains the same model -- keep two)."""
    magnitudes = []
    for row in rows:
        candidates = [abs(float(row["mean"]))]
        if not math.isnan(float(row["ci_high"])):
            candidates.append((float(row["ci_high"]) - float(row["ci_low"])) / 2)
        magnitudes += [value for value in candidates if math.isfinite(value) and value > 0]
    if not magnitudes:
        return DECIMALS
    return max(DECIMALS, min(MAX_DECIMALS, -math.floor(math.log10(min(magnitudes)))))


def paired_markdown(rows: Sequence[Mapping[str, Any]], labels: Mapping[Any, str], unit: str = "points",
                    sense: str = "better") -> str:
    """One line per other row: per column, the mean difference, its 95 % CI and the reference's wins.

    ``sense`` says what a positive difference means: "better" (every column higher-is-better) or "higher"
    (columns of both senses, e.g. losses beside accuracies)."""
    if not rows:
        return ""
    reference = rows[0]["reference"]
    columns = list(dict.fromkeys(row["column"] for row in rows))
    meaning = f"{reference} is better" if sense == "better" else f"{reference} is higher (on a loss or ECE: worse)"
    lines = [
        f"Paired differences, {reference} minus each row ({unit}; positive: {meaning}): mean over the "
        "seeds both ran, [95 % confidence interval, Student's t], and the seeds on which "
        f"{reference} is higher. An interval that contains 0 is no evidence of a difference.",
        "",
        "| vs | " + " | ".join(labels.get(column, str(column)) for column in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    decimals = {column: shown_decimals([r for r in rows if r["column"] == column]) for column in columns}
    for other in dict.fromkeys(row["other"] for row in rows):
        cells = []
        for column in columns:
            row = next(r for r in rows if r["other"] == other and r["column"] == column)
            if row["seeds"] == 0:
                cells.append("n/a")
                continue
            places = decimals[column]
            interval = ("" if math.isnan(row["ci_low"])
                        else f" [{row['ci_low']:+.{places}f}, {row['ci_high']:+.{places}f}]")
            ties = f" ({row['ties']} tied)" if row["ties"] else ""
            cells.append(f"{row['mean']:+.{places}f}{interval} {row['wins']}/{row['seeds']}{ties}")
        lines.append(f"| {other} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paired_p_value(row: Mapping[str, Any]) -> float:
    """The two-sided p-value of the paired t-test behind one :func:`paired_differences` row.

    The interval is mean ± t_{0.975, n-1} · se, so se and the t statistic are recovered from it exactly
    (no per-seed values needed): p = 2 · P(T_{n-1} > |mean| / se).  NaN without an interval (n < 2); with
    se = 0 (every seed gave the same difference), 0 for a non-zero mean and 1 for a zero one.
    """
    n, mean, high = int(row["seeds"]), float(row["mean"]), float(row["ci_high"])
    if n < 2 or math.isnan(high):
        return math.nan
    standard_error = (high - mean) / t_quantile(0.975, n - 1)
    if standard_error <= 0:
        return 0.0 if mean != 0 else 1.0
    from scipy import stats

    return float(2 * stats.t.sf(abs(mean) / standard_error, n - 1))


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error control under any dependence).

    Sorted ascending, the k-th smallest (k from 0) of m gets max over j <= k of min(1, (m - j) p_(j));
    a hypothesis is rejected at family-wise level alpha when its adjusted p is <= alpha.  NaN entries
    (no interval) are not members of the family and stay NaN.
    """
    members = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    adjusted = [math.nan] * len(p_values)
    running = 0.0
    for rank, (p, index) in enumerate(members):
        running = max(running, min(1.0, (len(members) - rank) * p))
        adjusted[index] = running
    return adjusted
