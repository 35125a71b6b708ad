"""pytest plugin: gate a test's device memory against a stored baseline, or a plain ceiling.

    @pytest.mark.memdiff                                 # against baselines/<test id>.json
    @pytest.mark.memdiff(fail_over_pct=5, categories={"activation": "10%"})
    @pytest.mark.memdiff(fail_on=["K002"], ignore="P001,T003")  # findings that fail, or are silenced
    @pytest.mark.memdiff(limit="2GiB")                   # a ceiling on the peak, no baseline
    @pytest.mark.memdiff(emulate="h100")                 # a CUDA test body on a machine without a GPU
    def test_train_step(): ...

The body of a marked test is recorded with `memdiff.recording.capture.record` (CUDA when available, else
the CPU profiler route), summarized and judged; a test that breaks a limit fails with the
diff's first screen. `--memdiff-update` writes or refreshes the baselines instead. Tests without
the marker are left alone: nothing is recorded and torch is never imported for them.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import tempfile
import warnings
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

import pytest

MARKER = "memdiff"
# The marker's keywords and what they mean, for the error when one is misspelled.
# The marker's keywords that are thresholds (api.thresholds takes them), and the others.
LIMIT_KEYWORDS = ("fail_over", "fail_over_pct", "categories", "phases", "fail_on", "ignore")
MARKER_KEYWORDS = ("limit", *LIMIT_KEYWORDS, "emulate")
UNSAFE = re.compile(r"[^A-Za-z0-9_.\[\]=,+-]+")
SHOWN_ROWS = 8  # rows of the diff a failing test shows: its first screen


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("memdiff", "device-memory gates (memdiff)")
    group.addoption("--memdiff-baselines", metavar="DIR",
                    help="folder of the baselines of @pytest.mark.memdiff tests (default: ini memdiff_baselines, "
                         "else baselines/)")
    group.addoption("--memdiff-emulate", metavar="GPU",
                    help="run every marked test's CUDA code on the emulated GPU (memdiff record --emulate; "
                         "docs/emulate.md), unless its marker names one")
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
    _check_baselines_folder(config)
    config.pluginmanager.register(_BadInput(), "memdiff-bad-input")
    config.addinivalue_line(
        "markers", "memdiff(limit=None, fail_over=None, fail_over_pct=None, categories=None, phases=None, "
                   "fail_on=None, ignore=None, emulate=None): record the test's device memory and gate it "
                   "against baselines/<test id>.json (fail_on, ignore: finding codes, docs/findings.md), or a "
                   "ceiling (limit); emulate=GPU runs the body on that emulated GPU (docs/emulate.md)")


def _check_baselines_folder(config: pytest.Config) -> None:
    """The baselines' folder, when it is named (--memdiff-baselines) or written (--memdiff-update),
    checked before any test runs, as the report folders are: a file named there made every test read
    'no baseline at FILE/NAME.json; create it with ... --memdiff-update', and that update then failed
    each test on 'is a file, not a folder' after recording its body."""
    from memdiff.atomic import check_folder
    from memdiff.errors import InputError

    named, update = config.getoption("memdiff_baselines"), config.getoption("memdiff_update")
    if named is None and not update:
        return
    folder, given = _folder(config), named or config.getini("memdiff_baselines")
    try:
        if named == "":  # not the default folder, which _folder would read it as
            check_folder(named)
        if update:
            check_folder(folder)  # written: a folder it can write into, or make
        elif os.path.exists(folder) and not os.path.isdir(folder):
            raise InputError(folder, "is a file, not a folder")  # read: it may be read-only, or not made yet
    except InputError as exc:
        label = "--memdiff-baselines" if named is not None else "memdiff_baselines (ini)"
        shown = exc.path if named == "" else given  # '' shown as '', as the report folders' is
        raise pytest.UsageError(f"{label}: {shown}: {exc.message}") from None


# Set on a marked test's report when its marker, baseline or recording is bad input (not a regression).
BAD_INPUT = ("memdiff", "bad input")
BAD_INPUT_STATUS = 2  # memdiff's exit status for bad input or usage, the CLI's


# Set on a marked test's report by --memdiff-update: the baseline it wrote, ("new" or "updated", path).
WROTE = "memdiff baseline written"


class _BadInput:
    """Ends the session with exit status 2 when a marked test failed on bad input (its marker, its
    baseline, a run that recorded nothing), as the CLI does: CI must tell it from a regression (1).
    Reports carry the mark, so this works in the controller of pytest-xdist too; so do they the
    baselines --memdiff-update wrote, which the session's summary lists."""

    def __init__(self) -> None:
        self.seen = False
        self.wrote: list = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seen = self.seen or BAD_INPUT in report.user_properties
        self.wrote += [value for name, value in report.user_properties if name == WROTE and report.when == "call"]

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        # The update wrote files into the repository: say which, for the reviewer's `git add`.
        if self.wrote:
            new = sum(1 for how, _ in self.wrote if how == "new")
            terminalreporter.write_line(
                f"memdiff: wrote {len(self.wrote)} baseline{'s' if len(self.wrote) > 1 else ''} ({new} new): "
                + ", ".join(sorted(path for _, path in self.wrote)) + "; review and commit them")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.seen and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
            session.exitstatus = BAD_INPUT_STATUS


def _bad_input(item: pytest.Item, message: str) -> None:
    """Fail a marked test on bad input: one line, and the session's exit status becomes 2."""
    item.user_properties.append(BAD_INPUT)
    pytest.fail(message, pytrace=False)


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
        close = [difflib.get_close_matches(k, MARKER_KEYWORDS, n=1) for k in unknown]
        hint = next((f" (did you mean {c[0]}?)" for c in close if c), "")
        _bad_input(item, f"@pytest.mark.memdiff takes keywords {', '.join(MARKER_KEYWORDS)}; got "
                         f"{', '.join(unknown) or repr(marker.args)}{hint}")
    others = sorted(k for k, v in marker.kwargs.items() if k not in ("limit", "emulate") and v is not None)
    if marker.kwargs.get("limit") is not None and others:
        _bad_input(item, f"@pytest.mark.memdiff: limit is a ceiling with no baseline, so {', '.join(others)} "
                         f"would check nothing: give one or the other")
    from memdiff import api
    from memdiff.analyse.classify import check_categories, load_rules
    from memdiff.errors import InputError
    from memdiff.recording.emulate.gpus import gpu

    emulate = marker.kwargs.get("emulate")
    emulate = item.config.getoption("memdiff_emulate") if emulate is None else emulate
    wrong = None
    try:
        # The marker's values are read before the body runs: a bad one is said without a recording.
        if emulate is not None:
            try:
                emulate = gpu(str(emulate)).key
            except InputError as exc:
                raise InputError("emulate", exc.message) from None  # the marker's keyword, not the CLI's flag
        if marker.kwargs.get("limit") is not None:
            api.to_bytes(marker.kwargs["limit"], "limit")
        api.thresholds(**_limits(marker.kwargs))
        if marker.kwargs.get("categories"):  # a misspelt category, said before the body runs, not after
            check_categories(marker.kwargs["categories"], load_rules(), "categories")
    except InputError as exc:
        wrong = f"{exc.path}: {exc.message}"
    if wrong is not None:  # failed outside the except: one line, no chained exception
        _bad_input(item, f"@pytest.mark.memdiff: {wrong}")
    folder = tempfile.mkdtemp(prefix="memdiff-")
    # Named after the test: the report's head and the baseline's source say which run it was ("test.pickle").
    snapshot = os.path.join(folder, baseline_name(item.nodeid)[: -len(".json")] + ".pickle")
    try:
        with api.record(snapshot, emulate=emulate):
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
    path = os.path.join(_folder(config), baseline_name(item.nodeid))
    refresh = f"pytest {item.nodeid!r} --memdiff-update"
    updating = bool(config.getoption("memdiff_update"))
    error = None
    try:
        summary = api.summarize(snapshot, history=bool(config.getoption("memdiff_html")))
        if not summary.devices:
            error = ("memdiff: the test recorded no device memory, so there is nothing to gate (does the model "
                     "run in another process, or before the test?)")
        elif options.get("limit") is not None:
            _ceiling(summary, options["limit"])
            return
        else:
            limits = _limits(options)
            if updating:
                make_folder(os.path.dirname(path))
                _replace_unreadable(path)
                # The marker is the test's rule: a refresh writes exactly it, never a mix with old limits.
                how = "updated" if os.path.isfile(path) else "new"
                api.write_baseline(summary, path, name=item.nodeid, keep_limits=False, **limits)
                item.user_properties.append((WROTE, (how, os.path.relpath(path))))
                return
            if not os.path.exists(path):
                # Nothing was compared: bad input (exit 2), as `memdiff gate --require-baseline` says
                # it, not a regression (1) that CI would read as memory grown.
                error = (f"memdiff: no baseline for this test at {os.path.relpath(path)}; create it with\n"
                         f"    {refresh}{_renamed_from(path, config)}")
            else:
                stored = api.load_baseline(path).name
                if stored != item.nodeid:
                    # A baseline copied from another test, or a renamed test's file moved by hand: gated, it
                    # judged this test by another's memory (an eval step's copy read as P002, a twin's passed).
                    error = (f"memdiff: {os.path.relpath(path)} is the baseline of {stored!r}, not of this test "
                             f"(copied from another test, or the test renamed?); make this test's: {refresh}")
                else:
                    report = api.gate(summary, path, top=SHOWN_ROWS, **limits)
    except InputError as exc:
        # Said outside the handler: pytest would print the InputError too, as the failure's context.
        # The test's own baseline by the path its other lines use (`no baseline ... at baselines/...`).
        where = os.path.relpath(path) if exc.path == path else exc.path
        error = f"memdiff: {where}: {exc.message}" + (f"; refresh it: {refresh}" if exc.path == path and
                                                        not updating else "")
    if error is not None:
        _bad_input(item, error)
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
                    error = f"memdiff: {exc.path}: {exc.message}"
                if error is not None:
                    _bad_input(item, error)
        # The first line is what pytest's short summary shows: the figures, not only the verdict.
        pytest.fail(f"memdiff: {report.failure} against {os.path.relpath(path)}: {report.headline}\n\n{text}",
                    pytrace=False)


# The baseline file names of every test collected, before -k or -m deselects any.
COLLECTED = pytest.StashKey[frozenset]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    config.stash[COLLECTED] = frozenset(baseline_name(item.nodeid) for item in items)


def _renamed_from(path: str, config: pytest.Config) -> str:
    """A line naming the baseline in the same folder closest in name to `path`, among those of no test
    collected in this session: a renamed test leaves its old baseline behind, which nothing else shows."""
    folder = os.path.dirname(path)
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".json") and n not in config.stash.get(COLLECTED, ())]
    except OSError:
        return ""
    close = difflib.get_close_matches(os.path.basename(path), names, n=1, cutoff=0.8)
    return (f"\n    ({os.path.relpath(os.path.join(folder, close[0]))} is there, of no test collected in this "
            f"session: if this test was renamed from that one, that file is stale)") if close else ""


def _limits(options: Mapping[str, Any]) -> Dict[str, Any]:
    """The marker's thresholds, as api.thresholds takes them (`emulate` and `limit` are not)."""
    return {k: v for k, v in options.items() if k in LIMIT_KEYWORDS and v is not None}


def _replace_unreadable(path: str) -> None:
    """A test's own baseline that cannot be read is replaced by --memdiff-update, with a warning:
    the plugin names the file, so it holds nothing else (the CLI never overwrites what it cannot read)."""
    from memdiff import api
    from memdiff.errors import InputError

    if not os.path.isfile(path):
        return
    try:
        api.load_baseline(path)
    except InputError as exc:
        from memdiff.compare.findings import finding, shown

        replaced = finding("G009", path=exc.path, problem=exc.message)
        warnings.warn(f"memdiff: {shown(replaced)}", stacklevel=1)
        os.remove(path)


def _ceiling(summary: Any, limit: Any) -> None:
    from memdiff.api import to_bytes
    from memdiff.compare.observe import where_text
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
