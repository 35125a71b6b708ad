"""The HTML report in a real browser: headless Chromium, network cut off, the real ctx128 -> ctx256 pair.

Skips with a reason when Chromium or Playwright is missing; `.ci/run` installs both and sets
MEMDIFF_REQUIRE_BROWSER=1, so in CI a skip is a failure.
"""

from __future__ import annotations

import os

import pytest

from browser import chromium, open_report
from memdiff.cli import main
from memdiff.units import format_bytes

# Slow (the fast loop, -m "not slow", leaves it out): drives Chromium.
pytestmark = pytest.mark.slow


def _browser_or_skip() -> str:
    reasons = []
    path = chromium()
    if path is None:
        reasons.append("no Chromium installed (apt-get install chromium)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        reasons.append("playwright is not installed (pip install -e '.[test]')")
    if reasons:
        reason = "; ".join(reasons)
        if os.environ.get("MEMDIFF_REQUIRE_BROWSER") == "1":
            pytest.fail(reason + "; MEMDIFF_REQUIRE_BROWSER=1 makes this a failure")
        pytest.skip(reason)
    return path


def test_the_report_of_a_real_pair_draws_offline_with_exact_peaks(shared, expected, tmp_path, capsys):
    executable = _browser_or_skip()
    base, head = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx256-train.pickle"
    report = tmp_path / "report.html"
    assert main([str(base), str(head), "--html", str(report)]) == 1  # the head's peak grew 29.8%
    capsys.readouterr()

    seen = open_report(report, screenshot=tmp_path / "report.png", executable=executable)

    assert seen.console_errors == []
    assert seen.requests == []
    peaks = [expected[name]["0"]["peak_bytes"]
             for name in ("cs336-medium-ctx128-train.pickle", "cs336-medium-ctx256-train.pickle")]
    assert [t["role"] for t in seen.timelines] == ["base", "head"]
    # Drawn from the history: its highest point is the peak the viewer's rules give, exactly.
    assert [int(t["peak-bytes"]) for t in seen.timelines] == peaks
    assert [int(t["drawn-max"]) for t in seen.timelines] == peaks
    assert seen.peak_labels == [f"base peak {format_bytes(peaks[0])}", f"head peak {format_bytes(peaks[1])}"]
    # Hovering the first row shows its stack; clicking it marks its groups' bars.
    assert seen.row_title.split(" <- ")[0] in seen.detail_after_hover
    assert "at::_ops::" in seen.detail_after_hover
    assert seen.selected_bars > 0
    assert seen.zoomed
    assert (tmp_path / "report.png").stat().st_size > 10_000
