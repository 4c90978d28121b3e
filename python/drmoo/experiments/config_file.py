"""``drmoo train --config FILE`` and ``drmoo compare --config FILE``: settings from a TOML or JSON file.

``train``'s file has the keys of a run's ``config.json``.  ``compare``'s has the same keys but those
that name one run (``method``, ``seed``, ``label``; and ``cuda_graph``, which compare does not take),
plus compare's own (:data:`COMPARE_KEYS`): ``methods`` and ``seeds`` (lists or comma-separated text),
``eps``, ``reference``, ``jobs``, ``eps_space``.

A run's own ``config.json`` replays it: ``drmoo train --config runs/x/config.json --out runs/y`` trains
the same run again.  The file's settings become command-line options placed *before* the ones typed,
so that an option on the command line overrides the file (argparse keeps an option's last value) and
every value goes through the same parsing and checks as when it is typed.  ``hparams`` become
``--hp KEY=VALUE`` options, except those the command line sets itself (``--hp KEY=...``, or ``--lr``
for ``lr``).  A key that is not a setting of the command is refused, naming the keys it takes.
Imports no torch (the CLI reads the file before anything else).
"""

from __future__ import annotations

import sys
from dataclasses import fields
from itertools import pairwise
from pathlib import Path
from typing import Any

from drmoo.experiments.run_config import MAX_CONFIG_BYTES, RunConfig, upgrade_config_dict
from drmoo.store import MAX_JSON_DEPTH, UsageError, nesting_depth, parse_json, read_bytes

__all__ = ["options_from_config_file"]

# Keys of config.json that are no command-line option of ``train``: set on the built config instead.
NOT_OPTIONS = ("hparams", "label")
# Keys of config.json that are on/off options (``--KEY`` / ``--no-KEY``).
FLAGS = ("cuda_graph",)
# compare's own options, and those of them given as lists (a TOML/JSON array or comma-separated text).
COMPARE_KEYS = ("methods", "seeds", "eps", "reference", "jobs", "eps_space")
LIST_KEYS = ("methods", "seeds", "eps")
# Run settings that compare does not take, and what it takes instead.
NOT_COMPARE = {"method": "methods (a list of the rows)", "seed": "seeds (a list)",
               "label": "methods (a row NAME[KEY=VALUE] is labelled by its text)",
               "cuda_graph": "drmoo train --cuda-graph (compare runs each step eagerly)"}
COMMANDS = ("train", "compare")


def _load(path: Path) -> dict[str, Any]:
    data = read_bytes(path, MAX_CONFIG_BYTES, "--config file")
    if path.suffix == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            try:
                import tomli as tomllib  # type: ignore[import-not-found]  # Python 3.10 only
            except ModuleNotFoundError:
                raise UsageError(f"--config {path}: reading TOML on Python 3.10 needs the tomli package, which "
                                 "pip install 'drmoo[experiments]' brings; or give the settings as JSON") from None
        try:
            values = tomllib.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
            raise UsageError(f"--config {path}: not valid TOML: {error}") from None
        except RecursionError:  # tomllib recurses once per level of nested arrays and inline tables
            values = None
        if values is None or nesting_depth(values) > MAX_JSON_DEPTH:  # bounded as JSON is
            raise UsageError(f"--config {path}: refused: TOML nested deeper than {MAX_JSON_DEPTH} levels (a run's "
                             "settings are a table and its hparams)")
    elif path.suffix == ".json":
        values = parse_json(data, path, unique_keys=True)  # a key twice: refused, as TOML refuses it
    else:
        raise UsageError(f"--config {path}: expected a .toml or .json file (the keys of a run's config.json)")
    if not isinstance(values, dict):
        raise UsageError(f"--config {path}: expected a table of settings (the keys of a run's config.json)")
    return upgrade_config_dict(values, f"--config {path}")  # an older run's config.json replays too


def _option_value(key: str, value: Any, path: Path) -> str:
    if key in LIST_KEYS and isinstance(value, list):  # compare's lists: what --methods / --seeds / --eps take
        if not value or any(isinstance(item, (dict, list, bool)) or item is None for item in value):
            raise UsageError(f"--config {path}: {key} = {value!r} is not a list of {key}")
        return ",".join(str(item) for item in value)
    if isinstance(value, (dict, list, bool)):  # no run setting is a table, a list or a flag
        raise UsageError(f"--config {path}: {key} = {value!r} is not a setting's value")
    return str(value)


def _check_keys(values: dict[str, Any], path: Path, command: str) -> None:
    """Refuse a key that is not a setting of ``command`` (train: a run's config.json; compare: see above)."""
    run_keys = {field.name for field in fields(RunConfig)}
    if command == "train":
        known, where = run_keys, "the keys of a run's config.json"
    else:
        misplaced = sorted(set(values) & set(NOT_COMPARE))
        if misplaced:
            raise UsageError(f"--config {path}: {misplaced[0]} is a setting of one run, not of drmoo compare: use "
                             f"{NOT_COMPARE[misplaced[0]]}")
        known = (run_keys - set(NOT_COMPARE)) | set(COMPARE_KEYS)
        where = "the keys of a run's config.json but method, seed, label and cuda_graph, and compare's own"
    unknown = sorted(set(values) - known)
    if unknown:
        raise UsageError(f"--config {path}: unknown setting(s) {', '.join(unknown)}; the settings of drmoo {command} "
                         f"are {where}: {', '.join(sorted(known))}")


def _typed_method(typed: list[str]) -> str | None:
    """The --method given on the command line (the last one), or None."""
    method = None
    for flag, item in pairwise(typed):
        if flag == "--method":
            method = item
    for item in typed:
        if item.startswith("--method="):
            method = item[len("--method="):]
    return method


def _refuse_other_methods_hparams(path: Path, saved: Any, typed: str | None, passed: set[str]) -> None:
    """A file's hyperparameters are its method's: with another --method, refuse the ones that method lacks,
    naming the file (the refusal would otherwise name keys the user never typed)."""
    if typed is None or typed == saved or not passed:
        return
    from drmoo.optim import available
    from drmoo.optim._method_arguments import accepted_hyperparameters

    if typed not in available():
        return  # the command refuses the unknown method itself
    accepted = accepted_hyperparameters(typed)
    if accepted is None:
        return
    foreign = sorted(passed - accepted)
    if foreign:
        raise UsageError(f"--config {path} holds the hyperparameters of a {saved} run, and {', '.join(foreign)} "
                         f"{'is' if len(foreign) == 1 else 'are'} not {typed}'s (--method {typed}): remove "
                         f"{'it' if len(foreign) == 1 else 'them'} from the file's hparams, or start from a {typed} "
                         "run's config.json")


def options_from_config_file(path: str | Path, typed: list[str], command: str = "train"
                             ) -> tuple[list[str], str | None]:
    """The options that stand for the settings of ``path``, to be placed before ``typed`` (the options
    given on the command line after ``command``, ``train`` or ``compare``), and the file's run label
    (None: none; compare's files have none).

    Raises:
        UsageError: the file cannot be read, is not TOML/JSON, or holds a key that is not a setting of ``command``.
    """
    if command not in COMMANDS:
        raise ValueError(f"--config is an option of {' and '.join(COMMANDS)}, not of {command}")
    path = Path(path)
    values = _load(path)
    _check_keys(values, path, command)
    options: list[str] = []
    for key, value in values.items():
        if key in NOT_OPTIONS or value is None:  # None: the option's default (e.g. the preset's size)
            continue
        if key in FLAGS and isinstance(value, bool):
            options.append(f"--{'' if value else 'no-'}{key.replace('_', '-')}")
            continue
        options.append(f"--{key.replace('_', '-')}={_option_value(key, value, path)}")
    hparams = values.get("hparams") or {}
    if not isinstance(hparams, dict):
        raise UsageError(f"--config {path}: hparams must be a table of hyperparameters, got {hparams!r}")
    typed_hp = {item.partition("=")[0].strip() for flag, item in pairwise(typed) if flag == "--hp"}
    typed_hp |= {item[len("--hp="):].partition("=")[0].strip() for item in typed if item.startswith("--hp=")}
    if "--lr" in typed or any(item.startswith("--lr=") for item in typed):
        typed_hp.add("lr")
    _refuse_other_methods_hparams(path, values.get("method"), _typed_method(typed), set(hparams) - typed_hp)
    for key, value in hparams.items():
        if key not in typed_hp:
            options += ["--hp", f"{key}={value!r}"]  # repr: --hp's literal_eval gives back the value's type
    label = values.get("label")
    if label is not None and not isinstance(label, str):
        raise UsageError(f"--config {path}: label must be text, got {label!r}")
    return options, label or None
