"""The fit's result: the answer per GPU and every run behind it (FitResult, GpuFit, FitRun, the Grid searched),
and every number and sentence any of its outputs shows (text, markdown, JSON, the page), worded here once:
each GPU's runs in sentences, the values searched, the table, the page's charts' labels and tooltips.

memdiff.predict.fit searches and builds it, memdiff.predict.fit_gate judges it against a baseline, and the
renderers (render/fit.py, render/fit_html.py) lay it out; this module imports neither.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from memdiff import __version__
from memdiff.errors import InputError
from memdiff.model import Finding, Table
from memdiff.recording.fitrun import FITS, OOM
from memdiff.units import format_bytes

SCHEMA_VERSION = 1
# What the fit searches for: the largest value that fits (a batch), or the fewest (`{nproc}`: each rank holds less
# with more of them).
LARGEST, SMALLEST = "largest", "smallest"
TICKS = 5  # the page's charts: a label at each fifth of each axis
# The grid is a list the search indexes and walks: `--range batch=1:10000000000` would build ten
# billion values before the first run (2**70: an OverflowError). A million is a sequence length of
# 1:1M by ones, about 40 MB.
MAX_GRID_VALUES = 1 << 20


@dataclass(frozen=True)
class Grid:
    """The values a knob may take: the multiples of `multiple` in [low, high], or its powers of two."""

    name: str
    low: int
    high: int
    multiple: int = 1
    pow2: bool = False

    def values(self) -> List[int]:
        """Every value, smallest first; InputError past MAX_GRID_VALUES."""
        if self.pow2:
            return [1 << k for k in range(self.high.bit_length()) if self.low <= 1 << k <= self.high]
        first = -(-self.low // self.multiple) * self.multiple
        count = max(0, (self.high - first) // self.multiple + 1)
        if count > MAX_GRID_VALUES:
            raise InputError("--range", f"{self.describe()} holds {count:,} values, and fit searches at most "
                                        f"{MAX_GRID_VALUES:,}: narrow --range, or give --multiple N or --pow2")
        return list(range(first, self.high + 1, self.multiple))

    def describe(self) -> str:
        """The grid in words: `batch in 1..4096, multiples of 8`."""
        kind = ", powers of two" if self.pow2 else f", multiples of {self.multiple}" if self.multiple > 1 else ""
        return f"{self.name} in {self.low:,}..{self.high:,}{kind}"


@dataclass
class FitRun:
    """One emulated run of the fit: a GPU, a value, how it ended and what it used."""

    gpu: str
    value: int
    outcome: str  # FITS, OOM or OVER_LIMIT
    snapshot: str
    log: str
    peak_bytes: Optional[int]
    reserved_peak_bytes: Optional[int]
    phase: Optional[str]
    step: Optional[int]
    site: Optional[str]
    oom_message: Optional[str]
    seconds: float
    cpu_seconds: float  # the run's process, user and system, the summary of its snapshot included
    why: str  # the probe's reason: "smallest values", "ascending", "forecast", "neighbour", "halving", "doubling"
    # a launched job run as its picked ranks (--ranks auto): those ranks, and the job's size; None: run whole
    ranks_run: Optional[List[int]] = None
    world_size: Optional[int] = None
    ranks_how: Optional[str] = None  # with ranks_run: ONE_PER_ROLE or FIRST_NODE (fitrun.py)

    @property
    def fits(self) -> bool:
        """Whether the value fits."""
        return self.outcome == FITS


@dataclass
class GpuFit:
    """The answer for one GPU: the largest value that fits, its run, and the first run that did not."""

    gpu: str
    name: str
    capacity_bytes: int  # what PyTorch's allocator can reserve there (total memory less the CUDA context)
    limit_bytes: int  # --max-memory's share of it: a run fits when its reserved peak stays within
    value: Optional[int]  # None: not even the smallest value fits
    fits: Optional[FitRun]
    fails: Optional[FitRun]  # the next value up, run; None when the top of the range fits
    headroom_bytes: Optional[int]  # capacity less the fitting run's reserved peak
    runs: List[FitRun]
    forecasts: List[str]  # each forecast made, in words
    line: str  # the answer in one line

    @property
    def details(self) -> List[str]:
        """The GPU's runs in sentences, every format's (gpu_details)."""
        return gpu_details(self)


@dataclass
class FitResult:
    """The whole fit, every number and sentence any output shows."""

    command: List[str]
    knob: str
    grid: Grid
    max_memory: float
    gpus: List[GpuFit]
    runs: int
    seconds: float
    output: str
    findings: List[Finding] = field(default_factory=list)  # the gate's, with a baseline
    baseline: Optional[str] = None
    passed: Optional[bool] = None  # the gate's verdict, with a baseline
    tool: str = f"memdiff {__version__}"
    # LARGEST (a batch: memory grows with it) or SMALLEST ({nproc}: a sharded job's ranks each hold less
    # as there are more of them, so the answer is the fewest processes on which every rank fits)
    direction: str = "largest"

    @property
    def knob_line(self) -> str:
        """The values searched, and what fits under --max-memory (knob_line)."""
        return knob_line(self)

    @property
    def words(self) -> FitWords:
        """The table, the page's charts and the lines around them (fit_words)."""
        return fit_words(self)

    @property
    def verdict_line(self) -> Optional[str]:
        """The gate's verdict as every format says it (`PASS  fit against fit.json`); None without a baseline."""
        if self.passed is None:
            return None
        return f"{'PASS' if self.passed else 'FAIL'}  fit against {self.baseline}"

    def to_dict(self) -> Dict[str, Any]:
        """The JSON document (schemas/fit.schema.json)."""
        return {"schema_version": SCHEMA_VERSION, "kind": "fit", "tool": self.tool, "command": self.command,
                "knob": self.knob, "direction": self.direction, "grid": asdict(self.grid),
                "max_memory": self.max_memory,
                "runs": self.runs, "seconds": round(self.seconds, 2), "output": self.output,
                "gpus": [{**asdict(g), "fits": None if g.fits is None else asdict(g.fits),
                          "fails": None if g.fails is None else asdict(g.fails), "details": g.details}
                         for g in self.gpus],
                "baseline": self.baseline, "passed": self.passed,
                "findings": [f.to_dict() for f in self.findings]}


# ---------------------------------------------------------------- its words


def where(run: Optional[FitRun]) -> str:
    """Where a run's peak fell, in words: `backward, step 1 at AddmmBackward0 <- mm`."""
    if run is None:
        return ""
    parts = [p for p in (run.phase, None if run.step is None else f"step {run.step}") if p]
    return ", ".join(parts) + (f" at {run.site}" if run.site else "")


def gpu_details(g: GpuFit) -> List[str]:
    """A GPU's runs in sentences, every format's: where the fitting and the failing value peak, why the
    failing one failed, each run and why it was tried, and each forecast made."""
    out = []
    if g.fits is not None:
        out.append(f"fits at {g.fits.value:,}: peak in {where(g.fits)}")
    if g.fails is not None:
        f = g.fails
        out.append(f"{f.value:,} does not fit: peak in {where(f)}")
        if f.oom_message:
            out.append(f"  {f.oom_message}")
        elif f.outcome != OOM:
            reserved = "" if f.reserved_peak_bytes is None else format_bytes(f.reserved_peak_bytes)
            out.append(f"  reserved peak {reserved} over the limit {format_bytes(g.limit_bytes)}")
    out.append("runs: " + ", ".join(f"{r.value:,} {r.outcome} ({r.why})" for r in g.runs))
    out += [f"forecast {line}" for line in g.forecasts]
    return out


def knob_line(result: FitResult) -> str:
    """The values searched, and what fits when --max-memory leaves headroom."""
    limit = "" if result.max_memory == 1 else (f"; a value fits when its reserved peak is within "
                                               f"{result.max_memory:g} of the capacity")
    return f"{result.grid.describe()}{limit}"


# ---------------------------------------------------------------- the table and the page


HEADERS = ["gpu", "largest", "allocated peak", "reserved peak", "headroom", "capacity", "first not fitting", "runs"]
# {nproc}: the fewest processes that fit, and the run of one fewer that did not
FEWEST_HEADERS = ["gpu", "fewest", "allocated peak", "reserved peak", "headroom", "capacity", "next down, not fitting",
                  "runs"]


def _bytes(n: Optional[int]) -> str:
    return "" if n is None else format_bytes(n)


@dataclass
class FitWords:
    """The fit's words beside each GPU's: its table, and how the text, the markdown and the page name it."""

    which: str  # `largest`, or `fewest` for {nproc} and the parallel degrees
    table: Table  # one row per GPU: the answer, its peaks, headroom, capacity, the first value not fitting
    table_lead: str  # the markdown's sentence over the table, around the knob: `Largest` {batch} ...
    table_tail: str  # ... `that trains, per emulated GPU (5 runs):`
    runs_said: str  # `5 emulated runs in 12.3 s`
    runs_line: str  # the text's: `5 emulated runs in 12.3 s, snapshots in runs/`
    page_title: str  # `memdiff fit: largest batch that trains`
    charts: List["FitChart"]  # the page's, one per GPU


def fit_words(result: FitResult) -> FitWords:
    """The fit's table and the sentences around it, every format's."""
    fewest = result.direction == SMALLEST
    rows = []
    for g in result.gpus:
        fits, fails = g.fits, g.fails
        rows.append([g.gpu, "none" if g.value is None else f"{g.value:,}", _bytes(fits.peak_bytes if fits else None),
                     _bytes(fits.reserved_peak_bytes if fits else None), _bytes(g.headroom_bytes),
                     format_bytes(g.capacity_bytes), "" if fails is None else f"{fails.value:,} ({fails.outcome})",
                     str(len(g.runs))])
    which = "fewest" if fewest else "largest"
    said = f"{result.runs} emulated runs in {result.seconds:.1f} s"
    return FitWords(which=which, table=Table(FEWEST_HEADERS if fewest else HEADERS, rows, left=[0, 6]),
                    table_lead=which.capitalize(), table_tail=f"that trains, per emulated GPU ({result.runs} runs):",
                    runs_said=said, runs_line=f"{said}, snapshots in {result.output}",
                    page_title=f"memdiff fit: {which} {result.knob} that trains",
                    charts=[gpu_chart(g, result.knob) for g in result.gpus])


@dataclass
class ChartPoint:
    """One run on a GPU's chart, in one series (its allocated or its reserved peak)."""

    value: int
    bytes: int
    outcome: str
    fits: bool
    title: str  # `40: allocated peak 18.44 GiB, fits (halving)`


@dataclass
class FitChart:
    """One GPU's chart on the page and the table under it: the axes' span and labels, the lines' titles,
    the runs as points, each series smallest value first."""

    x_low: int  # the values run, smallest and largest
    x_high: int
    top_bytes: int  # the y axis' top: the capacity or the highest reserved peak, and some room above it
    y_ticks: List[Tuple[int, str]]  # bytes, and their label
    x_ticks: List[Tuple[int, str]]  # values, and their label
    capacity_title: str
    limit_title: Optional[str]  # --max-memory's limit; None when it is the capacity
    found_title: Optional[str]  # the answer's upright line; None when nothing fits
    series: Dict[str, List[ChartPoint]]  # `allocated` and `reserved`
    marks: List[Tuple[int, str]]  # each run that did not fit, and its mark: ✕ out of memory, ! over the limit
    table: Table  # the runs, smallest value first: outcome, peaks, why each was run


def gpu_chart(g: GpuFit, knob: str) -> FitChart:
    """A GPU's chart and runs' table, every figure and label the page shows of them."""
    xs = [r.value for r in g.runs] or [1]
    lo, hi = min(xs), max(xs)
    top = int(max([g.capacity_bytes] + [r.reserved_peak_bytes or 0 for r in g.runs]) * 1.08)
    drawn = sorted((r for r in g.runs if r.peak_bytes is not None), key=lambda r: r.value)
    series = {}
    for name, attr in (("allocated", "peak_bytes"), ("reserved", "reserved_peak_bytes")):
        series[name] = [ChartPoint(r.value, b, r.outcome, r.fits, f"{r.value:,}: {name} peak {format_bytes(b)}, "
                                                                  f"{r.outcome} ({r.why})")
                        for r in drawn if (b := getattr(r, attr)) is not None]
    rows = [[f"{r.value:,}", r.outcome, _bytes(r.peak_bytes), _bytes(r.reserved_peak_bytes), r.why]
            for r in sorted(g.runs, key=lambda r: r.value)]
    return FitChart(
        x_low=lo, x_high=hi, top_bytes=top,
        y_ticks=[(b, format_bytes(b)) for b in (top * k // TICKS for k in range(TICKS + 1))],
        x_ticks=[(v, f"{v:,}") for v in sorted({lo + (hi - lo) * k // TICKS for k in range(TICKS + 1)})],
        capacity_title=f"capacity {format_bytes(g.capacity_bytes)}",
        limit_title=None if g.limit_bytes == g.capacity_bytes else f"--max-memory limit {format_bytes(g.limit_bytes)}",
        found_title=None if g.value is None else f"the answer: {g.value:,}", series=series,
        marks=[(r.value, "✕" if r.outcome == OOM else "!") for r in drawn if not r.fits],
        table=Table([knob, "outcome", "allocated peak", "reserved peak", "why run"], rows))
