"""Errors that reach a person: each carries the file it concerns and one line saying what is wrong."""

from __future__ import annotations


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
