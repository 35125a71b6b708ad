"""Markdown reports, for pull-request comments and job summaries."""

from __future__ import annotations

from typing import Dict

from memdiff.diff import Diff, Folded
from memdiff.gate import Verdict
from memdiff.model import Source
from memdiff.render.table import category_table, check_line, diff_table, peak_line


def _escape(cell: str) -> str:
    # Sites hold `<module>`, `|` never; keep GitHub from reading tags or splitting cells.
    return cell.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _input(s: Source) -> str:
    return f"`{s.file}` ({s.container}, {s.generation})"


def render_diff(diff: Diff, verdict: Verdict, folded: Dict[int, Folded]) -> str:
    """The diff report in GitHub-flavoured markdown."""
    mark = "✅ no peak regression" if verdict.passed else "❌ peak regression"
    lines = [f"### memdiff: {mark}", "", f"**base** {_input(diff.base)} → **head** {_input(diff.head)}"]
    lines += ["", *(f"> ⚠️ {_escape(w)}" for w in diff.warnings)] if diff.warnings else []
    for d in diff.devices:
        lines += ["", f"#### device {d.device}: {peak_line(d)}"]
        if d.categories:
            lines += ["", category_table(d, "github")]
        lines += ["", diff_table(folded[d.device], "github", escape=_escape)]
    lines += ["", f"**Rule:** {verdict.rule}", ""]
    lines += [f"- {check_line(c)}" for c in verdict.checks]
    lines += ["", *(_escape(n) for n in verdict.notes)] if verdict.notes else []
    return "\n".join(lines) + "\n"
