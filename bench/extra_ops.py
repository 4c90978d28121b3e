"""aten ops per steady-state training iteration beyond each method's own algorithmic floor.

On a GPU every such op is (at least) one kernel launch, so this count is what an iteration adds in
launches over the forward and backward passes its algorithm needs: a CPU-countable proxy for the
host-side overhead that ``drmoo bench-iter`` times.  The model is the Multi-MNIST ResNet18 at a tiny
input (the op count does not depend on the batch or the image size), reset for each method.

    PYTHONPATH=python:. python bench/extra_ops.py [--capturable] [--methods all]
"""

from __future__ import annotations

import argparse
import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from drmoo.experiments import wallclock
from drmoo.experiments.multimnist import method_hparams
from drmoo.models.resnet_mtl import MultiTaskResNet
from drmoo.optim import available, create


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops that do work (views only change metadata)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _count(fn: Callable[[], Any]) -> Counter[str]:
    with _OpCounter() as counter:
        fn()
    return counter.ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="all")
    parser.add_argument("--capturable", action="store_true", help="as the trainer runs the optimizers on CUDA")
    args = parser.parse_args()
    methods = sorted(available()) if args.methods == "all" else args.methods.split(",")
    num_tasks = 2
    torch.manual_seed(0)
    model = MultiTaskResNet([10] * num_tasks).train()
    shared = model.shared_parameters()
    counter = wallclock.PassCounter(shared)
    generator = torch.Generator().manual_seed(0)
    pool = itertools.cycle([(torch.rand(4, 3, 64, 64, generator=generator),
                             torch.randint(0, 10, (4, num_tasks), generator=generator)) for _ in range(8)])
    initial = {key: value.clone() for key, value in model.state_dict().items()}

    def losses_of(images: Tensor, labels: Tensor) -> Tensor:
        counter.forward()
        return torch.stack([F.cross_entropy(z, labels[:, i], reduction="none")
                            for i, z in enumerate(model(images))], dim=1)

    print("| method | passes (its own floor) | aten ops / iteration | own floor | extra | most frequent extra |")
    print("|---|---|---:|---:|---:|---|")
    for label, method, overrides in wallclock._variants(methods):
        model.load_state_dict(initial)  # every method starts from the same weights
        optimizer = create(method, shared, num_tasks,
                           **method_hparams(method, {"capturable": args.capturable, **overrides}))
        heads = torch.optim.SGD(model.task_parameters(), lr=1e-2)
        iteration = wallclock._method_iteration(optimizer, heads, lambda: next(pool), losses_of)
        passes = wallclock._count_passes(iteration, counter, 2, label)  # also the warm-up

        def floor(passes: wallclock.Passes = passes) -> None:
            wallclock.replay_passes(passes, num_tasks, lambda: losses_of(*next(pool)), shared)

        floor()
        ops, floor_ops = _count(iteration), _count(floor)
        extra = ops - floor_ops
        top = ", ".join(f"{name.removeprefix('aten.')} {n}" for name, n in extra.most_common(4))
        print(f"| {label} | {wallclock.describe_passes(passes)} | {sum(ops.values())} | {sum(floor_ops.values())} "
              f"| {sum(ops.values()) - sum(floor_ops.values())} | {top} |")


if __name__ == "__main__":
    main()
