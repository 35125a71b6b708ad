"""The one replay forecast and what-if share: a course's events re-run with each allocation holding a
given size, giving the bytes live after each event, the peak, its phase and step, and what is live
there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from memdiff.model import PhaseSpan, Step
from memdiff.predict.forecast.course import DeviceCourse


def replay(ref: DeviceCourse, sizes: np.ndarray) -> np.ndarray:
    """Bytes live after each event of `ref`'s trace with allocation k holding `sizes[k]` (see
    peak_of for the moment before the first event)."""
    n = ref.events
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, ref.start, sizes)
    ends = np.minimum(ref.end, n)
    np.subtract.at(delta, ends, sizes)
    return np.cumsum(delta[:n]) if n else np.zeros(0, dtype=np.int64)


def _phase_of(spans: Sequence[PhaseSpan], event: int) -> Optional[str]:
    return next((s.phase for s in spans if s.start_event <= event <= s.end_event), None)


@dataclass
class Replayed:
    """A course replayed with given sizes: its peak, where it is, each phase's peak, what is live there.

    The one replay forecast and what-if share: a forecast changes every size by its fitted form,
    a what-if drops, scales, replaces or adds allocations by its rules."""

    totals: np.ndarray  # bytes live after each event
    peak_bytes: int
    event: Optional[int]  # the event after which the peak is reached; None: before the first event
    at: int  # the event whose live allocations are the peak's (0 for memory from before the trace)
    live: np.ndarray  # allocations live at the peak
    phase: Optional[str]
    step: Optional[int]
    phase_peaks: Dict[str, int]
    categories: Dict[str, int]


def replay_course(ref: DeviceCourse, sizes: np.ndarray, spans: Sequence[PhaseSpan], steps: Sequence[Step]) -> Replayed:
    """Replay `ref` with allocation k holding `sizes[k]`: the peak, its phase and step (from the
    phase runs and steps of the run the course comes from), each phase's peak, the categories live."""
    totals = replay(ref, sizes)
    peak, event = peak_of(ref, sizes, totals)
    if event is None:  # before the first event: only memory from before the trace is live
        live = ref.before
        at = 0
    else:
        at = event
        live = (ref.start <= at) & (ref.end > at)
    phase_peaks: Dict[str, int] = {}
    for span in spans:
        phase, start, end = span.phase, span.start_event, span.end_event
        if start <= end < len(totals):
            top = int(totals[start:end + 1].max())
            phase_peaks[phase] = max(phase_peaks.get(phase, 0), top)
    cats: Dict[str, int] = {}
    for c, b in zip(ref.category[live].tolist(), sizes[live].tolist()):
        name = ref.categories[c]
        cats[name] = cats.get(name, 0) + b
    step = None if event is None else next((s.step for s in steps if s.start_event <= at <= s.end_event), None)
    return Replayed(totals=totals, peak_bytes=peak, event=event, at=at, live=live,
                    phase=None if event is None else _phase_of(spans, at), step=step, phase_peaks=phase_peaks,
                    categories=dict(sorted(cats.items(), key=lambda kv: (-kv[1], kv[0]))))


def peak_of(ref: DeviceCourse, sizes: np.ndarray, totals: np.ndarray) -> Tuple[int, Optional[int]]:
    """(the peak, the event after which it is reached): as normalize counts it, memory from
    before the trace is live before the first event, so a trace that starts by freeing it peaks
    there (event None)."""
    static = int(sizes[ref.before].sum())
    top = int(totals.max()) if len(totals) else 0
    if not len(totals) or static > top:
        return static, None
    return top, int(totals.argmax())
