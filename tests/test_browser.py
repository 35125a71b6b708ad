"""The HTML report in a real browser: headless Chromium, network cut off, the real ctx128 -> ctx256 pair.

Skips with a reason when Chromium or Playwright is missing; `.ci/run` installs both and sets
MEMDIFF_REQUIRE_BROWSER=1, so in CI a skip is a failure.
"""

from __future__ import annotations

import json
import re

import pytest
from browser import Opened, chromium, open_report
from conftest import alloc, free, py_frames, required_or_skip

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
        required_or_skip("MEMDIFF_REQUIRE_BROWSER", "; ".join(reasons))
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
    _reads_without_hovering(seen, _data(report))


def _data(report) -> dict:
    m = re.search(r'<script type="application/json" id="memdiff-data">(.*?)</script>', report.read_text(), re.S)
    return json.loads(m.group(1))


def _reads_without_hovering(seen: Opened, data: dict) -> None:
    """Issue 24 item 8: one order of categories, a phase legend, a site on every bar, no clipped tick."""
    order = seen.legend_categories
    # One order for the page: the built-in categories longest-lived first. Base and head stack
    # them alike (the payload lists each run's by its own bytes: activation first in head's, last in base's).
    assert order == ["parameter", "optimizer_state", "gradient", "activation", "autograd", "optimizer_temporary",
                     "workspace"]
    runs = data["devices"][0]["runs"]
    assert [list(r["history"]["categories"]) for r in runs] != [order[:len(r["history"]["categories"])] for r in runs]
    assert seen.areas == [[c for c in order if c in r["history"]["categories"]] for r in runs]
    assert seen.tip_categories and seen.tip_categories == [c for c in order if c in seen.tip_categories]
    for chart in seen.lanes:
        ranks = [order.index(lane["category"]) for lane in chart]
        assert ranks == sorted(ranks), [lane["category"] for lane in chart]
    # The phase shading has a legend, one entry per phase drawn.
    assert sorted(seen.legend_phases) == sorted(seen.band_phases) == ["backward", "forward", "optimizer"]
    assert seen.legend_phases == ["forward", "backward", "optimizer"]
    # Every lane of "live at the peak" is labelled with its group's site, cut with an ellipsis to fit.
    for chart, run in zip(seen.lanes, runs):
        assert {lane["signature"] for lane in chart} == {b["signature"] for b in run["bars"]}
        for lane in chart:
            site = run["groups"][lane["signature"]]["site"]
            assert lane["text"] == site or (lane["text"].endswith("\u2026") and site.startswith(lane["text"][:-1]))
            assert lane["title"] == f"{site} ({lane['category']})" and lane["bars"] > 0 and lane["inside"]
    assert any(lane["text"] == "functional.py:einsum <- einsum <- bmm" for lane in seen.lanes[1])
    # Every x tick label, the last (100%, or the run's end in seconds) included, lies inside its chart.
    assert set(seen.ticks) == {"trace", "time", "overlay"}
    assert [chart[-1]["text"] for chart in seen.ticks["trace"]] == ["100%", "100%"]
    for view, charts in seen.ticks.items():
        assert charts and all(chart for chart in charts), view
        assert all(t["inside"] for chart in charts for t in chart), (view, [chart[-1] for chart in charts])


def test_a_site_wider_than_its_lane_is_cut_with_an_ellipsis(write_snapshot, tmp_path, capsys):
    # The real pairs' sites all fit a lane; a hand-made one whose function name does not.
    executable = _browser_or_skip()
    name = "forward_" + "very_long_function_name_" * 30
    frames = py_frames(f"model.py:3:{name}", "train.py:9:main")
    path = write_snapshot({"device_traces": [[alloc(0x100, 512, frames), alloc(0x200, 256, frames),
                                              free(0x200, 256, frames)]], "segments": []})
    report = tmp_path / "peak.html"
    assert main(["peak", path, "--html", str(report)]) == 0
    capsys.readouterr()

    seen = open_report(report, executable=executable)

    assert seen.console_errors == []
    [lanes] = seen.lanes
    groups = _data(report)["devices"][0]["runs"][0]["groups"]
    assert lanes and all(name in groups[lane["signature"]]["site"] for lane in lanes)
    for lane in lanes:
        site = groups[lane["signature"]]["site"]
        assert lane["title"] == f"{site} ({lane['category']})" and lane["inside"]
        assert lane["text"].endswith("\u2026") and len(lane["text"]) > 20 and site.startswith(lane["text"][:-1])
