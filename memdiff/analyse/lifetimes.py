"""lifetimes: when memory is held. Steps and phases of a trace, and the lifetime of each allocation.

Stacks alone cannot tell a gradient from a backward temporary (on CPU both are allocated under
`run_backward`), nor optimizer state from the update's temporaries; when they are allocated
and how long they live can. This stage cuts a device trace into steps and phases and gives
each allocation live at the peak its lifetime facts, which category rules may test:

- `born`: the phase its first version was allocated in (`forward`, `backward`, `optimizer`,
  `other`), or `before_trace`;
- `freed`: the phase its last version was freed in, or `never` (still live when the trace ends);
- `outlives`: `none` (freed inside the phase run it was born in), `phase` (outlived that run,
  freed inside its step), `step` (outlived its step) or `trace` (never freed);
- `call`: `freed` when the call into native code that allocated it freed it before returning
  (PyTorch's `temporary`: see calls.py); groups carry it only then.

Phases come from `record_function` annotations when the snapshot has them (`ProfilerStep#N`,
`Optimizer.step#...`, user scopes naming forward/backward/optimizer) and otherwise from the
stacks of the allocations, read in trace order: the autograd engine and backward nodes mean
backward, `torch/optim` and `zero_grad` mean optimizer, module forwards mean forward. An
allocation whose stack says nothing takes the phase around it. A step starts where the
forward (or backward) begins after an optimizer phase, or after a backward when the trace
has no optimizer phase at all (inference with gradients). An optimizer step that allocates
nothing (plain SGD's in-place update) is a phase run all the same where its scope, zero_grad's
frees or the in-place update's new versions show it (_with_silent_steps).
"""

from __future__ import annotations

import bisect
import re
from array import array
from dataclasses import dataclass, field
from typing import Any, Collection, Dict, Generic, List, Mapping, Optional, Sequence, Tuple, TypeVar

import numpy as np

from memdiff.analyse.calls import NO_CALLS, Calls, call_runs
from memdiff.model import PhaseSpan, Step
from memdiff.read.accel import ObjectCodes
from memdiff.read.frames import LIBRARY_PATH, MAX_STACK_FRAMES, STDLIB_PATH, PerFrames, profiler_frame

FORWARD, BACKWARD, OPTIMIZER, OTHER = "forward", "backward", "optimizer", "other"
PHASES = (FORWARD, BACKWARD, OPTIMIZER, OTHER)
SETUP = "setup"  # model construction and moves: a hint only, shown as phase `other`
CONTINUES = "continues"  # a hint only: a new version of a tensor stays in the phase it is in
BEFORE_TRACE, NEVER = "before_trace", "never"

# What a frame says about the phase, strongest first. Matched against "file:name" of a raw
# frame (just the name for profiler frames, whose name holds the file, and for C++ frames).
STACK_HINTS: Tuple[Tuple[str, "re.Pattern[str]"], ...] = (
    (BACKWARD, re.compile(r"run_backward|torch::autograd::Engine::|Backward\d*::apply|AccumulateGrad"
                          r"|torch/autograd/(__init__|graph)\.py\S*:\s?(backward|grad|_engine_run_backward)$")),
    # torch/optim/swa_utils.py is the loop's averaging of the weights (AveragedModel), no optimizer.
    # DeepSpeed's engine.step is the loop's optimizer step: ZeRO's gradient partitions, norms and
    # (offloaded) update run in it before, or without, any torch.optim frame.
    (OPTIMIZER, re.compile(r"torch/optim/(?!swa_utils\.py)|:\s?zero_grad$|torch/nn/utils/clip_grad\.py"
                           r"|deepspeed/runtime/engine\.py:\s?step$")),
    (FORWARD, re.compile(r":\s?forward$|^nn\.Module: |torch/nn/functional\.py")),
    (SETUP, re.compile(r":\s?(__init__|reset_parameters|_reset_parameters|_apply|to|cuda|to_empty|load_state_dict"
                       r"|_load_from_state_dict|from_pretrained|post_init|_init_weights|init_weights)$"
                       r"|torch/nn/init\.py")),
)
_RANK = {phase: rank for rank, (phase, _) in enumerate(STACK_HINTS)}

# Annotation scopes that name a phase (searched, case-insensitive), and the step scope.
SCOPE_HINTS: Tuple[Tuple[str, "re.Pattern[str]"], ...] = (
    (OPTIMIZER, re.compile(r"^Optimizer\.(step|zero_grad)#|optimi[sz]er", re.IGNORECASE)),
    (BACKWARD, re.compile(r"backward|\bbwd\b", re.IGNORECASE)),
    (FORWARD, re.compile(r"forward|\bfwd\b", re.IGNORECASE)),
)
STEP_SCOPE = re.compile(r"^ProfilerStep#(\d{1,18})$")  # a longer number is no step count

# Stack hints are read from at most this many allocations (evenly spaced), so a trace whose
# every event has its own frames list costs a bounded number of stack scans.
MAX_HINTS = 100_000
# Steps kept in a summary; the step at the peak is always kept.
MAX_STEPS = 1_000


@dataclass(frozen=True)
class Lifetime:
    """What a group's allocations share about when they were held (see the module docstring)."""

    born: str
    freed: str
    outlives: str
    call: str = "kept"

    def to_dict(self) -> Dict[str, str]:
        """The JSON form a group carries: `call` only when the call freed it (a key added within
        the summary's version, absent where nothing was told)."""
        out = {"born": self.born, "freed": self.freed, "outlives": self.outlives}
        if self.call == CALL_FREED:
            out["call"] = CALL_FREED
        return out

    def key(self) -> str:
        """The form hashed into a group's signature and shown in reports. Memory its call kept has
        the form it had before `call` was told, so that its groups keep their signatures."""
        return f"{self.born}>{self.freed}:{self.outlives}" + ("/call" if self.call == CALL_FREED else "")


@dataclass(frozen=True)
class StackHint:
    """What one stack says about its phase: the hint (None: nothing), and whether it shows memory
    that is no optimizer's work even inside an optimizer step's `record_function` scope: a backward
    (the autograd engine's frames, with no optimizer frame outside them), or code the step called
    back (`optimizer.step(closure)`)."""

    phase: Optional[str]
    outside_step: bool = False


_NO_HINT = StackHint(None)


@dataclass(frozen=True)
class _FrameFacts:
    phase: Optional[str]
    outside: bool  # Python source of neither torch nor the standard library
    optimizer_base: bool  # torch.optim.Optimizer's own wrappers (a custom step runs inside them)
    closure: bool  # named as a closure is (`closure`, Lightning's `_wrap_closure`)


class _Hints:
    """The phase hint of a raw frames list, cached per sequence of frame objects and per frame."""

    def __init__(self) -> None:
        self._lists: PerFrames[StackHint] = PerFrames(self._scan)
        self._frames: Dict[Tuple[Any, Any], _FrameFacts] = {}

    def of(self, frames: Any) -> Optional[str]:
        """The phase the stack says, None when it says nothing."""
        return self.scan(frames).phase

    def scan(self, frames: Any) -> StackHint:
        """The stack's hint, and whether it shows memory that is no optimizer's work."""
        if not frames or not isinstance(frames, list) or len(frames) > MAX_STACK_FRAMES:
            return _NO_HINT  # a longer stack is refused when it is grouped
        return self._lists.get(frames)

    def _facts(self, name: str, filename: Optional[str]) -> _FrameFacts:
        known = self._frames.get((name, filename))
        if known is None:
            text = _frame_text(name, filename)
            known = self._frames[(name, filename)] = _FrameFacts(
                frame_phase(name, filename), _outside_torch(name, filename), bool(_OPTIMIZER_BASE.search(text)),
                bool(CLOSURE_FRAME.search(name[:1000])))
        return known

    def _scan(self, frames: List[Any], _: Any) -> StackHint:
        """The strongest hint of the stack's frames (innermost first), but where the step called
        back into other code (`optimizer.step(closure)`: Lightning's automatic optimization,
        LBFGS), what that code did is not the optimizer's: the forward and the loss the closure
        computes take the hints of the frames inside the callback (none for the loss: the phase
        around it), and its backward stays a backward.

        A call back is a frame named as a closure is inside the innermost optimizer frame, or code
        outside torch inside one of torch's own optimizers' steps (`SGD.step` calling whatever it
        was handed). A custom optimizer's `step` is code outside torch too, but it runs inside
        `torch.optim.Optimizer`'s wrappers, and what it does is the optimizer's."""
        best: Optional[str] = None
        inner: Optional[str] = None  # the strongest hint before (inside) the first optimizer frame
        outside = closure = False  # code outside torch, a closure, inside the first optimizer frame
        called_back = False
        stepped = False  # an optimizer frame was met
        for raw in frames:
            if not isinstance(raw, dict):
                continue
            name, filename = raw.get("name"), raw.get("filename")
            if not isinstance(name, str):
                continue  # a malformed frame says nothing (the stack normalizer reports it)
            facts = self._facts(name, filename if isinstance(filename, str) else None)
            hint = facts.phase
            if hint == BACKWARD:
                # Outside an optimizer's frames: an optimizer run by a backward hook (optimizer in
                # backward) is the step's work, though the stack's strongest hint is the backward.
                return StackHint(BACKWARD, not stepped or called_back)
            if not stepped:
                if hint == OPTIMIZER:
                    stepped = True
                    called_back = closure or (outside and not facts.optimizer_base)
                else:
                    outside = outside or facts.outside
                    closure = closure or facts.closure
                    if hint is not None and (inner is None or _RANK[hint] < _RANK[inner]):
                        inner = hint
            if hint is not None and (best is None or _RANK[hint] < _RANK[best]):
                best = hint
        if stepped and (called_back or inner == FORWARD):
            # Construction inside a closure is the loop's bookkeeping (Lightning's ClosureResult),
            # no model being built: the phase around it.
            return StackHint(None if inner == SETUP and called_back else inner, outside_step=called_back)
        return StackHint(best)


def frame_phase(name: str, filename: Optional[str]) -> Optional[str]:
    """The phase one frame says its allocation happened in (STACK_HINTS), or None."""
    text = _frame_text(name, filename)
    for phase, pattern in STACK_HINTS:
        if pattern.search(text):
            return phase
    return None


def _frame_text(name: str, filename: Optional[str]) -> str:
    """"file:name" of a raw frame, just the name where that holds the file (profiler frames) or
    there is none (C++ frames), cut short: a hostile 60 KB name costs nothing more."""
    return (name if filename in (None, "", "none", "??") else f"{filename}:{name}")[:1000]


_TORCH_FILE = re.compile(r"(^|/)torch/")
# torch.optim.Optimizer's wrappers around every optimizer's `step` (the profiling scope, the hooks,
# `_use_grad`), as a frame's "file:name" or a profiler frame's name; DeepSpeed's engine.step, whose
# ZeRO optimizer (code outside torch) is the step's work, not a closure called back.
_OPTIMIZER_BASE = re.compile(r"torch/optim/optimizer\.py|deepspeed/runtime/engine\.py:\s?step$")
# A frame that runs a closure handed to `optimizer.step`: LBFGS's documented `def closure()`,
# Lightning's `Closure.closure` and `_wrap_closure`.
CLOSURE_FRAME = re.compile(r"(^|[_.:\s])closure$", re.IGNORECASE)


def _outside_torch(name: str, filename: Optional[str]) -> bool:
    """Whether a frame runs Python source of neither torch nor the standard library: the user's
    code or a framework's (a closure an optimizer step calls back into)."""
    if filename in (None, "", "none", "??"):
        match = profiler_frame(name[:1000])
        filename = match.group("file") if match else None
    if not filename or not filename.endswith(".py") or _TORCH_FILE.search(filename):
        return False
    return bool(LIBRARY_PATH.search(filename)) or not STDLIB_PATH.search(filename)


V = TypeVar("V")


class _Intervals(Generic[V]):
    """Time intervals with a value each, for asking which innermost one holds a time.

    record_function scopes nest, so each interval keeps the nearest earlier interval that
    still holds its start (its parent); a lookup walks up from the last interval started
    before the time, a few steps rather than back over every interval of a long trace.
    """

    def __init__(self, intervals: List[Tuple[int, float, V]]) -> None:
        self.items = sorted(intervals, key=lambda item: (item[0], item[1]))
        self._starts = [start for start, _, _ in self.items]
        self._parents: List[int] = []
        open_: List[int] = []
        for k, (start, _, _) in enumerate(self.items):
            while open_ and self.items[open_[-1]][1] < start:
                open_.pop()
            self._parents.append(open_[-1] if open_ else -1)
            open_.append(k)

    def at(self, time_us: Any) -> Optional[V]:
        """The value of the innermost interval holding `time_us`, if any."""
        if not isinstance(time_us, int) or not self.items:
            return None
        k = bisect.bisect_right(self._starts, time_us) - 1
        while k >= 0 and self.items[k][1] < time_us:
            k = self._parents[k]
        return self.items[k][2] if k >= 0 else None


class Scopes:
    """`record_function` scopes of one device (external_annotations), for looking up by time."""

    def __init__(self, annotations: Sequence[Any], device: int) -> None:
        opened: Dict[str, List[int]] = {}
        intervals: List[Tuple[int, float, str]] = []
        usable = [a for a in annotations if isinstance(a, dict) and a.get("device", device) == device
                  and isinstance(a.get("time_us"), int) and isinstance(a.get("name"), str)]
        for a in sorted(usable, key=lambda a: a["time_us"]):
            name = a["name"]
            if a.get("stage") == "START":
                opened.setdefault(name, []).append(a["time_us"])
            elif a.get("stage") == "END" and opened.get(name):
                intervals.append((opened[name].pop(), a["time_us"], name))
        # A scope still open at the dump lasts to the end.
        intervals += [(start, float("inf"), name) for name, starts in opened.items() for start in starts]
        self._all = _Intervals(intervals)
        self.names = sorted({name for _, _, name in intervals})  # each scope's name once
        self.steps = sorted((start, end, int(m.group(1))) for start, end, name in intervals
                            for m in [STEP_SCOPE.match(name)] if m)
        # Scopes repeat a few names (one per layer and step), each read once.
        phase_of = {name: _scope_phase(name) for name in {name for _, _, name in intervals}}
        self._phases = _Intervals([(start, end, phase) for start, end, name in intervals
                                   if (phase := phase_of[name])])
        self.has_phases = bool(self._phases.items)
        self._optimizer_ends = _Intervals([(start, end, end) for start, end, phase in self._phases.items
                                           if phase == OPTIMIZER])

    def innermost(self, time_us: Optional[int]) -> Optional[str]:
        """The most recently opened scope still open at `time_us`, if any."""
        return self._all.at(time_us)

    def phase_intervals(self) -> List[Tuple[int, float, str]]:
        """(start, end, phase) of every scope that names a phase."""
        return self._phases.items

    def phase_at(self, time_us: Any) -> Optional[str]:
        """The phase named by the innermost phase scope open at `time_us`."""
        return self._phases.at(time_us)

    def optimizer_end_at(self, time_us: Any) -> Optional[float]:
        """When the innermost optimizer scope open at `time_us` closes (inf: never), if one is."""
        return self._optimizer_ends.at(time_us)


def _scope_phase(name: str) -> Optional[str]:
    name = name[:1000]  # scope names are short; a hostile 1 MB one costs nothing more
    for phase, pattern in SCOPE_HINTS:
        if pattern.search(name):
            return phase
    return None


def _fill(labels: List[Optional[str]]) -> List[str]:
    """Unlabelled allocations take the phase after them when a forward follows (the batch made
    before a forward belongs to it, not to the last update or the last micro-batch's backward),
    else the phase before them (a loss computed after the forward), else the one after."""
    out: List[Optional[str]] = list(labels)
    following: Optional[str] = None
    nxt: List[Optional[str]] = [None] * len(out)
    for k in range(len(out) - 1, -1, -1):
        if out[k] not in (None, CONTINUES):
            following = out[k]
        nxt[k] = following
    previous: Optional[str] = None
    for k, label in enumerate(out):
        if label == CONTINUES:
            out[k] = previous
        elif label is None:
            out[k] = nxt[k] if nxt[k] == FORWARD or previous in (None, SETUP) else previous
        else:
            previous = label
    return [OTHER if (p is None or p == SETUP) else p for p in out]


def _runs(positions: Sequence[int], labels: Sequence[str]) -> List[Tuple[str, int]]:
    """(phase, first position) of each run of equal labels; a run of one sampled allocation between
    two runs of the same phase is absorbed (a stray stack is not a phase)."""
    runs: List[List[Any]] = []
    for pos, label in zip(positions, labels):
        if runs and runs[-1][0] == label:
            runs[-1][2] += 1
        else:
            runs.append([label, pos, 1])
    merged: List[List[Any]] = []
    k = 0
    while k < len(runs):
        run = runs[k]
        if merged and run[2] == 1 and k + 1 < len(runs) and runs[k + 1][0] == merged[-1][0]:
            merged[-1][2] += 1 + runs[k + 1][2]
            k += 2
            continue
        if merged and merged[-1][0] == run[0]:
            merged[-1][2] += run[2]
        else:
            merged.append(list(run))
        k += 1
    return [(label, pos) for label, pos, _ in merged]


def _inferred_step_starts(phases: List[str]) -> List[int]:
    """Indices of the runs where a step begins: the first forward, backward or optimizer run, then
    each forward or backward run after an optimizer run (after a backward run when the trace has
    no optimizer run), except a backward that follows its step's forward with only an optimizer
    run between (zero_grad called between forward and backward); in a trace with optimizer runs a
    step runs a backward (_with_backwards). `other` runs stay in the step around them."""
    ends_step = OPTIMIZER if OPTIMIZER in phases else BACKWARD
    starts: List[int] = []
    previous: Optional[str] = None
    forward_only = False  # the step so far has run a forward and no backward
    for k, phase in enumerate(phases):
        if phase == OTHER:
            continue
        # An optimizer run between a forward and its backward is `zero_grad` called there (in
        # place with set_to_none=False): the backward after it continues the step.
        continues = phase == BACKWARD and ends_step == OPTIMIZER and forward_only
        if not starts or (previous == ends_step and phase != ends_step and not continues):
            starts.append(k)
        if phase != OPTIMIZER:
            forward_only = phase == FORWARD
        previous = phase
    return _with_backwards(starts, phases) if ends_step == OPTIMIZER else starts


def _with_backwards(starts: List[int], phases: List[str]) -> List[int]:
    """Step starts such that every step of a training loop runs a backward: a would-be step with
    none (a forward cut from its backward by an optimizer run inside it, a validation loop between
    steps) opens the step that follows it; after the last step (a validation loop after training)
    it belongs to the step before."""
    out: List[int] = []
    j = 0
    while j < len(starts):
        k, nxt = starts[j], j + 1
        while nxt < len(starts) and BACKWARD not in phases[k: starts[nxt]]:
            nxt += 1
        if out and BACKWARD not in phases[k: starts[nxt] if nxt < len(starts) else len(phases)]:
            break  # the trace ends without a backward: the step before holds it
        out.append(k)
        j = nxt
    return out


@dataclass
class Passes:
    """Forward passes inside forward runs: where each starts and ends, and which code it runs.

    A validation loop without torch.no_grad() runs one forward per batch with nothing between
    (no backward, no optimizer step), so its forwards are one phase run of one step; what each
    forward made and the next still finds live is kept memory all the same. A pass starts where
    the loop's own code (an allocation whose stack names no model forward: the batch made or
    copied to the device) allocates with the very stack that started the run, after the model
    allocated since the last start; passes that start with one stack run the same code.
    A run whose first allocation is the model's own has one pass: nothing tells its forwards apart.
    """

    starts: List[int]  # first event of each pass, ascending
    ends: List[int]  # last event of each
    codes: List[int]  # passes with one code run the same code

    def at(self, event: int) -> Optional[int]:
        """Index of the pass holding `event`, None when no pass holds it."""
        k = bisect.bisect_right(self.starts, event) - 1
        return k if k >= 0 and event <= self.ends[k] else None

    def later(self, k: int, event: int) -> bool:
        """Whether a pass of pass `k`'s code started after pass `k` and at or before `event`."""
        j = k + 1
        while j < len(self.starts) and self.starts[j] <= event:
            if self.codes[j] == self.codes[k]:
                return True
            j += 1
        return False


@dataclass
class Timeline:
    """Phase runs and steps of one device trace, with lookups by event index."""

    runs: List[PhaseSpan]
    steps: List[Step]
    _run_starts: List[int]
    _run_step: List[Optional[int]]  # index into steps of each run (None: outside any step)
    passes: Passes = field(default_factory=lambda: Passes([], [], []))
    # Per event, the call (an op, a backward node) it falls in (calls.py); empty: none told.
    calls: Calls = NO_CALLS

    def run_at(self, event: int) -> int:
        """Index of the phase run that holds `event`."""
        return max(0, bisect.bisect_right(self._run_starts, event) - 1)

    def phase_at(self, event: int) -> str:
        """The phase an event falls in."""
        return self.runs[self.run_at(event)].phase if self.runs else OTHER

    def step_index_at(self, event: int) -> Optional[int]:
        """Index into `steps` of the step holding `event`, None when outside every step."""
        return self._run_step[self.run_at(event)] if self.runs else None

    def step_at(self, event: int) -> Optional[int]:
        """The step number of an event, None when outside every step."""
        k = self.step_index_at(event)
        return None if k is None else self.steps[k].step

    def lifetime(self, born_event: Optional[int], end_event: int, n_events: int) -> Lifetime:
        """Lifetime facts of an allocation opened at `born_event` (None: before the trace) and
        closed at `end_event` (`n_events`: never closed)."""
        born = np.array([-1 if born_event is None else born_event], dtype=np.int64)
        return LIFETIMES[int(self.lifetime_codes(born, np.array([end_event], dtype=np.int64), n_events)[0])]

    def lifetime_codes(self, born: np.ndarray, end: np.ndarray, n_events: int) -> np.ndarray:
        """`lifetime` of many allocations at once, as indices into LIFETIMES: `born` holds each one's
        first event (-1: before the trace), `end` the event that frees it (`n_events`: never)."""
        never = end >= n_events
        before = born < 0
        if not self.runs:
            born_phase = np.full(len(born), _PHASE_INDEX[OTHER])
            freed_phase = np.where(never, len(PHASES), _PHASE_INDEX[OTHER])
            outlives = np.where(never, _OUTLIVES_INDEX["trace"], _OUTLIVES_INDEX["none"])
        else:
            starts = np.asarray(self._run_starts, dtype=np.int64)
            run_phase = np.array([_PHASE_INDEX[r.phase] for r in self.runs])
            run_end = np.array([r.end_event for r in self.runs], dtype=np.int64)
            # A run outside every step ends its own "step": outliving it is outliving the step.
            step_end = np.array([-1 if k is None else self.steps[k].end_event for k in self._run_step], dtype=np.int64)
            born_run = np.maximum(np.searchsorted(starts, born, side="right") - 1, 0)
            end_run = np.maximum(np.searchsorted(starts, np.minimum(end, n_events - 1), side="right") - 1, 0)
            born_phase = run_phase[born_run]
            freed_phase = np.where(never, len(PHASES), run_phase[end_run])
            outlives = np.select([end <= run_end[born_run], end <= step_end[born_run]],
                                 [_OUTLIVES_INDEX["none"], _OUTLIVES_INDEX["phase"]], _OUTLIVES_INDEX["step"])
            outlives = np.where(never, _OUTLIVES_INDEX["trace"], outlives)
        # Memory from before the trace: "trace" when never freed, else "none" (its birth is unknown).
        born_phase = np.where(before, len(PHASES), born_phase)
        outlives = np.where(before, np.where(never, _OUTLIVES_INDEX["trace"], _OUTLIVES_INDEX["none"]), outlives)
        in_call = self.calls.freed_inside(born, end).astype(np.int64)
        return ((born_phase * (len(PHASES) + 1) + freed_phase) * len(OUTLIVES) + outlives) * len(CALLS) + in_call


OUTLIVES = ("none", "phase", "step", "trace")
CALL_KEPT, CALL_FREED = "kept", "freed"
CALLS = (CALL_KEPT, CALL_FREED)  # indexed by whether the call that allocated it freed it
_PHASE_INDEX = {phase: k for k, phase in enumerate(PHASES)}
_OUTLIVES_INDEX = {name: k for k, name in enumerate(OUTLIVES)}
# Every lifetime, indexed as Timeline.lifetime_codes numbers them.
LIFETIMES = [Lifetime(born, freed, outlives, call) for born in PHASES + (BEFORE_TRACE,) for freed in PHASES + (NEVER,)
             for outlives in OUTLIVES for call in CALLS]


def build_timeline(trace: List[Any], allocs: Sequence[int], running: np.ndarray, static: int, scopes: Scopes,
                   versions: Optional[Mapping[int, int]] = None) -> Timeline:
    """Steps and phase runs of one device trace.

    `allocs` are the trace's alloc event indices in order, `running` the running total after
    each event (static memory excluded), so each run's peak comes from one numpy max, and
    `versions` maps the allocs that are new versions of a tensor (they stay in the phase around them)
    to the alloc they continue, or to -(f + 1) for the unmatched free f of a tensor older than the trace.
    """
    n = len(trace)
    if n == 0 or not len(allocs):
        return Timeline([], [], [], [])
    versions = versions or {}
    hints = _Hints()
    stride = -(-len(allocs) // MAX_HINTS)
    positions = list(range(0, len(allocs), stride))
    labels: List[Optional[str]] = []
    for k in positions:
        e = trace[allocs[k]]
        label = scopes.phase_at(e.get("time_us")) if scopes.has_phases else None
        if label == OPTIMIZER:
            # The step's scope also holds what a closure it calls back computes: its forward and
            # backward are theirs (Lightning runs every training_step so).
            hint = hints.scan(e.get("frames"))
            if hint.outside_step:
                label = hint.phase
        labels.append(label or (CONTINUES if allocs[k] in versions else hints.of(e.get("frames"))))
    runs = _runs([allocs[k] for k in positions], _fill(labels))
    runs[0] = (runs[0][0], 0)  # the first run starts with the trace
    runs = _with_silent_steps(trace, allocs, runs, scopes, hints, versions)
    bounds = _annotated_step_bounds(trace, scopes)
    if bounds:
        runs = _split_at(runs, [b for b, _ in bounds])
        run_starts = [start for _, start in runs]
        step_starts = [(bisect.bisect_left(run_starts, b), number) for b, number in bounds]
    else:
        step_starts = [(k, number) for number, k in enumerate(_inferred_step_starts([p for p, _ in runs]))]
    spans = [PhaseSpan(phase, start, (runs[k + 1][1] - 1) if k + 1 < len(runs) else n - 1)
             for k, (phase, start) in enumerate(runs)]
    for span in spans:
        window = running[span.start_event: span.end_event + 1]
        top = int(window.argmax())
        span.peak_event_index = span.start_event + top
        span.peak_bytes = static + int(window[top])
    steps: List[Step] = []
    run_step: List[Optional[int]] = [None] * len(spans)
    for j, (first, number) in enumerate(step_starts):
        last = step_starts[j + 1][0] if j + 1 < len(step_starts) else len(spans)
        if first >= last:
            continue
        for k in range(first, last):
            run_step[k] = len(steps)
        steps.append(Step(number, spans[first].start_event, spans[last - 1].end_event, spans[first:last]))
    return Timeline(spans, steps, [s.start_event for s in spans], run_step,
                    forward_passes(trace, allocs, spans, versions, hints), call_runs(trace))


def _with_silent_steps(trace: List[Any], allocs: Sequence[int], runs: List[Tuple[str, int]], scopes: Scopes,
                      hints: "_Hints", versions: Mapping[int, int]) -> List[Tuple[str, int]]:
    """Runs with an optimizer run added after each backward run not followed by one, where the
    trace shows an optimizer step that allocated nothing (plain SGD's update is in place): from
    the first event after the backward's last allocation of its own that falls in an optimizer
    scope opened since (`Optimizer.step#SGD.step`, `Optimizer.zero_grad#...`), that comes after the
    optimizer scope the backward ran in closes (a closure's backward, which the step then follows
    with its update: Lightning's automatic optimization), that frees memory
    from a stack of the optimizer's (`zero_grad` setting the gradients to None), or that writes a
    new version of memory older than the trace (the profiler route's record of a weight updated
    in place), to the next run."""
    starts = sorted(start for start, _, phase in scopes.phase_intervals() if phase == OPTIMIZER)
    older: Dict[int, bool] = {}  # version alloc -> whether its first version is older than the trace
    stacks_left = MAX_HINTS  # frees whose stacks are read, as for the allocations' hints
    out: List[Tuple[str, int]] = []
    for k, (phase, first) in enumerate(runs):
        out.append((phase, first))
        end = runs[k + 1][1] if k + 1 < len(runs) else len(trace)
        if phase != BACKWARD or (k + 1 < len(runs) and runs[k + 1][0] == OPTIMIZER):
            continue
        j = bisect.bisect_left(allocs, end) - 1
        while j > 0 and allocs[j] > first and allocs[j] in versions:
            j -= 1
        last = allocs[j]  # the backward's last allocation that is no new version of a tensor
        opened_at = trace[last].get("time_us") if isinstance(trace[last], dict) else None
        scope = bisect.bisect_right(starts, opened_at) if isinstance(opened_at, int) else len(starts)
        closes = scopes.optimizer_end_at(opened_at)
        for i in range(last + 1, end):
            e = trace[i]
            if not isinstance(e, dict):
                continue
            time_us, action = e.get("time_us"), e.get("action")
            freed_by_step = False
            if action in ("free_requested", "free_completed") and stacks_left > 0:
                stacks_left -= 1
                freed_by_step = hints.of(e.get("frames")) == OPTIMIZER
            at = time_us if isinstance(time_us, int) else None
            if freed_by_step or (scope < len(starts) and at is not None and at >= starts[scope]) or \
                    (closes is not None and at is not None and at >= closes) or \
                    (action == "alloc" and i in versions and _older_than_trace(i, versions, older)):
                out.append((OPTIMIZER, i))
                break
    return out


def _older_than_trace(alloc: int, versions: Mapping[int, int], known: Dict[int, bool]) -> bool:
    """Whether the first version of the tensor that alloc event `alloc` re-versions was live
    before the trace (an unmatched free, numbered below 0 in `versions`)."""
    chain = []
    j = alloc
    while j in versions and j not in known:
        chain.append(j)
        j = versions[j]
    answer = known[j] if j in known else j < 0
    for c in chain:
        known[c] = answer
    return answer


def forward_passes(trace: List[Any], allocs: Sequence[int], runs: Sequence[PhaseSpan], versions: Collection[int],
                   hints: "_Hints") -> Passes:
    """The forward passes of each forward run (see Passes); a run holds one pass at least.

    A run's first stack (its first allocation with frames that is not a new version) starts a
    pass; when that stack is not the model's own (a loop's, a data step's), each later allocation
    with an equal stack starts another pass, provided the model allocated since the last start."""
    starts: List[int] = []
    ends: List[int] = []
    codes: List[int] = []
    code_stacks: List[Any] = []  # the stack that starts the passes of each code

    def code_of(frames: Any) -> int:
        for code, known in enumerate(code_stacks):
            if known is frames or known == frames:
                return code
        code_stacks.append(frames)
        return len(code_stacks) - 1
    ordered = np.frombuffer(allocs, dtype=np.int64) if isinstance(allocs, array) else np.asarray(allocs, np.int64)
    renewed = np.fromiter(versions, np.int64, len(versions))
    stacks = ObjectCodes(trace, "frames")
    # Per distinct stack, decided once: whether it has frames, whether it is the model's.
    framed = model = np.zeros(0, dtype=bool)
    same: Dict[int, np.ndarray] = {}  # per code of a run's first stack: which stacks equal it
    for run in runs:
        if run.phase != FORWARD:
            continue
        events = ordered[bisect.bisect_left(allocs, run.start_event): bisect.bisect_right(allocs, run.end_event)]
        found = stacks.at(events)
        new = stacks.objects[len(framed):]
        if new:
            framed = np.concatenate((framed, np.array([bool(o) for o in new], dtype=bool)))
            model = np.concatenate((model, np.array([hints.of(o) == FORWARD for o in new], dtype=bool)))
        usable = np.flatnonzero(framed[found] & ~np.isin(events, renewed))
        if not len(usable):
            continue
        first_code = int(found[usable[0]])
        first = stacks.objects[first_code]
        starts.append(run.start_event)
        codes.append(code_of(first))
        if hints.of(first) not in (FORWARD, BACKWARD):
            equal = same.get(first_code, np.zeros(0, dtype=bool))
            if len(equal) < len(framed):
                equal = same[first_code] = np.concatenate((equal, np.array(
                    [o is first or (type(o) is type(first) and o == first) for o in stacks.objects[len(equal):]],
                    dtype=bool)))
            rest = found[usable[1:]]
            # The model's allocations so far, at each later allocation (first's stack is not the model's).
            seen = np.cumsum(model[rest])
            again = np.flatnonzero(equal[rest])  # later allocations with first's stack
            seen_again = seen[again]  # ascending: the next pass starts at the first one above the count
            count, k = 0, 0
            while True:
                k += int(np.searchsorted(seen_again[k:], count, side="right"))
                if k >= len(again):
                    break
                i = int(events[usable[1 + again[k]]])
                ends.append(i - 1)
                starts.append(i)
                codes.append(codes[-1])
                count = int(seen_again[k])
        ends.append(run.end_event)
    return Passes(starts, ends, codes)


def _annotated_step_bounds(trace: List[Any], scopes: Scopes) -> List[Tuple[int, int]]:
    """(first event, step number) of each `ProfilerStep#N` scope, when events carry times."""
    if not scopes.steps:
        return []
    times: List[Any] = [e.get("time_us") if isinstance(e, dict) else None for e in trace]
    if not all(isinstance(t, int) for t in times):
        return []
    bounds: List[Tuple[int, int]] = []
    for start, _, number in scopes.steps:
        event = bisect.bisect_left(times, start)
        if event < len(trace) and (not bounds or event > bounds[-1][0]):
            bounds.append((event, number))
    return bounds


def _split_at(runs: List[Tuple[str, int]], events: Sequence[int]) -> List[Tuple[str, int]]:
    """Runs cut at each of `events` (ascending), so that every step begins with a run of its own."""
    out: List[Tuple[str, int]] = []
    j = 0
    for k, (phase, start) in enumerate(runs):
        end = runs[k + 1][1] if k + 1 < len(runs) else float("inf")
        out.append((phase, start))
        while j < len(events) and events[j] < end:
            if events[j] > start:
                out.append((phase, events[j]))
            j += 1
    return out
