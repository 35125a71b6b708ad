"""Attributes of torch and the standard library replaced for the emulated run, and put back after it."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence, Tuple

_MISSING = object()


@contextlib.contextmanager
def replaced(changes: Sequence[Tuple[Any, str, Any]]) -> Iterator[None]:
    """For the block, `owner.name` is `value` for each (owner, name, value); after it, what it was. What
    was is read from the owner's own `__dict__` first, so a staticmethod comes back as itself and not as
    the plain function a class attribute reads as; an attribute the owner did not have is removed."""
    saved = [(owner, name, getattr(owner, "__dict__", {}).get(name, getattr(owner, name, _MISSING)))
             for owner, name, _ in changes]
    try:
        for owner, name, value in changes:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is not _MISSING:
                setattr(owner, name, value)
            elif hasattr(owner, name):
                delattr(owner, name)
