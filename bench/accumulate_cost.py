"""What exact gradient accumulation costs: ``Balancer.backward(losses, accumulate=True)`` on k micro-batches
against one ``backward`` on the whole batch, ResNet18 (drmoo.models.MultiTaskResNet) on the CPU.

Measured as process CPU time per optimizer step (forward passes, backward passes and the step), the median
of ``--steps`` steps after one warm-up step, one torch thread: the machine may be shared, and process CPU
time counts this process's work only (not the wait for a core).  Plain training (one backward of the summed
mean losses) is measured the same way as the reference.

    python bench/accumulate_cost.py --out bench/results/accumulate-resnet18-cpu.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

import drmoo
from drmoo.models.resnet_mtl import MultiTaskResNet


def per_sample_losses(model: MultiTaskResNet, images: Tensor, labels: Tensor) -> Tensor:
    logits = model(images)
    return torch.stack([nn.functional.cross_entropy(out, labels[:, i], reduction="none")
                        for i, out in enumerate(logits)], dim=1)  # [B, m]


def step_timer(model: MultiTaskResNet, images: Tensor, labels: Tensor, micro: int,
               method: str | None) -> Callable[[], None]:
    """One optimizer step on the batch, as ``micro`` micro-batches (1: the whole batch at once)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    balancer = None if method is None else drmoo.Balancer(method, model.shared_parameters(), labels.shape[1],
                                                          optimizer=optimizer)  # type: ignore[call-overload]

    def step() -> None:
        optimizer.zero_grad()
        pieces = list(zip(images.chunk(micro), labels.chunk(micro)))
        for index, (x, y) in enumerate(pieces):
            losses = per_sample_losses(model, x, y)
            if balancer is None:
                (losses.mean(0).sum() * (x.shape[0] / images.shape[0])).backward()  # type: ignore[no-untyped-call]
            else:
                balancer.backward(losses, accumulate=index < len(pieces) - 1)
        optimizer.step()

    return step


def cpu_seconds(step: Callable[[], None], steps: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--method", default="mgda")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MultiTaskResNet([2] * args.tasks)
    model.train()
    images = torch.randn(args.batch, 3, args.size, args.size)
    labels = torch.randint(0, 2, (args.batch, args.tasks))
    rows = []
    for method in (None, args.method):
        for micro in args.micro:
            seconds = cpu_seconds(step_timer(model, images, labels, micro, method), args.steps)
            rows.append((method or "plain (sum of mean losses)", micro, seconds))
    full = {method: seconds for method, micro, seconds in rows if micro == 1}
    lines = [
        f"ResNet18 (MultiTaskResNet, layer2-4 shared), m = {args.tasks}, batch {args.batch} of "
        f"{args.size}x{args.size} images, one torch thread, {platform.processor() or platform.machine()}; "
        f"process CPU seconds per optimizer step (median of {args.steps} after a warm-up)",
        "",
        "| training | micro-batches | CPU s / step | vs the whole batch at once |",
        "|---|---|---|---|",
        *(f"| {method} | {micro} x {args.batch // micro} | {seconds:.2f} | {seconds / full[method]:.2f}x |"
          for method, micro, seconds in rows),
        "",
        "Command: `python " + " ".join(["bench/accumulate_cost.py", *(sys.argv[1:] if argv is None else argv)]) + "`",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
