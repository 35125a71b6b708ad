"""JSON output: summaries (schemas/summary.schema.json) and reports (diff, gate and job documents)."""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from memdiff.inert import json_text
from memdiff.model import Finding, Summary
from memdiff.report.build import Report


def dumps(data: Any) -> str:
    """Indented JSON with a trailing newline, as every JSON output is written."""
    return json_text(json.dumps(data, indent=2, ensure_ascii=False)) + "\n"


def render_summary(summary: Summary, findings: Optional[Sequence[Finding]] = None) -> str:
    """The summary as indented JSON; with `findings` (`memdiff peak`), their list added as `findings`."""
    doc = summary.to_dict()
    if findings is not None:
        doc["findings"] = [f.to_dict() for f in findings]
    return dumps(doc)


def render_diff(report: Report) -> str:
    """The report's document (diff.schema.json), never folded."""
    return dumps(report.to_dict())
