"""HTML reports: one self-contained page per diff, gate or peak, to open from disk or a CI artifact.

Everything is inline (style, script, data) and the page's Content-Security-Policy forbids any
fetch, so it works offline and leaks nothing. Tables are written here, as static HTML that reads
without JavaScript; the charts are drawn in the browser from the figures memdiff measured,
embedded as JSON.

Drawing layer: inline SVG and about 450 lines of plain JavaScript (report.js), not a charting
library. The report needs stacked areas, bands, markers and bars on one shared, zoomable axis:
each a few SVG paths. A vendored library (uPlot, Chart.js) would add 50-200 KB to every
report, a licence and version to carry, and a canvas whose drawn values a test cannot read
back from the DOM; SVG elements carry their figures as attributes.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict
from importlib import resources
from typing import Any, Dict, List, Optional, Sequence

from memdiff.differ import Diff, DiffRow, Folded
from memdiff.judge import Verdict
from memdiff.model import DeviceSummary, Frame, Summary
from memdiff.peak import DevicePeak, PeakRow
from memdiff.render.table import (
    CATEGORY_HEADERS,
    HEADERS,
    PHASE_HEADERS,
    category_rows,
    check_line,
    frame_line,
    kept_line,
    peak_line,
    phase_rows,
    row_cells,
    where_line,
)
from memdiff.units import format_bytes

STACK_FRAMES = 40  # frames of a stack the page keeps


def _asset(name: str) -> str:
    return (resources.files("memdiff") / "render" / name).read_text(encoding="utf-8")


def _stack(frames: Sequence[Frame]) -> List[str]:
    lines = [frame_line(f) for f in frames[:STACK_FRAMES]]
    if len(frames) > STACK_FRAMES:
        lines.append(f"... {len(frames) - STACK_FRAMES} more frames")
    return lines


def _run(role: str, label: str, d: Optional[DeviceSummary]) -> Dict[str, Any]:
    """One run of one device as the page's script draws it."""
    if d is None:
        return {"role": role, "label": label, "peak_bytes": 0, "peak_event": None, "trace_events": 0,
                "start_us": None, "end_us": None, "history": None, "bands": [], "bars": [], "groups": {}}
    history = d.history
    bars = [asdict(b) for b in history.bars] if history else []
    drawn = {b["signature"] for b in bars}
    groups = {g.signature: {"site": g.site, "category": g.category or "other", "bytes": g.bytes, "count": g.count,
                            "stack": _stack(g.frames)} for g in d.groups if g.signature in drawn}
    bands = [{"phase": p.phase, "start": p.start_event, "end": p.end_event, "step": s.step, "first": k == 0}
             for s in d.steps for k, p in enumerate(s.phases)]
    return {"role": role, "label": label, "peak_bytes": d.peak_bytes, "peak_event": d.peak_event_index,
            "trace_events": d.trace_events, "start_us": d.trace_start_time_us, "end_us": d.trace_end_time_us,
            "history": None if history is None else {k: v for k, v in asdict(history).items() if k != "bars"},
            "bands": bands, "bars": bars, "groups": groups}


def _row_data(r: DiffRow) -> Dict[str, Any]:
    members = r.member_groups()
    return {"title": f"{r.status} {r.label or r.site} {format_bytes(r.delta_bytes, signed=True)}",
            "signatures": sorted({m.signature for m in members}),
            "stacks": [{"side": m.side, "count": m.count, "bytes": m.bytes, "frames": _stack(m.frames)}
                       for m in members]}


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int] = (0,),
           attrs: Sequence[str] = ()) -> str:
    """A table; `left` are the left-aligned columns, `attrs` each row's attributes (already escaped)."""
    def cell(tag: str, k: int, text: str) -> str:
        cls = ' class="l"' if k in left else ""
        return f"<{tag}{cls}>{html.escape(text)}</{tag}>"
    head = "".join(cell("th", k, h) for k, h in enumerate(headers))
    body = "".join(f"<tr{attrs[i] if i < len(attrs) else ''}>" + "".join(cell("td", k, c) for k, c in enumerate(row))
                   + "</tr>" for i, row in enumerate(rows))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _page(title: str, body: List[str], payload: Dict[str, Any]) -> str:
    # "<" escaped inside the JSON: no label in a snapshot can close the script element.
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        'style-src \'unsafe-inline\'; script-src \'unsafe-inline\'; img-src data:">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<meta name="color-scheme" content="light dark">',
        f"<title>{html.escape(title)}</title>", f"<style>{_asset('report.css')}</style>", "</head>", "<body>", "<main>",
        *body, "</main>", '<div id="tip" role="tooltip"></div>', '<aside id="detail" aria-live="polite"></aside>',
        f'<script type="application/json" id="memdiff-data">{data}</script>',
        f"<script>{_asset('report.js')}</script>", "</body>", "</html>", ""])


def _toolbar(compare: bool) -> str:
    overlay = ('<button type="button" data-action="overlay" aria-pressed="false">overlay the runs</button>'
               if compare else "")
    return ('<div class="toolbar" id="toolbar">'
            '<button type="button" data-action="time" aria-pressed="false">x axis: time</button>'
            f'{overlay}<button type="button" data-action="reset">reset zoom</button>'
            '<span class="hint">wheel or +/- zooms, drag or arrow keys pan, 0 resets; '
            'hover a row for its stack, click it to mark its groups</span></div>'
            '<div class="legend"></div>')


def _charts(device: int) -> str:
    return (f'<section class="device" data-device="{device}"><div class="chart charts"></div>'
            '<h3>Live at the peak</h3><div class="chart bar-charts"></div></section>')


def _diff_rows(device: int, folded: Folded) -> str:
    rows, attrs = [], []
    for k, r in enumerate(folded.shown):
        rows.append(row_cells(r))
        attrs.append(f' class="row {r.status}" tabindex="0" data-device="{device}" data-row="r{k}"')
    if folded.others is not None:
        rows.append(row_cells(folded.others))
        attrs.append("")
    rows.append(row_cells(folded.total))
    attrs.append(' class="total"')
    return _table(HEADERS, rows, left=(0, 6), attrs=attrs)


def _verdict(verdict: Verdict) -> List[str]:
    mark = "pass" if verdict.passed else "fail"
    text = "memdiff: no regression" if verdict.passed else "memdiff: regression"
    out = [f'<p class="verdict {mark}" data-passed="{str(verdict.passed).lower()}">{html.escape(text)}</p>',
           f"<p><strong>Rule:</strong> {html.escape(verdict.rule)}</p>", "<ul>"]
    out += [f'<li class="mono {"pass" if c.passed else "fail"}">{html.escape(check_line(c))}</li>'
            for c in verdict.checks]
    out.append("</ul>")
    out += [f'<p class="muted">{html.escape(n)}</p>' for n in verdict.notes]
    return out


def render_diff(diff: Diff, verdict: Verdict, folded: Dict[int, Folded], base: Summary, head: Summary,
                base_label: Optional[str] = None) -> str:
    """The diff (or gate) report as one self-contained HTML page."""
    base_name, head_name = base_label or diff.base.file, diff.head.file
    title = f"memdiff: {base_name} → {head_name}"
    body = [f"<h1>{html.escape(title)}</h1>",
            f'<p class="muted">base <code>{html.escape(base_name)}</code> ({html.escape(diff.base.container)}, '
            f'{html.escape(diff.base.generation)}) → head <code>{html.escape(head_name)}</code> '
            f'({html.escape(diff.head.container)}, {html.escape(diff.head.generation)})</p>']
    body += _verdict(verdict)
    body += [f'<p class="warning">{html.escape(w)}</p>' for w in diff.warnings]
    body.append(_toolbar(compare=True))
    devices = []
    base_devices = {d.device: d for d in base.devices}
    head_devices = {d.device: d for d in head.devices}
    for d in diff.devices:
        f = folded[d.device]
        body.append(f"<h2>device {d.device}: {html.escape(peak_line(d))}</h2>")
        body += [f"<p>{html.escape(line)}</p>" for line in (where_line(d), kept_line(d)) if line]
        body.append(_charts(d.device))
        if d.phases:
            body += ["<h3>Phase peaks</h3>", _table(PHASE_HEADERS, phase_rows(d))]
        if d.categories:
            body += ["<h3>Categories at the compared moment</h3>", _table(CATEGORY_HEADERS, category_rows(d))]
        body += ["<h3>What changed</h3>", _diff_rows(d.device, f)]
        devices.append({"device": d.device,
                        "runs": [_run("base", base_name, base_devices.get(d.device)),
                                 _run("head", head_name, head_devices.get(d.device))],
                        "rows": {f"r{k}": _row_data(r) for k, r in enumerate(f.shown)}})
    return _page(title, body, {"kind": "diff", "devices": devices})


def _peak_rows(device: int, p: DevicePeak) -> str:
    rows, attrs = [], []
    for k, r in enumerate(p.rows):
        rows.append([r.label, f"{r.count:,}", format_bytes(r.bytes), f"{r.share_pct:.1f}%", r.category, r.site])
        attrs.append(f' class="row" tabindex="0" data-device="{device}" data-row="r{k}"' if r.signature else "")
    t = p.total
    rows.append([t.label, f"{t.count:,}", format_bytes(t.bytes), f"{t.share_pct:.1f}%", "", t.site])
    attrs.append(' class="total"')
    return _table(["#", "count", "bytes", "share", "category", "site"], rows, left=(0, 4, 5), attrs=attrs)


def _peak_row_data(r: PeakRow) -> Dict[str, Any]:
    return {"title": f"{r.site} ({r.category}) {format_bytes(r.bytes)}", "signatures": [r.signature],
            "stacks": [{"side": "run", "count": r.count, "bytes": r.bytes, "frames": _stack(r.frames)}]}


def render_peak(summary: Summary, peaks: List[DevicePeak]) -> str:
    """The peak report of one run as one self-contained HTML page."""
    name = summary.source.file
    title = f"memdiff peak: {name}"
    body = [f"<h1>{html.escape(title)}</h1>",
            f'<p class="muted"><code>{html.escape(name)}</code> ({html.escape(summary.source.container)}, '
            f'{html.escape(summary.source.generation)})</p>', _toolbar(compare=False)]
    devices = []
    for p in peaks:
        d = p.device
        where = f", {d.phase_at_peak}" + (f" of step {d.step_at_peak}" if d.step_at_peak is not None else "") \
            if d.phase_at_peak else ""
        body.append(f"<h2>device {d.device}: peak {html.escape(format_bytes(d.peak_bytes))}{html.escape(where)}; "
                    f"static {html.escape(format_bytes(d.static_bytes))}</h2>")
        body.append(_charts(d.device))
        body += ["<h3>Categories at the peak</h3>",
                 _table(["category", "bytes", "share"],
                        [[c, format_bytes(b), f"{s:.1f}%"] for c, b, s in p.categories])]
        body += ["<h3>Groups live at the peak</h3>", _peak_rows(d.device, p)]
        devices.append({"device": d.device, "runs": [_run("run", name, d)],
                        "rows": {f"r{k}": _peak_row_data(r) for k, r in enumerate(p.rows) if r.signature}})
    return _page(title, body, {"kind": "peak", "devices": devices})
