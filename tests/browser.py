"""Open a memdiff HTML report in headless Chromium with the network cut off, and read it back.

Used by tests/test_browser.py, and run by hand to regenerate the screenshot in docs/:

    memdiff tests/data/cuda/gpt2-base.pickle.gz \\
        tests/data/cuda/gpt2-retain-graph.pickle.gz --html /tmp/report.html
    python tests/browser.py /tmp/report.html docs/report.png

Playwright drives the Chromium that the system has (Debian's `chromium` package): Playwright's
own browser download is never needed.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

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
    legend_categories: List[str] = field(default_factory=list)  # the legend's categories, in its order
    legend_phases: List[str] = field(default_factory=list)  # the legend's phases, in its order
    band_phases: List[str] = field(default_factory=list)  # the phases of the bands drawn, each once
    areas: List[List[str]] = field(default_factory=list)  # each timeline's stacked categories, bottom first
    tip_categories: List[str] = field(default_factory=list)  # the categories hovering the last timeline lists
    lanes: List[List[Dict[str, Any]]] = field(default_factory=list)  # each bar chart's lanes, top first
    ticks: Dict[str, List[List[Dict[str, Any]]]] = field(default_factory=dict)  # per view, each chart's, see TICKS
    trends: List[Dict[str, Any]] = field(default_factory=list)  # each main-branch trend chart, see TRENDS


# Each bar chart's lanes, top first: the label's text, the full site and category (its tooltip), its
# signature and category, whether its box lies inside the chart's, and how many bars the lane has.
LANES = """() => [...document.querySelectorAll("svg.bars")].map(svg => {
  const box = svg.getBoundingClientRect();
  const inside = b => b.left >= box.left && b.right <= box.right && b.top >= box.top && b.bottom <= box.bottom;
  const rects = [...svg.querySelectorAll("rect.bar")];
  return [...svg.querySelectorAll("text.bar-label")].map(t => ({
    role: svg.dataset.role, text: t.textContent, title: t.parentNode.querySelector("title").textContent,
    signature: t.dataset.signature, category: t.dataset.category, inside: inside(t.getBoundingClientRect()),
    bars: rects.filter(r => r.dataset.signature === t.dataset.signature).length}));
})"""

# Each timeline's (or the overlay's) x tick labels: text, and whether the box lies inside the svg's.
TICKS = """() => [...document.querySelectorAll("svg.timeline")].map(svg => {
  const box = svg.getBoundingClientRect();
  return [...svg.querySelectorAll(".axis text.x-tick")].map(t => {
    const b = t.getBoundingClientRect();
    return {text: t.textContent, inside: b.left >= box.left && b.right <= box.right,
            right: b.right, svg_right: box.right};
  });
})"""


# Each main-branch trend chart (--history): its points as drawn (centre in page pixels, the bytes
# and tooltip they carry), this run's point, and whether every point lies inside the chart.
TRENDS = """() => [...document.querySelectorAll("svg.trend")].map(svg => {
  const box = svg.getBoundingClientRect();
  const at = c => { const b = c.getBoundingClientRect();
    return {x: (b.left + b.right) / 2, y: (b.top + b.bottom) / 2, bytes: Number(c.dataset.bytes),
            commit: c.dataset.commit || null, title: c.querySelector("title").textContent,
            inside: b.left >= box.left && b.right <= box.right && b.top >= box.top && b.bottom <= box.bottom}; };
  return {width: box.width, height: box.height, points: [...svg.querySelectorAll("circle.trend-point")].map(at),
          head: at(svg.querySelector("circle.trend-head")),
          line: svg.querySelector("polyline.trend-main").getAttribute("points").trim().split(/\\s+/).length};
})"""


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
            seen.legend_categories = [s.get_attribute("data-category") or ""
                                      for s in page.query_selector_all(".legend [data-category]")]
            seen.legend_phases = [s.get_attribute("data-phase") or ""
                                  for s in page.query_selector_all(".legend [data-phase]")]
            seen.band_phases = page.evaluate(
                '() => [...new Set([...document.querySelectorAll("rect.band")].map(r => r.dataset.phase))]')
            seen.areas = [[a.get_attribute("data-category") or "" for a in svg.query_selector_all("path.area")]
                          for svg in page.query_selector_all("svg.timeline")]
            seen.lanes = page.evaluate(LANES)
            seen.trends = page.evaluate(TRENDS)
            timelines = page.query_selector_all("svg.timeline")
            if timelines:
                timelines[-1].hover()
                seen.tip_categories = page.evaluate(
                    '() => [...document.querySelectorAll("#tip tr")].slice(1).map(r => r.cells[0].textContent)')
                page.mouse.move(0, 0)
            seen.ticks["trace"] = page.evaluate(TICKS)
            for action in ("time", "overlay"):  # each view on its own, then back
                button = page.query_selector(f"#toolbar [data-action={action}]")
                if button is not None and button.is_enabled():
                    button.click()
                    seen.ticks[action] = page.evaluate(TICKS)
                    button.click()
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
