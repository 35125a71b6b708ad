"""The what-if engine: `memdiff whatif`, from one recorded run, the peak after a change nobody has made yet.

A what-if is the forecast's replay (forecasting.replay_course) with each allocation of the run
changed by a rule instead of by a fitted size: a rule drops an allocation, scales it, moves its
birth, or adds allocations the change makes. Which allocations a rule touches is read from what
the earlier stages say of each: its category (classify), the phase run and step it was born and
freed in (lifetimes), its site, and the profiler's module instances on its stack
(`nn.Module: GPT2Block_3`) for the repeated blocks, or without them (CUDA stacks) the call the
forward repeats with the same allocations (a loop over the layers). Every change names what it assumed, and a
change the run cannot show (no optimizer state, no repeated blocks) is one line, not a guess.

The changes (`--change`, several joined by `+` apply together), one module each with its own
facts and tests: checkpoint.py, weights.py, autocast.py, optimizer.py, zero_grad.py,
accumulate.py. Each is a ChangeRule (edit.py): a value check and an edit of the run's
allocations; this module runs them and replays the result.

Nothing here imports torch.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from memdiff import __version__
from memdiff.analyse.classify import Rule
from memdiff.analyse.guesses import GuessedPart, guessed_data, guessed_text
from memdiff.compare.findings import finding
from memdiff.compare.observe import where_text
from memdiff.errors import InputError
from memdiff.inert import scrubbed
from memdiff.model import DeviceSummary, Finding, PhaseSpan, Step, Table
from memdiff.predict.forecast.course import DeviceCourse, read_course, structure
from memdiff.predict.forecast.replay import replay_course
from memdiff.predict.overhead import Overhead, budget_note, device_overhead
from memdiff.predict.whatif import accumulate, autocast, checkpoint, optimizer, step, weights, zero_grad
from memdiff.predict.whatif.blocks import blocks_of, called_at
from memdiff.predict.whatif.edit import CannotApply, ChangeRule, Edit, changed_course, closest
from memdiff.predict.whatif.optimizer import OPTIMIZERS, run_optimizer
from memdiff.predict.whatif.run import Run, read_run
from memdiff.read.host import CpuHost
from memdiff.units import format_bytes

SCHEMA_VERSION = 1


# Every change, in the order a combination applies them (`weights` first: see predict); one
# module a rule, each with the facts it reads from the run.
RULES: Dict[str, ChangeRule] = {rule.name: rule for rule in (
    checkpoint.RULE, weights.RULE, autocast.RULE, optimizer.RULE, step.RULE, zero_grad.RULE, accumulate.RULE)}
NAMES = tuple(RULES)


@dataclass(frozen=True)
class Change:
    """One `--change` as given: its parts (name, value or None), applied together."""

    text: str
    parts: Tuple[Tuple[str, Optional[str]], ...]


@dataclass
class ChangePrediction:
    """The run's device replayed with one change: the peak, where, what it saves, how far to trust it."""

    change: str
    applies: bool
    reason: Optional[str]  # why it cannot apply (then no prediction)
    predicted_peak_bytes: Optional[int]
    predicted_peak_phase: Optional[str]
    predicted_peak_step: Optional[int]
    delta_bytes: Optional[int]
    delta_pct: Optional[float]
    fits_budget: Optional[bool]
    phase_peaks: Dict[str, int]
    categories: Dict[str, int]
    assumptions: List[str]
    line: str  # the change in one sentence
    # `whatif --emulate`: the re-run's reserved peak (what the caching allocator held: what runs out) and its
    # snapshot; None for a prediction, which replays allocations and knows no reserved memory
    reserved_peak_bytes: Optional[int] = None
    snapshot: Optional[str] = None
    # The most bytes held at once of the run's allocations the change edited whose category memdiff inferred
    # (memory live before the trace, no stack of its own: analyse.guesses, C001), those categories, and the
    # bytes of each category and inference: the figure rests on the guess (W016). 0: none.
    guessed_bytes: int = 0
    guessed_categories: List[str] = field(default_factory=list)
    guessed_by: List[GuessedPart] = field(default_factory=list)
    # The cells every table shows: whether it fits --budget (`yes`, `no`, `not known (W017)`; empty without a
    # budget, fits_words) and the delta's percent (`-12.3%`; empty when the change does not apply).
    fits_text: str = ""
    delta_pct_text: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.delta_pct_text = "" if self.delta_pct is None else f"{self.delta_pct:+.1f}%"


@dataclass
class DeviceWhatIf:
    """Every change asked of one device of the run."""

    device: int
    base_peak_bytes: int
    base_peak_phase: Optional[str]
    base_peak_step: Optional[int]
    blocks: List[str]  # the repeated blocks' instances the stacks show, in order
    optimizer: Optional[str]  # the run's optimizer, as torch.optim's scope or code names it (run_optimizer)
    changes: List[ChangePrediction]
    headline: str  # the run's peak and the change that saves most, in one line
    # each change whose figure rests on a guessed category (W016), then each that does not apply (W014)
    findings: List[Finding] = field(default_factory=list)


@dataclass
class WhatIf:
    """The whole what-if, every number and sentence any output shows."""

    file: str
    budget_bytes: Optional[int]
    asked: List[str]  # the changes given (empty: every applicable one)
    devices: List[DeviceWhatIf]
    notes: List[Finding] = field(default_factory=list)  # the catalogue's (findings.py)
    tool: str = f"memdiff {__version__}"
    # `memdiff whatif --emulate GPU`: each row is the script re-run with the change on that emulated GPU, not
    # a prediction (predict/whatif/rerun.py); None for a replay of a recorded run
    rerun_on: Optional[str] = None
    # What --budget is compared with, as the forecast says it: a replay's peak times the run's reserved over
    # allocated (the caching allocator's overhead: what runs out is reserved memory), a re-run's reserved peak.
    overhead_ratio: Optional[float] = None
    overhead_note: Optional[str] = None

    @property
    def run_name(self) -> str:
        """The run's file name, without its folder."""
        return os.path.basename(self.file)

    @property
    def how(self) -> str:
        """What the figures are: `(re-run on emulated l4, each change a run)`; empty when predicted from the run."""
        return f"(re-run on emulated {self.rerun_on}, each change a run)" if self.rerun_on else ""

    @property
    def budget_line(self) -> Optional[str]:
        """`budget 80.00 GiB: the budget is compared with ...`, as the forecast says it; None without one."""
        if self.budget_bytes is None:
            return None
        return f"budget {format_bytes(self.budget_bytes)}" + (f": {self.overhead_note}" if self.overhead_note else "")

    @property
    def heading(self) -> str:
        """`memdiff whatif run.pickle (re-run on ...)`: what the text and the page open with (the budget follows)."""
        return f"memdiff whatif {self.run_name}" + (f" {self.how}" if self.how else "")

    @property
    def assumed_word(self) -> str:
        """What the changes' lists say they did: `made` (re-run: the script was changed) or `assumed` (a replay)."""
        return "made" if self.rerun_on else "assumed"

    def table(self, d: DeviceWhatIf) -> Optional[Table]:
        """The device's changes that apply as every format's table: the peak after each (and a re-run's reserved
        peak), its phase, the delta, the bytes on a guessed category (W016) where any change has them, and
        whether it fits --budget; None when no change applies."""
        applied = [c for c in d.changes if c.applies]
        if not applied:
            return None
        guessed = any(c.guessed_bytes for c in applied)
        budget, rerun = self.budget_bytes is not None, bool(self.rerun_on)
        rows: List[List[str]] = []
        for c in applied:
            row = [c.change, format_bytes(c.predicted_peak_bytes or 0)]
            row += [format_bytes(c.reserved_peak_bytes or 0)] if rerun else []
            row += [c.predicted_peak_phase or "before the trace", format_bytes(c.delta_bytes or 0, signed=True),
                    c.delta_pct_text]
            row += [format_bytes(c.guessed_bytes) if c.guessed_bytes else ""] if guessed else []
            row += [c.fits_text] if budget else []
            rows.append(row)
        headers = ((["change", "re-run peak", "reserved", "phase"] if rerun else ["change", "predicted peak", "phase"])
                   + ["delta", "%"] + (["on a guessed category"] if guessed else []) + (["fits"] if budget else []))
        return Table(headers, rows, left=[0, headers.index("phase")] + ([len(headers) - 1] if budget else []))

    def to_dict(self) -> Dict[str, Any]:
        """The JSON document (schemas/whatif.schema.json)."""
        return {"schema_version": SCHEMA_VERSION, "tool": self.tool, "file": self.file,
                "budget_bytes": self.budget_bytes, "overhead_ratio": self.overhead_ratio,
                "overhead_note": self.overhead_note, "rerun_on": self.rerun_on,
                "asked": self.asked, "notes": [n.text for n in self.notes],
                "findings": [n.to_dict() for n in self.notes],
                "devices": [{**asdict(d), "findings": [f.to_dict() for f in d.findings]} for d in self.devices]}


def parse_change(text: str) -> Change:
    """The Change in `checkpoint=0.5+weights=bf16`; InputError naming the closest known name or value."""
    if not text or len(text) > 200:
        raise InputError("--change", "give a change such as checkpoint, weights=bf16 or optimizer=sgd")
    parts: List[Tuple[str, Optional[str]]] = []
    for piece in text.split("+"):
        name, sep, value = piece.strip().partition("=")
        name = name.strip().lower()
        if name not in NAMES:
            raise InputError("--change", f"unknown change {name!r}{closest(name, NAMES)}")
        if any(n == name for n, _ in parts):
            raise InputError("--change", f"{name} is given twice in {text!r}")
        v: Optional[str] = value.strip().lower() if sep else None
        RULES[name].check(v)
        parts.append((name, v))
    return Change(text, tuple(parts))


def fits_words(budget: Optional[int], fits: Optional[bool]) -> str:
    """Whether a change's peak fits --budget as its table cell says it; empty without a budget."""
    if budget is None:
        return ""
    return "not known (W017)" if fits is None else "yes" if fits else "no"


def predict(run: Run, change: Change, budget: Optional[int], overhead: float = 1.0,
            stopped: bool = False) -> ChangePrediction:
    """The run replayed with `change`: its peak and where, or why the change cannot apply; it fits `budget`
    when its peak times `overhead` (reserved over allocated) does. Of a run `stopped` by an out-of-memory
    error the peak is a lower bound: it fits no budget it is over, and whether it fits one is not known."""
    c = run.course
    edit = Edit(start=c.start.copy(), end=c.end.copy(), size=c.size.copy())
    # Precision first, so that rules adding memory (casts, state) add it at the changed sizes' scale.
    order = sorted(change.parts, key=lambda p: NAMES.index(p[0]) if p[0] != "weights" else -1)
    given = {n for n, _ in change.parts}
    try:
        for name, value in order:
            rule = RULES[name]
            for other, why in rule.excludes:
                if other in given:
                    raise CannotApply(why)
            rule.apply(run, edit, value)
    except CannotApply as why:
        return ChangePrediction(change=change.text, applies=False, reason=str(why), predicted_peak_bytes=None,
                                predicted_peak_phase=None, predicted_peak_step=None, delta_bytes=None,
                                delta_pct=None, fits_budget=None, phase_peaks={}, categories={}, assumptions=[],
                                line=finding("W014", change=change.text, why=str(why)).message)
    # What the change edited that no stack of its own says what it is: its category, which the rule went by, is
    # a guess. Counted as held at once: a CPU capture's tensor updated in place is one allocation a version.
    touched = np.flatnonzero((run.inferred != "") & ((edit.size != c.size) | (edit.start != c.start)
                                                     | (edit.end != c.end)))
    guessed = _held_at_once(c, touched)
    parts = [GuessedPart(str(category), str(how), _held_at_once(c, touched[(run.category[touched] == category)
                                                                          & (run.inferred[touched] == how)]))
             for category, how in sorted({(run.category[k], run.inferred[k]) for k in touched.tolist()})]
    course, sizes = changed_course(run, edit)
    r = replay_course(course, sizes, run.spans, run.steps)
    base = run.base.peak_bytes
    delta = r.peak_bytes - base
    pct = round(100.0 * delta / base, 2) if base else 0.0
    fits = None if budget is None else r.peak_bytes * overhead <= budget
    fits = None if stopped and fits else fits
    where = f"in {where_text(r.phase, None)}" if r.phase else "before the trace's first event"
    moved = "" if r.phase == run.base.phase else f" (it was in {where_text(run.base.phase, None) or 'no phase'})"
    line = (f"{change.text}: peak {format_bytes(r.peak_bytes)} ({format_bytes(delta, signed=True)}, {pct:+.1f}%), "
            f"{where}{moved}" + ("" if budget is None else "; over the budget" if fits is False
                                 else "; fits the budget" if fits else "; the budget not known (W017)")
            + (f"; {on_a_guess(guessed, parts)}" if guessed else ""))
    return ChangePrediction(change=change.text, applies=True, reason=None, predicted_peak_bytes=r.peak_bytes,
                            predicted_peak_phase=r.phase, predicted_peak_step=r.step, delta_bytes=delta,
                            delta_pct=pct, fits_budget=fits, phase_peaks=r.phase_peaks, categories=r.categories,
                            assumptions=edit.assumptions, line=line, guessed_bytes=guessed,
                            guessed_categories=sorted({p.category for p in parts}), guessed_by=parts,
                            fits_text=fits_words(budget, fits))


def _held_at_once(c: DeviceCourse, members: np.ndarray) -> int:
    """The most bytes the allocations `members` hold at once, each held for at least its first event (a
    snapshot without a trace holds its blocks over no event at all)."""
    if not len(members):
        return 0
    events = np.concatenate([c.start[members], np.maximum(c.end[members], c.start[members] + 1)])
    sizes = np.concatenate([c.size[members], -c.size[members]])
    order = np.lexsort((sizes, events))  # frees before allocations at the same event
    return int(max(0, np.cumsum(sizes[order]).max()))


def on_a_guess(amount: int, parts: Sequence[GuessedPart]) -> str:
    """`on a guess: 8.13 MiB it changes is parameter by its lifetime`, the words every output says it in."""
    return f"on a guess: {format_bytes(amount)} it changes is {guessed_text(parts, amounts=False)}"


def guess_findings(device: int, predictions: Sequence[ChangePrediction]) -> List[Finding]:
    """W016 for each change whose figure rests on a category memdiff guessed."""
    return [finding("W016", device, change=p.change, amount=format_bytes(p.guessed_bytes), amount_bytes=p.guessed_bytes,
                    categories=guessed_text(p.guessed_by), guessed_by=guessed_data(p.guessed_by))
            for p in predictions if p.applies and p.guessed_bytes]


def every_change(optimizer: Optional[str], accumulate: bool = True) -> List[Change]:
    """Every change worth trying (without --change) on a run whose optimizer is `optimizer`: another
    optimizer than its own, and accumulation unless `accumulate` is False (a re-run whose command takes
    no accumulation flag)."""
    texts = ["checkpoint", "checkpoint=0.5", "weights=bf16", "autocast=bf16"]
    same = ("adam", "adamw") if optimizer in ("adam", "adamw") else (optimizer,)
    texts += [f"optimizer={name}" for name in OPTIMIZERS if name not in same and name != "adam"]
    texts += ["step=fused", "zero-grad=none", "zero-grad=zeros"]
    texts += ["accumulate=2", "accumulate=4"] if accumulate else []
    return [parse_change(t) for t in texts]


def blocks_text(blocks: Sequence[str]) -> str:
    """The repeated blocks as a person says them, for the headline of every output: `12 repeated blocks, called
    at modeling_layers.py:109` (calls of one line, where the stacks name no module), `12 repeated blocks,
    GPT2Block_0 to GPT2Block_11`."""
    line = called_at(blocks)
    if line is not None:
        return f"{len(blocks)} repeated blocks, called at {line}"
    if len(blocks) == 2:
        return f"2 repeated blocks, {blocks[0]} and {blocks[1]}"
    return f"{len(blocks)} repeated blocks, {blocks[0]} to {blocks[-1]}"


def headline(device: int, peak: int, phase: Optional[str], step: Optional[int], blocks: List[str],
             optimizer: Optional[str], predictions: Sequence[ChangePrediction]) -> str:
    """A device's peak (at `phase` of `step`) and the change that saves most, in one line."""
    where = f"in {where_text(phase, step)}" if phase else "before the trace's first event"
    line = f"device {device}: peak {format_bytes(peak)} {where}"
    line += f"; {blocks_text(blocks)}" if blocks else ""
    line += f"; optimizer {optimizer}" if optimizer else ""
    applied = [p for p in predictions if p.applies and p.delta_bytes is not None]
    if not applied:
        return line + "; no change asked applies to this run"
    best = min(applied, key=lambda p: (p.delta_bytes or 0, p.change))
    if (best.delta_bytes or 0) >= 0:
        return line + "; no change asked lowers the peak"
    moved = (f", the peak moves to {where_text(best.predicted_peak_phase, None) or 'before the trace'}"
             if best.predicted_peak_phase != phase else "")
    guess = f" ({on_a_guess(best.guessed_bytes, best.guessed_by)}, W016)" if best.guessed_bytes else ""
    return line + (f"; most saved by {best.change}: {format_bytes(best.delta_bytes or 0, signed=True)} "
                   f"({best.delta_pct or 0:+.1f}%){moved}{guess}")


def whatif_course(path: str, courses: Dict[int, DeviceCourse],
                  spans_steps: Dict[int, Tuple[List[PhaseSpan], List[Step]]], changes: Sequence[Change],
                  budget: Optional[int], host: Optional[CpuHost] = None,
                  overheads: Optional[Dict[int, Overhead]] = None,
                  stopped: Optional[Dict[int, int]] = None) -> WhatIf:
    """The WhatIf of a read run: each device replayed with each change (`host`: what a CPU capture
    says of the host it ran on; `overheads`: each device's reserved over allocated, which the budget
    is compared with the predicted peak times; `stopped`: the event of each device's first out-of-memory
    error, where its trace ends short of the step)."""
    overheads, stopped = overheads or {}, stopped or {}
    if not courses:
        raise InputError(path, "no device records any allocation: nothing to replay")
    devices = []
    for device in sorted(courses):
        course = courses[device]
        spans, steps = spans_steps[device]
        run = facts(course, spans, steps)
        run.host = host
        blocks = run.blocks
        optimizer = run_optimizer(run)[0]
        asked = list(changes) or every_change(optimizer)
        predictions = [predict(run, ch, budget, overheads[device].ratio if device in overheads else 1.0,
                               device in stopped) for ch in asked]
        if not changes:
            applied = sorted((p for p in predictions if p.applies), key=lambda p: (p.delta_bytes or 0, p.change))
            predictions = applied + [p for p in predictions if not p.applies]
        devices.append(DeviceWhatIf(device=device, base_peak_bytes=run.base.peak_bytes, base_peak_phase=run.base.phase,
                                    base_peak_step=run.base.step, blocks=blocks, optimizer=optimizer,
                                    changes=predictions,
                                    headline=headline(device, run.base.peak_bytes, run.base.phase, run.base.step,
                                                      blocks, optimizer, predictions),
                                    findings=_stopped(device, stopped, run) + guess_findings(device, predictions)
                                    + [finding("W014", device, change=p.change, why=p.reason or "")
                                       for p in predictions if not p.applies]))
    notes = [finding("W006")]
    ratio, said = budget_note(list(overheads.values()), "each predicted peak")
    # Names from the snapshot (module instances, the file) are made one line each here, once for every output.
    return scrubbed(WhatIf(file=path, budget_bytes=budget, asked=[c.text for c in changes], devices=devices,
                           notes=notes, overhead_ratio=None if budget is None else round(ratio, 4),
                           overhead_note=None if budget is None else said))


def whatif(path: str, changes: Sequence[str], rules: Sequence[Rule], budget: Optional[int] = None) -> WhatIf:
    """The WhatIf of a snapshot file with the changes given as text (none: every applicable one)."""
    parsed = [parse_change(t) for t in changes]
    for change in parsed:  # a pair the replay never combines is the user's to fix, said before the run is read
        given = {n for n, _ in change.parts}
        why = next((w for n, _ in change.parts for other, w in RULES[n].excludes if other in given), None)
        if why:
            raise InputError("--change", f"{change.text}: {why}")
    course = read_course(path, 1, rules)
    structures = {d: structure(course.summary, d) for d in course.devices}
    return whatif_course(path, course.devices, structures, parsed, budget, course.host,
                         overheads(path, course.summary.devices),
                         {d.device: d.oom_events[0].event_index for d in course.summary.devices if d.oom_events})


def _stopped(device: int, stopped: Dict[int, int], run: Run) -> List[Finding]:
    """W017 when the device's trace ends at an out-of-memory error."""
    if device not in stopped:
        return []
    b = run.base
    where = where_text(b.phase, b.step) if b.phase else "before the trace"
    return [finding("W017", device, event=stopped[device], phase=where)]


def overheads(path: str, devices: Sequence[DeviceSummary]) -> Dict[int, Overhead]:
    """Each device's reserved over allocated at its peak, where the run knows it; none for a CPU capture,
    which has no reserved memory."""
    measured = {d.device: device_overhead(d, f"{os.path.basename(path)} device {d.device}") for d in devices}
    return {device: o for device, o in measured.items() if o is not None}


def facts(course: DeviceCourse, spans: List[PhaseSpan], steps: List[Step]) -> Run:
    """One device of a run with every fact the rules read, its repeated blocks included."""
    run = read_run(course, spans, steps)
    run.blocks, run.block = blocks_of(run)
    return run
