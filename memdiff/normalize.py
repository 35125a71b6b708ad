"""normalize: Snapshot -> Summary, with the peak counted as PyTorch's Active Memory Timeline counts it.

Rules (../shared/docs/snapshot-format.md, "The peak"):
1. Walk one device's trace in order; `alloc` opens an allocation at its address and
   `free_completed` closes the open one there. `free_requested` alone changes nothing.
2. Static memory, live from the start: a `free_completed` with no open allocation (its alloc
   fell out of the ring buffer), and `active_allocated` blocks at dump time with no open
   allocation at their address after the walk (`requested_size` bytes).
3. Requested bytes throughout. 4. The peak is the largest running total.

Every byte live at the peak lands in exactly one group, so groups add up to the peak.
"""

from __future__ import annotations

import bisect
from array import array
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from memdiff import __version__
from memdiff.errors import InputError
from memdiff.frames import Stack, StackNormalizer, relativize
from memdiff.load import Snapshot
from memdiff.model import DeviceSummary, Group, OomEvent, Summary, largest_first

TIMELINE_POINTS = 100

# (raw frames, bytes, is a free's stack, live before the trace, the alloc entry when in the trace)
_LiveItem = Tuple[Optional[List[Any]], int, bool, bool, Optional[Dict[str, Any]]]
# compile_context values that mean "not compiled"
NO_COMPILE_CONTEXT = ("", "N/A", None)


class _Walk:
    """One pass over a device trace: what was opened, closed and never matched.

    Per-event numbers live in array('q'): 8 bytes a slot and no int objects, so a
    million-event trace costs 16 MB here, and numpy reads them without copying.
    """

    def __init__(self, path: str, device: int, trace: List[Dict[str, Any]]) -> None:
        n = len(trace)
        self.deltas = deltas = array("q", bytes(8 * n))  # running-total change at each event
        self.closed = closed = array("q", [n]) * n  # alloc event -> its free_completed event (n: never)
        self.allocs = allocs = array("q")  # alloc event indices, ascending
        self.unmatched = unmatched = array("q")  # free_completed events with no open allocation
        self.open_at_end: Dict[int, int] = {}  # address -> alloc event index
        self.ooms: List[int] = []
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
                elif action == "free_completed":
                    j = close_alloc(e["addr"], None)
                    if j is None:
                        deltas[i] = -e["size"]
                        add_unmatched(i)
                    else:
                        closed[j] = i
                        deltas[i] = -deltas[j]
                elif action == "oom":
                    self.ooms.append(i)
        except KeyError as exc:
            raise InputError(path, f"device_traces[{device}][{i}]: missing {exc}") from None
        except (TypeError, AttributeError, OverflowError) as exc:
            size = trace[i].get("size") if isinstance(trace[i], dict) else None
            if isinstance(trace[i], dict) and (size.__class__ is not int):
                exc = TypeError(f"'size' is {type(size).__name__} {size!r:.40}, not an integer")
            raise InputError(path, f"device_traces[{device}][{i}]: {exc}") from None

    def live_allocs(self, p: int) -> np.ndarray:
        """Indices of the alloc events still open after event `p`."""
        allocs = np.array(self.allocs, dtype=np.int64)[: bisect.bisect_right(self.allocs, p)]
        return allocs[np.array(self.closed, dtype=np.int64)[allocs] > p]


def _dump_blocks(segments: List[Dict[str, Any]]) -> Iterator[Tuple[int, int, Optional[List[Any]]]]:
    """(address, requested bytes, frames) of each active_allocated block at dump time."""
    for seg in segments:
        addr = seg["address"]
        for block in seg.get("blocks", []):
            # torch 2.0 blocks have no address: they follow each other from the segment's start.
            addr = block.get("address", addr)
            if block["state"] == "active_allocated":
                frames = block.get("frames")
                history = block.get("history")
                if not frames and history:
                    frames = history[-1].get("frames")
                yield addr, block.get("requested_size", block["size"]), frames
            addr += block["size"]


def _timeline(static: int, running: np.ndarray) -> List[List[int]]:
    """At most TIMELINE_POINTS [event index, allocated bytes] points, each the max of its window."""
    n = len(running)
    if n == 0:
        return []
    totals = running + static
    if n <= TIMELINE_POINTS:
        return [[i, int(v)] for i, v in enumerate(totals)]
    points = []
    for window in np.array_split(np.arange(n), TIMELINE_POINTS):
        k = int(window[0] + totals[window[0]: window[-1] + 1].argmax())
        points.append([k, int(totals[k])])
    return points


def _device_summary(snapshot: Snapshot, device: int, stacks: StackNormalizer) -> DeviceSummary:
    path = snapshot.path
    traces = snapshot.device_traces
    trace = traces[device] if device < len(traces) else []
    segments = [s for s in snapshot.segments if s["device"] == device]
    walk = _Walk(path, device, trace)

    live_items: List[_LiveItem] = []
    unmatched_bytes = -sum(walk.deltas[i] for i in walk.unmatched)
    static = unmatched_bytes
    dump_only = [(size, frames) for addr, size, frames in _dump_blocks(segments)
                 if addr not in walk.open_at_end]
    static += sum(size for size, _ in dump_only)

    running = np.cumsum(np.frombuffer(walk.deltas, dtype=np.int64) if len(trace) else np.zeros(0, np.int64))
    peak_index: Optional[int] = None
    peak = static
    if len(running):
        k = int(running.argmax())
        if running[k] > 0:
            peak_index, peak = k, static + int(running[k])

    p = -1 if peak_index is None else peak_index
    n = len(trace)
    for j in walk.live_allocs(p).tolist():
        e = trace[j]
        live_items.append((e.get("frames"), e["size"], False, False, e))
    for i in walk.unmatched[bisect.bisect_right(walk.unmatched, p):]:
        e = trace[i]
        live_items.append((e.get("frames"), e["size"], True, True, None))
    live_items.extend((frames, size, False, True, None) for size, frames in dump_only)

    groups = _group(path, live_items, stacks)
    if sum(g.bytes for g in groups) != peak:
        raise AssertionError(f"{path}: device {device}: groups do not add up to the peak (a memdiff bug)")

    peak_event = trace[peak_index] if peak_index is not None else None
    scopes = Scopes(snapshot.external_annotations, device)
    by_scope: Dict[str, int] = {}
    by_context: Dict[str, int] = {}
    for _, size, _, _, e in live_items:
        if e is None:
            continue
        scope = scopes.innermost(e.get("time_us"))
        if scope is not None:
            by_scope[scope] = by_scope.get(scope, 0) + size
        context = e.get("compile_context")
        if context not in NO_COMPILE_CONTEXT:
            by_context[str(context)] = by_context.get(str(context), 0) + size
    times = [trace[0].get("time_us"), trace[-1].get("time_us")] if trace else [None, None]
    allocated = (sum(s["allocated_size"] for s in segments) if all("allocated_size" in s for s in segments)
                 else sum(b["size"] for s in segments for b in s.get("blocks", [])
                          if b["state"] == "active_allocated"))
    return DeviceSummary(
        device=device,
        trace_events=n,
        static_bytes=static,
        peak_bytes=peak,
        peak_event_index=peak_index,
        peak_time_us=peak_event.get("time_us") if peak_event else None,
        peak_event_signature=(stacks.stack(peak_event.get("frames")).signature if peak_event else None),
        trace_start_time_us=times[0],
        trace_end_time_us=times[1],
        allocated_bytes_at_dump=allocated,
        reserved_bytes_at_dump=sum(s["total_size"] for s in segments),
        unmatched_free_count=len(walk.unmatched),
        unmatched_free_bytes=unmatched_bytes,
        oom_events=[OomEvent(event_index=i, requested_bytes=trace[i].get("size", 0),
                             device_free_bytes=trace[i].get("device_free"),
                             time_us=trace[i].get("time_us")) for i in walk.ooms],
        timeline=_timeline(static, running),
        groups=groups,
        scope_at_peak=scopes.innermost(peak_event.get("time_us")) if peak_event else None,
        bytes_by_scope=largest_first(by_scope),
        bytes_by_compile_context=largest_first(by_context),
    )


class Scopes:
    """`record_function` scopes of one device (external_annotations), for looking up by time."""

    def __init__(self, annotations: List[Dict[str, Any]], device: int) -> None:
        opened: Dict[str, List[int]] = {}
        intervals: List[Tuple[int, float, str]] = []
        for a in sorted((a for a in annotations if isinstance(a, dict) and a.get("device", device) == device
                         and isinstance(a.get("time_us"), int)), key=lambda a: a["time_us"]):
            name = str(a.get("name", ""))
            if a.get("stage") == "START":
                opened.setdefault(name, []).append(a["time_us"])
            elif a.get("stage") == "END" and opened.get(name):
                intervals.append((opened[name].pop(), a["time_us"], name))
        # A scope still open at the dump lasts to the end.
        intervals += [(start, float("inf"), name) for name, starts in opened.items() for start in starts]
        intervals.sort()
        self._intervals = intervals
        self._starts = [start for start, _, _ in intervals]

    def innermost(self, time_us: Optional[int]) -> Optional[str]:
        """The most recently opened scope still open at `time_us`, if any."""
        if time_us is None:
            return None
        for start, end, name in reversed(self._intervals[: bisect.bisect_right(self._starts, time_us)]):
            if end >= time_us:
                return name
        return None


def _group(path: str, items: List[_LiveItem], stacks: StackNormalizer) -> List[Group]:
    by_signature: Dict[str, List[Any]] = {}
    for frames, size, freed, before_trace, _ in items:
        try:
            stack: Stack = stacks.stack(frames, freed=freed, before_trace=before_trace)
        except ValueError as exc:
            raise InputError(path, str(exc)) from None
        slot = by_signature.get(stack.signature)
        if slot is None:
            by_signature[stack.signature] = [stack, 1, size]
        else:
            slot[1] += 1
            slot[2] += size
    ordered = sorted(by_signature.values(), key=lambda s: (-s[2], s[0].signature))
    return [Group(signature=s.signature, site=s.site, frames=list(s.frames), count=c, bytes=b)
            for s, c, b in ordered]


def devices_of(snapshot: Snapshot) -> List[int]:
    """Devices with a non-empty trace or at least one segment, ascending."""
    found = {i for i, t in enumerate(snapshot.device_traces) if t}
    found.update(s["device"] for s in snapshot.segments)
    return sorted(found)


def summarize(snapshot: Snapshot) -> Summary:
    """The Summary of every device in the snapshot."""
    stacks = StackNormalizer()
    devices = [_device_summary(snapshot, d, stacks) for d in devices_of(snapshot)]
    all_groups = [g for d in devices for g in d.groups]
    for group, frames in zip(all_groups, relativize([g.frames for g in all_groups])):
        group.frames = frames
    return Summary(source=snapshot.source, devices=devices, tool=f"memdiff {__version__}")
