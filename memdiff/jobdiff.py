"""jobdiff: two jobs' rank summaries -> one Diff per rank, ranks matched by number.

A job regresses when any rank does, so every rank is diffed and judged; the report shows the
worst rank (the largest peak growth) in full and the others a line each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

from memdiff.differ import PEAK, Diff, diff
from memdiff.errors import InputError
from memdiff.job import RankFile, ranges, ranks_text
from memdiff.model import Summary


@dataclass
class RankDiff:
    """One rank of both jobs, compared."""

    rank: int
    diff: Diff

    @property
    def peak_delta_bytes(self) -> int:
        """The largest peak change over the rank's devices (growth before shrinkage)."""
        return max((d.peak_delta_bytes for d in self.diff.devices), default=0)


@dataclass
class JobDiff:
    """Every rank both jobs have, the ranks only one has, and the worst rank."""

    ranks: List[RankDiff]
    only_base: List[int]
    only_head: List[int]

    @property
    def worst(self) -> RankDiff:
        """The rank whose peak grew most (the lowest rank among equals)."""
        return max(self.ranks, key=lambda r: (r.peak_delta_bytes, -r.rank))

    @property
    def warnings(self) -> List[str]:
        """Ranks that could not be compared."""
        out = []
        if self.only_base:
            out.append(f"{ranks_text(self.only_base)} only in base, not compared")
        if self.only_head:
            out.append(f"{ranks_text(self.only_head)} only in head, not compared")
        return out


def diff_jobs(base_files: Sequence[RankFile], base: Sequence[Summary], head_files: Sequence[RankFile],
              head: Sequence[Summary], at: str = PEAK) -> JobDiff:
    """Each rank of head against the same rank of base; InputError when they share no rank."""
    b = {f.rank: s for f, s in zip(base_files, base)}
    h = {f.rank: s for f, s in zip(head_files, head)}
    common = sorted(set(b) & set(h))
    if not common:
        raise InputError("job", f"base has ranks {ranges(sorted(b))} and head {ranges(sorted(h))}: none to compare")
    return JobDiff(ranks=[RankDiff(r, diff(b[r], h[r], at=at)) for r in common],
                   only_base=sorted(set(b) - set(h)), only_head=sorted(set(h) - set(b)))
