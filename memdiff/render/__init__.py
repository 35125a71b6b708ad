"""Renderers: a Report in, text out. Each lays out what the Report decided and computes nothing."""

from __future__ import annotations

from memdiff.report.build import Report

FORMATS = ("text", "markdown", "json", "html")


def render(report: Report, fmt: str) -> str:
    """The report in `fmt` (one of FORMATS); text and markdown show the folded rows, JSON every row,
    HTML one self-contained page (what `--html` writes). ValueError for any other format: a report
    is never shown in a format other than the one asked for."""
    if fmt == "json":
        from memdiff.render.json import render_diff as as_json

        return as_json(report)
    if fmt == "markdown":
        from memdiff.render.markdown import render_diff as as_markdown

        return as_markdown(report)
    if fmt == "html":
        from memdiff.render.html import render_diff as as_html

        return as_html(report)
    if fmt == "text":
        from memdiff.render.text import render_diff as as_text

        return as_text(report)
    raise ValueError(f"no report format {fmt!r}: one of {', '.join(FORMATS)}")
