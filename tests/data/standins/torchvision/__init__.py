"""A stand-in for torchvision in tests: `torchvision.models.resnet50`, and the names transformers imports
on finding a torchvision (see ../README.md)."""

from . import io, models, transforms

__all__ = ["io", "models", "transforms"]
