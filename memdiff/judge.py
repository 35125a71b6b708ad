"""gate: Diff + thresholds -> Verdict. A limit is inclusive: exactly at it passes, one byte over fails.

Thresholds apply per device to the peak, to the bytes of a category, and to the bytes of the
groups whose site matches a regex. Each limit has an absolute and/or a percent part; with both,
both must be exceeded for the check to fail. A limit may add a percent that fails on its own
(`or-fail-over-pct`): the default rule's, so that small runs are gated too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from typing import Any, Dict, List, Optional, Tuple

from memdiff.differ import GREW, NEW, PEAK, CategoryHigh, Diff, label_rows
from memdiff.errors import InputError, clip
from memdiff.model import DeviceSummary, Summary
from memdiff.patterns import Pattern
from memdiff.units import format_bytes, parse_size

DEFAULT_FAIL_OVER_BYTES = 64 * 2**20
DEFAULT_FAIL_OVER_PCT = 1.0
# Growth past this fails at any size: a pytest-sized run (a few MiB) never grows by 64 MiB, yet
# doubling it is a regression; an identical rerun (0 B) or allocator rounding never comes near.
DEFAULT_OR_OVER_PCT = 50.0
TOP_GROWTH = 3


def pct_text(pct: float) -> str:
    """A percentage as users type it: `1%`, `2.5%`."""
    return f"{pct:g}%"


def size_text(n: int) -> str:
    """A size as users type it, exact: `64MiB`, `3GiB`, or plain bytes."""
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


@dataclass(frozen=True)
class Limit:
    """How much growth is allowed; with both parts set, both must be exceeded to fail."""

    fail_over_bytes: Optional[int] = None
    fail_over_pct: Optional[float] = None
    or_over_pct: Optional[float] = None  # growth past this percent fails whatever the other parts say

    @classmethod
    def from_options(cls, fail_over: Optional[int], fail_over_pct: Optional[float]) -> "Limit":
        """The peak limit the flags ask for; neither flag means the default (DEFAULT_PEAK)."""
        if fail_over is None and fail_over_pct is None:
            return DEFAULT_PEAK
        return cls(fail_over, fail_over_pct)

    def overridden(self, fail_over: Optional[int], fail_over_pct: Optional[float]) -> "Limit":
        """This limit with the parts given on the command line replaced; a flag given makes the
        rule the user's, so the default's percent that fails on its own goes with it."""
        if fail_over is None and fail_over_pct is None:
            return self
        return Limit(self.fail_over_bytes if fail_over is None else fail_over,
                     self.fail_over_pct if fail_over_pct is None else fail_over_pct)

    def describe(self) -> str:
        """`more than 1% and by more than 64.00 MiB, or by more than 50%`."""
        parts = []
        if self.fail_over_pct is not None:
            parts.append(f"more than {pct_text(self.fail_over_pct)}")
        if self.fail_over_bytes is not None:
            parts.append(f"more than {format_bytes(self.fail_over_bytes)}")
        text = " and by ".join(parts)
        if self.or_over_pct is not None:
            alone = f"more than {pct_text(self.or_over_pct)}"
            text = f"{text}, or by {alone}" if text else alone
        return text or "(no limit)"

    def exceeded(self, base: int, head: int) -> bool:
        """Whether growth from `base` to `head` bytes breaks the limit."""
        delta = head - base
        over = []
        if self.fail_over_bytes is not None:
            over.append(delta > self.fail_over_bytes)
        if self.fail_over_pct is not None:
            # Exact arithmetic: 1% of 6,400 bytes is 64, and 65 is over it, 64 is not.
            over.append(delta > Fraction(str(self.fail_over_pct)) * base / 100)
        alone = self.or_over_pct is not None and delta > 0 and delta > Fraction(str(self.or_over_pct)) * base / 100
        return (bool(over) and all(over)) or alone

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form stored in baselines."""
        out: Dict[str, Any] = {}
        if self.fail_over_bytes is not None:
            out["fail-over"] = size_text(self.fail_over_bytes)
        if self.fail_over_pct is not None:
            out["fail-over-pct"] = self.fail_over_pct
        if self.or_over_pct is not None:
            out["or-fail-over-pct"] = self.or_over_pct
        return out


DEFAULT_PEAK = Limit(DEFAULT_FAIL_OVER_BYTES, DEFAULT_FAIL_OVER_PCT, DEFAULT_OR_OVER_PCT)
MAX_PCT = 1e9  # as the baseline schema allows


def parse_pct(text: str) -> float:
    """A percentage as users type it (`1`, `2.5`, `3%`); ValueError saying why when it is none a
    limit can use (negative, NaN, infinite: a limit nothing can exceed is no limit)."""
    try:
        value = float(text.strip().rstrip("%"))
    except ValueError:
        raise ValueError(f"{text!r} is not a percentage") from None
    if value < 0:
        raise ValueError(f"{text!r} is not a percentage: it is negative")
    if not value <= MAX_PCT:
        raise ValueError(f"{text!r} is not a percentage a limit can use")
    return value


def parse_limit(text: str) -> Limit:
    """One part of a limit: `10%` (percent) or a size (`256MiB`); ValueError saying why when neither."""
    if text.strip().endswith("%"):
        return Limit(fail_over_pct=parse_pct(text))
    return Limit(fail_over_bytes=parse_size(text))


@dataclass(frozen=True)
class SiteLimit:
    """A limit on the groups whose site label matches `pattern`."""

    pattern: Pattern
    limit: Limit


@dataclass
class Thresholds:
    """Everything a run is gated with."""

    peak: Limit = DEFAULT_PEAK
    categories: Dict[str, Limit] = field(default_factory=dict)
    sites: List[SiteLimit] = field(default_factory=list)
    phases: Dict[str, Limit] = field(default_factory=dict)  # the highest memory of a phase over all steps

    def describe(self) -> str:
        """The rule in words, as printed with every verdict."""
        text = f"fail when the peak of a device grows by {self.peak.describe()}"
        text += "".join(f"; the {p} peak by {lim.describe()}" for p, lim in self.phases.items())
        text += "".join(f"; {c} bytes by {lim.describe()}" for c, lim in self.categories.items())
        text += "".join(f"; sites matching /{s.pattern.pattern}/ by {s.limit.describe()}" for s in self.sites)
        return text

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form stored in baselines, in a stable order."""
        out: Dict[str, Any] = {"peak": self.peak.to_dict()}
        if self.phases:
            out["phases"] = {p: lim.to_dict() for p, lim in sorted(self.phases.items())}
        if self.categories:
            out["categories"] = {c: lim.to_dict() for c, lim in sorted(self.categories.items())}
        if self.sites:
            out["sites"] = [{"site": s.pattern.pattern, **s.limit.to_dict()} for s in self.sites]
        return out


def _limit_from(path: str, where: str, data: Dict[str, Any]) -> Limit:
    size = data.get("fail-over")
    if isinstance(size, str):
        try:
            size = parse_size(size)
        except ValueError:
            raise InputError(path, f'{where}.fail-over: "{data["fail-over"]}" is not a size '
                                   f"(examples: 512MiB, 0.5GiB, 64MB, 1e9)") from None
    return Limit(size, data.get("fail-over-pct"), data.get("or-fail-over-pct"))


def thresholds_from_dict(path: str, data: Dict[str, Any]) -> Thresholds:
    """Thresholds from a baseline's `thresholds` (already schema-checked); InputError naming the bad value."""
    peak = _limit_from(path, "thresholds.peak", data.get("peak", {})) if "peak" in data else DEFAULT_PEAK
    categories = {c: _limit_from(path, f"thresholds.categories.{clip(c)}", lim)
                  for c, lim in data.get("categories", {}).items()}
    phases = {p: _limit_from(path, f"thresholds.phases.{p}", lim) for p, lim in data.get("phases", {}).items()}
    sites = []
    for i, s in enumerate(data.get("sites", [])):
        try:
            pattern = Pattern(s["site"], f"{path}: thresholds.sites.{i}.site")
        except ValueError as exc:
            raise InputError(path, f"thresholds.sites.{i}.site: {exc}") from None
        sites.append(SiteLimit(pattern, _limit_from(path, f"thresholds.sites.{i}", s)))
    return Thresholds(peak, categories, sites, phases)


def thresholds_over(stored: Optional[Thresholds], fail_over: Optional[int], fail_over_pct: Optional[float],
                    categories: Dict[str, Limit], phases: Dict[str, Limit]) -> Thresholds:
    """The limits given, over stored ones (a baseline's) where each given part replaces its own;
    with nothing stored, the peak's default rule unless a peak part is given."""
    if stored is None:
        return Thresholds(Limit.from_options(fail_over, fail_over_pct), dict(categories), phases=dict(phases))
    return Thresholds(stored.peak.overridden(fail_over, fail_over_pct), {**stored.categories, **categories},
                      list(stored.sites), {**stored.phases, **phases})


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
class Verdict:
    """Every check, whether all passed, and what a reviewer should know besides."""

    passed: bool
    rule: str
    checks: List[Check]
    notes: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        """The verdict's part of the JSON diff contract."""
        return {"verdict": "pass" if self.passed else "fail", "rule": self.rule,
                "checks": [asdict(c) for c in self.checks], "notes": self.notes}


def growth_pct(base: int, head: int) -> Optional[float]:
    """Percent change from base to head; None when base is 0 (growth from nothing has no percentage)."""
    return 100.0 * (head - base) / base if base else None


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


def judge(diff: Diff, thresholds: Thresholds, update_hint: Optional[str] = None,
          runs: Optional[Runs] = None) -> Verdict:
    """Apply every threshold to every device of a diff.

    `update_hint`, when gating against a baseline, is the command that refreshes it; a peak that
    went down gets a note suggesting it, so the baseline keeps up with improvements. With `runs`
    (the summaries compared), site limits compare each run's highest moment for the site.
    """
    checks: List[Check] = []
    notes: List[str] = []
    for d in diff.devices:
        moment = "peak" if d.at == PEAK else f"{d.at} peak"  # --at PHASE compares that phase's peaks
        peak = _check(f"device {d.device} {moment}", d.base_peak_bytes, d.head_peak_bytes, thresholds.peak)
        checks.append(peak)
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
                notes.append(f"device {d.device}: sites /{s.pattern.pattern}/ matches no group of the base run, "
                             f"so its limit only sees groups that are new")
        if d.peak_delta_bytes < 0 and update_hint:
            drop = growth_pct(d.base_peak_bytes, d.head_peak_bytes)
            assert drop is not None  # the peak went down, so the base's is above 0
            notes.append(f"device {d.device}: peak went down by {format_bytes(-d.peak_delta_bytes)} "
                         f"({pct_text(round(-drop, 1))}): consider "
                         f"updating the baseline: {update_hint}")
        if not peak.passed:
            growth = [replace(r) for r in d.rows if r.status in (NEW, GREW)][:TOP_GROWTH]
            label_rows(growth)  # modules named only where two of these would read alike
            notes.append(f"device {d.device}: {moment} grew by {format_bytes(d.peak_delta_bytes)}; top growth: "
                         + ", ".join(f"{r.label or r.site} {format_bytes(r.delta_bytes, signed=True)}" for r in growth))
    return Verdict(passed=all(c.passed for c in checks), rule=thresholds.describe(), checks=checks, notes=notes)


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
    """A job's verdict from each rank's: it passes when every rank does; checks and notes name their rank."""
    checks = [replace(c, subject=f"rank {rank} {c.subject}") for rank, v in per_rank.items() for c in v.checks]
    notes = [f"rank {rank} {n}" for rank, v in per_rank.items() for n in v.notes]
    return Verdict(passed=all(v.passed for v in per_rank.values()), rule=rule, checks=checks, notes=notes)
