"""gate: Diff + thresholds -> Verdict. A limit is inclusive: exactly at it passes, one byte over fails."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import List, Optional

from memdiff.diff import Diff
from memdiff.units import format_bytes

DEFAULT_FAIL_OVER_BYTES = 64 * 2**20
DEFAULT_FAIL_OVER_PCT = 1.0


def pct_text(pct: float) -> str:
    """A percentage as users type it: `1%`, `2.5%`."""
    return f"{pct:g}%"


@dataclass(frozen=True)
class PeakRule:
    """When a device's peak growth is a regression; with both limits set, both must be exceeded."""

    fail_over_bytes: Optional[int]
    fail_over_pct: Optional[float]

    @classmethod
    def from_options(cls, fail_over: Optional[int], fail_over_pct: Optional[float]) -> "PeakRule":
        """The rule the flags ask for; neither flag means the default (1% and 64 MiB)."""
        if fail_over is None and fail_over_pct is None:
            return cls(DEFAULT_FAIL_OVER_BYTES, DEFAULT_FAIL_OVER_PCT)
        return cls(fail_over, fail_over_pct)

    def describe(self) -> str:
        """The rule in words, as printed with every verdict."""
        limits = []
        if self.fail_over_pct is not None:
            limits.append(f"more than {pct_text(self.fail_over_pct)}")
        if self.fail_over_bytes is not None:
            limits.append(f"more than {format_bytes(self.fail_over_bytes)}")
        return "fail when the peak of a device grows by " + " and by ".join(limits)

    def exceeded(self, base: int, head: int) -> bool:
        """Whether growth from `base` to `head` bytes breaks the rule."""
        delta = head - base
        over = []
        if self.fail_over_bytes is not None:
            over.append(delta > self.fail_over_bytes)
        if self.fail_over_pct is not None:
            # Exact arithmetic: 1% of 6,400 bytes is 64, and 65 is over it, 64 is not.
            limit = Fraction(str(self.fail_over_pct)) * base / 100
            over.append(delta > limit)
        return all(over)


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
    """Every check and whether all passed."""

    passed: bool
    rule: str
    checks: List[Check]


def growth_pct(base: int, head: int) -> Optional[float]:
    """Percent change from base to head; None when base is 0 (growth from nothing has no percentage)."""
    return 100.0 * (head - base) / base if base else None


def judge_peaks(diff: Diff, rule: PeakRule) -> Verdict:
    """Apply the peak rule to every device of a diff."""
    checks = [
        Check(subject=f"device {d.device} peak", base_bytes=d.base_peak_bytes, head_bytes=d.head_peak_bytes,
              delta_bytes=d.peak_delta_bytes, delta_pct=growth_pct(d.base_peak_bytes, d.head_peak_bytes),
              limit=rule.describe(), passed=not rule.exceeded(d.base_peak_bytes, d.head_peak_bytes))
        for d in diff.devices
    ]
    return Verdict(passed=all(c.passed for c in checks), rule=rule.describe(), checks=checks)
