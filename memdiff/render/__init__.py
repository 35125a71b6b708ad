"""Renderers: a Report in, text out. Each lays out what the Report decided and computes nothing."""

from __future__ import annotations

from memdiff.report.build import Report

FORMATS = ("text", "markdown", "json")


def render(report: Report, fmt: str) -> str:
    """The report in `fmt` (one of FORMATS); text and markdown show the folded rows, JSON every row."""
    if fmt == "json":
        from memdiff.render.json import render_diff as as_json

        return as_json(report)
    if fmt == "markdown":
        from memdiff.render.markdown import render_diff as as_markdown

        return as_markdown(report)
    from memdiff.render.text import render_diff as as_text

    return as_text(report)
