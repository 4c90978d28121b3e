"""The run settings ``train`` and ``compare`` share (their options, the run config they build and
check, ``--config FILE``), and the checks other commands share (data, output directory,
``--eps-space``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from .arguments import (
    AMP_MODES,
    BACKENDS,
    EPS_SPACES,
    EXPERIMENTS,
    JACOBIAN_STRATEGIES,
    PRESETS,
    _count,
    _hp_overrides,
    _override,
    _path,
    _positive_float,
)


def _check_data(experiment: Any, configs: Sequence[Any]) -> None:
    """Each distinct data root of ``configs`` checked once by its experiment (a missing folder: one line)."""
    if experiment.check_data is None:
        return
    checked: set[Any] = set()
    for config in configs:
        if config.data_root not in checked:
            checked.add(config.data_root)
            experiment.check_data(config)


def _check_out_dir(path: str) -> None:
    """Create an output directory or refuse with one line (a file in the way, no permission)."""
    from pathlib import Path

    from drmoo.store import make_directory

    make_directory(Path(path), "--out directory")


def _check_hparams(method: str, hparams: dict[str, Any]) -> None:
    """Refuse hyperparameters that ``method``'s optimizer does not take (a typo would otherwise crash later)."""
    from drmoo.optim import available
    from drmoo.optim._method_arguments import accepted_hyperparameters
    from drmoo.store import UsageError

    if method not in available():
        raise UsageError(f"unknown method {method!r}; valid choices: {', '.join(available())}")
    names = accepted_hyperparameters(method)
    if names is None:
        return
    accepted = sorted(names - {"backend", "jacobian_strategy"})
    if "backend" in hparams:
        raise UsageError("the kernel backend is not a hyperparameter: use --backend instead of --hp backend=...")
    if "jacobian_strategy" in hparams:  # one place to set it: the run's config records --jacobian-strategy
        raise UsageError("the Jacobian strategy is not a hyperparameter: use --jacobian-strategy instead of "
                         "--hp jacobian_strategy=...")
    unknown = sorted(set(hparams) - set(accepted))
    if unknown:
        raise UsageError(f"unknown hyperparameter(s) {', '.join(unknown)} for {method}; valid: {', '.join(accepted)}")


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``train`` and ``compare`` (None = take the preset's value)."""
    parser.add_argument("--experiment", default="multimnist2", choices=EXPERIMENTS,
                        help="the experiment (default: %(default)s)")
    parser.add_argument("--preset", default="quick", choices=PRESETS, help="quick (CPU demo) | small (Multi-MNIST: "
                        "MultiLeNet) | medium (Multi-MNIST: 8 methods in ~10 GPU minutes) | paper (App. D settings) "
                        "(default: %(default)s)")
    parser.add_argument("--epochs", type=_count, help="training epochs (default: the preset's)")
    parser.add_argument("--batch-size", type=_count, help="batch size (default: the preset's)")
    parser.add_argument("--input-size", type=_count, help="image side in pixels (paper: 128 for 2 digits, 96 for 3; "
                        "default: the preset's)")
    parser.add_argument("--train-size", type=_count, help="number of training composites (default: all / preset)")
    parser.add_argument("--test-size", type=_count, help="number of test composites (default: all / preset)")
    parser.add_argument("--lr", type=_positive_float, help="the method's parameter learning rate (default: the "
                        "paper's for the method)")
    parser.add_argument("--hp", type=_override, action="append", default=[], metavar="KEY=VALUE",
                        help="override a method hyperparameter, e.g. --hp lam=0.8 (repeatable; default: the paper's)")
    parser.add_argument("--head-lr", type=_positive_float,
                        help="SGD learning rate of the task heads (default: the preset's; 1e-2 as in the paper)")
    parser.add_argument("--model", choices=("resnet18", "lenet"),
                        help="the network (default: the preset's; small: lenet, the others: resnet18)")
    parser.add_argument("--eval-split", choices=("test", "validation"), default="test",
                        help="evaluate on the test digits (default) or on held-out training digits "
                        "(validation: for choosing hyperparameters without the test set)")
    parser.add_argument("--weights", type=_path, help="imagenet | none | PATH to a ResNet18 state dict (never "
                        "downloaded; "
                        "default: the preset's)")
    parser.add_argument("--data-root", type=_path,
                        help="torchvision MNIST root (raw idx files); default: the embedded digits. "
                        "celeba: the folder with img_align_celeba/ and the list_*.txt files (or its celeba/)")
    parser.add_argument("--cache-dir", type=_path,
                        help="where generated data sets are cached (default ~/.cache/drmoo); "
                        "celeba: decoded images are cached only when this is given (~10 GB at 128 px)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: %(default)s)")
    parser.add_argument("--backend", choices=BACKENDS, help="kernel backend (default: automatic, by device)")
    # --jacobian-strategy: how the per-task gradients are computed; not the Jacobian's coordinates, which a
    # method variant sets (--hp jacobian=features).  Its former name --jacobian is refused by main with both.
    parser.add_argument("--jacobian-strategy", default="loop", choices=JACOBIAN_STRATEGIES,
                        help="how the per-task gradients are computed: loop (m backward passes) | batched (one "
                        "vmapped pass) | auto (batched on a GPU, loop on the CPU; in features mode separate heads "
                        "in one pass, else batched on a GPU or above 4 tasks) (default: %(default)s; not --hp "
                        "jacobian=features, the coordinates)")
    parser.add_argument("--amp", default="none", choices=AMP_MODES,
                        help="autocast the model's forward (default: %(default)s)")
    parser.add_argument("--max-steps", type=_count, help="stop after this many optimizer steps in total "
                        "(default: no limit)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _run_config(args: argparse.Namespace, method: str, seed: int, variant: Any = None) -> Any:
    from drmoo.experiments.devices import resolve_device
    from drmoo.experiments.registry import get_experiment
    from drmoo.experiments.run_config import RunConfig
    from drmoo.experiments.variants import MethodVariant
    from drmoo.store import UsageError

    experiment = get_experiment(args.experiment)
    if args.preset not in experiment.presets:
        raise ValueError(f"unknown preset {args.preset!r}; valid choices: {', '.join(experiment.presets)}")
    preset = dict(experiment.presets[args.preset])
    for key in ("epochs", "batch_size", "input_size", "train_size", "test_size", "weights", "head_lr", "model"):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    if args.max_steps is not None:
        preset["max_steps"] = args.max_steps
    if variant is None:
        variant = MethodVariant(method)
    overrides = _hp_overrides(args.hp)
    if args.lr is not None:
        if "lr" in overrides:
            raise UsageError(f"--lr {args.lr} and --hp lr={overrides['lr']} both set the learning rate: give one")
        overrides["lr"] = args.lr
    overrides.update(variant.hparams)  # a variant's own settings (compare --methods NAME[KEY=VALUE])
    preset.update(variant.run)
    _check_hparams(method, overrides)
    config = RunConfig(
        experiment=args.experiment, method=method, preset=args.preset, seed=seed,
        data_root=args.data_root, cache_dir=args.cache_dir,
        device=str(resolve_device(args.device)), backend=args.backend, jacobian_strategy=args.jacobian_strategy,
        amp=args.amp,
        hparams=experiment.method_hparams(method, overrides, preset=args.preset), eval_split=args.eval_split,
        label=variant.label, **preset,
    )
    config.validate()
    _check_hparam_values(config)
    return config


def _check_hparam_values(config: Any) -> None:
    """Build the method's optimizer on a stand-in parameter: a bad value (NaN lr, negative lam, unknown
    divergence, unusable backend) is refused now, before any directory is written or process launched."""
    import torch

    from drmoo.experiments.devices import check_backend
    from drmoo.optim._method_arguments import check_hyperparameter_values
    from drmoo.store import UsageError

    check_backend(config.backend, torch.device(config.device))
    try:
        check_hyperparameter_values(config.method, config.hparams, 2)
    except ValueError as error:
        raise UsageError(str(error)) from None



def _with_config_file(argv: list[str], args: argparse.Namespace) -> tuple[list[str], str | None]:
    """``argv`` with the settings of ``--config FILE`` inserted as options right after the command (``train``
    or ``compare``), before the typed ones (which thereby override them), and the file's run label."""
    from drmoo.experiments.config_file import options_from_config_file
    from drmoo.store import UsageError

    if getattr(args, "resume", None):  # (train's)
        raise UsageError("--config starts a run from a file's settings and --resume continues a saved run as it "
                         "was: give one")
    position = argv.index(args.command) + 1
    options, label = options_from_config_file(args.config, argv[position:], args.command)
    return [*argv[:position], *options, *argv[position:]], label



def _add_eps_space(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--eps-space", choices=EPS_SPACES,
                        help="FGSM: pixel (default; eps on the [0, 1] image) | normalized (eps after ImageNet "
                        "normalisation: the pixel step is eps * std per channel, ~4.4x smaller); see drmoo.attacks")


def _eps_space_option(args: argparse.Namespace, command: Any, experiment: str) -> dict[str, str]:
    """{'eps_space': ...} when --eps-space was given; refused for an experiment without FGSM (CelebA)."""
    import inspect

    if args.eps_space is None:
        return {}
    if "eps_space" not in inspect.signature(command).parameters:
        raise ValueError(f"--eps-space applies to the FGSM experiments; {experiment} is not attacked")
    return {"eps_space": args.eps_space}
