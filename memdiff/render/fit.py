"""What `memdiff fit` prints (text, markdown, json): it lays out the FitResult and decides nothing."""

from __future__ import annotations

from memdiff.compare.findings import shown
from memdiff.inert import md_cell, md_code, md_text
from memdiff.predict.fit_gate import FitGate
from memdiff.predict.fit_result import FitResult
from memdiff.render.json import dumps
from memdiff.render.table import layout


def render_text(result: FitResult) -> str:
    """The fit for a terminal: one line per GPU, the table, each GPU's runs and failing request."""
    words = result.words
    out = [f"memdiff: {g.line}" for g in result.gpus]
    out += [shown(f) for f in result.findings]
    if result.verdict_line is not None:
        out.append(result.verdict_line)
    out += ["", f"knob   {result.knob_line}", f"runs   {words.runs_line}", "", layout(words.table, "simple"), ""]
    for g in result.gpus:
        out.append(f"{g.gpu} ({g.name})")
        out += [f"  {line}" for line in g.details]
    return "\n".join(out) + "\n"


def render_markdown(result: FitResult) -> str:
    """The fit as a pull-request comment: each GPU's answer and the gate's finding in one line each, what
    was searched, then the table."""
    words = result.words
    out = ["### memdiff fit", ""]
    for g in result.gpus:
        out += [f"**{md_text(g.line)}**", ""]
    out += [f"knob: {md_text(result.knob_line)}", ""]
    if result.verdict_line is not None:
        out.append(("✅ " if result.passed else "❌ ") + md_text(result.verdict_line) + "  ")
    # One line each: a hard break (two spaces), else markdown runs them into one paragraph.
    out += [("❌ " if f.severity == "error" else "") + md_text(shown(f)) + "  " for f in result.findings]
    out += ["", f"{words.table_lead} {md_code(result.knob)} {words.table_tail}", "",
            layout(words.table, "github", md_cell), ""]
    for g in result.gpus:
        out.append(f"- {md_text(g.gpu)} ({md_text(g.name)})")
        out += [f"  {'  ' if line.startswith('  ') else ''}- {md_text(line.strip())}" for line in g.details]
    return "\n".join(out) + "\n"


def render_json(result: FitResult) -> str:
    """The fit as its JSON document (schemas/fit.schema.json)."""
    return dumps(result.to_dict())


def render_gate(gate: FitGate, fmt: str) -> str:
    """`memdiff gate FIT.json --baseline FIT.json`: the verdict and each finding in one line."""
    if fmt == "json":
        return dumps([gate.to_dict()])
    verdict = gate.verdict_line
    if fmt == "markdown":
        return "\n".join([("✅ " if gate.passed else "❌ ") + md_text(verdict) + "  "]
                         + ["❌ " + md_text(shown(f)) + "  " for f in gate.findings]) + "\n"
    return "\n".join([verdict, *(shown(f) for f in gate.findings), *gate.values]) + "\n"
