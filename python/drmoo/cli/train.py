"""``drmoo train``: one run, checkpointed and resumable, on one or more processes."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from .arguments import _count, _non_negative, _Parser, _path
from .run_options import _add_run_options, _check_data, _run_config


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


# The signals the launcher passes on to torchrun, which passes them on to its workers: SIGTERM and SIGINT
# make each worker save its checkpoint and stop (130 / 143); SIGHUP and SIGQUIT (a closed terminal, Ctrl-\)
# end them as they would end a single-process run.  torchrun runs in its own session (below), so it gets
# these only from the launcher.
FORWARDED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
                          if hasattr(signal, name))


def _launch_torchrun(nproc: int, argv: list[str]) -> int:
    """Re-run this very command under torchrun with ``nproc`` processes (minus --nproc).

    A SIGTERM or SIGINT to the launcher stops the run as it stops a single-process one: it is passed on to
    torchrun, the launcher waits until torchrun and its workers have saved and exited (the run directory's
    lock is free again, --resume works at once), then exits with 128 + the signal (143 / 130).
    """
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

    received: list[int] = []  # the signals the launcher got
    sent: list[int] = []  # the one passed on
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        # Only the first signal, as a single-process run heeds only the first: torchrun answers it by
        # signalling its workers and waiting for them (SIGKILL after its shutdown timeout); signalled again
        # (torch 2.x: a third time) it gives up that wait and exits while the workers are still saving,
        # leaving them running without it.
        if child is not None and not sent:
            sent.append(signum)
            _send(child, signum)

    previous: dict[int, Any] = {}
    for signum in FORWARDED_SIGNALS:
        try:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # ignored (nohup's SIGHUP) stays ignored
                previous[signum] = signal.signal(signum, forward)
        except ValueError:  # not the main thread: signals cannot be handled here
            break
    try:
        # torchrun starts in its own session (so its own process group, as it starts each worker): a signal
        # to the launcher's process group (Ctrl-C in a terminal, timeout -s TERM, kill -TERM -PGID) then
        # reaches torchrun once, through the launcher, exactly as a signal to the launcher's pid alone does.
        # In the launcher's group, torchrun would get each signal twice (from the terminal and from the
        # launcher), and a second Ctrl-C would then abort its shutdown of the workers, as above.
        child = subprocess.Popen(command, env=os.environ.copy(), start_new_session=True,
                                 preexec_fn=_stop_with_parent if sys.platform.startswith("linux") else None)
        if received and not sent:  # a signal that came before torchrun started
            sent.append(received[0])
            _send(child, received[0])
        status = child.wait()
    finally:
        if child is not None and child.poll() is None:  # an exception in the launcher itself: no orphans
            _send(child, signal.SIGTERM)
            child.wait()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if not received or status == 0:  # no signal, or the run finished before the signal stopped it
        return status
    name = signal.Signals(received[0]).name
    print(f"drmoo train: stopped by {name}; torchrun and its {nproc} processes have exited", file=sys.stderr)
    return 128 + received[0]


def _stop_with_parent() -> None:
    """In torchrun's process, before it starts (Linux): a SIGTERM when the launcher dies, even by SIGKILL
    (``timeout -k``, a scheduler's last resort), so that its workers save and stop instead of training on
    with no launcher, torchrun being in a session of its own (``prctl(PR_SET_PDEATHSIG)``)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl here: the launcher's own signal handling still applies
        pass


def _send(child: Any, signum: int) -> None:
    try:
        child.send_signal(signum)
    except ProcessLookupError:  # it has just exited
        pass


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
_RESUME_MAY_CHANGE = {"epochs", "max_steps", "quiet", "resume", "nproc", "device", "cuda_graph", "log_dir",
                      "cache_dir"}


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
                         "contradict it; only --epochs/--max-steps may change, and --device, --cuda-graph, "
                         "--cache-dir, --log-dir and --nproc, which do not change what it computes (start a new "
                         "--out for other settings)")
