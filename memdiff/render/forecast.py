"""What `memdiff forecast` prints (text, markdown, json, html): it lays out the Forecast and decides nothing."""

from __future__ import annotations

import html
from typing import List

from memdiff.compare.findings import shown
from memdiff.inert import md_cell, md_code, md_text
from memdiff.predict.forecast.engine import DeviceForecast, Forecast
from memdiff.render.json import dumps
from memdiff.render.table import layout


def _tables(d: DeviceForecast, fmt: str) -> List[str]:
    """The device's tables in `fmt`: markdown escapes every cell (names come from snapshots)."""
    escape = md_cell if fmt == "github" else str
    return [layout(t, fmt, escape) for t in (d.runs_table, d.predictions_table, d.categories_table, d.sites_table)]


def render_text(f: Forecast) -> str:
    """The forecast for a terminal."""
    out = []
    for d in f.devices:
        out.append(f"memdiff: {d.headline}")
    if f.headroom is not None:
        out.append(f.headroom.line)
    out.append("")
    out.append("runs   " + ", ".join(f"{name}={v}" for name, v in f.runs_said))
    out += [f"note: {n}" for n in f.notes]
    if f.budget_line is not None:
        out.append(f.budget_line)
    for d in f.devices:
        runs, predictions, categories, sites = _tables(d, "simple")
        out += ["", f"device {d.device}: {d.alignment}"]
        out += [shown(n) for n in d.notes]
        out += ["", runs, "", predictions]
        out += ["", f"{d.at_peak}:"]
        out += ["", *f"{categories}\n\n{sites}".split("\n")]
        if d.within_line is not None:
            out += ["", d.within_line]
    return "\n".join(out) + "\n"


def render_markdown(f: Forecast) -> str:
    """The forecast for a pull-request comment or a job summary."""
    out = ["### memdiff forecast", ""]
    # Consecutive lines end in a hard break (two spaces), as the diff's alerts do: else markdown runs a
    # device's headline into the next, and each note into the next, as one paragraph.
    out += [f"**{md_text(d.headline)}**  " for d in f.devices]
    if f.headroom is not None:
        out += ["", ("✅ " if f.headroom.passed else "❌ ") + md_text(f.headroom.line)]
    out += ["", "runs: " + ", ".join(f"{md_code(name)}={v}" for name, v in f.runs_said)]
    out += [f"> {md_text(n)}  " for n in f.notes]
    if f.budget_line is not None:
        out += ["", md_text(f.budget_line)]
    for d in f.devices:
        runs, predictions, categories, sites = _tables(d, "github")
        out += ["", f"#### device {d.device}", "", md_text(d.alignment), ""]
        out += [f"> `{n.code}` {md_text(n.text)}  " for n in d.notes]
        out += ["", runs, "", predictions, "", f"{md_text(d.at_peak)}:", ""]
        out += [f"{categories}\n\n{sites}"]
        out += ["", md_text(d.within_line)] if d.within_line is not None else []
    return "\n".join(out) + "\n"


def render_json(f: Forecast) -> str:
    """The forecast document (schemas/forecast.schema.json)."""
    return dumps(f.to_dict())


def render_html(f: Forecast) -> str:
    """One self-contained page: the markdown's tables as HTML tables."""
    body = [f"<h2>{html.escape(d.headline)}</h2>" for d in f.devices]
    body += [f"<p>{html.escape(f.headroom.line)}</p>"] if f.headroom is not None else []
    body.append("<p>runs: " + ", ".join(f"<code>{html.escape(name)}</code>={v}" for name, v in f.runs_said) + "</p>")
    body += [f"<p class=note>{html.escape(n)}</p>" for n in f.notes]
    body += [f"<p>{html.escape(f.budget_line)}</p>"] if f.budget_line is not None else []
    for d in f.devices:
        runs, predictions, categories, sites = _tables(d, "html")
        body += [f"<h3>device {d.device}</h3>", f"<p>{html.escape(d.alignment)}</p>"]
        body += [f"<p class=note>{n.code} {html.escape(n.text)}</p>" for n in d.notes]
        body += [runs, predictions, f"<p>{html.escape(d.at_peak)}:</p>", categories, sites]
        body += [f"<p>{html.escape(d.within_line)}</p>"] if d.within_line is not None else []
    style = ("body{font:14px system-ui,sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
             "td,th{padding:2px 10px;border-bottom:1px solid #ddd;text-align:right}.note{color:#555}")
    return ("<!doctype html><html><head><meta charset=utf-8><title>memdiff forecast</title>"
            f"<style>{style}</style></head><body><h1>memdiff forecast</h1>{''.join(body)}</body></html>\n")
