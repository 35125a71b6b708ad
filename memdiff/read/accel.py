"""The optional compiled reader (memdiff/read/_fastread.c), when it was built, and the switch that
turns it off: MEMDIFF_PURE=1 reads every file with the pure-Python path, which gives the same
summaries byte for byte (tests run both)."""

from __future__ import annotations

import importlib
import os
from typing import Any, Dict, Hashable, List, Optional

import numpy as np


def _compiled() -> Optional[Any]:
    try:
        return importlib.import_module("memdiff.read._fastread")
    except ImportError:  # installed without a compiler: the pure path reads everything
        return None


_fastread = _compiled()

# What a device's trace may be: a list of dicts, or the accelerator's columns read as one.
TRACES: Any = (list,) if _fastread is None else (list, _fastread.Trace)


def reader() -> Optional[Any]:
    """The compiled module, or None when it is not built or MEMDIFF_PURE is set."""
    return None if os.environ.get("MEMDIFF_PURE") else _fastread


def identities(items: List[Any]) -> Hashable:
    """A key equal for two lists exactly when they hold the same objects in the same order (while
    those objects live): the items' addresses as bytes from the accelerator, one int per item
    from the pure path."""
    fast = reader()
    return fast.identities(items) if fast is not None else tuple(map(id, items))


def is_columns(trace: Any) -> bool:
    """Whether `trace` is the accelerator's columns (not a plain list)."""
    return _fastread is not None and isinstance(trace, _fastread.Trace)


class ObjectCodes:
    """Codes for the values one key takes at chosen events of a trace, read from the columns when
    the trace is the accelerator's and entry by entry when it is a list: equal codes are one
    object. Decisions are made once per distinct object (`objects`), by value, so both paths decide
    alike (the columns share one object among equal strings and ints where a list may hold two)."""

    def __init__(self, trace: Any, key: str) -> None:
        self._trace, self._key = trace, key
        self._table = trace.table() if is_columns(trace) else None
        self.objects: List[Any] = []
        self._code: Dict[int, int] = {}  # id(object) -> its code; objects keeps each alive
        # table id -> code (-1: not met yet); the table is complete once the trace is read
        self._by_id = np.full(0 if self._table is None else len(self._table), -1, dtype=np.int64)

    def _of(self, value: Any) -> int:
        code = self._code.get(id(value))
        if code is None:
            code = self._code[id(value)] = len(self.objects)
            self.objects.append(value)
        return code

    def at(self, events: np.ndarray) -> np.ndarray:
        """The code of each event's value (the code of None where the entry has no such key)."""
        events = np.ascontiguousarray(events, dtype=np.int64)
        trace, key = self._trace, self._key
        if self._table is None:
            return np.fromiter((self._of(trace[i].get(key)) for i in events.tolist()), np.int64, len(events))
        ids = np.frombuffer(trace.codes(key, events.tobytes()), dtype=np.int64)
        known = ids >= 0
        held = ids[known]
        for t in np.unique(held[self._by_id[held] < 0]).tolist():
            self._by_id[t] = self._of(self._table[t])
        out = np.full(len(ids), -1, dtype=np.int64)
        out[known] = self._by_id[held]
        for j in np.flatnonzero(~known).tolist():  # rows the columns do not hold: the entry says
            out[j] = self._of(trace[int(events[j])].get(key))
        return out
