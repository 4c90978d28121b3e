"""FGSM's eps in normalised units: the pixel step is eps * std per channel (= attacking the normalised input)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from drmoo.attacks import EPS_SPACES, fgsm, pixel_step, summed_task_loss
from drmoo.experiments.evaluation import accuracy

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class NormalisingTwoTask(nn.Module):
    """Normalises like MultiTaskResNet (mean/std buffers), then two linear heads on the flattened image."""

    def __init__(self, pixels: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1))
        self.heads = nn.ModuleList([nn.Linear(3 * pixels, 10), nn.Linear(3 * pixels, 10)])

    def trunk(self, normalised: torch.Tensor) -> list[torch.Tensor]:
        return [head(normalised.flatten(1)) for head in self.heads]

    def forward(self, images: torch.Tensor) -> list[torch.Tensor]:
        return self.trunk((images - self.mean) / self.std)


def test_normalized_eps_is_the_attack_on_the_normalised_input() -> None:
    torch.manual_seed(0)
    model = NormalisingTwoTask(pixels=16)
    images = 0.3 + 0.4 * torch.rand(5, 3, 4, 4)  # 0.3..0.7: no step below reaches the clamp
    labels = torch.randint(0, 10, (5, 2))
    eps = 0.05
    # What code that normalises the data first and attacks the normalised tensor does:
    normalised = ((images - model.mean) / model.std).requires_grad_(True)
    (grad,) = torch.autograd.grad(summed_task_loss(model.trunk(normalised), labels), normalised)
    expected = (normalised.detach() + eps * grad.sign()) * model.std + model.mean

    attacked = fgsm(model, images, labels, eps, step_scale=pixel_step(model, "normalized"))
    torch.testing.assert_close(attacked, expected, rtol=0, atol=1e-6)
    step = (attacked - images).abs()
    for channel, std in enumerate(STD):  # eps * std per channel, ~4.4x smaller than the pixel-space step
        torch.testing.assert_close(step[:, channel], torch.full_like(step[:, channel], eps * std), rtol=0, atol=1e-6)
    pixel = fgsm(model, images, labels, eps)
    torch.testing.assert_close((pixel - images).abs(), torch.full_like(images, eps), rtol=0, atol=1e-6)
    assert pixel_step(model, "pixel") is None


def test_eps_space_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown eps space 'raw'; valid choices: pixel, normalized"):
        pixel_step(NormalisingTwoTask(4), "raw")
    with pytest.raises(ValueError, match="needs a model that normalises its input with a `std` buffer; Linear"):
        pixel_step(nn.Linear(2, 2), "normalized")
    assert EPS_SPACES == ("pixel", "normalized")


def test_accuracy_attacks_in_the_eps_space_it_is_given() -> None:
    torch.manual_seed(1)
    model = NormalisingTwoTask(pixels=16).eval()
    images = torch.rand(64, 3, 4, 4)
    with torch.no_grad():
        labels = torch.stack([z.argmax(1) for z in model(images)], dim=1)  # clean accuracy 100 %
    device = torch.device("cpu")

    def by_hand(step_scale: torch.Tensor | None) -> list[float]:
        attacked = fgsm(model, images, labels, 0.3, step_scale=step_scale)
        with torch.no_grad():
            return [float((z.argmax(1) == labels[:, i]).double().mean()) for i, z in enumerate(model(attacked))]

    def identity(batch: torch.Tensor) -> torch.Tensor:
        return batch

    assert accuracy(model, images, labels, 64, device, identity) == [1.0, 1.0]
    pixel = accuracy(model, images, labels, 64, device, identity, eps=0.3)
    normalized = accuracy(model, images, labels, 64, device, identity, eps=0.3, eps_space="normalized")
    assert pixel == by_hand(None) and normalized == by_hand(model.std)
    assert pixel != normalized  # the budgets differ ~4.4x: the accuracies do too


def test_summed_task_loss_is_the_sum_of_the_task_losses_and_refuses_no_tasks() -> None:
    """The attack objective adds the tasks' cross-entropies in task order; with no task logits it raises
    (it returned the int 0, on which the attack's gradient call then failed)."""
    generator = torch.Generator().manual_seed(0)
    logits = [torch.randn(6, classes, generator=generator) for classes in (3, 4, 5)]
    labels = torch.stack([torch.randint(0, classes, (6,), generator=generator) for classes in (3, 4, 5)], dim=1)
    ce = [nn.functional.cross_entropy(z, labels[:, task]) for task, z in enumerate(logits)]
    assert torch.equal(summed_task_loss(logits, labels), ce[0] + ce[1] + ce[2])
    with pytest.raises(ValueError, match="at least one task"):
        summed_task_loss([], labels)
