"""`memdiff fit --html FILE`: the emulated peak against the knob, one chart per GPU, as a static page.

The page takes render/html.py's style sheet and its offline rules (everything inline, a
Content-Security-Policy that forbids any fetch) and no script: each chart is inline SVG written
here, every point carrying its run's figures as attributes (data-value, data-peak-bytes,
data-reserved-bytes), so what is drawn can be read back. It lays out the FitResult; it decides nothing.
"""

from __future__ import annotations

import html
from importlib import resources
from typing import List, Tuple

from tabulate import tabulate

from memdiff.predict.fit import SMALLEST, FitResult, FitRun, GpuFit
from memdiff.units import format_bytes

WIDTH, HEIGHT = 720, 300
LEFT, RIGHT, TOP, BOTTOM = 78, 16, 14, 34  # the plot area's margins: the axes' labels sit in them
TICKS = 5

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


def _scale(g: GpuFit) -> Tuple[int, int, int]:
    """The x range (the values run, and the found one) and the y top (the capacity or the highest peak)."""
    xs = [r.value for r in g.runs] or [1]
    top = max([g.capacity_bytes] + [r.reserved_peak_bytes or 0 for r in g.runs])
    return min(xs), max(xs), int(top * 1.08)


def _svg(g: GpuFit, knob: str) -> str:
    """One GPU's chart: a line of allocated and one of reserved peaks over the runs, each run a point
    (marked by how it ended), the capacity (and --max-memory's limit) across, the found value upright."""
    lo, hi, top = _scale(g)
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(v: int) -> float:
        return LEFT + (w / 2 if hi == lo else (v - lo) / (hi - lo) * w)

    def y(b: int) -> float:
        return TOP + h - b / top * h

    runs = sorted((r for r in g.runs if r.peak_bytes is not None), key=lambda r: r.value)
    out = [f'<svg class="fit" role="img" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
           f'data-gpu="{html.escape(g.gpu)}" data-y-top-bytes="{top}" '
           f'aria-label="{html.escape(g.line)}">', '<g class="axis">',
           f'<line x1="{LEFT}" y1="{TOP + h}" x2="{LEFT + w}" y2="{TOP + h}"></line>',
           f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + h}"></line>']
    for k in range(TICKS + 1):
        b = top * k // TICKS
        out.append(f'<text x="{LEFT - 6}" y="{y(b) + 4:.1f}" text-anchor="end">{html.escape(format_bytes(b))}</text>')
    for v in sorted({lo + (hi - lo) * k // TICKS for k in range(TICKS + 1)}):
        out.append(f'<text x="{x(v):.1f}" y="{TOP + h + 16}" text-anchor="middle">{v:,}</text>')
    out.append(f'<text x="{LEFT + w / 2:.1f}" y="{HEIGHT - 2}" text-anchor="middle">{html.escape(knob)}</text></g>')
    out.append(f'<line class="capacity" x1="{LEFT}" x2="{LEFT + w}" y1="{y(g.capacity_bytes):.1f}" '
               f'y2="{y(g.capacity_bytes):.1f}" data-bytes="{g.capacity_bytes}"><title>capacity '
               f'{html.escape(format_bytes(g.capacity_bytes))}</title></line>')
    if g.limit_bytes != g.capacity_bytes:
        out.append(f'<line class="limit" x1="{LEFT}" x2="{LEFT + w}" y1="{y(g.limit_bytes):.1f}" '
                   f'y2="{y(g.limit_bytes):.1f}" data-bytes="{g.limit_bytes}"><title>--max-memory limit '
                   f'{html.escape(format_bytes(g.limit_bytes))}</title></line>')
    if g.value is not None:
        out.append(f'<line class="found" x1="{x(g.value):.1f}" x2="{x(g.value):.1f}" y1="{TOP}" y2="{TOP + h}" '
                   f'data-value="{g.value}"><title>the answer: {g.value:,}</title></line>')
    for series, field in (("allocated", "peak_bytes"), ("reserved", "reserved_peak_bytes")):
        points = [(r, getattr(r, field)) for r in runs if getattr(r, field) is not None]
        line = " ".join(f"{x(r.value):.1f},{y(b):.1f}" for r, b in points)
        out.append(f'<polyline class="series {series}" data-gpu="{html.escape(g.gpu)}" '
                   f'data-series="{series}" points="{line}"></polyline>')
        for r, b in points:
            out.append(f'<circle class="{series} {r.outcome}" cx="{x(r.value):.1f}" cy="{y(b):.1f}" '
                       f'r="{3.5 if r.fits else 5}" data-series="{series}" data-value="{r.value}" '
                       f'data-outcome="{r.outcome}" data-bytes="{b}"><title>{html.escape(_tip(r, series, b))}'
                       "</title></circle>")
    for r in runs:
        if not r.fits:
            out.append(f'<text class="oom-mark" x="{x(r.value):.1f}" y="{TOP + 10}" text-anchor="middle">'
                       f'{"✕" if r.outcome == "oom" else "!"}</text>')
    return "".join(out) + "</svg>"


def _tip(r: FitRun, series: str, b: int) -> str:
    return f"{r.value:,}: {series} peak {format_bytes(b)}, {r.outcome} ({r.why})"


def _gpu(g: GpuFit, knob: str) -> List[str]:
    out = [f"<h2>{html.escape(g.gpu)} <span class=\"muted\">{html.escape(g.name)}</span></h2>",
           f"<p>{html.escape(g.line)}</p>", _svg(g, knob)]
    items: List[str] = []
    for line in g.details:  # a line led by two spaces is about the one above: a list inside that item
        if line.startswith("  ") and items:
            items[-1] += f'<ul><li class="mono">{html.escape(line.strip())}</li></ul>'
        else:
            items.append(html.escape(line))
    out.append('<ul class="details">' + "".join(f"<li>{i}</li>" for i in items) + "</ul>")
    rows = [[f"{r.value:,}", r.outcome, format_bytes(r.peak_bytes) if r.peak_bytes is not None else "",
             format_bytes(r.reserved_peak_bytes) if r.reserved_peak_bytes is not None else "", r.why]
            for r in sorted(g.runs, key=lambda r: r.value)]
    out.append(tabulate(rows, headers=[knob, "outcome", "allocated peak", "reserved peak", "why run"],
                        tablefmt="html"))
    return out


def render_fit_html(result: FitResult) -> str:
    """The fit as a self-contained page: per GPU its chart of peak against the knob and its runs' table."""
    css = (resources.files("memdiff") / "render" / "report.css").read_text(encoding="utf-8")
    which = "fewest" if result.direction == SMALLEST else "largest"
    body = [f"<h1>memdiff fit: {which} {html.escape(result.knob)} that trains</h1>",
            f"<p class=\"mono\">{html.escape(' '.join(result.command))}</p>",
            f"<p>{html.escape(result.knob_line)}; {result.runs} emulated runs in {result.seconds:.1f} s</p>",
            '<p class="key muted"><span>— allocated peak</span><span>- - reserved peak</span>'
            f"<span>— capacity</span><span>┆ {which} that fits</span><span>✕ out of memory</span></p>"]
    for g in result.gpus:
        body += _gpu(g, result.knob)
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; style-src \'unsafe-inline\'">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<meta name="color-scheme" content="light dark">',
        f"<title>memdiff fit {html.escape(result.knob)}</title>", f"<style>{css}{CSS}</style>", "</head>",
        "<body>", "<main>", *body, "</main>", "</body>", "</html>", ""])
