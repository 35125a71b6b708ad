"""What `memdiff ranks JOB` prints: the ranks side by side, the spread, roles, and why the heaviest is heaviest."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any, Dict, Optional, Sequence

from tabulate import tabulate

from memdiff import __version__
from memdiff.differ import Folded, where_text
from memdiff.job import ranges, ranks_text
from memdiff.jobdiff import JobDiff
from memdiff.judge import Check, Verdict
from memdiff.ranks import RanksReport, Role
from memdiff.render.table import category_table, check_line, diff_table, pct_cell, peak_line
from memdiff.units import format_bytes

CATEGORY_COLUMNS = 4  # the largest categories across ranks get a column each

# The ranks JSON's version: bumped when a field changes meaning or disappears.
RANKS_SCHEMA_VERSION = 1


def _ratio(report: RanksReport) -> str:
    ratio = report.max_over_median
    return f"{ratio:.2f}x" if ratio is not None else "n/a"


def _rank_table(report: RanksReport) -> str:
    totals: Dict[str, int] = {}
    for r in report.ranks:
        for name, n in r.categories.items():
            totals[name] = totals.get(name, 0) + n
    columns = sorted(totals, key=lambda c: (-totals[c], c))[:CATEGORY_COLUMNS]
    rows = []
    for r in report.ranks:
        mark = " heaviest" if r.rank == report.heaviest else " median" if r.rank == report.median_rank else ""
        rows.append([f"{r.rank}{mark}", os.path.basename(r.file), r.device, format_bytes(r.peak_bytes),
                     format_bytes(r.static_bytes), where_text(r.phase_at_peak, r.step_at_peak) or "",
                     *[format_bytes(r.categories.get(c, 0)) for c in columns]])
    return tabulate(rows, headers=["rank", "file", "device", "peak", "static", "peak in", *columns],
                    tablefmt="simple", colalign=("left", "left", "right", "right", "right", "left")
                    + ("right",) * len(columns))


def render_text(report: RanksReport, folded: Optional[Folded], check: Optional[Check]) -> str:
    """The ranks report: a row per rank, the spread, the roles, the heaviest rank against the median one."""
    by_rank = {r.rank: r for r in report.ranks}
    count = len(report.ranks)
    lines = [f"{count:,} rank{'s' if count != 1 else ''} ({ranges([r.rank for r in report.ranks])})"
             + (f"; missing: {ranges(report.missing)}" if report.missing else ""), "", _rank_table(report), ""]
    lines.append(f"peak across ranks: min {format_bytes(report.min_bytes)}, median {format_bytes(report.median_bytes)} "
                 f"(rank {report.median_rank}), max {format_bytes(report.max_bytes)} (rank {report.heaviest}); "
                 f"spread {format_bytes(report.spread_bytes)}, max/median {_ratio(report)}")
    if report.roles:
        lightest = report.roles[-1].max_bytes  # roles come heaviest first

        def role_text(role: Role) -> str:
            peaks = (format_bytes(role.max_bytes) if role.min_bytes == role.max_bytes
                     else f"{format_bytes(role.min_bytes)}-{format_bytes(role.max_bytes)}")
            more = f" ({pct_cell(lightest, role.max_bytes)})" if role is not report.roles[-1] and lightest else ""
            return f"{ranks_text(role.ranks)}: {peaks}{more}"
        lines.append("ranks by shape (the same stacks hold the peak; % over the lightest): "
                     + "; ".join(role_text(role) for role in report.roles))
    d = report.diff.devices[0] if report.diff.devices else None
    if d is not None and folded is not None and report.heaviest != report.median_rank:
        lines += ["", f"heaviest rank {report.heaviest} (device {by_rank[report.heaviest].device}) against the "
                      f"median rank {report.median_rank} (device {by_rank[report.median_rank].device}): {peak_line(d)}",
                  *[f"warning: {w}" for w in report.diff.warnings]]
        if d.categories:
            lines += ["", category_table(d, "simple")]
        lines += ["", diff_table(folded, "simple")]
    if check is not None:
        lines += ["", check_line(check)]
    return "\n".join(lines) + "\n"


def ranks_document(report: RanksReport, check: Optional[Check]) -> Dict[str, Any]:
    """The ranks JSON: every rank, the spread, the roles, the heaviest-vs-median diff, the check."""
    doc: Dict[str, Any] = {
        "schema_version": RANKS_SCHEMA_VERSION, "tool": f"memdiff {__version__}",
        "verdict": None if check is None else ("pass" if check.passed else "fail"),
        "checks": [] if check is None else [asdict(check)],
        "ranks": [asdict(r) for r in report.ranks], "missing": report.missing,
        "min_bytes": report.min_bytes, "median_bytes": report.median_bytes, "max_bytes": report.max_bytes,
        "spread_bytes": report.spread_bytes, "max_over_median": report.max_over_median,
        "heaviest_rank": report.heaviest, "median_rank": report.median_rank,
        "roles": [asdict(r) for r in report.roles], "heaviest_vs_median": report.diff.to_dict(),
    }
    return doc


def render_json(report: RanksReport, check: Optional[Check]) -> str:
    """The ranks JSON, indented."""
    return json.dumps(ranks_document(report, check), indent=2, ensure_ascii=False) + "\n"



def _job_table(job: JobDiff, per_rank: Dict[int, Verdict], tablefmt: str) -> str:
    rows = []
    for r in job.ranks:
        for d in r.diff.devices:
            rows.append([r.rank, d.device, format_bytes(d.base_peak_bytes), format_bytes(d.head_peak_bytes),
                         format_bytes(d.peak_delta_bytes, signed=True), pct_cell(d.base_peak_bytes, d.head_peak_bytes),
                         "PASS" if per_rank[r.rank].passed else "FAIL"])
    return tabulate(rows, headers=["rank", "device", "base peak", "head peak", "delta", "%", "verdict"],
                    tablefmt=tablefmt, colalign=("right", "right", "right", "right", "right", "right", "left"))


def render_job_diff(job: JobDiff, verdict: Verdict, per_rank: Dict[int, Verdict], worst_report: str,
                    markdown: bool = False, notes: Sequence[str] = ()) -> str:
    """Job against job: the job's verdict and `notes` on the job as a whole, a line per rank, the
    worst rank's report (`worst_report`, already rendered), then the failing checks of the other ranks."""
    worst = job.worst.rank
    failing = [r.rank for r in job.ranks if not per_rank[r.rank].passed]
    verdict_line = (f"{'PASS' if verdict.passed else 'FAIL'}: {len(job.ranks):,} ranks compared"
                    + (f", failing: {ranges(failing)}" if failing else ""))
    others = [c for c in verdict.checks if not c.passed and not c.subject.startswith(f"rank {worst} ")]
    lines = [f"**{verdict_line}**" if markdown else verdict_line, *notes, *[f"warning: {w}" for w in job.warnings], "",
             _job_table(job, per_rank, "pipe" if markdown else "simple"), "",
             f"{'### ' if markdown else ''}worst rank: {worst}", ""]
    body = "\n".join(lines) + "\n" + worst_report
    if others:
        body += "\nother ranks:\n" + "\n".join(("- " if markdown else "") + check_line(c) for c in others) + "\n"
    return body


def job_diff_document(job: JobDiff, verdict: Verdict, per_rank: Dict[int, Verdict]) -> Dict[str, Any]:
    """The job diff JSON: the job's verdict and every rank's diff document (never folded)."""
    from memdiff.render.json import diff_document

    return {"schema_version": RANKS_SCHEMA_VERSION, "tool": f"memdiff {__version__}", **verdict.to_dict(),
            "warnings": job.warnings, "worst_rank": job.worst.rank, "only_base": job.only_base,
            "only_head": job.only_head,
            "ranks": [{"rank": r.rank, **diff_document(r.diff, per_rank[r.rank])} for r in job.ranks]}
