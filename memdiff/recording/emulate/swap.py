"""Attributes of torch and the standard library, and environment variables, replaced for the emulated
run, and put back after it."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Mapping, Optional, Sequence, Tuple

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


@contextlib.contextmanager
def environment(changes: Mapping[str, Optional[str]]) -> Iterator[None]:
    """For the block, each environment variable of `changes` is its value (None: unset); after it,
    what it was (unset where it was not set)."""
    saved = {name: os.environ.get(name) for name in changes}
    try:
        for name, value in changes.items():
            _put(name, value)
        yield
    finally:
        for name, value in saved.items():
            _put(name, value)


def _put(name: str, value: Optional[str]) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
