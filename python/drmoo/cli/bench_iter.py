"""``drmoo bench-iter``: seconds per iteration of every method against its floors."""

from __future__ import annotations

import argparse

from .arguments import (
    BACKENDS,
    BENCH_EXPERIMENTS,
    CLOCKS,
    _count,
    _name_list,
    _non_negative,
    _Parser,
    _path,
)
from .run_options import _check_out_dir


def _add_bench_iter(sub: argparse._SubParsersAction[_Parser]) -> None:
    parser = sub.add_parser(
        "bench-iter", help="seconds per iteration of every method vs the 1 fwd + m bwd floor and vs its own "
        "algorithm's passes",
        description="Time iterations of each method on a Multi-MNIST ResNet18 (random inputs of the experiment's "
        "shape) and compare them with the floor every method pays, one forward and m backward passes, and with the "
        "passes its own algorithm makes. Writes the medians as a markdown table, a CSV and a figure in --out.",
    )
    parser.add_argument("--experiment", default="multimnist2", choices=BENCH_EXPERIMENTS,
                        help="the Multi-MNIST model to time (default: %(default)s)")
    parser.add_argument("--methods", type=_name_list, default=["all"],
                        help="all or a comma-separated list (default: all)")
    parser.add_argument("--batch-size", type=_count, default=256,
                        help="batch size (default: %(default)s, the paper's; use less on a CPU)")
    parser.add_argument("--input-size", type=_count, help="default: the paper's (128 for 2 digits, 96 for 3)")
    parser.add_argument("--repeats", type=_count, default=20,
                        help="timed iterations per method (medians; default: %(default)s)")
    parser.add_argument("--warmup", type=_non_negative, default=3,
                        help="untimed iterations per method first (at least one: its passes are counted there; "
                        "default: %(default)s)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: %(default)s)")
    parser.add_argument("--backend", choices=BACKENDS, help="kernel backend (default: automatic, by device)")
    parser.add_argument("--clock", choices=CLOCKS, default="auto",
                        help="wall: elapsed time; cpu: this process's CPU time (a shared CPU); auto: cpu on a CPU "
                        "(default: %(default)s)")
    parser.add_argument("--api", choices=("step", "balancer"), default="step",
                        help="step: optimizer.step(closure); balancer: drmoo.Balancer.backward + Adam.step against "
                        "forward + m backward + Adam.step (default: %(default)s)")
    parser.add_argument("--out", type=_path, required=True, help="output directory")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _run_bench_iter(args: argparse.Namespace) -> int:
    from pathlib import Path

    from drmoo.experiments.devices import resolve_device
    from drmoo.experiments.multimnist import EXPERIMENTS, PRESETS
    from drmoo.experiments.wallclock import machine_name, measure_iterations, output_stem, write_outputs
    from drmoo.optim import available

    if args.experiment not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {args.experiment!r}; valid choices: {', '.join(EXPERIMENTS)}")
    methods = list(available()) if args.methods == ["all"] else args.methods
    unknown = [m for m in methods if m not in available()]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; valid choices: {', '.join(available())}")
    if args.batch_size < 2:  # the timed ResNet18 trains its BatchNorm layers: one sample cannot be normalised
        raise ValueError(f"--batch-size {args.batch_size}: the model's BatchNorm needs at least 2 samples per batch")
    device = resolve_device(args.device)
    _check_out_dir(args.out)
    size = args.input_size or PRESETS["paper"][args.experiment]["input_size"]
    rows = measure_iterations(args.experiment, methods, args.batch_size, size, device, warmup=args.warmup,
                              repeats=args.repeats, backend=args.backend, progress=not args.quiet, clock=args.clock,
                              api=args.api)
    api = "; drmoo.Balancer + Adam" if args.api == "balancer" else ""
    title = (f"{args.experiment}, ResNet18, batch {args.batch_size}, {size}px, {machine_name(device)}{api}; "
             f"median of {args.repeats} iterations after {max(args.warmup, 1)} warm-up(s)")
    table = write_outputs(rows, Path(args.out), title, stem=output_stem(device, args.batch_size))
    from drmoo.store import read_text

    print(read_text(table))
    return 0
