"""``drmoo report``: result directories collected into one markdown file."""

from __future__ import annotations

import argparse

from .arguments import _Parser, _path


def _add_report(sub: argparse._SubParsersAction[_Parser]) -> None:
    parser = sub.add_parser(
        "report", help="collect the tables and figures of result directories into one markdown file",
        description="Walk the given directories, recognise synthetic comparisons, robustness comparisons, "
        "ablations, wall-clock and kernel-benchmark results and single training runs, and write one markdown "
        "file that embeds their tables and links their PNGs (paths relative to the report), with the machine, "
        "backend and settings each records. Directories holding none of these are listed as skipped.",
    )
    parser.add_argument("--runs", type=_path, nargs="+", required=True, metavar="DIR",
                        help="result directories to collect")
    parser.add_argument("--out", type=_path, required=True,
                        help="the markdown file to write, e.g. report.md (an existing file is replaced only when "
                        "drmoo report wrote it)")
    parser.add_argument("--title", default="drmoo results", help="the report's title (default: %(default)s)")


def _run_report(args: argparse.Namespace) -> int:
    from drmoo.experiments.results_report import write_report

    sections, skipped = write_report(args.runs, args.out, title=args.title)
    print(f"wrote {args.out}: {sections} section(s), {skipped} skipped")
    return 0
