"""``drmoo eval``: a trained run evaluated (FGSM accuracy, or CelebA's clean metrics)."""

from __future__ import annotations

import argparse

from .arguments import ATTACKS, _eps_list, _noise_list, _Parser, _path
from .run_options import _add_eps_space, _eps_space_option


def _add_eval(sub: argparse._SubParsersAction[_Parser]) -> None:
    parser = sub.add_parser(
        "eval", help="evaluate a trained run: FGSM accuracy per task and eps (Multi-MNIST); accuracy, balanced "
        "accuracy and AUC per attribute (CelebA); tail loss, worst case, calibration and graded shift (all)",
        description="Load the weights saved in a run directory of drmoo train and evaluate them on the run's test "
        "split: Multi-MNIST under the FGSM attack at each --eps (per-task and mean accuracy), CelebA clean "
        "(accuracy, balanced accuracy and AUC per attribute); and for every experiment, per task and averaged, "
        "the robustness metrics (mean loss, CVaR, the f-divergence worst case, ECE, the loss on errors, the "
        "worst class), with a fitted temperature, under each FGSM eps, label shift and Gaussian pixel noise "
        "(docs/robustness-metrics.md). Prints the tables and writes eval.json in the run, which records the "
        "checkpoint it evaluated; a finished run evaluated before is evaluated again, eval.json replaced whole.",
    )
    parser.add_argument("--run", type=_path, required=True, metavar="RUN_DIR", help="the run directory of drmoo train")
    parser.add_argument("--attack", default="fgsm", choices=ATTACKS, help="the paper's attack (default: %(default)s)")
    parser.add_argument("--eps", type=_eps_list, default=[0.0, 0.01, 0.03, 0.05, 0.08],
                        help="FGSM budgets, comma-separated (Multi-MNIST; CelebA is evaluated clean; "
                        "default: 0,0.01,0.03,0.05,0.08)")
    _add_eps_space(parser)
    parser.add_argument("--noise", type=_noise_list, metavar="SIGMAS",
                        help="standard deviations of the Gaussian pixel noise (covariate shift), comma-separated, "
                        "each in (0, 1] on the [0, 1] image (default: 0.1,0.2,0.3)")
    parser.add_argument("--device", help="override the run's device (default: the run's)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")



def _run_eval(args: argparse.Namespace) -> int:
    import inspect
    from pathlib import Path

    from drmoo.experiments.registry import get_experiment
    from drmoo.experiments.run_config import read_run_config
    from drmoo.store import ResultNotSaved, UsageError

    if args.attack != "fgsm":
        raise ValueError(f"unknown attack {args.attack!r}; valid choices: fgsm")

    experiment = get_experiment(read_run_config(Path(args.run)).experiment)
    eps_given = any(item == "--eps" or item.startswith("--eps=") for item in args.argv)
    if eps_given and "eps_space" not in inspect.signature(experiment.evaluate).parameters:
        raise UsageError(f"--eps: the {experiment.name} evaluation is clean (no FGSM attack); leave --eps out")
    try:
        noise = {} if args.noise is None else {"noise_sigmas": args.noise}
        report = experiment.evaluate(Path(args.run), eps=args.eps, progress=not args.quiet, device=args.device,
                                     **_eps_space_option(args, experiment.evaluate, experiment.name), **noise)
    except ResultNotSaved as error:  # computed: show it, then say (one line, status 2) that it was not saved
        print(experiment.eval_table(error.result))
        raise
    print(experiment.eval_table(report))
    print(f"wrote {Path(args.run) / 'eval.json'}")
    return 0
