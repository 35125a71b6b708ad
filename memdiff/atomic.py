"""Atomic file writes: a reader sees the old file or the new one, never half of either."""

from __future__ import annotations

import errno
import os
import stat
import tempfile


def write_text_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder, fsync, then rename.

    A path that exists and is not a regular file (/dev/stdout, /dev/null, a pipe) is written in
    place: renaming over it would replace the device or pipe with a file. A symlink is followed,
    so the file it points to is replaced and the link stays.
    """
    if os.path.islink(path) and not os.path.exists(path):
        # A dangling link would have the file made wherever it points, maybe outside the folder.
        raise OSError(errno.ENOENT, f"{path} is a link to {os.readlink(path)}, which does not exist")
    target = os.path.realpath(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and stat.S_ISFIFO(mode):
        # Opening a pipe for writing waits for a reader; without one, say so instead of hanging.
        try:
            fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise OSError(exc.errno, f"{path} is a pipe with no reader") from None
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as f:
            os.set_blocking(fd, True)
            f.write(text)
        return
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
