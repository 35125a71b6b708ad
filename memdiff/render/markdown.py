"""Markdown reports for pull-request comments and job summaries: read in ten seconds, details folded."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, cast

from memdiff.differ import GONE, GREW, NEW, SHRANK, DeviceDiff, Diff, Folded
from memdiff.judge import Verdict
from memdiff.model import Frame, Source
from memdiff.render.table import (
    category_table,
    check_line,
    diff_table,
    frame_line,
    kept_line,
    pct_cell,
    peak_line,
    phase_table,
    where_line,
)
from memdiff.units import count_of, format_bytes

MARKERS = {NEW: "🆕 NEW", GREW: "🔺 GREW", SHRANK: "🔻 SHRANK", GONE: "✖️ GONE"}
STACK_FRAMES = 8


@dataclass
class Options:
    """What to name the runs and how much to show (the GitHub layer shrinks reports to fit)."""

    base_label: Optional[str] = None
    head_label: Optional[str] = None
    details: bool = True
    chart: bool = True
    note: Optional[str] = None


_TAG = re.compile(r"<(?=[A-Za-z/!])")


def _escape(cell: str) -> str:
    # `<module>` would be read as an HTML tag and vanish; `<-` and `->` are safe as they are.
    return _TAG.sub("&lt;", cell.replace("|", "\\|"))


def _input(label: Optional[str], s: Source) -> str:
    # A baseline's source already reads `baseline NAME (file)`: its label would say it twice.
    named = f"`{label}` · " if label and not s.file.startswith(label) else ""
    return f"{named}`{s.file}` ({s.container}, {s.generation})"


def _verdict_line(diff: Diff, verdict: Verdict) -> str:
    mark = "✅ memdiff: no regression" if verdict.passed else "❌ memdiff: regression"
    worst = max(diff.devices, key=lambda d: d.peak_delta_bytes, default=None)
    if worst is None:
        return f"### {mark}"
    return (f"### {mark} · device {worst.device} peak {format_bytes(worst.base_peak_bytes)} → "
            f"{format_bytes(worst.head_peak_bytes)} ({format_bytes(worst.peak_delta_bytes, signed=True)}, "
            f"{pct_cell(worst.base_peak_bytes, worst.head_peak_bytes)})")


def _frame_lines(frames: List[Frame]) -> List[str]:
    lines = ["```text"] + [frame_line(f) for f in frames[:STACK_FRAMES]]
    if len(frames) > STACK_FRAMES:
        lines.append(f"... {count_of(len(frames) - STACK_FRAMES, 'more frame')}")
    return lines + ["```", ""]


def _stacks(folded: Folded) -> List[str]:
    lines = ["<details><summary>Stacks of the rows above</summary>", ""]
    for r in folded.shown:
        if not r.frames:
            continue
        lines.append(f"**{r.status}** `{r.label or r.site}` {format_bytes(r.delta_bytes, signed=True)}")
        if not r.members:
            lines += _frame_lines(r.frames)
            continue
        # A row that aligns several groups shows each one's stack: where the memory moved.
        lines.append("")
        for m in r.members:
            lines.append(f"- {m.side}: {m.count:,} allocation{'s' if m.count != 1 else ''}, {format_bytes(m.bytes)}")
            lines += ["", *_frame_lines(m.frames)]
    return lines + ["</details>"]


def _chart(d: DeviceDiff) -> List[str]:
    runs = [(name, [p[i] for p in d.chart]) for i, name in ((1, "base"), (2, "head"))]
    # A run with a timeline has a value in every bucket (differ fills the empty ones); one without has none.
    lines_by_run = [(name, cast(List[int], values)) for name, values in runs if values and values[0] is not None]
    if not lines_by_run:
        return []
    top = max(v for _, values in lines_by_run for v in values)
    unit, factor = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
    out = ["```mermaid", "xychart-beta",
           f'    title "Allocated memory over the trace, device {d.device} ({unit})"',
           '    x-axis "trace progress (%)" 0 --> 100', f'    y-axis "{unit}"']
    out += [f"    line [{', '.join(f'{v / factor:.2f}' for v in values)}]" for _, values in lines_by_run]
    out.append("```")
    out.append("Lines, in order: " + ", ".join(name for name, _ in lines_by_run)
               + " (each point the largest total in its stretch of the trace).")
    return out


def render_diff(diff: Diff, verdict: Verdict, folded: Dict[int, Folded], options: Optional[Options] = None) -> str:
    """The diff report in GitHub-flavoured markdown."""
    o = options or Options()
    lines = [_verdict_line(diff, verdict), "",
             f"**base** {_input(o.base_label, diff.base)} → **head** {_input(o.head_label, diff.head)}"]
    if diff.warnings:
        lines += ["", "> [!WARNING]", *(f"> {_escape(w)}  " for w in diff.warnings)]
    for d in diff.devices:
        lines += ["", f"#### device {d.device}: {peak_line(d)}; static {format_bytes(d.base_static_bytes)} -> "
                      f"{format_bytes(d.head_static_bytes)}"]
        lines += ["", *(_escape(line) for line in (where_line(d), kept_line(d)) if line)]
        if d.phases:
            lines += ["", phase_table(d, "github")]
        if d.categories:
            lines += ["", category_table(d, "github")]
        lines += ["", diff_table(folded[d.device], "github", escape=_escape, status=lambda s: MARKERS.get(s, s))]
        if o.details:
            lines += ["", *_stacks(folded[d.device])]
        if o.chart:
            chart = _chart(d)
            lines += ["", *chart] if chart else []
    lines += ["", f"**Rule:** {verdict.rule}", ""]
    lines += [f"- {'✅' if c.passed else '❌'} {check_line(c)}" for c in verdict.checks]
    lines += ["", *(_escape(n) for n in verdict.notes)] if verdict.notes else []
    lines += ["", f"*{o.note}*"] if o.note else []
    return "\n".join(lines) + "\n"
