"""JSON output: summaries (schemas/summary.schema.json) and reports (diff, gate and job documents)."""

from __future__ import annotations

import json
from typing import Any

from memdiff.inert import json_text
from memdiff.model import Summary
from memdiff.report import Report


def dumps(data: Any) -> str:
    """Indented JSON with a trailing newline, as every JSON output is written."""
    return json_text(json.dumps(data, indent=2, ensure_ascii=False)) + "\n"


def render_summary(summary: Summary) -> str:
    """The summary as indented JSON."""
    return dumps(summary.to_dict())


def render_diff(report: Report) -> str:
    """The report's document (diff.schema.json), never folded."""
    return dumps(report.to_dict())
