"""fit: the largest value of a knob (batch size, sequence length) whose emulated run trains on each GPU.

`memdiff fit --emulate h100,l4 -o runs/ -- python train.py --batch-size {batch}` runs the unmodified
script on each emulated GPU (memdiff.recording.fitrun: the machinery of `memdiff record --emulate`, one
fresh process per run) at as few values as it can:

1. the two smallest values of the grid (the range, a multiple, or powers of two);
2. the forecast (memdiff.predict.forecast.engine) of the runs that fit gives the largest value whose peak, times
   the allocator's overhead, stays within the limit: that value is run, then its neighbour on the
   grid (the next one up when it fit, the next one down when it did not);
3. when the neighbour does not close the boundary (the forecast was off), the forecast is made again
   with the runs that fit since, and where it gives nothing new the interval is halved (doubled while
   nothing has failed yet);
4. never more than bisection's runs plus GUIDED_RUNS: a value that would leave more than the runs left
   can halve is moved to the nearest one that does not (Search._bounded).

A value fits when its run ends with status 0 without the emulated GPU running out of memory and,
under `--max-memory F`, its reserved peak (what the caching allocator holds: what runs out) stays
within F of the GPU's capacity. Every run is real: the answer is the largest value that was run and
fit, next to a value one grid step up that was run and did not. A run that fails for another reason
stops the fit (exit 2, with its output's last lines): it is never taken for out of memory.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import time
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from memdiff.atomic import make_folder
from memdiff.errors import InputError, clip
from memdiff.inert import text
from memdiff.numbers import whole_number
from memdiff.predict.fit_notes import LONG_RUN_S, failed_above, long_run
from memdiff.predict.fit_result import LARGEST, SMALLEST, FitResult, FitRun, GpuFit, Grid
from memdiff.recording.emulate.gpus import Gpu
from memdiff.recording.fit_lightning import WHOLE_JOB_RANKS as WHOLE_JOB_RANKS  # which launched jobs run whole
from memdiff.recording.fit_lightning import splits
from memdiff.recording.fitrun import FIRST_NODE, FITS, OOM, checked, child, finished, launched_child, stop
from memdiff.units import format_bytes

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
DEFAULT_RANGE = (1, 4096)
OVER_LIMIT = "over-limit"  # ran, but its reserved peak passed --max-memory's share of the GPU
# Why a value is run: the forecast's boundary, or a value below it that measures the allocator's overhead there.
FORECAST, BELOW = "forecast", "below the boundary"
MARGIN = 0.9
# The runs a forecast-guided search may make beyond what bisection over the grid needs: a forecast's value
# below the boundary, the forecast's own and its neighbour, and a step from it (docs/fit.md: 6 runs on the
# MLP and on the 1B Llama's H100) all go where the forecast puts them before the cap moves any.
GUIDED_RUNS = 4
# `{nproc}`: the processes a launcher starts (`torchrun --nproc-per-node {nproc}`), searched for the fewest
# that fit, over one node's GPUs unless --range says otherwise. `{nodes}` (`--nnodes {nodes}`) and the
# parallel degrees `{tp}`, `{pp}`, `{dp}` are searched so too: each rank holds less with more of them.
NPROC, NODES = "nproc", "nodes"
FEWEST_KNOBS = (NPROC, NODES, "tp", "pp", "dp")
FEWEST_RANGE = (1, 8)


# ---------------------------------------------------------------- the command and its knob


def knob_of(command: Sequence[str], ranges: Dict[str, Tuple[int, int]]) -> str:
    """The one placeholder the command carries (`{batch}`), the others fixed by --set; InputError when it has
    none or several, or when a --range names another."""
    names = sorted({m for arg in command for m in PLACEHOLDER.findall(arg)})
    if not names:
        raise InputError("fit", "the command has no placeholder: put the knob where its value goes, e.g. "
                                "`-- python train.py --batch-size {batch}`")
    if len(names) > 1:
        raise InputError("fit", f"the command has {len(names)} placeholders ({', '.join(names)}): fit searches one: "
                                f"fix the others with --set NAME=VALUE (--set {names[1]}=8)")
    for name in ranges:
        if name != names[0]:
            raise InputError("--range", f"names {clip(name)!r}, and the command's placeholder is {{{names[0]}}}")
    return names[0]


def with_value(command: Sequence[str], knob: str, value: int) -> List[str]:
    """The command with the placeholder replaced by `value`."""
    return [arg.replace("{" + knob + "}", str(value)) for arg in command]


def parse_set(text_: str) -> Tuple[str, int]:
    """`tp=8` -> ("tp", 8): a placeholder fit does not search, fixed; InputError when it is not that."""
    name, sep, value = text_.partition("=")
    try:
        number = whole_number(value)
    except ValueError:
        number = 0
    if not sep or not PLACEHOLDER.fullmatch("{" + name + "}") or number < 1:
        raise InputError("--set", f"{clip(text_)!r}: give NAME=VALUE with VALUE a whole number >= 1 (tp=8)")
    return name, number


def fixed(command: Sequence[str], values: Dict[str, int], flag: str = "--set") -> List[str]:
    """The command with each placeholder of `values` replaced by its value; InputError (`flag`'s) for one
    the command does not carry."""
    for name, value in values.items():
        if not any("{" + name + "}" in arg for arg in command):
            raise InputError(flag, f"the command has no {{{clip(name)}}} to put {value} in")
        command = with_value(command, name, value)
    return list(command)


def parse_range(text_: str) -> Tuple[str, Tuple[int, int]]:
    """`batch=1:4096` -> ("batch", (1, 4096)); InputError when it is not that."""
    name, sep, span = text_.partition("=")
    low, colon, high = span.partition(":")
    try:
        lo, hi = whole_number(low), whole_number(high)
    except ValueError:
        lo = hi = 0
    if not sep or not colon or not PLACEHOLDER.fullmatch("{" + name + "}") or not 1 <= lo <= hi:
        raise InputError("--range", f"{clip(text_)!r}: give NAME=LOW:HIGH with 1 <= LOW <= HIGH (batch=1:4096)")
    return name, (lo, hi)


# ---------------------------------------------------------------- the search on one GPU


class Search:
    """The runs of one GPU, and which value to run next."""

    def __init__(self, gpu: Gpu, grid: Grid, max_memory: float, forecast_rules: Any) -> None:
        self.gpu = gpu
        self.values = grid.values()
        if not self.values:
            raise InputError("--range", f"{grid.describe()} holds no value")
        self.limit = int(max_memory * gpu.capacity)
        self.rules = forecast_rules
        self.runs: Dict[int, FitRun] = {}  # by grid index
        self.running: Dict[int, str] = {}  # grid index -> why it runs
        self.forecasts: List[str] = []
        self._forecast_of: Optional[Tuple[int, ...]] = None  # the fitting runs the last forecast used
        self._last: Optional[Tuple[int, str]] = None  # the last probe and why
        self._steps: Optional[Tuple[int, int, int]] = None  # stepping from a forecast: (index, direction, step)
        self._wanted: Optional[List[Tuple[int, str]]] = None  # what wants() decided in this state
        # The most runs the search makes: the two smallest values, bisection over the rest, and GUIDED_RUNS.
        self.budget = min(2, len(self.values)) + (len(self.values) - 1).bit_length() + GUIDED_RUNS

    def _lo_hi(self) -> Tuple[int, int]:
        """(the largest index that fits, or -1; the smallest that does not, or len(values))."""
        lo = max((i for i, r in self.runs.items() if r.fits), default=-1)
        hi = min((i for i, r in self.runs.items() if not r.fits), default=len(self.values))
        return lo, hi

    @property
    def done(self) -> bool:
        """Whether the boundary is found: the largest fitting value's next one was run and did not fit
        (or it is the top of the range), or the smallest does not fit."""
        lo, hi = self._lo_hi()
        return hi == lo + 1 and not self.running

    def wants(self) -> List[Tuple[int, str]]:
        """The values to run now, each with why (none while the ones running decide the next). Decided once
        per state of the search: asked again before a run starts or ends, it answers the same."""
        if self._wanted is None:
            self._wanted = self._decide()
        return [w for w in self._wanted if w[0] not in self.running and w[0] not in self.runs]

    def _decide(self) -> List[Tuple[int, str]]:
        smallest = [i for i in range(min(2, len(self.values))) if i not in self.runs]
        if smallest:  # run together: neither decides the other (unless the smallest fails, then one is spare)
            return [(i, "smallest values") for i in smallest if i not in self.running]
        if self.running or self.done:
            return []
        lo, hi = self._lo_hi()
        if lo >= hi:
            raise InputError("fit", f"{self.gpu.key}: {self.values[lo]:,} fits and {self.values[hi]:,}, smaller, "
                                    "does not: memory does not grow with the knob, so there is no largest value")
        return [self._bounded(*self._next(lo, hi), lo, hi)]

    def _bounded(self, index: int, why: str, lo: int, hi: int) -> Tuple[int, str]:
        """`index`, or the index nearest it from which bisection still ends within the runs' budget.

        A guided probe (a forecast, a step from one) that lands far from the boundary leaves most of the
        interval: unchecked, a flat, noisy forecast line made 26 runs on a 4,096-value grid that bisection
        closes in 14. So the runs are capped as bisection's are, plus GUIDED_RUNS: with `left` runs left of
        the budget, a probe may leave at most 2**(left - 1) indices on either side of it, the interval
        bisection can still close with the runs left after it (the midpoint always may). A probe outside
        that window is moved to its nearest edge, which leaves at most half of what the runs left allow."""
        left = self.budget - len(self.runs)
        reach = 1 << max(0, left - 1)
        first, last = max(lo + 1, hi - reach), min(hi - 1, lo + reach)
        if first <= index <= last:
            return index, why
        self._steps = None  # the steps from a forecast's value went too far: they stop here
        return min(max(index, first), last), "halving"

    def _next(self, lo: int, hi: int) -> Tuple[int, str]:
        last = self._last
        if last is not None and last[1] == FORECAST:
            # From the forecast's value, steps of 1, 2, 4 ... toward the boundary, until one lands past it.
            self._steps = (last[0], 1 if self.runs[last[0]].fits else -1, 1)
        if self._steps is not None:
            start, direction, size = self._steps
            self._steps = (start, direction, 2 * size)
            index = start + direction * size
            if lo < index < hi:
                return index, "neighbour" if size == 1 else "stepping"
            self._steps = None
        guess = self._forecast(lo)
        if guess is not None and lo < guess[0] < hi and guess[0] not in self.runs:
            return guess
        if hi == len(self.values):  # nothing failed yet: double the value
            target = 2 * self.values[lo]
            index = next((i for i in range(lo + 1, hi) if self.values[i] >= target), hi - 1)
            return index, "doubling"
        return (lo + hi) // 2, "halving"

    def _forecast(self, lo: int) -> Optional[Tuple[int, str]]:
        """The grid index the forecast of the fitting runs puts at the boundary, and why; None with fewer
        than two fitting runs, no new one since the last forecast, or runs that are not one loop.

        The forecast predicts the allocated peak; what runs out is the reserved one, and the caching
        allocator's overhead (reserved over allocated) grows with the tensors' sizes. So it is taken as
        the fitting runs measured it, followed along the line through the two largest; and while the
        largest is far from the limit (under half of it), the forecast aims at MARGIN of the limit: a
        run just below the boundary, whose overhead is the boundary's, for the next one to aim at the
        limit itself. From a forecast's value the runs step toward the boundary by 1, 2, 4, ...
        """
        from memdiff.predict.forecast.course import KnobRun, read_courses

        fitting = tuple(sorted(i for i, r in self.runs.items() if r.fits))[-3:]
        if len(fitting) < 2 or fitting == self._forecast_of:
            return None
        self._forecast_of = fitting
        largest_run = self.runs[lo]
        measured = [(self.values[i], self.runs[i].reserved_peak_bytes, self.runs[i].peak_bytes) for i in fitting]
        ratios = [(value, reserved / peak) for value, reserved, peak in measured if reserved and peak]
        near = (largest_run.reserved_peak_bytes or 0) >= self.limit / 2
        share, why = (1.0, FORECAST) if near else (MARGIN, BELOW)
        aim = int(self.limit * share)
        named = self._named(fitting)
        courses = read_courses([KnobRun(self.runs[i].snapshot, self.values[i]) for i in fitting], self.rules)
        while True:
            try:
                largest = self._within(courses, ratios, aim, lo)
                break
            except InputError as exc:
                # A batch of 1 often takes other paths (Hugging Face's Llama lines up 45% of its allocations
                # with batch 2's): the smallest run is left out while two remain.
                if len(courses) <= 2:
                    self.forecasts.append(f"from {named}: none ({exc.message})")
                    return None
                courses = courses[1:]
                named = ", ".join(f"{c.value:,}" for c in courses)
        within = f"within {format_bytes(aim)}" + ("" if near else f" ({MARGIN:g} of the limit: {why})")
        if largest is None:
            self.forecasts.append(f"from {named}: not even 1 {within}")
            return None
        index = max((i for i, v in enumerate(self.values) if v <= largest), default=-1)
        if largest > self.values[-1]:  # the forecast is past the range: its top is run, for what it is
            why = "largest value"
        self.forecasts.append(f"from {named}: {largest:,} {within}, the peak times {_ratio_at(ratios, largest):.3f} "
                              f"(the runs' reserved over allocated, followed along the value)")
        return (index, why) if index >= 0 else None

    def _within(self, courses: List[Any], ratios: List[Tuple[int, float]], aim: int, lo: int) -> Optional[int]:
        """The largest value whose forecast peak, times the overhead at that value, stays within `aim`."""
        from memdiff.predict.forecast.engine import forecast_courses

        # forecast_courses compares the peak times its own overhead estimate with the budget: the budget
        # given makes that the peak times the overhead the runs measured within `aim`.
        overhead = forecast_courses(courses, [self.values[lo]]).overhead_ratio
        largest: Optional[int] = self.values[lo]
        for _ in range(3):  # the overhead at the value found, then the value under that overhead
            ratio = _ratio_at(ratios, largest or 1)
            result = forecast_courses(courses, [self.values[lo]], budget=int(aim * overhead / ratio))
            found = min((d.max_value_within_budget for d in result.devices), key=lambda v: -1 if v is None else v)
            if found == largest:
                break
            largest = found
        return largest

    def _named(self, indices: Sequence[int]) -> str:
        return ", ".join(f"{self.values[i]:,}" for i in indices)

    def started(self, index: int, why: str) -> None:
        """A run of `index` was started."""
        self.running[index] = why
        self._last = (index, why)
        self._wanted = None

    def finished(self, index: int, run: FitRun) -> None:
        """The run of `index` ended (fitting or not)."""
        del self.running[index]
        self.runs[index] = run
        self._wanted = None

    # How the answer reads: the value found, the end of the range that fits nothing, per what, and when the
    # other end fits too.
    FOUND, FIRST, PER, OPEN_END = "largest", 0, "", "the top of the range fits"

    def _ends(self) -> Tuple[Optional[FitRun], Optional[FitRun]]:
        """(the answer's run, that fits; the next value's run, that does not), either None where not run."""
        lo, hi = self._lo_hi()
        return self.runs.get(lo), self.runs.get(hi)

    def answer(self) -> GpuFit:
        """The GPU's answer, once done."""
        fits, fails = self._ends()
        key = self.gpu.key
        if fits is None:
            assert fails is not None
            line = f"{key}: does not fit at {self.values[self.FIRST]:,}: {self._why_not(fails)}"
        else:
            headroom = self.gpu.capacity - (fits.reserved_peak_bytes or 0)
            line = (f"{key}: {self.FOUND} {fits.value:,}, reserved peak "
                    f"{format_bytes(fits.reserved_peak_bytes or 0)} of {format_bytes(self.gpu.capacity)}{self.PER} "
                    f"({format_bytes(headroom)} headroom); "
                    + (f"{fails.value:,} {self._why_not(fails)}" if fails is not None else self.OPEN_END))
        line += _ranks_said(fits or fails)
        return GpuFit(gpu=key, name=self.gpu.name, capacity_bytes=self.gpu.capacity, limit_bytes=self.limit,
                      value=None if fits is None else fits.value, fits=fits, fails=fails,
                      headroom_bytes=None if fits is None else self.gpu.capacity - (fits.reserved_peak_bytes or 0),
                      runs=sorted(self.runs.values(), key=lambda r: r.value), forecasts=self.forecasts, line=text(line))

    def _why_not(self, run: FitRun) -> str:
        if run.outcome == OOM:
            return "runs out of memory"
        return (f"reserves {format_bytes(run.reserved_peak_bytes or 0)}, over the limit "
                f"{format_bytes(self.limit)}")


class Fewest(Search):
    """The runs of one GPU for `{nproc}` (or `{nodes}`, `{tp}`, `{pp}`, `{dp}`): the fewest processes on which
    every rank fits. The values are run
    from the smallest up, one at a time, and the first that fits is the answer, next to the value one grid
    step down, run, that did not. Nothing is assumed of how memory moves with the processes: a sharded job
    holds less per rank with more ranks only once its sharded state outweighs what every rank holds whole
    (the allocator's rounding, the cuBLAS workspace, a model built whole before it is sharded), so a
    bisection could skip the fewest, and a forecast, which fits memory that grows with its knob, does not
    apply."""

    FOUND, FIRST, PER, OPEN_END = "fewest", -1, " per rank", "the bottom of the range fits"

    def _lo_hi(self) -> Tuple[int, int]:
        """(the largest index run below the first that fits, or -1; the first that fits, or len(values))."""
        hi = min((i for i, r in self.runs.items() if r.fits), default=len(self.values))
        lo = max((i for i in self.runs if i < hi), default=-1)
        return lo, hi

    @property
    def done(self) -> bool:
        """Whether the fewest is found: a value fits (every smaller one was run and did not), or every value
        was run and none fits."""
        lo, hi = self._lo_hi()
        return not self.running and (hi < len(self.values) or lo == len(self.values) - 1)

    def _decide(self) -> List[Tuple[int, str]]:
        if self.running or self.done:
            return []
        lo, _ = self._lo_hi()
        return [(lo + 1, "ascending")]

    def _ends(self) -> Tuple[Optional[FitRun], Optional[FitRun]]:
        """(the fewest processes' run, that fits; the run of one fewer, that does not; with none fitting,
        the largest value's)."""
        lo, hi = self._lo_hi()
        return self.runs.get(hi), self.runs.get(lo)


def _ranks_said(run: Optional[FitRun]) -> str:
    """`; ran ranks 0, 3 of 4, the others not run` for a launched job run as its picked ranks; "" otherwise."""
    if run is None or run.ranks_run is None or run.world_size is None:
        return ""
    from memdiff.read.job import ranges

    if run.ranks_how == FIRST_NODE:
        return (f"; at {run.value:,} ran ranks {ranges(run.ranks_run)} of {run.world_size:,} (its first node's, "
                f"which its Lightning launcher starts here), the other nodes' not run")
    if len(run.ranks_run) == run.world_size:  # every role is a rank of its own: none was left out
        return f"; at {run.value:,} ran each of its {run.world_size:,} ranks alone (--ranks auto)"
    return (f"; at {run.value:,} ran ranks {ranges(run.ranks_run)} of {run.world_size:,} (one per role, "
            f"--ranks auto), the others not run")


def _ratio_at(ratios: Sequence[Tuple[int, float]], value: int) -> float:
    """Reserved over allocated at `value`, on the line through the two largest runs' (never below the
    largest run's: the overhead is not assumed to shrink); 1 without runs."""
    if not ratios:
        return 1.0
    if len(ratios) == 1 or ratios[-1][0] == ratios[-2][0]:
        return ratios[-1][1]
    (v0, r0), (v1, r1) = ratios[-2], ratios[-1]
    return max(r1, r1 + (r1 - r0) * (value - v1) / (v1 - v0))


# ---------------------------------------------------------------- running


@dataclass
class _Running:
    search: Search
    index: int
    why: str
    process: Any
    conn: Any
    snapshot: str
    log: str
    started: float


def _target(command: Sequence[str]) -> List[str]:
    from memdiff.commands.record import _target as checked

    return checked(list(command))


LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")


def is_launched(command: Sequence[str]) -> bool:
    """Whether the command starts a job of its own processes (`torchrun ...`, `python -m
    torch.distributed.run ...`), each recorded as `memdiff record -o DIR/` records a launcher's, rather
    than one script run in fit's own process."""
    from memdiff.commands.record import PYTHON

    first = os.path.basename(command[0]) if command else ""
    if PYTHON.match(first):
        return len(command) > 2 and command[1] == "-m" and command[2] in LAUNCHERS
    return bool(command) and not first.endswith(".py") and first != "-m"


def runs_picked_ranks(command: Sequence[str], knob: str) -> bool:
    """Whether fit runs a launched job (`command`, its knob's value put in) as the ranks `memdiff record
    --ranks auto` picks rather than whole: always while `{nodes}` is searched (every value then runs alike),
    and for a job of several nodes (which one machine cannot start whole) or of more than WHOLE_JOB_RANKS
    ranks; a torchrun, accelerate or deepspeed command only (the launchers --ranks reads from the command
    alone: a script whose Lightning launcher starts its ranks runs in a process of its own, as any script,
    and is split where the launcher would start them: fit_lightning.py)."""
    from memdiff.recording.launchers import read_launch

    try:
        launch = read_launch(list(command))
    except InputError:  # another launcher, or a job --ranks cannot split (one process): run whole, as before
        return False
    return splits(knob, launch.nnodes, launch.world_size)


def _outcome(r: _Running, sent: Optional[Dict[str, Any]], limit: int, value: int, knob: str) -> FitRun:
    """The run's FitRun, or InputError when it failed for another reason than memory (never read as OOM;
    where smaller values fit, it names the --range below the value that failed)."""
    gpu = r.search.gpu.key
    hint = failed_above(gpu, knob, value, [run.value for run in r.search.runs.values()
                                                               if run.fits])
    sent = checked("fit", f"on {gpu} at {knob} {value:,}", sent, r.process.exitcode, r.log, hint)
    outcome = sent["status"]
    if outcome == FITS and sent["reserved_peak_bytes"] is not None and sent["reserved_peak_bytes"] > limit:
        outcome = OVER_LIMIT
    return FitRun(gpu=gpu, value=value, outcome=outcome, snapshot=sent.get("folder") or r.snapshot, log=r.log,
                  peak_bytes=sent["peak_bytes"], reserved_peak_bytes=sent["reserved_peak_bytes"],
                  phase=sent["phase"], step=sent["step"], site=sent["site"], oom_message=sent["oom_message"],
                  seconds=round(sent["seconds"], 2), cpu_seconds=round(sent["cpu_seconds"], 2), why=r.why,
                  ranks_run=sent.get("ranks_run"), world_size=sent.get("world_size"), ranks_how=sent.get("ranks_how"))


def run_fit(command: Sequence[str], gpus: Sequence[Gpu], output: str, grid: Grid, max_memory: float,
            rules: Any, jobs: int, max_entries: int = 1_000_000, say: Callable[[str], None] = lambda _: None,
            long_run_s: float = LONG_RUN_S) -> FitResult:
    """Search each GPU's largest value, running up to `jobs` emulated runs at a time; every snapshot is
    kept in `output` as GPU-NAMEVALUE.pickle, with the script's output as GPU-NAMEVALUE.log. The first run
    that takes `long_run_s` or more is told to `say`, with how to keep runs short."""
    if not 0 < max_memory <= 1:
        raise InputError("--max-memory", f"{max_memory:g} is not a share of the GPU: give a number in (0, 1]")
    command = list(command[1:] if command and command[0] == "--" else command)
    launched = is_launched(command)
    if launched:
        from memdiff.commands.record import _launched

        _launched(with_value(command, grid.name, grid.values()[0] if grid.values() else 1))
    else:
        _target(with_value(command, grid.name, grid.values()[0] if grid.values() else 1))
    # A file, or a folder that cannot be made or written, is the user's mistake, said before any run.
    make_folder(output)
    kind = Fewest if grid.name in FEWEST_KNOBS else Search
    searches = [kind(g, grid, max_memory, rules) for g in gpus]
    context = multiprocessing.get_context("forkserver")
    # The server imports torch once; each run is forked from it with nothing of the script loaded.
    context.set_forkserver_preload(["torch", "memdiff.recording.fitrun", "memdiff.recording.emulate.runtime"])
    running: List[_Running] = []
    started = time.monotonic()
    total = 0
    told = False
    try:
        while True:
            # Turns over the GPUs, the one with the fewest runs first: each has a run going as soon as a job is free.
            order = sorted(searches, key=lambda s: len(s.runs) + len(s.running))
            wanted = [[(s, index, why) for index, why in s.wants()] for s in order]
            queue = [w for turn in zip_longest(*wanted) for w in turn if w is not None]
            for s, index, why in queue[:max(0, jobs - len(running))]:
                value = s.values[index]
                name = f"{s.gpu.key}-{grid.name}{value}"
                snapshot, log = os.path.join(output, name + ".pickle"), os.path.join(output, name + ".log")
                ours, theirs = context.Pipe(duplex=False)
                if launched:  # the job's rank snapshots go to a folder of their own: GPU-NAMEVALUE/rank0.pickle
                    snapshot = os.path.join(output, name)
                    job = with_value(command, grid.name, value)
                    process = context.Process(target=launched_child, args=(
                        theirs, s.gpu.key, job, snapshot, log, max_entries, rules,
                        runs_picked_ranks(job, grid.name)), daemon=True)
                else:
                    target = _target(with_value(command, grid.name, value))
                    # Not a daemon: a script's DataLoader workers are its children, which a daemonic process
                    # may not start (minGPT's trainer has 4); `stop` ends the runs still going.
                    process = context.Process(target=child, args=(theirs, s.gpu.key, target, snapshot, log,
                                                                  max_entries, rules, None, grid.name), daemon=False)
                process.start()
                theirs.close()
                s.started(index, why)
                running.append(_Running(s, index, why, process, ours, snapshot, log, time.monotonic()))
                total += 1
            if not running:
                break
            for r, sent in finished(running):
                running.remove(r)
                value = r.search.values[r.index]
                r.search.finished(r.index, _outcome(r, sent, r.search.limit, value, grid.name))
                if sent is not None and not told and sent["seconds"] >= long_run_s:
                    say(long_run(r.search.gpu.key, grid.name, value, sent, r.log))
                    told = True
    finally:  # a failed run or Ctrl-C: the runs still going write what they recorded
        stop([r.process for r in running])
    return FitResult(command=command, knob=grid.name, grid=grid, max_memory=max_memory,
                     gpus=[s.answer() for s in searches], runs=total, seconds=time.monotonic() - started,
                     output=output, direction=SMALLEST if grid.name in FEWEST_KNOBS else LARGEST)
