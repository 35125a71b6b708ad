"""JSON output of summaries (the contract in schemas/summary.schema.json)."""

from __future__ import annotations

import json
from typing import Any, Dict

from memdiff import __version__
from memdiff.differ import Diff
from memdiff.judge import Verdict
from memdiff.model import Summary


def render_summary(summary: Summary) -> str:
    """The summary as indented JSON with a trailing newline."""
    return json.dumps(summary.to_dict(), indent=2, ensure_ascii=False) + "\n"


# The diff JSON's version: bumped when a field changes meaning or disappears.
DIFF_SCHEMA_VERSION = 1


def diff_document(diff: Diff, verdict: Verdict) -> Dict[str, Any]:
    """The diff contract: its version, verdict, rule, checks and per device every row, never folded."""
    return {"schema_version": DIFF_SCHEMA_VERSION, "tool": f"memdiff {__version__}", **verdict.to_dict(),
            **diff.to_dict()}


def render_diff(diff: Diff, verdict: Verdict) -> str:
    """The diff contract as indented JSON."""
    return json.dumps(diff_document(diff, verdict), indent=2, ensure_ascii=False) + "\n"
