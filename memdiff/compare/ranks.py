"""ranks: the summaries of one job's ranks -> where memory is imbalanced and why.

Each rank is read on its busiest device (a rank drives one GPU, `cuda:LOCAL_RANK`). The report
gives every rank's peak, static and category bytes, the spread across ranks, the heaviest rank
diffed against the median one (which groups make the difference), and the ranks grouped by
shape: ranks doing the same work hold the same stacks, so data-parallel replicas fall in one
role and pipeline stages, or a rank 0 with extra buffers, each in their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

from memdiff.compare.differ import Diff, diff
from memdiff.inert import scrubbed
from memdiff.model import DeviceSummary, Summary
from memdiff.read.job import RankFile

# A group holding at least this share of a rank's peak is part of the rank's shape.
SHAPE_SHARE = 0.01
CATEGORY_COLUMNS = 4  # the largest categories across ranks get a column each


@dataclass
class RankRow:
    """One rank at its peak."""

    rank: int
    file: str
    device: int
    peak_bytes: int
    static_bytes: int
    phase_at_peak: Optional[str]
    step_at_peak: Optional[int]
    categories: Dict[str, int]


@dataclass
class Role:
    """Ranks of one shape (the same stacks hold the peak), and their peaks."""

    ranks: List[int]
    min_bytes: int
    max_bytes: int


@dataclass
class RanksReport:
    """A job's ranks compared with each other."""

    ranks: List[RankRow]
    missing: List[int]
    min_bytes: int
    median_bytes: int
    max_bytes: int
    heaviest: int
    median_rank: int
    diff: Diff  # the heaviest rank (head) against the median rank (base)
    roles: List[Role] = field(default_factory=list)
    category_columns: List[str] = field(default_factory=list)  # the categories with the most bytes across ranks

    @property
    def spread_bytes(self) -> int:
        """Max minus min peak across ranks."""
        return self.max_bytes - self.min_bytes

    @property
    def max_over_median(self) -> Optional[float]:
        """The heaviest rank's peak over the median rank's; None when the median is 0."""
        return self.max_bytes / self.median_bytes if self.median_bytes else None


def busiest(summary: Summary) -> Optional[DeviceSummary]:
    """The device holding the rank's largest peak (the rank's GPU); None for an empty snapshot."""
    return max(summary.devices, key=lambda d: (d.peak_bytes, -d.device), default=None)


def on_device(summary: Summary, device: int) -> Summary:
    """`summary` reduced to its busiest device, numbered `device`, so two ranks' GPUs align."""
    d = busiest(summary)
    return replace(summary, devices=[replace(d, device=device)] if d else [])


def _braced(path: str) -> str:
    return path.replace("{", "{{").replace("}", "}}")


def _shape(d: Optional[DeviceSummary]) -> Tuple[str, ...]:
    if d is None or not d.peak_bytes:
        return ()
    return tuple(sorted(g.signature for g in d.groups if g.bytes >= SHAPE_SHARE * d.peak_bytes))


def compare_ranks(files: Sequence[RankFile], summaries: Sequence[Summary], missing: Sequence[int] = ()) -> RanksReport:
    """Per-rank rows, the spread, the roles, and the heaviest rank diffed against the median one."""
    rows = []
    shapes: Dict[Tuple[str, ...], List[int]] = {}
    by_rank: Dict[int, Summary] = {}
    for f, s in zip(files, summaries):
        d = busiest(s)
        rows.append(RankRow(rank=f.rank, file=f.path, device=d.device if d else 0,
                            peak_bytes=d.peak_bytes if d else 0, static_bytes=d.static_bytes if d else 0,
                            phase_at_peak=d.phase_at_peak if d else None, step_at_peak=d.step_at_peak if d else None,
                            categories=dict(d.categories) if d else {}))
        shapes.setdefault(_shape(d), []).append(f.rank)
        by_rank[f.rank] = s
    ordered = sorted(rows, key=lambda r: (r.peak_bytes, -r.rank))
    median = ordered[(len(ordered) - 1) // 2]
    heaviest = ordered[-1]
    peaks = {r.rank: r.peak_bytes for r in rows}
    roles = [Role(ranks=ranks, min_bytes=min(peaks[r] for r in ranks), max_bytes=max(peaks[r] for r in ranks))
             for ranks in shapes.values()]
    roles.sort(key=lambda role: (-role.max_bytes, role.ranks[0]))
    # ranks has no --at: the advice names the command that diffs the two ranks at one phase.
    pair = diff(on_device(by_rank[median.rank], heaviest.device), on_device(by_rank[heaviest.rank], heaviest.device),
                at_advice=f"memdiff {_braced(median.file)} {_braced(heaviest.file)} --at {{phase}}")
    totals: Dict[str, int] = {}
    for r in rows:
        for name, n in r.categories.items():
            totals[name] = totals.get(name, 0) + n
    columns = sorted(totals, key=lambda c: (-totals[c], c))[:CATEGORY_COLUMNS]
    # Names from the snapshots are made one line each here, once for every output.
    return scrubbed(RanksReport(category_columns=columns, ranks=rows, missing=list(missing),
                                min_bytes=ordered[0].peak_bytes, median_bytes=median.peak_bytes,
                                max_bytes=heaviest.peak_bytes, heaviest=heaviest.rank, median_rank=median.rank,
                                diff=pair, roles=roles if len(roles) > 1 else []), skip=("diff",))
