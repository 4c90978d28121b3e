"""Per-rank memory of the shared trunk under FSDP2 (``fully_shard``) against a replicated trunk (DDP's layout),
with the features-mode balancer, ResNet18 (drmoo.models.MultiTaskResNet) on the CPU, 2 gloo ranks.

Run under torchrun, once per layout; rank 0 prints one table row (and appends it to ``--out``):

    torchrun --nproc-per-node 2 bench/fsdp_memory.py --layout fsdp --out bench/results/fsdp-memory-resnet18-cpu.md
    torchrun --nproc-per-node 2 bench/fsdp_memory.py --layout replicated --out bench/results/fsdp-memory-resnet18-cpu.md

Measured after two steps of AdamW: the bytes of the trunk's parameters, their ``.grad`` and AdamW's state as
this rank holds them (a DTensor counts its local shard), and the process's peak resident memory (ru_maxrss,
which also counts the activations, the heads, the interpreter and torch itself).  The replicated layout
writes the same ``.grad`` on every rank through the balancer's own all-reduce (DDP's reducer would hold
another copy of the gradients in its buckets).
"""

from __future__ import annotations

import argparse
import os
import resource
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard

import drmoo
from drmoo import distributed
from drmoo.models.resnet_mtl import MultiTaskResNet


def local_bytes(tensor: Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["fsdp", "replicated"], required=True)
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = MultiTaskResNet([2] * args.tasks)
    model.train()
    if args.layout == "fsdp":
        fully_shard(model.trunk)
    shared = model.shared_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    balancer = drmoo.Balancer("mgda", shared, args.tasks, jacobian="features", optimizer=optimizer)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        images = torch.randn(args.batch, 3, 64, 64, generator=generator)
        labels = torch.randint(0, 2, (args.batch, args.tasks), generator=generator)
        rows = distributed.shard(torch.arange(args.batch))
        optimizer.zero_grad()
        z = model.features(images[rows])
        losses = torch.stack([nn.functional.cross_entropy(head(z), labels[rows, i], reduction="none")
                              for i, head in enumerate(model.heads)], dim=1)
        balancer.backward(losses, features=z)
        optimizer.step()
    state: dict[str, Any] = {"params": sum(local_bytes(p) for p in shared),
                             "grads": sum(local_bytes(p.grad) for p in shared),
                             "adam": sum(local_bytes(value) for p in shared
                                         for value in optimizer.state[p].values() if isinstance(value, Tensor)),
                             "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB -> MiB
    totals: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(totals, state)
    if dist.get_rank() == 0:
        mib = 1024 * 1024
        worst = {key: max(total[key] for total in totals if total is not None) for key in state}
        trunk = worst["params"] + worst["grads"] + worst["adam"]
        row = (f"| {args.layout} | {worst['params'] / mib:.1f} | {worst['grads'] / mib:.1f} "
               f"| {worst['adam'] / mib:.1f} | {trunk / mib:.1f} | {worst['rss']:.0f} |")
        print(row)
        if args.out:
            header = not os.path.exists(args.out)
            with open(args.out, "a", encoding="utf-8") as handle:
                if header:
                    handle.write(f"ResNet18 trunk (layer2-4 shared), m = {args.tasks}, global batch {args.batch} of "
                                 f"64x64 images, {dist.get_world_size()} gloo ranks, features-mode MGDA, AdamW; MiB "
                                 "per rank (the larger rank's)\n\n| trunk layout | parameters | .grad | AdamW state "
                                 "| trunk total | peak RSS |\n|---|---|---|---|---|---|\n")
                handle.write(row + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
