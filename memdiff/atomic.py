"""Atomic file writes: a reader sees the old file or the new one, never half of either."""

from __future__ import annotations

import os
import stat
import tempfile


def write_text_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder, fsync, then rename.

    A path that exists and is not a regular file (/dev/stdout, /dev/null, a pipe) is written in
    place: renaming over it would replace the device or pipe with a file. A symlink is followed,
    so the file it points to is replaced and the link stays.
    """
    target = os.path.realpath(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        with open(target, "w", encoding="utf-8", errors="backslashreplace") as f:
            f.write(text)
        return
    folder = os.path.dirname(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=folder)
    try:
        # A lone surrogate (from a hostile frame name) is written escaped, which JSON reads back.
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
