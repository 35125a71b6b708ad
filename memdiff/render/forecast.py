"""What `memdiff forecast` prints (text, markdown, json, html): it lays out the Forecast and decides nothing."""

from __future__ import annotations

import html
import os
from typing import List

from tabulate import tabulate

from memdiff.compare.findings import shown
from memdiff.inert import md_cell, md_code, md_text
from memdiff.predict.forecast.engine import DeviceForecast, Forecast
from memdiff.render.json import dumps
from memdiff.units import format_bytes


def _cells(rows: List[List[str]], fmt: str) -> List[List[str]]:
    """The cells as the format reads them: markdown escapes every cell (names come from snapshots)."""
    return [[md_cell(c) for c in row] for row in rows] if fmt == "github" else rows


def _runs_table(d: DeviceForecast, fmt: str) -> str:
    rows = [[os.path.basename(r.file), f"{r.value:,}", format_bytes(r.actual_peak_bytes), r.actual_phase or "",
             r.fitted_text, "" if r.predicted_peak_bytes is None else format_bytes(r.predicted_peak_bytes),
             r.error_text] for r in d.runs]
    headers = ["run", "value", "peak", "phase", "fitted", "predicted without it", "error"]
    return tabulate(_cells(rows, fmt), headers=headers,
                    tablefmt=fmt, colalign=("left", "right", "right", "left", "left", "right", "right"))


def _predictions_table(d: DeviceForecast, fmt: str) -> str:
    phases = [name for name in ("forward", "backward", "optimizer")
              if any(name in p.phase_peaks for p in d.predictions)]
    rows = [[f"{p.value:,}", format_bytes(p.peak_bytes), p.phase or "", *[format_bytes(p.phase_peaks.get(name, 0))
                                                                        for name in phases]]
            for p in d.predictions]
    return tabulate(_cells(rows, fmt), headers=["value", "predicted peak", "phase", *phases], tablefmt=fmt,
                    colalign=("right", "right", "left") + ("right",) * len(phases))


def _at_peak_tables(d: DeviceForecast, fmt: str) -> List[str]:
    p = d.predictions[0]
    cats = tabulate(_cells([[name, format_bytes(b), d.forms.get(name, "")] for name, b in p.categories.items()], fmt),
                    headers=["category", f"at {p.value:,}", "form"], tablefmt=fmt, colalign=("left", "right", "left"))
    low, high = d.growth_between
    sites = tabulate(_cells([[s.site, s.category, s.form, s.runs_growth_text,
                              format_bytes(s.largest_run_bytes), format_bytes(s.bytes),
                              format_bytes(s.growth_bytes, signed=True)] for s in p.sites], fmt),
                     headers=["growing site", "category", "form", f"{low:,} to {high:,}", "largest run",
                              f"at {p.value:,}", "growth"],
                     tablefmt=fmt, colalign=("left", "left", "left", "right", "right", "right", "right"))
    return [cats, sites]


def render_text(f: Forecast) -> str:
    """The forecast for a terminal."""
    out = []
    for d in f.devices:
        out.append(f"memdiff: {d.headline}")
    if f.headroom is not None:
        out.append(f.headroom.line)
    out.append("")
    out.append("runs   " + ", ".join(f"{name}={v:,}" for name, v in f.runs))
    out += [f"note: {n}" for n in f.notes]
    if f.budget_line is not None:
        out.append(f.budget_line)
    for d in f.devices:
        out += ["", f"device {d.device}: {d.alignment}"]
        out += [shown(n) for n in d.notes]
        out += ["", _runs_table(d, "simple"), "", _predictions_table(d, "simple")]
        out += ["", f"{d.at_peak}:"]
        out += ["", *("\n\n".join(_at_peak_tables(d, "simple")).split("\n"))]
        if d.within_line is not None:
            out += ["", d.within_line]
    return "\n".join(out) + "\n"


def render_markdown(f: Forecast) -> str:
    """The forecast for a pull-request comment or a job summary."""
    out = ["### memdiff forecast", ""]
    out += [f"**{md_text(d.headline)}**" for d in f.devices]
    if f.headroom is not None:
        out += ["", ("✅ " if f.headroom.passed else "❌ ") + md_text(f.headroom.line)]
    out += ["", "runs: " + ", ".join(f"{md_code(name)}={v:,}" for name, v in f.runs)]
    out += [f"> {md_text(n)}" for n in f.notes]
    if f.budget_line is not None:
        out += ["", md_text(f.budget_line)]
    for d in f.devices:
        out += ["", f"#### device {d.device}", "", md_text(d.alignment), ""]
        out += [f"> `{n.code}` {md_text(n.text)}" for n in d.notes]
        out += ["", _runs_table(d, "github"), "", _predictions_table(d, "github"), "", f"{md_text(d.at_peak)}:", ""]
        out += ["\n\n".join(_at_peak_tables(d, "github"))]
        out += ["", md_text(d.within_line)] if d.within_line is not None else []
    return "\n".join(out) + "\n"


def render_json(f: Forecast) -> str:
    """The forecast document (schemas/forecast.schema.json)."""
    return dumps(f.to_dict())


def render_html(f: Forecast) -> str:
    """One self-contained page: the markdown's tables as HTML tables."""
    body = [f"<h2>{html.escape(d.headline)}</h2>" for d in f.devices]
    body += [f"<p>{html.escape(f.headroom.line)}</p>"] if f.headroom is not None else []
    body.append("<p>runs: " + ", ".join(f"<code>{html.escape(name)}</code>={v:,}" for name, v in f.runs) + "</p>")
    body += [f"<p class=note>{html.escape(n)}</p>" for n in f.notes]
    body += [f"<p>{html.escape(f.budget_line)}</p>"] if f.budget_line is not None else []
    for d in f.devices:
        body += [f"<h3>device {d.device}</h3>", f"<p>{html.escape(d.alignment)}</p>"]
        body += [f"<p class=note>{n.code} {html.escape(n.text)}</p>" for n in d.notes]
        body += [_runs_table(d, "html"), _predictions_table(d, "html"), f"<p>{html.escape(d.at_peak)}:</p>",
                 *_at_peak_tables(d, "html")]
        body += [f"<p>{html.escape(d.within_line)}</p>"] if d.within_line is not None else []
    style = ("body{font:14px system-ui,sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
             "td,th{padding:2px 10px;border-bottom:1px solid #ddd;text-align:right}.note{color:#555}")
    return ("<!doctype html><html><head><meta charset=utf-8><title>memdiff forecast</title>"
            f"<style>{style}</style></head><body><h1>memdiff forecast</h1>{''.join(body)}</body></html>\n")
