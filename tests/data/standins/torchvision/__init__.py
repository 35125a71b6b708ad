"""A stand-in for torchvision in tests: `torchvision.models.resnet50`, and the names transformers imports
on finding a torchvision (see ../README.md)."""

from . import io, models, transforms

# The release the real run had (../shared/cuda-truth/README.md); transformers reads it to pick its image paths.
__version__ = "0.26.0"

__all__ = ["io", "models", "transforms"]
