"""The ``drmoo`` command line: one sub-command per experiment."""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _comma_list(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def _int_list(text: str) -> list[int]:
    try:
        return [int(item) for item in _comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value  # a bare word, e.g. divergence=kl
    return key.strip(), parsed


def _add_synthetic(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "synthetic",
        help="the paper's synthetic experiments (App. E): convergence of every method on the DR dual",
        description="Train each method on a small multi-task problem with the paper's settings and write "
        "metrics.csv, summary.json/.md and convergence.png (balanced gradient norm vs iterations and samples).",
    )
    parser.add_argument("--problem", default="linear",
                        help="linear (App. E.1, synthetic) or wine (App. E.2, needs --data-root)")
    parser.add_argument("--methods", type=_comma_list, default=["double-clip", "double-loop"],
                        help="comma-separated registry names, or 'all' (default: double-clip,double-loop)")
    seeds = parser.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, help="one seed (default 0)")
    seeds.add_argument("--seeds", type=_int_list, help="comma-separated seeds, e.g. 0,1,2")
    parser.add_argument("--steps", type=int, help="iterations (default: the paper's, 600 linear, 1000 wine)")
    parser.add_argument("--batch-size", type=int, help="batch size (default 256)")
    parser.add_argument("--data-root", help="wine: the UCI white-wine CSV (winequality-white.csv) or its directory")
    parser.add_argument("--hp", type=_override, action="append", default=[], metavar="KEY=VALUE",
                        help="override a hyperparameter of every method, e.g. --hp lam=0.8 (repeatable)")
    parser.add_argument("--out", required=True, help="output directory (finished runs in it are reused)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(handler=_run_synthetic)


def _run_synthetic(args: argparse.Namespace) -> int:
    from drmoo.experiments.synthetic import PAPER_PRESETS, SyntheticConfig, run_synthetic
    from drmoo.optim import available

    methods = args.methods
    if methods == ["all"]:
        methods = [m for m in available() if m in PAPER_PRESETS.get(args.problem, {}).get("methods", {})]
    seeds = args.seeds if args.seeds is not None else [args.seed if args.seed is not None else 0]
    config = SyntheticConfig(
        problem=args.problem, methods=methods, seeds=seeds, steps=args.steps, batch_size=args.batch_size,
        overrides=dict(args.hp), data_root=args.data_root,
    )
    summary = run_synthetic(config, args.out, progress=not args.quiet)
    from drmoo.experiments.reporting import summary_table

    print(summary_table(summary))
    print(f"wrote {args.out}/metrics.csv, summary.json, summary.md, convergence.csv, convergence.png")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drmoo", description="Distributionally robust multi-objective optimization: experiments and tools."
    )
    from drmoo import __version__

    parser.add_argument("--version", action="version", version=f"drmoo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_synthetic(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except (ValueError, FileNotFoundError, FloatingPointError) as error:
        # User-facing problems (bad names, missing files, divergence) get one clear line, not a traceback.
        print(f"drmoo {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"drmoo {args.command}: interrupted; finished runs are kept in the output directory", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
