"""Every classification, detection, segmentation and video builder of torchvision.models.list_models,
weights=None, at a batch of two images (224 x 224; Inception v3 299; video 16 frames of 112 x 112,
224 x 224 for MViT, Swin3D and S3D, whose windows and kernels ask for it; detection 2 images of 120 x 160 resized to
at most 160)."""

from __future__ import annotations

from typing import Any, Dict, Iterator

from case import Case
from torchvision_ops import import_torchvision


def _leaves_loss(out: Any) -> Any:
    """The mean of every floating output (logits, auxiliary logits, a segmentation's `out` and `aux`)."""
    import torch
    from torch.utils._pytree import tree_leaves
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.float().mean() for t in leaves)


def _images(torch: Any, shape: Any) -> Any:
    return torch.randn(*shape)


def _classify(torchvision: Any, torch: Any, name: str) -> Case:
    side = 299 if name == "inception_v3" else 224
    return Case(name, lambda: torchvision.models.get_model(name, weights=None),
                lambda model: _leaves_loss(model(_images(torch, (2, 3, side, side)))))


def _segment(torchvision: Any, torch: Any, name: str) -> Case:
    kwargs = {"weights": None, "weights_backbone": None, "num_classes": 3}
    return Case(name, lambda: torchvision.models.get_model(name, **kwargs),
                lambda model: _leaves_loss(model(_images(torch, (2, 3, 128, 128)))))


def _video(torchvision: Any, torch: Any, name: str) -> Case:
    side = 224 if name.startswith(("mvit", "swin3d", "s3d")) else 112
    return Case(name, lambda: torchvision.models.get_model(name, weights=None),
                lambda model: _leaves_loss(model(_images(torch, (2, 3, 16, side, side)))))


def _targets(torch: Any, name: str) -> Any:
    boxes = torch.tensor([[10.0, 20.0, 60.0, 90.0], [30.0, 30.0, 100.0, 110.0]])
    target: Dict[str, Any] = {"boxes": boxes, "labels": torch.tensor([1, 2])}
    if name.startswith("maskrcnn"):
        masks = torch.zeros(2, 120, 160, dtype=torch.uint8)
        masks[0, 20:90, 10:60] = 1
        masks[1, 30:110, 30:100] = 1
        target["masks"] = masks
    if name.startswith("keypointrcnn"):
        target["labels"] = torch.tensor([1, 1])
        points = torch.tensor([[20.0, 30.0, 1.0], [50.0, 80.0, 1.0]])
        target["keypoints"] = points.repeat(17, 1).reshape(2, 17, 3)
    return [target, target]


def _detect(torchvision: Any, torch: Any, name: str) -> Case:
    kwargs: Dict[str, Any] = {"weights": None, "weights_backbone": None,
                              "num_classes": 2 if name.startswith("keypointrcnn") else 3}
    if not name.startswith("ssd"):
        kwargs.update(min_size=128, max_size=160)

    def loss(model: Any) -> Any:
        images = [_images(torch, (3, 120, 160)) for _ in range(2)]
        return sum(model(images, _targets(torch, name)).values())
    return Case(name, lambda: torchvision.models.get_model(name, **kwargs), loss)


def cases() -> Iterator[Case]:
    """The zoo, classification first."""
    import torch
    torchvision = import_torchvision()
    models = torchvision.models
    for module, make in ((models, _classify), (models.detection, _detect), (models.segmentation, _segment),
                         (models.video, _video)):
        for name in models.list_models(module=module):
            yield make(torchvision, torch, name)
