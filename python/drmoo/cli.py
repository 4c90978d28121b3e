"""The ``drmoo`` command line: one sub-command per experiment."""

from __future__ import annotations

import argparse
import ast
import json
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


def _float_list(text: str) -> list[float]:
    try:
        return [float(item) for item in _comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``train`` and ``compare`` (None = take the preset's value)."""
    parser.add_argument("--experiment", default="multimnist2", help="multimnist2 | multimnist3 | celeba")
    parser.add_argument("--preset", default="quick", help="quick (CPU demo) | medium (Multi-MNIST: 8 methods in "
                        "~10 GPU minutes) | paper (App. D settings)")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--input-size", type=int, help="image side in pixels (paper: 128 for 2 digits, 96 for 3)")
    parser.add_argument("--train-size", type=int, help="number of training composites (default: all / preset)")
    parser.add_argument("--test-size", type=int, help="number of test composites (default: all / preset)")
    parser.add_argument("--lr", type=float, help="the method's parameter learning rate")
    parser.add_argument("--hp", type=_override, action="append", default=[], metavar="KEY=VALUE",
                        help="override a method hyperparameter, e.g. --hp lam=0.8 (repeatable)")
    parser.add_argument("--head-lr", type=float, default=1e-2, help="SGD learning rate of the task heads (1e-2)")
    parser.add_argument("--weights", help="imagenet | none | PATH to a ResNet18 state dict (never downloaded)")
    parser.add_argument("--data-root", help="torchvision MNIST root (raw idx files); default: the embedded digits. "
                        "celeba: the folder with img_align_celeba/ and the list_*.txt files (or its celeba/)")
    parser.add_argument("--cache-dir", help="where generated data sets are cached (default ~/.cache/drmoo); "
                        "celeba: decoded images are cached only when this is given (~10 GB at 128 px)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--backend", help="kernel backend: reference | cpp | cuda | triton (default: automatic)")
    parser.add_argument("--jacobian", default="loop", help="per-task gradients: loop (m backward passes) | batched")
    parser.add_argument("--amp", default="none", help="autocast the model's forward: none | bf16 | fp16")
    parser.add_argument("--max-steps", type=int, help="stop after this many optimizer steps in total")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _run_config(args: argparse.Namespace, method: str, seed: int) -> Any:
    import torch

    from drmoo.experiments.registry import get_experiment
    from drmoo.experiments.training import RunConfig

    experiment = get_experiment(args.experiment)
    if args.preset not in experiment.presets:
        raise ValueError(f"unknown preset {args.preset!r}; valid choices: {', '.join(experiment.presets)}")
    preset = dict(experiment.presets[args.preset])
    for key in ("epochs", "batch_size", "input_size", "train_size", "test_size", "weights"):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    overrides = dict(args.hp)
    if args.lr is not None:
        overrides["lr"] = args.lr
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return RunConfig(
        experiment=args.experiment, method=method, preset=args.preset, seed=seed, head_lr=args.head_lr,
        data_root=args.data_root, cache_dir=args.cache_dir, max_steps=args.max_steps, device=device,
        backend=args.backend, jacobian=args.jacobian, amp=args.amp,
        hparams=experiment.method_hparams(method, overrides),
        **preset,
    )


def _add_train(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("train", help="train one method on a Multi-MNIST or CelebA experiment (checkpointed, "
                            "resumable)")
    _add_run_options(parser)
    parser.add_argument("--method", default="double-clip", help="a registered method (see drmoo.optim.available())")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="run directory (default runs/<experiment>-<method>-seed<seed>)")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run saved in RUN_DIR exactly where it stopped")
    parser.add_argument("--nproc", type=int, help="data-parallel processes: relaunches itself under torchrun "
                        "(gloo on CPU, nccl on GPUs); the batch size is the global one")
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


def _run_train(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    if args.nproc is not None:
        if args.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
        if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
            return _launch_torchrun(args.nproc, args.argv)

    from drmoo.experiments.registry import get_experiment
    from drmoo.experiments.training import RunConfig, train

    if args.resume:
        run_dir = Path(args.resume)
        config_path = run_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"cannot resume: {config_path} does not exist")
        config = RunConfig.from_json(config_path.read_text())
        if args.max_steps is not None:  # the only settings a resume may change: how far to go
            config.max_steps = args.max_steps
        if args.epochs is not None:
            config.epochs = args.epochs
    else:
        config = _run_config(args, args.method, args.seed)
        run_dir = Path(args.out or f"runs/{config.experiment}-{config.method}-seed{config.seed}")
    experiment = get_experiment(config.experiment)
    summary = train(config, run_dir, experiment.build, resume=bool(args.resume), progress=not args.quiet,
                    sample_weight=experiment.sample_weight)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, one report
        print(json.dumps(summary, indent=2))
        print(f"run saved in {run_dir}")
    return 0


def _add_eval(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("eval", help="evaluate a trained run: FGSM accuracy per task and eps (Multi-MNIST); "
                            "accuracy, balanced accuracy and AUC per attribute (CelebA)")
    parser.add_argument("--run", required=True, metavar="RUN_DIR")
    parser.add_argument("--attack", default="fgsm", help="fgsm (the paper's attack)")
    parser.add_argument("--eps", type=_float_list, default=[0.0, 0.01, 0.03, 0.05, 0.08],
                        help="FGSM budgets (Multi-MNIST; CelebA is evaluated clean)")
    _add_eps_space(parser)
    parser.add_argument("--device", help="override the run's device")
    parser.add_argument("--quiet", action="store_true")
    parser.set_defaults(handler=_run_eval)


def _run_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from drmoo.experiments.registry import get_experiment

    if args.attack != "fgsm":
        raise ValueError(f"unknown attack {args.attack!r}; valid choices: fgsm")
    config_path = Path(args.run) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} does not exist: is {args.run} a run directory of drmoo train?")
    experiment = get_experiment(json.loads(config_path.read_text())["experiment"])
    report = experiment.evaluate(Path(args.run), eps=args.eps, progress=not args.quiet, device=args.device,
                                 **_eps_space_option(args, experiment.evaluate, experiment.name))
    print(experiment.eval_table(report))
    print(f"wrote {Path(args.run) / 'eval.json'}")
    return 0


def _add_eps_space(parser: argparse.ArgumentParser) -> None:
    from drmoo.attacks import EPS_SPACES

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


def _add_compare(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("compare", help="train + evaluate every method x seed; the paper's Table 1 "
                            "(Multi-MNIST, FGSM) or Table 2 (CelebA)")
    _add_run_options(parser)
    parser.add_argument("--methods", type=_comma_list, default=["all"], help="all or a comma-separated list")
    parser.add_argument("--seeds", type=_int_list, default=[0])
    parser.add_argument("--eps", type=_float_list, default=[0.0, 0.01, 0.03, 0.05, 0.08])
    _add_eps_space(parser)
    parser.add_argument("--out", required=True, help="output directory (finished runs in it are reused)")
    parser.set_defaults(handler=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from drmoo.experiments.registry import get_experiment
    from drmoo.optim import available

    methods = list(available()) if args.methods == ["all"] else args.methods
    unknown = [m for m in methods if m not in available()]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; valid choices: {', '.join(available())}")
    configs = [_run_config(args, method, seed) for method in methods for seed in args.seeds]
    experiment = get_experiment(args.experiment)
    table = experiment.compare(configs, Path(args.out), eps=args.eps, progress=not args.quiet,
                               **_eps_space_option(args, experiment.compare, experiment.name))
    print(table)
    return 0


def _add_bench_iter(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench-iter", help="seconds per iteration of every method vs the 1 fwd + m bwd floor")
    parser.add_argument("--experiment", default="multimnist2", help="multimnist2 | multimnist3")
    parser.add_argument("--methods", type=_comma_list, default=["all"])
    parser.add_argument("--batch-size", type=int, default=256, help="paper: 256 (use less on a CPU)")
    parser.add_argument("--input-size", type=int, help="default: the paper's (128 for 2 digits, 96 for 3)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--backend", help="kernel backend (default: automatic)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--quiet", action="store_true")
    parser.set_defaults(handler=_run_bench_iter)


def _run_bench_iter(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from drmoo.experiments.multimnist import EXPERIMENTS, PRESETS
    from drmoo.experiments.wallclock import machine_name, measure_iterations, write_outputs
    from drmoo.optim import available

    if args.experiment not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {args.experiment!r}; valid choices: {', '.join(EXPERIMENTS)}")
    methods = list(available()) if args.methods == ["all"] else args.methods
    unknown = [m for m in methods if m not in available()]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; valid choices: {', '.join(available())}")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    size = args.input_size or PRESETS["paper"][args.experiment]["input_size"]
    rows = measure_iterations(args.experiment, methods, args.batch_size, size, device, warmup=args.warmup,
                              repeats=args.repeats, backend=args.backend, progress=not args.quiet)
    title = (f"{args.experiment}, ResNet18, batch {args.batch_size}, {size}px, {machine_name(device)}; "
             f"median of {args.repeats} iterations")
    write_outputs(rows, Path(args.out), title)
    print((Path(args.out) / "wallclock.md").read_text())
    return 0


def _add_ablate(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "ablate", help="the paper's ablations (App. F): lambda, learning rate, batch size, inner steps",
        description="Vary one hyperparameter over the paper's grid and write ablation-<what>.csv/.md/.png/.json "
        "in --out (one sub-directory per grid value; finished values are skipped on a rerun). Supported: "
        "lambda on linear, wine and multimnist2 (Double-Clip; FGSM accuracy on multimnist2, balanced-gradient-norm "
        "curves otherwise); lr, batch and inner on linear and wine only (their measure is the balanced gradient "
        "norm; asking for them on multimnist2 is refused).",
    )
    parser.add_argument("--what", required=True, help="lambda | lr | batch | inner")
    parser.add_argument("--experiment", required=True, help="linear | wine | multimnist2 (lambda only)")
    parser.add_argument("--out", required=True, help="output directory (finished grid values in it are reused)")
    parser.add_argument("--data-root", help="wine: the UCI CSV or its directory; multimnist2: torchvision MNIST root")
    parser.add_argument("--seeds", type=_int_list, default=[0], help="comma-separated seeds (default 0)")
    parser.add_argument("--grid", type=_float_list, help="values to run instead of the paper's grid")
    parser.add_argument("--steps", type=int, help="linear/wine iterations (default: the paper's, 600 / 1000)")
    parser.add_argument("--batch-size", type=int, help="batch size where it is not the ablated value")
    parser.add_argument("--methods", type=_comma_list,
                        help="lr only: methods (default double-clip,double-loop,mgda,modo,moco,sdmgrad)")
    parser.add_argument("--backend", help="kernel backend: reference | cpp | cuda | triton (default: automatic)")
    parser.add_argument("--preset", default="quick", help="multimnist2: quick (CPU demo) | paper (App. D)")
    parser.add_argument("--max-steps", type=int, help="multimnist2: stop each run after this many steps")
    for flag in ("--epochs", "--input-size", "--train-size", "--test-size"):
        parser.add_argument(flag, type=int, help="multimnist2: override the preset's value")
    parser.add_argument("--weights", help="multimnist2: imagenet | none | PATH (default: the preset's)")
    parser.add_argument("--cache-dir", help="multimnist2: where generated data sets are cached")
    parser.add_argument("--device", default="auto", help="multimnist2: auto | cpu | cuda | cuda:N")
    parser.add_argument("--eps", type=_float_list, default=[0.0, 0.01, 0.03, 0.05, 0.08],
                        help="multimnist2: FGSM eps values")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(handler=_run_ablate)


def _run_ablate(args: argparse.Namespace) -> int:
    from drmoo.experiments.ablations import AblationConfig, run_ablation

    run_overrides = {key: getattr(args, key) for key in ("epochs", "input_size", "train_size", "test_size",
                                                         "weights") if getattr(args, key) is not None}
    config = AblationConfig(
        what=args.what, experiment=args.experiment, seeds=args.seeds, steps=args.steps, batch_size=args.batch_size,
        data_root=args.data_root, grid=args.grid, methods=args.methods, backend=args.backend, preset=args.preset,
        max_steps=args.max_steps, run_overrides=run_overrides, cache_dir=args.cache_dir, device=args.device,
        eps=args.eps,
    )
    print(run_ablation(config, args.out, progress=not args.quiet))
    print(f"wrote {args.out}/ablation-{args.what}.csv, .md, .png, .json")
    return 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "report", help="collect the tables and figures of result directories into one markdown file",
        description="Walk the given directories, recognise synthetic comparisons, robustness comparisons, "
        "ablations, wall-clock and kernel-benchmark results and single training runs, and write one markdown "
        "file that embeds their tables and links their PNGs (paths relative to the report), with the machine, "
        "backend and settings each records. Directories holding none of these are listed as skipped.",
    )
    parser.add_argument("--runs", nargs="+", required=True, metavar="DIR", help="result directories to collect")
    parser.add_argument("--out", required=True, help="the markdown file to write, e.g. report.md")
    parser.add_argument("--title", default="drmoo results", help="the report's title")
    parser.set_defaults(handler=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from drmoo.experiments.report import write_report

    sections, skipped = write_report(args.runs, args.out, title=args.title)
    print(f"wrote {args.out}: {sections} section(s), {skipped} skipped")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drmoo", description="Distributionally robust multi-objective optimization: experiments and tools."
    )
    from drmoo import __version__

    parser.add_argument("--version", action="version", version=f"drmoo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_synthetic(sub)
    _add_train(sub)
    _add_eval(sub)
    _add_compare(sub)
    _add_bench_iter(sub)
    _add_ablate(sub)
    _add_report(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from drmoo.experiments.training import TrainingInterrupted

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return int(args.handler(args))
    except (ValueError, FileNotFoundError, FileExistsError, FloatingPointError) as error:
        # User-facing problems (bad names, missing files, divergence) get one clear line, not a traceback.
        print(f"drmoo {args.command}: error: {error}", file=sys.stderr)
        return 2
    except TrainingInterrupted as error:
        print(f"drmoo {args.command}: {error}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"drmoo {args.command}: interrupted; finished runs are kept in the output directory", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
