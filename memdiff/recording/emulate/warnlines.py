"""Warnings under emulation name the script's line, as they do on the GPU.

The emulator's modes call every torch function and op the script calls, so a warning torch raises
for the caller (C++'s TORCH_WARN, which names the innermost Python frame; a Python function's
`warnings.warn(..., stacklevel=2)`) named the emulator's own line instead:
`memdiff/recording/emulate/modes.py:214: UserWarning: Sparse invariant checks are implicitly
disabled`, where the same script without emulation prints `train.py:3: UserWarning: ...`. While the
emulator runs, a warning shown at one of its lines is shown at the line that called torch: outward
from the emulator's frame, past the dispatch machinery (torch/overrides.py, torch/_ops.py,
torch/utils/_python_dispatch.py) and, when the call came through `handle_torch_function`, the
torch function that handed it over.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from types import FrameType
from typing import Any, Iterator, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Frames between the script's call and the emulator's mode: torch's dispatch to a mode.
DISPATCH = tuple(os.sep.join(("torch", *parts)) for parts in
                 (("overrides.py",), ("_ops.py",), ("utils", "_python_dispatch.py")))
OVERRIDES = os.sep.join(("torch", "overrides.py"))


def _caller(filename: str, lineno: int) -> Optional[Tuple[str, int]]:
    """The line that called torch, for a warning shown at the emulator's `filename:lineno`."""
    frame: Optional[FrameType] = sys._getframe(2)
    while frame is not None and not (frame.f_code.co_filename == filename and frame.f_lineno == lineno):
        frame = frame.f_back
    handed_over = False
    while frame is not None and (frame.f_code.co_filename.startswith(HERE)
                                 or frame.f_code.co_filename.endswith(DISPATCH)):
        handed_over = handed_over or frame.f_code.co_filename.endswith(OVERRIDES)
        frame = frame.f_back
    if frame is not None and handed_over:  # the torch function that handed the call to the mode
        frame = frame.f_back
    if frame is None:
        return None
    return frame.f_code.co_filename, frame.f_lineno


@contextlib.contextmanager
def at_the_script() -> Iterator[None]:
    """For the block: a warning shown at the emulator's line is shown at the script's."""
    real = warnings.showwarning

    def shown(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
              line: Optional[str] = None) -> None:
        if filename.startswith(HERE):
            found = _caller(filename, lineno)
            if found is not None:
                filename, lineno = found
                line = None  # read from the script's file, as warnings does
        real(message, category, filename, lineno, file, line)
    warnings.showwarning = shown
    try:
        yield
    finally:
        if warnings.showwarning is shown:
            warnings.showwarning = real
