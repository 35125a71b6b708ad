"""pytest plugin: gate a test's device memory against a stored baseline, or a plain ceiling.

    @pytest.mark.memdiff                                 # against baselines/<test id>.json
    @pytest.mark.memdiff(fail_over_pct=5, categories={"activation": "10%"})
    @pytest.mark.memdiff(limit="2GiB")                   # a ceiling on the peak, no baseline
    def test_train_step(): ...

The body of a marked test is recorded with `memdiff.capture.record` (CUDA when available, else
the CPU profiler route), summarized and judged; a test that breaks a limit fails with the
diff's first screen. `--memdiff-update` writes or refreshes the baselines instead. Tests without
the marker are left alone: nothing is recorded and torch is never imported for them.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional, Tuple

import pytest

MARKER = "memdiff"
# The marker's keywords and what they mean, for the error when one is misspelled.
MARKER_KEYWORDS = ("limit", "fail_over", "fail_over_pct", "categories", "phases")
UNSAFE = re.compile(r"[^A-Za-z0-9_.\[\]=,+-]+")
SHOWN_ROWS = 8  # rows of the diff a failing test shows: its first screen


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("memdiff", "device-memory gates (memdiff)")
    group.addoption("--memdiff-baselines", metavar="DIR",
                    help="folder of the baselines of @pytest.mark.memdiff tests (default: ini memdiff_baselines, "
                         "else baselines/)")
    group.addoption("--memdiff-update", action="store_true",
                    help="write or refresh the baselines of the marked tests instead of gating them")
    group.addoption("--memdiff-report", metavar="DIR",
                    help="write the markdown report of each marked test that fails its gate into DIR")
    group.addoption("--memdiff-html", metavar="DIR",
                    help="write the HTML report (memory over time, the tables, the stacks) of each marked test "
                         "that fails its gate into DIR")
    parser.addini("memdiff_baselines", "folder of the baselines of @pytest.mark.memdiff tests", default="baselines")


def pytest_configure(config: pytest.Config) -> None:
    from memdiff.atomic import check_folder
    from memdiff.errors import InputError

    for option in ("memdiff_report", "memdiff_html"):
        if config.getoption(option) is not None:
            try:  # before any test runs: a bad folder must not cost the session its reports
                check_folder(config.getoption(option))
            except InputError as exc:
                raise pytest.UsageError(f"--{option.replace('_', '-')}: {exc.path}: {exc.message}") from None
    config.addinivalue_line(
        "markers", "memdiff(limit=None, fail_over=None, fail_over_pct=None, categories=None, phases=None): record "
                   "the test's device memory and gate it against baselines/<test id>.json, or a ceiling (limit)")


def baseline_name(nodeid: str) -> str:
    """The file name a test's baseline is kept under: its id with runs of characters other than
    letters, digits and `_.[]=,+-` turned into `-` (`tests/test_a.py::test_b[x]` ->
    `tests-test_a.py-test_b[x].json`)."""
    return UNSAFE.sub("-", nodeid).strip("-") + ".json"


def _folder(config: pytest.Config) -> str:
    folder = config.getoption("memdiff_baselines") or config.getini("memdiff_baselines")
    return folder if os.path.isabs(folder) else os.path.join(str(config.rootpath), folder)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return (yield)
    unknown = sorted(set(marker.kwargs) - set(MARKER_KEYWORDS))
    if unknown or marker.args:
        pytest.fail(f"@pytest.mark.memdiff takes keywords {', '.join(MARKER_KEYWORDS)}; got "
                    f"{', '.join(unknown) or repr(marker.args)}", pytrace=False)
    from memdiff import api

    folder = tempfile.mkdtemp(prefix="memdiff-")
    snapshot = os.path.join(folder, "test.pickle")
    try:
        with api.record(snapshot):
            result = yield
        _judge(item, marker.kwargs, snapshot)
        return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _judge(item: pytest.Item, options: Mapping[str, Any], snapshot: str) -> None:
    """Gate the recorded snapshot as the marker says; pytest.fail with the report when it breaks a limit."""
    from memdiff import api
    from memdiff.atomic import make_folder
    from memdiff.errors import InputError

    config = item.config
    try:
        summary = api.summarize(snapshot, history=bool(config.getoption("memdiff_html")))
        if options.get("limit") is not None:
            _ceiling(summary, options["limit"])
            return
        path = os.path.join(_folder(config), baseline_name(item.nodeid))
        limits = {k: v for k, v in options.items() if k != "limit" and v is not None}
        if config.getoption("memdiff_update"):
            make_folder(os.path.dirname(path))
            # The marker is the test's rule: a refresh writes exactly it, never a mix with old limits.
            api.write_baseline(summary, path, name=item.nodeid, keep_limits=False, **limits)
            return
        if not os.path.exists(path):
            pytest.fail(f"memdiff: no baseline for this test at {os.path.relpath(path)}; create it with\n"
                        f"    pytest {item.nodeid!r} --memdiff-update", pytrace=False)
        report = api.gate(summary, path, top=SHOWN_ROWS, **limits)
    except InputError as exc:
        pytest.fail(f"memdiff: {exc.path}: {exc.message}", pytrace=False)
    if not report.passed:
        from memdiff.render import render
        from memdiff.render.text import render_stacks

        text = render(report, "text") + ("\n" + render_stacks(report) if config.getoption("verbose") > 0 else "")
        for option, page in (("memdiff_report", lambda: (".md", render(report, "markdown"))),
                             ("memdiff_html", lambda: (".html", api.html_report(report)))):
            if config.getoption(option) is not None:
                try:
                    _write_report(config.getoption(option), item.nodeid, page())
                except InputError as exc:
                    pytest.fail(f"memdiff: {exc.path}: {exc.message}", pytrace=False)
        pytest.fail(f"memdiff: device memory regressed against {os.path.relpath(path)}\n\n{text}", pytrace=False)


def _ceiling(summary: Any, limit: Any) -> None:
    from memdiff.api import to_bytes
    from memdiff.differ import where_text
    from memdiff.units import format_bytes

    ceiling = to_bytes(limit, "limit")
    assert ceiling is not None  # _judge passes only a limit that is set
    over = [d for d in summary.devices if d.peak_bytes > ceiling]
    if over:
        d = over[0]
        where = f" in {where_text(d.phase_at_peak, d.step_at_peak)}" if d.phase_at_peak else ""
        top = ", ".join(f"{g.site} {format_bytes(g.bytes)} ({g.category})" for g in d.groups[:3])
        pytest.fail(f"memdiff: device {d.device} peak {format_bytes(d.peak_bytes)}{where} is over the limit of "
                    f"{format_bytes(ceiling)}; largest live at the peak: {top}", pytrace=False)


def _write_report(folder: str, nodeid: str, page: Tuple[str, str]) -> None:
    """Write a failing test's report, named after its baseline, into `folder`."""
    from memdiff.atomic import make_folder, write_output

    suffix, text = page
    make_folder(folder)
    write_output(os.path.join(folder, baseline_name(nodeid)[: -len(".json")] + suffix), text)


class Recorded:
    """What `memdiff_record` leaves after its block: the run's Summary."""

    summary: Optional[Any] = None


@pytest.fixture
def memdiff_record(tmp_path: Any) -> Any:
    """`with memdiff_record() as run: ...` records the block; `run.summary` is its Summary after."""
    @contextmanager
    def record_block(name: str = "block") -> Iterator[Recorded]:
        from memdiff import api

        path = str(tmp_path / f"{name}.pickle")
        recorded = Recorded()
        with api.record(path):
            yield recorded
        recorded.summary = api.summarize(path)
    return record_block
