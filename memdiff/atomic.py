"""Atomic file writes: a reader sees the old file or the new one, never half of either."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import time

from memdiff.errors import InputError


# How long a pipe may go without a reader before writing to it is given up (no input hangs memdiff).
PIPE_READER_WAIT_S = 10.0


def _open_pipe(target: str, path: str) -> int:
    """A pipe opened for writing once a reader is there, for at most PIPE_READER_WAIT_S."""
    deadline = time.monotonic() + PIPE_READER_WAIT_S
    while True:
        try:
            return os.open(target, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise OSError(exc.errno, f"{path} is a pipe with no reader") from None
        time.sleep(0.05)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
        fd = _open_pipe(target, path)
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
        # mkstemp makes the file private; the result gets the mode a plain open() would give it
        # (or the replaced file's), so a report or baseline stays readable by whoever could read it.
        os.chmod(tmp, stat.S_IMODE(mode) if mode is not None else 0o666 & ~_umask())
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


def check_output(path: str) -> None:
    """InputError when `path` cannot be written for want of its folder: checked before the work."""
    folder = os.path.dirname(path)
    if folder and not os.path.isdir(folder):
        raise InputError(path, f"the folder {folder} does not exist: create it, or write elsewhere")


def write_output(path: str, text: str) -> None:
    """`write_text_atomic` for a path the user gave: a failure is bad input (exit 2) saying why."""
    check_output(path)
    try:
        write_text_atomic(path, text)
    except OSError as exc:
        raise InputError(path, f"cannot write: {exc.strerror or exc}") from None
