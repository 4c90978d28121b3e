"""Small multi-task problems of the paper's Appendix E, as tensors plus a per-sample loss.

A :class:`Problem` holds the whole data set in memory, the shared parameters' initial values and
a function mapping (parameters, a batch of rows) to per-sample losses ``[B, m]`` - exactly what an
optimizer closure returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["BatchStream", "Problem", "make_linear_problem"]

LossFn = Callable[[list[Tensor], Tensor, Tensor], Tensor]


@dataclass
class Problem:
    """A multi-task data set with shared parameters.

    ``inputs`` [N, d] and ``targets`` [N, m]; ``initial_params`` are cloned into fresh leaves for
    every run; ``loss_fn(params, inputs_batch, targets_batch)`` returns per-sample losses [B, m].
    """

    name: str
    inputs: Tensor
    targets: Tensor
    initial_params: list[Tensor]
    loss_fn: LossFn
    description: str

    @property
    def num_tasks(self) -> int:
        return self.targets.shape[1]

    @property
    def num_samples(self) -> int:
        return self.inputs.shape[0]

    def fresh_params(self) -> list[Tensor]:
        return [p.detach().clone().requires_grad_(True) for p in self.initial_params]


class BatchStream:
    """Independent uniform draws (with replacement) of batches of row indices, counting samples.

    Every call is a fresh draw from the data set - the "independent batches" the algorithms'
    analyses assume - from a dedicated, seedable generator.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.samples_drawn = 0

    def __call__(self) -> Tensor:
        self.samples_drawn += self.batch_size
        return torch.randint(0, self.num_samples, (self.batch_size,), generator=self.generator)


def _squared_error(params: list[Tensor], inputs: Tensor, targets: Tensor) -> Tensor:
    (theta,) = params
    return (inputs @ theta).unsqueeze(1).sub(targets).pow(2)


def make_linear_problem(seed: int, num_samples: int = 6000, dim: int = 10) -> Problem:
    """Multi-task linear regression of App. E.1 (m = 3, n = 10, 6000 samples, MSE).

    x ~ N(0, I); theta1* ~ N(0, I), theta2* ~ N(-0.2 theta1*, 0.04 I), theta3* ~ N(0.5 theta1*, 0.25 I);
    y^i = x^T theta_i* + eps^i with Var(eps) = 0.04, 0.36, 0.25.  One shared theta (start 0) is
    fitted to all three tasks, whose optima partly conflict.  Everything is drawn from ``seed``.
    """
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_samples, dim, generator=gen)
    theta1 = torch.randn(dim, generator=gen)
    theta2 = -0.2 * theta1 + 0.2 * torch.randn(dim, generator=gen)
    theta3 = 0.5 * theta1 + 0.5 * torch.randn(dim, generator=gen)
    optima = torch.stack([theta1, theta2, theta3], dim=1)  # [d, 3]
    noise_std = torch.tensor([0.04, 0.36, 0.25]).sqrt()
    targets = inputs @ optima + noise_std * torch.randn(num_samples, 3, generator=gen)
    return Problem(
        name="linear",
        inputs=inputs,
        targets=targets,
        initial_params=[torch.zeros(dim)],
        loss_fn=_squared_error,
        description=f"App. E.1 multi-task linear regression: m = 3, n = {dim}, {num_samples} samples, "
        f"squared error, theta_0 = 0, data seed {seed}",
    )
