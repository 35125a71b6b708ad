"""Imported by transformers as `tvF` when it finds a torchvision; the stand-in defines no transforms."""
