"""`memdiff fit --html FILE`: the emulated peak against the knob, one chart per GPU, as a static page.

The page takes render/html.py's style sheet and its offline rules (everything inline, a
Content-Security-Policy that forbids any fetch) and no script: each chart is inline SVG written
here, every point carrying its run's figures as attributes (data-value, data-peak-bytes,
data-reserved-bytes), so what is drawn can be read back. It lays out the FitResult; it decides nothing.
"""

from __future__ import annotations

import html
from importlib import resources
from typing import List

from tabulate import tabulate

from memdiff.predict.fit_result import FitChart, FitResult, GpuFit

WIDTH, HEIGHT = 720, 300
LEFT, RIGHT, TOP, BOTTOM = 78, 16, 14, 34  # the plot area's margins: the axes' labels sit in them

CSS = """
svg.fit { display: block; max-width: 100%; }
svg.fit .allocated { stroke: var(--accent); fill: none; stroke-width: 1.6; }
svg.fit .reserved { stroke: var(--grew); fill: none; stroke-width: 1.6; stroke-dasharray: 5 3; }
svg.fit circle.allocated { fill: var(--accent); stroke: none; }
svg.fit circle.reserved { fill: var(--bg); stroke: var(--grew); stroke-dasharray: none; }
svg.fit circle.oom, svg.fit circle.over-limit { stroke-width: 2.5; }
svg.fit .capacity { stroke: var(--fg); stroke-width: 1.4; }
svg.fit .limit { stroke: var(--muted); stroke-dasharray: 2 3; }
svg.fit .found { stroke: var(--shrank); stroke-width: 1.4; stroke-dasharray: 4 3; }
svg.fit text.oom-mark { fill: var(--grew); font-weight: 600; }
svg.fit .axis line { stroke: var(--line); }
.key span { margin-right: 14px; }
"""


def _svg(g: GpuFit, c: FitChart, knob: str) -> str:
    """One GPU's chart: a line of allocated and one of reserved peaks over the runs, each run a point
    (marked by how it ended), the capacity (and --max-memory's limit) across, the found value upright."""
    lo, hi, top = c.x_low, c.x_high, c.top_bytes
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(v: int) -> float:
        return LEFT + (w / 2 if hi == lo else (v - lo) / (hi - lo) * w)

    def y(b: int) -> float:
        return TOP + h - b / top * h

    out = [f'<svg class="fit" role="img" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
           f'data-gpu="{html.escape(g.gpu)}" data-y-top-bytes="{top}" '
           f'aria-label="{html.escape(g.line)}">', '<g class="axis">',
           f'<line x1="{LEFT}" y1="{TOP + h}" x2="{LEFT + w}" y2="{TOP + h}"></line>',
           f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + h}"></line>']
    for b, label in c.y_ticks:
        out.append(f'<text x="{LEFT - 6}" y="{y(b) + 4:.1f}" text-anchor="end">{html.escape(label)}</text>')
    for v, label in c.x_ticks:
        out.append(f'<text x="{x(v):.1f}" y="{TOP + h + 16}" text-anchor="middle">{html.escape(label)}</text>')
    out.append(f'<text x="{LEFT + w / 2:.1f}" y="{HEIGHT - 2}" text-anchor="middle">{html.escape(knob)}</text></g>')
    out.append(f'<line class="capacity" x1="{LEFT}" x2="{LEFT + w}" y1="{y(g.capacity_bytes):.1f}" '
               f'y2="{y(g.capacity_bytes):.1f}" data-bytes="{g.capacity_bytes}"><title>'
               f'{html.escape(c.capacity_title)}</title></line>')
    if c.limit_title is not None:
        out.append(f'<line class="limit" x1="{LEFT}" x2="{LEFT + w}" y1="{y(g.limit_bytes):.1f}" '
                   f'y2="{y(g.limit_bytes):.1f}" data-bytes="{g.limit_bytes}"><title>'
                   f'{html.escape(c.limit_title)}</title></line>')
    if g.value is not None and c.found_title is not None:
        out.append(f'<line class="found" x1="{x(g.value):.1f}" x2="{x(g.value):.1f}" y1="{TOP}" y2="{TOP + h}" '
                   f'data-value="{g.value}"><title>{html.escape(c.found_title)}</title></line>')
    for series, points in c.series.items():
        line = " ".join(f"{x(p.value):.1f},{y(p.bytes):.1f}" for p in points)
        out.append(f'<polyline class="series {series}" data-gpu="{html.escape(g.gpu)}" '
                   f'data-series="{series}" points="{line}"></polyline>')
        for p in points:
            out.append(f'<circle class="{series} {p.outcome}" cx="{x(p.value):.1f}" cy="{y(p.bytes):.1f}" '
                       f'r="{3.5 if p.fits else 5}" data-series="{series}" data-value="{p.value}" '
                       f'data-outcome="{p.outcome}" data-bytes="{p.bytes}"><title>{html.escape(p.title)}'
                       "</title></circle>")
    for v, mark in c.marks:
        out.append(f'<text class="oom-mark" x="{x(v):.1f}" y="{TOP + 10}" text-anchor="middle">{mark}</text>')
    return "".join(out) + "</svg>"


def _gpu(g: GpuFit, c: FitChart, knob: str) -> List[str]:
    out = [f"<h2>{html.escape(g.gpu)} <span class=\"muted\">{html.escape(g.name)}</span></h2>",
           f"<p>{html.escape(g.line)}</p>", _svg(g, c, knob)]
    items: List[str] = []
    for line in g.details:  # a line led by two spaces is about the one above: a list inside that item
        if line.startswith("  ") and items:
            items[-1] += f'<ul><li class="mono">{html.escape(line.strip())}</li></ul>'
        else:
            items.append(html.escape(line))
    out.append('<ul class="details">' + "".join(f"<li>{i}</li>" for i in items) + "</ul>")
    out.append(tabulate(c.table.rows, headers=c.table.headers, tablefmt="html"))
    return out


def render_fit_html(result: FitResult) -> str:
    """The fit as a self-contained page: per GPU its chart of peak against the knob and its runs' table."""
    css = (resources.files("memdiff") / "render" / "report.css").read_text(encoding="utf-8")
    words = result.words
    body = [f"<h1>{html.escape(words.page_title)}</h1>",
            f"<p class=\"mono\">{html.escape(' '.join(result.command))}</p>",
            f"<p>{html.escape(result.knob_line)}; {html.escape(words.runs_said)}</p>",
            '<p class="key muted"><span>— allocated peak</span><span>- - reserved peak</span>'
            f"<span>— capacity</span><span>┆ {html.escape(words.which)} that fits</span>"
            "<span>✕ out of memory</span></p>"]
    for g, chart in zip(result.gpus, words.charts):
        body += _gpu(g, chart, result.knob)
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; style-src \'unsafe-inline\'">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<meta name="color-scheme" content="light dark">',
        f"<title>memdiff fit {html.escape(result.knob)}</title>", f"<style>{css}{CSS}</style>", "</head>",
        "<body>", "<main>", *body, "</main>", "</body>", "</html>", ""])
