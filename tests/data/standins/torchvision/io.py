"""Imported by transformers' video_utils.py when it finds a torchvision; the stand-in reads no files."""
