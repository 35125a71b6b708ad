"""Plain-text reports for a terminal (tabulate tables, binary units)."""

from __future__ import annotations

from typing import List, Sequence

from tabulate import tabulate

from memdiff.analyse.peak import PHASE_COLUMNS, DevicePeak, PeakRow, StepRow
from memdiff.compare.findings import shown
from memdiff.inert import text
from memdiff.model import Finding, Summary
from memdiff.render.table import layout, row_table
from memdiff.report.build import Report
from memdiff.report.types import DeviceReport, stack_lines

STACK_LINES = 6


def _site_cell(row: PeakRow) -> str:
    return "\n".join([row.site] + ["  " + line for line in stack_lines(row.frames, STACK_LINES)])


def _device_block(p: DevicePeak) -> List[str]:
    d = p.device
    out = [f"device {d.device}"]
    out.append(tabulate(p.facts, tablefmt="plain", colalign=("left", "right", "left")))
    out += [shown(f) for f in p.findings]
    for title, shares in (("category", p.categories), ("scope at allocation", p.scopes),
                          ("compile context", p.compile_contexts),
                          ("label (user_metadata, annotations)", p.labels)):
        if shares:
            out.append("")
            out.append(tabulate([sh.cells for sh in shares],
                                headers=[title, "bytes at peak", "share"], tablefmt="simple",
                                colalign=("left", "right", "right")))
    if p.steps:
        out.append("")
        out.append(step_table(p.steps, "simple"))
    rows = [[*r.cells, _site_cell(r)] for r in p.rows + [p.total]]
    out.append("")
    out.append(tabulate(rows, headers=["#", "count", "bytes", "share", "category", "site and stack (innermost first)"],
                        tablefmt="simple", colalign=("right", "right", "right", "right", "left", "left")))
    return out


def step_table(rows: List[StepRow], tablefmt: str) -> str:
    """Per step, the highest memory of each phase; `*` marks the step holding the peak."""
    columns = [c for c in PHASE_COLUMNS if any(r.peaks.get(c) is not None for r in rows)]
    cells = [[r.step_text, *[r.phase_text(c) for c in columns]] for r in rows]
    return tabulate(cells, headers=["step", *[f"{c} peak" for c in columns]], tablefmt=tablefmt,
                    colalign=("right", *["right"] * len(columns)))


def render_peak(summary: Summary, peaks: List[DevicePeak], run_findings: Sequence[Finding]) -> str:
    """What `memdiff peak` prints: the findings about the run as a whole (analyse.peak.source_findings),
    then per device the peak, static, where the peak happens and the top groups."""
    s = summary.source
    lines = [f"{text(s.file)}: {s.container}, format {s.generation}, sha256 {s.sha256[:12]}"]
    if not peaks:
        lines.append("no device memory in this snapshot (no trace and no segments)")
    lines += [text(shown(f)) for f in run_findings]  # a finding may quote the file (a GPU's name)
    for p in peaks:
        lines.append("")
        lines.extend(_device_block(p))
    return "\n".join(lines) + "\n"


def render_stacks(report: Report) -> str:
    """The stacks of the shown rows, for a reader who asked for more (pytest -v)."""
    lines = []
    for d in report.devices:
        for r in d.rows:
            for st in r.stacks:
                lines.append(f"device {d.device} {r.title} ({st.facts})")
                lines += ["  " + line for line in st.shown]
    return "\n".join(lines) + "\n"


def _device(d: DeviceReport) -> List[str]:
    lines = ["", d.heading]
    lines += d.lines
    for t in (d.phases, d.categories):
        if t is not None:
            lines += ["", layout(t, "simple")]
    lines += ["", layout(row_table(d), "simple")]
    like = d.like_for_like
    if like is not None:  # what the headline quotes when the peaks are in different phases
        lines += ["", f"like with like: {like.heading}"]
        lines += ["", layout(like.categories, "simple")] if like.categories is not None else []
        lines += ["", layout(row_table(like), "simple")]
    return lines


def _trends(report: Report) -> List[str]:
    """The main-branch trend of each device (--history): the sparkline, this run's block after it."""
    lines = [f"trend on main: {t.sparkline} -> {t.head_block}  {t.text}" for t in report.trends or []]
    lines += [f"trend on main: {shown(report.trend_note)}"] if report.trend_note else []
    return ["", *lines] if lines else []


def buy_back_lines(report: Report) -> List[str]:
    """What buys the regression back (--whatif): a line per change, then the notes."""
    if report.buy_back is None:
        return []
    return ["", "what buys it back (memdiff whatif on head):", *(f"  {b.text}" for b in report.buy_back.items),
            *(f"  {shown(n)}" for n in report.buy_back.notes)]


def render_diff(report: Report) -> str:
    """What `memdiff BASE HEAD` prints: the verdict and headline, the inputs, warnings, per device
    the phase, category and row tables, then the rule and each check; a job's ranks first."""
    verdict = "" if report.verdict_word is None else f"{report.verdict_word}: "
    lines = [f"memdiff: {verdict}{report.headline}", ""]
    if report.job is not None:
        lines += [report.job.summary_line, "", layout(report.job.table, "simple"), "",
                  report.job.worst_line, ""]
    lines += [f"{i.role}  {i.file}  ({i.facts})" for i in report.inputs]
    lines += [shown(f) for f in report.findings]
    for d in report.devices:
        lines += _device(d)
    lines += _trends(report)
    lines += ["", f"rule: {report.rule}"] if report.rule else []
    lines += [c.text for c in report.check_lines]
    lines += [shown(f) for f in report.notes]
    if report.job is not None and report.job.other_failures:
        lines += ["", "other ranks:", *report.job.other_failures]
    lines += buy_back_lines(report)
    return "\n".join(lines) + "\n"
