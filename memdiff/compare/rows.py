"""The rows of a diff: what a comparison of two runs holds per device, aligned group by group (differ.py
builds them; observe.py reads them to say what else the pair shows; the report renders them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from memdiff.analyse.lifetimes import BACKWARD, OPTIMIZER
from memdiff.model import Frame

PEAK = "peak"  # the moment a diff compares unless --at names a phase's peak


@dataclass
class Member:
    """One group of one run that a row aligns (a row may hold several of each run)."""

    side: str  # "base" or "head"
    signature: str
    count: int
    bytes: int
    bytes_from_earlier_steps: int
    frames: List[Frame]
    bytes_from_earlier_forwards: int = 0
    earlier_forwards: int = 0


@dataclass
class DiffRow:
    """One aligned set of groups (or a NEW/GONE one) and how it changed."""

    status: str
    site: str
    signature: str
    category: Optional[str]
    base_count: int
    head_count: int
    base_bytes: int
    head_bytes: int
    delta_bytes: int
    frames: List[Frame]
    matched_by: Optional[str]
    context: str = ""  # the module (or model-code line) the allocation happens in, when the frames say
    label: str = ""  # the site, with the context or category added where two rows would read alike
    base_earlier_bytes: int = 0  # kept bytes: allocated in a step before the peak's step, or by an earlier forward
    head_earlier_bytes: int = 0
    members: List[Member] = field(default_factory=list)
    base_forward_bytes: int = 0  # of the kept bytes, those kept from earlier forwards in the peak's step
    head_forward_bytes: int = 0
    head_forwards: int = 0  # how many earlier forwards head's come from

    def member_groups(self) -> List[Member]:
        """The groups the row aligns; a one-to-one row keeps them implicit (a smaller JSON)."""
        if self.members:
            return self.members
        out = []
        if self.base_bytes or self.base_count:
            out.append(Member("base", self.signature, self.base_count, self.base_bytes, self.base_earlier_bytes,
                              self.frames, self.base_forward_bytes))
        if self.head_bytes or self.head_count:
            out.append(Member("head", self.signature, self.head_count, self.head_bytes, self.head_earlier_bytes,
                              self.frames, self.head_forward_bytes, self.head_forwards))
        return out


@dataclass
class CategoryDelta:
    """Bytes live at the peak in one category, base and head."""

    category: str
    base_bytes: int
    head_bytes: int
    delta_bytes: int


@dataclass
class CategoryHigh:
    """A category's highest bytes in each run over the moments a summary keeps (the peak and each
    phase's peak), and where: what a category limit compares, like with like however the peak
    moved (a peak that moves from the optimizer step to the forward would otherwise compare
    activations already freed with activations at their height)."""

    category: str
    base_bytes: int
    head_bytes: int
    base_at: str  # "peak", or the phase whose peak holds the most of it
    head_at: str


@dataclass
class PhaseDelta:
    """The highest memory of one phase over all steps, base and head."""

    phase: str
    base_peak_bytes: Optional[int]  # None: the run has no such phase
    head_peak_bytes: Optional[int]
    delta_bytes: int


@dataclass
class Kept:
    """Bytes live at the compared moment that were allocated in an earlier step, or by a forward
    that a forward of the same code followed, and are of no category meant to outlive a step
    (classify.PERSISTENT), in both runs, and the rows holding more in head."""

    base_bytes: int
    head_bytes: int
    rows: List[DiffRow]
    base_forward_bytes: int = 0  # of those, kept from earlier forwards in the moment's step
    head_forward_bytes: int = 0
    head_forwards: int = 0  # how many earlier forwards head's come from


@dataclass
class DeviceDiff:
    """One device of both runs, compared at `at` (the peak, or a phase's peak)."""

    device: int
    base_peak_bytes: int
    head_peak_bytes: int
    peak_delta_bytes: int
    base_static_bytes: int
    head_static_bytes: int
    rows: List[DiffRow]
    categories: List[CategoryDelta]
    chart: List[List[Optional[int]]]
    at: str = PEAK
    base_peak_phase: Optional[str] = None
    head_peak_phase: Optional[str] = None
    base_peak_step: Optional[int] = None
    head_peak_step: Optional[int] = None
    base_peak_scope: Optional[str] = None
    head_peak_scope: Optional[str] = None
    phases: List[PhaseDelta] = field(default_factory=list)
    kept: Optional[Kept] = None
    category_highs: List[CategoryHigh] = field(default_factory=list)
    # The caching allocator's side (None: that run has no segments): the highest reserved total
    # and reserved minus allocated at the peak. The gate judges allocated memory unless asked.
    base_reserved_peak_bytes: Optional[int] = None
    head_reserved_peak_bytes: Optional[int] = None
    base_fragmentation_bytes: Optional[int] = None
    head_fragmentation_bytes: Optional[int] = None

    def phases_lost(self) -> List[str]:
        """The training phases (backward, optimizer step) the base runs and the head does not, where
        the head's phases are known: without them a run peaks lower whatever it allocates."""
        if not any(p.head_peak_bytes is not None for p in self.phases):
            return []
        return [p.phase for p in self.phases if p.phase in (BACKWARD, OPTIMIZER)
                and p.base_peak_bytes is not None and p.head_peak_bytes is None]
