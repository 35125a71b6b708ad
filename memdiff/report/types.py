"""What a Report holds: its tables, rows, stacks and checks as shown, and the text of a cell or a
check that every output writes alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from memdiff.compare.differ import DeviceDiff, Diff, DiffRow
from memdiff.compare.judge import Check, FindingCheck, Verdict
from memdiff.compare.observe import PEAK
from memdiff.model import Finding, Frame, Summary, Table
from memdiff.units import change_text, count_of, format_bytes

DEFAULT_TOP = 20
STACK_FRAMES = 16  # frames of a stack any output shows; the rest are counted
SITES_NAMED = 2  # sites the headline names for the category that moved

# The JSON documents' version: bumped when a field changes meaning or disappears.
DIFF_SCHEMA_VERSION = 1
RANKS_SCHEMA_VERSION = 1

# The analysis values a Report carries beside what it shows: the JSON document reads them as
# they are; every other string of a Report is shown, and made one line (inert.text).
ANALYSIS_FIELDS = ("verdict", "results", "diff", "row")

ROW_HEADERS = ["status", "count", "base", "head", "delta", "%", "site"]
PHASE_HEADERS = ["phase peak", "base", "head", "delta", "%"]
CATEGORY_HEADERS = ["category", "base", "head", "delta", "%"]
RANK_HEADERS = ["rank", "device", "base peak", "head peak", "delta", "%", "verdict"]


# --- wording shared by every output ----------------------------------------------------------

def frame_line(f: Frame) -> str:
    """One stack frame as every report prints it: `file:line function`, or a native frame's name."""
    if not f.file:
        return f.name
    return f"{f.file}:{f.line} {f.name}" if f.line else f"{f.file} {f.name}"


def stack_lines(frames: Sequence[Frame], shown: int = STACK_FRAMES) -> List[str]:
    """A stack as every output shows it: its first `shown` frames, then `… 3 more frames` when cut."""
    cut = len(frames) - shown
    return [frame_line(f) for f in frames[:shown]] + ([more_frames(cut)] if cut > 0 else [])


def more_frames(count: int) -> str:
    """`… 3 more frames`: the line that ends a cut stack, in every output."""
    return f"… {count_of(count, 'more frame')}"


def check_line(c: Check) -> str:
    """`FAIL  device 0 peak: 6.53 GiB -> 8.48 GiB, +1.95 GiB (+29.8%), limit: more than 1% and ...`."""
    return (f"{'PASS' if c.passed else 'FAIL'}  {c.subject}: {format_bytes(c.base_bytes)} -> "
            f"{format_bytes(c.head_bytes)}, {change_text(c.base_bytes, c.head_bytes)}, limit: {c.limit}")


def finding_check_line(c: FindingCheck) -> str:
    """`FAIL  finding K004 kept-grows-per-step: device 0: memory kept ... (fails on K004: default)`."""
    return f"FAIL  finding {c.code} {c.name}: {c.text} (fails on {c.code}: {c.source})"


def moment_name(at: str) -> str:
    """`peak`, or `forward peak` when compared at a phase's peak."""
    return "peak" if at == PEAK else f"{at} peak"


# --- what crosses to the renderers -----------------------------------------------------------

@dataclass
class Stack:
    """One group's stack as shown: trimmed to STACK_FRAMES lines, the rest counted."""

    side: str  # "base" or "head"
    count: int
    bytes: int
    signature: str
    lines: List[str]  # the frames shown, without the line that says how many more there are
    more_frames: int

    @property
    def shown(self) -> List[str]:
        """The stack's lines as every output shows them: the frames, then `… 3 more frames` when cut."""
        return self.lines + ([more_frames(self.more_frames)] if self.more_frames else [])

    @property
    def facts(self) -> str:
        """`base: 65 allocations, 1.28 GiB`: whose group it is and what it holds, in every output."""
        return f"{self.side}: {count_of(self.count, 'allocation')}, {format_bytes(self.bytes)}"


@dataclass
class ShownRow:
    """A row of the diff table as every output shows it, and the groups behind it."""

    row: DiffRow
    cells: List[str]  # in ROW_HEADERS order
    title: str  # `GREW linear <- addmm +4.00 MiB`
    stacks: List[Stack]

    @property
    def delta_text(self) -> str:
        """`+4.00 MiB`: the row's signed change, its delta cell."""
        return self.cells[ROW_HEADERS.index("delta")]


@dataclass
class CheckLine:
    """One threshold's result, in words."""

    passed: bool
    text: str
    finding: Optional[str] = None  # the code, when the check is a finding's (`--fail-on`, or by default)


@dataclass
class ChartLine:
    """One run's line of the chart of allocated memory over the trace: its points in the chart's unit."""

    run: str  # "base" or "head"
    points: List[str]  # `1.25`: each stretch of the trace's largest total, in the chart's unit


@dataclass
class Chart:
    """The chart of allocated memory over each run's trace, as every output that draws it words it."""

    title: str  # `Allocated memory over the trace, device 0 (GiB)`
    x_axis: str  # `trace progress (%)`
    unit: str  # GiB, or MiB below 1 GiB
    lines: List[ChartLine]  # the runs that have a timeline, base first
    caption: str  # `Lines, in order: base, head (each point the largest total in its stretch of the trace).`


@dataclass
class DeviceReport:
    """One device of the compared pair, ready to show."""

    device: int
    diff: DeviceDiff
    heading: str  # `device 0: peak 6.53 GiB -> 8.48 GiB (+1.95 GiB, +29.8%); static ...`
    where: Optional[str]  # where each run's peak is
    phases: Optional[Table]
    categories: Optional[Table]
    rows: List[ShownRow]
    others: Optional[List[str]]  # the folded rest's cells
    total: List[str]
    like_for_like: Optional["DeviceReport"] = None  # the same device at one phase's peak in both runs (_moved_phase)
    noise: Optional[str] = None  # where the peak's change falls in a baseline's measured spread over repeats
    noise_within: Optional[str] = None  # `within the spread of 3 runs (...)`, for the headline, when it is
    reserved: Optional[str] = None  # the caching allocator's reserved peak and fragmentation
    findings: List[Finding] = field(default_factory=list)  # what the report adds (A001 reserved moved, G001 noise)
    chart: Optional[Chart] = None  # allocated memory over each run's trace; None when neither has a timeline

    @property
    def lines(self) -> List[str]:
        """The device's sentences under its heading, in order: where the peaks are, measured noise,
        reserved memory (kept memory is a finding: K002)."""
        return [line for line in (self.where, self.noise, self.reserved) if line]


@dataclass
class Input:
    """One side of the comparison: its file and what it is."""

    role: str  # "base" or "head"
    file: str
    facts: str  # `pickle, format 2.x, sha256 1a2b3c4d5e6f`

    def label_shown(self, label: Optional[str]) -> Optional[str]:
        """The label to show beside the file (a commit, `--base-label`); None without one, or when the
        file already says it (a baseline's file reads `baseline NAME (file)`: it would be said twice)."""
        return label if label and not self.file.startswith(label) else None


@dataclass
class RankResult:
    """One rank of both jobs (or the one pair of a run), compared and judged."""

    rank: Optional[int]
    diff: Diff
    verdict: Optional[Verdict]
    base: Summary
    head: Summary

    @property
    def peak_delta_bytes(self) -> int:
        """The largest peak change over the pair's devices (growth before shrinkage)."""
        return max((d.peak_delta_bytes for d in self.diff.devices), default=0)


@dataclass
class JobPart:
    """What a job adds to the worst rank's report: the verdict over ranks, a line per rank, and
    the failing checks of the ranks not shown in full."""

    summary_line: str  # `FAIL: 4 ranks compared, failing: 1, 3`
    table: Table
    worst_rank: int
    other_failures: List[str]
    only_base: List[int]
    only_head: List[int]
    failures: List[Finding]  # why the job fails beyond its ranks' checks (G005, G006)

    @property
    def worst_line(self) -> str:
        """`worst rank: 3, shown in full`: which rank the report shows, in every format."""
        return f"worst rank: {self.worst_rank}, shown in full"
