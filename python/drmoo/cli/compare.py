"""``drmoo compare``: every method x seed trained and evaluated, and their table."""

from __future__ import annotations

import argparse

from drmoo._echo import echo_items, first_repeat

from .arguments import _eps_list, _jobs, _Parser, _path, _seed_list
from .run_options import _add_eps_space, _add_run_options, _check_data, _check_out_dir, _eps_space_option, _run_config


def _add_compare(sub: argparse._SubParsersAction[_Parser]) -> None:
    parser = sub.add_parser(
        "compare", help="train + evaluate every method x seed; the paper's Table 1 (Multi-MNIST, FGSM) or Table 2 "
        "(CelebA)",
        description="Train every method (and variant) of --methods with every seed of --seeds, evaluate each run, "
        "and write the comparison in --out: table.md/.csv (mean ± std over seeds and rank beside the paper's "
        "numbers), paired differences against --reference, agreement.json and robustness.png (Multi-MNIST). One "
        "directory per run; finished runs are reused and interrupted ones resumed on a rerun. Every setting is "
        "checked before anything is written.",
    )
    _add_run_options(parser)
    parser.add_argument("--methods", default="all",
                        help="a comma-separated list of methods and variants NAME[KEY=VALUE,...], e.g. "
                        "double-clip,mgda,mgda[pref_lr=0],double-clip[lam=0.4] (a variant's text labels its row); "
                        "the item all stands for every registered method, so all,mgda[pref_lr=0] adds a variant to "
                        "them; two rows with the same settings are refused (default: all)")
    parser.add_argument("--seeds", type=_seed_list, default=[0], help="comma-separated seeds (default: 0)")
    parser.add_argument("--eps", type=_eps_list, default=[0.0, 0.01, 0.03, 0.05, 0.08],
                        help="FGSM budgets, comma-separated (default: 0,0.01,0.03,0.05,0.08)")
    parser.add_argument("--reference",
                        help="the row the paired differences are taken against: a row of --methods, by its label "
                        "(default: double-clip, when it is a row)")
    parser.add_argument("--jobs", type=_jobs, default=1,
                        help="runs trained at once in worker processes (1 to 256), each with cores/jobs torch threads, "
                        "each showing its progress, all ending with the comparison (default 1; small models on a CPU: "
                        "the number of cores)")
    _add_eps_space(parser)
    parser.add_argument("--config", metavar="FILE", type=_path,
                        help="settings from a .toml or .json file: the keys of a run's config.json that every row "
                        "shares (not method, seed, label) and compare's own methods, seeds, eps (lists or "
                        "comma-separated), reference, jobs, eps_space; options on the command line override the "
                        "file (default: none)")
    parser.add_argument("--out", type=_path, required=True, help="output directory (finished runs in it are reused)")


def _run_compare(args: argparse.Namespace) -> int:
    import inspect
    from pathlib import Path

    from drmoo.experiments.registry import get_experiment
    from drmoo.experiments.variants import expand_all, parse_variants
    from drmoo.optim import available
    from drmoo.store import UsageError

    try:
        variants = parse_variants(expand_all(args.methods.strip(), list(available())))
    except ValueError as error:
        raise UsageError(f"--methods: {error}") from None
    unknown = [v.method for v in variants if v.method not in available()]
    if unknown:
        raise UsageError(f"unknown method(s) {', '.join(unknown)}; valid choices: {', '.join(available())}")
    repeated = first_repeat(args.seeds)
    if repeated is not None:
        raise UsageError(f"--seeds {echo_items(args.seeds)} repeats a seed: {repeated} (each seed must be a different "
                         "run)")
    # Everything is checked before the output directory is created: a refused comparison writes nothing.
    experiment = get_experiment(args.experiment)
    options = _eps_space_option(args, experiment.compare, experiment.name)
    accepted = inspect.signature(experiment.compare).parameters
    if "reference" in accepted:
        row_names = [v.name for v in variants]
        if args.reference is not None and args.reference not in row_names:
            raise UsageError(f"--reference {args.reference}: no row of the comparison is called that; the rows are "
                             f"{', '.join(row_names)}")
        options["reference"] = args.reference or "double-clip"
    elif args.reference is not None:
        raise UsageError(f"--reference: the {experiment.name} comparison has no paired differences")
    if "jobs" in accepted:
        options["jobs"] = args.jobs
    elif args.jobs != 1:
        raise UsageError(f"--jobs: the {experiment.name} comparison trains one run at a time")
    # one config checked per row (building its optimizer), then one per seed: 20,000 seeds are not
    # 20,000 optimizers built
    from dataclasses import replace

    rows = [_run_config(args, v.method, args.seeds[0], v) for v in variants]
    configs = [replace(row, seed=seed) for row in rows for seed in args.seeds]
    from drmoo.experiments.robustness import check_distinct

    check_distinct(configs)  # a row and seed given twice, or two labels of the same settings
    _check_data(experiment, configs)
    if experiment.check_model is not None:  # the model settings each run would refuse, before --out is created
        for row in rows:
            experiment.check_model(row)
    _check_out_dir(args.out)
    table = experiment.compare(configs, Path(args.out), eps=args.eps, progress=not args.quiet, **options)
    print(table)
    return 0
