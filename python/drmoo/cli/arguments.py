"""What the options accept: the fixed choice sets, the value types and their bounds, the
one-line-error parser, and the rewriting of a command line before it is parsed.
"""

from __future__ import annotations

import argparse
import ast
from typing import Any, NoReturn

from drmoo._echo import echo, first_repeat, shortened
from drmoo.experiments.run_config import FLOAT32_MAX

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
    """A learning rate: a finite number > 0 that float32 holds."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {echo(text)}") from None
    if not (math.isfinite(value) and 0 < value <= FLOAT32_MAX):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0 and at most {FLOAT32_MAX:.4g} (the largest "
                                         f"float32), got {echo(text)}")
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



def _noise_list(text: str) -> list[float]:
    """``eval --noise``: pixel-noise standard deviations, each in (0, 1], none repeated."""
    values = _float_list(text)
    if not values or any(not 0 < value <= 1 for value in values):
        raise argparse.ArgumentTypeError(f"expected standard deviations in (0, 1], got {echo(text)}")
    return _distinct(values, text)



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
