"""The text of a display frame's line of Python, and the class it is in, where this machine has its file.

A trace shows what was allocated, not the code that did: two lines that allocate alike in one
precision may not in another (an inline `.to(torch.float32)` is no copy of an fp32 tensor). Rules
that must tell such lines apart read the line itself. A library's display path is relative to
site-packages (`transformers/models/t5/modeling_t5.py`: frames.normalize_path), so it is
looked up under each entry of this Python's path, then under the folders outside site-packages
a library was found installed in (installed.py: `pip install --target DIR`); an absolute path is
read as given. Nothing is imported; None where no file is found, or where what the path names is
no source file a person wrote (past MAX_SOURCE_BYTES: the path comes from the snapshot, which may
name any file). A user file's display path is relative to the project (frames.relativize) or as the
script was started (`python train.py`), so a relative path is looked up in the current folder first.

A trace names a frame's function only (`__init__`), never its class: `enclosing_class` reads the
class from the file, so that a rule can tell an EMA's constructor in train.py from the model's.
"""

from __future__ import annotations

import ast
import bisect
import functools
import linecache
import os
import sys
from typing import Optional, Tuple

from memdiff.model import Frame
from memdiff.read.installed import library_roots

# Larger than any module of Python a person wrote (transformers' largest is about 300 KB): linecache
# reads a file whole, and a snapshot's path could name a large generated file.
MAX_SOURCE_BYTES = 8 << 20


def source_line(frame: Frame) -> Optional[str]:
    """The stripped text of `frame`'s line, or None where its file is not on this machine."""
    path = _find(frame.file)
    if path is None or frame.line < 1:
        return None
    return linecache.getline(path, frame.line).strip() or None


def enclosing_class(frame: Frame) -> Optional[str]:
    """The name of the innermost class whose body holds `frame`'s line (a method's line, or a
    comprehension's inside a method), or None where the file is not here, does not parse, or the line
    is in no class."""
    path = _find(frame.file)
    if path is None or frame.line < 1:
        return None
    starts, spans = _classes(path)
    # spans are sorted by first line, so the innermost class holding the line is the last one that
    # starts at or before it and ends at or after it (a nested class starts after its outer one)
    for first, last, name in reversed(spans[:bisect.bisect_right(starts, frame.line)]):
        if first <= frame.line <= last:
            return name
    return None


@functools.lru_cache(maxsize=256)
def _classes(path: str) -> Tuple[Tuple[int, ...], Tuple[Tuple[int, int, str], ...]]:
    """(first lines, (first line, last line, name) of each class), sorted by first line; parsed once
    per file (0.11 s for transformers' 272 KiB modeling_utils.py), empty where it does not parse."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(MAX_SOURCE_BYTES + 1))
    except (SyntaxError, ValueError, OSError, RecursionError, MemoryError):
        return (), ()
    spans = sorted((n.lineno, n.end_lineno or n.lineno, n.name) for n in ast.walk(tree) if isinstance(n, ast.ClassDef))
    return tuple(first for first, _, _ in spans), tuple(spans)


def _find(file: str) -> Optional[str]:
    """The file a display path names here: itself when absolute, else the first match in the current
    folder or under sys.path."""
    try:
        cwd = os.getcwd()
    except OSError:  # the folder was removed under us: no relative path resolves against it
        cwd = ""
    return _find_from(file, cwd, library_roots())


@functools.lru_cache(maxsize=1024)
def _find_from(file: str, cwd: str, libraries: Tuple[str, ...] = ()) -> Optional[str]:
    """`_find` from the folder `cwd`, then sys.path, then the `libraries` folders (installed outside
    site-packages, found by installed.py), looked up once per file and folders: a long run asks for
    the same few lines thousands of times."""
    if not file.endswith(".py"):
        return None
    roots = [root for root in (cwd, *sys.path, *libraries) if root]
    candidates = [file] if os.path.isabs(file) else [os.path.join(root, file) for root in roots]
    return next((path for path in candidates if _readable(path)), None)


def _readable(path: str) -> bool:
    """Whether `path` is a regular file small enough to be source (never a FIFO or a device, which a
    read could wait on forever)."""
    try:
        return os.path.isfile(path) and os.path.getsize(path) <= MAX_SOURCE_BYTES
    except OSError:
        return False
