"""`memdiff gate --fit FIT.json`: a snapshot's report with its baseline's fit check added, so that
every output of the one report (text, markdown, JSON, HTML, the PR comment) says it."""

from __future__ import annotations

from dataclasses import replace
from typing import List

from memdiff.model import Finding
from memdiff.report.build import Report
from memdiff.report.types import CheckLine


def with_fit(report: Report, findings: List[Finding], lines: List[str]) -> Report:
    """The report with the fit's check lines (one per GPU of the baseline) and its G011 findings, failed
    when there is one. A report not judged stays unjudged: the gate always judges."""
    if report.verdict is None:
        return report
    verdict = replace(report.verdict, passed=report.verdict.passed and not findings,
                      findings=report.verdict.findings + findings)
    return replace(report, verdict=verdict,
                   check_lines=report.check_lines + [CheckLine(line.startswith("PASS"), line) for line in lines],
                   notes=report.notes + findings)
