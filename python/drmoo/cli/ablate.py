"""``drmoo ablate``: the paper's ablations (App. F)."""

from __future__ import annotations

import argparse

from .arguments import (
    ABLATION_EXPERIMENTS,
    ABLATIONS,
    BACKENDS,
    PRESETS,
    _count,
    _eps_list,
    _grid_list,
    _name_list,
    _Parser,
    _path,
    _seed_list,
)
from .run_options import _check_out_dir


def _add_ablate(sub: argparse._SubParsersAction[_Parser]) -> None:
    parser = sub.add_parser(
        "ablate", help="the paper's ablations (App. F): lambda, learning rate, batch size, inner steps",
        description="Vary one hyperparameter over the paper's grid and write ablation-<what>.csv/.md/.png/.json "
        "in --out (one sub-directory per grid value; finished values are skipped on a rerun). Supported: "
        "lambda on linear, wine and multimnist2 (Double-Clip; FGSM accuracy on multimnist2, balanced-gradient-norm "
        "curves otherwise); lr, batch and inner on linear and wine only (their measure is the balanced gradient "
        "norm; asking for them on multimnist2 is refused).",
    )
    parser.add_argument("--what", required=True, choices=ABLATIONS, help="the hyperparameter to vary")
    parser.add_argument("--experiment", required=True, choices=ABLATION_EXPERIMENTS,
                        help="the problem (multimnist2: lambda only)")
    parser.add_argument("--out", type=_path, required=True,
                        help="output directory (finished grid values in it are reused; one finished with other "
                        "settings is refused and kept)")
    parser.add_argument("--data-root", type=_path,
                        help="wine: the UCI CSV or its directory (required); multimnist2: torchvision "
                        "MNIST root (default: the embedded digits)")
    parser.add_argument("--seeds", type=_seed_list, default=[0], help="comma-separated seeds (default 0)")
    parser.add_argument("--grid", type=_grid_list, help="values to run instead of the paper's grid "
                        "(default: the paper's grid)")
    parser.add_argument("--steps", type=_count, help="linear/wine iterations (default: the paper's, 600 / 1000)")
    parser.add_argument("--batch-size", type=_count, help="batch size where it is not the ablated value "
                        "(default: the paper's)")
    parser.add_argument("--methods", type=_name_list,
                        help="lr only: methods, or 'all' for every method with synthetic settings, each given "
                        "only the fixed hyperparameters it has (default double-clip,double-loop,mgda,modo,moco,"
                        "sdmgrad)")
    parser.add_argument("--backend", choices=BACKENDS, help="kernel backend (default: automatic, by device)")
    parser.add_argument("--preset", default="quick", choices=PRESETS,
                        help="multimnist2: quick (CPU demo) | small | medium | paper (App. D) (default: %(default)s)")
    parser.add_argument("--max-steps", type=_count, help="multimnist2: stop each run after this many steps "
                        "(default: no limit)")
    for flag in ("--epochs", "--input-size", "--train-size", "--test-size"):
        parser.add_argument(flag, type=_count, help="multimnist2: override the preset's value (default: the preset's)")
    parser.add_argument("--weights", type=_path, help="multimnist2: imagenet | none | PATH (default: the preset's)")
    parser.add_argument("--cache-dir", type=_path, help="multimnist2: where generated data sets are cached "
                        "(default ~/.cache/drmoo)")
    parser.add_argument("--device", default="auto", help="multimnist2: auto | cpu | cuda | cuda:N "
                        "(default: %(default)s)")
    parser.add_argument("--eps", type=_eps_list, default=[0.0, 0.01, 0.03, 0.05, 0.08],
                        help="multimnist2: FGSM eps values (default: 0,0.01,0.03,0.05,0.08)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _run_ablate(args: argparse.Namespace) -> int:
    from drmoo.experiments.ablations import AblationConfig, check_ablation, run_ablation

    run_overrides = {key: getattr(args, key) for key in ("epochs", "input_size", "train_size", "test_size",
                                                         "weights") if getattr(args, key) is not None}
    config = AblationConfig(
        what=args.what, experiment=args.experiment, seeds=args.seeds, steps=args.steps, batch_size=args.batch_size,
        data_root=args.data_root, grid=args.grid, methods=args.methods, backend=args.backend, preset=args.preset,
        max_steps=args.max_steps, run_overrides=run_overrides, cache_dir=args.cache_dir, device=args.device,
        eps=args.eps,
    )
    # the whole request (settings, hyperparameter values, data, what the point directories hold) is checked
    # before anything is written
    check_ablation(config, args.out)
    _check_out_dir(args.out)
    print(run_ablation(config, args.out, progress=not args.quiet))
    print(f"wrote {args.out}/ablation-{args.what}.csv, .md, .png, .json")
    return 0
