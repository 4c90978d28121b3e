"""The multi-task ResNet18: frozen layers, heads, weights handling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drmoo.models import MultiTaskResNet, resolve_weights
from drmoo.optim import DoubleClipMGDA


def test_frozen_layers_do_not_move_and_the_rest_does() -> None:
    torch.manual_seed(0)
    model = MultiTaskResNet([10, 10])
    frozen_before = {k: v.clone() for k, v in model.trunk.state_dict().items()
                     if k.split(".")[0] in MultiTaskResNet.FROZEN}
    layer2_before = model.trunk.layer2[0].conv1.weight.detach().clone()
    bn2_stats_before = model.trunk.layer2[0].bn1.running_mean.clone()
    optimizer = DoubleClipMGDA(model.shared_parameters(), 2, lr=0.1)
    heads = torch.optim.SGD(model.task_parameters(), lr=0.01)
    images, labels = torch.rand(6, 3, 32, 32), torch.randint(0, 10, (6, 2))
    model.train()

    def closure() -> torch.Tensor:
        logits = model(images)
        return torch.stack([torch.nn.functional.cross_entropy(z, labels[:, i], reduction="none")
                            for i, z in enumerate(logits)], dim=1)

    for _ in range(2):
        heads.zero_grad()
        optimizer.step(closure)
        heads.step()
    for key, value in model.trunk.state_dict().items():
        if key in frozen_before:
            assert torch.equal(value, frozen_before[key]), f"frozen {key} changed"
    assert not model.trunk.bn1.training and not model.trunk.layer1.training and model.trunk.layer2.training
    assert not torch.equal(model.trunk.layer2[0].conv1.weight, layer2_before)
    assert not torch.equal(model.trunk.layer2[0].bn1.running_mean, bn2_stats_before)
    assert all(p.requires_grad for p in model.shared_parameters())
    frozen_ids = {id(p) for name in MultiTaskResNet.FROZEN for p in getattr(model.trunk, name).parameters()}
    assert not frozen_ids & {id(p) for p in model.shared_parameters()}


def test_heads_shapes_and_normalisation_inside() -> None:
    model = MultiTaskResNet([10, 4, 2]).eval()
    outputs = model(torch.rand(3, 3, 32, 32))
    assert [tuple(o.shape) for o in outputs] == [(3, 10), (3, 4), (3, 2)]
    # inputs live in [0, 1]: the ImageNet normalisation is part of the model
    x = torch.full((1, 3, 32, 32), 0.5)
    manual = model.trunk((x - model.mean) / model.std)
    torch.testing.assert_close(model.features(x), manual)


def test_weights_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_weights("none") is None and resolve_weights(None) is None
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(FileNotFoundError, match=r"never downloads.*--weights none"):
        resolve_weights("imagenet")
    with pytest.raises(FileNotFoundError, match="no such file"):
        resolve_weights(str(tmp_path / "nope.pth"))
    # a saved trunk loads back through --weights PATH, and garbage is a clear error
    from torchvision.models import resnet18

    source = resnet18()
    torch.save(source.state_dict(), tmp_path / "r18.pth")
    loaded = MultiTaskResNet([10], weights=resolve_weights(str(tmp_path / "r18.pth")))
    assert torch.equal(loaded.trunk.conv1.weight, source.conv1.weight)
    torch.save({"something": torch.zeros(1)}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="not a ResNet18 state dict"):
        MultiTaskResNet([10], weights=tmp_path / "bad.pth")
