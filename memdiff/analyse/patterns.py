"""User regular expressions (category rules, a baseline's site limits), run with a time limit.

A rules file or a baseline comes from the repository being gated and may be careless or
hostile: `(a|a)*c` takes Python's `re` exponential time on a forty-letter label. The `regex`
package matches such patterns without that backtracking and takes a timeout, so one pattern
on one label can cost at most TIMEOUT_S before the run ends in one line, exit 2. The timeout
costs about 3 µs a search, more than the search itself, so memdiff's own rules, which are
reviewed and tested, run without it.
"""

from __future__ import annotations

from typing import Any, Optional

import regex

from memdiff.errors import InputError, shown

TIMEOUT_S = 1.0


class Pattern:
    """A compiled regular expression whose every search is bounded by TIMEOUT_S."""

    def __init__(self, text: str, origin: str, timeout: Optional[float] = TIMEOUT_S) -> None:
        """Compile `text`; ValueError saying why when it is not a regex. `origin` (a file and the
        rule in it) names it when a search takes too long; `timeout=None` is for memdiff's own rules."""
        try:
            self._compiled = regex.compile(text)
        except (regex.error, OverflowError, RecursionError) as exc:
            raise ValueError(f"invalid regex {shown(text)}: {exc}") from None
        self.pattern = text
        self.origin = origin
        self.timeout = timeout

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pattern) and other.pattern == self.pattern

    def __hash__(self) -> int:
        return hash(self.pattern)

    def __repr__(self) -> str:
        return f"Pattern({self.pattern!r})"

    def _bounded(self, method: Any, text: str) -> Optional[Any]:
        if self.timeout is None:
            return method(text)
        try:
            return method(text, timeout=self.timeout)
        except TimeoutError:
            raise InputError(self.origin, f"the regex {shown(self.pattern)} took more than {self.timeout:g} s on a "
                                          f"{len(text):,}-character label: simplify it") from None

    def search(self, text: str) -> Optional[Any]:
        """The first match in `text`, or None."""
        return self._bounded(self._compiled.search, text)

    def fullmatch(self, text: str) -> Optional[Any]:
        """The match of all of `text`, or None."""
        return self._bounded(self._compiled.fullmatch, text)
