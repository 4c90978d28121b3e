"""``drmoo train --cuda-graph`` timed against eager ``drmoo train``: the same run, both ways, in one process.

    PYTHONPATH=python python scripts/gpu_step_timing.py --out DIR [--steps 20] [-- extra drmoo train arguments]

Trains the same run (multimnist2, Double-Clip, the quick preset, seed 0) twice for ``--steps`` steps: eagerly,
then with ``--cuda-graph`` (3 eager warm-up steps, a capture, replays), and resumes the graphed run by one step
(a checkpoint written by a graphed run must resume).  Each step's ``step_s`` (its wall-clock time, read
from the run's ``steps.csv``: the step and the host reads of its logging) is compared over the steady
steps: the eager run's after its first, the graphed run's after its warm-up and capture.  Writes
``DIR/train-graph.{json,md}`` and prints the table.

``--stand-in`` (the GPU check's dry run on the CPU): the second run is eager too (``--cuda-graph`` needs
CUDA); the code path is walked, the times compare nothing.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Any

GRAPH_WARMUP = 4  # GraphedStep's 3 eager warm-up steps and the capture step


def steady_step_seconds(run_dir: Path, skip: int) -> list[float]:
    """The ``step_s`` of the run's steps after the first ``skip``."""
    with open(run_dir / "steps.csv", newline="") as rows:
        return [float(row["step_s"]) for row in csv.DictReader(rows)][skip:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the two runs and train-graph.{json,md}")
    parser.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--stand-in", action="store_true", help="CPU dry run: the graphed run is eager as well")
    parser.add_argument("train_args", nargs="*", help="extra drmoo train arguments (after --)")
    args = parser.parse_args(argv)
    if args.steps <= GRAPH_WARMUP + 1:
        parser.error(f"--steps must exceed {GRAPH_WARMUP + 1} (the graphed run's warm-up and capture come first)")
    from drmoo.cli import main as drmoo

    common = ["train", "--experiment", "multimnist2", "--method", "double-clip", "--preset", "quick",
              "--device", args.device, "--max-steps", str(args.steps), "--quiet", *args.train_args]
    eager_dir, graph_dir = args.out / "eager", args.out / "graph"
    graph_flag = [] if args.stand_in else ["--cuda-graph"]
    for run_dir, flags in ((eager_dir, []), (graph_dir, graph_flag)):
        code = drmoo([*common, *flags, "--out", str(run_dir)])
        if code:
            print(f"drmoo train {' '.join(flags)} exited {code}", file=sys.stderr)
            return code
    code = drmoo(["train", "--resume", str(graph_dir), "--max-steps", str(args.steps + 1), "--quiet"])
    if code:
        print(f"resuming the graphed run exited {code}", file=sys.stderr)
        return code
    eager = steady_step_seconds(eager_dir, 1)
    graphed = steady_step_seconds(graph_dir, GRAPH_WARMUP)[: args.steps - GRAPH_WARMUP]  # not the resumed step
    data: dict[str, Any] = {"device": args.device, "stand_in": args.stand_in, "steps": args.steps,
                            "eager_step_s": eager, "graph_step_s": graphed,
                            "eager_median_s": statistics.median(eager), "graph_median_s": statistics.median(graphed)}
    data["graph_over_eager"] = data["graph_median_s"] / data["eager_median_s"]
    stand_in = " (CPU stand-in: both runs eager, the times compare nothing)" if args.stand_in else ""
    table = "\n".join([
        f"# drmoo train, eager against --cuda-graph{stand_in}", "",
        f"multimnist2, Double-Clip, quick preset, {args.steps} steps each on {args.device}; `step_s` of "
        f"`steps.csv` (a step's wall clock, its logging's host reads included), medians over the steady steps "
        f"(eager: after the first; graphed: after {GRAPH_WARMUP - 1} warm-up steps and the capture).", "",
        "| run | steady steps | median step | ratio |", "|---|---:|---:|---:|",
        f"| eager | {len(eager)} | {data['eager_median_s'] * 1e3:.2f} ms | 1.00x |",
        f"| --cuda-graph | {len(graphed)} | {data['graph_median_s'] * 1e3:.2f} ms | {data['graph_over_eager']:.2f}x |",
    ])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train-graph.json").write_text(json.dumps(data, indent=1) + "\n")
    (args.out / "train-graph.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
