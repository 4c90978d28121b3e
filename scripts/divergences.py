"""Divergences per row: which committed runs blew up, and how far they fell.

    python scripts/divergences.py [results]        # writes results/divergences.csv

A table of means hides how a mean was made: one seed that collapses in its last epoch (features-mode
Double-Clip fell from 91 % to 44 % clean in one replication) pulls a row down without saying so.  This
script reads every finished test-split run under the folder (``config.json`` + ``metrics.csv`` +
``eval.json``) and reports, per comparison folder and row:

* ``stopped``: runs that stopped at a non-finite step (the trainer's ``diverged`` marker; they are
  evaluated as they stood);
* ``collapsed``: runs whose final clean accuracy (``eval.json`` at ε = 0, or the prevalence test set's
  mean accuracy for the label-imbalance experiments) is ``COLLAPSE_POINTS`` or more
  below the best clean test accuracy of their own epochs (``metrics.csv``).  Seed-to-seed standard
  deviations of converged clean accuracy in these tables are about 1 point, so a fall of 10 points from a
  run's own best is not noise;
* ``max_drop``: the largest such fall of the row (points), and ``seeds`` of the stopped or collapsed runs.

No training, no network; the runs are only read.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

COLLAPSE_POINTS = 10.0
FIELDS = ("folder", "row", "runs", "stopped", "collapsed", "max_drop", "seeds")


def run_drop(run: Path) -> float:
    """Best epoch's clean test accuracy minus the final evaluation's, in points."""
    with (run / "metrics.csv").open(newline="") as handle:
        epochs = [float(row["test_acc"]) for row in csv.DictReader(handle) if row.get("test_acc")]
    report = json.loads((run / "eval.json").read_text())
    if "prevalence" in report:  # label-imbalance experiments: the mean accuracy on the prevalence test set
        clean = [report["prevalence"]["mean_accuracy"]]
    else:  # robustness experiments: the clean column of the FGSM sweep
        clean = [r["mean_acc"] for r in report.get("results", []) if float(r["eps"]) == 0.0]
    if not epochs or not clean:
        raise ValueError(f"{run}: no per-epoch test accuracy or no clean evaluation to compare")
    return 100 * (max(epochs) - clean[0])


def divergence_rows(results: Path) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[tuple[int, Path]]] = {}
    for config_path in sorted(results.rglob("*-seed[0-9]*/config.json")):
        run = config_path.parent
        config = json.loads(config_path.read_text())
        if config.get("eval_split") != "test" or not (run / "eval.json").is_file():
            continue
        key = (run.parent.relative_to(results).as_posix(), config.get("label") or config["method"])
        groups.setdefault(key, []).append((int(config["seed"]), run))
    rows = []
    for (folder, label), runs in sorted(groups.items()):
        drops = {seed: run_drop(run) for seed, run in runs}
        stopped = {seed for seed, run in runs if (run / "diverged").exists()}
        collapsed = {seed for seed, drop in drops.items() if drop >= COLLAPSE_POINTS}
        rows.append({"folder": folder, "row": label, "runs": len(runs), "stopped": len(stopped),
                     "collapsed": len(collapsed), "max_drop": round(max(drops.values()), 2),
                     "seeds": " ".join(str(seed) for seed in sorted(stopped | collapsed))})
    return rows


def main(argv: list[str]) -> int:
    results = Path(argv[1] if len(argv) > 1 else "results")
    rows = divergence_rows(results)
    if not rows:
        print(f"{results}: no finished test-split runs under it", file=sys.stderr)
        return 2
    with (results / "divergences.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    bad = [row for row in rows if row["stopped"] or row["collapsed"]]
    print(f"{len(rows)} rows, {sum(row['runs'] for row in rows)} runs; rows with a stopped or collapsed run: "
          + (", ".join(f"{row['folder']}/{row['row']} (seeds {row['seeds']})" for row in bad) or "none")
          + f" -> {results / 'divergences.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
