"""Duplicate keys in a user's JSON: Python's decoder keeps the last of two silently, so a baseline
with `"fail-over"` twice gated with whichever came last, and a reviewer reading the first saw
another rule. parse_json (read/load.py) decodes every JSON input with `unique_object` as its
object hook; a duplicate raises DuplicateKey, and `duplicate_path` then finds where it is.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple, Union


class DuplicateKey(ValueError):
    """An object of the document names a key twice."""


def unique_object(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    """The object of `pairs` (json's object_pairs_hook); DuplicateKey when a key comes twice."""
    doc = dict(pairs)
    if len(doc) != len(pairs):  # a dict as long as the pairs had no key twice: the common case costs one len()
        raise DuplicateKey()
    return doc


class _Mark:
    """Where the first duplicate key is: the key path from the object it is found in."""

    def __init__(self, path: List[Union[str, int]]) -> None:
        self.path = path


def duplicate_path(data: Union[str, bytes]) -> Optional[List[Union[str, int]]]:
    """The JSON path of the first duplicate key of `data` (a document unique_object refused), the key
    last: decoded again, each object hands its parent a mark of where the duplicate is. None when
    it cannot be found (a document nested past Python's recursion limit)."""
    try:
        mark = _mark_in(json.loads(data, object_pairs_hook=_marking))
    except RecursionError:
        return None
    return None if mark is None else mark.path


def _marking(pairs: List[Tuple[str, Any]]) -> Union[Dict[str, Any], _Mark]:
    seen = set()
    for key, value in pairs:
        inner = _mark_in(value)
        if inner is not None:
            return _Mark([key, *inner.path])
        if key in seen:
            return _Mark([key])
        seen.add(key)
    return {}  # this object's content does not matter any more: only where the duplicate is


def _mark_in(value: Any) -> Optional[_Mark]:
    if isinstance(value, _Mark):
        return value
    if isinstance(value, list):
        for i, item in enumerate(value):
            inner = _mark_in(item)
            if inner is not None:
                return _Mark([i, *inner.path])
    return None
