"""The small preset's two-stage learning-rate rule, applied to a sweep's table.csv files.

    python scripts/sweep_rule.py extension SWEEP   # rates to add to stage 1 (best rate at an end of the grid)
    python scripts/sweep_rule.py finalists SWEEP   # stage 2: each method's two best stage-1 rates
    python scripts/sweep_rule.py winners SWEEP     # each method's winner
    python scripts/sweep_rule.py rows SWEEP EXPERIMENT [KEY...]   # the winners as EXPERIMENT's small-preset rows
    python scripts/sweep_rule.py tuned SWEEP EXPERIMENT [KEY...]  # those rows whose rate is not the preset's

Each prints a ``--methods`` spec (``method[lr=X],...``; empty when there is nothing to add).  The rule
is the one the committed sweeps used (see SMALL_LR in python/drmoo/experiments/multimnist.py): stage 1
(``SWEEP/table.csv``, seed 0) runs the grid 0.1, 0.3, 1, 3 and the next rate of the ladder beyond an
end while the best rate sits at that end; stage 2 (``SWEEP/runoff/table.csv``, seeds 1 and 2) runs
each method's two best stage-1 rates (ties to the smaller); the winner has the highest clean
validation accuracy averaged over seeds 0-2 (ties to the smaller rate).

The same rule reads a label-imbalance comparison's table (``--experiment mnist-attributes``: columns
``set``, ``metric``), ranking by the prevalence set's mean balanced accuracy instead of clean accuracy.

A row may also set ``jacobian`` (issue 26's features-mode sweep), ``lam`` or ``pref_lr`` (the label-imbalance
controls): the rule then runs per method and setting, e.g. ``double-clip[jacobian=features]`` is swept apart
from ``double-clip``, and the specs it prints keep the setting.  Rows that vary any other setting are not this rule's.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Collection
from pathlib import Path

from drmoo.experiments.variants import parse_variants

LADDER = (1e-4, 3e-4, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)


# Settings a swept row may carry besides lr: each value is swept on its own (its own key).  ``lam`` and
# ``pref_lr`` key mnist-attributes' control rows (MGDA without DR, the plain reference
# ``mgda[lam=100,pref_lr=0]``), which are swept apart from the method they ablate.
MODE_SETTINGS = ("jacobian", "lam", "pref_lr")


def clean_by_rate(table: Path) -> dict[str, dict[float, float]]:
    """{key: {lr: clean validation accuracy (mean over the table's seeds)}} of its lr-only rows.

    The key is the method's name, with ``[jacobian=...]`` when the row sets the mode.
    """
    out: dict[str, dict[float, float]] = {}
    with table.open() as handle:
        for row in csv.DictReader(handle):
            if not _is_criterion(row):
                continue
            (variant,) = parse_variants(row["method"])
            others = {k: v for k, v in variant.hparams.items() if k != "lr"}
            if "lr" not in variant.hparams or set(others) - set(MODE_SETTINGS):
                continue  # another setting varies too (the 2-digit sweep's MoCo rows): not this rule's
            mode = ",".join(f"{k}={v}" for k, v in sorted(others.items()))
            key = f"{variant.method}[{mode}]" if mode else variant.method
            out.setdefault(key, {})[float(variant.hparams["lr"])] = float(row["mean_acc" if "eps" in row else "mean"])
    return out


def _is_criterion(row: dict[str, str]) -> bool:
    """The row the rule ranks by: clean accuracy in an FGSM comparison's table (column ``eps``); in a
    label-imbalance table (columns ``set``, ``metric``: ``mnist-attributes``) the mean balanced accuracy on
    the prevalence set, Table 2's imbalance-aware headline (plain accuracy there rewards predicting the
    majority label)."""
    if "eps" in row:
        return float(row["eps"]) == 0.0
    if "metric" in row:
        return row["set"] == "prevalence" and row["metric"] == "mean_balanced_accuracy"
    raise ValueError(f"a table row with neither an eps nor a set/metric column: {sorted(row)}")


def _best(rates: dict[float, float], count: int) -> list[float]:
    return sorted(rates, key=lambda lr: (-rates[lr], lr))[:count]


def extension(sweep: Path) -> list[str]:
    spec = []
    for method, rates in clean_by_rate(sweep / "table.csv").items():
        best = _best(rates, 1)[0]
        index = LADDER.index(best)
        if best == min(rates) and index > 0:
            spec.append(with_rate(method, LADDER[index - 1]))
        elif best == max(rates) and index + 1 < len(LADDER):
            spec.append(with_rate(method, LADDER[index + 1]))
    return spec


def with_rate(key: str, lr: float) -> str:
    """The ``--methods`` row of KEY (``method`` or ``method[jacobian=...]``) at rate LR."""
    if key.endswith("]"):
        return f"{key[:-1]},lr={lr!r}]"
    return f"{key}[lr={lr!r}]"


def finalists(sweep: Path) -> dict[str, list[float]]:
    return {method: _best(rates, 2) for method, rates in clean_by_rate(sweep / "table.csv").items()}


def winners(sweep: Path, keys: Collection[str] | None = None) -> dict[str, float]:
    """Each key's winner (``keys``: only these, e.g. the rows whose stage 2 has run while others' has not)."""
    first, second = clean_by_rate(sweep / "table.csv"), clean_by_rate(sweep / "runoff" / "table.csv")
    chosen = {}
    for method, pair in finalists(sweep).items():
        if keys is not None and method not in keys:
            continue
        if sorted(second.get(method, {})) != sorted(pair):
            ran = sorted(second.get(method, {}))
            raise ValueError(f"{method}: stage 2 ran {ran}, not the finalists {sorted(pair)}")
        three_seed = {lr: (first[method][lr] + 2 * second[method][lr]) / 3 for lr in pair}
        chosen[method] = _best(three_seed, 1)[0]
    return chosen


def preset_rows(sweep: Path, experiment: str, *, tuned_only: bool = False,
                keys: Collection[str] | None = None) -> list[str]:
    """The winners as ``--methods`` rows of EXPERIMENT's small preset: a winner at the preset's own rate is
    the row without ``lr`` (``mgda``, ``mgda[lam=100,pref_lr=0]``), so the runs the preset already made are
    reused instead of repeated under another name; any other winner keeps its rate.  ``tuned_only``: only the
    latter (the rows a comparison at the preset's rates lacks).  ``keys``: as for :func:`winners`."""
    from drmoo.experiments.registry import get_experiment

    method_hparams = get_experiment(experiment).method_hparams
    rows = []
    for key, lr in winners(sweep, keys).items():
        method = key.split("[", 1)[0]
        if float(method_hparams(method, None, preset="small")["lr"]) == lr:
            if not tuned_only:
                rows.append(key)
        else:
            rows.append(with_rate(key, lr))
    return rows


def main(argv: list[str]) -> int:
    fixed = {"extension": 3, "finalists": 3, "winners": 3}
    if len(argv) < 3 or not (fixed.get(argv[1]) == len(argv) or (argv[1] in ("rows", "tuned") and len(argv) >= 4)):
        print(__doc__, file=sys.stderr)
        return 2
    sweep = Path(argv[2])
    if argv[1] in ("rows", "tuned"):
        keys = argv[4:] or None
        print(",".join(preset_rows(sweep, argv[3], tuned_only=argv[1] == "tuned", keys=keys)))
    elif argv[1] == "extension":
        print(",".join(extension(sweep)))
    elif argv[1] == "finalists":
        print(",".join(with_rate(m, lr) for m, pair in finalists(sweep).items() for lr in pair))
    else:
        print(",".join(with_rate(m, lr) for m, lr in winners(sweep).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
