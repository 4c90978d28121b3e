"""Paired contrasts of the MNIST-attributes comparison (issue 36): does DR help, do the importance weights?

    python scripts/attribute_contrasts.py [results/mnist-attributes-small]

Reads the runs' eval.json under ``DIR/weighted`` (trained with the paper's importance weights) and
``DIR/unweighted`` (without; their rows are prefixed ``unweighted:``) and writes ``DIR/contrasts.{csv,md}``:
reference minus other per seed, mean and Student-t 95 % interval, for every metric of both test sets.
A contrast whose two rows have not both run is named as not run.  No training.

Once both stages of the validation rate sweep have run (``DIR/lr-sweep``, ``scripts/sweep_rule.py``), the
contrasts are also taken at the rates it chose (where those are not the preset's): Double-Clip against
MGDA and the plain reference at their winning rates, MGDA against the plain reference, DR (a row
against its ``lam=100`` twin) at each tuned rate of Double-Clip and MGDA, and the importance weights (a
row against its twin trained without them) at each tuned rate.
"""

from __future__ import annotations

import sys
from pathlib import Path

from drmoo.experiments.mnist_attributes import write_contrasts

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sweep_rule.py, beside this script (not a package)
from sweep_rule import preset_rows

PLAIN = "mgda[lam=100,pref_lr=0]"  # equal weights on the (nearly) plain mean of the task losses
CONTRASTS = (
    # DR: the method against itself with lambda = 100 (the chi^2 dual's weights within ~1 % of uniform)
    ("double-clip", "double-clip[lam=100]"),
    ("mgda", "mgda[lam=100]"),
    # the importance weights: each row against itself trained without them
    ("double-clip", "unweighted:double-clip"),
    ("mgda", "unweighted:mgda"),
    (PLAIN, f"unweighted:{PLAIN}"),
    # against the plain reference a practitioner would try first, with and without the weights
    ("double-clip", PLAIN),
    ("mgda", PLAIN),
    ("double-clip", f"unweighted:{PLAIN}"),
)


def tuned_contrasts(root: Path) -> list[tuple[str, str]]:
    """The contrasts at the sweep's winning rates (see the module's docstring); none until both stages ran."""
    try:
        rows = preset_rows(root / "lr-sweep", "mnist-attributes", keys=("double-clip", "mgda", PLAIN))
    except (FileNotFoundError, ValueError):  # a stage not run yet, or a runoff that is not the finalists'
        return []
    plain = next(row for row in rows if row.startswith(PLAIN[:-1]))
    double_clip = next(row for row in rows if row.split("[")[0] == "double-clip")
    mgda = next(row for row in rows if row.split("[")[0] == "mgda" and row != plain)
    twins = [(row, f"{row.split('[')[0]}[lam=100,{row.split('[', 1)[1]}") for row in (double_clip, mgda)
             if "lr=" in row]
    unweighted = [(row, f"unweighted:{row}") for row in (double_clip, mgda, plain) if "lr=" in row]
    wanted = [(double_clip, mgda), (double_clip, plain), (mgda, plain), *twins, *unweighted]
    return [pair for pair in wanted if pair not in CONTRASTS]


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "results/mnist-attributes-small")
    contrasts = [*CONTRASTS, *tuned_contrasts(root)]
    print(write_contrasts(root, {"": root / "weighted", "unweighted:": root / "unweighted"}, contrasts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
