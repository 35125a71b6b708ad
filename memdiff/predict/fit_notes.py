"""What `memdiff fit` says, every sentence and cell its outputs show (text, markdown, JSON, the page): each
GPU's runs in sentences, the values searched, the table, the page's charts' labels; and what it tells a user
whose script is a public one, written for a real GPU: how to keep each run short, and where to search when
the script stops working at large values for another reason than memory.

Each value the fit tries is the whole script, run once: a script that trains for thousands of steps or
evaluates on hundreds of batches (nanoGPT's `train_shakespeare_char` config: `eval_iters = 200`, 38.6 s a
run where `--eval_iters=2` takes 4 s) makes a fit of some twenty runs take a quarter of an hour, while the
peak of a training step shows within its first steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from memdiff.model import Table
from memdiff.recording.fitrun import OOM
from memdiff.units import format_bytes

if TYPE_CHECKING:  # fit.py imports this module: its types are named for the checker only
    from memdiff.predict.fit import FitResult, FitRun, GpuFit

# A run longer than this is worth a word: the fit's own scenario and the public scripts the project ran
# with few steps take 3.5 to 8 s a run on the shared 2-core machine (docs/fit.md, "On public scripts").
LONG_RUN_S = 20.0
# What the fit searches for: the largest value that fits (a batch), or the fewest (`{nproc}`: each rank holds less
# with more of them).
LARGEST, SMALLEST = "largest", "smallest"
TICKS = 5  # the page's charts: a label at each fifth of each axis


def long_run(gpu: str, knob: str, value: int, sent: Dict[str, Any], log: str) -> str:
    """The note said once when a run took LONG_RUN_S or more: how long, how many steps it held, and what
    to pass the script."""
    steps, at = sent.get("steps"), sent.get("step")
    held = ""
    if steps:
        held = f", {steps:,} training step{'s' if steps != 1 else ''}" + (
            f", its peak in step {at:,}" if at is not None else "")
    return (f"fit: the run of {gpu} at {knob} {value:,} took {sent['seconds']:.1f} s{held}; the fit runs the "
            f"whole script once per value it tries (often 5 to 15 per GPU): pass the script's own flags for a "
            f"few steps and a short evaluation, as a step's peak shows in the first steps (its output: {log})")


def failed_above(gpu: str, knob: str, value: int, fitting: Sequence[int]) -> str:
    """The clause a failure for another reason than memory carries when smaller values ran and fit: the
    largest of them, and the --range between it and the value that failed (a script whose data runs out at
    large batches, or that refuses them, fails there and not for lack of memory: the fit stops, as a
    failure is never taken for out of memory, and the range lets it search where the script runs)."""
    below = [v for v in fitting if v < value]
    if not below:
        return ""
    return (f"{gpu} trained at {knob} {max(below):,}: to search below {value:,}, give "
            f"--range {knob}={max(below)}:{value - 1}; ")


def where(run: Optional["FitRun"]) -> str:
    """Where a run's peak fell, in words: `backward, step 1 at AddmmBackward0 <- mm`."""
    if run is None:
        return ""
    parts = [p for p in (run.phase, None if run.step is None else f"step {run.step}") if p]
    return ", ".join(parts) + (f" at {run.site}" if run.site else "")


def gpu_details(g: "GpuFit") -> List[str]:
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
        elif f.outcome != "oom":
            reserved = "" if f.reserved_peak_bytes is None else format_bytes(f.reserved_peak_bytes)
            out.append(f"  reserved peak {reserved} over the limit {format_bytes(g.limit_bytes)}")
    out.append("runs: " + ", ".join(f"{r.value:,} {r.outcome} ({r.why})" for r in g.runs))
    out += [f"forecast {line}" for line in g.forecasts]
    return out


def knob_line(result: "FitResult") -> str:
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


def fit_words(result: "FitResult") -> FitWords:
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


def gpu_chart(g: "GpuFit", knob: str) -> FitChart:
    """A GPU's chart and runs' table, every figure and label the page shows of them."""
    xs = [r.value for r in g.runs] or [1]
    lo, hi = min(xs), max(xs)
    top = int(max([g.capacity_bytes] + [r.reserved_peak_bytes or 0 for r in g.runs]) * 1.08)
    drawn = sorted((r for r in g.runs if r.peak_bytes is not None), key=lambda r: r.value)
    series = {}
    for name, field in (("allocated", "peak_bytes"), ("reserved", "reserved_peak_bytes")):
        series[name] = [ChartPoint(r.value, b, r.outcome, r.fits, f"{r.value:,}: {name} peak {format_bytes(b)}, "
                                                                  f"{r.outcome} ({r.why})")
                        for r in drawn if (b := getattr(r, field)) is not None]
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
