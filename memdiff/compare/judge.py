"""judge: Diff + Thresholds (limits.py) -> Verdict. A limit is inclusive: exactly at it passes,
one byte over fails."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from memdiff.analyse.patterns import Pattern
from memdiff.compare.differ import GREW, NEW, CategoryHigh, Diff
from memdiff.compare.findings import finding
from memdiff.compare.limits import DEFAULT_PEAK, FAIL, IGNORE, FindingSelection, Limit, Thresholds, pct_text
from memdiff.compare.observe import PEAK
from memdiff.errors import InputError
from memdiff.model import DeviceSummary, Finding, Spread, Summary
from memdiff.units import format_bytes, growth_pct

TOP_GROWTH = 3  # growing rows a failing peak's note names


@dataclass
class Check:
    """One threshold applied to one value."""

    subject: str
    base_bytes: int
    head_bytes: int
    delta_bytes: int
    delta_pct: Optional[float]
    limit: str
    passed: bool


@dataclass
class FindingCheck:
    """A finding of a code the gate fails on (limits.FindingSelection): it failed the verdict."""

    code: str
    name: str
    device: Optional[int]
    message: str
    source: str  # who chose to fail on the code
    text: str  # the finding's sentence with what it is about


@dataclass
class Verdict:
    """Every check, whether all passed, and what a reviewer should know besides (the judge's own
    findings: why a peak failed, a baseline to refresh, ...)."""

    passed: bool
    rule: str
    checks: List[Check]
    findings: List[Finding] = field(default_factory=list)
    finding_checks: List[FindingCheck] = field(default_factory=list)
    finding_rules: List[Dict[str, str]] = field(default_factory=list)  # FindingSelection.to_list()

    @property
    def notes(self) -> List[str]:
        """The judge's findings' sentences, as the JSON's `notes` has always listed them."""
        return [f.text for f in self.findings]

    def to_dict(self) -> Dict[str, Any]:
        """The verdict's part of the JSON diff contract."""
        return {"verdict": "pass" if self.passed else "fail", "rule": self.rule,
                "checks": [asdict(c) for c in self.checks], "notes": self.notes,
                "finding_rules": self.finding_rules,
                "finding_checks": [{"code": c.code, "name": c.name, "device": c.device, "message": c.message,
                                    "source": c.source, "passed": False} for c in self.finding_checks]}


def _check(subject: str, base: int, head: int, limit: Limit) -> Check:
    return Check(subject=subject, base_bytes=base, head_bytes=head, delta_bytes=head - base,
                 delta_pct=growth_pct(base, head), limit=limit.describe(), passed=not limit.exceeded(base, head))


@dataclass
class Runs:
    """The two runs a diff compared: site limits look into every moment each one keeps."""

    base: Summary
    head: Summary


def _high(d: Optional[DeviceSummary], pattern: Pattern) -> Tuple[int, str]:
    """The bytes of the groups whose site matches, at the moment (the peak or a phase's peak)
    where they are highest, and its name; the peak wins ties."""
    if d is None:
        return 0, PEAK
    best = (0, PEAK)
    moments = [(d.phase_at_peak or PEAK, d.groups)]
    moments += [(p.phase, p.groups) for p in d.phase_peaks if p.groups]
    for at, groups in moments:
        size = sum(g.bytes for g in groups if pattern.search(g.site))
        if size > best[0]:
            best = (size, at)
    return best


def _site_high(device: int, pattern: Pattern, runs: Runs) -> CategoryHigh:
    """A site limit's figures, like with like however the peak moved: each run's matching groups
    at their highest over the peak and the phases' peaks."""
    b = next((x for x in runs.base.devices if x.device == device), None)
    h = next((x for x in runs.head.devices if x.device == device), None)
    (b_bytes, b_at), (h_bytes, h_at) = _high(b, pattern), _high(h, pattern)
    return CategoryHigh(pattern.pattern, b_bytes, h_bytes, b_at, h_at)


def noise_limit(thresholds: Thresholds, base_peak: int, spread: Optional[Spread]) -> Optional[Limit]:
    """The peak limit a baseline made from repeats gates with: growth past the runs' highest peak by
    more than the margin fails, so no run inside the measured spread ever does. None when the
    peak has a limit of its own (flags or the baseline's), or the runs had one peak (zero spread:
    the default rule applies)."""
    if spread is None or spread.peak.max == spread.peak.min or thresholds.peak != DEFAULT_PEAK:
        return None
    return Limit(fail_over_bytes=max(0, spread.peak.max - base_peak) + thresholds.margin_bytes(base_peak))


def _margin_unused(thresholds: Thresholds, device: int, at: str) -> str:
    """Why a noise margin set gates nothing on `device` (G012): the words after its colon."""
    if thresholds.peak != DEFAULT_PEAK:
        return "the peak has a limit of its own (--fail-over, --fail-over-pct or the baseline's), which replaces " \
               "the rule a margin widens"
    if at != PEAK:
        return f"it widens the spread of the peak, and --at compares the {at} peak, so it is judged by the rule above"
    return (f"it widens the spread of a baseline made from repeated runs whose peaks differ, and this baseline has "
            f"none on device {device} (make one with `memdiff baseline RUN1 RUN2 RUN3`), so the peak is judged by "
            f"the rule above")


def judge(diff: Diff, thresholds: Thresholds, update_hint: Optional[str] = None,
          runs: Optional[Runs] = None, spreads: Optional[Dict[int, Spread]] = None) -> Verdict:
    """Apply every threshold to every device of a diff.

    `update_hint`, when gating against a baseline, is the command that refreshes it; a peak that
    went down gets a note suggesting it, so the baseline keeps up with improvements. With `runs`
    (the summaries compared), site limits compare each run's highest moment for the site.
    With `spreads` (a baseline made from repeats, per device), the default peak rule becomes the
    measured spread plus the noise margin (noise_limit).
    """
    checks: List[Check] = []
    notes: List[Finding] = []
    noise_runs: Optional[int] = None
    for d in diff.devices:
        moment = "peak" if d.at == PEAK else f"{d.at} peak"  # --at PHASE compares that phase's peaks
        spread = (spreads or {}).get(d.device) if d.at == PEAK else None
        noisy = noise_limit(thresholds, d.base_peak_bytes, spread)
        if noisy is not None and spread is not None:
            noise_runs = spread.runs
            peak = _check(f"device {d.device} {moment}", d.base_peak_bytes, d.head_peak_bytes, noisy)
            peak.limit = (f"{noisy.describe()} (the highest of the baseline's {spread.runs} runs, "
                          f"{format_bytes(spread.peak.max - d.base_peak_bytes, signed=True)} over its peak, "
                          f"plus a margin of {thresholds.margin_text()})")
        else:
            peak = _check(f"device {d.device} {moment}", d.base_peak_bytes, d.head_peak_bytes, thresholds.peak)
            if thresholds.noise_margin is not None:
                notes.append(finding("G012", d.device, margin=thresholds.margin_text(),
                                     why=_margin_unused(thresholds, d.device, d.at)))
        checks.append(peak)
        if thresholds.reserved is not None:
            if d.base_reserved_peak_bytes is None or d.head_reserved_peak_bytes is None:
                role = "base" if d.base_reserved_peak_bytes is None else "head"
                raise InputError("the reserved peak", f"the {role} run has no allocator segments on device "
                                                      f"{d.device} (a CPU capture, or a baseline made before reserved "
                                                      f"memory was stored), so its reserved peak cannot be gated")
            checks.append(_check(f"device {d.device} reserved peak", d.base_reserved_peak_bytes,
                                 d.head_reserved_peak_bytes, thresholds.reserved))
        phases = {p.phase: p for p in d.phases}
        for name, limit in thresholds.phases.items():
            p = phases.get(name)
            if p is None or p.base_peak_bytes is None or p.head_peak_bytes is None:
                role = "base" if p is None or p.base_peak_bytes is None else "head"
                raise InputError(f"the {name} peak", f"the {role} run has no {name} phase on device {d.device}, "
                                                     f"so it cannot be gated (a baseline made before phases: "
                                                     f"re-create it with `memdiff baseline`)")
            checks.append(_check(f"device {d.device} {name} peak", p.base_peak_bytes, p.head_peak_bytes, limit))
        # Each category at its highest in each run (the peak or a phase's peak), so that a peak
        # that moved between phases does not compare activations freed with activations held.
        highs = {h.category: h for h in d.category_highs}
        for name, limit in thresholds.categories.items():
            h = highs.get(name)
            checks.append(_check(f"device {d.device} {name} ({_moments(h)})", h.base_bytes if h else 0,
                                 h.head_bytes if h else 0, limit))
        for s in thresholds.sites:
            high = _site_high(d.device, s.pattern, runs) if runs is not None else None
            if high is None:  # no runs to look into: the compared moment's rows
                rows = [r for r in d.rows if s.pattern.search(r.site)]
                high = CategoryHigh(s.pattern.pattern, sum(r.base_bytes for r in rows),
                                    sum(r.head_bytes for r in rows), d.at, d.at)
            checks.append(_check(f"device {d.device} sites /{s.pattern.pattern}/ ({_moments(high)})",
                                 high.base_bytes, high.head_bytes, s.limit))
            if not high.base_bytes:
                # A misspelt or stale pattern would check 0 B against whatever is new, and nothing else.
                notes.append(finding("G004", d.device, pattern=s.pattern.pattern))
        if d.peak_delta_bytes < 0 and update_hint and not d.phases_lost():  # P002: a lower peak of less work
            drop = growth_pct(d.base_peak_bytes, d.head_peak_bytes)
            assert drop is not None  # the peak went down, so the base's is above 0
            notes.append(finding("G003", d.device, drop_bytes=-d.peak_delta_bytes,
                                 drop=format_bytes(-d.peak_delta_bytes), pct=pct_text(round(-drop, 1)),
                                 command=update_hint))
        if not peak.passed:
            growth = [r for r in d.rows if r.status in (NEW, GREW)][:TOP_GROWTH]
            notes.append(finding("G002", d.device, moment=moment, grew_bytes=d.peak_delta_bytes,
                                 grew=format_bytes(d.peak_delta_bytes),
                                 sites=", ".join(f"{r.label or r.site} {format_bytes(r.delta_bytes, signed=True)}"
                                                 for r in growth)))
    return select(Verdict(passed=all(c.passed for c in checks), rule=thresholds.describe(noise_runs), checks=checks,
                          findings=notes), diff.findings, thresholds.findings)


def select(verdict: Verdict, observed: Sequence[Finding], selection: FindingSelection) -> Verdict:
    """The verdict with the findings chosen to fail the gate failing it, the ignored ones dropped
    from its own, and the rules in force recorded."""
    failing = [FindingCheck(f.code, f.name, f.device, f.message, rule.source, f.text)
               for f in [*observed, *verdict.findings]
               for rule in [selection.rule(f.code)] if rule is not None and rule.action == FAIL]
    return replace(verdict, passed=verdict.passed and not failing, finding_checks=failing,
                   findings=[f for f in verdict.findings if selection.action(f.code) != IGNORE],
                   finding_rules=selection.to_list())


def _moment(at: str) -> str:
    return "the peak" if at == PEAK else f"the {at} peak"


def _moments(high: Optional[CategoryHigh]) -> str:
    """Which moments a category check compared: `highest at the forward peak in both`."""
    if high is None:
        return "in neither run"
    if high.base_at == high.head_at:
        return f"highest at {_moment(high.base_at)} in both"
    return f"highest at {_moment(high.base_at)} in base, {_moment(high.head_at)} in head"


def imbalance_check(median_bytes: int, max_bytes: int, pct: float) -> Check:
    """The heaviest rank's peak against the median rank's: fails when max/median exceeds 1 + pct/100."""
    ratio_limit = 1 + pct / 100
    return Check(subject="imbalance (heaviest rank / median rank)", base_bytes=median_bytes, head_bytes=max_bytes,
                 delta_bytes=max_bytes - median_bytes, delta_pct=growth_pct(median_bytes, max_bytes),
                 limit=f"max/median over {ratio_limit:.2f}x", passed=max_bytes <= ratio_limit * median_bytes)


def judge_ranks(per_rank: Dict[int, Verdict], rule: str) -> Verdict:
    """A job's verdict from each rank's: it passes when every rank does; checks, findings and
    failing findings name their rank."""
    checks = [replace(c, subject=f"rank {rank} {c.subject}") for rank, v in per_rank.items() for c in v.checks]
    notes = [replace(f, rank=rank) for rank, v in per_rank.items() for f in v.findings]
    failing = [replace(c, text=f"rank {rank} {c.text}") for rank, v in per_rank.items() for c in v.finding_checks]
    rules = next((v.finding_rules for v in per_rank.values()), [])
    return Verdict(passed=all(v.passed for v in per_rank.values()), rule=rule, checks=checks, findings=notes,
                   finding_checks=failing, finding_rules=rules)
