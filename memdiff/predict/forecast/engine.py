"""forecast: from a few runs of one loop that differ in one knob, memory at a value not run.

Runs of the same loop at different batch sizes or sequence lengths record the same allocations
in the same order; only their sizes differ, and a tensor's size is an exact polynomial of the
knob (constant for weights and optimizer state, linear for what scales with the batch,
quadratic for attention scores over the sequence). So the forecast

1. reads every allocation of each run (`Course`: start and end event, size, stack, category);
2. lines the runs' allocations up with the run of the largest value (`Alignment`): one for one
   when their stack sequences are equal, else by the longest matching runs of stacks (a run at
   batch 1 may skip a copy the others make); runs whose allocations mostly do not line up, or
   that differ in devices, steps or weights, are not one loop and are refused;
3. fits each allocation's size with the simplest exact form its runs support (`Fit`): constant,
   linear, quadratic, or none (then the quadratic through its three largest values is used
   and the report says how many bytes fit no form);
4. replays the largest run's events with the sizes predicted at the requested value, so the
   whole course of memory is rebuilt and the peak may land in another phase than in any run.

Leave-one-out (each run predicted from the others) says how far to trust it. Nothing here
imports torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from memdiff import __version__
from memdiff.analyse.classify import Rule
from memdiff.compare.findings import finding
from memdiff.compare.limits import Headroom
from memdiff.compare.observe import where_text
from memdiff.errors import InputError
from memdiff.inert import scrubbed, text
from memdiff.model import Finding, PhaseSpan, Step, Table
from memdiff.predict.forecast.align import _lined_up, align, check_one_loop
from memdiff.predict.forecast.course import MAX_VALUE, Course, DeviceCourse, KnobRun, _shown, read_courses, structure
from memdiff.predict.forecast.replay import peak_of, replay, replay_course
from memdiff.predict.overhead import budget_note, device_overhead
from memdiff.read.load import MAX_BYTES
from memdiff.read.window import Window
from memdiff.units import count_of, format_bytes

SCHEMA_VERSION = 1
FORMS = ("constant", "linear", "quadratic", "none")
# Below this share of the largest run's allocations lined up in another run, the runs are not one loop.
MIN_ALIGNED = 0.6
TOP_SITES = 5
# A site whose bytes grew between the two largest runs as the knob to this power or more grew faster than any
# line through its sizes allows with a non-negative constant (a line through zero is the power 1): a size
# rounded to the allocator's 512-byte blocks moves the power of a linear one by far less.
FASTER_THAN_LINEAR = 1.1


@dataclass
class Fit:
    """The fitted size of each allocation of the reference run: `form[k]` indexes FORMS and
    `coef[k]` are (c0, c1, c2) with size(x) = c0 + c1 x + c2 x^2."""

    form: np.ndarray
    coef: np.ndarray

    def at(self, value: float) -> np.ndarray:
        """Predicted sizes at `value`, rounded to bytes, never below 0."""
        x = float(value)
        sizes = self.coef[:, 0] + self.coef[:, 1] * x + self.coef[:, 2] * x * x
        # Far from the runs a size can pass any device: capped so that sums stay inside int64
        # (the replay then reports sizes past MAX_BYTES instead of wrapping around).
        cap = float(MAX_BYTES // max(1, len(sizes)))
        return np.clip(np.rint(np.nan_to_num(sizes, nan=0.0, posinf=cap)), 0, cap).astype(np.int64)


@dataclass
class SitePrediction:
    """One stack site live at a predicted peak: its bytes there, at the largest run's same
    moment, and how it grows."""

    site: str
    category: str
    form: str
    bytes: int
    largest_run_bytes: int
    growth_bytes: int
    # What the two largest fitted runs show of the site: its bytes live at the predicted peak in the largest
    # run over the same allocations' bytes in the run before it, and that ratio as a power of the knob's
    # ratio (4.0x for 2x the knob: 2.0). None where the run before has none of them.
    runs_ratio: Optional[float] = None
    runs_power: Optional[float] = None
    # the two as every table's cell says them, `4.00x (power 2.00)`; empty where either is None
    runs_growth_text: str = field(init=False, default="")

    def __post_init__(self) -> None:
        if self.runs_ratio is not None and self.runs_power is not None:
            self.runs_growth_text = f"{self.runs_ratio:.2f}x (power {self.runs_power:.2f})"


@dataclass
class Prediction:
    """Memory of one device at one knob value, rebuilt by replaying the trace."""

    value: int
    peak_bytes: int
    phase: Optional[str]
    step: Optional[int]
    event_index: int
    phase_peaks: Dict[str, int]
    categories: Dict[str, int]
    sites: List[SitePrediction]
    with_overhead_bytes: int

    @property
    def where(self) -> str:
        """Where the predicted peak is, in words (`backward, step 1`)."""
        return ", ".join(([self.phase] if self.phase else []) + ([f"step {self.step}"] if self.step is not None
                                                                   else [])) or "no phase"


@dataclass
class RunCheck:
    """One run predicted from the others (leave-one-out) against what it measured."""

    file: str
    value: int
    actual_peak_bytes: int
    actual_phase: Optional[str]
    predicted_peak_bytes: Optional[int]  # None: not checked (two runs fitted, each needed for the line)
    error_pct: Optional[float]
    fitted: bool  # the run is one the sizes are fitted from (else it only checks the fit)
    # the cells every table shows: `yes` or `no (check only)`, and the error as `+1.2%` (empty: not checked)
    fitted_text: str = field(init=False, default="")
    error_text: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.fitted_text = "yes" if self.fitted else "no (check only)"
        self.error_text = "" if self.error_pct is None else f"{self.error_pct:+.1f}%"


@dataclass
class DeviceForecast:
    """A device's forecast: predictions, fitted forms, trust, and the largest value within the budget."""

    device: int
    method: str  # "events": allocations lined up one for one; "aligned": by matching stacks
    aligned_pct: float
    runs: List[RunCheck]  # each run as measured (predicted_peak_bytes: leave-one-out, or its own peak)
    predictions: List[Prediction]
    forms: Dict[str, str]
    unfitted_allocations: int
    unfitted_bytes: int
    fit_error_pct: Optional[float]
    max_value_within_budget: Optional[int]
    headline: str
    alignment: str  # how the runs' allocations were lined up, in words
    notes: List[Finding] = field(default_factory=list)  # the catalogue's (findings.py)
    # The largest value within the budget in words (`11`; `any (...)` when nothing outgrows it); None
    # without a budget or when nothing fits. max_value_within_budget is then MAX_VALUE, no value.
    within_text: Optional[str] = None
    # The knob values of the two runs each site's runs_ratio compares (the fitted run before the largest, the largest).
    growth_between: List[int] = field(default_factory=list)
    # The sentences every format shows: what the table of the predicted peak's categories and sites is
    # at (`at the predicted peak for 8 (backward, step 1)`), and with a budget the largest value within
    # it (`largest value within the budget: 11`; None without a budget, or when nothing fits).
    at_peak: str = ""
    within_line: Optional[str] = None

    @property
    def predicted_peak_bytes(self) -> int:
        """The peak at the first requested value."""
        return self.predictions[0].peak_bytes

    # The tables every format shows, their cells worded here (a property each: the JSON keeps its figures).
    @property
    def runs_table(self) -> Table:
        """Each run as measured, whether it was fitted, and its leave-one-out prediction and error."""
        rows = [[os.path.basename(r.file), f"{r.value:,}", format_bytes(r.actual_peak_bytes), r.actual_phase or "",
                 r.fitted_text, "" if r.predicted_peak_bytes is None else format_bytes(r.predicted_peak_bytes),
                 r.error_text] for r in self.runs]
        return Table(["run", "value", "peak", "phase", "fitted", "predicted without it", "error"], rows,
                     left=[0, 3, 4])

    @property
    def predictions_table(self) -> Table:
        """Each requested value's predicted peak, its phase, and the peak of each training phase there."""
        phases = [name for name in ("forward", "backward", "optimizer")
                  if any(name in p.phase_peaks for p in self.predictions)]
        rows = [[f"{p.value:,}", format_bytes(p.peak_bytes), p.phase or "",
                 *[format_bytes(p.phase_peaks.get(name, 0)) for name in phases]] for p in self.predictions]
        return Table(["value", "predicted peak", "phase", *phases], rows, left=[2])

    @property
    def categories_table(self) -> Table:
        """The categories live at the first value's predicted peak, and the form each grows by."""
        p = self.predictions[0]
        return Table(["category", f"at {p.value:,}", "form"],
                     [[name, format_bytes(b), self.forms.get(name, "")] for name, b in p.categories.items()],
                     left=[0, 2])

    @property
    def sites_table(self) -> Table:
        """The sites growing most at the first value's predicted peak: their growth between the two largest
        fitted runs, their bytes in the largest run and at the value."""
        p = self.predictions[0]
        low, high = self.growth_between
        rows = [[s.site, s.category, s.form, s.runs_growth_text, format_bytes(s.largest_run_bytes),
                 format_bytes(s.bytes), format_bytes(s.growth_bytes, signed=True)] for s in p.sites]
        return Table(["growing site", "category", "form", f"{low:,} to {high:,}", "largest run", f"at {p.value:,}",
                      "growth"], rows, left=[0, 1, 2])


@dataclass
class HeadroomCheck:
    """A baseline's headroom limit applied to the forecast: every device's largest value within
    the budget must stay at least `min_value`."""

    baseline: str
    budget_bytes: int
    min_value: int
    passed: bool
    line: str


@dataclass
class Forecast:
    """The whole forecast, every number and sentence any output shows."""

    knob_values: List[int]
    files: List[str]
    at: List[int]
    budget_bytes: Optional[int]
    overhead_ratio: float
    overhead_note: str
    devices: List[DeviceForecast]
    notes: List[str]
    tool: str = f"memdiff {__version__}"
    headroom: Optional[HeadroomCheck] = None
    # The budget and what it is compared with, as every format says it (`budget 40.00 MiB: the runs carry
    # no allocator segments ...`); None without a budget.
    budget_line: Optional[str] = None

    @property
    def runs(self) -> List[Tuple[str, int]]:
        """Each run as every format names it: its file name without its folder, and its knob value."""
        return [(os.path.basename(name), value) for name, value in zip(self.files, self.knob_values)]

    @property
    def runs_said(self) -> List[Tuple[str, str]]:
        """`runs`, the value as every format writes it (`1,024`)."""
        return [(name, f"{value:,}") for name, value in self.runs]

    def to_dict(self) -> Dict[str, Any]:
        """The JSON document (schemas/forecast.schema.json)."""
        devices = []
        for d in self.devices:
            item = asdict(d)
            item = {"device": d.device, "predicted_peak_bytes": d.predicted_peak_bytes, **item,
                    "notes": [n.text for n in d.notes], "findings": [n.to_dict() for n in d.notes]}
            devices.append(item)
        return {"schema_version": SCHEMA_VERSION, "tool": self.tool, "knob_values": self.knob_values,
                "files": self.files, "at": self.at, "budget_bytes": self.budget_bytes,
                "overhead_ratio": self.overhead_ratio, "overhead_note": self.overhead_note,
                "budget_line": self.budget_line, "notes": self.notes, "devices": devices,
                "headroom": None if self.headroom is None else asdict(self.headroom)}


# ---------------------------------------------------------------- reading


# ---------------------------------------------------------------- one loop?


# ---------------------------------------------------------------- fitting


def columns(sizes: np.ndarray, present: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(the distinct columns of `sizes` (runs x allocations), -1 where not `present`; each
    allocation's column): a million allocations hold a few thousand distinct size series."""
    keyed = np.where(present, sizes, -1)
    if keyed.shape[1] == 0:
        return keyed, np.zeros(0, dtype=np.int64)
    # Each run's sizes as small codes, mixed into one integer per allocation: one 1-D unique
    # instead of numpy's unique over columns, which sorts a structured view (10x slower).
    key = np.zeros(keyed.shape[1], dtype=np.int64)
    radix = 1
    for row in keyed:
        _, codes = np.unique(row, return_inverse=True)
        count = int(codes.max()) + 1
        if radix * count >= 2**62:
            _, inverse = np.unique(keyed, axis=1, return_inverse=True)
            inverse = inverse.reshape(-1)
            return keyed[:, np.unique(inverse, return_index=True)[1]], inverse
        key += codes.reshape(-1) * radix
        radix *= count
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    return keyed[:, first], inverse.reshape(-1)


def fit_sizes(values: Sequence[int], sizes: np.ndarray, present: np.ndarray,
              distinct: Optional[Tuple[np.ndarray, np.ndarray]] = None, rows: Optional[Sequence[int]] = None) -> Fit:
    """The simplest exact polynomial of each column of `sizes` (runs x allocations) over the
    runs where `present` (only `rows` of them when given, `values` being theirs); each distinct
    column (`distinct`, from columns()) is fitted once, in exact arithmetic."""
    unique, inverse = distinct if distinct is not None else columns(sizes, present)
    picked = list(range(unique.shape[0])) if rows is None else list(rows)
    u_form = np.zeros(unique.shape[1], dtype=np.int64)
    u_coef = np.zeros((unique.shape[1], 3), dtype=np.float64)
    for j, col in enumerate(unique[picked].T.tolist()):
        points = [(values[i], col[i]) for i in range(len(picked)) if col[i] >= 0]
        u_form[j], u_coef[j] = _fit(points)
    return Fit(u_form[inverse], u_coef[inverse])


def _fit(points: List[Tuple[int, int]]) -> Tuple[int, Tuple[float, float, float]]:
    """(form index, coefficients) of the simplest polynomial through all `points` (x, size)."""
    if not points:
        return 0, (0.0, 0.0, 0.0)
    ys = [y for _, y in points]
    if len(set(ys)) == 1:
        return 0, (float(ys[0]), 0.0, 0.0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    slope = Fraction(y1 - y0, x1 - x0)
    c0 = y1 - slope * x1
    if all(c0 + slope * x == y for x, y in points):
        return 1, (float(c0), float(slope), 0.0)
    if len(points) < 3:  # unreachable: two points always fit a line
        return 3, (float(c0), float(slope), 0.0)
    (xa, ya), (xb, yb), (xc, yc) = points[-3:]
    # Lagrange through the three largest values, in exact fractions.
    da = Fraction(ya, (xa - xb) * (xa - xc))
    db = Fraction(yb, (xb - xa) * (xb - xc))
    dc = Fraction(yc, (xc - xa) * (xc - xb))
    a2 = da + db + dc
    a1 = -(da * (xb + xc) + db * (xa + xc) + dc * (xa + xb))
    a0 = da * xb * xc + db * xa * xc + dc * xa * xb
    exact = all(a0 + a1 * x + a2 * x * x == y for x, y in points)
    return (2 if exact else 3), (float(a0), float(a1), float(a2))


# ---------------------------------------------------------------- replay


@dataclass
class _Device:
    """What replaying one device needs: the reference run's structure and the fitted sizes."""

    ref: DeviceCourse
    fit: Fit
    spans: List[PhaseSpan]  # the reference run's phase runs, in order
    steps: List[Step]


@dataclass
class _Before:
    """The fitted run before the largest: its size of each of the largest run's allocations (-1: it has none),
    and the knob's ratio between the two."""

    sizes: np.ndarray
    knob_ratio: float


def _predict(dev: _Device, value: int, overhead: float, largest: np.ndarray,
             before: _Before) -> Tuple[Prediction, List[SitePrediction]]:
    """Replay at `value`: the peak, its phase and step, each phase's peak, and what is live there; and every
    growing site live there, most growth first (the prediction keeps the first TOP_SITES)."""
    ref = dev.ref
    sizes = dev.fit.at(value)
    r = replay_course(ref, sizes, dev.spans, dev.steps)
    live = r.live
    sites: Dict[int, List[int]] = {}
    for s, b, o, f, c, e in zip(ref.stack[live].tolist(), sizes[live].tolist(), largest[live].tolist(),
                                dev.fit.form[live].tolist(), ref.category[live].tolist(),
                                before.sizes[live].tolist()):
        slot = sites.setdefault(s, [0, 0, 0, c, 0, 0])
        slot[0] += b
        slot[1] += o
        slot[2] = max(slot[2], f)
        if e >= 0:  # the same allocations in both runs: their ratio is the site's growth between them
            slot[4] += o
            slot[5] += e
    rows = [SitePrediction(site=ref.stacks[s][1], category=ref.categories[c], form=FORMS[f], bytes=b,
                           largest_run_bytes=o, growth_bytes=b - o, **_growth(same, earlier, before.knob_ratio))
            for s, (b, o, f, c, same, earlier) in sites.items() if f > 0]
    rows.sort(key=lambda r: (-r.growth_bytes, -r.bytes, r.site))
    return (Prediction(value=value, peak_bytes=r.peak_bytes, phase=r.phase, step=r.step, event_index=r.at,
                       phase_peaks=r.phase_peaks, categories=r.categories, sites=rows[:TOP_SITES],
                       with_overhead_bytes=int(round(r.peak_bytes * overhead))), rows)


def _growth(largest: int, earlier: int, knob_ratio: float) -> Dict[str, Optional[float]]:
    """A site's bytes in the largest run over the run before's, and that ratio as a power of the knob's."""
    if earlier <= 0 or largest <= 0:  # the runs' values differ (forecast_courses): knob_ratio > 1
        return {"runs_ratio": None, "runs_power": None}
    ratio = largest / earlier
    return {"runs_ratio": round(ratio, 4), "runs_power": round(math.log(ratio) / math.log(knob_ratio), 3)}


def _peak_at(dev: _Device, value: int) -> int:
    sizes = dev.fit.at(value)
    return peak_of(dev.ref, sizes, replay(dev.ref, sizes))[0]


def _max_within(dev: _Device, budget: int, overhead: float, lowest: int) -> Optional[int]:
    """The largest integer value whose predicted peak (times the overhead) stays within `budget`,
    searched upward from 1; None when even 1 does not fit, MAX_VALUE when it never stops fitting."""
    def fits(x: int) -> bool:
        return _peak_at(dev, x) * overhead <= budget
    if not fits(1):
        return None
    lo, hi = 1, max(2, lowest)
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > MAX_VALUE:
            return MAX_VALUE
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


# ---------------------------------------------------------------- the forecast


def forecast_courses(courses: Sequence[Course], at: Sequence[int], budget: Optional[int] = None) -> Forecast:
    """The Forecast of runs of one loop (each with its knob value) at the values `at`."""
    if len(courses) < 2:
        raise InputError("forecast", "give at least two runs, each as RUN=VALUE")
    courses = sorted(courses, key=lambda c: c.value)
    values = [c.value for c in courses]
    if len(set(values)) != len(values):
        raise InputError("forecast", f"two runs have the same value {_dup(values)}: each run needs its own")
    check_one_loop(courses)
    at = list(at) or [2 * values[-1]]
    overhead, overhead_note = _overhead(courses)
    notes: List[str] = []
    if not courses[0].devices:
        raise InputError(courses[0].file, "no device records any allocation: nothing to forecast")
    devices = []
    for device in sorted(courses[0].devices):
        devices.append(_device_forecast([c.devices[device] for c in courses], courses, device, at, budget,
                                        overhead))
    # Names from the snapshots are made one line each here, once for every output.
    return scrubbed(Forecast(knob_values=values, files=[c.file for c in courses], at=at, budget_bytes=budget,
                             overhead_ratio=round(overhead, 4), overhead_note=overhead_note, devices=devices,
                             notes=notes,
                             budget_line=None if budget is None else f"budget {format_bytes(budget)}: {overhead_note}"))


def _names(courses: Sequence[Course]) -> str:
    return ", ".join(os.path.basename(c.file) for c in courses)


def _dup(values: Sequence[int]) -> int:
    return next(v for v in values if values.count(v) > 1)


def _overhead(courses: Sequence[Course]) -> Tuple[float, str]:
    """Reserved over allocated at the peak, the caching allocator's overhead, the largest any run measured."""
    measured = [o for c in courses for d in c.summary.devices
                for o in [device_overhead(d, f"{os.path.basename(c.file)} device {d.device}")] if o is not None]
    return budget_note(measured, "the peak")


def _device_forecast(runs: List[DeviceCourse], courses: Sequence[Course], device: int, at: Sequence[int],
                     budget: Optional[int], overhead: float) -> DeviceForecast:
    ref_index = len(runs) - 1  # the largest value: its structure is the one extrapolated
    alignment = align(runs, ref_index)
    if alignment.aligned_pct < 100 * MIN_ALIGNED:
        worst = min(range(len(runs)), key=lambda k: float((alignment.matched[k] >= 0).mean()) if len(
            alignment.matched[k]) else 1.0)
        raise InputError(courses[worst].file,
                         f"not the same loop as {courses[ref_index].file}: on device {device} only "
                         f"{alignment.aligned_pct:.0f}% of the allocations line up (different model or code?)")
    if alignment.covered_pct < 100 * MIN_ALIGNED:
        worst = min(range(len(runs)), key=lambda k: float((alignment.matched[k] >= 0).sum()) / max(
            len(runs[k].size), 1))
        raise InputError(courses[worst].file,
                         f"not the same loop as {courses[ref_index].file}: on device {device} only "
                         f"{alignment.covered_pct:.0f}% of its allocations line up with that run's "
                         "(it records much more: a different loop?)")
    ref = runs[ref_index]
    values = [c.value for c in courses]
    n = len(ref.size)
    # Runs that record the largest run's allocations one for one are fitted; when at least two
    # do, a run that records others (batch 1 often skips a copy) only checks the fit, since
    # lining its allocations up by stack is a guess where many share one stack (the backward's).
    fitted = [k for k in range(len(runs)) if alignment.same[k]]
    if len(fitted) < 2:
        fitted = list(range(len(runs)))
    sizes = np.zeros((len(runs), n), dtype=np.int64)
    present = np.zeros((len(runs), n), dtype=bool)
    for k, (run, m) in enumerate(zip(runs, alignment.matched)):
        ok = m >= 0
        sizes[k, ok] = run.size[m[ok]]
        present[k] = ok
    spans, steps = structure(courses[ref_index].summary, device)
    distinct = columns(sizes, present)
    fit = fit_sizes([values[k] for k in fitted], sizes, present, distinct, fitted)
    dev = _Device(ref, fit, spans, steps)
    largest = ref.size
    earlier = fitted[-2] if fitted[-1] == ref_index else fitted[-1]
    before = _Before(np.where(present[earlier], sizes[earlier], -1), values[ref_index] / values[earlier])
    replayed = [_predict(dev, v, overhead, largest, before) for v in at]
    predictions = [p for p, _ in replayed]
    # What two runs show and a line cannot: sites that grew faster than linearly between them (4.0x for 2x).
    faster = _faster(replayed[0][1])
    if len(fitted) == 2:
        # W015 counts them: each is a row of the growing-site table, where a reader looks for it.
        for p, rows in replayed:
            p.sites = _with_faster(p.sites, _faster(rows))

    checks = []
    for k, c in enumerate(courses):
        actual = c.summary.devices[[d.device for d in c.summary.devices].index(device)]
        predicted: Optional[int] = None
        if k not in fitted:
            predicted = _peak_at(dev, c.value)
        elif len(fitted) >= 3:
            keep = [i for i in fitted if i != k]
            loo = fit_sizes([values[i] for i in keep], sizes, present, distinct, keep)
            predicted = _peak_at(_Device(ref, loo, spans, steps), c.value)
        err = (None if predicted is None else 0.0 if actual.peak_bytes == 0
               else round(100.0 * (predicted - actual.peak_bytes) / actual.peak_bytes, 3))
        checks.append(RunCheck(file=c.file, value=c.value, actual_peak_bytes=actual.peak_bytes,
                               actual_phase=actual.phase_at_peak, predicted_peak_bytes=predicted,
                               error_pct=err, fitted=k in fitted))
    errors = [abs(r.error_pct) for r in checks if r.error_pct is not None]
    fit_error = round(max(errors), 3) if errors else None

    forms = _forms(ref, fit, predictions[0].event_index)
    unfitted = fit.form == 3
    unfitted_bytes = int(ref.size[unfitted].sum()) if n else 0
    notes = []
    odd = [courses[k] for k in range(len(runs)) if k not in fitted]
    if odd and len(fitted) >= 2:
        notes.append(finding("W007", device, runs=_names(odd), s="s" if len(odd) == 1 else "", fitted=len(fitted)))
    elif not alignment.exact:
        # A fit through one run is a constant: what only the largest run records keeps its size
        # there at every value, the forecast's blind spot, so the note counts it.
        counts = present[fitted].sum(axis=0) if n else np.zeros(0, dtype=np.int64)
        alone, others = int((counts <= 1).sum()), int((counts < len(fitted)).sum())
        held = f"{'keeps its' if alone == 1 else 'keep their'} size in it at every value"
        said = ("" if alignment.aligned_pct >= 100 else
                f"; the {count_of(others, 'other')}, which only the largest run records, {held}" if alone == others
                else f"; the others are fitted from the runs that have them, and the "
                     f"{count_of(alone, 'allocation')} only the largest run records {held}" if alone
                else "; the others are fitted from the runs that have them")
        notes.append(finding("W008", device, aligned=_lined_up(alignment), aligned_pct=alignment.aligned_pct,
                             others=said, alone=alone))
    if len(fitted) == 3 and "quadratic" in forms.values():
        notes.append(finding("W009", device))
    if len(fitted) == 2:
        notes.append(finding("W010", device))
        if faster:
            listed = sum(1 for x in predictions[0].sites if x in faster)
            unlisted = (f"; the growing-site table shows {listed:,} of them, and the forecast's JSON "
                        f"(--format json) names all {len(faster):,} in this warning's data"
                        if listed < len(faster) else "")
            notes.append(finding("W015", device, **_faster_said(faster, values[earlier], values[ref_index]),
                                 count=len(faster), s="" if len(faster) == 1 else "s", listed=listed,
                                 unlisted=unlisted, faster_sites=[
                                     {"site": x.site, "runs_ratio": x.runs_ratio, "runs_power": x.runs_power}
                                     for x in faster]))
    if int(unfitted.sum()):
        notes.append(finding("W011", device, count=int(unfitted.sum()), amount=format_bytes(unfitted_bytes),
                             amount_bytes=unfitted_bytes))
    within = None
    if budget is not None:
        within = _max_within(dev, budget, overhead, values[-1])
        if within is None:
            notes.append(finding("W012", device, budget=format_bytes(budget), budget_bytes=budget))
        elif within == MAX_VALUE:
            notes.append(finding("W013", device))
    first = predictions[0]
    largest_run = checks[-1]
    moved = ("" if first.phase is None else
             f", in {where_text(first.phase, None)} (the largest run, {largest_run.value}, peaks in "
             f"{where_text(largest_run.actual_phase, None)})"
             if first.phase != largest_run.actual_phase else f", in {where_text(first.phase, None)}")
    if fit_error is None and faster:
        grew = _faster_said(faster, values[earlier], values[ref_index])["sites"]
        trust = (f"unchecked (no third run to leave out), and between the runs {grew}: above "
                 f"{values[ref_index]:,} the line forecasts {'it' if len(faster) == 1 else 'them'} too low (W015)")
    elif fit_error is None:
        trust = ("unchecked (no third run to leave out), and no site live at the peak grew faster than linearly "
                 "between the runs")
    elif len(fitted) >= 3:
        trust = f"leave-one-out error at most {fit_error:.1f}%"
    else:
        trust = f"error on the runs left out of the fit at most {fit_error:.1f}%"
    headline = (f"device {device}: predicted peak {format_bytes(first.peak_bytes)} at {first.value}{moved}; "
                + ("a linear forecast from two runs, " if len(fitted) == 2 else "") + trust)
    # Above the largest run the line forecasts a site that grew faster than linearly too low
    # (W015), so the value it finds within the budget is only an upper bound there.
    bound = "at most " if faster and within is not None and within > values[ref_index] else ""
    within_text = (None if within is None else "any (the predicted peak never outgrows it)" if within == MAX_VALUE
                   else f"{bound}{within:,}")
    if budget is not None:
        headline += ("; nothing fits the budget" if within_text is None
                     else f"; largest value within {format_bytes(budget)}: {within_text}")
    return DeviceForecast(
        device=device, method="events" if all(alignment.same[k] for k in fitted) else "aligned",
        aligned_pct=round(alignment.aligned_pct, 2),
        runs=checks, predictions=predictions, forms=forms,
        unfitted_allocations=int(unfitted.sum()), unfitted_bytes=unfitted_bytes, fit_error_pct=fit_error,
        max_value_within_budget=within, headline=headline, notes=notes, within_text=within_text,
        at_peak=f"at the predicted peak for {first.value:,} ({first.where})",
        within_line=None if within_text is None else f"largest value within the budget: {within_text}",
        growth_between=[values[earlier], values[ref_index]],
        alignment=(f"the {len(fitted)} fitted runs record the same allocations in the same order "
                   f"({len(ref.size):,} allocations)" if all(alignment.same[k] for k in fitted)
                   else _lined_up(alignment)))


def _faster(rows: List[SitePrediction]) -> List[SitePrediction]:
    """The sites that grew faster than linearly between the two largest fitted runs (W015)."""
    return [s for s in rows if s.runs_power is not None and s.runs_power >= FASTER_THAN_LINEAR]


def _with_faster(shown: List[SitePrediction], faster: List[SitePrediction]) -> List[SitePrediction]:
    """The growing-site table (the TOP_SITES that grew most) with the sites that grew faster than
    linearly added, up to TOP_SITES more (the fastest first), in the table's order of growth."""
    extra = sorted((s for s in faster if s not in shown), key=lambda s: (-(s.runs_power or 0.0), -s.bytes, s.site))
    return sorted(shown + extra[:TOP_SITES], key=lambda r: (-r.growth_bytes, -r.bytes, r.site))


def _faster_said(faster: List[SitePrediction], low: int, high: int) -> Dict[str, str]:
    """W015's words for the sites that grew faster than linearly between the runs at `low` and `high`:
    the one that grew most by its power, and how many others."""
    top = max(faster, key=lambda s: (s.runs_power or 0.0, s.bytes))
    others = len(faster) - 1
    said = (f"{top.site} grew {top.runs_ratio:.2f}x for {high / low:.2f}x the knob ({low:,} to {high:,}), as its "
            f"power {top.runs_power:.2f}")
    if others:
        said += f" ({count_of(others, 'other site')} faster than linearly too)"
    return {"sites": said}


def _forms(ref: DeviceCourse, fit: Fit, at: int) -> Dict[str, str]:
    """Each category's form: the highest degree among the forms that hold at least 5% of its
    bytes at the predicted peak (all its allocations when none is live there)."""
    live = (ref.start <= at) & (ref.end > at)
    sizes = ref.size
    out: Dict[str, str] = {}
    for c, name in enumerate(ref.categories):
        mine = ref.category == c
        chosen = mine & live if (mine & live).any() else mine
        if not chosen.any():
            continue
        by_form = np.bincount(fit.form[chosen], weights=sizes[chosen].astype(np.float64), minlength=len(FORMS))
        total = by_form.sum()
        kept = [k for k in range(len(FORMS)) if by_form[k] > 0 and by_form[k] >= 0.05 * total] or [0]
        out[name] = FORMS[max(kept)]
    return dict(sorted(out.items()))


def judge_headroom(result: Forecast, baseline: str, headroom: Headroom) -> Forecast:
    """The forecast with the baseline's headroom limit checked (its budget must be the forecast's)."""
    worst = min(result.devices, key=lambda d: -1 if d.max_value_within_budget is None else d.max_value_within_budget)
    largest = worst.max_value_within_budget
    passed = largest is not None and largest >= headroom.min_value
    # In the outputs' words: `at most N` where the line's value is only a bound (W015), never the
    # search's ceiling as a number where the peak never outgrows the budget (W013).
    shown = "nothing" if largest is None else worst.within_text or f"{largest:,}"
    line = (f"{'PASS' if passed else 'FAIL'}  headroom (device {worst.device}): the largest value within "
            f"{format_bytes(headroom.budget_bytes)} is {shown}, limit: fail below {headroom.min_value:,} "
            f"(baseline {baseline})")
    result.headroom = HeadroomCheck(baseline, headroom.budget_bytes, headroom.min_value, passed, text(line))
    return result


def forecast(runs: Sequence[KnobRun], at: Sequence[int], rules: Sequence[Rule],
             budget: Optional[int] = None, window: Optional[Window] = None) -> Forecast:
    """The Forecast of snapshot files, each with its knob value, at the values `at` (default:
    twice the largest value), with the largest value within `budget` when one is given; with
    `window`, of that window of each run only (memdiff.read.window)."""
    for v in at:
        if not 1 <= v <= MAX_VALUE:
            raise InputError("--at", f"{_shown(v)} is not a knob value: a positive integer up to {MAX_VALUE:,}")
    if len(runs) < 2:
        raise InputError("forecast", "give at least two runs, each as RUN=VALUE")
    courses = read_courses(runs, rules, window)
    _check_distinct(courses)
    return forecast_courses(courses, at, budget)


def _check_distinct(courses: Sequence[Course]) -> None:
    """InputError when one snapshot is given at two values: nothing in it grows with the knob, so
    the forecast would find nothing growing and every value fitting any budget."""
    seen: Dict[str, Course] = {}
    for c in courses:
        if not c.devices:
            continue  # a run that recorded nothing is said as such (forecast_courses)
        first = seen.setdefault(c.summary.source.sha256, c)
        if first is not c and first.value != c.value:  # at one value: forecast_courses says so
            raise InputError(c.file, f"the same snapshot as {first.file} (sha256 {c.summary.source.sha256[:12]}), "
                                     f"given at {first.value:,} and at {c.value:,}: a forecast needs a run recorded "
                                     "at each value")
