"""The diff table shared by the text and markdown reports (same columns, different tablefmt)."""

from __future__ import annotations

from typing import Callable, List, Optional

from tabulate import tabulate

from memdiff.differ import BY_SITE, NEW, PEAK, DeviceDiff, DiffRow, Folded, where_text
from memdiff.judge import Check, growth_pct
from memdiff.model import Frame
from memdiff.units import format_bytes

HEADERS = ["status", "count", "base", "head", "delta", "%", "site"]


# Beyond this a percent is not read as a number any more: `x13.4` says it better.
RATIO_FROM_PCT = 999


def frame_line(f: Frame) -> str:
    """One stack frame as every report prints it: `file:line function`, or a native frame's name."""
    if not f.file:
        return f.name
    return f"{f.file}:{f.line} {f.name}" if f.line else f"{f.file} {f.name}"


def pct_cell(base: int, head: int) -> str:
    """Signed percent change; a ratio (`x13.4`) past +999%; `new` when there was nothing before."""
    pct = growth_pct(base, head)
    if pct is None:
        return "new" if head else ""
    if pct > RATIO_FROM_PCT:
        return f"x{head / base:,.1f}"
    return f"{pct:+.1f}%"


def _count(r: DiffRow) -> str:
    if r.base_count == r.head_count:
        return f"{r.base_count:,}"
    counts = f"{r.base_count:,} -> {r.head_count:,}"
    # Fewer allocations holding more bytes (or more holding fewer) is not a typo: say why.
    if r.head_count < r.base_count and r.delta_bytes > 0:
        return counts + " (fewer, larger)"
    if r.head_count > r.base_count and r.delta_bytes < 0:
        return counts + " (more, smaller)"
    return counts


def row_cells(r: DiffRow, status: Callable[[str], str] = str) -> List[str]:
    """A row's cells in HEADERS order; `status` labels the status column."""
    site = (r.label or r.site) + (" (matched by site)" if r.matched_by == BY_SITE else "")
    pct = "new" if r.status == NEW else pct_cell(r.base_bytes, r.head_bytes)
    return [status(r.status), _count(r), format_bytes(r.base_bytes), format_bytes(r.head_bytes),
            format_bytes(r.delta_bytes, signed=True), pct, site]


def diff_table(folded: Folded, tablefmt: str, escape: Callable[[str], str] = str,
               status: Callable[[str], str] = str) -> str:
    """The rows, the folded rest and the TOTAL row as one table; `status` labels the status column."""
    rows = [row_cells(r, status) for r in folded.shown]
    if folded.others is not None:
        rows.append(row_cells(folded.others, status))
    rows.append(row_cells(folded.total, status))
    rows = [[escape(c) for c in row] for row in rows]
    return tabulate(rows, headers=HEADERS, tablefmt=tablefmt,
                    colalign=("left", "right", "right", "right", "right", "right", "left"))


def peak_line(d: DeviceDiff) -> str:
    """`peak 6.53 GiB -> 8.48 GiB (+1.95 GiB, +29.8%)`, or `forward peak ...` when compared --at forward."""
    moment = "peak" if d.at == PEAK else f"{d.at} peak"
    return (f"{moment} {format_bytes(d.base_peak_bytes)} -> {format_bytes(d.head_peak_bytes)} "
            f"({format_bytes(d.peak_delta_bytes, signed=True)}, {pct_cell(d.base_peak_bytes, d.head_peak_bytes)})")


def where_line(d: DeviceDiff) -> Optional[str]:
    """Where each run's peak is: `base peak in the optimizer step of step 0 (scope ...); head peak in ...`."""
    if not (d.base_peak_phase or d.head_peak_phase):
        return None
    parts = []
    for role, phase, step, scope in (("base", d.base_peak_phase, d.base_peak_step, d.base_peak_scope),
                                     ("head", d.head_peak_phase, d.head_peak_step, d.head_peak_scope)):
        text = f"{role} peak in {where_text(phase, step)}" if phase else f"{role} peak: phase unknown"
        parts.append(text + (f" (scope {scope})" if scope else ""))
    return "; ".join(parts)


def kept_line(d: DeviceDiff, sites: int = 3) -> Optional[str]:
    """`kept from earlier steps: 0 B -> 51.10 MiB (activation: modeling_llama.py:forward +51.10 MiB)`,
    when head keeps more memory from earlier steps than base."""
    k = d.kept
    if k is None or k.head_bytes <= k.base_bytes:
        return None
    named = ", ".join(f"{r.category}: {r.label or r.site} "
                      f"{format_bytes(r.head_earlier_bytes - r.base_earlier_bytes, signed=True)}"
                      for r in k.rows[:sites])
    return (f"kept from earlier steps (not parameters, gradients or optimizer state): "
            f"{format_bytes(k.base_bytes)} -> {format_bytes(k.head_bytes)} ({named})")


PHASE_HEADERS = ["phase peak", "base", "head", "delta", "%"]
CATEGORY_HEADERS = ["category", "base", "head", "delta", "%"]


def phase_rows(d: DeviceDiff) -> List[List[str]]:
    """The cells of the phase table: the highest memory of each phase over all steps, base and head."""
    return [[p.phase, "" if p.base_peak_bytes is None else format_bytes(p.base_peak_bytes),
             "" if p.head_peak_bytes is None else format_bytes(p.head_peak_bytes),
             format_bytes(p.delta_bytes, signed=True), pct_cell(p.base_peak_bytes or 0, p.head_peak_bytes or 0)]
            for p in d.phases]


def phase_table(d: DeviceDiff, tablefmt: str) -> str:
    """The highest memory of each phase over all steps, base and head: like compared with like."""
    return tabulate(phase_rows(d), headers=PHASE_HEADERS, tablefmt=tablefmt,
                    colalign=("left", "right", "right", "right", "right"))


def check_line(c: Check) -> str:
    """`FAIL  device 0 peak: 6.53 GiB -> 8.48 GiB, +1.95 GiB (+29.8%), limit: more than 1% and ...`."""
    return (f"{'PASS' if c.passed else 'FAIL'}  {c.subject}: {format_bytes(c.base_bytes)} -> "
            f"{format_bytes(c.head_bytes)}, {format_bytes(c.delta_bytes, signed=True)} "
            f"({pct_cell(c.base_bytes, c.head_bytes)}), limit: {c.limit}")


def category_rows(d: DeviceDiff) -> List[List[str]]:
    """The cells of the category table: bytes at the compared moment per category, base and head."""
    return [[c.category, format_bytes(c.base_bytes), format_bytes(c.head_bytes),
             format_bytes(c.delta_bytes, signed=True), pct_cell(c.base_bytes, c.head_bytes)]
            for c in d.categories]


def category_table(d: DeviceDiff, tablefmt: str) -> str:
    """Per-category bytes at the peak, base and head."""
    return tabulate(category_rows(d), headers=CATEGORY_HEADERS, tablefmt=tablefmt,
                    colalign=("left", "right", "right", "right", "right"))
