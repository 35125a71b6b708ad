"""The report stage: everything any output shows, decided once (`memdiff.report.build.compare`).
`from memdiff.report import Report` is the public path (docs/api.md); the modules under it are
memdiff's internal layout."""

from memdiff.report.build import Report

__all__ = ["Report"]
