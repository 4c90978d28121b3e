"""Multiple comparisons: what Holm's correction leaves standing of a results folder's paired intervals.

    python scripts/multiple_comparisons.py results/multimnist2-small [results/multimnist3-small ...]

Every verdict folder reports many 95 % paired t intervals computed from the same trained models (for
2-digit Multi-MNIST: Double-Clip minus 13 rows at 8 ε, the ablations' rows and contrasts at 8 ε).  Read
one at a time, each interval that excludes 0 has a 5 % chance of doing so by luck; read as a family, the
chance that at least one does is far higher.  This script takes a folder's family (``FAMILIES``: every
paired CSV its README's verdict draws from), recovers each interval's two-sided paired-t p-value from the
interval itself (:func:`drmoo.experiments.paired_stats.paired_p_value`), applies Holm's step-down
correction over the whole family (:func:`~drmoo.experiments.paired_stats.holm_adjusted`: family-wise
error rate 5 %, valid under any dependence between the comparisons), and writes
``<folder>/multiple-comparisons.csv``: one row per interval with its p, its Holm-adjusted p, whether the
interval excludes 0 and whether it survives the correction, and ``<folder>/multiple-comparisons-summary.csv``:
the family's size and those two counts.  No training, no network.

A family may list one hypothesis more than once: the same contrast in two of its CSVs, or two columns
that are always equal.  Each row's ``hypothesis`` names the first row that states it, and the summary
also counts the distinct hypotheses (``distinct``, ``distinct_exclude_0``, ``distinct_survive_holm``).
Holm's correction runs over the rows as listed: a hypothesis counted twice only makes it stricter, so
it stays valid for the distinct family.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path
from typing import Any

from drmoo.experiments.paired_stats import holm_adjusted, paired_p_value

ALPHA = 0.05
# Each folder's family: the paired CSVs (reference minus other, per column) its README's verdict reads.
FAMILIES: dict[str, tuple[str, ...]] = {
    "multimnist2-small": ("paired.csv", "ablations/paired.csv", "ablations/contrasts.csv"),
    "multimnist3-small": ("paired.csv",),
    "mnist-attributes-small": ("weighted/paired.csv", "unweighted/paired.csv", "contrasts.csv"),
    # the λ path (scripts/dr_path.py): each DR row against λ 100, and on the losses against λ 100 with a temperature
    "dr-path": ("contrasts.csv",),
}
# Where a family states one hypothesis twice.  NAMESPACES: the prefix under which a folder's cross-folder
# CSV names the rows of one of its paired CSVs (mnist-attributes' contrasts.csv calls unweighted/paired.csv's
# "mgda" "unweighted:mgda").  SAME_COLUMNS: a column that always equals another (mnist-attributes' label-
# balanced sets hold as many positives as negatives, so their accuracy is their balanced accuracy).
NAMESPACES: dict[str, dict[str, str]] = {"mnist-attributes-small": {"unweighted/paired.csv": "unweighted:"}}
SAME_COLUMNS: dict[str, dict[str, str]] = {
    "mnist-attributes-small": {"balanced:mean_accuracy": "balanced:mean_balanced_accuracy"}}
FIELDS = ("source", "reference", "other", "column", "mean", "ci_low", "ci_high", "seeds", "p", "p_holm",
          "excludes_0", "survives_holm", "hypothesis")
SUMMARY = ("family", "intervals", "exclude_0", "survive_holm", "distinct", "distinct_exclude_0",
           "distinct_survive_holm")


def family_of(folder: Path) -> str:
    """FOLDER's family name: its own name, or ``dr-path`` for a set-up's folder inside a λ path
    (``mnist-attributes-small/dr-path/weighted``: one family per set-up) and for a λ path at each λ's own
    rate (``multimnist2-small/dr-path-tuned``)."""
    if folder.name in FAMILIES:
        return folder.name
    if folder.parent.name == "dr-path" or folder.name == "dr-path-tuned":
        return "dr-path"
    raise SystemExit(f"{folder}: no family is defined for this folder (known: {', '.join(FAMILIES)})")


def family_rows(folder: Path) -> list[dict[str, Any]]:
    """The family's intervals, each with its p-value, Holm-adjusted p and verdicts."""
    family = family_of(folder)
    rows: list[dict[str, Any]] = []
    for source in FAMILIES[family]:
        path = folder / source
        if not path.is_file():
            raise SystemExit(f"{path}: missing (run the folder's reproduce_small.sh target first)")
        with path.open(newline="") as handle:
            for row in csv.DictReader(handle):
                rows.append({"source": source, **row})
    p_values = [paired_p_value(row) for row in rows]
    for row, p, p_holm in zip(rows, p_values, holm_adjusted(p_values), strict=True):
        low, high = float(row["ci_low"]), float(row["ci_high"])
        row["p"], row["p_holm"] = p, p_holm
        row["excludes_0"] = not math.isnan(low) and (low > 0 or high < 0)
        row["survives_holm"] = not math.isnan(p_holm) and p_holm <= ALPHA
    first: dict[tuple[str, str, str], int] = {}
    for index, row in enumerate(rows):
        row["hypothesis"] = first.setdefault(hypothesis(family, row), index)
    return rows


def hypothesis(folder: str, row: dict[str, Any]) -> tuple[str, str, str]:
    """What one row asks, whichever CSV of the family lists it: (reference, other, column), the rows named
    as the folder's cross-folder CSV names them and the column as the one it always equals."""
    prefix = NAMESPACES.get(folder, {}).get(row["source"], "")
    column = SAME_COLUMNS.get(folder, {}).get(row["column"], row["column"])
    return prefix + row["reference"], prefix + row["other"], column


def summary(rows: list[dict[str, Any]]) -> tuple[int, int, int, int, int, int]:
    """Intervals in the family, those excluding 0 and those surviving Holm; then the same for the distinct
    hypotheses (a hypothesis listed twice counts once)."""
    members = [row for row in rows if not math.isnan(row["p"])]
    distinct = [row for index, row in enumerate(rows) if row["hypothesis"] == index and not math.isnan(row["p"])]
    return (len(members), sum(row["excludes_0"] for row in members), sum(row["survives_holm"] for row in members),
            len(distinct), sum(row["excludes_0"] for row in distinct), sum(row["survives_holm"] for row in distinct))


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    for name in argv[1:]:
        folder = Path(name)
        rows = family_rows(folder)
        with (folder / "multiple-comparisons.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=FIELDS, lineterminator="\n")
            writer.writeheader()
            writer.writerows({field: row[field] for field in FIELDS} for row in rows)
        counts = summary(rows)
        with (folder / "multiple-comparisons-summary.csv").open("w", newline="") as handle:
            sources = "+".join(FAMILIES[family_of(folder)])
            csv.writer(handle, lineterminator="\n").writerows([SUMMARY, (sources, *counts)])
        print(f"{folder}: {counts[0]} intervals in the family ({counts[3]} distinct hypotheses), {counts[1]} "
              f"({counts[4]}) exclude 0 one at a time, {counts[2]} ({counts[5]}) survive Holm at family-wise "
              f"{ALPHA:.0%} -> {folder / 'multiple-comparisons.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
