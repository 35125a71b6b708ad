"""window: one stretch of a snapshot's trace (some steps, events or microseconds) as a snapshot of its own.

A window keeps the trace entries inside it and carries in, as blocks allocated at its "dump",
what was live at its start and is not freed inside it; what was live at its start and is freed
inside it needs nothing, since a free whose allocation the trace never saw counts as memory
live from the start (../shared/docs/snapshot-format.md, "The peak"). So the window's static
memory is what was live when it began, and its peak is the highest the full trace reached in
it, both as PyTorch's viewer counts them. `memdiff slice` writes a window to a file; every
analysing command's --steps/--events/--time-us reads one in place.

Step numbers are the full trace's when steps come from `ProfilerStep#N` scopes; steps found from
the stacks are numbered from 0 within whatever trace is read, so a slice's own are renumbered.
"""

from __future__ import annotations

import argparse
import bisect
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

from memdiff.analyse.lifetimes import Scopes, build_timeline
from memdiff.analyse.normalize.engine import devices_of
from memdiff.analyse.normalize.kinds import window_kinds
from memdiff.analyse.normalize.standins import dump_only_blocks
from memdiff.analyse.normalize.walk import Walk
from memdiff.compare.observe import TRACE_BOOKKEEPING
from memdiff.errors import InputError
from memdiff.model import KIND_KEY, WINDOW_KEY, Source
from memdiff.numbers import whole_number
from memdiff.read.load import Snapshot, to_snapshot

KINDS = ("steps", "events", "time_us")
FLAGS = {"steps": "--steps", "events": "--events", "time_us": "--time-us"}
ALIGN = 512  # PyTorch's allocator rounds blocks to 512 bytes; stand-in addresses keep to it


@dataclass(frozen=True)
class Window:
    """A half-open range [start, end) of steps (their numbers), event indices or `time_us`;
    None on either side: open there."""

    kind: str
    start: Optional[int]
    end: Optional[int]

    def describe(self) -> str:
        """`--steps 3:4` as the command line gives it."""
        return f"{FLAGS[self.kind]} {'' if self.start is None else self.start}:{'' if self.end is None else self.end}"

    def contains(self, value: int) -> bool:
        """Whether `value` (a step number, an event index, a time) lies inside."""
        return (self.start is None or value >= self.start) and (self.end is None or value < self.end)


def parse_window(kind: str, text: str) -> Window:
    """`3:5`, `3:`, `:5` or `3` (that one alone: 3:4) as a Window; ValueError saying why not."""
    start_text, sep, end_text = text.partition(":")
    try:
        start = whole_number(start_text) if start_text.strip() else None
        end = whole_number(end_text) if end_text.strip() else None
    except ValueError:
        raise ValueError(f"{text!r} is not START:END (whole numbers, either may be left out)") from None
    if not sep:
        if start is None:
            raise ValueError("an empty window")
        end = start + 1
    if (start is not None and start < 0) or (end is not None and end < 0):
        raise ValueError(f"{text!r}: negative bounds mean nothing here")
    if start is not None and end is not None and end <= start:
        raise ValueError(f"{text!r} is empty: END must be past START (END is not included)")
    return Window(kind, start, end)


def _arg_type(kind: str) -> Any:
    def parse(text: str) -> Window:
        try:
            return parse_window(kind, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def add_window_arguments(p: argparse.ArgumentParser, required: bool = False) -> None:
    """--steps, --events and --time-us: read only that window of each snapshot (one of them)."""
    group = p.add_mutually_exclusive_group(required=required)
    group.add_argument("--steps", dest="window", type=_arg_type("steps"), metavar="START:END",
                       help="only steps START to END-1 of each snapshot (`3` alone: step 3), memory live when "
                            "they begin counted from their start")
    group.add_argument("--events", dest="window", type=_arg_type("events"), metavar="START:END",
                       help="only trace events START to END-1 of each device")
    group.add_argument("--time-us", dest="window", type=_arg_type("time_us"), metavar="START:END",
                       help="only trace events whose time_us is in START to END-1 (microseconds since the epoch)")


def _event_range(path: str, device: int, trace: List[Dict[str, Any]], walk: Walk, window: Window,
                 annotations: List[Any], seen: Set[int]) -> Optional[Tuple[int, int]]:
    """[a, b) of the device's events inside the window; None when it holds none of them (a window
    past the trace's end or before its first time is no window of it: carrying in what is live
    there would make up a trace that never was). The step numbers it has are added to `seen`."""
    n = len(trace)
    if window.kind == "events":
        a = min(n, window.start or 0)
        b = min(n, n if window.end is None else window.end)
        return (a, b) if a < b else None
    if window.kind == "time_us":
        found = [e.get("time_us") for e in trace]
        times: List[int] = [t for t in found if isinstance(t, int) and not isinstance(t, bool)]
        if len(times) != n:
            raise InputError(path, f"device {device}: --time-us needs every trace entry to carry time_us")
        if any(later < earlier for earlier, later in zip(times, times[1:])):
            raise InputError(path, f"device {device}: trace times go backwards; cut by --events instead")
        a = 0 if window.start is None else bisect.bisect_left(times, window.start)
        b = n if window.end is None else bisect.bisect_left(times, window.end)
        return (a, b) if a < b else None
    running = walk.running_totals()
    timeline = build_timeline(trace, walk.allocs, running, 0, Scopes(annotations, device), walk.version_of)
    seen.update(s.step for s in timeline.steps)
    inside = [s for s in timeline.steps if window.contains(s.step)]
    if not inside:
        return None
    return min(s.start_event for s in inside), max(s.end_event for s in inside) + 1


def _block(addr: int, size: int, frames: Any, kind: Dict[str, Any]) -> Dict[str, Any]:
    block: Dict[str, Any] = {"address": addr, "size": size, "requested_size": size, "state": "active_allocated",
                             KIND_KEY: kind}
    if isinstance(frames, list) and frames:
        block["frames"] = frames
    return block


def _carried(snapshot: Snapshot, device: int, trace: List[Dict[str, Any]], walk: Walk, a: int, b: int
             ) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """(the window's trace entries, blocks for what is live when the window begins and still live
    when it ends). The blocks: allocations opened before it and freed after it (or never), memory
    older than the trace freed after it, and the dump's blocks that the trace never opened. Every
    block, every allocation inside and every free inside of memory allocated before it carries
    what the full trace makes of that memory (KIND_KEY), so it keeps its category there."""
    allocs = np.frombuffer(walk.allocs, dtype=np.int64) if len(walk.allocs) else np.zeros(0, np.int64)
    closed = np.frombuffer(walk.closed, dtype=np.int64) if len(trace) else np.zeros(0, np.int64)
    unmatched = np.frombuffer(walk.unmatched, dtype=np.int64) if len(walk.unmatched) else np.zeros(0, np.int64)
    before = allocs[: bisect.bisect_left(walk.allocs, a)]
    carried = before[closed[before] >= b]
    freed_inside = before[(closed[before] >= a) & (closed[before] < b)]  # each freed by an event of the window
    inside = allocs[bisect.bisect_left(walk.allocs, a): bisect.bisect_left(walk.allocs, b)]
    unmatched_inside = unmatched[(unmatched >= a) & (unmatched < b)]
    unmatched_after = unmatched[unmatched >= b]
    kinds, dump_kinds = window_kinds(snapshot, device, walk,
                                     np.concatenate((carried, freed_inside, inside)).tolist(),
                                     np.concatenate((unmatched_after, unmatched_inside)).tolist())
    k = iter(kinds)
    # Sizes as the walk read them (an int64 each): a segment's size must be an integer.
    blocks = [_block(trace[j]["addr"], size, trace[j].get("frames"), next(k))
              for j, size in zip(carried.tolist(), walk.deltas_at(carried).tolist())]
    kept = trace[a:b]
    # Copies: the full trace's entries stay as they were.
    for i in closed[freed_inside].tolist() + inside.tolist():
        kept[i - a] = {**trace[i], KIND_KEY: next(k)}
    blocks += [_block(trace[u]["addr"], -size, None, next(k))
               for u, size in zip(unmatched_after.tolist(), walk.deltas_at(unmatched_after).tolist())]
    for i in unmatched_inside.tolist():
        kept[i - a] = {**trace[i], KIND_KEY: next(k)}
    segments = [seg for seg in snapshot.segments if seg["device"] == device]
    dump = [(addr, size, frames) for addr, size, frames, _ in dump_only_blocks(segments, walk, trace)]
    blocks += [_block(addr, size, frames, kind) for (addr, size, frames), kind in zip(dump, dump_kinds)]
    return kept, blocks


def _placed(address: Any) -> bool:
    # The walk matches frees to allocations by any key a trace gives as `addr`; a segment's
    # address must be an integer (the loader refuses anything else, bool included).
    return isinstance(address, int) and not isinstance(address, bool)


def _readdress(blocks: List[Dict[str, Any]], taken: Set[Any]) -> None:
    """Blocks sharing an address with another or with an allocation the window leaves open, and
    blocks whose trace entry's address is no integer, move to fresh addresses past every one
    used: a dump block at an open address is not counted."""
    top = max([0] + [x for x in taken if _placed(x)] + [blk["address"] for blk in blocks if _placed(blk["address"])])
    fresh = -(-(top + 1) // ALIGN) * ALIGN
    used = set(taken)
    for blk in blocks:
        if not _placed(blk["address"]) or blk["address"] in used:
            blk["address"] = fresh
            fresh += -(-max(blk["size"], 1) // ALIGN) * ALIGN
        used.add(blk["address"])


def _annotations_in(annotations: List[Any], first: Optional[int], last: Optional[int]) -> List[Any]:
    """The record_function scopes that overlap [first, last] (times), both ends of each kept; all of
    them when the window's events carry no times."""
    if first is None or last is None:
        return list(annotations)
    ends: Dict[int, Optional[int]] = {}  # index of a START -> index of its END
    opened: Dict[Tuple[Any, Any], List[int]] = {}
    # What Scopes reads (a named, timed dict); anything else it ignores, so the window drops it.
    timed = [(a["time_us"], k) for k, a in enumerate(annotations)
             if isinstance(a, dict) and isinstance(a.get("time_us"), int) and isinstance(a.get("name"), str)]
    for _, k in sorted(timed):
        a = annotations[k]
        device = a.get("device")
        key = (device if isinstance(device, int) else None, a["name"])
        if a.get("stage") == "START":
            opened.setdefault(key, []).append(k)
            ends[k] = None
        elif a.get("stage") == "END" and opened.get(key):
            ends[opened[key].pop()] = k
    keep: Set[int] = set()
    for s, e in ends.items():
        start, end = annotations[s]["time_us"], (annotations[e]["time_us"] if e is not None else None)
        if start <= last and (end is None or end >= first):
            keep.update(k for k in (s, e) if k is not None)
    return [a for k, a in enumerate(annotations) if k in keep]


def _span(first: int, last: int, spec: str = ",") -> str:
    return f"{first:{spec}}" if first == last else f"{first:{spec}} to {last:{spec}}"


def _nothing_inside(snapshot: Snapshot, window: Window, seen: Set[int]) -> str:
    """Why a window holds nothing, naming what the trace has: its steps, events or times."""
    if window.kind == "steps":
        steps = sorted(seen)
        have = (f"steps {steps[0]} to {steps[-1]}" if len(steps) > 1 else f"step {steps[0]}") if steps else "no steps"
        return f"no device has those steps (the trace has {have})"
    ranges: List[str] = []
    for device, trace in enumerate(snapshot.device_traces):
        if not trace:
            continue
        if window.kind == "events":
            ranges.append(f"device {device}: events {_span(0, len(trace) - 1)}")
        else:  # every entry carries an int time_us, in order: _event_range checked
            ranges.append(f"device {device}: time_us {_span(trace[0]['time_us'], trace[-1]['time_us'], '')}")
    return (f"no trace event is inside it ({'; '.join(ranges)})" if ranges
            else "the snapshot has no trace events to cut (its trace is empty)")


def cut(snapshot: Snapshot, window: Window) -> Dict[str, Any]:
    """The window of `snapshot` as a snapshot dict (`segments`, `device_traces`, ...), which a
    pickle of protocol 4 makes a file PyTorch's viewer and memdiff read. Devices that hold none
    of the window's steps are left out."""
    path = snapshot.path
    traces = snapshot.device_traces
    profiler = snapshot.source.generation == "profiler"
    out_traces: List[List[Dict[str, Any]]] = [[] for _ in traces]
    segments: List[Dict[str, Any]] = []
    times: List[int] = []
    found = False
    seen: Set[int] = set()
    for device in devices_of(snapshot):
        trace = traces[device] if device < len(traces) else []
        walk = Walk(path, device, trace, reversions=profiler)
        span = _event_range(path, device, trace, walk, window, snapshot.external_annotations, seen)
        if span is None:
            continue
        found = True
        a, b = span
        kept, blocks = _carried(snapshot, device, trace, walk, a, b)
        times += [t for e in kept[:1] + kept[-1:] if isinstance(t := e.get("time_us"), int)]
        _readdress(blocks, set(Walk(path, device, kept).open_at_end))
        while len(out_traces) <= device:
            out_traces.append([])
        out_traces[device] = kept
        # A segment of its own for each: PyTorch's viewer places a segment's blocks one after another
        # from its address (it reads no block address), and the window's end is no dump, so there
        # is no allocator state to show anyway.
        for blk in sorted(blocks, key=lambda blk: blk["address"]):
            segments.append({"device": device, "address": blk["address"], "total_size": blk["size"],
                             "allocated_size": blk["size"], "active_size": blk["size"],
                             "requested_size": blk["size"], "stream": 0, "segment_type": "large", "blocks": [blk]})
    if not found:
        raise InputError(path, f"{window.describe()}: {_nothing_inside(snapshot, window, seen)}")
    raw: Dict[str, Any] = {"segments": segments, "device_traces": out_traces,
                           "external_annotations": _annotations_in(snapshot.external_annotations,
                                                                   min(times, default=None), max(times, default=None))}
    raw[WINDOW_KEY] = {"window": window.describe(), "of": snapshot.source.file}
    settings = snapshot.source.allocator_settings
    if settings is not None:
        # A window starts where it was cut, not where a ring buffer wrapped: its own start is no loss.
        raw["allocator_settings"] = {k: v for k, v in settings.items() if k not in TRACE_BOOKKEEPING}
    if snapshot.source.emulated is not None:  # a window of an emulated run is still an emulated run
        raw["emulated"] = dict(snapshot.source.emulated)
    return raw


def windowed(snapshot: Snapshot, window: Optional[Window]) -> Snapshot:
    """`snapshot` itself, or with `window` the snapshot of that window (same file, hash and container)."""
    if window is None:
        return snapshot
    raw = cut(snapshot, window)
    source = Source(file=snapshot.source.file, sha256=snapshot.source.sha256, size_bytes=snapshot.source.size_bytes,
                    container=snapshot.source.container, generation="", keys=[])
    return to_snapshot(snapshot.path, raw, source, snapshot.decoded_bytes)
