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
from typing import Any, Dict, List, Optional

from memdiff.errors import InputError, clip
from memdiff.patterns import Pattern
from memdiff.units import format_bytes, parse_size

DEFAULT_FAIL_OVER_BYTES = 64 * 2**20
DEFAULT_FAIL_OVER_PCT = 1.0
# Growth past this fails at any size: a pytest-sized run (a few MiB) never grows by 64 MiB, yet
# doubling it is a regression; an identical rerun (0 B) or allocator rounding never comes near.
DEFAULT_OR_OVER_PCT = 50.0


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
