"""What `memdiff whatif` prints (text, markdown, json, html): it lays out the WhatIf and decides nothing."""

from __future__ import annotations

import html

from memdiff.compare.findings import shown
from memdiff.inert import md_cell, md_code, md_text
from memdiff.predict.whatif import WhatIf
from memdiff.render.json import dumps
from memdiff.render.table import layout


def render_text(w: WhatIf) -> str:
    """The what-if for a terminal."""
    out = [w.heading]
    out += [w.budget_line] if w.budget_line is not None else []
    out += [shown(n) for n in w.notes]
    for d in w.devices:
        out += ["", d.headline]
        table = w.table(d)
        if table is not None:
            out += ["", layout(table, "simple")]
        if d.findings:
            out += [""] + [shown(f) for f in d.findings]
        assumed = [f"  {c.change}: {a}" for c in d.changes for a in c.assumptions]
        out += ["", f"{w.assumed_word}:", *assumed] if assumed else []
    return "\n".join(out) + "\n"


def render_markdown(w: WhatIf) -> str:
    """The what-if for a pull-request comment or a job summary."""
    out = [f"### {md_text(w.heading)}"]
    if w.budget_line is not None:
        out += ["", md_text(w.budget_line)]
    # Each finding a line of its own (a hard break, as the diff's alerts): markdown ran them into one paragraph.
    out += ["", *(f"> `{n.code}` {md_text(n.text)}  " for n in w.notes)] if w.notes else []
    for d in w.devices:
        out += ["", f"**{md_text(d.headline)}**", ""]
        table = w.table(d)
        if table is not None:  # markdown escapes every cell: the change is the user's text
            out += [layout(table, "github", md_cell), ""]
        out += [f"> `{f.code}` {md_text(f.message)}  " for f in d.findings]
        assumed = [f"- {md_code(c.change)}: {md_text(a)}" for c in d.changes for a in c.assumptions]
        if assumed:
            out += ["", f"<details><summary>what each change {w.assumed_word}</summary>", "", *assumed, "",
                    "</details>"]
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
        table = w.table(d)
        if table is not None:
            body.append(layout(table, "html"))
        body += [f"<p class=note>{f.code} {html.escape(f.message)}</p>" for f in d.findings]
        body.append("<ul>" + "".join(f"<li><b>{html.escape(c.change)}</b>: {html.escape(a)}</li>"
                                     for c in d.changes for a in c.assumptions) + "</ul>")
    style = ("body{font:14px system-ui,sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
             "td,th{padding:2px 10px;border-bottom:1px solid #ddd;text-align:right}.note{color:#555}")
    return ("<!doctype html><html><head><meta charset=utf-8><title>memdiff whatif</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(w.heading)}</h1>{''.join(body)}</body></html>\n")
