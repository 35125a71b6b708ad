"""The walk of one device's trace: the running total of requested bytes, event by event, as
PyTorch's viewer counts it (rules 1-4 of engine.py), and the reserved total beside it.
"""


from __future__ import annotations

import bisect
import itertools
import re
from array import array
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from memdiff.errors import InputError, brief, number
from memdiff.read.accel import is_columns
from memdiff.read.load import MAX_BYTES

# Segment events and the sign they change the reserved total by.
SEGMENT_ACTIONS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


# The actions Walk tells apart, as the accelerator's walk numbers them.
_ACTION_CODES = {"alloc": 1, "free_completed": 2, "oom": 3, "annotate": 4, **{a: 5 for a in SEGMENT_ACTIONS}}


def reserved_totals(path: str, device: int, trace: List[Dict[str, Any]], events: Sequence[int], at_dump: Optional[int],
              peak_index: Optional[int], peak: int) -> Tuple[Optional[int], Optional[int]]:
    """(the highest reserved total over the trace, reserved minus allocated at the peak).

    The segments at dump time are exact; walking the trace's segment events back from them gives
    the reserved total before the trace and after every event. (None, None) without segments
    (the profiler route), or when the events and the segments disagree (more freed than held:
    a trace cut at both ends), since no figure could be trusted then."""
    if at_dump is None or (not at_dump and not events):
        return None, None
    steps: List[int] = []
    moved = 0
    for i in events:
        size = trace[i].get("size")
        if size.__class__ is not int or not 0 <= size <= MAX_BYTES:
            raise InputError(path, f"device_traces[{device}][{i}]: 'size' is {brief(size)}, not a segment's bytes")
        moved += size
        if moved > MAX_BYTES:  # the running total must stay inside int64
            raise InputError(path, f"device {device}: segment sizes add up to more than {MAX_BYTES:,} bytes")
        steps.append(SEGMENT_ACTIONS[trace[i]["action"]] * size)
    # The reserved total changes only at segment events (ascending): its running values there,
    # and 0 at the events before the first, are all the totals the trace goes through.
    totals = list(itertools.accumulate(steps))
    if len(trace) and (not events or events[0] > 0):
        totals.append(0)
    start = at_dump - (sum(steps) if len(trace) else 0)
    if start < 0 or (totals and start + min(totals) < 0):
        return None, None
    highest = max(start, start + max(totals) if totals else start)
    if peak_index is not None:
        k = bisect.bisect_right(events, peak_index)
        then = start + (sum(steps[:k]) if k else 0)
    else:
        then = start
    return highest, (then - peak if then >= peak else None)


def _bad_entry(device: int, i: int, entry: Any, exc: Exception) -> str:
    """What is wrong with the trace entry the walk's loop failed on, in the words every other bad
    field of a snapshot gets (its path, the value, what it should be), not Python's own
    (`int too big to convert`, `unhashable type: 'list'`)."""
    where = f"device_traces[{device}][{i}]"
    if not isinstance(entry, dict):
        return f"{where}: {brief(entry)}, not a dict"
    size = entry.get("size")
    if size.__class__ is not int:
        return f"{where}: 'size' is {brief(size)}, not an integer"
    if isinstance(exc, OverflowError):  # an int past int64, which array('q') cannot hold
        return f"{where}.size: {number(size)} is not a size in bytes (0 to {MAX_BYTES:,})"
    addr = entry.get("addr")
    try:
        hash(addr)
    except TypeError:
        return f"{where}.addr: {brief(addr)} is not an address"
    return f"{where}: {exc}"


class Walk:
    """One pass over a device trace: what was opened, closed and never matched.

    Per-event numbers live in array('q'): 8 bytes a slot and no int objects, so a
    million-event trace costs 16 MB here, and numpy reads them without copying.
    """

    def __init__(self, path: str, device: int, trace: List[Dict[str, Any]], reversions: bool = False) -> None:
        n = len(trace)
        self.path, self.device = path, device
        self._accumulated = False  # deltas hold the running totals (running_totals)
        self.open_at_end: Dict[int, int] = {}  # address -> alloc event index
        self.ooms: List[int] = []
        self.annotations: List[int] = []  # `annotate` events: a label attached to a live allocation
        self.segment_events: List[int] = []  # cudaMalloc/cudaFree (or map/unmap) of the allocator's segments
        # Profiler-route re-versions: alloc event -> the alloc it continues (>= 0), or -(f + 1)
        # for an unmatched free f; and free event -> the alloc that continues it.
        self.version_of: Dict[int, int] = {}
        self.continued_by: Dict[int, int] = {}
        if not reversions and is_columns(trace) and self._walk_columns(trace):
            self._check_sizes(path, device, trace)
            return
        self.deltas = deltas = array("q", bytes(8 * n))  # running-total change at each event
        self.closed = closed = array("q", [n]) * n  # alloc event -> its free_completed event (n: never)
        self.allocs = allocs = array("q")  # alloc event indices, ascending
        self.unmatched = unmatched = array("q")  # free_completed events with no open allocation
        last_free = last_closed = -2
        live = self.open_at_end
        open_alloc, close_alloc, add_alloc, add_unmatched = live.__setitem__, live.pop, allocs.append, unmatched.append
        i = -1
        try:
            # The hot loop of memdiff: plain locals, and array('q') itself rejects a size that
            # is not an integer (TypeError), which the handler below turns into a message.
            for e in trace:
                i += 1
                action = e["action"]
                if action == "alloc":
                    # A reused address that is still open leaves the older allocation open for
                    # good, as PyTorch's viewer does.
                    deltas[i] = e["size"]
                    open_alloc(e["addr"], i)
                    add_alloc(i)
                    if last_free == i - 1 and reversions and is_reversion(trace[i - 1], e):
                        self.version_of[i] = last_closed
                        self.continued_by[i - 1] = i
                elif action == "free_completed":
                    j = close_alloc(e["addr"], None)
                    if j is None:
                        deltas[i] = -e["size"]
                        add_unmatched(i)
                        last_closed = -(i + 1)
                    else:
                        closed[j] = i
                        deltas[i] = -deltas[j]
                        last_closed = j
                    last_free = i
                elif action == "oom":
                    self.ooms.append(i)
                elif action == "annotate":
                    self.annotations.append(i)
                elif action in SEGMENT_ACTIONS:
                    self.segment_events.append(i)
        except KeyError as exc:
            raise InputError(path, f"device_traces[{device}][{i}]: missing {exc}") from None
        except (TypeError, AttributeError, OverflowError) as exc:
            raise InputError(path, _bad_entry(device, i, trace[i], exc)) from None
        self._check_sizes(path, device, trace)

    def _walk_columns(self, trace: Any) -> bool:
        """The loop above run by the accelerator over its columns; False when an entry is not
        plain (a missing key, a value of another type), and the loop above says what."""
        n = len(trace)
        self.deltas, self.closed = array("q", [0]) * n, array("q", [n]) * n
        self.allocs, self.unmatched = array("q"), array("q")
        done = trace.walk(_ACTION_CODES, self.deltas, self.closed, self.allocs, self.unmatched)
        if done is None:
            return False
        self.open_at_end, self.ooms, self.annotations, self.segment_events = done
        return True

    def _check_sizes(self, path: str, device: int, trace: List[Dict[str, Any]]) -> None:
        # A negative size would read as memory freed by an allocation: checked once over the
        # arrays rather than in the hot loop above.
        deltas, allocs, unmatched, n = self.deltas, self.allocs, self.unmatched, len(trace)
        if n:
            d = np.frombuffer(deltas, dtype=np.int64)
            opened = np.frombuffer(allocs, dtype=np.int64) if len(allocs) else np.zeros(0, np.int64)
            freed = np.frombuffer(unmatched, dtype=np.int64) if len(unmatched) else np.zeros(0, np.int64)
            negative = np.concatenate([opened[d[opened] < 0], freed[d[freed] > 0]])
            # True is an int to Python (and to array('q')): a size of `true` read as 1 B. Only the
            # events of 0 or 1 byte can be one, so only they are looked at.
            tiny = np.concatenate([opened[np.abs(d[opened]) <= 1], freed[np.abs(d[freed]) <= 1]])
            flag = next((int(k) for k in np.sort(tiny) if isinstance(trace[int(k)]["size"], bool)), None)
            if flag is not None:
                raise InputError(path, f"device_traces[{device}][{flag}]: 'size' is {brief(trace[flag]['size'])}, "
                                       f"not an integer")
            if len(negative):
                k = int(negative.min())
                raise InputError(path, f"device_traces[{device}][{k}].size: {number(trace[k]['size'])} is not a size "
                                       f"in bytes (0 to {MAX_BYTES:,})")

    def running_totals(self) -> np.ndarray:
        """The running total after each event (static memory excluded), computed once in the place
        of the per-event changes (deltas_at still gives them): a second int64 array the length of
        the trace would be 8 more bytes an event at the peak of a big snapshot's read."""
        totals = np.frombuffer(self.deltas, dtype=np.int64) if len(self.deltas) else np.zeros(0, np.int64)
        if not self._accumulated:
            # Sizes that could add up past int64 are no real trace (and would wrap).
            if absolute_sum(totals) > MAX_BYTES:
                raise InputError(self.path, f"device {self.device}: sizes add up to more than {MAX_BYTES:,} bytes: "
                                            "not a real snapshot")
            np.cumsum(totals, out=totals)
            self._accumulated = True
        return totals

    def deltas_at(self, events: np.ndarray) -> np.ndarray:
        """The running total's change at each of `events` (an alloc's size, minus a free's)."""
        values = np.frombuffer(self.deltas, dtype=np.int64) if len(self.deltas) else np.zeros(0, np.int64)
        events = np.asarray(events, dtype=np.int64)
        if not self._accumulated:
            return values[events]
        before = np.where(events > 0, values[np.maximum(events - 1, 0)], 0) if len(events) else events
        return values[events] - before

    def origin(self, j: int) -> Tuple[Optional[int], Optional[int]]:
        """(first version's alloc event, None) of the allocation opened at `j`, or (None, the
        unmatched free) when its first version was live before the trace."""
        while j in self.version_of:
            j = self.version_of[j]
            if j < 0:
                return None, -j - 1
        return j, None

    def end(self, closing: int) -> int:
        """The event that really frees an allocation whose version is closed at `closing` (the
        trace length when it is never freed)."""
        while closing in self.continued_by:
            closing = self.closed[self.continued_by[closing]]
        return closing

    def live_allocs(self, p: int) -> np.ndarray:
        """Indices of the alloc events still open after event `p`."""
        # Zero-copy views: this runs once for the peak and once per phase peak.
        allocs = np.frombuffer(self.allocs, dtype=np.int64)[: bisect.bisect_right(self.allocs, p)]
        return allocs[np.frombuffer(self.closed, dtype=np.int64)[allocs] > p]


# Random draws make a new tensor: a loop that draws a batch (`randint`) at the same line each step
# frees the old one and allocates the new, and the host allocator hands back the same address as
# often as not; that is no new version of the old batch. (Factories that init fills in place,
# `empty` under `uniform_`, do leave versions of one tensor.)
FACTORY_CALL = re.compile(r"^<built-in (?:method|function) (randint|randn|rand|randperm|randint_like|randn_like"
                          r"|rand_like)\b")


def is_reversion(freed: Dict[str, Any], e: Dict[str, Any]) -> bool:
    """Whether alloc `e`, right after the free `freed`, is the profiler route writing a new
    version of the same tensor (an in-place update): same address and size, and no stack or
    the freed version's stack, which is no random draw's."""
    if freed.get("addr") != e["addr"] or freed.get("size") != e["size"]:
        return False
    frames = e.get("frames")
    if not frames:
        return True
    first = frames[0] if isinstance(frames, list) else None
    factory = isinstance(first, dict) and isinstance(first.get("name"), str) and FACTORY_CALL.match(first["name"])
    return frames == freed.get("frames") and not factory


def absolute_sum(deltas: np.ndarray, chunk: int = 1 << 20) -> float:
    """The sum of |deltas| as a float, a million at a time: two float copies of a whole trace
    would be 16 bytes an event of peak memory."""
    return sum(float(np.abs(deltas[k: k + chunk].astype(np.float64)).sum()) for k in range(0, len(deltas), chunk))


@dataclass
class DumpBlock:
    """A block allocated at the dump that the trace never opened: memory older than the trace."""

    size: int
    frames: Optional[List[Any]]
    guess: Optional[str] = None  # the category guessed when it has no frames
    kind: Any = None  # a window's block carried in: what the full trace makes of it (KIND_KEY)
