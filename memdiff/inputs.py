"""Any input -> Summary: a snapshot is loaded and normalized, a stored summary is validated and read.

This lets CI keep a few KB of summary JSON instead of a 300 MB pickle and still diff or gate it.
"""

from __future__ import annotations

from typing import Any, Sequence

from memdiff.classify import Rule, classify
from memdiff.errors import InputError
from memdiff.load import decode, to_snapshot
from memdiff.model import SCHEMA_VERSION, Summary
from memdiff.normalize import summarize
from memdiff.schema import validate


def _is_summary(raw: Any) -> bool:
    return isinstance(raw, dict) and "schema_version" in raw and "devices" in raw


def read_summary(path: str, rules: Sequence[Rule]) -> Summary:
    """The classified Summary of `path`, a snapshot or a summary written by `memdiff summarize`.

    A stored summary is classified again, so `--rules` applies to it as to a snapshot.
    """
    raw, source = decode(path)
    if not _is_summary(raw):
        return classify(summarize(to_snapshot(path, raw, source)), rules)
    version = raw["schema_version"]
    if version != SCHEMA_VERSION:
        raise InputError(path, f"summary schema_version {version!r} is not one this memdiff reads "
                               f"({SCHEMA_VERSION}); re-create it with `memdiff summarize`")
    return classify(Summary.from_dict(validate(path, raw, "summary")), rules)
