"""Whether two runs are runs of one loop: what the forecast (runs of one loop at different knob
values) and a baseline from repeats (runs of one loop, again) both require.

Compared on the Summaries alone: the devices, each device's number of steps, the training
phases (a backward or an optimizer step in one run only: a training run beside an inference
run), the weights (parameter bytes, which neither a knob nor noise changes by more than 1%), and,
for repeats, the stacks that hold the peak.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Sequence, Set, Tuple

from memdiff.model import DeviceSummary, Summary
from memdiff.units import count_of, format_bytes

# The phases only a training step has: a run with them and a run without are two loops.
TRAINING_PHASES = ("backward", "optimizer")
# Parameter bytes of one loop agree within this share (a buffer sized by the knob, rotary tables
# sized by the context, may count as a parameter).
PARAMETER_TOLERANCE = 0.01
# At least this share of each run's peak bytes is held by stacks the other run records too
# (at its peak or at a phase's peak): repeats run the same code.
MIN_SHARED_STACKS = 0.5


def loop_difference(run: Summary, first: Summary, first_name: str, stacks: bool = False) -> Optional[str]:
    """What makes `run` another loop than `first` (named `first_name`), in words that follow
    "not the same loop as FIRST: "; None when nothing does. `stacks` also compares the stacks
    holding each peak (repeats run the same code; a knob's runs may not, batch 1 skips a copy)."""
    a, b = sorted(d.device for d in first.devices), sorted(d.device for d in run.devices)
    if a != b:
        return f"it records devices {_list(b)}, {first_name} records {_list(a)}"
    for d0, d1 in zip(sorted(first.devices, key=_device), sorted(run.devices, key=_device)):
        s0 = [[p.phase for p in s.phases] for s in d0.steps]
        s1 = [[p.phase for p in s.phases] for s in d1.steps]
        if len(s0) != len(s1):
            return f"device {d0.device} has {count_of(len(s1), 'step')}, {first_name} has {len(s0)}"
        t0, t1 = _training(s0), _training(s1)
        if t0 != t1:
            return (f"on device {d0.device} it records {_phases_words(t1)}, {first_name} records "
                    f"{_phases_words(t0)} (a training run and an inference run?)")
        p0 = _params(d0.phase_peaks, d0.categories)
        p1 = _params(d1.phase_peaks, d1.categories)
        if p0 is not None and p1 is not None and abs(p1 - p0) > PARAMETER_TOLERANCE * max(p0, p1):
            return (f"device {d0.device} holds {format_bytes(p1)} of parameters, {first_name} holds "
                    f"{format_bytes(p0)} (a different model?)")
        if stacks:
            shared = min(_shared(d1, _signatures(d0)), _shared(d0, _signatures(d1)))
            if shared < MIN_SHARED_STACKS:
                return (f"on device {d0.device} only {100 * shared:.0f}% of the bytes at one run's peak are held by "
                        f"stacks the other records (different code?)")
    return None


def _device(d: DeviceSummary) -> int:
    return d.device


def _training(steps: Sequence[Sequence[str]]) -> Tuple[str, ...]:
    """The training phases any step records, in TRAINING_PHASES' order."""
    seen = {p for s in steps for p in s}
    return tuple(p for p in TRAINING_PHASES if p in seen)


def _phases_words(phases: Sequence[str]) -> str:
    return (" and ".join(f"a{'n' if p[0] in 'aeiou' else ''} {p} phase" for p in phases) if phases
            else "no backward and no optimizer phase")


def _params(phase_peaks: Sequence[Any], categories: Dict[str, int]) -> Optional[int]:
    """Parameter bytes at the forward peak (or the peak), None when no group is a parameter."""
    for p in phase_peaks:
        if p.phase == "forward":
            cats = p.categories if p.groups is not None else categories
            return cats.get("parameter")
    return categories.get("parameter")


def _signatures(d: DeviceSummary) -> Set[str]:
    """Every stack signature the summary keeps: at the peak and at each phase's peak."""
    out = {g.signature for g in d.groups}
    for p in d.phase_peaks:
        out.update(g.signature for g in p.groups or ())
    return out


def _shared(d: DeviceSummary, signatures: Set[str]) -> float:
    """The share of `d`'s peak bytes held by groups whose stack is in `signatures` (1 when empty)."""
    total = sum(g.bytes for g in d.groups)
    return 1.0 if not total else sum(g.bytes for g in d.groups if g.signature in signatures) / total


def _list(values: Sequence[int]) -> str:
    return ", ".join(map(str, values)) or "none"


def name_of(summary: Summary) -> str:
    """A run's file name as the messages show it."""
    return os.path.basename(summary.source.file) if summary.source.file else "the first run"

