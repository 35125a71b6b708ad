"""The forecast's input: each run (a snapshot and its knob value, `b4.pickle=4`) read once into its
classified Summary and every allocation of each device in trace order (`Course`), the form a
forecast and a what-if replay."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from memdiff.analyse.classify import Rule, classify
from memdiff.analyse.history import Allocations, category_codes
from memdiff.analyse.lifetimes import Scopes
from memdiff.analyse.normalize.engine import summarize
from memdiff.errors import InputError, clip
from memdiff.model import PhaseSpan, Step, Summary
from memdiff.numbers import whole_number
from memdiff.read.host import CpuHost, read_cpu_host
from memdiff.read.inputs import is_summary, read_each, refuse_baseline
from memdiff.read.load import decode, paused_gc, to_snapshot
from memdiff.read.window import Window, windowed


@dataclass(frozen=True)
class KnobRun:
    """A snapshot and the knob value it was recorded at (`b4.pickle=4`)."""

    path: str
    value: int


@dataclass
class DeviceCourse:
    """Every allocation of one device of one run, in the order the trace opened them.

    Allocation k holds `size[k]` bytes after events `start[k]` .. `end[k] - 1` (memory from
    before the trace starts at 0); `stack[k]` indexes the run's `stacks` (signature, site) and
    `category[k]` its `categories`."""

    device: int
    events: int
    start: np.ndarray
    end: np.ndarray
    size: np.ndarray
    stack: np.ndarray
    category: np.ndarray
    stacks: List[Tuple[str, str]]
    categories: List[str]
    before: np.ndarray  # live before the trace's first event (memory from before the trace)
    # The display frames of each allocation's first version, instance numbers of the profiler's
    # `nn.Module: GPT2Block_3` frames kept (signatures drop them): `origin[k]` indexes `origins`.
    origin: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    origins: List[Tuple[Any, ...]] = field(default_factory=list)
    scopes: List[str] = field(default_factory=list)  # the names of the device's record_function scopes


@dataclass
class Course:
    """One run: its classified Summary and the allocations of each device."""

    file: str
    value: int
    summary: Summary
    devices: Dict[int, DeviceCourse]
    # What a CPU capture says of its host (half precision's convolutions); None for other runs.
    host: Optional[CpuHost] = None


def read_course(path: str, value: int, rules: Sequence[Rule], window: Optional[Window] = None) -> Course:
    """One run's Summary and allocations (of `window` only, when given): the snapshot is decoded and
    walked once."""
    with paused_gc():
        raw, source, decoded = decode(path, columns=True)
        if is_summary(raw):
            refuse_baseline(path, raw)
            raise InputError(path, "a stored summary holds only the peak; a forecast or a what-if replays every "
                                   "allocation, so give it the snapshot itself")
        keep: Dict[int, Allocations] = {}
        host = read_cpu_host(raw)
        snapshot = windowed(to_snapshot(path, raw, source, decoded), window)
        summary = summarize(snapshot, None, keep)
        # An allocation at event 0 opens there; any other that starts at 0 was live before the trace.
        opens_at_0 = {d: bool(t) and isinstance(t[0], dict) and t[0].get("action") == "alloc"
                      for d, t in enumerate(snapshot.device_traces)}
        scopes = {d: Scopes(snapshot.external_annotations, d).names for d in range(len(snapshot.device_traces))}
        del raw, snapshot
    summary = classify(summary, rules)
    devices = {}
    for d in summary.devices:
        allocations = keep[d.device]
        names, codes = category_codes(allocations, rules)
        stacks: Dict[str, int] = {}
        kinds = [stacks.setdefault(stack.signature, len(stacks)) for stack, _ in allocations.kinds]
        sites = {stack.signature: stack.site for stack, _ in allocations.kinds}
        kind = allocations.kind
        stack = np.array(kinds, dtype=np.int64)[kind] if len(kind) else kind
        # Memory live for the whole trace (blocks found only at dump time) comes in address order,
        # which differs from run to run: put it in one order, by stack then size.
        start, end, size = allocations.start, allocations.end, allocations.size
        order = np.arange(len(size))
        whole = np.flatnonzero((start == 0) & (end >= d.trace_events))
        if len(whole) > 1:
            signatures = list(stacks)
            ranked = sorted(whole.tolist(), key=lambda k: (signatures[int(stack[k])], int(size[k])))
            order[whole] = ranked
        before = start == 0
        if len(before) and opens_at_0.get(d.device, False):
            before[0] = False
        devices[d.device] = DeviceCourse(
            device=d.device, events=d.trace_events, start=start[order], end=end[order], size=size[order],
            stack=stack[order], category=codes[order], stacks=[(sig, sites[sig]) for sig in stacks],
            categories=names, before=before[order],
            origin=kind[order] if len(kind) else kind, origins=[stack.frames for stack, _ in allocations.kinds],
            scopes=scopes.get(d.device, []))
    return Course(file=path, value=value, summary=summary, devices=devices, host=host)


def read_courses(runs: Sequence[KnobRun], rules: Sequence[Rule], window: Optional[Window] = None) -> List[Course]:
    """read_course of each (path, value), big inputs in parallel worker processes (inputs.read_each)."""
    return read_each(read_course, [(r.path, r.value, rules, window) for r in runs])


def structure(summary: Summary, device: int) -> Tuple[List[PhaseSpan], List[Step]]:
    """The phase runs and steps of a run's device (kept in its Summary)."""
    for d in summary.devices:
        if d.device == device:
            return [p for s in d.steps for p in s.phases], list(d.steps)
    return [], []


def parse_run(text: str) -> KnobRun:
    """The run in `RUN=VALUE`; InputError when it is not that (the value a positive integer)."""
    path, sep, value = text.rpartition("=")
    if not sep or not path:
        raise InputError(text, "give each run as RUN=VALUE (for example b4.pickle=4)")
    try:
        number = whole_number(value)
    except ValueError:
        raise InputError(path, f"{clip(value)!r} is not a knob value: a positive integer (a batch size, a length)") \
            from None
    if not 1 <= number <= MAX_VALUE:
        raise InputError(path, f"{_shown(number)} is not a knob value: a positive integer up to {MAX_VALUE:,}")
    return KnobRun(path, number)


# The largest knob value the budget search tries.
MAX_VALUE = 2**40


def _shown(value: int) -> str:
    return f"{value:,}" if value.bit_length() <= 128 else f"an integer of {value.bit_length():,} bits"
