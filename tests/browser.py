"""Open a memdiff HTML report in headless Chromium with the network cut off, and read it back.

Used by tests/test_browser.py, and run by hand to regenerate the screenshot in docs/:

    memdiff ../shared/snapshots/cs336-medium-ctx128-train.pickle \\
        ../shared/snapshots/cs336-medium-ctx256-train.pickle --html /tmp/report.html
    python tests/browser.py /tmp/report.html docs/report.png

Playwright drives the Chromium that the system has (Debian's `chromium` package): Playwright's
own browser download is never needed.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium() -> Optional[str]:
    """The path of an installed Chromium, if any."""
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class Opened:
    """What the page did and showed."""

    console_errors: List[str] = field(default_factory=list)
    requests: List[str] = field(default_factory=list)  # every URL asked for besides the page itself
    timelines: List[Dict[str, Optional[str]]] = field(default_factory=list)  # data-* of each svg.timeline
    peak_labels: List[str] = field(default_factory=list)
    row_title: str = ""  # the first diff row's site cell
    detail_after_hover: str = ""  # the stack panel after hovering that row
    selected_bars: int = 0  # bars marked after clicking it
    zoomed: bool = False  # the x axis changed after pressing "+" on a chart


def open_report(report: Path, screenshot: Optional[Path] = None, executable: Optional[str] = None) -> Opened:
    """Load `report` offline, exercise a diff row and the zoom, optionally save a screenshot."""
    from playwright.sync_api import sync_playwright

    page_url = report.resolve().as_uri()
    seen = Opened()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable or chromium(), args=["--no-sandbox"])
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 1500}, offline=True,
                                          color_scheme="light")
            page = context.new_page()
            page.on("console", lambda m: seen.console_errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: seen.console_errors.append(str(e)))
            page.on("request", lambda r: seen.requests.append(r.url) if r.url != page_url else None)
            # Anything but the page itself is refused, so a fetch would also fail loudly.
            page.route("**/*", lambda route: route.continue_() if route.request.url == page_url else route.abort())
            page.goto(page_url)
            page.wait_for_selector("body[data-drawn=true]", timeout=15_000)
            if screenshot is not None:
                page.screenshot(path=str(screenshot), full_page=False)
            seen.timelines = [{k: svg.get_attribute(f"data-{k}") for k in ("role", "peak-bytes", "drawn-max")}
                              for svg in page.query_selector_all("svg.timeline")]
            seen.peak_labels = [t.text_content() or "" for t in page.query_selector_all("g.peak-marker text")]
            rows = page.query_selector_all("tr.row")
            if rows:
                seen.row_title = rows[0].query_selector_all("td")[-1].text_content() or ""
                rows[0].hover()
                seen.detail_after_hover = page.inner_text("#detail")
                rows[0].click()
                seen.selected_bars = len(page.query_selector_all("svg.bars rect.bar.hl"))
            before = page.get_attribute("svg.timeline .axis text:last-of-type", "x")
            page.focus("svg.timeline")
            page.keyboard.press("+")
            seen.zoomed = page.get_attribute("svg.timeline .axis text:last-of-type", "x") != before
        finally:
            browser.close()
    return seen


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python tests/browser.py REPORT.html SCREENSHOT.png")
    opened = open_report(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"console errors: {len(opened.console_errors)}, requests: {len(opened.requests)}, "
          f"timelines: {opened.timelines}")
