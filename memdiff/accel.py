"""The optional compiled reader (memdiff/_fastread.c), when it was built, and the switch that
turns it off: MEMDIFF_PURE=1 reads every file with the pure-Python path, which gives the same
summaries byte for byte (tests run both)."""

from __future__ import annotations

import importlib
import os
from typing import Any, Optional


def _compiled() -> Optional[Any]:
    try:
        return importlib.import_module("memdiff._fastread")
    except ImportError:  # installed without a compiler: the pure path reads everything
        return None


_fastread = _compiled()

# What a device's trace may be: a list of dicts, or the accelerator's columns read as one.
TRACES: Any = (list,) if _fastread is None else (list, _fastread.Trace)


def reader() -> Optional[Any]:
    """The compiled module, or None when it is not built or MEMDIFF_PURE is set."""
    return None if os.environ.get("MEMDIFF_PURE") else _fastread


def is_columns(trace: Any) -> bool:
    """Whether `trace` is the accelerator's columns (not a plain list)."""
    return _fastread is not None and isinstance(trace, _fastread.Trace)
