"""The names Hugging Face transformers imports when it finds a torchvision (image_utils.py), so that
`import transformers` works beside this stand-in; no image transform is implemented."""

from enum import Enum


class InterpolationMode(Enum):
    """The interpolation modes transformers maps PIL's resampling filters to."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"
