"""memdiff from Python: the stages the CLI wires, as functions on paths or the dataclasses they return.

    import memdiff

    base = memdiff.summarize("base.pickle")             # a Summary (the `memdiff summarize` JSON)
    change = memdiff.diff(base, "head.pickle")          # a Report, not judged: headline, rows per device
    report = memdiff.gate("head.pickle", "baselines/train.json", fail_over="256MiB")
    ahead = memdiff.forecast({"b1.pickle": 1, "b2.pickle": 2, "b4.pickle": 4}, at=16, budget="80GiB")
    maybe = memdiff.whatif("run.pickle", ["checkpoint", "optimizer=sgd"], budget="80GiB")
    print(report.passed, report.headline, [c.subject for c in report.checks if not c.passed])

Every result has `to_dict()`, the JSON the CLI writes: `memdiff.gate(...)` is one document of
`memdiff gate --format json`, `memdiff.diff(...)` the CLI's diff document less the verdict's keys.
`from memdiff.render import render; render(report, "markdown")` renders a Report as the CLI
does; a `diff` Report's `passed` is None (compared, not judged). Defaults are the CLI's: groups
are classified with the built-in rules, plus `rules` (rules files, JSON or TOML) when given.
Errors in the input raise `memdiff.errors.InputError` (the CLI's exit 2). Capturing needs torch;
nothing else here imports it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, ContextManager, Dict, Optional, Sequence, Tuple, Union

from memdiff.analyse.classify import Rule, check_categories, load_rules
from memdiff.analyse.lifetimes import BACKWARD, FORWARD, OPTIMIZER
from memdiff.compare.baseline import Baseline, comparable_pair, read_baseline, update_baseline
from memdiff.compare.limits import Limit, Thresholds, parse_pct, thresholds_over
from memdiff.compare.observe import PEAK
from memdiff.errors import InputError, clip
from memdiff.inert import baseline_command
from memdiff.lists import chosen_codes, limit_of, named_limits, split_items
from memdiff.model import Summary
from memdiff.numbers import whole_number
from memdiff.read.inputs import read_summary
from memdiff.report.build import Report, Settings, compare
from memdiff.report.build import Run as ReportRun
from memdiff.report.types import DEFAULT_TOP
from memdiff.units import MAX_SIZE, parse_size

if TYPE_CHECKING:
    from memdiff.predict.forecast.engine import Forecast
    from memdiff.predict.whatif import WhatIf

Run = Union[str, "os.PathLike[str]", Summary]
Size = Union[int, str, None]
PHASES = (FORWARD, BACKWARD, OPTIMIZER)  # the phases a limit can name, as --phase-fail-over's


def _knob(value: Any, where: str) -> int:
    """A knob value given to the API: an int, or text of ASCII digits; InputError naming `where`
    otherwise (a float or a bool, which int() would truncate or count as 1)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return whole_number(value)
        except ValueError:
            pass
    raise InputError(where, f"{clip(repr(value))} is not a knob value: a positive integer (a batch size, a length)")


def _rules(rules: Union[str, Sequence[str], None]) -> Sequence[Rule]:
    # As --rules takes them: one path, several, or a comma list (a file whose name holds a comma kept whole).
    return load_rules(split_items(rules, "rules", os.path.isfile) if rules is not None else [])


def summarize(path: Union[str, "os.PathLike[str]"], *, rules: Optional[Sequence[str]] = None,
              history: bool = False) -> Summary:
    """The classified Summary of a snapshot (or of a stored summary JSON); with `history`, each
    device's memory over time too, which the HTML report draws (it reads every allocation)."""
    return read_summary(os.fspath(path), _rules(rules), history)


def _summary(run: Run, rules: Optional[Sequence[str]]) -> Summary:
    return run if isinstance(run, Summary) else summarize(run, rules=rules)


def diff(base: Run, head: Run, *, at: str = PEAK, rules: Optional[Sequence[str]] = None,
         top: int = DEFAULT_TOP) -> Report:
    """Why `head` uses more (or less) memory than `base`: paths or Summaries, compared at their
    peaks or, with `at` = forward / backward / optimizer, at that phase's peak in both. The
    Report is not judged (`memdiff BASE HEAD` also applies the default rule)."""
    return compare([ReportRun(_summary(base, rules))], [ReportRun(_summary(head, rules))],
                   Settings(thresholds=None, at=at, top=top))


def to_bytes(value: Size, what: str) -> Optional[int]:
    """A size given as bytes (`1 << 28`, `1e9`) or as text (`"512MiB"`); InputError naming `what`
    when it is neither, or past what a size can be (negative, NaN, over 8 EiB)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        # True is an int to Python, and a list or a dict has no size: neither is what the caller meant.
        raise InputError(what, f"a value of type {type(value).__name__} is not a size: give bytes (1 << 28) "
                               f"or text (512MiB, 0.5GiB, 64MB, 1e9B)")
    if isinstance(value, int):
        if not 0 <= value <= MAX_SIZE:
            why = "it is negative" if value < 0 else "more than 8 EiB"
            raise InputError(what, f"{value:,} bytes is not a size: {why}" if value.bit_length() <= 128
                             else f"an integer of {value.bit_length():,} bits is not a size: {why}")
        return value
    try:
        # A Python number is bytes (it has no unit to forget), said back as given (`'nan' is not a size`);
        # text must say its unit.
        return parse_size(value) if isinstance(value, str) else parse_size(repr(value), bare_is_bytes=True)
    except ValueError as exc:
        raise InputError(what, clip(str(exc), 300)) from None


def _limit(value: Union[Size, Sequence[str]], what: str) -> Limit:
    """A limit from `"256MiB"`, `1 << 28`, `"10%"` or both parts (`"256MiB,10%"`, `["256MiB", "10%"]`),
    as the CLI's flags take them."""
    if isinstance(value, int):
        return Limit(fail_over_bytes=to_bytes(value, what))
    return limit_of(value if isinstance(value, (str, list, tuple)) else str(value), what)


def _named(limits: Union[Dict[str, Any], str, Sequence[str], None], what: str,
           names: Optional[Sequence[str]] = None) -> Dict[str, Limit]:
    """Limits by name from a dict (`{"activation": "10%"}`) or as the flags write them
    (`"activation=10%,gradient=256MiB"`, or a list of such strings)."""
    if not isinstance(limits, dict):
        return named_limits(limits or [], what, names)
    unknown = [n for n in limits if names and n not in names]
    if unknown:  # a misspelt phase would check nothing
        raise InputError(what, f"{clip(str(unknown[0]))!r} is not a phase: use one of {', '.join(names or ())}")
    return {name: _limit(v, f"{what}[{name!r}]") for name, v in limits.items()}


def thresholds(*, fail_over: Size = None, fail_over_pct: Optional[float] = None,
               categories: Union[Dict[str, Any], str, Sequence[str], None] = None,
               phases: Union[Dict[str, Any], str, Sequence[str], None] = None,
               fail_on: Union[str, Sequence[str]] = (), ignore: Union[str, Sequence[str]] = (),
               base: Optional[Thresholds] = None) -> Thresholds:
    """Thresholds as the CLI's flags give them (`categories={"activation": "10%"}`,
    `fail_on=["K002"]`, `ignore=["T003"]`: finding codes, as --fail-on and --ignore); each list
    takes the flags' forms too (`fail_on="K002,K003"`, `categories="activation=10%,gradient=256MiB"`,
    `categories={"activation": "256MiB,10%"}`). Over `base` (a baseline's), each one given replaces
    its stored one whole."""
    try:
        pct = None if fail_over_pct is None else parse_pct(str(fail_over_pct))
    except ValueError as exc:
        raise InputError("fail_over_pct", str(exc)) from None
    if isinstance(fail_over, str) and fail_over.strip().endswith("%"):  # as categories take "10%"
        raise InputError("fail_over", f"{fail_over!r} is a percent, not a size: give it as fail_over_pct="
                                      f"{fail_over.strip()[:-1].strip()} (or a size: \"512MiB\")")
    return thresholds_over(base, to_bytes(fail_over, "fail_over"), pct,
                           _named(categories, "categories"), _named(phases, "phases", PHASES),
                           choices=[("fail_on", "ignore", *chosen_codes(fail_on, ignore, "fail_on", "ignore"))])


def load_baseline(path: Union[str, "os.PathLike[str]"]) -> Baseline:
    """A stored baseline, validated against its schema."""
    return read_baseline(os.fspath(path))


def write_baseline(run: Run, path: Union[str, "os.PathLike[str]"], *, name: Optional[str] = None,
                   git_sha: Optional[str] = None, rules: Optional[Sequence[str]] = None,
                   keep_limits: bool = True, **limits: Any) -> Baseline:
    """Create or update the baseline at `path` from a run, atomically. An existing baseline keeps
    its name and thresholds unless `name` or limits (as `thresholds()` takes them) replace them;
    with `keep_limits=False` the limits given are the baseline's whole rule (the pytest marker's)."""
    _check_categories(limits, rules, None, "")
    baseline, _ = update_baseline(os.fspath(path), lambda: _summary(run, rules),
                                  lambda old: thresholds(base=old if keep_limits else None, **limits), name,
                                  git_sha)
    return baseline


def gate(run: Run, baseline: Union[str, "os.PathLike[str]", Baseline], *, rules: Optional[Sequence[str]] = None,
         top: int = DEFAULT_TOP, whatif: bool = False, mixed_routes: bool = False, **limits: Any) -> Report:
    """Judge a run against a baseline under its thresholds; limits given (`fail_over="256MiB"`,
    `categories={"activation": "10%"}`, `phases={"forward": "512MiB"}`) replace the stored ones whole,
    and findings chosen (`fail_on=["K002"]`, `ignore=["T003"]`) choose over the stored choice.
    The Report's `passed`, `checks` and `headline` say how it went; `to_dict()` is the CLI's gate document.
    With `whatif` (`memdiff gate --whatif`), a regressed peak's report names the changes that buy it
    back (`Report.buy_back`), replayed from the run's snapshot: `run` must then be a path. An emulated run
    and a recorded baseline (or the other way round) are refused unless `mixed_routes`."""
    if whatif and isinstance(run, Summary):
        raise InputError("whatif", "the what-if replays the run's snapshot: pass its path, not a Summary")
    stored = baseline if isinstance(baseline, Baseline) else load_baseline(baseline)
    where = "baseline" if isinstance(baseline, Baseline) else os.fspath(baseline)
    _check_categories(limits, rules, stored.thresholds, where)
    name = run if isinstance(run, Summary) else os.fspath(run)
    base, head = comparable_pair(where, stored, _summary(run, rules), mixed_routes)
    settings = Settings(thresholds=thresholds(base=stored.thresholds, **limits), top=top,
                        update_hint=None if isinstance(name, Summary) else baseline_command(name, where),
                        base_label=stored.label(),
                        run=head.source.file if isinstance(name, Summary) else name, baseline=where,
                        spreads=stored.spreads(),  # a baseline of repeats gates with its spread, as `memdiff gate`
                        whatif_run=None if isinstance(name, Summary) or not whatif else name,
                        rules=_rules(rules))
    return compare([ReportRun(base)], [ReportRun(head)], settings)


def _check_categories(limits: Dict[str, Any], rules: Optional[Sequence[str]], stored: Optional[Thresholds],
                      where: str) -> None:
    """A category limit, given or stored, that no rule gives is bad input: it would check nothing."""
    known = _rules(rules)
    given = limits.get("categories")
    check_categories(_named(given, "categories") if given is not None else {}, known, "categories")
    if stored is not None:
        check_categories(stored.categories, known, where)


Path = Union[str, "os.PathLike[str]"]


def forecast(runs: Union[Dict[Path, int], Sequence[Tuple[Path, int]]], *, at: Union[int, Sequence[int], None] = None,
             budget: Size = None, baseline: Optional[Path] = None, rules: Optional[Sequence[str]] = None) -> "Forecast":
    """The peak at knob values not run, from snapshots of one loop each with its value
    (`{"b1.pickle": 1, "b2.pickle": 2, "b4.pickle": 4}`), at `at` (default: twice the largest),
    and with `budget` the largest value that fits; with `baseline`, its headroom limit checked
    (`result.headroom.passed`). `to_dict()` is `memdiff forecast --format json`."""
    from memdiff.predict.forecast.course import parse_run
    from memdiff.predict.forecast.engine import forecast as _forecast
    from memdiff.predict.forecast.engine import judge_headroom

    pairs = list(runs.items()) if isinstance(runs, dict) else list(runs)
    values = [_knob(at, "at")] if isinstance(at, (int, str, float)) else [_knob(v, "at") for v in at or []]
    limit = None
    if baseline is not None:
        limit = load_baseline(baseline).thresholds.headroom
        if limit is None:
            raise InputError(os.fspath(baseline), "no headroom limit to check")
        budget = limit.budget_bytes
    # As the CLI reads RUN=VALUE: int() made 1.5 a run at 1 and True one at 1, and took `٤` as 4.
    result = _forecast([parse_run(f"{os.fspath(p)}={_knob(v, os.fspath(p))}") for p, v in pairs], values, _rules(rules),
                       to_bytes(budget, "budget"))
    return result if limit is None or baseline is None else judge_headroom(result, os.fspath(baseline), limit)


def whatif(run: Path, changes: Union[str, Sequence[str], None] = None, *, budget: Size = None,
           rules: Optional[Sequence[str]] = None) -> "WhatIf":
    """The peak of a snapshot after changes nobody has made (`"checkpoint"`, `"weights=bf16"`,
    `"optimizer=sgd+accumulate=4"`; none: every applicable one), each fitting `budget` or not.
    `to_dict()` is `memdiff whatif --format json`."""
    from memdiff.predict.whatif import whatif as _whatif

    asked = split_items(changes, "changes") if changes is not None else []  # as --change takes them
    return _whatif(os.fspath(run), asked, _rules(rules), to_bytes(budget, "budget"))


def html_report(report: Report) -> str:
    """The self-contained HTML page of a Report (what `memdiff gate --html` writes); summarize the
    runs with `history=True` for their memory over time to be drawn."""
    from memdiff.render import render

    return render(report, "html")


def record(path: Union[str, "os.PathLike[str]"], **options: Any) -> ContextManager[None]:
    """`memdiff.recording.capture.record`: a context manager writing the snapshot of the block to `path`."""
    from memdiff.recording.capture import record as _record

    return _record(os.fspath(path), **options)
