"""`memdiff ranks`: the sentences and cells its text shows around the job's ranks, decided once
here, as build.py decides a diff's; render/ranks.py lays them out and computes nothing."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

from memdiff.compare.judge import Check
from memdiff.compare.observe import where_text
from memdiff.compare.ranks import RanksReport, Role
from memdiff.inert import scrubbed
from memdiff.model import Finding
from memdiff.read.job import ranges, ranks_text
from memdiff.report.build import change_line, device_report
from memdiff.report.types import DeviceReport, Table, check_line
from memdiff.units import count_of, format_bytes, pct_cell


@dataclass
class RanksShown:
    """What the ranks text shows, in its order: the ranks counted, a row per rank, the spread, the
    roles, the heaviest rank against the median one (its sentence, findings and tables), the check."""

    counted: str  # `4 ranks (0-3); missing: 5`
    table: Table
    spread: str
    roles: Optional[str]  # None: every rank has one shape
    against: Optional[str]  # None: the heaviest rank is the median one, or neither has a device
    findings: List[Finding]
    detail: Optional[DeviceReport]
    check: Optional[str]


def _ratio(report: RanksReport) -> str:
    ratio = report.max_over_median
    return f"{ratio:.2f}x" if ratio is not None else "n/a"


def _table(report: RanksReport) -> Table:
    columns = report.category_columns
    rows = []
    for r in report.ranks:
        mark = " heaviest" if r.rank == report.heaviest else " median" if r.rank == report.median_rank else ""
        rows.append([f"{r.rank}{mark}", os.path.basename(r.file), str(r.device), format_bytes(r.peak_bytes),
                     format_bytes(r.static_bytes), where_text(r.phase_at_peak, r.step_at_peak) or "unknown",
                     *[format_bytes(r.categories.get(c, 0)) for c in columns]])
    return Table(["rank", "file", "device", "peak", "static", "peak in", *columns], rows, left=[0, 1, 5])


def _roles(report: RanksReport) -> Optional[str]:
    if not report.roles:
        return None
    lightest = report.roles[-1].max_bytes  # roles come heaviest first

    def said(role: Role) -> str:
        peaks = (format_bytes(role.max_bytes) if role.min_bytes == role.max_bytes
                 else f"{format_bytes(role.min_bytes)}-{format_bytes(role.max_bytes)}")
        more = f" ({pct_cell(lightest, role.max_bytes)})" if role is not report.roles[-1] and lightest else ""
        return f"{ranks_text(role.ranks)}: {peaks}{more}"
    return ("ranks by shape (the same stacks hold the peak; % over the lightest): "
            + "; ".join(said(role) for role in report.roles))


def shown_ranks(report: RanksReport, top: int, min_delta: int, check: Optional[Check]) -> RanksShown:
    """The ranks report in words and cells; `top` and `min_delta` fold the heaviest-vs-median rows."""
    by_rank = {r.rank: r for r in report.ranks}
    d = report.diff.devices[0] if report.diff.devices else None
    apart = d is not None and report.heaviest != report.median_rank
    return scrubbed(RanksShown(
        counted=(f"{count_of(len(report.ranks), 'rank')} ({ranges([r.rank for r in report.ranks])})"
                 + (f"; missing: {ranges(report.missing)}" if report.missing else "")),
        table=_table(report),
        spread=(f"peak across ranks: min {format_bytes(report.min_bytes)}, median "
                f"{format_bytes(report.median_bytes)} (rank {report.median_rank}), max "
                f"{format_bytes(report.max_bytes)} (rank {report.heaviest}); spread "
                f"{format_bytes(report.spread_bytes)}, max/median {_ratio(report)}"),
        roles=_roles(report),
        against=(f"heaviest rank {report.heaviest} (device {by_rank[report.heaviest].device}) against the median "
                 f"rank {report.median_rank} (device {by_rank[report.median_rank].device}): {change_line(d)}"
                 if apart and d is not None else None),
        findings=report.diff.findings if apart else [],
        detail=device_report(d, top, min_delta) if apart and d is not None else None,
        check=check_line(check) if check is not None else None), skip=("findings", "detail"))
