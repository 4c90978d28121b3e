"""``drmoo synthetic``: the paper's synthetic experiments (App. E)."""

from __future__ import annotations

import argparse

from .arguments import (
    SYNTHETIC_PROBLEMS,
    _count,
    _hp_overrides,
    _name_list,
    _non_negative,
    _override,
    _Parser,
    _path,
    _seed_list,
)
from .run_options import _check_out_dir


def _add_synthetic(sub: argparse._SubParsersAction[_Parser]) -> None:
    parser = sub.add_parser(
        "synthetic",
        help="the paper's synthetic experiments (App. E): convergence of every method on the DR dual",
        description="Train each method on a small multi-task problem with the paper's settings and write "
        "metrics.csv, summary.json/.md and convergence.png (balanced gradient norm vs iterations and samples).",
    )
    parser.add_argument("--problem", default="linear", choices=SYNTHETIC_PROBLEMS,
                        help="linear (App. E.1, synthetic) or wine (App. E.2, needs --data-root) "
                        "(default: %(default)s)")
    parser.add_argument("--methods", type=_name_list, default=["double-clip", "double-loop"],
                        help="comma-separated registry names, or 'all' (default: double-clip,double-loop)")
    seeds = parser.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=_non_negative, help="one seed (default 0)")
    seeds.add_argument("--seeds", type=_seed_list, help="comma-separated seeds, e.g. 0,1,2 (default: --seed's)")
    parser.add_argument("--steps", type=_count, help="iterations (default: the paper's, 600 linear, 1000 wine)")
    parser.add_argument("--batch-size", type=_count, help="batch size (default 256)")
    parser.add_argument("--data-root", type=_path,
                        help="wine: the UCI white-wine CSV (winequality-white.csv) or its directory "
                        "(default: none; wine needs it)")
    parser.add_argument("--hp", type=_override, action="append", default=[], metavar="KEY=VALUE",
                        help="override a hyperparameter of every method, e.g. --hp lam=0.8 (repeatable; default: "
                        "the paper's settings)")
    parser.add_argument("--out", type=_path, required=True,
                        help="output directory: new, empty or an earlier synthetic --out (its finished runs are "
                        "reused; one made with other settings is refused and kept)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _run_synthetic(args: argparse.Namespace) -> int:
    from drmoo.experiments.synthetic import PAPER_PRESETS, SyntheticConfig, check_output_directory, run_synthetic
    from drmoo.optim import available

    methods = args.methods
    if methods == ["all"]:
        methods = [m for m in available() if m in PAPER_PRESETS.get(args.problem, {}).get("methods", {})]
    seeds = args.seeds if args.seeds is not None else [args.seed if args.seed is not None else 0]
    config = SyntheticConfig(
        problem=args.problem, methods=methods, seeds=seeds, steps=args.steps, batch_size=args.batch_size,
        overrides=_hp_overrides(args.hp), data_root=args.data_root,
    )
    # Everything is checked before the output directory is created: the settings, each method's hyperparameter
    # values, the problem's data, and what --out already holds (someone's files, a finished run made with other
    # settings: refused and kept as they are).
    settings = config.check()
    check_output_directory(args.out, settings)
    _check_out_dir(args.out)
    summary = run_synthetic(config, args.out, progress=not args.quiet)
    from drmoo.experiments.summaries import summary_table

    print(summary_table(summary))
    print(f"wrote {args.out}/metrics.csv, summary.json, summary.md, convergence.csv, convergence.png")
    return 0
