"""Paired contrasts of the MNIST-attributes comparison (issue 36): does DR help, do the importance weights?

    python scripts/attribute_contrasts.py [results/mnist-attributes-small]

Reads the runs' eval.json under ``DIR/weighted`` (trained with the paper's importance weights) and
``DIR/unweighted`` (without; their rows are prefixed ``unweighted:``) and writes ``DIR/contrasts.{csv,md}``:
reference minus other per seed, mean and Student-t 95 % interval, for every metric of both test sets.
A contrast whose two rows have not both run is named as not run.  No training.
"""

from __future__ import annotations

import sys
from pathlib import Path

from drmoo.experiments.mnist_attributes import write_contrasts

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


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "results/mnist-attributes-small")
    print(write_contrasts(root, {"": root / "weighted", "unweighted:": root / "unweighted"}, CONTRASTS))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
