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

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from memdiff import __version__
from memdiff.analyse.classify import Rule
from memdiff.analyse.history import Allocations, history_of, peak_bars, window_maxima
from memdiff.analyse.lifetimes import (
    BACKWARD,
    FORWARD,
    MAX_STEPS,
    OPTIMIZER,
    Scopes,
    Timeline,
    build_timeline,
)
from memdiff.analyse.normalize.groups import Live, group_live, labels_of, live_at
from memdiff.analyse.normalize.kinds import Kind, mark_kept_updates, read_allocations
from memdiff.analyse.normalize.standins import dump_only_blocks, stand_ins_of, state_by_sizes
from memdiff.analyse.normalize.walk import DumpBlock, Walk, reserved_totals
from memdiff.errors import InputError, brief, number
from memdiff.model import WINDOW_KEY, DeviceSummary, OomEvent, PhasePeak, Step, Summary, largest_first
from memdiff.read.frames import (
    StackNormalizer,
    allocation_frames_lists,
    frames_lists,
    number_compiled_buffers,
    relativize,
)
from memdiff.read.load import MAX_BYTES, Snapshot

TIMELINE_POINTS = 100


# compile_context values that mean "not compiled"
NO_COMPILE_CONTEXT = ("", "N/A", None)


def _timeline(static: int, running: np.ndarray) -> List[List[int]]:
    """At most TIMELINE_POINTS [event index, allocated bytes] points, each the max of its window."""
    # The maxima of running, shifted: running + static would be one more array the trace's length.
    return [[i, static + int(running[i])] for i in window_maxima(running, TIMELINE_POINTS).tolist()]


def _device_summary(snapshot: Snapshot, device: int, stacks: StackNormalizer,
                    history_rules: Optional[Sequence[Rule]] = None,
                    keep: Optional[Dict[int, Allocations]] = None) -> DeviceSummary:
    path = snapshot.path
    traces = snapshot.device_traces
    trace = traces[device] if device < len(traces) else []
    segments = [s for s in snapshot.segments if s["device"] == device]
    walk = Walk(path, device, trace, reversions=snapshot.source.generation == "profiler")

    unmatched_bytes = -int(walk.deltas_at(np.frombuffer(walk.unmatched, dtype=np.int64)).sum()) if walk.unmatched else 0
    static = unmatched_bytes
    dump_only = [DumpBlock(size, frames, kind=kind)
                 for _, size, frames, kind in dump_only_blocks(segments, walk, trace)]
    static += sum(b.size for b in dump_only)

    # Running totals are int64: sizes that could add up past it are no real trace (and would wrap).
    if static > MAX_BYTES:
        raise InputError(path, f"device {device}: sizes add up to more than {MAX_BYTES:,} bytes: not a real snapshot")
    running = walk.running_totals()
    peak_index: Optional[int] = None
    peak = static
    if len(running):
        k = int(running.argmax())
        if running[k] > 0:
            peak_index, peak = k, static + int(running[k])

    scopes = Scopes(snapshot.external_annotations, device)
    timeline = build_timeline(trace, walk.allocs, running, static, scopes, walk.version_of)
    p = -1 if peak_index is None else peak_index
    n = len(trace)
    stand_ins = stand_ins_of(walk, trace, timeline)
    state_by_sizes(dump_only, walk, trace, timeline)
    stacks.mark_updates(stand_ins.values())
    # A window: what the full trace makes of memory, kept on its entries and blocks (KIND_KEY).
    kinds: Optional[Dict[int, Tuple[Any, Kind]]] = {} if WINDOW_KEY in snapshot.source.keys else None
    live_items = live_at(walk, trace, p, dump_only, timeline, stand_ins, kinds, path)
    mark_kept_updates(stacks, kinds)
    # A re-versioned tensor is not memory from before a truncated trace: no advice to record more.
    reversioned = [i for i in walk.unmatched if i in walk.continued_by]
    unmatched_bytes -= sum(trace[i]["size"] for i in reversioned)
    where = _stack_place(snapshot, device, trace)
    groups, peak_signature, allocations_of = group_live(path, live_items, stacks, where)
    phase_peaks = []
    for phase in (FORWARD, BACKWARD, OPTIMIZER):
        spans = [span for span in timeline.runs if span.phase == phase]
        if not spans:
            continue
        top = max(spans, key=lambda span: (span.peak_bytes, -span.peak_event_index))
        at = top.peak_event_index
        phase_groups = None
        if at != peak_index:
            phase_items = live_at(walk, trace, at, dump_only, timeline, stand_ins, kinds, path)
            mark_kept_updates(stacks, kinds)
            phase_groups = group_live(path, phase_items, stacks, where)[0]
        phase_peaks.append(PhasePeak(phase, timeline.step_at(at), top.peak_bytes, at, phase_groups))
    if sum(g.bytes for g in groups) != peak:
        raise AssertionError(f"{path}: device {device}: groups do not add up to the peak (a memdiff bug)")

    peak_event = trace[peak_index] if peak_index is not None else None
    by_scope: Dict[str, int] = {}
    by_context: Dict[str, int] = {}
    for item in live_items:
        e, size = item.entry, item.size
        if e is None:
            continue
        scope = scopes.innermost(e.get("time_us"))
        if scope is not None:
            by_scope[scope] = by_scope.get(scope, 0) + size
        context = e.get("compile_context")
        if context not in NO_COMPILE_CONTEXT:
            name = context[:200] if isinstance(context, str) else brief(context)
            by_context[name] = by_context.get(name, 0) + size
    by_label = labels_of(trace, walk.annotations, live_items, peak_index)
    times = [_time(path, device, trace, 0), _time(path, device, trace, len(trace) - 1)] if trace else [None, None]
    history = None
    # Every allocation, read once for whoever asks (the history draws them, the forecast replays them).
    everything = (read_allocations(path, walk, trace, dump_only, timeline, stacks, stand_ins, kinds)
                  if keep is not None or history_rules is not None else None)
    if keep is not None and everything is not None:
        keep[device] = everything
    if history_rules is not None and everything is not None:
        bars = peak_bars([(g.signature, allocations_of[g.signature]) for g in groups])
        history = history_of(everything, running + static, lambda i: _time(path, device, trace, i), history_rules,
                             bars)
    reserved_at_dump = (None if snapshot.source.generation == "profiler" else sum(s["total_size"] for s in segments))
    reserved_peak, fragmentation = reserved_totals(path, device, trace, walk.segment_events, reserved_at_dump,
                                                   peak_index, peak)
    allocated = (sum(s["allocated_size"] for s in segments) if all("allocated_size" in s for s in segments)
                 else sum(b["size"] for s in segments for b in s.get("blocks", [])
                          if b["state"] == "active_allocated"))
    return DeviceSummary(
        device=device,
        trace_events=n,
        static_bytes=static,
        peak_bytes=peak,
        peak_event_index=peak_index,
        peak_time_us=_time(path, device, trace, peak_index) if peak_index is not None else None,
        peak_event_signature=peak_signature,
        trace_start_time_us=times[0],
        trace_end_time_us=times[1],
        allocated_bytes_at_dump=allocated,
        # The profiler route's one segment per device spans the lowest to the highest address it
        # saw (terabytes on CPU): it stands for no memory anyone reserved.
        reserved_bytes_at_dump=reserved_at_dump,
        unmatched_free_count=len(walk.unmatched) - len(reversioned),
        unmatched_free_bytes=unmatched_bytes,
        oom_events=[OomEvent(event_index=i, requested_bytes=_bytes(path, device, trace, i, "size") or 0,
                             device_free_bytes=_bytes(path, device, trace, i, "device_free"),
                             time_us=_time(path, device, trace, i)) for i in walk.ooms],
        timeline=_timeline(static, running),
        groups=groups,
        scope_at_peak=scopes.innermost(peak_event.get("time_us")) if peak_event else None,
        steps=_steps_kept(timeline, peak_index),
        step_at_peak=timeline.step_at(peak_index) if peak_index is not None else None,
        phase_at_peak=timeline.phase_at(peak_index) if peak_index is not None else None,
        phase_peaks=phase_peaks,
        bytes_by_scope=largest_first(by_scope),
        bytes_by_compile_context=largest_first(by_context),
        bytes_by_label=largest_first(by_label),
        history=history,
        reserved_peak_bytes=reserved_peak,
        fragmentation_bytes=fragmentation,
    )


def _stack_place(snapshot: Snapshot, device: int, trace: Any) -> Callable[[Live], str]:
    """For an error about a live allocation's stack: where in the file that stack is (the trace
    entry or segment block holding that very frames list), as every other bad field is named.
    Looked for only then, by a scan, so reading a good file costs nothing."""
    def where(item: Live) -> str:
        for i in range(len(trace)):
            entry = trace[i]
            if isinstance(entry, dict) and entry.get("frames") is item.frames:
                return f"device_traces[{device}][{i}]: "
        for k, segment in enumerate(snapshot.segments):
            if isinstance(segment, dict) and segment.get("device") == device:
                for j, block in enumerate(segment.get("blocks") or []):
                    if isinstance(block, dict) and block.get("frames") is item.frames:
                        return f"segments[{k}].blocks[{j}]: "
        return f"device {device}: the stack of memory live at a peak: "
    return where


def _time(path: str, device: int, trace: List[Dict[str, Any]], i: int) -> Optional[int]:
    """An entry's `time_us` for the summary: an integer or absent; anything else is bad input."""
    value = trace[i].get("time_us")
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63):
        return value
    raise InputError(path, f"device_traces[{device}][{i}].time_us: expected microseconds as an integer, "
                           f"got {brief(value)}")


def _bytes(path: str, device: int, trace: List[Dict[str, Any]], i: int, key: str) -> Optional[int]:
    """An entry's byte count that the walk does not read (an oom's): a size or absent."""
    value = trace[i].get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_BYTES):
        return value
    shown = number(value) if isinstance(value, int) else brief(value)
    raise InputError(path, f"device_traces[{device}][{i}].{key}: {shown} is not a size in bytes (0 to {MAX_BYTES:,})")


def _steps_kept(timeline: Timeline, peak_index: Optional[int]) -> List[Step]:
    """The steps a summary keeps: all of them up to MAX_STEPS, else the first ones and the peak's."""
    steps = timeline.steps
    if len(steps) <= MAX_STEPS:
        return steps
    at_peak = timeline.step_index_at(peak_index) if peak_index is not None else None
    kept = steps[: MAX_STEPS - 1]
    if at_peak is not None and at_peak >= MAX_STEPS - 1:
        kept.append(steps[at_peak])
    return kept


def devices_of(snapshot: Snapshot) -> List[int]:
    """Devices with a non-empty trace or at least one segment, ascending."""
    found = {i for i, t in enumerate(snapshot.device_traces) if t}
    found.update(s["device"] for s in snapshot.segments)
    return sorted(found)


def summarize(snapshot: Snapshot, history_rules: Optional[Sequence[Rule]] = None,
              keep: Optional[Dict[int, Allocations]] = None) -> Summary:
    """The Summary of every device in the snapshot; with `history_rules`, each device's history
    too, its allocations classified by those rules (the ones the summary will be classified by);
    with `keep`, every allocation of each device is put there by device (the forecast replays them)."""
    stacks = StackNormalizer(snapshot.decoded_bytes)
    number_compiled_buffers(snapshot.device_traces)
    stacks.learn_generated_from(lambda: frames_lists(snapshot.device_traces, snapshot.segments))
    stacks.learn_lines_from(lambda: allocation_frames_lists(snapshot.device_traces, snapshot.segments))
    devices = [_device_summary(snapshot, d, stacks, history_rules, keep) for d in devices_of(snapshot)]
    all_groups = [g for d in devices for g in d.groups]
    all_groups += [g for d in devices for p in d.phase_peaks for g in (p.groups or [])]
    for group, frames in zip(all_groups, relativize([g.frames for g in all_groups])):
        group.frames = frames
    return Summary(source=snapshot.source, devices=devices, tool=f"memdiff {__version__}")
