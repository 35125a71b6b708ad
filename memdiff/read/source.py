"""The text of a display frame's line of Python, where this machine has its file.

A trace shows what was allocated, not the code that did: two lines that allocate alike in one
precision may not in another (an inline `.to(torch.float32)` is no copy of an fp32 tensor). Rules
that must tell such lines apart read the line itself. A library's display path is relative to
site-packages (`transformers/models/t5/modeling_t5.py`: frames.normalize_path), so it is
looked up under each entry of this Python's path; an absolute path is read as given. Nothing is
imported; None where no file is found, or where what the path names is no source file a person
wrote (past MAX_SOURCE_BYTES: the path comes from the snapshot, which may name any file).
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
from typing import Optional

from memdiff.model import Frame

# Larger than any module of Python a person wrote (transformers' largest is about 300 KB): linecache
# reads a file whole, and a snapshot's path could name a large generated file.
MAX_SOURCE_BYTES = 8 << 20


def source_line(frame: Frame) -> Optional[str]:
    """The stripped text of `frame`'s line, or None where its file is not on this machine."""
    path = _find(frame.file)
    if path is None or frame.line < 1:
        return None
    return linecache.getline(path, frame.line).strip() or None


@functools.lru_cache(maxsize=1024)
def _find(file: str) -> Optional[str]:
    """The file a display path names here: itself when absolute, else the first match under sys.path.
    Looked up once per file: a long run asks for the same few lines thousands of times."""
    if not file.endswith(".py"):
        return None
    candidates = [file] if os.path.isabs(file) else [os.path.join(entry, file) for entry in sys.path if entry]
    return next((path for path in candidates if _readable(path)), None)


def _readable(path: str) -> bool:
    """Whether `path` is a regular file small enough to be source (never a FIFO or a device, which a
    read could wait on forever)."""
    try:
        return os.path.isfile(path) and os.path.getsize(path) <= MAX_SOURCE_BYTES
    except OSError:
        return False
