"""history: a device's memory over its whole trace, by category, downsampled for drawing.

The summary's groups say what is live at the peak; the HTML report also draws how memory rose
and fell. Every allocation of the trace is given the category its group would get (the stack
of its first version and its lifetime, classified once per distinct pair), so at every event
the categories add up exactly to the total the peak rules give, and at the peak they are the
summary's categories.

A category's bytes after event `p` are the sizes of its allocations opened at or before `p`
minus those of the ones also freed by then: two sorted prefix sums and a binary search, in
integers, so a million events cost a few numpy calls. For drawing, the trace is cut into at
most POINTS equal windows and each keeps the event with the largest total (the max of its
window), so no peak is lost however far the trace is shrunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, cast

import numpy as np

from memdiff.analyse.classify import Categorizer, Rule
from memdiff.analyse.lifetimes import LIFETIMES, Lifetime
from memdiff.model import Bar, Group, History
from memdiff.read.frames import Stack

POINTS = 800  # windows of a history: about one per pixel of a report's chart
BAR_GROUPS = 12  # groups live at the peak drawn as bars, largest first
BARS_PER_GROUP = 40  # their largest allocations each


@dataclass
class Allocations:
    """Every allocation of one device's trace as the history needs it (built by normalize).

    Arrays are aligned: allocation k holds `size[k]` bytes after events `start[k]` ..
    `end[k] - 1` (memory from before the trace starts at 0), and `kind[k]` indexes `kinds`,
    the (stack of its first version, lifetime code) it is classified by.
    """

    start: np.ndarray
    end: np.ndarray
    size: np.ndarray
    kind: np.ndarray
    kinds: List[Tuple[Stack, int]]


def window_maxima(totals: np.ndarray, points: int) -> np.ndarray:
    """The index of the largest value in each of at most `points` equal windows of `totals`
    (all indices when there are fewer values), ascending; ties take the earliest event."""
    n = len(totals)
    if n <= points:
        return np.arange(n, dtype=np.int64)
    bounds = np.linspace(0, n, points + 1).astype(np.int64)
    return np.array([lo + int(totals[lo:hi].argmax()) for lo, hi in zip(bounds[:-1], bounds[1:])], dtype=np.int64)


def category_codes(allocations: Allocations, rules: Sequence[Rule]) -> Tuple[List[str], np.ndarray]:
    """(category names, each allocation's index into them): each distinct stack and lifetime
    classified once, as its group would be."""
    names: Dict[str, int] = {}
    categorizer = Categorizer(rules)
    by_kind: Dict[Tuple[str, int], int] = {}
    codes = np.empty(len(allocations.kinds), dtype=np.int64)
    for k, (stack, lifetime_code) in enumerate(allocations.kinds):
        key = (stack.signature, lifetime_code)
        if key not in by_kind:
            lifetime: Lifetime = LIFETIMES[lifetime_code]
            group = Group(signature="", site=stack.site, frames=list(stack.frames), count=0, bytes=0,
                          lifetime=lifetime.to_dict())
            by_kind[key] = names.setdefault(categorizer.of(group), len(names))
        codes[k] = by_kind[key]
    return list(names), codes[allocations.kind] if len(allocations.kind) else np.zeros(0, dtype=np.int64)


def live_by_category(allocations: Allocations, categories: np.ndarray, n_categories: int,
                     events: np.ndarray) -> np.ndarray:
    """Bytes live after each of `events` (ascending) per category: an (n_categories, len(events)) array."""
    out = np.zeros((n_categories, len(events)), dtype=np.int64)
    for c in range(n_categories):
        mask = categories == c
        size = allocations.size[mask]
        for sign, at in ((1, allocations.start[mask]), (-1, allocations.end[mask])):
            order = np.argsort(at, kind="stable")
            prefix = np.concatenate(([0], np.cumsum(size[order])))
            out[c] += sign * prefix[np.searchsorted(at[order], events, side="right")]
    return out


def history_of(allocations: Allocations, totals: np.ndarray, time_of: Callable[[int], Optional[int]],
               rules: Sequence[Rule], bars: List[Bar], points: int = POINTS) -> History:
    """The History of one device: `totals` are the bytes live after each event (static
    included), `time_of(event)` its time_us if it has one."""
    events = window_maxima(totals, points)
    names, categories = category_codes(allocations, rules)
    live = live_by_category(allocations, categories, len(names), events)
    if not np.array_equal(live.sum(axis=0), totals[events]):
        raise AssertionError("the history's categories do not add up to the totals (a memdiff bug)")
    peak = int(totals.argmax()) if len(totals) else 0
    at_peak = live_by_category(allocations, categories, len(names), np.array([peak], dtype=np.int64))[:, 0]
    order = sorted(range(len(names)), key=lambda c: (-int(at_peak[c]), names[c]))
    times = [time_of(i) for i in events.tolist()]
    return History(events=events.tolist(), totals=totals[events].tolist(),
                   categories={names[c]: live[c].tolist() for c in order},
                   time_us=None if None in times else cast(List[int], times), bars=bars)


def peak_bars(groups: Sequence[Tuple[str, List[Tuple[int, int, int]]]]) -> List[Bar]:
    """Bars of the largest groups live at the peak: `groups` are (signature, [(start, end,
    bytes) of each allocation]) largest group first; each keeps its largest allocations."""
    bars: List[Bar] = []
    for signature, spans in groups[:BAR_GROUPS]:
        for start, end, size in sorted(spans, key=lambda s: (-s[2], s[0]))[:BARS_PER_GROUP]:
            bars.append(Bar(signature, start, end, size))
    return bars
