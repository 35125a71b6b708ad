"""The charts of a report: allocated memory over each run's trace, as the markdown's mermaid chart words
it (chart_of) and as the HTML page's script draws it (run_data). The figures and words are decided here;
the renderers lay them out."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, Optional

from memdiff.compare.differ import DeviceDiff
from memdiff.model import DeviceSummary
from memdiff.report.types import Chart, ChartLine, stack_lines


def chart_of(d: DeviceDiff) -> Optional[Chart]:
    """Allocated memory over each run's trace (the differ's buckets), in GiB from 1 GiB up, else in MiB;
    None when neither run has a timeline."""
    runs = [(name, [p[i] for p in d.chart]) for i, name in ((1, "base"), (2, "head"))]
    # A run with a timeline has a value in every bucket (differ fills the empty ones); one without has none.
    drawn = [(name, [v or 0 for v in values]) for name, values in runs if values and values[0] is not None]
    if not drawn:
        return None
    top = max(v for _, values in drawn for v in values)
    unit, factor = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
    return Chart(title=f"Allocated memory over the trace, device {d.device} ({unit})", x_axis="trace progress (%)",
                 unit=unit, lines=[ChartLine(name, [f"{v / factor:.2f}" for v in values]) for name, values in drawn],
                 caption="Lines, in order: " + ", ".join(name for name, _ in drawn)
                 + " (each point the largest total in its stretch of the trace).")


def run_data(role: str, label: str, d: Optional[DeviceSummary]) -> Dict[str, Any]:
    """One run of one device as the HTML page's script draws it (embedded as JSON): its peak, its trace's
    span and times, the phases' bands, the bars of its history and the groups they stand for, each with
    its stack as every output shows it; an empty run for a side that lacks the device."""
    if d is None:
        return {"role": role, "label": label, "peak_bytes": 0, "peak_event": None, "trace_events": 0,
                "start_us": None, "end_us": None, "history": None, "bands": [], "bars": [], "groups": {}}
    history = d.history
    bars = [asdict(b) for b in history.bars] if history else []
    drawn = {b["signature"] for b in bars}
    groups = {g.signature: {"site": g.site, "category": g.category or "other", "bytes": g.bytes, "count": g.count,
                            "stack": stack_lines(g.frames)} for g in d.groups if g.signature in drawn}
    bands = [{"phase": p.phase, "start": p.start_event, "end": p.end_event, "step": s.step, "first": k == 0}
             for s in d.steps for k, p in enumerate(s.phases)]
    return {"role": role, "label": label, "peak_bytes": d.peak_bytes, "peak_event": d.peak_event_index,
            "trace_events": d.trace_events, "start_us": d.trace_start_time_us, "end_us": d.trace_end_time_us,
            "history": None if history is None else {k: v for k, v in asdict(history).items() if k != "bars"},
            "bands": bands, "bars": bars, "groups": groups}
