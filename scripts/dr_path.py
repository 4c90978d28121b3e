"""The λ path: what DR changes, metric by metric, against plain training (λ 100) with and without a temperature.

    python scripts/dr_path.py results/multimnist2-small/dr-path
    python scripts/dr_path.py results/mnist-attributes-small/dr-path/weighted

Reads every test-split run directory of FOLDER (its ``config.json`` and the ``eval.json`` that ``drmoo
eval`` or ``drmoo compare`` wrote, with its robustness block) and writes ``contrasts.csv``, with no
training: each DR row minus its λ 100 twin (the same method with every other setting equal, at λ 100:
plain training, the χ² dual there being within a few percent of the mean loss; in a folder where each λ
runs at its own validated rate, ``*-tuned/``, the twin runs at its own too; Double-Clip's rows against
``double-clip[lam=100]``, MGDA's against ``mgda[lam=100]``) per column of :data:`AGAINST_ERM`, paired over
seeds (mean, 95 % Student-t interval, ``wins``: the seeds on which the DR row's value is higher); and the
same DR row minus the twin with its fitted temperature (the other row named ``<twin>+T``) on the loss,
tail and calibration columns of :data:`AGAINST_ERM_T` (a temperature changes no top label, so accuracies
would repeat the first contrast). The columns are those of ``drmoo compare``'s ``dr-table.csv``
(:func:`drmoo.experiments.dr_tables.dr_columns`: ``clean:cvar_0.05``, ``T:ece``, ``eps=0.2:accuracy``,
``label=4:accuracy``, ``noise=0.3:cvar_0.05``; accuracies and the ECE in %, losses in nats), which holds
every row's mean ± std. The contrasts are the family ``scripts/multiple_comparisons.py`` corrects with
Holm's method: one distinct hypothesis each, chosen before any run was scored.  ``lambda-path.png`` draws
the clean accuracy, tail, misclassified-sample loss and ECE contrasts against λ (:func:`plot_path`).
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from drmoo.experiments.dr_tables import dr_columns, unscaled_column
from drmoo.experiments.paired_stats import holm_adjusted, paired_differences, paired_p_value
from drmoo.experiments.variants import parse_variants

ERM_LAM = 100.0
DEFAULT_LAM = 0.8  # the methods' λ when a row names none (the paper's)
LOSS_COLUMNS = ("mean_loss", "cvar_0.05", "robust_chi2_0.1", "robust_chi2_0.8", "ece", "misclassified_loss")
# The hypotheses, chosen before any run was scored: on the nominal test set the accuracies, the tail, the
# worst case on two fixed balls, calibration; FGSM at a middle and at the strongest eps, the strongest
# label shift (one digit 4 times commoner) and the strongest pixel noise: accuracy and the tail.
AGAINST_ERM = (
    *(f"clean:{m}" for m in ("accuracy", "worst_class_accuracy", *LOSS_COLUMNS)),
    *(f"{c}:{m}" for c in ("eps=0.05", "eps=0.2", "label=4", "noise=0.3") for m in ("accuracy", "cvar_0.05")),
)
AGAINST_ERM_T = tuple(f"clean:{m}" for m in LOSS_COLUMNS)
FIELDS = ("reference", "other", "column", "mean", "ci_low", "ci_high", "wins", "ties", "seeds")
# The attributes' hypotheses, chosen before any of their λ-path runs was scored: the same nominal columns,
# balanced accuracy (what Table 2 ranks by) and the χ² 0.8 worst case around the label-balancing nominal (the
# distribution the importance weights train for); the strongest label shift (each attribute's positive rate
# mirrored about 1/2, s = 2: accuracy and the tail; balanced accuracy does not move under a label reweighting)
# and the strongest pixel noise (accuracy, balanced accuracy, the tail).
ATTRIBUTES_AGAINST_ERM = (
    *(f"clean:{m}" for m in ("accuracy", "balanced_accuracy", "worst_class_accuracy", *LOSS_COLUMNS,
                             "weighted_robust_chi2_0.8")),
    *(f"label=2:{m}" for m in ("accuracy", "cvar_0.05")),
    *(f"noise=0.3:{m}" for m in ("accuracy", "balanced_accuracy", "cvar_0.05")),
)
ATTRIBUTES_AGAINST_ERM_T = (*AGAINST_ERM_T, "clean:weighted_robust_chi2_0.8")


# A second family, added after the first was scored on 2 digits (before any attributes run was): under each
# shift of the first family, the tail and the calibration against λ 100 with the clean split's temperature
# applied to the shifted logits (the recalibration a practitioner would deploy).  Its own Holm correction,
# in contrasts-temperature-shift.csv, so that the first family's verdicts stand as they were chosen.
SHIFTS_T = ("eps=0.05", "eps=0.2", "label=4", "noise=0.3")
ATTRIBUTES_SHIFTS_T = ("label=2", "noise=0.3")
AGAINST_ERM_T_SHIFT = tuple(f"{where}:{m}" for where in SHIFTS_T for m in ("cvar_0.05", "ece"))
ATTRIBUTES_AGAINST_ERM_T_SHIFT = tuple(f"{where}:{m}" for where in ATTRIBUTES_SHIFTS_T for m in ("cvar_0.05", "ece"))
SHIFT_FIELDS = (*FIELDS, "p", "p_holm", "survives_holm")


def hypotheses(experiment: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The columns contrasted against λ 100 and against λ 100 with its temperature, for EXPERIMENT."""
    if experiment.startswith("mnist-attributes") or experiment.startswith("celeba"):
        return ATTRIBUTES_AGAINST_ERM, ATTRIBUTES_AGAINST_ERM_T
    return AGAINST_ERM, AGAINST_ERM_T


def row_name(config: dict[str, Any]) -> str:
    return str(config.get("label") or config["method"])


def experiment_of(folder: Path) -> str:
    """The one experiment of FOLDER's runs (the hypotheses depend on it)."""
    experiments = {json.loads((run / "config.json").read_text()).get("experiment", "multimnist2")
                   for run in folder.iterdir() if (run / "config.json").is_file()}
    if len(experiments) != 1:
        raise SystemExit(f"{folder}: the runs must share one experiment, found {sorted(experiments) or 'none'}")
    return experiments.pop()


def read_runs(folder: Path) -> dict[str, dict[str, dict[int, float]]]:
    """{row: {column: {seed: value}}} over FOLDER's test-split runs; a row's temperature-scaled values also
    as the row ``<row>+T`` (its ``T:`` columns under ``clean:``)."""
    per_seed: dict[str, dict[str, dict[int, float]]] = {}
    for run in sorted(path for path in folder.iterdir() if (path / "eval.json").is_file()):
        config = json.loads((run / "config.json").read_text())
        if config.get("eval_split", "test") != "test":
            continue
        columns = dr_columns(json.loads((run / "eval.json").read_text()))
        if not columns:
            raise SystemExit(f"{run}: eval.json has no robustness block: rerun `drmoo eval` on the run")
        name, seed = row_name(config), int(config["seed"])
        for column, value in columns.items():
            per_seed.setdefault(name, {}).setdefault(column, {})[seed] = value
            if column.startswith(("T:", "T@")):  # T:ece -> clean:ece, T@noise=0.3:ece -> noise=0.3:ece
                per_seed.setdefault(f"{name}+T", {}).setdefault(unscaled_column(column), {})[seed] = value
    if not per_seed:
        raise SystemExit(f"{folder}: no evaluated test-split run (run `bash scripts/reproduce_small.sh dr-path`)")
    return per_seed


def lam_of(row: str) -> float | None:
    """The row's λ (None: the method's default, the paper's 0.8)."""
    (variant,) = parse_variants(row)
    lam = variant.hparams.get("lam")
    return None if lam is None else float(lam)


def lam_on_path(row: str) -> float:
    """The row's place on the λ path: its λ, or the methods' default (the paper's 0.8) where it names none."""
    lam = lam_of(row)
    return DEFAULT_LAM if lam is None else lam


def runs_at_own_rates(folder: Path) -> bool:
    """Whether each λ of ``folder`` runs at its own validated rate: a ``*-tuned`` folder."""
    return folder.name.endswith("-tuned")


def erm_twin(row: str, rows: Iterable[str], own_rates: bool = False) -> str | None:
    """The λ 100 row of the same method and other settings as ``row`` (None: no such row, or ``row`` is it).

    ``own_rates`` (each λ at its own validated rate, :func:`runs_at_own_rates`): the rate aside, the method's
    one λ 100 row at the same other settings, i.e. plain training at plain training's rate."""
    (variant,) = parse_variants(row)
    if lam_of(row) == ERM_LAM:
        return None
    ignored = ("lam", "lr") if own_rates else ("lam",)
    others = {k: v for k, v in variant.hparams.items() if k not in ignored}
    found = []
    for candidate in rows:
        if candidate.endswith("+T"):
            continue
        (twin,) = parse_variants(candidate)
        if (twin.method == variant.method and lam_of(candidate) == ERM_LAM
                and {k: v for k, v in twin.hparams.items() if k not in ignored} == others):
            found.append(candidate)
    if len(found) > 1:
        raise SystemExit(f"{row}: more than one λ {ERM_LAM:g} twin ({', '.join(found)})")
    return found[0] if found else None


def dr_rows(per_seed: dict[str, dict[str, dict[int, float]]], own_rates: bool = False) -> list[str]:
    """The rows with a λ 100 twin (the DR rows), by method, then by increasing λ (the default, 0.8, in its place)."""
    return sorted((r for r in per_seed if not r.endswith("+T") and erm_twin(r, per_seed, own_rates)),
                  key=lambda r: (parse_variants(r)[0].method, lam_on_path(r)))


def contrasts(per_seed: dict[str, dict[str, dict[int, float]]],
              experiment: str = "multimnist2", own_rates: bool = False) -> list[dict[str, Any]]:
    """Each DR row minus its ERM twin (:data:`AGAINST_ERM`) and minus the twin with its temperature
    (:data:`AGAINST_ERM_T`; the attributes': :data:`ATTRIBUTES_AGAINST_ERM`), rows by increasing λ."""
    against_erm, against_erm_t = hypotheses(experiment)
    rows = []
    for row in dr_rows(per_seed, own_rates):
        twin = erm_twin(row, per_seed, own_rates)
        assert twin is not None
        for other, columns in ((twin, against_erm), (f"{twin}+T", against_erm_t)):
            subset = {name: per_seed[name] for name in (row, other)}
            rows += paired_differences(subset, row, list(columns))
    return rows


def shift_contrasts_with_temperature(per_seed: dict[str, dict[str, dict[int, float]]],
                                     experiment: str = "multimnist2", own_rates: bool = False
                                     ) -> list[dict[str, Any]]:
    """The second family: each DR row minus its λ 100 twin with the clean temperature, under each shift
    (:data:`AGAINST_ERM_T_SHIFT`, the attributes' :data:`ATTRIBUTES_AGAINST_ERM_T_SHIFT`), with Holm's
    correction over the family's distinct rows (each is one hypothesis)."""
    attributes = hypotheses(experiment)[0] is ATTRIBUTES_AGAINST_ERM
    columns = ATTRIBUTES_AGAINST_ERM_T_SHIFT if attributes else AGAINST_ERM_T_SHIFT
    rows = []
    for row in dr_rows(per_seed, own_rates):
        other = f"{erm_twin(row, per_seed, own_rates)}+T"
        present = [c for c in columns if c in per_seed.get(other, {})]
        if present:
            rows += paired_differences({name: per_seed[name] for name in (row, other)}, row, present)
    p_values = [paired_p_value(row) for row in rows]
    for row, p, p_holm in zip(rows, p_values, holm_adjusted(p_values), strict=True):
        row["p"], row["p_holm"] = p, p_holm
        row["survives_holm"] = not math.isnan(p_holm) and p_holm <= 0.05  # NaN (fewer than 2 seeds): no
    return rows


# The figure's panels: one column each, DR minus plain training (and minus it with its temperature where
# that contrast exists), against λ.
PLOT_COLUMNS = ("accuracy", "cvar_0.05", "misclassified_loss", "ece")
PLOT_TITLES = {"accuracy": "accuracy (points)", "balanced_accuracy": "balanced accuracy (points)",
               "cvar_0.05": "tail: CVaR at 5 % (nats)", "misclassified_loss": "loss of misclassified (nats)",
               "ece": "ECE (points)"}


def plot_path(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """``path`` (a PNG): each panel one clean column of :data:`PLOT_COLUMNS` (balanced accuracy in place of
    accuracy where the contrasts have it), each method's DR rows against λ (log scale), the mean difference
    from its λ 100 twin with its 95 % interval; dashed, the difference from the twin with its temperature.
    Below 0 is a lower value for DR: fewer points of accuracy, a lighter tail, better calibration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = {row["column"] for row in rows}
    columns = [("balanced_accuracy" if c == "accuracy" and "clean:balanced_accuracy" in present else c)
               for c in PLOT_COLUMNS]
    methods = sorted({parse_variants(row["reference"])[0].method for row in rows})
    ticks = sorted({lam_on_path(row["reference"]) for row in rows})
    figure, axes = plt.subplots(1, len(columns), figsize=(4 * len(columns), 3.4), layout="constrained")
    for axis, column in zip(axes, columns, strict=True):
        for colour, method in zip(("tab:blue", "tab:orange", "tab:green"), methods, strict=False):
            for dashed in (False, True):
                series = sorted(
                    ((lam_on_path(row["reference"]), row) for row in rows
                     if row["column"] == f"clean:{column}" and row["other"].endswith("+T") == dashed
                     and parse_variants(row["reference"])[0].method == method), key=lambda item: item[0])
                if not series:
                    continue
                # side by side, not on top: the temperature's contrast right of its point, a second method left
                shift = (1.06 if dashed else 1.0) * (0.9 if method != methods[0] else 1.0)
                lams = [lam * shift for lam, _ in series]
                means = [float(row["mean"]) for _, row in series]
                spread = [[m - float(row["ci_low"]) for m, (_, row) in zip(means, series, strict=True)],
                          [float(row["ci_high"]) - m for m, (_, row) in zip(means, series, strict=True)]]
                axis.errorbar(lams, means, yerr=spread, color=colour, marker="o" if not dashed else "s",
                              linestyle="--" if dashed else "-", capsize=3, markersize=4,
                              label=f"{method} − λ 100" + (" with T" if dashed else ""))
        axis.axhline(0.0, color="grey", linewidth=0.8)
        axis.set_xscale("log")
        axis.set_xticks(ticks, [f"{lam:g}" for lam in ticks])
        axis.minorticks_off()
        axis.set_xlabel("λ (smaller: a larger ball)")
        axis.set_title(PLOT_TITLES[column], fontsize=10)
    axes[1].legend(fontsize=7)  # the tail panel has every series (accuracy has no temperature contrast)
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=110, metadata={"Software": None})  # no version stamp: the same runs, the same file
    plt.close(figure)


def _write(path: Path, fields: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows({field: row[field] for field in fields} for row in rows)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    folder = Path(argv[1])
    per_seed = read_runs(folder)
    found = contrasts(per_seed, experiment_of(folder), runs_at_own_rates(folder))
    if not found:
        raise SystemExit(f"{folder}: no DR row has a λ {ERM_LAM:g} twin to be contrasted with")
    _write(folder / "contrasts.csv", FIELDS, found)
    print(f"{folder}: {len(found)} contrasts of {len(per_seed)} rows -> {folder / 'contrasts.csv'}")
    plot_path(found, folder / "lambda-path.png",
              f"{folder.name}: DR minus plain training (λ 100) over 95 % intervals, by λ")
    shifted = shift_contrasts_with_temperature(per_seed, experiment_of(folder), runs_at_own_rates(folder))
    if shifted:  # runs evaluated before drmoo eval scaled the shifted logits have none
        _write(folder / "contrasts-temperature-shift.csv", SHIFT_FIELDS, shifted)
        survivors = sum(bool(row["survives_holm"]) for row in shifted)
        excluding = sum(float(row["ci_low"]) > 0 or float(row["ci_high"]) < 0 for row in shifted)
        _write(folder / "contrasts-temperature-shift-summary.csv", ("intervals", "exclude_0", "survive_holm"),
               [{"intervals": len(shifted), "exclude_0": excluding, "survive_holm": survivors}])
        print(f"{folder}: {len(shifted)} contrasts under shift against λ {ERM_LAM:g} with its clean temperature, "
              f"{survivors} survive Holm -> {folder / 'contrasts-temperature-shift.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
