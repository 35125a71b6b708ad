"""What `memdiff ranks JOB` prints: the ranks side by side, the spread, roles, and why the heaviest is heaviest,
as report/ranks.py words them."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, Optional

from memdiff import __version__
from memdiff.compare.findings import shown as shown_finding
from memdiff.compare.judge import Check
from memdiff.compare.ranks import RanksReport
from memdiff.inert import text
from memdiff.render.json import dumps
from memdiff.render.table import layout, row_table
from memdiff.report.ranks import RanksShown
from memdiff.report.types import RANKS_SCHEMA_VERSION


def render_text(shown: RanksShown) -> str:
    """The ranks report (report.ranks words it): a row per rank, the spread, the roles, the heaviest
    rank against the median one, the check."""
    lines = [shown.counted, "", layout(shown.table, "simple"), "", shown.spread]
    lines += [shown.roles] if shown.roles else []
    if shown.against is not None:
        lines += ["", shown.against, *[text(shown_finding(f)) for f in shown.findings]]
        if shown.detail is not None and shown.detail.categories is not None:
            lines += ["", layout(shown.detail.categories, "simple")]
        lines += ["", layout(row_table(shown.detail), "simple")] if shown.detail is not None else []
    lines += ["", shown.check] if shown.check is not None else []
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
