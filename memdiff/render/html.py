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
from importlib import resources
from typing import Any, Dict, List, Sequence

from memdiff.analyse.peak import DevicePeak, PeakRow, page_title
from memdiff.compare.findings import BY_CODE, ERROR, INFO, WARNING
from memdiff.compare.trend import TREND_HEADERS, Trend
from memdiff.model import Finding, Summary
from memdiff.render.table import row_table
from memdiff.report.build import Report
from memdiff.report.chart import run_data
from memdiff.report.types import DeviceReport, ShownRow, Table, stack_lines


def _asset(name: str) -> str:
    return (resources.files("memdiff") / "render" / name).read_text(encoding="utf-8")


def _row_data(r: ShownRow) -> Dict[str, Any]:
    return {"title": r.title, "signatures": sorted({st.signature for st in r.stacks}),
            "stacks": [{"side": st.side, "count": st.count, "bytes": st.bytes,
                        "frames": st.shown}
                       for st in r.stacks]}


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


def _laid(t: Table, attrs: Sequence[str] = ()) -> str:
    return _table(t.headers, t.rows, left=t.left, attrs=attrs)


def _diff_rows(d: DeviceReport, marked: bool = True) -> str:
    """The row table; `marked` rows carry what the script needs to show their stacks."""
    attrs = [f' class="row {r.row.status}" tabindex="0" data-device="{d.device}" data-row="r{k}"' if marked
             else f' class="{r.row.status}"' for k, r in enumerate(d.rows)]
    attrs += [""] * (d.others is not None) + [' class="total"']
    return _laid(row_table(d), attrs)


def _finding(f: Finding, css: str = "") -> str:
    """A finding with its code linked to the code's documentation at the foot of the page."""
    kind = css or {ERROR: "error", WARNING: "warning", INFO: "muted"}[f.severity]
    return (f'<p class="{kind}"><a class="mono" href="#rule-{f.code.lower()}">{f.code}</a> '
            f"{html.escape(f.text)}</p>")


def _rules(findings: Sequence[Finding]) -> List[str]:
    """The documentation of each code shown (findings.py's catalogue), for the links to land on, in
    the order the page first shows each code."""
    codes = list(dict.fromkeys(f.code for f in findings))
    if not codes:
        return []
    out = ["<h2>Findings</h2>"]
    for c in (BY_CODE[code] for code in codes):
        out += [f'<details id="rule-{c.code.lower()}" open><summary><strong>{c.code} {c.name}</strong> '
                f"({c.severity})</summary>",
                *(f"<p><strong>{title}</strong> {html.escape(said)}</p>"
                  for title, said in (("What it means:", c.means), ("Why it matters:", c.why), ("What to do:", c.fix))),
                "</details>"]
    return out


def _verdict(report: Report) -> List[str]:
    mark = "none" if report.passed is None else "pass" if report.passed else "fail"
    passed = "null" if report.passed is None else str(report.passed).lower()
    out = [f'<p class="verdict {mark}" data-passed="{passed}">{html.escape(report.verdict_line)}</p>',
           f'<p class="headline">{html.escape(report.headline)}</p>',
           f"<p><strong>Rule:</strong> {html.escape(report.rule_line)}</p>", "<ul>"]
    out += [f'<li class="mono {"pass" if c.passed else "fail"}">{html.escape(c.text)}</li>' for c in report.check_lines]
    out.append("</ul>")
    out += [_finding(n, "muted") for n in report.notes]
    return out


def _buy_back(report: Report) -> List[str]:
    """What buys the regression back (--whatif): a list of changes, then the notes."""
    if report.buy_back is None:
        return []
    out = ['<section class="buy-back">', "<h2>What buys it back</h2>", "<ul>"]
    out += [f'<li class="mono {"pass" if b.enough else "fail"}" data-change="{html.escape(b.change)}">'
            f"{html.escape(b.text)}</li>" for b in report.buy_back.items]
    out.append("</ul>")
    out += [_finding(n, "muted") for n in report.buy_back.notes]
    return out + ["</section>"]


def _like_for_like(d: DeviceReport) -> List[str]:
    """The device compared at the head's peak phase in both runs, one click away."""
    like = d.like_for_like
    if like is None:
        return []
    out = [f'<details class="like-for-like"><summary>Compare like with like: {html.escape(like.heading)}</summary>']
    if like.categories is not None:
        out += ["<h3>Categories at that moment</h3>", _laid(like.categories)]
    out += ["<h3>What changed at that moment</h3>", _diff_rows(like, marked=False), "</details>"]
    return out


TREND_WIDTH, TREND_HEIGHT, TREND_PAD = 640, 150, 14  # the trend chart's drawing box, in SVG units


def _trend_svg(t: Trend) -> str:
    """The main-branch peaks as a line of points, oldest on the left, and this run's point after
    them, marked; each point's commit, date and peak in its tooltip (the table's figures)."""
    values = [p.peak_bytes for p in t.points] + [t.head_bytes]
    lo, hi = min(values), max(values)
    step = (TREND_WIDTH - 2 * TREND_PAD) / max(1, len(values) - 1)

    def y(v: int) -> float:  # the lowest peak at the bottom, the highest at the top; all equal: the middle
        if hi == lo:
            return TREND_HEIGHT / 2
        return TREND_HEIGHT - TREND_PAD - (v - lo) / (hi - lo) * (TREND_HEIGHT - 2 * TREND_PAD)
    xy = [(TREND_PAD + k * step, y(v)) for k, v in enumerate(values)]
    line = " ".join(f"{x:.1f},{yy:.1f}" for x, yy in xy[:-1])
    out = [f'<svg class="trend" role="img" viewBox="0 0 {TREND_WIDTH} {TREND_HEIGHT}" width="{TREND_WIDTH}" '
           f'height="{TREND_HEIGHT}" data-device="{t.device}" aria-label="{html.escape(t.text)}">',
           f'<polyline class="trend-main" fill="none" points="{line}"></polyline>',
           f'<line class="trend-step" x1="{xy[-2][0]:.1f}" y1="{xy[-2][1]:.1f}" x2="{xy[-1][0]:.1f}" '
           f'y2="{xy[-1][1]:.1f}"></line>']
    for (x, yy), p, title in zip(xy, t.points, t.point_titles):
        out.append(f'<circle class="trend-point" cx="{x:.1f}" cy="{yy:.1f}" r="3.5" '
                   f'data-commit="{html.escape(p.commit)}" data-bytes="{p.peak_bytes}">'
                   f"<title>{html.escape(title)}</title></circle>")
    out.append(f'<circle class="trend-head" cx="{xy[-1][0]:.1f}" cy="{xy[-1][1]:.1f}" r="6" '
               f'data-bytes="{t.head_bytes}"><title>{html.escape(t.head_title)}</title></circle>')
    return "".join(out) + "</svg>"


def _trends(report: Report) -> List[str]:
    """The main-branch trend of each device (--history): the chart, the sentence, the table."""
    if report.trends is None:
        return []
    out = ['<section class="trends">', "<h2>Peak on the main branch</h2>"]
    for t in report.trends:
        out += [f"<h3>{html.escape(t.workload)}, device {t.device}</h3>", _trend_svg(t),
                f'<p class="trend-text">{html.escape(t.text)}</p>',
                _table(TREND_HEADERS, t.rows, left=(0, 1), attrs=[' class="trend-head-row"'])]
    if report.trend_note:
        out.append(_finding(report.trend_note, "muted"))
    return out + ["</section>"]


def render_diff(report: Report) -> str:
    """The diff (or gate) report as one self-contained HTML page; a job's shows its worst rank."""
    shown = report.shown
    title = report.title
    body = [f"<h1>{html.escape(title)}</h1>",
            '<p class="muted">' + " → ".join(f"{i.role} <code>{html.escape(i.file)}</code> ({html.escape(i.facts)})"
                                            for i in report.inputs) + "</p>"]
    body += _verdict(report)
    body += _buy_back(report)
    if report.job is not None:
        body += [f"<p><strong>{html.escape(report.job.summary_line)}</strong>; {html.escape(report.job.worst_line)}"
                 "</p>", _laid(report.job.table)]
    body += [_finding(f) for f in report.findings]
    body.append(_toolbar(compare=True))
    devices = []
    base_devices = {d.device: d for d in shown.base.devices}
    head_devices = {d.device: d for d in shown.head.devices}
    for d in report.devices:
        body.append(f"<h2>{html.escape(d.heading)}</h2>")
        body += [f"<p>{html.escape(line)}</p>" for line in d.lines]
        body += _like_for_like(d)
        body.append(_charts(d.device))
        if d.phases is not None:
            body += ["<h3>Phase peaks</h3>", _laid(d.phases)]
        if d.categories is not None:
            body += ["<h3>Categories at the compared moment</h3>", _laid(d.categories)]
        body += ["<h3>What changed</h3>", _diff_rows(d)]
        devices.append({"device": d.device,
                        "runs": [run_data("base", report.base_name, base_devices.get(d.device)),
                                 run_data("head", report.head_name, head_devices.get(d.device))],
                        "rows": {f"r{k}": _row_data(r) for k, r in enumerate(d.rows)}})
    body += _trends(report)
    body += _rules([*report.notes, *(report.buy_back.notes if report.buy_back else []), *report.findings,
                    *([report.trend_note] if report.trend_note else [])])
    return _page(title, body, {"kind": "diff", "devices": devices})


def _peak_rows(device: int, p: DevicePeak) -> str:
    rows, attrs = [], []
    for k, r in enumerate(p.rows):
        rows.append([*r.cells, r.site])
        attrs.append(f' class="row" tabindex="0" data-device="{device}" data-row="r{k}"' if r.signature else "")
    t = p.total
    rows.append([*t.cells, t.site])
    attrs.append(' class="total"')
    return _table(["#", "count", "bytes", "share", "category", "site"], rows, left=(0, 4, 5), attrs=attrs)


def _peak_row_data(r: PeakRow) -> Dict[str, Any]:
    return {"title": r.title, "signatures": [r.signature],
            "stacks": [{"side": "run", "count": r.count, "bytes": r.bytes, "frames": stack_lines(r.frames)}]}


def render_peak(summary: Summary, peaks: List[DevicePeak], run_findings: Sequence[Finding]) -> str:
    """The peak report of one run as one self-contained HTML page: the findings about the run as a
    whole, then each device's."""
    name = summary.source.file
    title = page_title(summary)
    body = [f"<h1>{html.escape(title)}</h1>",
            f'<p class="muted"><code>{html.escape(name)}</code> ({html.escape(summary.source.container)}, '
            f'{html.escape(summary.source.generation)})</p>', *(_finding(f) for f in run_findings),
            _toolbar(compare=False)]
    devices = []
    for p in peaks:
        d = p.device
        body.append(f"<h2>{html.escape(p.heading)}</h2>")
        # the text's facts (static, at dump, reserved, the trace's length), each (what, figure, words)
        body.append(_table(["fact", "size", "detail"], p.facts, left=(0, 2)))
        body += [_finding(f) for f in p.findings]
        body.append(_charts(d.device))
        body += ["<h3>Categories at the peak</h3>",
                 _table(["category", "bytes", "share"],
                        [c.cells for c in p.categories])]
        body += ["<h3>Groups live at the peak</h3>", _peak_rows(d.device, p)]
        devices.append({"device": d.device, "runs": [run_data("run", name, d)],
                        "rows": {f"r{k}": _peak_row_data(r) for k, r in enumerate(p.rows) if r.signature}})
    body += _rules([*run_findings, *(f for p in peaks for f in p.findings)])
    return _page(title, body, {"kind": "peak", "devices": devices})
