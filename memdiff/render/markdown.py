"""Markdown reports for pull-request comments and job summaries: read in ten seconds, details folded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from memdiff.compare.differ import GONE, GREW, NEW, SHRANK
from memdiff.compare.findings import ERROR, INFO, WARNING
from memdiff.compare.trend import TREND_HEADERS
from memdiff.inert import md_cell, md_code, md_fence, md_text
from memdiff.render.table import layout, row_table
from memdiff.report.build import Report
from memdiff.report.types import DeviceReport, Input, Stack, Table

MARKERS = {NEW: "🆕 NEW", GREW: "🔺 GREW", SHRANK: "🔻 SHRANK", GONE: "✖️ GONE"}


@dataclass
class Options:
    """What to name the runs and how much to show (the GitHub layer shrinks reports to fit)."""

    base_label: Optional[str] = None
    head_label: Optional[str] = None
    details: bool = True
    chart: bool = True
    note: Optional[str] = None


def _input(label: Optional[str], i: Input) -> str:
    shown = i.label_shown(label)
    named = "" if shown is None else f"{md_code(shown)} · "
    return f"**{i.role}** {named}{md_code(i.file)} ({md_text(i.facts)})"


def _frame_lines(st: Stack) -> List[str]:
    return [*md_fence(st.shown), ""]


def _stacks(d: DeviceReport) -> List[str]:
    """The folded stacks of the rows shown; none when no row has one (a run against itself: an
    empty fold the reviewer opens for nothing)."""
    if not any(st.lines for r in d.rows for st in r.stacks):
        return []
    lines = ["<details><summary>Stacks of the rows above</summary>", ""]
    for r in d.rows:
        if not any(st.lines for st in r.stacks):
            continue
        lines.append(f"**{r.row.status}** {md_code(r.row.label or r.row.site)} {r.delta_text}")
        if len(r.stacks) == 1:
            lines += _frame_lines(r.stacks[0])
            continue
        # A row that aligns several groups shows each one's stack: where the memory moved.
        lines.append("")
        for st in r.stacks:
            lines.append(f"- {st.facts}")
            lines += ["", *_frame_lines(st)]
    return lines + ["</details>"]


def _chart(d: DeviceReport) -> List[str]:
    """The report's chart (report.build.chart_of) as a mermaid xychart, its caption below."""
    chart = d.chart
    if chart is None:
        return []
    out = ["```mermaid", "xychart-beta", f'    title "{chart.title}"', f'    x-axis "{chart.x_axis}" 0 --> 100',
           f'    y-axis "{chart.unit}"']
    out += [f"    line [{', '.join(line.points)}]" for line in chart.lines]
    return out + ["```", chart.caption]


def _device(d: DeviceReport, o: Options) -> List[str]:
    lines = ["", f"#### {md_text(d.heading)}"]
    # Each line its own (a hard break): markdown ran where each peak is and the reserved memory into one
    # paragraph, where the page gives each its own.
    lines += ["", *(md_text(line) + "  " for line in d.lines)]
    for t in (d.phases, d.categories):
        if t is not None:
            lines += ["", layout(t, "github", escape=md_cell)]
    lines += ["", layout(row_table(d, status=lambda s: MARKERS.get(s, s)), "github", escape=md_cell)]
    stacks = _stacks(d) if o.details else []
    if stacks:
        lines += ["", *stacks]
    if d.like_for_like is not None:
        like = d.like_for_like
        lines += ["", f"<details><summary>Like with like: {md_text(like.heading)}</summary>", ""]
        if like.categories is not None:
            lines += [layout(like.categories, "github", escape=md_cell), ""]
        lines += [layout(row_table(like, status=lambda s: MARKERS.get(s, s)), "github", escape=md_cell), "",
                  "</details>"]
    if o.chart:
        chart = _chart(d)
        lines += ["", *chart] if chart else []
    return lines


def _trends(report: Report) -> List[str]:
    """The main-branch trend of each device (--history): a sparkline with this run's block after
    it, in words, and every point in a folded table."""
    if report.trends is None:
        return []
    lines = ["", "#### Peak on the main branch"]
    for t in report.trends:
        lines += ["", f"{md_code(t.sparkline)} → **{md_code(t.head_block)}** {md_text(t.text)}", "",
                  f"<details><summary>The last {len(t.points)} peaks of {md_text(t.workload)} on main, "
                  f"device {t.device}</summary>", "",
                  layout(Table(TREND_HEADERS, t.rows, left=[0, 1]), "github", escape=md_cell), "", "</details>"]
    lines += ["", f"`{report.trend_note.code}` {md_text(report.trend_note.text)}"] if report.trend_note else []
    return lines


def _buy_back(report: Report) -> List[str]:
    """What buys the regression back (--whatif): a short list, the notes in small print."""
    if report.buy_back is None:
        return []
    lines = ["", "#### What buys it back", ""]
    lines += [f"- {'✅' if b.enough else '⚠️'} {md_text(b.text)}" for b in report.buy_back.items]
    lines += ["", *(f"<sub>`{n.code}` {md_text(n.text)}</sub>  " for n in report.buy_back.notes)] \
        if report.buy_back.notes else []
    return lines


def render_diff(report: Report, options: Optional[Options] = None) -> str:
    """The report in GitHub-flavoured markdown: the verdict and headline first, details folded."""
    o = options or Options()
    mark = ("memdiff" if report.verdict_word is None
            else f"{'✅' if report.passed else '❌'} memdiff: {report.verdict_word}")
    lines = [f"### {mark}", "", f"**{md_text(report.headline)}**", ""]
    if report.job is not None:
        lines += [f"**{md_text(report.job.summary_line)}**", "", layout(report.job.table, "github", escape=md_cell), "",
                  f"**{md_text(report.job.worst_line)}**", ""]
    base, head = report.inputs
    lines.append(f"{_input(o.base_label or report.base_label, base)} → "
                 f"{_input(o.head_label or report.head_label, head)}")
    for severity, alert in ((ERROR, "CAUTION"), (WARNING, "WARNING"), (INFO, "NOTE")):
        said = [f for f in report.findings if f.severity == severity]
        lines += ["", f"> [!{alert}]", *(f"> `{f.code}` {md_text(f.text)}  " for f in said)] if said else []
    for d in report.devices:
        lines += _device(d, o)
    lines += _trends(report)
    lines += ["", f"**Rule:** {md_text(report.rule)}", ""] if report.rule else []
    lines += [f"- {'✅' if c.passed else '❌'} {md_text(c.text)}" for c in report.check_lines]
    lines += ["", *(f"`{n.code}` {md_text(n.text)}  " for n in report.notes)] if report.notes else []
    if report.job is not None and report.job.other_failures:
        lines += ["", "Other ranks:", "", *(f"- ❌ {md_text(line)}" for line in report.job.other_failures)]
    lines += _buy_back(report)
    lines += ["", f"*{o.note}*"] if o.note else []
    return "\n".join(lines) + "\n"
