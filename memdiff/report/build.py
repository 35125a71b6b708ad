"""report: runs -> diff -> judge -> Report, every word and number any output shows, decided once.

`compare` is the one analysis entry for a run or a job (a job is runs with rank numbers): it
aligns each pair of runs, judges it, and returns a Report holding the verdict, the headline,
where each peak is, the phase and category tables, kept memory, the rows as shown (folded,
labelled, with their stacks trimmed) and the JSON document. The CLI, the API, the pytest
plugin, the GitHub publisher and `memdiff ranks` call it, then hand the Report to a renderer;
renderers lay it out and compute nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from memdiff import __version__
from memdiff.analyse.classify import Rule
from memdiff.compare.baseline import stem
from memdiff.compare.differ import (
    BY_COMPILED,
    BY_OLDER,
    BY_SITE,
    BY_SIZE,
    COMPILED_BUFFER,
    GRADIENTS,
    NEW,
    SAME,
    TEMPORARIES,
    DeviceDiff,
    Diff,
    DiffRow,
    PhaseDelta,
    diff,
)
from memdiff.compare.findings import INFO, finding, in_order
from memdiff.compare.judge import Check, Runs, Verdict, judge, judge_ranks, noise_limit
from memdiff.compare.limits import DEFAULT_PEAK, IGNORE, Limit, Thresholds
from memdiff.compare.observe import PEAK, WARNING_STRINGS, where_text
from memdiff.compare.trend import DEFAULT_POINTS, Trend, trend_of, workloads
from memdiff.errors import InputError, clip
from memdiff.inert import scrubbed, text
from memdiff.model import Finding, Source, Spread, Summary, TrendEntry
from memdiff.predict.whatif import BuyBackPart, BuyBackTarget, buy_back
from memdiff.read.job import ranges, ranks_text
from memdiff.read.window import Window
from memdiff.report.chart import chart_of
from memdiff.report.headline import headline_of
from memdiff.report.types import (
    ANALYSIS_FIELDS,
    CATEGORY_HEADERS,
    DEFAULT_TOP,
    DIFF_SCHEMA_VERSION,
    PHASE_HEADERS,
    RANK_HEADERS,
    RANKS_SCHEMA_VERSION,
    STACK_FRAMES,
    CheckLine,
    DeviceReport,
    Input,
    JobPart,
    RankResult,
    ShownRow,
    Stack,
    Table,
    check_line,
    finding_check_line,
    frame_line,
    moment_name,
)
from memdiff.units import change_or_unchanged, count_of, format_bytes, pct_cell

NOT_JUDGED = "not judged"  # what a report compared and did not judge (the API's `diff`) says for its verdict


@dataclass
class Report:
    """Everything any output of one comparison shows (a run's, or a job's: its worst rank in full)."""

    verdict: Optional[Verdict]  # None: compared, not judged (the API's `diff`)
    headline: str
    inputs: List["Input"]  # base's, then head's
    base_label: Optional[str]  # what names a run beside its file (`baseline train @ 1a2b3c`), when given
    head_label: Optional[str]
    warnings: List[str]  # the JSON's `warnings`: the sentences of the findings why the runs may not compare
    devices: List[DeviceReport]
    check_lines: List[CheckLine]
    notes: List[Finding]  # the judge's findings (why a peak failed, a baseline to refresh, ...)
    results: List[RankResult]  # every pair; one without a rank for a run
    top: int
    min_delta: int
    job: Optional[JobPart] = None
    run: Optional[str] = None  # what was gated and against which baseline, for the gate's documents
    baseline: Optional[str] = None
    # With a history (--history): each device's last peaks on the main branch and this run's point;
    # `trend_note` says why there is none (the history has no line of this workload).
    trends: Optional[List[Trend]] = None
    trend_note: Optional[Finding] = None
    # With --whatif on a regression: the changes that would bring head's peak back (predict.whatif.buyback).
    buy_back: Optional[BuyBackPart] = None
    # The catalogue's findings shown (those the gate ignores left out): the diff's and the report's, in
    # the one order every output shows them in (findings.in_order: severity, code, rank, device).
    findings: List[Finding] = field(default_factory=list)

    @property
    def every_finding(self) -> List[Finding]:
        """Every finding the report shows, the judge's (G002 why a peak failed, ...) among the runs',
        in the one order (findings.in_order): the JSON's `findings`, the Action's `findings` output."""
        return in_order([*self.findings, *self.notes])

    @property
    def passed(self) -> Optional[bool]:
        """Whether every check passed; None when the report was not judged (the API's `diff`),
        so that a script testing it cannot read 'compared' as 'passed'."""
        return None if self.verdict is None else self.verdict.passed

    @property
    def checks(self) -> List[Check]:
        """The verdict's checks, as values."""
        return self.verdict.checks if self.verdict else []

    @property
    def verdict_word(self) -> Optional[str]:
        """The verdict as every output opens with it: "no regression", "regression" when a threshold
        failed, "failed on a finding" when only findings did (under P002 the peak fell: nothing
        regressed); None when nothing was judged."""
        if self.passed is None:
            return None
        if self.passed:
            return "no regression"
        return "regression" if any(not c.passed for c in self.checks) else "failed on a finding"

    @property
    def verdict_line(self) -> str:
        """`memdiff: regression`, `memdiff: not judged` when nothing was (the API's `diff`): the page's verdict."""
        return f"memdiff: {self.verdict_word or NOT_JUDGED}"

    @property
    def rule_line(self) -> str:
        """The rule judged by, in words, or `not judged`."""
        return self.rule or NOT_JUDGED

    @property
    def base_name(self) -> str:
        """What names the base run: its label when given, else its file."""
        return self.base_label or self.diff.base.file

    @property
    def head_name(self) -> str:
        """What names the head run: its label when given, else its file."""
        return self.head_label or self.diff.head.file

    @property
    def title(self) -> str:
        """`memdiff: base.pickle → head.pickle`, each run by its name: the page's title."""
        return f"memdiff: {self.base_name} → {self.head_name}"

    @property
    def failure(self) -> Optional[str]:
        """What failed, to open a one-line summary (the pytest plugin's): "device memory regressed"
        when a threshold failed, "failed on a finding" when only findings did (under P002 the peak fell: memory
        did not regress); None when the gate passed or nothing was judged."""
        if self.passed is not False:
            return None
        return "device memory regressed" if self.verdict_word == "regression" else self.verdict_word

    @property
    def annotations(self) -> List[str]:
        """A failed gate's workflow annotations (`--github`), each a sentence of its own: the headline
        and the judge's notes once, then each failing check alone, saying what grew, by how much and
        the limit it broke. A failing finding shown is left out: it is annotated as the finding, by
        its code (github.py), and a second annotation would say it twice. Empty when nothing failed."""
        if all(c.passed for c in self.check_lines):
            return []
        shown = {f.code for f in self.findings}
        failing = [c.text for c in self.check_lines if not c.passed and c.finding not in shown]
        return [" ".join([f"{self.headline}.", *(f"{n.code} {n.text}" for n in self.notes)]), *failing]

    @property
    def finding_annotations(self) -> List[Tuple[str, Finding]]:
        """Each finding shown as a workflow annotation (`--github`) with its level: `error` for a code
        that failed the gate, `warning` for any other; notes are no annotation."""
        failing = {c.code for c in self.verdict.finding_checks} if self.verdict is not None else set()
        return [("error" if f.code in failing else "warning", f) for f in self.findings if f.severity != INFO]

    @property
    def failed_codes(self) -> List[str]:
        """The codes of the findings that failed the gate, sorted, each once (the Action's `failed-findings`)."""
        return sorted({c.code for c in self.verdict.finding_checks}) if self.verdict is not None else []

    @property
    def peak_delta_bytes(self) -> Optional[int]:
        """The largest change of a device's peak over every pair compared (a job's ranks, each device):
        the Action's `peak-delta-bytes`; None when no device was compared."""
        deltas = [d.peak_delta_bytes for r in self.results for d in r.diff.devices]
        return max(deltas) if deltas else None

    @property
    def rule(self) -> Optional[str]:
        """The rule judged by, in words; None when not judged."""
        return text(self.verdict.rule) if self.verdict else None

    @property
    def shown(self) -> RankResult:
        """The pair shown in full: the run, or the job's worst rank."""
        return next(r for r in self.results if self.job is None or r.rank == self.job.worst_rank)

    @property
    def diff(self) -> Diff:
        """The Diff shown in full."""
        return self.shown.diff

    def refolded(self, top: int) -> "Report":
        """The same report with at most `top` rows per device (the GitHub comment shrinks to fit)."""
        # Only the rows fold: what the report added to a device after folding it (_report: the
        # reserved memory, the measured noise, their findings) stays. The comment and the job
        # summary, which are refolded, lost the reserved and noise lines that --format markdown shows.
        return replace(self, devices=[replace(device_report(d.diff, top, self.min_delta,
                                                             d.like_for_like.diff if d.like_for_like else None),
                                              noise=d.noise, noise_within=d.noise_within, reserved=d.reserved,
                                              findings=list(d.findings))
                                      for d in self.devices],
                       top=top)

    def to_dict(self) -> Dict[str, Any]:
        """The JSON document (diff.schema.json; gate.schema.json adds `run` and `baseline`): every row, never folded."""
        named = {"run": self.run, "baseline": self.baseline} if self.run is not None else {}
        judged = self.verdict.to_dict() if self.verdict else {}
        head: Dict[str, Any] = {**named, "schema_version": DIFF_SCHEMA_VERSION, "tool": f"memdiff {__version__}",
                                **judged, "headline": self.headline}
        if self.trends is not None:
            head["trends"] = [t.to_dict() for t in self.trends]
        if self.buy_back is not None:
            head["buy_back"] = [asdict(b) for b in self.buy_back.items]
            head["buy_back_notes"] = [n.text for n in self.buy_back.notes]
        shown = {"warnings": self.warnings, "findings": [f.to_dict() for f in self.every_finding]
                 + ([self.trend_note.to_dict()] if self.trend_note is not None else [])}
        if self.job is None:
            compared = self.diff.to_dict()
            for device, r in zip(compared["devices"], self.devices):
                if r.like_for_like is not None:  # what the headline quotes: every row, as the devices'
                    device["like_for_like"] = asdict(r.like_for_like.diff)
            return {**head, **compared, **shown}
        head["schema_version"] = RANKS_SCHEMA_VERSION
        return {**head, **shown, "worst_rank": self.job.worst_rank,
                "only_base": self.job.only_base, "only_head": self.job.only_head,
                "ranks": [{"rank": r.rank, "schema_version": DIFF_SCHEMA_VERSION, "tool": f"memdiff {__version__}",
                           **(r.verdict.to_dict() if r.verdict else {}), **r.diff.to_dict()} for r in self.results]}


def largest_peak_delta(deltas: Sequence[Optional[int]]) -> Optional[int]:
    """The Action's `peak-delta-bytes` over a command's reports (each its Report.peak_delta_bytes): the
    largest; None when no report compared a device."""
    known = [d for d in deltas if d is not None]
    return max(known) if known else None


# --- building it -----------------------------------------------------------------------------

@dataclass
class Run:
    """One side's run: a Summary, with its rank when it is one rank of a job."""

    summary: Summary
    rank: Optional[int] = None


@dataclass
class Settings:
    """How to compare, judge and show: the thresholds, the moment, the folding, the names."""

    thresholds: Optional[Thresholds] = field(default_factory=lambda: Thresholds(DEFAULT_PEAK))  # None: not judged
    at: str = PEAK
    top: int = DEFAULT_TOP
    min_delta: int = 0
    update_hint: Optional[str] = None  # the command that refreshes a baseline, for a peak that went down
    base_label: Optional[str] = None
    head_label: Optional[str] = None
    run: Optional[str] = None
    baseline: Optional[str] = None
    missing_ranks_fail: bool = False  # a rank only base has fails (a gate: a rank that crashed)
    unbaselined_ranks_fail: bool = False  # a rank only head has fails (a gate with --require-baseline)
    spreads: Dict[int, Spread] = field(default_factory=dict)  # a baseline made from repeats: per device
    history: Optional[List[TrendEntry]] = None  # main-branch history (--history): the report shows a trend
    workload: Optional[str] = None  # the workload's name in the history (the gate: the baseline's name)
    trend_points: int = DEFAULT_POINTS
    trend_label: Optional[str] = None  # what names this run's point in a trend (default: `this run`)
    # --whatif: the head run's file, replayed with each change when the verdict is a regression
    # (None: nothing is replayed), and the category rules it is read with.
    whatif_run: Optional[str] = None
    rules: Sequence[Rule] = ()
    window: Optional[Window] = None  # the window both runs were read in (--steps, --events, --time-us)


def compare(base: Sequence[Run], head: Sequence[Run], settings: Optional[Settings] = None) -> Report:
    """The one analysis entry: align, judge and describe two runs, or two jobs rank by rank.

    A job regresses when any rank does; its report shows the worst rank (the largest peak growth)
    in full and every rank a line. InputError when two jobs share no rank."""
    s = settings or Settings()
    is_job = len(base) != 1 or len(head) != 1 or base[0].rank is not None or head[0].rank is not None
    b = {r.rank: r.summary for r in base}
    h = {r.rank: r.summary for r in head}
    common = sorted(set(b) & set(h), key=lambda r: -1 if r is None else r)
    if not common:
        raise InputError("job", f"base has ranks {ranges(sorted(k for k in b if k is not None))} and head "
                                f"{ranges(sorted(k for k in h if k is not None))}: none to compare")
    if s.thresholds is not None and not any(b[r].devices or h[r].devices for r in common):
        # A verdict on nothing would pass anything: the gate is never green when nothing was compared.
        raise InputError(head[0].summary.source.file or "run", "no device memory in either run, so nothing to gate "
                                                               "(the snapshots record no allocation)")
    results = []
    for rank in common:
        if s.thresholds is not None:
            _traced_alike(s, rank, b[rank], h[rank])
        result = diff(b[rank], h[rank], at=s.at)
        verdict = (judge(result, s.thresholds, s.update_hint, Runs(b[rank], h[rank]),
                         s.spreads if rank is None else None) if s.thresholds is not None else None)
        results.append(RankResult(rank, result, verdict, b[rank], h[rank]))
    if not is_job:
        return _report(s, results[0].verdict, results, None)
    only_base = sorted(k for k in set(b) - set(h) if k is not None)
    only_head = sorted(k for k in set(h) - set(b) if k is not None)
    failures = []
    if only_base and s.missing_ranks_fail:
        failures.append(finding("G005", ranks=ranks_text(only_base), rank_numbers=only_base))
    if only_head and s.unbaselined_ranks_fail:
        failures.append(finding("G006", ranks=ranks_text(only_head), rank_numbers=only_head))
    per_rank = {r.rank: r.verdict for r in results if r.rank is not None and r.verdict is not None}
    verdict = None
    if s.thresholds is not None:
        verdict = judge_ranks(per_rank, s.thresholds.describe())
        verdict = replace(verdict, passed=verdict.passed and not failures, findings=failures + verdict.findings)
    worst = max(results, key=lambda r: (r.peak_delta_bytes, -(r.rank or 0)))
    assert worst.rank is not None  # a job's runs all have ranks
    failing = [r.rank for r in results if r.verdict is not None and not r.verdict.passed and r.rank is not None]
    word = "" if verdict is None else "PASS: " if verdict.passed else "FAIL: "
    job = JobPart(
        summary_line=(f"{word}{count_of(len(results), 'rank')} compared"
                      + (f", failing: {ranges(failing)}" if failing else "")),
        table=Table(RANK_HEADERS, [[str(r.rank), str(d.device), format_bytes(d.base_peak_bytes),
                                    format_bytes(d.head_peak_bytes), format_bytes(d.peak_delta_bytes, signed=True),
                                    pct_cell(d.base_peak_bytes, d.head_peak_bytes),
                                    "" if r.verdict is None else "PASS" if r.verdict.passed else "FAIL"]
                                   for r in results for d in r.diff.devices], left=[6]),
        worst_rank=worst.rank,
        other_failures=[check_line(c) for c in (verdict.checks if verdict else [])
                        if not c.passed and not c.subject.startswith(f"rank {worst.rank} ")]
        + [finding_check_line(c) for c in (verdict.finding_checks if verdict else [])
           if not c.text.startswith(f"rank {worst.rank} ")],
        only_base=only_base, only_head=only_head, failures=failures)
    return _report(s, verdict, results, job)


def _traced_alike(s: Settings, rank: Optional[int], base: Summary, head: Summary) -> None:
    """InputError when a device has a trace in one run and none in the other: a run without one
    (dumped with memory history off) has for its peak only what was live at the dump, at most what
    its trace would have shown, so a verdict against a traced peak would pass a regression (or fail
    on nothing). Runs with no trace on either side compare what each held at its dump."""
    heads = {d.device: d for d in head.devices}
    for b in base.devices:
        h = heads.get(b.device)
        if h is None or bool(b.trace_events) == bool(h.trace_events):
            continue
        where = f"rank {rank}, device {b.device}" if rank is not None else f"device {b.device}"
        if s.baseline is not None:
            run = f"the run ({clip(head.source.file)})"
            untraced, traced = (run, "the baseline") if b.trace_events else ("the baseline", run)
            path = s.baseline
        else:
            named = {role: f"the {role} ({clip(r.source.file)})" for role, r in (("base", base), ("head", head))}
            untraced, traced = (named["head"], named["base"]) if b.trace_events else (named["base"], named["head"])
            path = (head if b.trace_events else base).source.file or "run"
        raise InputError(path, f"{untraced} has no trace on {where} and {traced} has one: its peak is only what "
                               f"was live when it was dumped, so it cannot be judged against a traced peak; "
                               f"record both runs with memory history on "
                               f"(torch.cuda.memory._record_memory_history, or `memdiff record`)")


def _report(s: Settings, verdict: Optional[Verdict], results: List[RankResult], job: Optional[JobPart]) -> Report:
    shown = next(r for r in results if job is None or r.rank == job.worst_rank)
    devices = []
    for d in shown.diff.devices:
        r = device_report(d, s.top, s.min_delta, _like_for_like(d, shown.base, shown.head))
        spread = s.spreads.get(d.device) if job is None and d.at == PEAK else None
        if spread is not None:
            r.noise, r.noise_within, within = _noise(d, spread, s.thresholds)
            r.findings += [within] if within is not None else []
        r.reserved, moved = _reserved(d, s.thresholds is not None and s.thresholds.reserved is not None)
        r.findings += [moved] if moved is not None else []
        devices.append(r)
    def kept(f: Finding) -> bool:  # not ignored by the gate's choice of findings
        return s.thresholds is None or s.thresholds.findings.action(f.code) != IGNORE

    findings = [f for f in shown.diff.findings + [f for r in devices for f in r.findings] if kept(f)]
    if job is not None:
        ranks = [finding("T011", ranks=ranks_text(numbers), rank_numbers=numbers, side=side)
                 for side, numbers in (("base", job.only_base), ("head", job.only_head)) if numbers]
        findings = [f for f in ranks if kept(f)] + [replace(f, rank=job.worst_rank) for f in findings]
    # One order, held here: every output shows the findings as this list has them.
    findings = in_order(findings)
    warnings = [f.text if f.rank is None else f"rank {f.rank}: {f.text}" for f in findings
                if f.code in WARNING_STRINGS or f.code == "T011"]
    headline = headline_of(devices)
    if verdict is not None and not verdict.passed and all(c.passed for c in verdict.checks):
        # Only findings failed it: the peak's own sentence would read as the regression (a fall, under P002).
        named = list(dict.fromkeys(f"{c.code} {c.name}" for c in verdict.finding_checks))
        headline = f"{', '.join(named)} {'fails' if len(named) == 1 else 'fail'} the gate; {headline}"
    if job is not None:
        headline = f"rank {job.worst_rank} (of {len(results):,}): {headline}"
    trends, trend_note = _trends(s, shown.diff)
    bought = _buy_back(s, verdict, shown, job)
    # Names from snapshots and baselines are made one line each here, once for every output.
    return scrubbed(Report(verdict=verdict, headline=headline, trends=trends, trend_note=trend_note,
                  inputs=[_input("base", shown.diff.base), _input("head", shown.diff.head)],
                  base_label=s.base_label, head_label=s.head_label, warnings=warnings, devices=devices,
                  check_lines=[CheckLine(c.passed, check_line(c)) for c in (verdict.checks if verdict else [])
                               if _shown(c.subject, job)]
                  + [CheckLine(False, finding_check_line(c), c.code)
                     for c in (verdict.finding_checks if verdict else []) if _shown(c.text, job)],
                  notes=[n for n in (verdict.findings if verdict else []) if job is None or n in job.failures
                         or _shown(n.text, job)],
                  results=results, top=s.top, min_delta=s.min_delta, job=job, run=s.run, baseline=s.baseline,
                  buy_back=bought, findings=findings),
                    skip=ANALYSIS_FIELDS)


def _buy_back(s: Settings, verdict: Optional[Verdict], shown: RankResult, job: Optional[JobPart]) -> \
        Optional[BuyBackPart]:
    """With --whatif, on a regression: the changes that bring each grown peak of the head back to
    the base's, or within the peak rule (under a baseline of repeats, its measured spread's rule)."""
    if s.whatif_run is None or verdict is None or verdict.passed:
        return None
    if job is not None:
        return BuyBackPart([], [finding("W001", why="it replays one run, and this is a job")])
    base_name = "the baseline" if s.baseline is not None else "base"
    heads = {d.device: d for d in shown.head.devices}
    targets = []
    for b in shown.base.devices:
        h = heads.get(b.device)
        if h is None or h.peak_bytes <= b.peak_bytes:
            continue
        limit = (noise_limit(s.thresholds, b.peak_bytes, s.spreads.get(b.device)) or s.thresholds.peak
                 if s.thresholds is not None else None)
        if limit is not None and not limit.exceeded(b.peak_bytes, h.peak_bytes):
            continue  # grown within the rule: another check failed, not this peak
        allowed = _allowed(limit, b.peak_bytes, h.peak_bytes) if limit is not None else b.peak_bytes
        targets.append(BuyBackTarget(b.device, b.peak_bytes, allowed, base_name))
    if not targets:
        return BuyBackPart([], [finding("W002", why="no device's peak broke the rule")])
    return buy_back(s.whatif_run, s.rules, targets, s.window)


def _allowed(limit: Limit, base: int, head: int) -> int:
    """The highest peak below `head` that `limit` passes over `base` (`base` at least): growth
    past it fails, and a limit's parts (a size, a percent, or either) make it no closed form."""
    low, high = base, max(base, head - 1)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if not limit.exceeded(base, mid) else (low, mid - 1)
    return low


def _trends(s: Settings, d: Diff) -> Tuple[Optional[List[Trend]], Optional[Finding]]:
    """Each device's main-branch trend with this run's peak after it, and why there is none when
    the history was given and holds no line of the workload."""
    if s.history is None:
        return None, None
    workload = s.workload or stem(d.head.file)
    trends = [t for t in (trend_of(s.history, workload, x.device, x.head_peak_bytes, s.trend_label, s.trend_points)
                          for x in d.devices) if t is not None]
    if trends:
        return trends, None
    known = workloads(s.history)
    return [], finding("G007", workload=workload, workloads=known,
                       holds=f"it holds {clip(', '.join(known))}" if known else "it is empty")


def _span(base: int, low: int, high: int) -> str:
    """`-0.2% to +0.6%` of `base`."""
    return f"{100 * (low - base) / base:+.1f}% to {100 * (high - base) / base:+.1f}%"


def _noise(d: DeviceDiff, spread: Spread, thresholds: Optional[Thresholds]) -> \
        Tuple[str, Optional[str], Optional[Finding]]:
    """(where the peak's change falls in the baseline's spread over repeats, in words; the
    headline's words when it is inside it, else None; G001 when it is)."""
    base, head, n = d.base_peak_bytes, d.head_peak_bytes, spread.runs
    lo, hi = spread.peak.min, spread.peak.max
    if lo == hi:
        return (f"measured noise: the baseline's {n} runs had one peak, {format_bytes(hi)}: no spread to allow, "
                f"the default rule applies"), None, None
    if not base:
        return (f"measured noise: the baseline's {n} runs peaked at {format_bytes(lo)} to {format_bytes(hi)}",
                None, None)
    change = f"peak {pct_cell(base, head) or '+0.0%'}"
    span = f"the spread of {n} runs, {_span(base, lo, hi)} ({format_bytes(lo)} to {format_bytes(hi)})"
    margin = thresholds.margin_text() if thresholds is not None else None
    if lo <= head <= hi:
        return (f"measured noise: {change}: within {span}", f"within the spread of {n} runs, {_span(base, lo, hi)}",
                finding("G001", d.device, change=pct_cell(base, head) or "+0.0%", runs=n, span=_span(base, lo, hi),
                        low_bytes=lo, high_bytes=hi))
    if head < lo:
        return f"measured noise: {change}: below {span}", None, None
    allowed = hi + (thresholds.margin_bytes(base) if thresholds is not None else 0)
    if margin is not None and head <= allowed:
        return f"measured noise: {change}: above {span}, within the margin of {margin}", None, None
    return (f"measured noise: {change}: beyond {span}" + (f" and its margin of {margin}" if margin else ""),
            None, None)


MOVED_PCT = 1  # a figure moved when it changed by more than this percent of the base's


def _moved(base: int, head: int) -> bool:
    return abs(head - base) * 100 > MOVED_PCT * base


def _reserved(d: DeviceDiff, gated: bool) -> Tuple[Optional[str], Optional[Finding]]:
    """The reserved peak and fragmentation of both runs, and A001 when reserved moved and allocated
    did not; None when a run has no allocator segments (CPU captures, older baselines)."""
    rb, rh = d.base_reserved_peak_bytes, d.head_reserved_peak_bytes
    if rb is None or rh is None:
        return None, None
    fb, fh = d.base_fragmentation_bytes, d.head_fragmentation_bytes
    frag = (f"; fragmentation at the peak (reserved minus allocated) {format_bytes(fb)} -> {format_bytes(fh)}"
            if fb is not None and fh is not None else "")
    line = (f"reserved by the caching allocator: peak {format_bytes(rb)} -> {format_bytes(rh)}, "
            f"{change_or_unchanged(rb, rh)}{frag}")
    if _moved(rb, rh) and not _moved(d.base_peak_bytes, d.head_peak_bytes):
        allocated = ("is unchanged" if d.peak_delta_bytes == 0
                     else f"moved {format_bytes(d.peak_delta_bytes, signed=True)}, within {MOVED_PCT}%")
        return line, finding("A001", d.device, allocated=allocated, direction="more" if rh > rb else "fewer",
                             base_reserved_bytes=rb, head_reserved_bytes=rh,
                             gated=("The reserved limit judges it." if gated else
                                    "The gate judges allocated memory; --reserved-fail-over gates reserved memory "
                                    "too."))
    return line, None


def _shown(text: str, job: Optional[JobPart]) -> bool:
    """Whether a check or note belongs in the full report: a run's all do, a job's those of its
    worst rank (the others' failures are listed apart)."""
    return job is None or text.startswith(f"rank {job.worst_rank} ")


def _input(role: str, source: Source) -> Input:
    sha = f", sha256 {source.sha256[:12]}" if source.sha256 else ""
    route = f", {source.route()} by memdiff" if source.emulated else ""
    return Input(role, source.file, f"{source.container}, format {source.generation}{sha}{route}")


def _moved_phase(d: DeviceDiff) -> Optional[str]:
    """The phase whose peak to compare in both runs when the device's peaks say too little.

    Peaks in different phases: the phase that made the change, the head's peak phase when the
    peak grew (it rose past the old peak), the base's when it went down (it fell below the new
    one), unless another phase moved more. Peaks in one phase while another phase's peak moved
    more than they did, by more than 1% of the base's peak (with `zero_grad(set_to_none=False)` or gradient
    accumulation the gradients live through the forward: the forward grows by them, the peak
    by less or not at all): that other phase, the one that moved most."""
    if d.at != PEAK or not d.head_peak_phase or not d.base_peak_phase:
        return None
    movers = [p for p in d.phases if p.base_peak_bytes and p.head_peak_bytes
              and abs(p.delta_bytes) * 100 > p.base_peak_bytes]
    most = max(movers, key=lambda p: (abs(p.delta_bytes), p.phase)) if movers else None
    if d.head_peak_phase != d.base_peak_phase:
        made = d.head_peak_phase if d.peak_delta_bytes >= 0 else d.base_peak_phase
        at_made = next((abs(p.delta_bytes) for p in d.phases if p.phase == made and p.base_peak_bytes), 0)
        return most.phase if most is not None and abs(most.delta_bytes) > at_made else made
    if most is None or most.phase == d.head_peak_phase or \
            (abs(most.delta_bytes) - abs(d.peak_delta_bytes)) * 100 <= d.base_peak_bytes:
        return None
    return most.phase


def _like_for_like(d: DeviceDiff, base: Summary, head: Summary) -> Optional[DeviceDiff]:
    """The device compared at one phase's peak in both runs, where its peaks say too little
    (_moved_phase). None when a run does not keep what was live then (a baseline made before
    phase groups)."""
    phase = _moved_phase(d)
    if phase is None:
        return None
    b = next((x for x in base.devices if x.device == d.device), None)
    h = next((x for x in head.devices if x.device == d.device), None)
    b_at, h_at = (b.at(phase) if b else None), (h.at(phase) if h else None)
    if b_at is None or h_at is None or not b_at.groups:
        return None
    assert b is not None and h is not None  # each has a moment
    pair = diff(replace(base, devices=[b]), replace(head, devices=[h]), at=phase)
    return pair.devices[0]


def _stacks(r: DiffRow) -> List[Stack]:
    return [Stack(m.side, m.count, m.bytes, m.signature, [frame_line(f) for f in m.frames[:STACK_FRAMES]],
                  max(0, len(m.frames) - STACK_FRAMES)) for m in r.member_groups()]


def _count(r: DiffRow) -> str:
    if r.base_count == r.head_count:
        return f"{r.base_count:,}"
    counts = f"{r.base_count:,} -> {r.head_count:,}"
    # Fewer allocations holding more bytes (or more holding fewer) is not a typo: say why.
    if r.head_count < r.base_count and r.delta_bytes > 0:
        return counts + " (fewer, larger)"
    if r.head_count > r.base_count and r.delta_bytes < 0:
        return counts + " (more, smaller)"
    return counts


def _compiled_numbers(r: DiffRow) -> str:
    """`base's buffer 101` for a row of one compiled buffer paired by its order (the site shows head's)."""
    numbers = {}
    for m in r.member_groups():
        numbers[m.side] = next((COMPILED_BUFFER.match(f.name).group(1) for f in m.frames  # type: ignore[union-attr]
                                if COMPILED_BUFFER.match(f.name)), "?")
    return f"base's buffer {numbers.get('base', '?')}"


def _cells(r: DiffRow) -> List[str]:
    site = r.label or r.site
    if r.matched_by == BY_SITE:
        site += " (matched by site)"
    elif r.matched_by == BY_SIZE:
        site += " (older than one run's trace: matched by size)"
    elif r.matched_by == BY_OLDER:
        site += " (older than the trace, without a stack: matched by category)"
    elif r.matched_by == BY_COMPILED:
        site += f" ({_compiled_numbers(r)}: matched by its growth and place in the graph)"
    elif r.matched_by == GRADIENTS:
        site += f" (with {count_of(len(r.members) - 1, 'other gradient group')}: the same total, made by other nodes)"
    elif r.matched_by == TEMPORARIES:
        site += f" (with {count_of(len(r.members) - 1, 'other node temporary', 'other node temporaries')})"
    pct = "new" if r.status == NEW else pct_cell(r.base_bytes, r.head_bytes)
    return [r.status, _count(r), format_bytes(r.base_bytes), format_bytes(r.head_bytes),
            format_bytes(r.delta_bytes, signed=True), pct, site]


def _sum_cells(label: str, rows: Sequence[DiffRow]) -> List[str]:
    total = DiffRow(status="", site=label, signature="", category=None,
                    base_count=sum(r.base_count for r in rows), head_count=sum(r.head_count for r in rows),
                    base_bytes=sum(r.base_bytes for r in rows), head_bytes=sum(r.head_bytes for r in rows),
                    delta_bytes=sum(r.delta_bytes for r in rows), frames=[], matched_by=None)
    return _cells(total)


def device_report(d: DeviceDiff, top: int, min_delta: int, like: Optional[DeviceDiff] = None) -> DeviceReport:
    """Fold the rows (Bloaty style: the top `top` that changed by at least `min_delta`, the rest in
    one row, and a TOTAL that adds up to the delta exactly) and word the device's lines."""
    changed = [r for r in d.rows if r.status != SAME and abs(r.delta_bytes) >= max(min_delta, 1)]
    kept_ids = {id(r) for r in changed[:top]}
    # Rows keep the labels the differ gave them over all rows: the same row reads the same in the
    # table, the headline and the notes, whatever --top shows.
    shown = changed[:top]
    rest = [r for r in d.rows if id(r) not in kept_ids]
    others_label = count_of(len(rest), "other")
    return scrubbed(DeviceReport(
        device=d.device, diff=d,
        heading=f"device {d.device}: {change_line(d)}",
        where=_where(d),
        phases=Table(PHASE_HEADERS, [_phase_cells(p) for p in d.phases]) if d.phases else None,
        categories=Table(CATEGORY_HEADERS, [[c.category, format_bytes(c.base_bytes), format_bytes(c.head_bytes),
                                             format_bytes(c.delta_bytes, signed=True),
                                             pct_cell(c.base_bytes, c.head_bytes)]
                                            for c in d.categories]) if d.categories else None,
        rows=[ShownRow(r, _cells(r), f"{r.status} {r.label or r.site} {format_bytes(r.delta_bytes, signed=True)}",
                       _stacks(r)) for r in shown],
        others=_sum_cells(others_label, rest) if rest else None,
        total=_sum_cells("TOTAL", d.rows),
        like_for_like=device_report(like, top, min_delta, None) if like is not None else None,
        chart=chart_of(d)),
        skip=ANALYSIS_FIELDS)


def change_line(d: DeviceDiff) -> str:
    """`peak 6.53 GiB -> 8.48 GiB (+1.95 GiB, +29.8%); static 4.75 GiB -> 4.75 GiB`: a device's change,
    as its heading says it after `device N: `."""
    return (f"{moment_name(d.at)} {format_bytes(d.base_peak_bytes)} -> {format_bytes(d.head_peak_bytes)} "
            f"({format_bytes(d.peak_delta_bytes, signed=True)}, {pct_cell(d.base_peak_bytes, d.head_peak_bytes)}); "
            f"static {format_bytes(d.base_static_bytes)} -> {format_bytes(d.head_static_bytes)}")


def _phase_cells(p: PhaseDelta) -> List[str]:
    """A phase's row; a run without the phase (it allocated nothing then: SGD's step) has no
    figure and the row no delta, which would read as the phase's memory gone."""
    if p.base_peak_bytes is None or p.head_peak_bytes is None:
        missing = "base" if p.base_peak_bytes is None else "head"
        return [p.phase, "" if p.base_peak_bytes is None else format_bytes(p.base_peak_bytes),
                "" if p.head_peak_bytes is None else format_bytes(p.head_peak_bytes), "", f"none in {missing}"]
    return [p.phase, format_bytes(p.base_peak_bytes), format_bytes(p.head_peak_bytes),
            format_bytes(p.delta_bytes, signed=True), pct_cell(p.base_peak_bytes, p.head_peak_bytes)]


def _where(d: DeviceDiff) -> Optional[str]:
    """Where each run's peak is: `base peak in the optimizer step of step 0 (scope ...); head peak in ...`."""
    if not (d.base_peak_phase or d.head_peak_phase):
        return None
    parts = []
    for role, phase, step, scope in (("base", d.base_peak_phase, d.base_peak_step, d.base_peak_scope),
                                     ("head", d.head_peak_phase, d.head_peak_step, d.head_peak_scope)):
        text = f"{role} peak in {where_text(phase, step)}" if phase else f"{role} peak: phase unknown"
        parts.append(text + (f" (scope {scope})" if scope else ""))
    return "; ".join(parts)
