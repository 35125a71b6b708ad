"""JSON output of summaries (the contract in schemas/summary.schema.json)."""

from __future__ import annotations

import json

from memdiff.model import Summary


def render_summary(summary: Summary) -> str:
    """The summary as indented JSON with a trailing newline."""
    return json.dumps(summary.to_dict(), indent=2, ensure_ascii=False) + "\n"
