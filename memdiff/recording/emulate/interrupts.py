"""Ctrl-C (SIGINT, and SIGTERM and SIGHUP where memdiff makes them stop a run as it) that comes while
the emulator frees a tensor's memory, held until the script's next op.

A storage the script drops is freed in a `weakref.finalize` callback (runtime.Emulator._storage_freed):
Python code of memdiff's, run where a GPU frees in C++. Python ignores an exception raised in such a
callback ("Exception ignored in: <finalize object ...>"), so a KeyboardInterrupt that lands there was lost:
the run went on as if Ctrl-C had never come (lucidrains' MEGABYTE-pytorch `train.py`, stopped by
`timeout -s INT`, trained on until killed, its snapshot unwritten), and the free it cut short was half
done. A signal whose handler is called inside such a callback of memdiff's is held and handled at the
next op the script runs on the emulated device, where it stops the script as on a GPU, the free done.
"""

from __future__ import annotations

import contextlib
import os
import signal
import weakref
from types import FrameType
from typing import Any, Callable, Iterator, List, Optional, Tuple

# Signals held in a finalizer of memdiff's, with the handler each would have run: handled by deliver().
PENDING: List[Tuple[Callable[..., Any], int]] = []
_FINALIZE = weakref.finalize.__call__.__code__
_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _nested(function: Any, name: str) -> Optional[Any]:
    """The code of the function `name` defined inside `function` (a weak dictionary's `remove`)."""
    return next((c for c in function.__code__.co_consts if getattr(c, "co_name", None) == name), None)


def _weak_removals() -> frozenset:
    """The codes of the weak dictionaries' key-removal callbacks, which CPython calls as a tensor dies and
    whose exceptions it ignores: torch's WeakIdKeyDictionary (autograd's and the emulator's tables of
    tensors), and the standard library's. Freeing an emulated tensor runs them far more often than a
    GPU's run does: a Ctrl-C landing there was dropped ("Exception ignored in: <function
    WeakIdKeyDictionary.__init__.<locals>.remove>") and the script trained on (1 Lightning run in 5)."""
    owners = [weakref.WeakKeyDictionary.__init__, weakref.WeakValueDictionary.__init__]
    try:
        from torch.utils.weak import WeakIdKeyDictionary

        owners.append(WeakIdKeyDictionary.__init__)
    except ImportError:
        pass
    return frozenset(c for c in (_nested(f, "remove") for f in owners) if c is not None)


_REMOVALS = _weak_removals()


def _in_our_finalizer(frame: Optional[FrameType]) -> bool:
    """Whether `frame` runs inside a weakref.finalize callback of the emulator's (a storage freed), or
    a weak dictionary's removal of a dead key (_weak_removals)."""
    inner_ours = False
    while frame is not None:
        if frame.f_code in _REMOVALS:
            return True
        if frame.f_code is _FINALIZE:
            info = frame.f_locals.get("info")
            func = getattr(info, "func", None)
            return inner_ours or os.path.abspath(getattr(getattr(func, "__code__", None), "co_filename", "")) \
                .startswith(_OURS)
        inner_ours = inner_ours or os.path.abspath(frame.f_code.co_filename).startswith(_OURS)
        frame = frame.f_back
    return False


def _deferring(handler: Callable[..., Any]) -> Callable[..., Any]:
    def handle(signum: int, frame: Optional[FrameType]) -> Any:
        if _in_our_finalizer(frame):
            PENDING.append((handler, signum))
            return None
        return handler(signum, frame)
    return handle


@contextlib.contextmanager
def held_in_finalizers(signals: Tuple[int, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """For the block, each of `signals` whose handler is Python's (Ctrl-C's KeyboardInterrupt, memdiff's
    Stopped) is held when it comes inside a finalizer of the emulator's, until deliver(). Off the main
    thread, where no handler can be set, nothing changes."""
    previous = {}
    try:
        for s in signals:
            handler = signal.getsignal(s)
            if callable(handler):
                previous[s] = signal.signal(s, _deferring(handler))
    except ValueError:  # not the main thread
        pass
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        PENDING.clear()


def deliver() -> None:
    """Handle a signal held in a finalizer (held_in_finalizers) now, in the script's op: Ctrl-C raises
    KeyboardInterrupt there, as on a GPU, where the free is C++'s and the signal reaches the script."""
    if PENDING:
        handler, signum = PENDING[0]
        PENDING.clear()
        handler(signum, None)
