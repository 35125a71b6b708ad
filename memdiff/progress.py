"""A progress line on stderr for long reads: shown only on a terminal, after a couple of seconds.

The CLI turns it on (`enable`) when stderr is a terminal and the output is not JSON; a library
caller, a pipe, a log file or a worker process never gets one.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional, TextIO

from memdiff.inert import text
from memdiff.units import format_bytes

DELAY_S = 2.0  # a read shorter than this shows nothing
EVERY_S = 0.25  # at most this often

_stream: Optional[TextIO] = None


def enable(stream: Optional[TextIO]) -> None:
    """Show progress lines on `stream` when it is a terminal (None: never)."""
    global _stream
    _stream = stream if stream is not None and _isatty(stream) else None


def enabled() -> bool:
    """Whether progress lines are shown in this process (what worker processes are told)."""
    return _stream is not None


def in_worker(show: bool) -> None:
    """A worker process's initializer: show progress when the parent does. The worker writes to
    the stderr it inherited, the terminal the parent checked (its own sys.stderr object is new)."""
    global _stream
    _stream = sys.stderr if show else None


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


class Progress:
    """How far through a file of `total` bytes a read is; `update` is cheap when nothing is shown."""

    def __init__(self, path: str, total: int) -> None:
        self.stream = _stream
        self.name = text(os.path.basename(path)[:60])  # a file name is data: one line, no escapes
        self.total = max(1, total)
        self.start = time.monotonic()
        self.next = self.start + DELAY_S
        self.shown = False

    def update(self, done: int) -> None:
        """`done` bytes of the file read so far."""
        if self.stream is None:
            return
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + EVERY_S
        share = min(done, self.total) / self.total
        self.stream.write(f"\rmemdiff: reading {self.name}: {share:4.0%} ({format_bytes(done)} of "
                          f"{format_bytes(self.total)}, {now - self.start:.0f} s)\x1b[K")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        """Clear the line, if one was shown."""
        if self.shown and self.stream is not None:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False
