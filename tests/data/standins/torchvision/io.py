"""Imported by transformers when it finds a torchvision (video_utils.py; image_utils.py of 5.17
imports ImageReadMode and decode_image): names only, the stand-in reads no files."""

import enum


class ImageReadMode(enum.Enum):
    """The modes torchvision.io reads an image in (names only)."""

    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def decode_image(*args, **kwargs):
    """Not part of the stand-in: it decodes no image."""
    raise NotImplementedError("the torchvision stand-in of tests/data/standins decodes no image")
