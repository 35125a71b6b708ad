"""What `memdiff whatif` prints (text, markdown, json, html): it lays out the WhatIf and decides nothing."""

from __future__ import annotations

import html
from typing import List

from tabulate import tabulate

from memdiff.compare.findings import shown
from memdiff.inert import md_cell, md_code, md_text
from memdiff.predict.whatif import DeviceWhatIf, WhatIf
from memdiff.render.json import dumps
from memdiff.units import format_bytes


def _table(d: DeviceWhatIf, fmt: str, budget: bool, rerun: bool) -> str:
    # The bytes each change edited whose category is memdiff's guess (W016), where any change has them.
    guessed = any(c.applies and c.guessed_bytes for c in d.changes)
    rows: List[List[str]] = []
    for c in d.changes:
        if not c.applies:
            continue
        row = [c.change, format_bytes(c.predicted_peak_bytes or 0)]
        row += [format_bytes(c.reserved_peak_bytes or 0)] if rerun else []
        row += [c.predicted_peak_phase or "before the trace", format_bytes(c.delta_bytes or 0, signed=True),
                c.delta_pct_text]
        row += [format_bytes(c.guessed_bytes) if c.guessed_bytes else ""] if guessed else []
        if budget:
            row.append(c.fits_text)
        rows.append(row)
    headers = ((["change", "re-run peak", "reserved", "phase", "delta", "%"] if rerun
                else ["change", "predicted peak", "phase", "delta", "%"])
               + (["on a guessed category"] if guessed else []) + (["fits"] if budget else []))
    if fmt == "github":  # markdown escapes every cell: the change is the user's text
        rows = [[md_cell(c) for c in row] for row in rows]
    return tabulate(rows, headers=headers, tablefmt=fmt,
                    colalign=("left", "right") + (("right",) if rerun else ()) + ("left", "right", "right")
                    + (("right",) if guessed else ()) + (("left",) if budget else ()))




def render_text(w: WhatIf) -> str:
    """The what-if for a terminal."""
    out = [w.heading]
    out += [w.budget_line] if w.budget_line is not None else []
    out += [shown(n) for n in w.notes]
    for d in w.devices:
        out += ["", d.headline]
        if any(c.applies for c in d.changes):
            out += ["", _table(d, "simple", w.budget_bytes is not None, bool(w.rerun_on))]
        if d.findings:
            out += [""] + [shown(f) for f in d.findings]
        assumed = [f"  {c.change}: {a}" for c in d.changes for a in c.assumptions]
        out += ["", "made:" if w.rerun_on else "assumed:", *assumed] if assumed else []
    return "\n".join(out) + "\n"


def render_markdown(w: WhatIf) -> str:
    """The what-if for a pull-request comment or a job summary."""
    out = [f"### {md_text(w.heading)}"]
    if w.budget_line is not None:
        out += ["", md_text(w.budget_line)]
    out += ["", *(f"> `{n.code}` {md_text(n.text)}" for n in w.notes)] if w.notes else []
    for d in w.devices:
        out += ["", f"**{md_text(d.headline)}**", ""]
        if any(c.applies for c in d.changes):
            out += [_table(d, "github", w.budget_bytes is not None, bool(w.rerun_on)), ""]
        out += [f"> `{f.code}` {md_text(f.message)}" for f in d.findings]
        assumed = [f"- {md_code(c.change)}: {md_text(a)}" for c in d.changes for a in c.assumptions]
        if assumed:
            what = "made" if w.rerun_on else "assumed"
            out += ["", f"<details><summary>what each change {what}</summary>", "", *assumed, "", "</details>"]
    return "\n".join(out) + "\n"


def render_json(w: WhatIf) -> str:
    """The what-if document (schemas/whatif.schema.json)."""
    return dumps(w.to_dict())


def render_html(w: WhatIf) -> str:
    """One self-contained page: the markdown's tables as HTML tables."""
    body = [f"<p>{html.escape(w.budget_line)}</p>"] if w.budget_line is not None else []
    body += [f"<p class=note>{n.code} {html.escape(n.text)}</p>" for n in w.notes]
    for d in w.devices:
        body.append(f"<h2>{html.escape(d.headline)}</h2>")
        if any(c.applies for c in d.changes):
            body.append(_table(d, "html", w.budget_bytes is not None, bool(w.rerun_on)))
        body += [f"<p class=note>{f.code} {html.escape(f.message)}</p>" for f in d.findings]
        body.append("<ul>" + "".join(f"<li><b>{html.escape(c.change)}</b>: {html.escape(a)}</li>"
                                     for c in d.changes for a in c.assumptions) + "</ul>")
    style = ("body{font:14px system-ui,sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
             "td,th{padding:2px 10px;border-bottom:1px solid #ddd;text-align:right}.note{color:#555}")
    return ("<!doctype html><html><head><meta charset=utf-8><title>memdiff whatif</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(w.heading)}</h1>{''.join(body)}</body></html>\n")
