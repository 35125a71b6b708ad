"""What `memdiff fit` prints (text, markdown, json): it lays out the FitResult and decides nothing."""

from __future__ import annotations

from typing import List, Optional

from tabulate import tabulate

from memdiff.compare.findings import shown
from memdiff.inert import md_cell, md_code, md_text
from memdiff.predict.fit import SMALLEST, FitResult
from memdiff.predict.fit_gate import FitGate
from memdiff.render.json import dumps
from memdiff.units import format_bytes


def _bytes(n: Optional[int]) -> str:
    return "" if n is None else format_bytes(n)


def _rows(result: FitResult) -> List[List[str]]:
    rows = []
    for g in result.gpus:
        fails = g.fails
        fits = g.fits
        rows.append([g.gpu, "none" if g.value is None else f"{g.value:,}", _bytes(fits.peak_bytes if fits else None),
                     _bytes(fits.reserved_peak_bytes if fits else None), _bytes(g.headroom_bytes),
                     format_bytes(g.capacity_bytes), "" if fails is None else f"{fails.value:,} ({fails.outcome})",
                     str(len(g.runs))])
    return rows


HEADERS = ["gpu", "largest", "allocated peak", "reserved peak", "headroom", "capacity", "first not fitting", "runs"]
# {nproc}: the fewest processes that fit, and the run of one fewer that did not
FEWEST_HEADERS = ["gpu", "fewest", "allocated peak", "reserved peak", "headroom", "capacity", "next down, not fitting",
                  "runs"]


def _headers(result: FitResult) -> List[str]:
    return FEWEST_HEADERS if result.direction == SMALLEST else HEADERS
ALIGN = ("left", "right", "right", "right", "right", "right", "left", "right")


def render_text(result: FitResult) -> str:
    """The fit for a terminal: one line per GPU, the table, each GPU's runs and failing request."""
    out = [f"memdiff: {g.line}" for g in result.gpus]
    out += [shown(f) for f in result.findings]
    if result.verdict_line is not None:
        out.append(result.verdict_line)
    out += ["", f"knob   {result.knob_line}",
            f"runs   {result.runs} emulated runs in {result.seconds:.1f} s, snapshots in {result.output}", "",
            tabulate(_rows(result), headers=_headers(result), tablefmt="simple", colalign=ALIGN), ""]
    for g in result.gpus:
        out.append(f"{g.gpu} ({g.name})")
        out += [f"  {line}" for line in g.details]
    return "\n".join(out) + "\n"


def render_markdown(result: FitResult) -> str:
    """The fit as a pull-request comment: each GPU's answer and the gate's finding in one line each, what
    was searched, then the table."""
    out = ["### memdiff fit", ""]
    for g in result.gpus:
        out += [f"**{md_text(g.line)}**", ""]
    out += [f"knob: {md_text(result.knob_line)}", ""]
    if result.verdict_line is not None:
        out.append(("✅ " if result.passed else "❌ ") + md_text(result.verdict_line))
    out += [("❌ " if f.severity == "error" else "") + md_text(shown(f)) for f in result.findings]
    rows = [[md_cell(c) for c in row] for row in _rows(result)]
    which = "Fewest" if result.direction == SMALLEST else "Largest"
    out += ["", f"{which} {md_code(result.knob)} that trains, per emulated GPU ({result.runs} runs):", "",
            tabulate(rows, headers=_headers(result), tablefmt="github", colalign=ALIGN), ""]
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
        return "\n".join([("✅ " if gate.passed else "❌ ") + md_text(verdict)]
                         + ["❌ " + md_text(shown(f)) for f in gate.findings]) + "\n"
    return "\n".join([verdict, *(shown(f) for f in gate.findings), *gate.values]) + "\n"
