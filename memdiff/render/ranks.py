"""What `memdiff ranks JOB` prints: the ranks side by side, the spread, roles, and why the heaviest is heaviest."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any, Dict, Optional

from tabulate import tabulate

from memdiff import __version__
from memdiff.compare.findings import shown
from memdiff.compare.judge import Check
from memdiff.compare.observe import where_text
from memdiff.compare.ranks import RanksReport, Role
from memdiff.inert import text
from memdiff.read.job import ranges, ranks_text
from memdiff.render.json import dumps
from memdiff.render.table import layout, row_table
from memdiff.report.types import RANKS_SCHEMA_VERSION, DeviceReport, check_line, pct_cell
from memdiff.units import count_of, format_bytes


def _ratio(report: RanksReport) -> str:
    ratio = report.max_over_median
    return f"{ratio:.2f}x" if ratio is not None else "n/a"


def _rank_table(report: RanksReport) -> str:
    columns = report.category_columns
    rows = []
    for r in report.ranks:
        mark = " heaviest" if r.rank == report.heaviest else " median" if r.rank == report.median_rank else ""
        rows.append([f"{r.rank}{mark}", os.path.basename(r.file), r.device, format_bytes(r.peak_bytes),
                     format_bytes(r.static_bytes), where_text(r.phase_at_peak, r.step_at_peak) or "unknown",
                     *[format_bytes(r.categories.get(c, 0)) for c in columns]])
    return tabulate(rows, headers=["rank", "file", "device", "peak", "static", "peak in", *columns],
                    tablefmt="simple", colalign=("left", "left", "right", "right", "right", "left")
                    + ("right",) * len(columns))


def render_text(report: RanksReport, detail: Optional[DeviceReport], check: Optional[Check]) -> str:
    """The ranks report: a row per rank, the spread, the roles, the heaviest rank against the median one."""
    by_rank = {r.rank: r for r in report.ranks}
    count = len(report.ranks)
    lines = [f"{count_of(count, 'rank')} ({ranges([r.rank for r in report.ranks])})"
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
    if detail is not None and report.heaviest != report.median_rank:
        lines += ["", f"heaviest rank {report.heaviest} (device {by_rank[report.heaviest].device}) against the "
                      f"median rank {report.median_rank} (device {by_rank[report.median_rank].device}): "
                      f"{detail.heading.partition(': ')[2]}",
                  *[text(shown(f)) for f in report.diff.findings]]
        if detail.categories is not None:
            lines += ["", layout(detail.categories, "simple")]
        lines += ["", layout(row_table(detail), "simple")]
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
    return dumps(ranks_document(report, check))
