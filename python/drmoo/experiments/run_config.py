"""What defines a training run: :class:`RunConfig` (saved as ``config.json``), its bounds and checks.

A config is validated as a whole (:meth:`RunConfig.validate`) before any command uses it, so a
refused setting is one line naming the option, and nothing has been written.  A resume may change
only :data:`RESUMABLE_FIELDS`; :func:`config_differences` names what else two configs disagree on.
``config.json`` is read through the run store (:mod:`drmoo.store`: bounded, strict JSON).  A key that
was renamed (:data:`RENAMED_KEYS`) is read under its former name too, so older run directories still
read, resume and compare (:func:`upgrade_config_dict`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from drmoo.store import UsageError, parse_json, read_bytes

# The largest float32 (torch.finfo(torch.float32).max, written out: the CLI's --help loads no torch).  A rate
# above it cannot be converted to the float32 the heads' SGD steps in: refused here, not mid-run.
FLOAT32_MAX = 3.4028234663852886e38

__all__ = ["AMP_MODES", "HOW_IT_RUNS", "MAX_COUNTS", "MAX_SEED", "RENAMED_KEYS", "RESUMABLE_FIELDS", "RunConfig",
           "config_differences", "read_run_config", "upgrade_config_dict"]

MAX_CONFIG_BYTES = 1 << 20  # a config.json is ~1 KB
# Upper bounds of every count (a value past them is a typo, and past 2**63 it would overflow torch).
MAX_COUNTS = {"epochs": 100_000, "batch_size": 1 << 20, "input_size": 4096, "train_size": 1 << 31,
              "test_size": 1 << 31, "max_steps": 1 << 40}
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
JACOBIANS = ("auto", "loop", "batched")  # drmoo.jacobian.STRATEGIES
COORDINATES = ("parameters", "features")  # hparams["jacobian"]: drmoo.optim._base.JACOBIANS
# The settings a resume may change: how far the run goes, and where it runs (a GPU run may be continued
# on a CPU; the continuation is then not bit-identical to one on the GPU).  Every other field defines the run.
# cuda_graph: how a step runs, not what; cache_dir: where the data cache lives (keyed and checked by content).
HOW_IT_RUNS = ("device", "cuda_graph", "cache_dir")  # what a finished run may have differed in and still be reused
RESUMABLE_FIELDS = ("epochs", "max_steps", *HOW_IT_RUNS)
MODELS = ("resnet18", "lenet")
EVAL_SPLITS = ("test", "validation")
MAX_LABEL = 200  # a run's label (a variant's text) names its directory: well below a file name's 255 bytes
AMP_MODES = ("none", "bf16", "fp16")  # the forward's autocast dtype (training.AMP_DTYPES maps them to torch's)
# Former names of config.json keys -> their names now.  "jacobian" was the strategy (loop | batched | auto),
# which read as the Jacobian's coordinates, hparams["jacobian"] (parameters | features), beside it.
RENAMED_KEYS = {"jacobian": "jacobian_strategy"}


@dataclass
class RunConfig:
    """Everything that defines a training run (saved as config.json)."""

    experiment: str
    method: str
    preset: str
    seed: int = 0
    epochs: int = 1
    batch_size: int = 256
    input_size: int = 128
    train_size: int | None = None
    test_size: int | None = None
    weights: str = "none"
    data_root: str | None = None
    cache_dir: str | None = None
    head_lr: float = 1e-2
    max_steps: int | None = None
    device: str = "cpu"
    backend: str | None = None
    jacobian_strategy: str = "loop"  # how the per-task gradients are computed (not hparams' jacobian, the coordinates)
    amp: str = "none"  # autocast the model's forward: none | bf16 | fp16
    hparams: dict[str, Any] = field(default_factory=dict)
    model: str = "resnet18"  # the experiment's network: resnet18 (the paper's) | lenet (Multi-MNIST's MultiLeNet)
    eval_split: str = "test"  # test | validation (held-out training digits, for choosing hyperparameters)
    cuda_graph: bool = False  # --cuda-graph: each training step replayed as one CUDA graph (drmoo.cuda_graph)
    label: str = ""  # the run's name in tables and its directory, e.g. "mgda[pref_lr=0]" ("": the method)

    @property
    def name(self) -> str:
        """What tables call this run: its label, or the method's registry name."""
        return self.label or self.method

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, source: str | Path = "config") -> RunConfig:
        """A config from JSON (strict, depth-bounded: :func:`drmoo.store.parse_json`), validated."""
        values = parse_json(text, source)
        if not isinstance(values, dict):
            raise UsageError(f"{source}: expected a JSON object")
        values = upgrade_config_dict(values, source)
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        missing = sorted(f.name for f in fields(cls) if f.name in ("experiment", "method", "preset")
                         and f.name not in values)
        if unknown or missing:
            raise UsageError(f"{source}: unknown setting(s) {', '.join(unknown)}" if unknown
                             else f"{source}: missing setting(s) {', '.join(missing)}")
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        """Refuse settings that cannot define a run (counts below 1 or past their bound, a non-finite rate, ...)."""
        for name in ("experiment", "method", "preset", "weights", "device", "jacobian_strategy", "amp"):
            if not isinstance(getattr(self, name), str):
                raise UsageError(f"{name} must be a string, got {getattr(self, name)!r}")
        for name in ("data_root", "cache_dir", "backend"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or value == ""):
                raise UsageError(f"--{name.replace('_', '-')} must be a non-empty string, got {value!r}")
        for name, bound in MAX_COUNTS.items():
            value = getattr(self, name)
            if value is None and name in ("train_size", "test_size", "max_steps"):
                continue  # None: all of the split / no step limit
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= 1 and <= {bound}, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise UsageError(f"--seed must be an integer >= 0 and <= {MAX_SEED}, got {self.seed!r}")
        if self.jacobian_strategy not in JACOBIANS:
            raise UsageError(f"unknown --jacobian-strategy {self.jacobian_strategy!r}; valid choices: "
                             f"{', '.join(JACOBIANS)}")
        if isinstance(self.head_lr, bool) or not isinstance(self.head_lr, (int, float)) or not (
                math.isfinite(self.head_lr) and 0 < self.head_lr <= FLOAT32_MAX):
            raise UsageError(f"--head-lr must be a finite number > 0 and at most {FLOAT32_MAX:.4g} (the largest "
                             f"float32: the heads' SGD steps in float32), got {self.head_lr!r}")
        if self.amp not in AMP_MODES:
            raise UsageError(f"unknown --amp {self.amp!r}; valid choices: {', '.join(AMP_MODES)}")
        if not isinstance(self.cuda_graph, bool):
            raise UsageError(f"cuda_graph must be true or false, got {self.cuda_graph!r}")
        if self.cuda_graph and not self.device.startswith("cuda"):
            raise UsageError(f"--cuda-graph needs a CUDA device, but the run's device is {self.device} (pass "
                             "--no-cuda-graph to train, or resume, without it)")
        if self.cuda_graph and self.amp == "fp16":
            raise UsageError("--cuda-graph cannot run --amp fp16: its loss scaling needs the eager step's raise on "
                             "an overflow (use --amp bf16 or none)")
        if not isinstance(self.hparams, dict):
            raise UsageError(f"hparams must be a mapping, got {type(self.hparams).__name__}")
        if self.model not in MODELS:
            raise UsageError(f"unknown --model {self.model!r}; valid choices: {', '.join(MODELS)}")
        if self.eval_split not in EVAL_SPLITS:
            raise UsageError(f"unknown --eval-split {self.eval_split!r}; valid choices: {', '.join(EVAL_SPLITS)}")
        if not isinstance(self.label, str) or any(c in self.label for c in "/\\\0\n"):
            raise UsageError(f"a run label is a name without path separators, got {self.label!r}")
        if len(self.label) > MAX_LABEL:
            raise UsageError(f"a run label is at most {MAX_LABEL} characters (it names the run's directory), got "
                             f"{len(self.label)}: {self.label[:60]!r}...")


def upgrade_config_dict(values: dict[str, Any], source: str | Path = "config") -> dict[str, Any]:
    """``values`` (a config.json's settings) with the keys of :data:`RENAMED_KEYS` under their names now.

    Raises:
        UsageError: a key is there under both its former name and its name now, or the top-level
            ``jacobian`` holds a coordinates mode (``features``), which belongs in ``hparams``.
    """
    renamed = {old: new for old, new in RENAMED_KEYS.items() if old in values}
    for old, new in renamed.items():
        if new in values:
            raise UsageError(f"{source}: {old} is the former name of {new}: give only {new}")
    if values.get("jacobian") in COORDINATES:  # a hand-written file meaning the method's mode
        raise UsageError(f"{source}: jacobian = {values['jacobian']!r} is the coordinates the task gradients are "
                         f"taken in, a hyperparameter: put it under hparams (jacobian_strategy, a setting, is one "
                         f"of {', '.join(JACOBIANS)})")
    return {renamed.get(key, key): value for key, value in values.items()}


def config_differences(saved: RunConfig | dict[str, Any], wanted: RunConfig | dict[str, Any],
                       ignore: Iterable[str] = RESUMABLE_FIELDS) -> list[str]:
    """``"field: saved -> wanted"`` for every setting (but ``ignore``'s) on which two runs differ (a setting
    saved under its former name, in an older run, compares under its name now)."""
    old = upgrade_config_dict(saved) if isinstance(saved, dict) else asdict(saved)
    new = upgrade_config_dict(wanted) if isinstance(wanted, dict) else asdict(wanted)
    skipped = set(ignore)
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(set(old) | set(new))
            if key not in skipped and old.get(key) != new.get(key)]


def check_run_dir(run_dir: str | Path) -> Path:
    """``run_dir`` as a path; an empty one (an unset shell variable) is refused rather than read as ``.``."""
    if str(run_dir) == "":
        raise UsageError("the run directory is an empty path (an unset shell variable?)")
    return Path(run_dir)


def read_run_config(run_dir: Path) -> RunConfig:
    """The config.json of a run directory; a clear error when it is missing or not a drmoo run config."""
    run_dir = check_run_dir(run_dir)
    path = run_dir / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory of drmoo train?")
    try:
        return RunConfig.from_json(read_bytes(path, MAX_CONFIG_BYTES, "run config"), path)
    except (ValueError, TypeError) as error:  # a UsageError already names the file
        message = str(error) if isinstance(error, UsageError) else f"{path}: {error}"
        raise UsageError(f"{message} (is {run_dir} a drmoo run directory?)") from None
