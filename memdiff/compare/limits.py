"""limits: what a run is gated with, as users write it (flags, baseline files, the API) and as
baselines store it. Parsing and wording live here; judge.py only applies them.

Thresholds apply per device to the peak, to a phase's peak, to the bytes of a category, and to
the bytes of the groups whose site matches a regex. Each limit has an absolute and/or a percent
part; with both, both must be exceeded for the check to fail. A limit may add a percent that
fails on its own (`or-fail-over-pct`): the default rule's, so that small runs are gated too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Dict, List, Optional, Sequence, Tuple

from memdiff.analyse.patterns import Pattern
from memdiff.compare.findings import DEFAULT_FAIL_ON, parse_codes
from memdiff.errors import InputError, clip
from memdiff.numbers import decimal
from memdiff.units import format_bytes, parse_size

DEFAULT_FAIL_OVER_BYTES = 64 * 2**20
DEFAULT_FAIL_OVER_PCT = 1.0
# Growth past this fails at any size: a pytest-sized run (a few MiB) never grows by 64 MiB, yet
# doubling it is a regression; an identical rerun (0 B) or allocator rounding never comes near.
DEFAULT_OR_OVER_PCT = 50.0
# Over a baseline made from repeated runs, the default rule becomes: growth past the runs' highest
# peak by more than this margin (of the baseline's peak) fails. `--noise-margin` replaces it.
DEFAULT_NOISE_MARGIN_PCT = 1.0


def pct_text(pct: float) -> str:
    """A percentage as users type it: `1%`, `2.5%`."""
    return f"{pct:g}%"


def size_text(n: int) -> str:
    """A size as users type it, exact: `64MiB`, `3GiB`, or bytes (`1000B`: a number alone is no size)."""
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return f"{n}B"


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
        """The limit the flags give, replacing this one whole: `--fail-over-pct 5` over a stored
        `512MiB` is `more than 5%`, the rule the user typed, never a mix of it and an old part
        (which would stop a small run from ever failing)."""
        if fail_over is None and fail_over_pct is None:
            return self
        return Limit(fail_over, fail_over_pct)

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
        value = decimal(text.strip().rstrip("%"))
    except ValueError:
        raise ValueError(f"{text!r} is not a percentage (digits 0-9, as in 2.5 or 5%)") from None
    if value < 0:
        raise ValueError(f"{text!r} is not a percentage: it is negative")
    if not value <= MAX_PCT:
        raise ValueError(f"{text!r} is not a percentage a limit can use")
    return value


def parse_limit(text: str) -> Limit:
    """One part of a limit: `10%` (percent) or a size with its unit (`256MiB`); ValueError saying
    why when neither. A bare number is refused: `activation=10` meant 10% far more often than
    10 bytes, and a limit of 10 B fails every run."""
    if text.strip().endswith("%"):
        return Limit(fail_over_pct=parse_pct(text))
    try:
        decimal(text)
    except ValueError:
        return Limit(fail_over_bytes=parse_size(text))
    raise ValueError(f"{text!r} has no unit: write {text.strip()}% for a percent, or a size such as "
                     f"{text.strip()}MiB ({text.strip()}B for bytes)")


@dataclass(frozen=True)
class SiteLimit:
    """A limit on the groups whose site label matches `pattern`."""

    pattern: Pattern
    limit: Limit


@dataclass(frozen=True)
class Headroom:
    """A capacity limit checked on a forecast (`memdiff forecast --baseline`): the largest knob
    value whose predicted peak fits in `budget_bytes` must stay at least `min_value`."""

    budget_bytes: int
    min_value: int

    def describe(self) -> str:
        """The limit in words."""
        return f"the largest value within {format_bytes(self.budget_bytes)} falls below {self.min_value:,}"

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form stored in baselines."""
        return {"budget": self.budget_bytes, "min-value": self.min_value}


FAIL, IGNORE = "fail", "ignore"
DEFAULT_SOURCE = "default"


@dataclass(frozen=True)
class FindingRule:
    """What the gate does with one finding code, and who chose it (`default`, `baseline`,
    `--fail-on`, `--ignore`, a rules file's path)."""

    code: str
    action: str  # FAIL or IGNORE
    source: str


@dataclass(frozen=True)
class FindingSelection:
    """The finding codes that fail the gate and those that are ignored (findings.py's catalogue)."""

    rules: Tuple[FindingRule, ...] = tuple(FindingRule(c, FAIL, DEFAULT_SOURCE) for c in DEFAULT_FAIL_ON)

    def action(self, code: str) -> Optional[str]:
        """FAIL, IGNORE, or None: the finding is shown and fails nothing."""
        return next((r.action for r in self.rules if r.code == code), None)

    def rule(self, code: str) -> Optional[FindingRule]:
        """The rule in force for `code`, if any."""
        return next((r for r in self.rules if r.code == code), None)

    def chosen(self, fail_on: Sequence[str], ignore: Sequence[str], source_fail: str,
               source_ignore: str) -> "FindingSelection":
        """These choices over the ones in force: each code's last choice wins, an ignore over a
        fail-on of the same code given together."""
        rules = {r.code: r for r in self.rules}
        for code in fail_on:
            rules[code] = FindingRule(code, FAIL, source_fail)
        for code in ignore:
            rules[code] = FindingRule(code, IGNORE, source_ignore)
        return FindingSelection(tuple(rules.values()))

    def describe(self) -> str:
        """`findings K003, K004, A002, P002 fail (default); T003 is ignored (--ignore)`; empty when none."""
        parts = []
        for action, word in ((FAIL, "fail"), (IGNORE, "ignored")):
            for source in dict.fromkeys(r.source for r in self.rules if r.action == action):
                codes = [r.code for r in self.rules if r.action == action and r.source == source]
                verb = word if action == FAIL else ("is ignored" if len(codes) == 1 else "are ignored")
                parts.append(f"{', '.join(codes)} {verb} ({source})")
        return ("findings " + "; ".join(parts)) if parts else ""

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form stored in baselines: the choices that are not the default."""
        out: Dict[str, Any] = {}
        fail = [r.code for r in self.rules if r.action == FAIL and r.source != DEFAULT_SOURCE]
        ignore = [r.code for r in self.rules if r.action == IGNORE]
        if fail:
            out["fail-on"] = fail
        if ignore:
            out["ignore"] = ignore
        return out

    def to_list(self) -> List[Dict[str, str]]:
        """The rules in force, as the JSON's `finding_rules`."""
        return [{"code": r.code, "action": r.action, "source": r.source} for r in self.rules]


@dataclass
class Thresholds:
    """Everything a run is gated with."""

    peak: Limit = DEFAULT_PEAK
    categories: Dict[str, Limit] = field(default_factory=dict)
    sites: List[SiteLimit] = field(default_factory=list)
    phases: Dict[str, Limit] = field(default_factory=dict)  # the highest memory of a phase over all steps
    headroom: Optional[Headroom] = None  # checked by `memdiff forecast --baseline`, not by a single run
    # Over a baseline made from repeats with a spread, what the default peak rule becomes: past
    # the runs' highest peak by more than this (a percent of the baseline's peak, or a size).
    noise_margin: Optional[Limit] = None
    # The caching allocator's reserved peak: judged only when set (the default gates allocated memory).
    reserved: Optional[Limit] = None
    findings: FindingSelection = field(default_factory=FindingSelection)

    def margin(self) -> Limit:
        """The noise margin in force: the one set, else DEFAULT_NOISE_MARGIN_PCT."""
        return self.noise_margin or Limit(fail_over_pct=DEFAULT_NOISE_MARGIN_PCT)

    def margin_bytes(self, base: int) -> int:
        """The noise margin in bytes over a baseline peak of `base` bytes (rounded down)."""
        m = self.margin()
        if m.fail_over_bytes is not None:
            return m.fail_over_bytes
        return int(Fraction(str(m.fail_over_pct or 0)) * base / 100)

    def margin_text(self) -> str:
        """The noise margin as users type it: `1%`, `32MiB`."""
        m = self.margin()
        return format_bytes(m.fail_over_bytes) if m.fail_over_bytes is not None else pct_text(m.fail_over_pct or 0)

    def describe(self, noise_runs: Optional[int] = None) -> str:
        """The rule in words, as printed with every verdict; `noise_runs`: the default peak rule
        was replaced by the measured spread of that many runs."""
        if noise_runs is not None and self.peak == DEFAULT_PEAK:
            text = (f"fail when the peak of a device grows past the highest of the baseline's {noise_runs} runs "
                    f"by more than {self.margin_text()} of the baseline's peak")
        else:
            text = f"fail when the peak of a device grows by {self.peak.describe()}"
        if self.reserved is not None:
            text += f"; the reserved peak by {self.reserved.describe()}"
        text += "".join(f"; the {p} peak by {lim.describe()}" for p, lim in self.phases.items())
        text += "".join(f"; {c} bytes by {lim.describe()}" for c, lim in self.categories.items())
        text += "".join(f"; sites matching /{s.pattern.pattern}/ by {s.limit.describe()}" for s in self.sites)
        if self.headroom is not None:
            text += f"; a forecast fails when {self.headroom.describe()}"
        chosen = self.findings.describe()
        return text + (f"; {chosen}" if chosen else "")

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form stored in baselines, in a stable order."""
        out: Dict[str, Any] = {"peak": self.peak.to_dict()}
        if self.phases:
            out["phases"] = {p: lim.to_dict() for p, lim in sorted(self.phases.items())}
        if self.categories:
            out["categories"] = {c: lim.to_dict() for c, lim in sorted(self.categories.items())}
        if self.sites:
            out["sites"] = [{"site": s.pattern.pattern, **s.limit.to_dict()} for s in self.sites]
        if self.headroom is not None:
            out["headroom"] = self.headroom.to_dict()
        if self.noise_margin is not None:
            out["noise-margin"] = self.noise_margin.to_dict()
        if self.reserved is not None:
            out["reserved"] = self.reserved.to_dict()
        if self.findings.to_dict():
            out["findings"] = self.findings.to_dict()
        return out


def _limit_from(path: str, where: str, data: Dict[str, Any]) -> Limit:
    size = data.get("fail-over")
    if isinstance(size, str):
        try:
            # Baselines written before sizes needed a unit stored plain bytes as a bare number ("1000").
            size = parse_size(size, bare_is_bytes=True)
        except ValueError as exc:
            raise InputError(path, f"{where}.fail-over: {exc}") from None
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
    noise = _limit_from(path, "thresholds.noise-margin", data["noise-margin"]) if "noise-margin" in data else None
    reserved = _limit_from(path, "thresholds.reserved", data["reserved"]) if "reserved" in data else None
    chosen = data.get("findings", {})
    both = sorted({c.strip().upper() for c in chosen.get("fail-on", [])}
                  & {c.strip().upper() for c in chosen.get("ignore", [])})
    if both:
        # Read in order, the ignore won: a reviewer reading `fail-on` saw a gate that never failed on it.
        raise InputError(path, f"thresholds.findings: {', '.join(both[:5])} in both fail-on and ignore: a finding "
                               f"either fails or is ignored, so keep each code in one of them")
    findings = FindingSelection().chosen(parse_codes(f"{path}: thresholds.findings.fail-on", chosen.get("fail-on", [])),
                                         parse_codes(f"{path}: thresholds.findings.ignore", chosen.get("ignore", [])),
                                         "baseline", "baseline")
    return Thresholds(peak, categories, sites, phases, _headroom_from(path, data.get("headroom")), noise, reserved,
                      findings)


def _headroom_from(path: str, data: Optional[Dict[str, Any]]) -> Optional[Headroom]:
    """A baseline's headroom limit (schema-checked: `budget` a size, `min-value` a count)."""
    if data is None:
        return None
    budget = data["budget"]
    if isinstance(budget, str):
        try:
            budget = parse_size(budget)
        except ValueError as exc:
            raise InputError(path, f"thresholds.headroom.budget: {exc}") from None
    return Headroom(budget, data["min-value"])


def thresholds_over(stored: Optional[Thresholds], fail_over: Optional[int], fail_over_pct: Optional[float],
                    categories: Dict[str, Limit], phases: Dict[str, Limit], noise_margin: Optional[Limit] = None,
                    reserved: Optional[Limit] = None,
                    choices: Sequence[Tuple[str, str, Sequence[str], Sequence[str]]] = ()) -> Thresholds:
    """The limits given, over stored ones (a baseline's) where each one given replaces its stored one whole;
    with nothing stored, the peak's default rule unless a peak part is given. `choices` choose findings
    over the stored choice, in order: (who chose to fail, who chose to ignore, fail-on codes, ignored codes)."""
    findings = stored.findings if stored is not None else FindingSelection()
    for source_fail, source_ignore, fail_on, ignore in choices:
        findings = findings.chosen(fail_on, ignore, source_fail, source_ignore)
    if stored is None:
        return Thresholds(Limit.from_options(fail_over, fail_over_pct), dict(categories), phases=dict(phases),
                          noise_margin=noise_margin, reserved=reserved, findings=findings)
    return Thresholds(stored.peak.overridden(fail_over, fail_over_pct), {**stored.categories, **categories},
                      list(stored.sites), {**stored.phases, **phases}, stored.headroom,
                      noise_margin or stored.noise_margin, reserved or stored.reserved, findings)
