"""The λ path: what DR changes, metric by metric, against plain training (λ 100) with and without a temperature.

    python scripts/dr_path.py results/multimnist2-small/dr-path

Reads every run directory of FOLDER (its ``config.json`` and the ``eval.json`` that ``drmoo eval`` or
``drmoo compare`` wrote, with its ``robustness`` block) and writes, with no training:

* ``table.csv``: per row (the run's label), condition and metric, the mean and standard deviation over
  the seeds. Conditions: ``clean`` (the nominal test set), ``T`` (the clean logits scaled by the
  temperature ``drmoo eval`` fits per task), ``fgsm_<eps>``, ``digit_x<k>`` (label shift: one digit k
  times commoner, the mean over the ten digits) and ``noise_<sigma>`` (Gaussian pixel noise).
  Accuracies and the ECE are in %, losses (mean, CVaR, the robust objectives, the loss on the
  misclassified samples) in nats.
* ``contrasts.csv``: each DR row minus its λ 100 twin (``ERM``: the dual at λ 100 is within a few
  percent of the mean loss) per column ``condition:metric``, paired over seeds (mean, 95 % Student-t
  interval, ``wins``: the seeds on which the DR row's value is higher), on the columns of
  :data:`AGAINST_ERM`; and the same DR row minus the twin with its fitted temperature (the other row
  named ``<twin>+T``) on the loss, tail and calibration columns of :data:`AGAINST_ERM_T` (a
  temperature changes no top label, so the accuracies would repeat the first contrast). These are the
  family ``scripts/multiple_comparisons.py`` corrects with Holm's method: each column is one distinct
  hypothesis, fixed before the runs were scored.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from drmoo.experiments.paired_stats import paired_differences
from drmoo.experiments.variants import parse_variants

ERM_LAM = 100.0
PERCENT = ("accuracy", "balanced_accuracy", "worst_class_accuracy", "ece")
LOSS_COLUMNS = ("mean_loss", "cvar_0.05", "robust_chi2_0.1", "robust_chi2_0.8", "ece", "misclassified_loss")
# The hypotheses, chosen before any run was scored: on the nominal test set the accuracies, the tail, the
# worst case on two fixed balls, calibration; under the strongest label shift, FGSM at a middle and the
# strongest eps, and the strongest pixel noise, accuracy and the tail.
AGAINST_ERM = (
    *(f"clean:{m}" for m in ("accuracy", "worst_class_accuracy", *LOSS_COLUMNS)),
    *(f"{c}:{m}" for c in ("fgsm_0.05", "fgsm_0.2", "digit_x4", "noise_0.3") for m in ("accuracy", "cvar_0.05")),
)
AGAINST_ERM_T = tuple(f"clean:{m}" for m in LOSS_COLUMNS)
FIELDS = ("reference", "other", "column", "mean", "ci_low", "ci_high", "wins", "ties", "seeds")
TABLE_FIELDS = ("row", "condition", "metric", "mean", "std", "seeds")


def _scaled(metric: str, value: float | None) -> float:
    if value is None:
        return math.nan
    return 100 * float(value) if metric in PERCENT else float(value)


def conditions(report: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(condition, {metric: task-mean value}) of one eval.json."""
    block = report.get("robustness")
    if not isinstance(block, dict):
        raise SystemExit(f"{report.get('run')}: eval.json has no robustness block: rerun `drmoo eval` on the run")
    yield "clean", block["clean"]["mean"]
    yield "T", block["temperature_scaled"]["mean"]
    for result in report["results"]:
        if result["eps"] > 0:
            yield f"fgsm_{result['eps']:g}", result["metrics"]["mean"]
    for point in block["label_shift"]["points"]:
        yield f"digit_x{point['digit_factor']:g}", point["mean"]
    for point in block["noise"]["points"]:
        yield f"noise_{point['sigma']:g}", point["mean"]


def row_name(config: dict[str, Any]) -> str:
    return str(config.get("label") or config["method"])


def read_runs(folder: Path) -> dict[str, dict[str, dict[int, float]]]:
    """{row: {condition:metric: {seed: value}}} over FOLDER's finished test-split runs; the fitted temperature
    of a row also as the row ``<row>+T`` (its ``T`` values under ``clean``)."""
    per_seed: dict[str, dict[str, dict[int, float]]] = {}
    for run in sorted(path for path in folder.iterdir() if (path / "eval.json").is_file()):
        config = json.loads((run / "config.json").read_text())
        if config.get("eval_split", "test") != "test":
            continue
        report = json.loads((run / "eval.json").read_text())
        name, seed = row_name(config), int(config["seed"])
        for condition, means in conditions(report):
            for metric, value in means.items():
                per_seed.setdefault(name, {}).setdefault(f"{condition}:{metric}", {})[seed] = _scaled(metric, value)
                if condition == "T":
                    per_seed.setdefault(f"{name}+T", {}).setdefault(f"clean:{metric}", {})[seed] = _scaled(
                        metric, value)
    if not per_seed:
        raise SystemExit(f"{folder}: no evaluated test-split run (run `bash scripts/reproduce_small.sh dr-path`)")
    return per_seed


def lam_of(row: str) -> float | None:
    """The row's λ (None: the method's default, the paper's 0.8)."""
    (variant,) = parse_variants(row)
    lam = variant.hparams.get("lam")
    return None if lam is None else float(lam)


def erm_twin(row: str, rows: Iterable[str]) -> str | None:
    """The λ 100 row of the same method and other settings as ``row`` (None: no such row, or ``row`` is it)."""
    (variant,) = parse_variants(row)
    if lam_of(row) == ERM_LAM:
        return None
    others = {k: v for k, v in variant.hparams.items() if k != "lam"}
    for candidate in rows:
        if candidate.endswith("+T"):
            continue
        (twin,) = parse_variants(candidate)
        if (twin.method == variant.method and lam_of(candidate) == ERM_LAM
                and {k: v for k, v in twin.hparams.items() if k != "lam"} == others):
            return candidate
    return None


def contrasts(per_seed: dict[str, dict[str, dict[int, float]]]) -> list[dict[str, Any]]:
    """Each DR row minus its ERM twin (:data:`AGAINST_ERM`) and minus the twin with its temperature
    (:data:`AGAINST_ERM_T`), rows by increasing λ."""
    rows = []
    dr_rows = sorted((r for r in per_seed if not r.endswith("+T") and erm_twin(r, per_seed)),
                     key=lambda r: (parse_variants(r)[0].method, lam_of(r) or 0.8))
    for row in dr_rows:
        twin = erm_twin(row, per_seed)
        assert twin is not None
        for other, columns in ((twin, AGAINST_ERM), (f"{twin}+T", AGAINST_ERM_T)):
            subset = {name: per_seed[name] for name in (row, other)}
            rows += paired_differences(subset, row, list(columns))
    return rows


def table(per_seed: dict[str, dict[str, dict[int, float]]]) -> list[dict[str, Any]]:
    out = []
    for row, columns in per_seed.items():
        for column, seeds in columns.items():
            condition, metric = column.split(":", 1)
            values = [v for v in seeds.values() if not math.isnan(v)]
            n = len(values)
            mean = sum(values) / n if n else math.nan
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan
            out.append({"row": row, "condition": condition, "metric": metric, "mean": mean, "std": std, "seeds": n})
    return out


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
    found = contrasts(per_seed)
    if not found:
        raise SystemExit(f"{folder}: no DR row has a λ {ERM_LAM:g} twin to be contrasted with")
    _write(folder / "table.csv", TABLE_FIELDS, table(per_seed))
    _write(folder / "contrasts.csv", FIELDS, found)
    print(f"{folder}: {len(per_seed)} rows -> table.csv; {len(found)} contrasts -> contrasts.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
