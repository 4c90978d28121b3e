"""Ops and host syncs per training step: plain training and every drmoo method, counted, not timed.

One command regenerates ``bench/results/launches.{json,md}``::

    python bench/launches.py                   # both trunks (see --help for a smaller grid)

Each row is one steady-state training step (the third: two warm-up steps first, so that the one-time checks
of the first steps are not counted) run under :class:`op_count.OpCounter`, a ``TorchDispatchMode``: the
non-view aten ops it dispatches (forward, every backward, the method's algebra, the optimizer step: on a
GPU each is a kernel launch, or a few for the multi-tensor ``_foreach`` ops), the view ops apart, and the
host syncs (scalar reads, value-dependent shapes, ``tolist``; see ``op_count``) with where each comes
from.  The counts are exact and machine-independent: the same code, torch version and model give the
same numbers on any CPU or GPU (they count what is asked of the device, not how long it takes).

Grid: plain training (``losses.mean(0).sum().backward()``, SGD), then every method x
{``jacobian="parameters"``, ``"features"``} (MoCo has no features mode) x {the ``drmoo.Balancer``
(``backward(losses[, features=z])`` then SGD on every parameter), the optimizer's ``step(closure)`` (SGD on
the heads)} x ``jacobian_strategy`` {auto, loop, batched} x m, on two head layouts: m separate ``Linear(d, 1)``
heads joined by ``torch.cat``, and one shared ``Linear(d, m)`` head; per-sample logistic losses [B, m].

The ``step(closure)`` closure draws the method's batches as its multi-batch form does (a fresh batch per
call, from a pool of 4) in parameters mode; in features mode it returns the step's one batch (the same
(losses, z) at every call with grad, recomputed under ``torch.no_grad()``), as features mode requires.

Trunks: ``small`` (the full grid: two 3x3 convolutions with GroupNorm and ReLU, global pooling, d = 32,
batch 8 at 8 px; counts grow with the number of layers, not their sizes) and ``resnet18`` (torchvision's
ResNet18 with GroupNorm(32), fc removed, d = 512, batch 2 at 32 px: the issue's model; m = 2 and 40, every
features row, and MGDA's parameters rows).

``--device cuda`` counts the same steps on a GPU (the models and batches on it; ``launches-cuda.{json,md}``
by default), with a second, independent sync counter beside the dispatch mode's: torch's own
``torch.cuda.set_sync_debug_mode("warn")``, which warns at every operation that makes the host wait for the
device (column ``cuda syncs``).  ``--apis``/``--strategies`` narrow the grid (a GPU call has minutes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
if str(HERE) not in sys.path:  # op_count, beside this file (appended: nothing installed is shadowed)
    sys.path.append(str(HERE))

from op_count import OpCounter  # noqa: E402

METHODS = ("mgda", "double-clip", "double-loop", "famo", "modo", "moco", "nashmtl", "sdmgrad")
NO_FEATURES = ("moco",)
MODES = ("parameters", "features")
APIS = ("balancer", "step")
STRATEGIES = ("auto", "loop", "batched")
DEFAULT_STRATEGY = "auto"  # what a new optimizer picks (drmoo.jacobian.resolve_strategy)
LAYOUTS = ("separate", "shared")
TASKS = (2, 8, 40, 100)
TRUNKS = ("small", "resnet18")
RESNET_TASKS = (2, 40)
WARMUP_STEPS = 2


@dataclass(frozen=True)
class Variant:
    """One row: plain training, or (method, mode, API, strategy)."""

    method: str  # "plain" or a registry name
    mode: str = ""
    api: str = ""
    strategy: str = ""

    @property
    def label(self) -> str:
        return "plain" if self.method == "plain" else f"{self.method} {self.mode} {self.api} {self.strategy}"


def variants(trunk: str) -> Iterator[Variant]:
    """The rows of the grid for ``trunk`` (the module docstring)."""
    yield Variant("plain")
    for method, mode, api, strategy in itertools.product(METHODS, MODES, APIS, STRATEGIES):
        if mode == "features" and method in NO_FEATURES:
            continue
        if trunk == "resnet18" and mode == "parameters" and (method != "mgda" or api != "balancer"):
            continue  # m backward passes through ResNet18 per row: MGDA's Balancer rows only
        yield Variant(method, mode, api, strategy)



def build(trunk: str, layout: str, num_tasks: int, seed: int = 0) -> tuple[Any, Any, Callable[[Any], Any], int]:
    """(trunk module, heads module, heads forward z -> logits [B, m], d)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    if trunk == "small":
        body: nn.Module = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.GroupNorm(8, 32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        width = 32
    elif trunk == "resnet18":
        import torchvision

        body = torchvision.models.resnet18(norm_layer=lambda channels: nn.GroupNorm(32, channels))
        body.fc = nn.Identity()  # type: ignore[assignment]
        width = 512
    else:
        raise ValueError(f"unknown trunk {trunk!r}; valid: {', '.join(TRUNKS)}")
    if layout == "separate":
        heads: nn.Module = nn.ModuleList(nn.Linear(width, 1) for _ in range(num_tasks))

        def head_forward(z: Any) -> Any:
            return torch.cat([head(z) for head in heads], dim=1)  # type: ignore[union-attr]
    elif layout == "shared":
        heads = nn.Linear(width, num_tasks)
        head_forward = heads
    else:
        raise ValueError(f"unknown head layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    return body.train(), heads.train(), head_forward, width


def batches(trunk: str, num_tasks: int, count: int = 4, seed: int = 1, device: str = "cpu") -> list[tuple[Any, Any]]:
    import torch

    size, image = (8, 8) if trunk == "small" else (2, 32)
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, image, image, generator=generator).to(device),
             torch.randint(0, 2, (size, num_tasks), generator=generator).float().to(device)) for _ in range(count)]


def make_step(variant: Variant, trunk: str, layout: str, num_tasks: int, device: str = "cpu") -> Callable[[], None]:
    """One training step of ``variant`` (zero_grad, forward, backward, optimizer steps), on a cycle of batches."""
    import torch
    import torch.nn.functional as F

    import drmoo
    from drmoo.optim import create

    body, heads, head_forward, _ = build(trunk, layout, num_tasks)
    body, heads = body.to(device), heads.to(device)
    pool = itertools.cycle(batches(trunk, num_tasks, device=device))

    def forward(x: Any, y: Any) -> tuple[Any, Any]:
        z = body(x)
        return F.binary_cross_entropy_with_logits(head_forward(z), y, reduction="none"), z

    everything = torch.optim.SGD([*body.parameters(), *heads.parameters()], lr=1e-3)
    if variant.method == "plain":
        def plain() -> None:
            everything.zero_grad(set_to_none=True)
            losses, _ = forward(*next(pool))
            losses.mean(0).sum().backward()
            everything.step()
        return plain

    extra = {"seed": 0} if variant.method == "double-loop" else {}
    if variant.api == "balancer":
        balancer = drmoo.Balancer(variant.method, body.parameters(), num_tasks, jacobian=variant.mode, lr=1e-3,
                                  **extra)
        balancer.algorithm.jacobian_strategy = variant.strategy

        def balancer_step() -> None:
            everything.zero_grad(set_to_none=True)
            losses, z = forward(*next(pool))
            if variant.mode == "features":
                balancer.backward(losses, features=z)
            else:
                balancer.backward(losses)
            everything.step()
        return balancer_step

    optimizer = create(variant.method, body.parameters(), num_tasks, jacobian=variant.mode, lr=1e-3, **extra)
    optimizer.jacobian_strategy = variant.strategy
    head_sgd = torch.optim.SGD(heads.parameters(), lr=1e-3)

    def optimizer_step() -> None:
        head_sgd.zero_grad(set_to_none=True)
        if variant.mode == "features":  # one batch per step: the same (losses, z) at every call with grad
            batch = next(pool)
            kept: list[tuple[Any, Any]] = []

            def closure() -> Any:
                if not torch.is_grad_enabled():
                    return forward(*batch)
                if not kept:
                    kept.append(forward(*batch))
                return kept[0]
        else:
            def closure() -> Any:  # a fresh batch per call: the method's multi-batch form
                return forward(*next(pool))[0]
        optimizer.step(closure)
        head_sgd.step()
    return optimizer_step


def cuda_sync_warnings(step: Callable[[], None]) -> int:
    """How many times ``step`` made the host wait for the device, by ``torch.cuda.set_sync_debug_mode``."""
    import warnings

    import torch

    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum("synchronizing" in str(warning.message) for warning in caught)


def count(variant: Variant, trunk: str, layout: str, num_tasks: int, device: str = "cpu") -> dict[str, Any]:
    """The counts of one steady-state step of ``variant`` (after WARMUP_STEPS); on CUDA, torch's count too."""
    import torch

    torch.set_num_threads(1)
    step = make_step(variant, trunk, layout, num_tasks, device)
    for _ in range(WARMUP_STEPS):
        step()
    with OpCounter() as counter:
        step()
    # torch's own counter, on the step after (the same work: a steady state)
    cuda_syncs = cuda_sync_warnings(step) if device.startswith("cuda") else None
    return {"device": device, "cuda_syncs": cuda_syncs,
            "trunk": trunk, "layout": layout, "m": num_tasks, "method": variant.method, "mode": variant.mode,
            "api": variant.api, "strategy": variant.strategy,
            "default_strategy": variant.strategy == DEFAULT_STRATEGY,
            "ops": counter.ops_total, "views": counter.views, "syncs": len(counter.syncs),
            "sync_origins": dict(counter.sync_origins()), "top_ops": dict(counter.ops.most_common(8))}


def _key(record: dict[str, Any]) -> tuple[str, str, str, str]:
    return record["method"], record["mode"], record["api"], record["strategy"]


def _caller(origin: str) -> str:
    """'op @ inner <- caller' as '`caller`' (the scalar reads) or '`caller` (op)': where a sync is asked for."""
    op, _, where = origin.partition(" @ ")
    caller = where.rsplit(" <- ", 1)[-1].removeprefix("drmoo/")
    return f"`{caller}`" if op == "_local_scalar_dense" else f"`{caller}` ({op})"


def table(data: dict[str, Any]) -> str:
    """The markdown tables of a run (``data`` as written to the JSON)."""
    records = data["records"]
    lines = [
        "# Ops and host syncs per training step",
        "",
        f"Regenerate: `{data['command']}` (torch {data['torch']}). **Counts, not timings: exact, and the same on any "
        "machine** for this code, torch version and model. Each row is one steady-state step (the third) under a "
        "`TorchDispatchMode` (`bench/op_count.py`): *ops* = non-view aten ops (each a kernel launch on a GPU), "
        "*syncs* = host syncs (`_local_scalar_dense` from `bool()`/`float()`/`.item()`, `equal`, `nonzero`, "
        "`tolist()`, ...). Cells: `ops / syncs`; the plain row's ops are the floor, and `(+x.xx)` is a row's ops "
        "above plain as a multiple of plain's (`(-x.xx)`: below it; the `step` rows update the trunk with one "
        "`combine` op where plain's SGD takes one op per parameter).",
        "",
        *([f"Device: {data['device_name']}. Cells: `ops / syncs / cuda syncs`, the last being torch's own count "
           "of the operations that made the host wait (`torch.cuda.set_sync_debug_mode(\"warn\")`), on the "
           "step after the counted one.", ""] if data.get("device", "cpu") != "cpu" else []),
        "Rows: method, `jacobian=` mode, API (`balancer`: `drmoo.Balancer(...).backward` then SGD; `step`: the "
        "optimizer's `step(closure)`, which in parameters mode draws a fresh batch per closure call, the method's "
        "multi-batch form), `jacobian_strategy` (`loop`: one backward per task; `batched`: one vmapped backward; "
        "`auto`, the default, marked `*`: on this CPU run, parameters mode's `loop`, and in features mode the "
        "rows of separate heads from one pass, else `batched` above 4 tasks; on a GPU `auto` takes `batched` "
        "where it does not split).",
        "",
    ]
    for trunk in data["trunks"]:
        for layout in data["layouts"]:
            rows = [r for r in records if r["trunk"] == trunk and r["layout"] == layout]
            if not rows:
                continue
            tasks = sorted({r["m"] for r in rows})
            plain = {r["m"]: r["ops"] for r in rows if r["method"] == "plain"}
            model = ("small trunk (2 conv + GroupNorm, d = 32, batch 8 at 8 px)" if trunk == "small"
                     else "ResNet18 with GroupNorm(32), d = 512, batch 2 at 32 px")
            heads = ("m separate `Linear(d, 1)` heads joined by `torch.cat`" if layout == "separate"
                     else "one shared `Linear(d, m)` head")
            lines += [f"## {model}; {heads}", "",
                      "| method | mode | API | strategy | " + " | ".join(f"m = {m}" for m in tasks) + " |",
                      "|---|---|---|---|" + "---:|" * len(tasks)]
            by_key: dict[tuple[str, str, str, str], dict[int, dict[str, Any]]] = {}
            for record in rows:
                by_key.setdefault(_key(record), {})[record["m"]] = record
            for key, cells in by_key.items():
                method, mode, api, strategy = key
                texts = []
                for m in tasks:
                    record = cells.get(m)
                    if record is None:
                        texts.append("")
                        continue
                    text = f"{record['ops']:,} / {record['syncs']}"
                    if record.get("cuda_syncs") is not None:  # torch's own count, on a GPU
                        text += f" / {record['cuda_syncs']}"
                    if method != "plain" and m in plain:
                        text += f" ({(record['ops'] - plain[m]) / plain[m]:+.2f})"
                    texts.append(text + ("\\*" if record["default_strategy"] else ""))
                lines.append(f"| {method} | {mode} | {api} | {strategy} | " + " | ".join(texts) + " |")
            lines.append("")
    lines += ["## Where the syncs come from", "",
              "Per row at the largest m of the small trunk with separate heads, the strategy a new optimizer picks: "
              "the number of syncs, and for each the drmoo function that asked for it (through "
              "`require_finite`'s `bool()` unless another op is named), with its count; the JSON has the full "
              "origins.", ""]
    small = [r for r in records if r["trunk"] == data["trunks"][0] and r["layout"] == data["layouts"][0]]
    if small:
        largest = max(r["m"] for r in small)
        for record in small:
            if record["m"] != largest or record["method"] == "plain" or not record["default_strategy"]:
                continue
            origins = "; ".join(f"{count} x {_caller(where)}"
                                for where, count in sorted(record["sync_origins"].items()))
            lines.append(f"- {record['method']} {record['mode']} {record['api']}: {record['syncs']} "
                         f"({origins or 'none'})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trunks", nargs="+", default=list(TRUNKS), choices=TRUNKS)
    parser.add_argument("--tasks", type=int, nargs="+", default=list(TASKS),
                        help=f"m for the small trunk (default {TASKS}; ResNet18 takes {RESNET_TASKS})")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--methods", nargs="+", default=None, choices=("plain", *METHODS),
                        help="only these rows (plain is always counted: the floor)")
    parser.add_argument("--apis", nargs="+", default=list(APIS), choices=APIS, help="only these APIs' rows")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES,
                        help="only these jacobian_strategy rows")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:index]: the steps on a GPU, with torch's own "
                                                         "sync count beside (default out: launches-cuda)")
    parser.add_argument("--out", type=Path, default=None, help="output path without suffix (default "
                                                               "bench/results/launches[-cuda])")
    parser.add_argument("--summary-only", type=Path, metavar="JSON", help="only rebuild the .md table of this JSON")
    args = parser.parse_args()
    if args.summary_only is not None:
        args.summary_only.with_suffix(".md").write_text(table(json.loads(args.summary_only.read_text())) + "\n")
        return
    import importlib.util
    import warnings

    if importlib.util.find_spec("drmoo") is None:  # run from a checkout without an install: the source tree
        sys.path.insert(0, str(ROOT / "python"))
    import torch

    on_gpu = args.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device on this machine")
    if not on_gpu and args.device != "cpu":
        parser.error(f"--device must be cpu or cuda[:index], not {args.device!r}")
    default_out = RESULTS / ("launches-cuda" if on_gpu else "launches")
    args.out = default_out if args.out is None else args.out
    warnings.filterwarnings("ignore", category=UserWarning)
    arguments = [f"--{name} {' '.join(map(str, value))}" for name, value, default in (
        ("trunks", args.trunks, list(TRUNKS)), ("tasks", args.tasks, list(TASKS)),
        ("layouts", args.layouts, list(LAYOUTS)), ("methods", args.methods, None), ("apis", args.apis, list(APIS)),
        ("strategies", args.strategies, list(STRATEGIES)), ("device", [args.device], ["cpu"])) if value != default]
    if args.out.resolve() != default_out.resolve():
        out = args.out.resolve()
        arguments.append(f"--out {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    data: dict[str, Any] = {"command": " ".join(["python bench/launches.py", *arguments]), "torch": torch.__version__,
                            "trunks": args.trunks, "layouts": args.layouts, "device": args.device,
                            "device_name": torch.cuda.get_device_name(args.device) if on_gpu else "cpu",
                            "records": []}
    for trunk in args.trunks:
        for layout in args.layouts:
            for m in (args.tasks if trunk == "small" else RESNET_TASKS):
                for variant in variants(trunk):
                    if args.methods is not None and variant.method not in ("plain", *args.methods):
                        continue
                    if variant.method != "plain" and (variant.api not in args.apis
                                                      or variant.strategy not in args.strategies):
                        continue
                    record = count(variant, trunk, layout, m, args.device)
                    data["records"].append(record)
                    print(trunk, layout, m, variant.label, record["ops"], record["syncs"], flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
            args.out.with_suffix(".md").write_text(table(data) + "\n")


if __name__ == "__main__":
    main()
