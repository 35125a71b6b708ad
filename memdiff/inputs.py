"""Any input -> Summary: a snapshot is loaded and normalized, a stored summary is validated and read.

This lets CI keep a few KB of summary JSON instead of a 300 MB pickle and still diff or gate it.
"""

from __future__ import annotations

from typing import Any

from memdiff.errors import InputError
from memdiff.load import decode, to_snapshot
from memdiff.model import SCHEMA_VERSION, Summary
from memdiff.normalize import summarize
from memdiff.schema import validate


def _is_summary(raw: Any) -> bool:
    return isinstance(raw, dict) and "schema_version" in raw and "devices" in raw


def read_summary(path: str) -> Summary:
    """The Summary of `path`, whether it holds a snapshot or a summary written by `memdiff summarize`."""
    raw, source = decode(path)
    if not _is_summary(raw):
        return summarize(to_snapshot(path, raw, source))
    version = raw["schema_version"]
    if version != SCHEMA_VERSION:
        raise InputError(path, f"summary schema_version {version!r} is not one this memdiff reads "
                               f"({SCHEMA_VERSION}); re-create it with `memdiff summarize`")
    return Summary.from_dict(validate(path, raw, "summary"))
