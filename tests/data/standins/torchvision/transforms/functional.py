"""Named by transformers' image_utils.py at import; the stand-in converts no images."""

from typing import Any


def pil_to_tensor(pic: Any) -> Any:
    """Not part of the stand-in: the ResNet-50 run it serves reads no images."""
    raise NotImplementedError("the torchvision stand-in of tests/data/standins has no image transforms")
