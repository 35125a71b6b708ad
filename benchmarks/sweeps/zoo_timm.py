"""timm's architectures: for each of its model modules (one family each: resnet, vision_transformer,
convnext, ...), the two smallest-named models (nano, tiny, small, ... before the rest; then by name),
weights not loaded, 10 classes, a batch of two at the model's default input size."""

from __future__ import annotations

import re
from typing import Any, Iterator, List

from case import Case
from torchvision_ops import import_torchvision

PER_MODULE = 2
# Words of a model's name that say it is one of its family's small ones, smallest first
SMALL = ("atto", "femto", "pico", "nano", "tiny", "mini", "xxs", "xs", "small", "s", "18", "b0", "base")


def _smallness(name: str) -> Any:
    words = re.split(r"[_.\-]", name)
    for rank, word in enumerate(SMALL):
        if word in words:
            return (rank, len(name), name)
    return (len(SMALL), len(name), name)


def picked(timm: Any) -> List[str]:
    """The sweep's models: PER_MODULE of each module, smallest-named first."""
    names = []
    for module in sorted(timm.list_modules()):
        names += sorted(timm.list_models(module=module), key=_smallness)[:PER_MODULE]
    return names


def _case(timm: Any, torch: Any, name: str) -> Case:
    def build() -> Any:
        return timm.create_model(name, pretrained=False, num_classes=10)

    def loss(model: Any) -> Any:
        size = model.pretrained_cfg.get("input_size", (3, 224, 224))
        logits = model(torch.randn(2, *size))
        return torch.nn.functional.cross_entropy(logits, torch.tensor([1, 2]))
    return Case(name, build, loss)


def cases() -> Iterator[Case]:
    """The zoo, by module name."""
    import torch
    import_torchvision()  # timm imports torchvision's transforms
    import timm
    for name in picked(timm):
        yield _case(timm, torch, name)
