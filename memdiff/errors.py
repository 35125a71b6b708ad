"""Errors that reach a person: each carries the file it concerns and one line saying what is wrong."""

from __future__ import annotations

from typing import Any

# Exit codes, the same for every command.
EXIT_OK, EXIT_REGRESSION, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


class InputError(Exception):
    """Bad input (file or usage). The CLI prints `memdiff: FILE: MESSAGE` and exits 2."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message

    def __reduce__(self):  # raised in a worker process, re-raised in the parent
        return (self.__class__, (self.path, self.message))


def number(value: int) -> str:
    """An integer from a file as an error shows it: with thousands separators, or by its size
    when it is too long to print (str() of a 4,300-digit integer raises ValueError)."""
    return f"{value:,}" if value.bit_length() <= 128 else f"an integer of {value.bit_length():,} bits"


def version_shown(value: Any) -> str:
    """A version field from a file as an error quotes it: the number, or only the type of anything
    else (a baseline can be a link to any file: a string there may be a secret)."""
    return number(value) if isinstance(value, int) and not isinstance(value, bool) else \
        f"of type {type(value).__name__}"


def clip(text: str, chars: int = 60) -> str:
    """Text from a file (a key, a name) as an error shows it: cut after `chars` characters."""
    return text if len(text) <= chars else text[:chars] + "..."


def shown(value: Any) -> str:
    """A value from a file as an error quotes it: its repr when that is short (`99`, `'2'`), else
    brief(value)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return number(value)
    if (isinstance(value, str) and len(value) <= 40) or isinstance(value, (bool, float)) or value is None:
        return repr(value)
    return brief(value)


def brief(value: Any, chars: int = 40) -> str:
    """A value from a file as one line of an error shows it: its type and a bounded prefix.

    Never the repr of a whole container: through pickle memo references a 1 MB file can hold a
    list whose repr is gigabytes, or one nested past the recursion limit."""
    kind = type(value).__name__
    if isinstance(value, (str, bytes)):
        return f"{kind} {value[:chars]!r}" + ("..." if len(value) > chars else "")
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return f"{kind} {value!r}"
    if isinstance(value, int):
        return f"{kind} {value}" if value.bit_length() <= 64 else f"{kind} of {value.bit_length():,} bits"
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return f"{kind} of {len(value):,} item{'' if len(value) == 1 else 's'}"
    return kind
