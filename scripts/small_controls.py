"""The controls of the 2-digit small verdict, tabulated from committed runs (no training here).

    python scripts/small_controls.py [results/multimnist2-small]
    python scripts/small_controls.py modes results/multimnist-k-small/multimnist4

writes, from the runs' ``eval.json`` and ``config.json`` files:

* ``rate-sensitivity.csv`` / ``rate-sensitivity.md``: the top five rows of the comparison
  (Double-Clip, FAMO, Nash-MTL, MoCo, MoDo) and MGDA, each at three learning rates: the rate of
  the sweep's first stage (seed 0 alone), of its second stage (the comparison's rate) and the
  common rate 0.3.  Per rate set and ε: each row's mean ± std over seeds 0-4, its rank among the
  six, and Double-Clip minus it (paired over seeds, 95 % t interval, wins).  Every run's learning
  rate is read from its config.json and checked against the rate set it is listed in.
* ``ablations/contrasts.csv``: paired differences between ablation rows and the rows they ablate
  (``ablations/paired.csv`` has Double-Clip minus each ablation row).
* ``lr-sweep/two-stage.csv`` (and ``batch64/lr-sweep/two-stage.csv`` once that sweep has both stages):
  the sweep's two stages per finalist rate: seed 0 (stage 1), the mean of seeds 1-2 (stage 2), the
  3-seed mean that decides, and the winner (``scripts/sweep_rule.py``'s rule).
* ``features/vs-parameters.csv`` / ``features/vs-parameters.md`` (once ``features/`` holds its runs,
  ``bash scripts/reproduce_small.sh features``): each method of ``FEATURES_METHODS`` with
  ``jacobian="features"`` minus the same method in parameters mode (the comparison's committed run
  of the same seed, rate and data: both are deterministic), paired over seeds 0-4 per ε, and the
  mean training wall time of both (the trunk is a small LeNet, so the time saved is small here); and,
  once ``features/swept/`` holds them (``features-sweep``, ``features-runoff``, ``features-swept``),
  the same for Double-Clip and Nash-MTL at the rate swept in features mode, with the sweep's
  ``features/lr-sweep/two-stage.csv``.
* with ``modes DIR``: ``DIR/vs-parameters.csv`` / ``.md``, the same pairing for a comparison whose rows
  hold both modes (``bash scripts/reproduce_small.sh k4``), over the seeds both modes finished; with the
  rows of ``DIR/features-swept/`` too where it exists (``k9-swept``: rates swept at that k), and the
  sweep's ``DIR/features-lr-sweep/two-stage.csv`` once its runoff ran.
* ``w-ranges.csv``: per row of the comparison and of ``ablations/``, the range each w_i took over all
  steps and seeds (the balancing table of ``table.md``, as numbers): ``low_w1``, ``high_w1``, ...,
  and ``max_off_uniform``, the largest |w_i - 1/m| seen.

``bash scripts/reproduce_small.sh controls`` runs it.  The paired statistics are the comparison's
own (:func:`drmoo.experiments.paired_stats.paired_differences`).
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

from drmoo.experiments.paired_stats import paired_differences
from drmoo.experiments.robustness import preference_trace
from drmoo.experiments.summaries import mean_std, ranks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_rule import clean_by_rate, finalists, winners  # a sibling script

from drmoo.experiments.variants import parse_variants

SEEDS = (0, 1, 2, 3, 4)
EPS = (0.0, 0.01, 0.03, 0.05, 0.08, 0.1, 0.15, 0.2)
REFERENCE = "double-clip"
RATE_SETS = ("stage-1", "stage-2", "common-0.3")
# Where each row's runs at each rate set are (a run directory prefix, relative to the results
# directory; "-seed{N}" is appended), and the trunk rate its config.json must have.
RATE_RUNS: dict[str, dict[str, tuple[str, float]]] = {
    "double-clip": {"stage-1": ("one-seed-rates/double-clip", 3.0), "stage-2": ("double-clip", 1.0),
                    "common-0.3": ("common-rate/double-clip_lr-0.3", 0.3)},
    "famo": {"stage-1": ("famo", 0.3), "stage-2": ("famo", 0.3), "common-0.3": ("famo", 0.3)},
    "nashmtl": {"stage-1": ("nashmtl", 0.3), "stage-2": ("nashmtl", 0.3), "common-0.3": ("nashmtl", 0.3)},
    # MoCo's first stage is its first choice (ema 0.9, lr 0.3), also its run at the common rate; its
    # second, its own 3-seed sweep's choice (ema 0.8, lr 0.2)
    "moco": {"stage-1": ("one-seed-rates/moco", 0.3), "stage-2": ("moco", 0.2),
             "common-0.3": ("one-seed-rates/moco", 0.3)},
    "modo": {"stage-1": ("modo", 0.3), "stage-2": ("modo", 0.3), "common-0.3": ("modo", 0.3)},
    "mgda": {"stage-1": ("one-seed-rates/mgda", 0.3), "stage-2": ("mgda", 0.1),
             "common-0.3": ("one-seed-rates/mgda", 0.3)},
}
# (row, run-directory prefix) minus (row, prefix): what each ablation changes, one thing at a time.
CONTRASTS: list[tuple[tuple[str, str], tuple[str, str]]] = [
    (("mgda[lr=1.0,clip_c1=1.0,clip_c2=0.5]", "ablations/mgda_lr-1.0_clip_c1-1.0_clip_c2-0.5"), ("mgda", "mgda")),
    # The missing arm (issue 36 item 6): the rate alone, then the clip alone at that rate.
    (("mgda[lr=1.0]", "ablations/mgda_lr-1.0"), ("mgda", "mgda")),
    (("mgda[lr=1.0,clip_c1=1.0,clip_c2=0.5]", "ablations/mgda_lr-1.0_clip_c1-1.0_clip_c2-0.5"),
     ("mgda[lr=1.0]", "ablations/mgda_lr-1.0")),
    (("mgda[lam=100]", "ablations/mgda_lam-100"), ("mgda", "mgda")),
    (("double-clip[pref_lr=0]", "ablations/double-clip_pref_lr-0"), ("double-clip", "double-clip")),
    (("double-clip[lam=100,pref_lr=0]", "ablations/double-clip_lam-100_pref_lr-0"),
     ("double-clip[pref_lr=0]", "ablations/double-clip_pref_lr-0")),
    (("double-clip[lam=100,pref_lr=0]", "ablations/double-clip_lam-100_pref_lr-0"),
     ("mgda[pref_lr=0]", "mgda_pref_lr-0")),
]


def accuracies(results: Path, prefix: str, expected_lr: float | None = None) -> dict[float, dict[int, float]]:
    """{eps: {seed: accuracy %}} of the runs ``prefix``-seed0..4, checked to be finished test runs."""
    runs = {seed: results / f"{prefix}-seed{seed}" for seed in SEEDS}
    for seed, run in runs.items():
        config = json.loads((run / "config.json").read_text())
        if config["seed"] != seed or config["eval_split"] != "test":
            raise ValueError(f"{run} is not the test run of seed {seed}")
        if expected_lr is not None and not math.isclose(config["hparams"]["lr"], expected_lr):
            raise ValueError(f"{run} ran at lr {config['hparams']['lr']}, not {expected_lr}")
    return _accuracy_table(runs)  # (which checks each eval.json's seed too)


def _fmt(value: float, signed: bool = False) -> str:
    return f"{value:+.2f}".replace("-", "−") if signed else f"{value:.2f}"


def rate_sensitivity(results: Path) -> tuple[list[dict[str, Any]], str]:
    rows: list[dict[str, Any]] = []
    sections = []
    for rate_set in RATE_SETS:
        per_seed = {row: accuracies(results, *runs[rate_set]) for row, runs in RATE_RUNS.items()}
        paired = {(p["other"], p["column"]): p for p in paired_differences(per_seed, REFERENCE, list(EPS))}
        rank_of = {eps: ranks({row: mean_std(list(per_seed[row][eps].values()))[0] for row in per_seed})
                   for eps in EPS}
        for row, runs in RATE_RUNS.items():
            for eps in EPS:
                mean, std = mean_std([per_seed[row][eps][seed] for seed in SEEDS])
                difference = paired.get((row, eps), {})
                rows.append({"rates": rate_set, "row": row, "lr": runs[rate_set][1], "eps": eps, "mean": mean,
                             "std": std, "rank": rank_of[eps][row],
                             "diff_mean": difference.get("mean", ""), "ci_low": difference.get("ci_low", ""),
                             "ci_high": difference.get("ci_high", ""), "wins": difference.get("wins", ""),
                             "runs": runs[rate_set][0]})
    # Side by side: one table per eps shown, a column per rate set.
    lines = ["# Rate sensitivity, 2 digits, `small` preset", "",
             "Generated by `python scripts/small_controls.py` from the committed runs; every number is in "
             "`rate-sensitivity.csv`. Rows: the comparison's top five and MGDA. Rates: **stage 1** = the "
             "one-seed sweep's choice (the first comparison, `one-seed-rates/`), **stage 2** = the 3-seed "
             "run-off's choice (the comparison, `./`), **common 0.3** = every row at trunk rate 0.3 (MoCo at its "
             "first choice, ema 0.9; Double-Clip's runs in `common-rate/`). Where a row's rate is the same in "
             "two sets the runs are the same. Cells: mean ± std over seeds 0-4 (rank among these six); "
             "Double-Clip minus the row, paired: mean [95 % CI] wins/5.", ""]
    lines += ["## The verdict at each rate set", "",
              "Double-Clip's rank among the six by mean, then the rows whose paired 95 % interval against it "
              "excludes 0 (Double-Clip ahead: `>`, behind: `<`); every other difference is not distinguishable "
              "from 0 at n = 5.", "",
              "| ε | " + " | ".join(RATE_SETS) + " |", "|---|" + "---|" * len(RATE_SETS)]
    for eps in EPS:
        cells = []
        for rate_set in RATE_SETS:
            mine = [r for r in rows if r["rates"] == rate_set and r["eps"] == eps]
            (reference,) = [r for r in mine if r["row"] == REFERENCE]
            ahead = [r["row"] for r in mine if r["diff_mean"] != "" and r["ci_low"] > 0]
            behind = [r["row"] for r in mine if r["diff_mean"] != "" and r["ci_high"] < 0]
            cells.append(f"{reference['rank']:g} of {len(mine)}" + (f"; > {', '.join(ahead)}" if ahead else "")
                         + (f"; < {', '.join(behind)}" if behind else ""))
        lines.append(f"| {'clean' if eps == 0 else f'{eps:g}'} | " + " | ".join(cells) + " |")
    lines.append("")
    for eps in EPS:
        label = "clean" if eps == 0 else f"ε {eps:g}"
        lines += [f"## {label}", "", "| row | " + " | ".join(f"{s}: lr, accuracy" for s in RATE_SETS)
                  + " | " + " | ".join(f"{s}: Double-Clip − row" for s in RATE_SETS) + " |",
                  "|---|" + "---:|" * (2 * len(RATE_SETS))]
        for row in RATE_RUNS:
            cells, diffs = [], []
            for rate_set in RATE_SETS:
                (record,) = [r for r in rows if r["rates"] == rate_set and r["row"] == row and r["eps"] == eps]
                cells.append(f"{record['lr']:g}: {_fmt(record['mean'])} ± {_fmt(record['std'])} "
                             f"({record['rank']:g})")
                diffs.append("–" if record["diff_mean"] == "" else
                             f"{_fmt(record['diff_mean'], True)} [{_fmt(record['ci_low'], True)}, "
                             f"{_fmt(record['ci_high'], True)}] {record['wins']}/5")
            lines.append(f"| {row} | " + " | ".join(cells) + " | " + " | ".join(diffs) + " |")
        lines.append("")
    sections.append("\n".join(lines))
    return rows, "\n".join(sections)


def contrasts(results: Path) -> list[dict[str, Any]]:
    out = []
    for (row, prefix), (other, other_prefix) in CONTRASTS:
        per_seed = {row: accuracies(results, prefix), other: accuracies(results, other_prefix)}
        out += paired_differences(per_seed, row, list(EPS))
    return out


FEATURES_METHODS = ("double-clip", "mgda", "famo", "nashmtl")  # issue 26 item 7's rows


def finished_test_runs(directory: Path) -> dict[str, dict[int, Path]]:
    """{row label: {seed: run}} of the finished test-split runs directly under ``directory``."""
    out: dict[str, dict[int, Path]] = {}
    for config_path in sorted(directory.glob("*-seed[0-9]*/config.json")):
        run = config_path.parent
        config = json.loads(config_path.read_text())
        if config["eval_split"] != "test" or not (run / "eval.json").is_file():
            continue
        out.setdefault(config["label"] or config["method"], {})[int(config["seed"])] = run
    return out


def _accuracy_table(runs: dict[int, Path]) -> dict[float, dict[int, float]]:
    per_eps: dict[float, dict[int, float]] = {eps: {} for eps in EPS}
    for seed, run in runs.items():
        report = json.loads((run / "eval.json").read_text())
        if report["seed"] != seed:
            raise ValueError(f"{run}: eval.json is of seed {report['seed']}, config.json of seed {seed}")
        by_eps = {result["eps"]: 100 * result["mean_acc"] for result in report["results"]}
        for eps in EPS:
            per_eps[eps][seed] = by_eps[eps]
    return per_eps


def training_seconds(epochs: list[dict[str, Any]]) -> float:
    """A run's training time from its metrics.json rows.  ``wall_time_s`` counts from the start of the
    process that trained the epoch, so a resumed run starts again near 0: its time is the sum of each
    process's last value (the last row alone undercounted a run resumed at epoch 30 of 40 by 94 %)."""
    total, previous = 0.0, 0.0
    for epoch in epochs:
        if epoch["wall_time_s"] < previous:  # a new process resumed the run here
            total += previous
        previous = epoch["wall_time_s"]
    return total + previous


def _mean_wall_time(runs: dict[int, Path]) -> float:
    times = [training_seconds(json.loads((run / "metrics.json").read_text())) for run in runs.values()]
    return sum(times) / len(times)


def features_vs_parameters(parameters_dir: Path, features_dirs: list[Path],
                           title: str) -> tuple[list[dict[str, Any]], str]:
    """Each ``jacobian=features`` row of ``features_dirs`` minus the same method's parameters-mode row
    (the row named by the method alone, in ``parameters_dir``), paired over the seeds both finished;
    the csv rows and the markdown table.  Runs are deterministic, so a pair differs by the mode (and
    the rate, where the features row sets its own ``lr``) only."""
    parameters = finished_test_runs(parameters_dir)
    rows: list[dict[str, Any]] = []
    lines = [f"# Features mode against parameters mode ({title})", "",
             "Each cell: the method with `jacobian=\"features\"` minus the same method with the paper's",
             "Jacobian, in accuracy points: mean [95 % t interval] (seeds where features mode is higher),",
             "over the seeds both modes finished.  Written by `scripts/small_controls.py` from the runs'",
             "`config.json` and `eval.json`.", "",
             "| row | seeds | " + " | ".join(f"ε {eps:g}" for eps in EPS) + " | training s (features / parameters) |",
             "|---|---:|" + "---:|" * (len(EPS) + 1)]
    for directory in features_dirs:
        for label, runs in finished_test_runs(directory).items():
            (variant,) = parse_variants(label)
            if variant.hparams.get("jacobian") != "features" or variant.method not in parameters:
                continue
            theirs = parameters[variant.method]
            seeds = sorted(set(runs) & set(theirs))
            if len(seeds) < 2:
                continue
            mine, theirs = {seed: runs[seed] for seed in seeds}, {seed: theirs[seed] for seed in seeds}
            paired = paired_differences({label: _accuracy_table(mine), variant.method: _accuracy_table(theirs)},
                                        label, list(EPS))
            rows += paired
            cells = [f"{_fmt(r['mean'], True)} [{_fmt(r['ci_low'], True)}, {_fmt(r['ci_high'], True)}] ({r['wins']})"
                     for r in paired]
            times = f"{_mean_wall_time(mine):.0f} / {_mean_wall_time(theirs):.0f}"
            lines.append(f"| {label} | {len(seeds)} | " + " | ".join(cells) + f" | {times} |")
    lines.append("")
    return rows, "\n".join(lines)


def w_ranges(results: Path) -> list[dict[str, Any]]:
    out = []
    for directory in (results, results / "ablations"):
        rows: dict[str, list[Path]] = {}
        for config_path in sorted(directory.glob("*-seed[0-9]/config.json")):
            config = json.loads(config_path.read_text())
            rows.setdefault(config["label"] or config["method"], []).append(config_path.parent)
        for label, runs in rows.items():
            traces = [preference_trace(run) for run in runs]
            if any(trace is None for trace in traces):
                raise ValueError(f"{label} in {directory}: a run has no readable steps.csv")
            tasks = len(traces[0]["final"])
            record: dict[str, Any] = {"comparison": directory.relative_to(results).as_posix(), "row": label,
                                      "seeds": len(runs)}
            for i in range(tasks):
                record[f"low_w{i + 1}"] = min(trace["low"][i] for trace in traces)
                record[f"high_w{i + 1}"] = max(trace["high"][i] for trace in traces)
            record["max_off_uniform"] = max(max(abs(record[f"low_w{i + 1}"] - 1 / tasks),
                                                abs(record[f"high_w{i + 1}"] - 1 / tasks)) for i in range(tasks))
            out.append(record)
    return out


def two_stage(sweep: Path) -> list[dict[str, Any]]:
    first, second = clean_by_rate(sweep / "table.csv"), clean_by_rate(sweep / "runoff" / "table.csv")
    chosen = winners(sweep)
    return [{"method": method, "lr": lr, "seed0": first[method][lr], "seeds12": second[method][lr],
             "three_seed_mean": (first[method][lr] + 2 * second[method][lr]) / 3, "winner": lr == chosen[method]}
            for method, pair in finalists(sweep).items() for lr in sorted(pair)]


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "modes":  # one comparison holding both modes' rows (Multi-MNIST-k)
        comparison = Path(argv[2])
        # Features rows at rates swept for this comparison itself (reproduce_small.sh k9-swept), when present.
        features_dirs = [comparison] + [d for d in [comparison / "features-swept"] if d.is_dir()]
        rows, markdown = features_vs_parameters(comparison, features_dirs, f"{comparison.name}, small preset")
        write_csv(comparison / "vs-parameters.csv", rows)
        (comparison / "vs-parameters.md").write_text(markdown)
        if (comparison / "features-lr-sweep" / "runoff" / "table.csv").is_file():
            write_csv(comparison / "features-lr-sweep" / "two-stage.csv", two_stage(comparison / "features-lr-sweep"))
        print(f"wrote {comparison / 'vs-parameters.csv'}, {comparison / 'vs-parameters.md'}")
        return 0
    results = Path(argv[1] if len(argv) > 1 else "results/multimnist2-small")
    rows, markdown = rate_sensitivity(results)
    write_csv(results / "rate-sensitivity.csv", rows)
    (results / "rate-sensitivity.md").write_text(markdown)
    write_csv(results / "ablations" / "contrasts.csv", contrasts(results))
    write_csv(results / "w-ranges.csv", w_ranges(results))
    write_csv(results / "lr-sweep" / "two-stage.csv", two_stage(results / "lr-sweep"))
    if all((results / "features" / f"{m}_jacobian-features-seed{seed}" / "eval.json").is_file()
           for m in FEATURES_METHODS for seed in SEEDS):
        rows, markdown = features_vs_parameters(
            results, [results / "features", results / "features" / "swept"], "2 digits, small preset")
        write_csv(results / "features" / "vs-parameters.csv", rows)
        (results / "features" / "vs-parameters.md").write_text(markdown)
    if (results / "features" / "lr-sweep" / "runoff" / "table.csv").is_file():
        write_csv(results / "features" / "lr-sweep" / "two-stage.csv", two_stage(results / "features" / "lr-sweep"))
    regime = results / "batch64" / "lr-sweep"
    if (regime / "runoff" / "table.csv").is_file():  # the second regime, once its sweep has both stages
        write_csv(regime / "two-stage.csv", two_stage(regime))
    print(f"wrote {results / 'rate-sensitivity.csv'}, {results / 'rate-sensitivity.md'}, "
          f"{results / 'ablations' / 'contrasts.csv'}, {results / 'w-ranges.csv'}, "
          f"{results / 'lr-sweep' / 'two-stage.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
