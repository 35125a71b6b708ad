"""JSON output of summaries (the contract in schemas/summary.schema.json)."""

from __future__ import annotations

import json
from typing import Any, Dict

from memdiff.differ import Diff
from memdiff.judge import Verdict
from memdiff.model import Summary


def render_summary(summary: Summary) -> str:
    """The summary as indented JSON with a trailing newline."""
    return json.dumps(summary.to_dict(), indent=2, ensure_ascii=False) + "\n"


def diff_document(diff: Diff, verdict: Verdict) -> Dict[str, Any]:
    """The diff contract: verdict, rule, checks and per device every row, never folded."""
    return {**verdict.to_dict(), **diff.to_dict()}


def render_diff(diff: Diff, verdict: Verdict) -> str:
    """The diff contract as indented JSON."""
    return json.dumps(diff_document(diff, verdict), indent=2, ensure_ascii=False) + "\n"
