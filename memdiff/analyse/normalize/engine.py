"""normalize: Snapshot -> Summary, with the peak counted as PyTorch's Active Memory Timeline counts it.

Rules (../shared/docs/snapshot-format.md, "The peak"):
1. Walk one device's trace in order; `alloc` opens an allocation at its address and
   `free_completed` closes the open one there. `free_requested` alone changes nothing.
2. Static memory, live from the start: a `free_completed` with no open allocation (its alloc
   fell out of the ring buffer), and `active_allocated` blocks at dump time with no open
   allocation at their address after the walk (`requested_size` bytes).
3. Requested bytes throughout. 4. The peak is the largest running total.

Every byte live at the peak lands in exactly one group, so groups add up to the peak.
"""

from __future__ import annotations

import bisect
import itertools
import re
from array import array
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import numpy as np

from memdiff import __version__
from memdiff.accel import is_columns
from memdiff.classify import Rule
from memdiff.errors import InputError, brief, number
from memdiff.frames import (
    GUESS_PARAMETER,
    GUESS_STATE,
    GUESS_WORKSPACE,
    Stack,
    StackNormalizer,
    frames_lists,
    number_compiled_buffers,
    relativize,
    signature_of,
)
from memdiff.history import Allocations, history_of, peak_bars, window_maxima
from memdiff.lifetimes import (
    BACKWARD,
    FORWARD,
    LIFETIMES,
    MAX_STEPS,
    OPTIMIZER,
    Lifetime,
    Scopes,
    Timeline,
    build_timeline,
    frame_phase,
)
from memdiff.load import MAX_BYTES, Snapshot
from memdiff.model import KIND_KEY, WINDOW_KEY, DeviceSummary, Group, OomEvent, PhasePeak, Step, Summary, largest_first

TIMELINE_POINTS = 100
# Groups kept per peak. Real runs have tens to hundreds (the 13 shared snapshots: at most 27); a
# file with hundreds of thousands of distinct stacks live at once would make a summary of
# hundreds of MB, so past this the smallest are folded into one group per lifetime.
MAX_GROUPS = 10_000
# ...and so are the groups past this many frames in all: stacks sharing a long frame list
# through pickle memo references make thousands of distinct 500-frame stacks from 100 KB, whose
# summary was hundreds of MB and took a minute to classify and write. Real peaks hold hundreds
# of frames (the 13 shared snapshots: at most 634).
MAX_GROUP_FRAMES = 100_000
FOLDED = "<{:,} smaller stacks>"


@dataclass
class _Live:
    """One allocation live at the peak, as grouping needs it."""

    frames: Optional[List[Any]]
    size: int
    freed: bool  # `frames` is the stack of the free standing in for the allocation's
    before_trace: bool
    entry: Optional[Dict[str, Any]]  # the alloc entry when it is in the trace
    born_event: int  # its first version's alloc event; -1 before the trace
    end_event: int  # the event that frees its last version; the trace length when never freed
    earlier: bool  # allocated in a step before the peak's, or by a forward that one of the same code followed
    reached_peak: bool = False  # the allocation whose event is the peak
    # The forward pass (lifetimes.Passes) that made it, when a pass of the same code ran after it
    # in the same step before the moment: kept from an earlier forward. None otherwise.
    earlier_pass: Optional[int] = None
    # The category guessed for memory live before the trace with no stack, no freeing and no update
    # telling what it is (GUESS_PARAMETER or GUESS_STATE); None when something tells.
    guess: Optional[str] = None
    lifetime: Lifetime = LIFETIMES[0]  # filled in for all items at once


@dataclass
class _Slot:
    """The live allocations of one stack and lifetime, gathered into a group."""

    stack: Stack
    lifetime: Lifetime
    count: int = 0
    bytes: int = 0
    earlier_bytes: int = 0  # allocated in a step before the peak's, or kept from an earlier forward
    forward_bytes: int = 0  # of which kept from an earlier forward of the same code in the peak's step
    passes: Set[int] = field(default_factory=set)  # the earlier forwards those come from
    allocations: List[Tuple[int, int, int]] = field(default_factory=list)  # (first event, end event, bytes)


# compile_context values that mean "not compiled"
NO_COMPILE_CONTEXT = ("", "N/A", None)


# Segment events and the sign they change the reserved total by.
SEGMENT_ACTIONS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
# The actions _Walk tells apart, as the accelerator's walk numbers them.
_ACTION_CODES = {"alloc": 1, "free_completed": 2, "oom": 3, "annotate": 4, **{a: 5 for a in SEGMENT_ACTIONS}}


def _reserved(path: str, device: int, trace: List[Dict[str, Any]], events: Sequence[int], at_dump: Optional[int],
              peak_index: Optional[int], peak: int) -> Tuple[Optional[int], Optional[int]]:
    """(the highest reserved total over the trace, reserved minus allocated at the peak).

    The segments at dump time are exact; walking the trace's segment events back from them gives
    the reserved total before the trace and after every event. (None, None) without segments
    (the profiler route), or when the events and the segments disagree (more freed than held:
    a trace cut at both ends), since no figure could be trusted then."""
    if at_dump is None or (not at_dump and not events):
        return None, None
    steps: List[int] = []
    moved = 0
    for i in events:
        size = trace[i].get("size")
        if size.__class__ is not int or not 0 <= size <= MAX_BYTES:
            raise InputError(path, f"device_traces[{device}][{i}]: 'size' is {brief(size)}, not a segment's bytes")
        moved += size
        if moved > MAX_BYTES:  # the running total must stay inside int64
            raise InputError(path, f"device {device}: segment sizes add up to more than {MAX_BYTES:,} bytes")
        steps.append(SEGMENT_ACTIONS[trace[i]["action"]] * size)
    # The reserved total changes only at segment events (ascending): its running values there,
    # and 0 at the events before the first, are all the totals the trace goes through.
    totals = list(itertools.accumulate(steps))
    if len(trace) and (not events or events[0] > 0):
        totals.append(0)
    start = at_dump - (sum(steps) if len(trace) else 0)
    if start < 0 or (totals and start + min(totals) < 0):
        return None, None
    highest = max(start, start + max(totals) if totals else start)
    if peak_index is not None:
        k = bisect.bisect_right(events, peak_index)
        then = start + (sum(steps[:k]) if k else 0)
    else:
        then = start
    return highest, (then - peak if then >= peak else None)


class _Walk:
    """One pass over a device trace: what was opened, closed and never matched.

    Per-event numbers live in array('q'): 8 bytes a slot and no int objects, so a
    million-event trace costs 16 MB here, and numpy reads them without copying.
    """

    def __init__(self, path: str, device: int, trace: List[Dict[str, Any]], reversions: bool = False) -> None:
        n = len(trace)
        self.path, self.device = path, device
        self._accumulated = False  # deltas hold the running totals (running_totals)
        self.open_at_end: Dict[int, int] = {}  # address -> alloc event index
        self.ooms: List[int] = []
        self.annotations: List[int] = []  # `annotate` events: a label attached to a live allocation
        self.segment_events: List[int] = []  # cudaMalloc/cudaFree (or map/unmap) of the allocator's segments
        # Profiler-route re-versions: alloc event -> the alloc it continues (>= 0), or -(f + 1)
        # for an unmatched free f; and free event -> the alloc that continues it.
        self.version_of: Dict[int, int] = {}
        self.continued_by: Dict[int, int] = {}
        if not reversions and is_columns(trace) and self._walk_columns(trace):
            self._check_sizes(path, device, trace)
            return
        self.deltas = deltas = array("q", bytes(8 * n))  # running-total change at each event
        self.closed = closed = array("q", [n]) * n  # alloc event -> its free_completed event (n: never)
        self.allocs = allocs = array("q")  # alloc event indices, ascending
        self.unmatched = unmatched = array("q")  # free_completed events with no open allocation
        last_free = last_closed = -2
        live = self.open_at_end
        open_alloc, close_alloc, add_alloc, add_unmatched = live.__setitem__, live.pop, allocs.append, unmatched.append
        i = -1
        try:
            # The hot loop of memdiff: plain locals, and array('q') itself rejects a size that
            # is not an integer (TypeError), which the handler below turns into a message.
            for e in trace:
                i += 1
                action = e["action"]
                if action == "alloc":
                    # A reused address that is still open leaves the older allocation open for
                    # good, as PyTorch's viewer does.
                    deltas[i] = e["size"]
                    open_alloc(e["addr"], i)
                    add_alloc(i)
                    if last_free == i - 1 and reversions and _is_reversion(trace[i - 1], e):
                        self.version_of[i] = last_closed
                        self.continued_by[i - 1] = i
                elif action == "free_completed":
                    j = close_alloc(e["addr"], None)
                    if j is None:
                        deltas[i] = -e["size"]
                        add_unmatched(i)
                        last_closed = -(i + 1)
                    else:
                        closed[j] = i
                        deltas[i] = -deltas[j]
                        last_closed = j
                    last_free = i
                elif action == "oom":
                    self.ooms.append(i)
                elif action == "annotate":
                    self.annotations.append(i)
                elif action in SEGMENT_ACTIONS:
                    self.segment_events.append(i)
        except KeyError as exc:
            raise InputError(path, f"device_traces[{device}][{i}]: missing {exc}") from None
        except (TypeError, AttributeError, OverflowError) as exc:
            reason: Exception = exc
            size = trace[i].get("size") if isinstance(trace[i], dict) else None
            if isinstance(trace[i], dict) and (size.__class__ is not int):
                reason = TypeError(f"'size' is {brief(size)}, not an integer")
            raise InputError(path, f"device_traces[{device}][{i}]: {reason}") from None
        self._check_sizes(path, device, trace)

    def _walk_columns(self, trace: Any) -> bool:
        """The loop above run by the accelerator over its columns; False when an entry is not
        plain (a missing key, a value of another type), and the loop above says what."""
        n = len(trace)
        self.deltas, self.closed = array("q", [0]) * n, array("q", [n]) * n
        self.allocs, self.unmatched = array("q"), array("q")
        done = trace.walk(_ACTION_CODES, self.deltas, self.closed, self.allocs, self.unmatched)
        if done is None:
            return False
        self.open_at_end, self.ooms, self.annotations, self.segment_events = done
        return True

    def _check_sizes(self, path: str, device: int, trace: List[Dict[str, Any]]) -> None:
        # A negative size would read as memory freed by an allocation: checked once over the
        # arrays rather than in the hot loop above.
        deltas, allocs, unmatched, n = self.deltas, self.allocs, self.unmatched, len(trace)
        if n:
            d = np.frombuffer(deltas, dtype=np.int64)
            opened = np.frombuffer(allocs, dtype=np.int64) if len(allocs) else np.zeros(0, np.int64)
            freed = np.frombuffer(unmatched, dtype=np.int64) if len(unmatched) else np.zeros(0, np.int64)
            negative = np.concatenate([opened[d[opened] < 0], freed[d[freed] > 0]])
            if len(negative):
                k = int(negative.min())
                raise InputError(path, f"device_traces[{device}][{k}].size: {number(trace[k]['size'])} is not a size "
                                       f"in bytes (0 to {MAX_BYTES:,})")

    def running_totals(self) -> np.ndarray:
        """The running total after each event (static memory excluded), computed once in the place
        of the per-event changes (deltas_at still gives them): a second int64 array the length of
        the trace would be 8 more bytes an event at the peak of a big snapshot's read."""
        totals = np.frombuffer(self.deltas, dtype=np.int64) if len(self.deltas) else np.zeros(0, np.int64)
        if not self._accumulated:
            # Sizes that could add up past int64 are no real trace (and would wrap).
            if _absolute_sum(totals) > MAX_BYTES:
                raise InputError(self.path, f"device {self.device}: sizes add up to more than {MAX_BYTES:,} bytes: "
                                            "not a real snapshot")
            np.cumsum(totals, out=totals)
            self._accumulated = True
        return totals

    def deltas_at(self, events: np.ndarray) -> np.ndarray:
        """The running total's change at each of `events` (an alloc's size, minus a free's)."""
        values = np.frombuffer(self.deltas, dtype=np.int64) if len(self.deltas) else np.zeros(0, np.int64)
        events = np.asarray(events, dtype=np.int64)
        if not self._accumulated:
            return values[events]
        before = np.where(events > 0, values[np.maximum(events - 1, 0)], 0) if len(events) else events
        return values[events] - before

    def origin(self, j: int) -> Tuple[Optional[int], Optional[int]]:
        """(first version's alloc event, None) of the allocation opened at `j`, or (None, the
        unmatched free) when its first version was live before the trace."""
        while j in self.version_of:
            j = self.version_of[j]
            if j < 0:
                return None, -j - 1
        return j, None

    def end(self, closing: int) -> int:
        """The event that really frees an allocation whose version is closed at `closing` (the
        trace length when it is never freed)."""
        while closing in self.continued_by:
            closing = self.closed[self.continued_by[closing]]
        return closing

    def live_allocs(self, p: int) -> np.ndarray:
        """Indices of the alloc events still open after event `p`."""
        # Zero-copy views: this runs once for the peak and once per phase peak.
        allocs = np.frombuffer(self.allocs, dtype=np.int64)[: bisect.bisect_right(self.allocs, p)]
        return allocs[np.frombuffer(self.closed, dtype=np.int64)[allocs] > p]


# Random draws make a new tensor: a loop that draws a batch (`randint`) at the same line each step
# frees the old one and allocates the new, and the host allocator hands back the same address as
# often as not; that is no new version of the old batch. (Factories that init fills in place,
# `empty` under `uniform_`, do leave versions of one tensor.)
FACTORY_CALL = re.compile(r"^<built-in (?:method|function) (randint|randn|rand|randperm|randint_like|randn_like"
                          r"|rand_like)\b")


def _is_reversion(freed: Dict[str, Any], e: Dict[str, Any]) -> bool:
    """Whether alloc `e`, right after the free `freed`, is the profiler route writing a new
    version of the same tensor (an in-place update): same address and size, and no stack or
    the freed version's stack, which is no random draw's."""
    if freed.get("addr") != e["addr"] or freed.get("size") != e["size"]:
        return False
    frames = e.get("frames")
    if not frames:
        return True
    first = frames[0] if isinstance(frames, list) else None
    factory = isinstance(first, dict) and isinstance(first.get("name"), str) and FACTORY_CALL.match(first["name"])
    return frames == freed.get("frames") and not factory


# A re-versioned tensor of at most this many bytes is a step counter (`state["step"]`, one float32),
# not a weight (a one-element weight is rare): in a single-tensor update each weight's turn begins with one.
SCALAR_BYTES = 4


def _gradient_sizes(walk: _Walk, trace: List[Dict[str, Any]], held: List[int], backwards: Sequence[Any],
                    step: Any) -> Dict[int, int]:
    """size -> how many: what the backward runs made and still hold when an optimizer run starts,
    the gradients it reads (one per trainable weight), each counted once.

    `held` is what earlier backwards made and still held at the last optimizer run; it is updated
    to what is held at this one. Gradients kept across steps (`zero_grad(set_to_none=False)`) are
    made once, in the first step's backward, and only written in place after it."""
    allocs = np.frombuffer(walk.allocs, dtype=np.int64) if len(walk.allocs) else np.zeros(0, np.int64)
    closed = np.frombuffer(walk.closed, dtype=np.int64)
    for backward in backwards:
        # allocs is ascending: the run's allocations are one slice, found by bisection (a
        # mask would read every allocation of the trace for every step's backward).
        made = allocs[np.searchsorted(allocs, backward.start_event):
                      np.searchsorted(allocs, backward.end_event, side="right")]
        # Counted once, by its first version (a later micro-batch adds into it in place,
        # writing new versions).
        held.extend(j for j in made.tolist() if j not in walk.version_of)
    held[:] = [j for j in held if walk.end(int(closed[j])) > step.start_event]
    grads: Dict[int, int] = {}
    for j in held:
        grads[trace[j]["size"]] = grads.get(trace[j]["size"], 0) + 1
    return grads


# Of the gradients' bytes, the share that must find its further copies among the frameless
# blocks before they are read as optimizer state (the rest: other things the backward kept).
STATE_COVERAGE = 0.99
MAX_STATE_PER_WEIGHT = 3  # AdamW with amsgrad: exp_avg, exp_avg_sq, max_exp_avg_sq


@dataclass
class _DumpBlock:
    """A block allocated at the dump that the trace never opened: memory older than the trace."""

    size: int
    frames: Optional[List[Any]]
    guess: Optional[str] = None  # the category guessed when it has no frames
    kind: Any = None  # a window's block carried in: what the full trace makes of it (KIND_KEY)


def _keeps_what_it_makes(walk: _Walk, run: Any) -> bool:
    """Whether an allocation made in the run outlives it (an optimizer step making its state)."""
    k = bisect.bisect_left(walk.allocs, run.start_event)
    while k < len(walk.allocs) and walk.allocs[k] <= run.end_event:
        if walk.end(walk.closed[walk.allocs[k]]) > run.end_event:
            return True
        k += 1
    return False


def _state_by_sizes(blocks: List[_DumpBlock], walk: _Walk, trace: List[Dict[str, Any]], timeline: Timeline) -> None:
    """Guess the category of the frameless blocks older than the trace (CUDA captures): parameter,
    or optimizer state where their sizes hold further copies of the gradients'.

    An optimizer keeps each state tensor the shape of its weight, so state made before recording
    (in a constructor, as Adagrad's; in a warm-up step) leaves, of every gradient's size, 1 + k
    blocks per gradient (k state tensors per weight) where the weights alone leave one. The first
    optimizer step after a backward shows the gradients (when it keeps what it makes, the state
    is in the trace with its stacks, and nothing is guessed: frozen weights of the trainable
    ones' sizes are no state); the largest k (at most MAX_STATE_PER_WEIGHT) whose copies are
    there for nearly all their bytes is taken, and k blocks per gradient of each size are marked
    state. Which block of a size is a weight and which state cannot be told: the bytes can, and
    the site says they are a guess.
    """
    frameless = [b for b in blocks if not b.frames]
    if not frameless:
        return  # CPU captures, and CUDA dumps whose blocks all have stacks: nothing to guess
    for b in frameless:
        b.guess = GUESS_PARAMETER
    backwards: List[Any] = []
    grads: Dict[int, int] = {}
    keeps = False
    for run in timeline.runs:
        if run.phase == BACKWARD:
            backwards.append(run)
        elif run.phase == OPTIMIZER and backwards:
            keeps = _keeps_what_it_makes(walk, run)
            grads = _gradient_sizes(walk, trace, [], backwards, run)
            break
    _workspaces_by_handles(frameless, walk, trace, timeline, grads)
    frameless = [b for b in frameless if b.guess == GUESS_PARAMETER]
    if keeps:
        # The state is made in the trace, with its stack: frozen weights of the trainable ones'
        # sizes are older than the trace too, and no state.
        return
    by_size: Dict[int, List[_DumpBlock]] = {}
    for b in frameless:
        by_size.setdefault(b.size, []).append(b)
    # A weight older than the trace has a block of its gradient's size there: what else the
    # backward kept (a BLAS workspace, a buffer a hook holds) does not. Weights made in the trace
    # (most of the gradients' bytes without such blocks) leave nothing to guess.
    weights_older = {size: count for size, count in grads.items() if len(by_size.get(size, ())) >= count}
    total = sum(size * count for size, count in weights_older.items())
    if not total or total < sum(size * count for size, count in grads.items()) / 2:
        return
    grads = weights_older
    for k in range(MAX_STATE_PER_WEIGHT, 0, -1):
        covered = [size for size, count in grads.items() if len(by_size.get(size, ())) >= (1 + k) * count]
        if sum(size * grads[size] for size in covered) >= STATE_COVERAGE * total:
            for size in covered:
                for b in by_size[size][-k * grads[size]:]:
                    b.guess = GUESS_STATE
            return


# A cuBLAS handle's workspace (PyTorch's default: 32 MiB on sm90 and newer, 4096 KiB x 2 + 16 KiB
# x 8 before) and its cuBLASLt workspace (1 MiB), as CUDA stacks name the functions that make them.
WORKSPACE_SIZES = (33_554_432, 8_519_680)
LT_WORKSPACE_SIZES = (1_048_576,)
MAX_WORKSPACE_READS = 100_000
WORKSPACE_NATIVE = re.compile(r"^at::cuda::setWorkspaceForHandle\b")
LT_NATIVE = re.compile(r"^at::cuda::getCUDABlasLtWorkspace\b")
def _handles(walk: _Walk, trace: List[Dict[str, Any]], timeline: Timeline
             ) -> Tuple[Dict[str, Set[str]], Dict[str, int]]:
    """({"blas", "lt"} -> the threads, `forward` or `backward`, that run matrix products), and how
    many of each workspace the trace makes. A handle is one thread's: the script's runs the
    forward and autograd's the backward, and every model runs products in both (a compiled
    graph's run as extern kernels that allocate nothing, so stacks cannot be asked); cuBLASLt
    (addmm with its bias) runs in the forward. Only allocations of a workspace's size are read
    for the workspaces made, by their stacks: the trace is not walked."""
    phases = {run.phase for run in timeline.runs}
    threads = ({"forward"} if phases - {BACKWARD} else set()) | ({"backward"} if BACKWARD in phases else set())
    if not _native_stacks(walk, trace):
        # Stacks without C++ frames (stacks="python", a hand-built trace) never show a workspace
        # being made: that none is shown says nothing.
        threads = set()
    used = {"blas": threads, "lt": threads & {"forward"}}
    made = {"blas": 0, "lt": 0}
    allocs = np.frombuffer(walk.allocs, dtype=np.int64) if len(walk.allocs) else np.zeros(0, np.int64)
    # A handle makes its workspace at its first product, early in its phase: the first allocations
    # of those sizes are read, so that a hostile file of millions of them costs a bounded scan.
    sized = allocs[np.isin(walk.deltas_at(allocs), WORKSPACE_SIZES + LT_WORKSPACE_SIZES)][:MAX_WORKSPACE_READS]
    for j in sized.tolist():
        frames = trace[j].get("frames") if isinstance(trace[j], dict) else None
        if not isinstance(frames, list):
            continue
        inner = [f["name"] for f in frames[:8] if isinstance(f, dict) and isinstance(f.get("name"), str)]
        if any(WORKSPACE_NATIVE.match(n) for n in inner):
            made["blas"] += 1
        elif any(LT_NATIVE.match(n) for n in inner):
            made["lt"] += 1
    return used, made


def _native_stacks(walk: _Walk, trace: List[Dict[str, Any]], looked: int = 64) -> bool:
    """Whether the trace's stacks carry C++ frames (CUDA's stacks="all"), read off its first allocations."""
    for j in walk.allocs[:looked]:
        frames = trace[j].get("frames") if isinstance(trace[j], dict) else None
        if isinstance(frames, list) and any(isinstance(f, dict) and isinstance(f.get("name"), str)
                                            and f["name"].startswith(("at::", "c10::", "torch::")) for f in frames):
            return True
    return False


def _workspaces_by_handles(blocks: List[_DumpBlock], walk: _Walk, trace: List[Dict[str, Any]], timeline: Timeline,
                           grads: Dict[int, int]) -> None:
    """Frameless blocks older than the trace that are a BLAS handle's workspaces, not weights.

    A handle belongs to a thread (the script's, autograd's backward one) and makes its workspace,
    of a size fixed per GPU generation, at its first product: a trace that runs a thread's phase
    without showing that thread's workspace being made had it made before recording started (a
    warm-up step, torch.compile's compilation). Of each such size, the blocks beyond
    the weights of that size (one per gradient of it) are marked, one per handle missing.
    """
    if not any(b.size in WORKSPACE_SIZES + LT_WORKSPACE_SIZES for b in blocks):
        return  # no block of a workspace's size: nothing to read the trace for
    used, made = _handles(walk, trace, timeline)
    for kind, sizes in (("blas", WORKSPACE_SIZES), ("lt", LT_WORKSPACE_SIZES)):
        missing = len(used[kind]) - made[kind]
        for size in sizes:
            if missing <= 0:
                break
            spare = [b for b in blocks if b.size == size and b.guess == GUESS_PARAMETER][grads.get(size, 0):]
            for b in spare[:missing]:
                b.guess = GUESS_WORKSPACE
            missing -= len(spare[:missing])


def _optimizer_state_stand_ins(walk: _Walk, trace: List[Dict[str, Any]], timeline: Timeline
                               ) -> Dict[int, List[Any]]:
    """For tensors live before the trace that an optimizer step updates in place as its state (on
    profiler-route captures, which write each in-place update as a frameless re-version): the
    unmatched free that starts each one's chain -> the stack of the update standing in for the
    stack it was made with.

    A step updates the state and the weights in place alike, so the order says which is which:
    every built-in optimizer updates a weight last, from its state (`param.addcdiv_(exp_avg,
    denom)`, `param.add_(buf)`). In a single-tensor update each weight's turn starts with its step
    counter, and the weight is the tensor of that turn updated last; a foreach update updates all
    weights after all state, so of each size the last as many as there are gradients of that
    size held at the step are the weights, and in a fused update (one op, its new versions in
    its arguments' order) the first as many. Updates after the optimizer's last event in the step
    are the loop's (an EMA): neither, with the loop's stack.
    Weights, and tensors no step updates (frozen weights, buffers), get neither: parameters by
    their lifetime (docs/categories.md), under one label.
    """
    n = len(trace)
    roots = [f for f in walk.unmatched if f in walk.continued_by]
    if not roots or not timeline.runs:
        return {}
    events: List[Tuple[int, int]] = []  # (re-version event, the chain's root)
    for f in roots:
        c = f
        while True:
            events.append((c, f))
            c = walk.closed[walk.continued_by[c]]
            if c >= n or c not in walk.continued_by:
                break
    events.sort()
    at = [e for e, _ in events]
    votes: Dict[int, int] = {}  # root -> state votes minus weight votes
    first_in_run: Dict[int, Tuple[int, int, int]] = {}  # root -> (event, run start, run end) of its first state vote
    backwards: List[Any] = []  # the backward runs since the last optimizer run (micro-batches)
    held: List[int] = []  # what earlier backwards made and still held at the last optimizer run
    loop_updated: Dict[int, Optional[List[Any]]] = {}  # root -> the loop's stack that updated it after a step
    for run in timeline.runs:
        if run.phase == BACKWARD:
            backwards.append(run)
        if run.phase != OPTIMIZER:
            continue
        grads = _gradient_sizes(walk, trace, held, backwards, run)
        backwards = []
        # Updates written before the step's first allocation with a stack take the phase before it:
        # the run starts, for this, after the last allocation that is no new version.
        k = bisect.bisect_left(walk.allocs, run.start_event) - 1
        while k >= 0 and walk.allocs[k] in walk.version_of:
            k -= 1
        start = walk.allocs[k] + 1 if k >= 0 else 0
        loop = _loop_after_step(walk, trace, run, at)
        for e, root in events[bisect.bisect_left(at, loop): bisect.bisect_right(at, run.end_event)]:
            if root not in loop_updated:
                loop_updated[root] = _stack_before(walk, trace, e, loop)
        inside = events[bisect.bisect_left(at, start): bisect.bisect_left(at, loop)]
        if not inside:
            continue
        last: Dict[int, int] = {}
        first: Dict[int, int] = {}
        for e, root in inside:
            last[root] = e
            first.setdefault(root, e)
        size = {root: trace[root]["size"] for root in last}
        # Turns: split at step counters (state themselves).
        turns: List[List[int]] = [[]]
        for root in sorted(last, key=last.__getitem__):
            if size[root] <= SCALAR_BYTES:
                votes[root] = votes.get(root, 0) + 1
                first_in_run.setdefault(root, (first[root], run.start_event, run.end_event))
                if turns[-1]:
                    turns.append([])
            else:
                turns[-1].append(root)
        turns = [t for t in turns if t]
        weights: set = set()
        if len(turns) > 1:
            weights = {t[-1] for t in turns}
        elif turns:
            by_size: Dict[int, List[int]] = {}
            for root in turns[0]:
                by_size.setdefault(size[root], []).append(root)
            # A fused step is one op, whose new versions follow its arguments: the weights first.
            fused = _runs_fused_step(walk, trace, run)
            for s, members in by_size.items():
                if grads.get(s):
                    weights.update(members[:grads[s]] if fused else members[-grads[s]:])
                else:  # no gradients to count: the last of each run of one size
                    weights.update(r for k, r in enumerate(turns[0])
                                   if size[r] == s and (k + 1 == len(turns[0]) or size[turns[0][k + 1]] != s))
        for root in (r for t in turns for r in t):
            votes[root] = votes.get(root, 0) + (-1 if root in weights else 1)
            if root not in weights:
                first_in_run.setdefault(root, (first[root], run.start_event, run.end_event))
    stand_ins: Dict[int, List[Any]] = {}
    trimmed: Dict[int, List[Any]] = {}  # id of a frames list -> its update frames (kept alive here)
    for root, vote in votes.items():
        if vote <= 0:
            continue
        frames = _optimizer_stack_near(walk, trace, *first_in_run[root])
        if frames is None:
            continue
        if id(frames) not in trimmed:
            trimmed[id(frames)] = frames[next((i for i, f in enumerate(frames) if _optimizer_frame(f)), 0):]
        stand_ins[root] = trimmed[id(frames)]
    for root, frames in loop_updated.items():
        if root not in votes and frames:
            stand_ins[root] = frames
    return stand_ins


def _stand_ins(walk: _Walk, trace: List[Dict[str, Any]], timeline: Timeline) -> Dict[int, List[Any]]:
    """Stacks standing in for tensors live before the trace, from their in-place updates: optimizer
    state by the step's update order, gradients by the backward's accumulation (which wins: no
    optimizer updates a gradient as its state)."""
    return {**_optimizer_state_stand_ins(walk, trace, timeline), **_gradient_stand_ins(walk, trace, timeline)}


# How far from a gradient's in-place accumulation its incoming gradient's events are looked for.
ACCUMULATE_NEAR = 16


def _gradient_stand_ins(walk: _Walk, trace: List[Dict[str, Any]], timeline: Timeline) -> Dict[int, List[Any]]:
    """For tensors live before the trace that a backward updates in place (on profiler-route
    captures, which write each in-place update as a frameless re-version): the unmatched free that
    starts each one's chain -> the stack of the backward node whose gradient was accumulated into it.

    Gradients kept with `zero_grad(set_to_none=False)` from steps before recording (a warm-up) are
    zeroed in place and then accumulated into by the backward (`AccumulateGrad`: `grad += new`, the
    new gradient freed right after): a weight, optimizer state or a buffer is never written by a
    backward. The accumulation's stand-in is the backward stack of the nearest event, after it
    first (the incoming gradient's free), else before it; a backward whose stack there is an
    optimizer's (an optimizer step run in a post-accumulate-grad hook updates the weights inside
    the backward) stands in for nothing."""
    n = len(trace)
    backwards = [(r.start_event, r.end_event) for r in timeline.runs if r.phase == BACKWARD]
    if not backwards:
        return {}
    starts = [b for b, _ in backwards]
    out: Dict[int, List[Any]] = {}
    for root in walk.unmatched:
        if root not in walk.continued_by:
            continue
        c = root
        while True:
            e = walk.continued_by[c]  # the new version's allocation
            k = bisect.bisect_right(starts, e) - 1
            if k >= 0 and e <= backwards[k][1]:
                frames = _backward_stack_near(trace, e, backwards[k][0])
                if frames is not None:
                    out[root] = frames
                break
            c = walk.closed[e]
            if c >= n or c not in walk.continued_by:
                break
    return out


def _backward_stack_near(trace: List[Dict[str, Any]], event: int, start: int) -> Optional[List[Any]]:
    """The backward's stack nearest to the in-place update at `event` of a backward run from `start`,
    after it first; None where the nearest stack is an optimizer's or none says backward. What comes
    after is looked at past the run's end: the run ends at the last stack that says backward, and a
    step's updates that come before its first stack of its own (Adagrad's step count and state sum)
    fall inside it, with the optimizer's stack just after."""
    after = range(event + 1, min(len(trace) - 1, event + ACCUMULATE_NEAR) + 1)
    before = range(event - 1, max(start, event - ACCUMULATE_NEAR) - 1, -1)
    for i in itertools.chain(after, before):
        frames = trace[i].get("frames")
        if not isinstance(frames, list) or not frames:
            continue
        if _is_optimizers(frames):
            return None
        if any(isinstance(f, dict) and isinstance(f.get("name"), str)
               and frame_phase(f["name"], f.get("filename") if isinstance(f.get("filename"), str) else None)
               == BACKWARD for f in frames):
            return frames
    return None


def _optimizer_stack_near(walk: _Walk, trace: List[Dict[str, Any]], event: int, start: int, end: int
                          ) -> Optional[List[Any]]:
    """The optimizer's stack that stands in for an update at `event` of its run (`start`..`end`):
    its first allocation after the update, else its last before it (a fused step allocates
    before its one update op, and the run can reach into the next step's backward)."""
    k = bisect.bisect_left(walk.allocs, event)
    while k < len(walk.allocs) and walk.allocs[k] <= end:
        frames = trace[walk.allocs[k]].get("frames")
        if _is_optimizers(frames):
            return frames
        k += 1
    k = bisect.bisect_left(walk.allocs, event) - 1
    while k >= 0 and walk.allocs[k] >= start:
        frames = trace[walk.allocs[k]].get("frames")
        if _is_optimizers(frames):
            return frames
        k -= 1
    return None


def _runs_fused_step(walk: _Walk, trace: List[Dict[str, Any]], run: Any) -> bool:
    """Whether an optimizer run's allocations show a fused update (`adam.py(...): _fused_adam`)."""
    stacks = (trace[i].get("frames") for i in walk.allocs[bisect.bisect_left(walk.allocs, run.start_event):
                                                          bisect.bisect_right(walk.allocs, run.end_event)])
    return any(isinstance(frames, list) and any(_optimizer_frame(f) and "): _fused_" in str(f.get("name", ""))
                                                for f in frames) for frames in stacks)


def _optimizer_frame(frame: Any) -> bool:
    """Whether a raw frame is torch.optim's code (its file in the name on CPU captures, apart on CUDA)."""
    if not isinstance(frame, dict):
        return False
    text = f"{frame.get('filename', '')}:{frame.get('name', '')}"
    # swa_utils.py: AveragedModel, an average of the weights the loop keeps (an EMA), no optimizer's.
    return "torch/optim/" in text and "torch/optim/swa_utils.py" not in text


def _is_optimizers(frames: Any) -> bool:
    return isinstance(frames, list) and any(map(_optimizer_frame, frames))


def _loop_after_step(walk: _Walk, trace: List[Dict[str, Any]], run: Any, at: List[int]) -> int:
    """Where the loop's own code takes over in an optimizer run: after the optimizer's last event
    (its temporaries are freed as its step returns), when the step's own in-place updates (events
    `at`) come before it; past the run's end otherwise. An EMA of the weights updated after
    `step()` is not the optimizer's; a fused step updates everything after its last event, where
    nothing tells an EMA's updates from its own."""
    last = next((i for i in range(run.end_event, run.start_event - 1, -1) if _is_optimizers(trace[i].get("frames"))),
                None)
    if last is None or bisect.bisect_left(at, last) == bisect.bisect_left(at, run.start_event):
        return run.end_event + 1
    return last + 1


def _stack_before(walk: _Walk, trace: List[Dict[str, Any]], event: int, since: int) -> Optional[List[Any]]:
    """The stack of the last allocation with one at or after `since` and before `event`: the loop's
    call that wrote the frameless new version at `event`."""
    k = bisect.bisect_left(walk.allocs, event) - 1
    while k >= 0 and walk.allocs[k] >= since:
        frames = trace[walk.allocs[k]].get("frames")
        if frames:
            return frames
        k -= 1
    return None


def _dump_blocks(segments: List[Dict[str, Any]]) -> Iterator[Tuple[int, int, Optional[List[Any]], Any, bool]]:
    """(address, requested bytes, frames, a window's KIND_KEY or None, whether the address was
    placed rather than the block's own) of each active_allocated block at dump time."""
    for seg in segments:
        addr = seg["address"]
        for block in seg.get("blocks", []):
            # torch 2.0 blocks, and the profiler route's, have no address: they follow each other
            # from the segment's start.
            placed = "address" not in block
            addr = block.get("address", addr)
            if block["state"] == "active_allocated":
                frames = block.get("frames")
                history = block.get("history")
                if not frames and history:
                    frames = history[-1].get("frames")
                yield addr, block.get("requested_size", block["size"]), frames, block.get(KIND_KEY), placed
            addr += block["size"]


def dump_only_blocks(segments: List[Dict[str, Any]], walk: "_Walk", trace: Any
                     ) -> List[Tuple[int, int, Optional[List[Any]], Any]]:
    """(address, bytes, frames, KIND_KEY) of the dump's blocks that the trace does not hold open at
    its end: memory older than the trace.

    A placed block (no address of its own) that finds no open allocation at its place is matched
    by size to an open allocation no block claimed: where the profiler missed a free on another
    thread (gloo's), the trace holds two open allocations whose ranges overlap, torch's converter
    lays the blocks out past that point at other addresses than the trace's, and each of them
    would otherwise be counted twice, once in the trace and once as older than it."""
    open_at_end = walk.open_at_end
    blocks = list(_dump_blocks(segments))
    missing = [b for b in blocks if b[0] not in open_at_end]
    if any(b[4] for b in missing):
        claimed = {b[0] for b in blocks}
        by_size: Dict[int, int] = {}
        for addr, event in open_at_end.items():
            if addr not in claimed:
                size = trace[event]["size"]
                by_size[size] = by_size.get(size, 0) + 1
        kept = []
        for b in missing:
            if b[4] and by_size.get(b[1]):
                by_size[b[1]] -= 1
            else:
                kept.append(b)
        missing = kept
    return [(addr, size, frames, kind) for addr, size, frames, kind, _ in missing]


def _timeline(static: int, running: np.ndarray) -> List[List[int]]:
    """At most TIMELINE_POINTS [event index, allocated bytes] points, each the max of its window."""
    # The maxima of running, shifted: running + static would be one more array the trace's length.
    return [[i, static + int(running[i])] for i in window_maxima(running, TIMELINE_POINTS).tolist()]


@dataclass(frozen=True)
class _Kind:
    """What memory is taken for, as the full trace says it: the stack grouping reads (frames, freed,
    live before the trace, guess; `update`: the frames stand in for an in-place update) and its lifetime."""

    frames: Optional[List[Any]]
    freed: bool
    before_trace: bool
    guess: Optional[str]
    update: bool
    lifetime: int  # index into LIFETIMES


LIFETIME_CODES = {lifetime.key(): code for code, lifetime in enumerate(LIFETIMES)}
GUESSES = (None, GUESS_PARAMETER, GUESS_STATE, GUESS_WORKSPACE)


class _Origins:
    """Where the stack, guess and lifetime of each live allocation come from in one device's trace:
    one code path for the peak, the phase peaks and the kinds a window keeps of the full trace."""

    def __init__(self, walk: _Walk, trace: List[Dict[str, Any]], timeline: Timeline,
                 stand_ins: Dict[int, List[Any]]) -> None:
        self.walk, self.trace, self.timeline, self.stand_ins = walk, trace, timeline, stand_ins

    def alloc(self, j: int) -> Tuple[Optional[List[Any]], bool, Optional[str], bool, int, int]:
        """(frames, live before the trace, guess, frames are an update's, first event, end event) of
        the allocation open at alloc event `j` (freed: as live before the trace)."""
        walk, trace = self.walk, self.trace
        first, unmatched = walk.origin(j)
        end = walk.end(walk.closed[j])
        if first is None:
            assert unmatched is not None  # origin() gives one of the two
            # One label whether the update order told a weight or nothing did (a frozen weight, a
            # buffer): the same weights read as a parameter by either rule, and two runs that tell
            # them apart differently (SGD and SGD with momentum, a model and its LoRA fine-tune)
            # must not show the same bytes as a NEW beside a SHRANK.
            stand_in = self.stand_ins.get(unmatched)
            return stand_in or trace[unmatched].get("frames"), True, None, bool(stand_in), -1, end
        return trace[first].get("frames"), False, None, False, first, end

    def unmatched(self, i: int) -> Tuple[Optional[List[Any]], bool, Optional[str], bool, int, int]:
        """The same for memory live before the trace and freed at the unmatched free `i`."""
        stand_in = self.stand_ins.get(i)
        return stand_in or self.trace[i].get("frames"), True, None, bool(stand_in), -1, self.walk.end(i)

    def kinds(self, allocs: Sequence[int], unmatched: Sequence[int], dump_only: Sequence[_DumpBlock]
              ) -> List[Dict[str, Any]]:
        """The full trace's kind (KIND_KEY's form) of allocations open at `allocs`, of memory freed at
        the unmatched frees `unmatched`, and of `dump_only` blocks, in that order. Equal kinds are
        one dict, so a window's file holds each once."""
        found = [(f, before, before, guess, update, born, end)
                 for f, before, guess, update, born, end in (self.alloc(j) for j in allocs)]
        found += [(f, True, True, guess, update, born, end)
                  for f, _, guess, update, born, end in (self.unmatched(i) for i in unmatched)]
        found += [(b.frames, False, True, b.guess, False, -1, len(self.trace)) for b in dump_only]
        codes = self.timeline.lifetime_codes(np.array([f[5] for f in found], dtype=np.int64),
                                             np.array([f[6] for f in found], dtype=np.int64), len(self.trace))
        out: List[Dict[str, Any]] = []
        shared: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
        for (frames, freed, before, guess, update, _, _), code in zip(found, codes.tolist()):
            key = (id(frames), freed, before, guess, update, code)
            kind = shared.get(key)
            if kind is None:
                kind = shared[key] = {"frames": frames, "freed": freed, "before_trace": before, "guess": guess,
                                      "update": update, "lifetime": LIFETIMES[code].key()}
            out.append(kind)
        return out


def _kind(path: str, value: Any, known: Dict[int, Tuple[Any, _Kind]]) -> _Kind:
    """A window's KIND_KEY value read back (it is input like any other: checked, never trusted)."""
    hit = known.get(id(value))
    if hit is not None:
        return hit[1]
    ok = (isinstance(value, dict) and isinstance(value.get("freed"), bool)
          and isinstance(value.get("before_trace"), bool) and isinstance(value.get("update"), bool)
          and value.get("guess") in GUESSES and isinstance(value.get("lifetime"), str)
          and value["lifetime"] in LIFETIME_CODES
          and (value.get("frames") is None or isinstance(value.get("frames"), list)))
    if not ok:
        raise InputError(path, f"{KIND_KEY}: {brief(value)} is not what a memdiff window writes "
                               "(frames, freed, before_trace, guess, update, lifetime)")
    kind = _Kind(value.get("frames"), value["freed"], value["before_trace"], value["guess"], value["update"],
                 LIFETIME_CODES[value["lifetime"]])
    known[id(value)] = (value, kind)  # the value kept alive: its id stays its own
    return kind


def _mark_kept_updates(stacks: StackNormalizer, kinds: Optional[Dict[int, Tuple[Any, _Kind]]]) -> None:
    """A window's kept kinds whose frames stand in for an in-place update read as one, as in the full trace."""
    if kinds:
        stacks.mark_updates(k.frames for _, k in kinds.values() if k.update and k.frames)


def window_kinds(snapshot: Snapshot, device: int, walk: _Walk, allocs: Sequence[int], unmatched: Sequence[int]
                 ) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """What the full trace of `device` makes of memory a window of it holds, in KIND_KEY's form: of the
    allocations open at `allocs` and of memory freed at the unmatched frees `unmatched` (one list, in
    that order), and of the dump's blocks the trace never opened (in _dump_blocks' order). Memory a
    window carries in keeps its stack, lifetime and so category: a window alone would see weights
    updated in place as memory freed, and a whole run's memory as made before its start. Kinds the
    snapshot already carries (a window of a window) are kept as they are."""
    path = snapshot.path
    trace = snapshot.device_traces[device] if device < len(snapshot.device_traces) else []
    segments = [seg for seg in snapshot.segments if seg["device"] == device]
    dump_only = [_DumpBlock(size, frames, kind=kind)
                 for _, size, frames, kind in dump_only_blocks(segments, walk, trace)]
    running = walk.running_totals()
    timeline = build_timeline(trace, walk.allocs, running, 0, Scopes(snapshot.external_annotations, device),
                              walk.version_of)
    stand_ins = _stand_ins(walk, trace, timeline)
    _state_by_sizes(dump_only, walk, trace, timeline)
    found = _Origins(walk, trace, timeline, stand_ins).kinds(allocs, unmatched, dump_only)
    records = [trace[j].get(KIND_KEY) for j in allocs] + [trace[i].get(KIND_KEY) for i in unmatched]
    records += [b.kind for b in dump_only]
    if WINDOW_KEY in snapshot.source.keys:
        known: Dict[int, Tuple[Any, _Kind]] = {}
        for record in records:
            if record is not None:
                _kind(path, record, known)  # checked before it is copied on
        found = [found[k] if record is None else record for k, record in enumerate(records)]
    m = len(allocs) + len(unmatched)
    return found[:m], found[m:]


def _live_at(walk: _Walk, trace: List[Dict[str, Any]], p: int, dump_only: List[_DumpBlock],
             timeline: Timeline, stand_ins: Dict[int, List[Any]],
             kinds: Optional[Dict[int, Tuple[Any, _Kind]]] = None, path: str = "") -> List[_Live]:
    """Every allocation live after event `p` with its lifetime: open allocations, memory live
    before the trace and freed after `p`, and dump blocks the trace never opened. Memory live
    before the trace is known by the stack that freed it, or by its stand-in (see
    _optimizer_state_stand_ins). With `kinds` (a window), what the full trace makes of memory
    (KIND_KEY on its entry or block) replaces what the window alone would."""
    n = len(trace)
    origins = _Origins(walk, trace, timeline, stand_ins)
    peak_step = timeline.step_index_at(p) if p >= 0 else None
    items: List[_Live] = []
    records: List[Any] = []  # per item, its KIND_KEY value, if any
    for j in walk.live_allocs(p).tolist():
        frames, before, guess, _, first, end = origins.alloc(j)
        records.append(trace[j].get(KIND_KEY) if kinds is not None else None)
        if before:
            items.append(_Live(frames, trace[j]["size"], freed=True, before_trace=True, entry=None, born_event=-1,
                               end_event=end, earlier=False, reached_peak=j == p, guess=guess))
            continue
        step = timeline.step_index_at(first)
        # A scalar (the previous step's loss, waiting to be replaced) holds nothing worth a leak
        # line; a graph it keeps alive is counted by its own allocations.
        worth = trace[j]["size"] > SCALAR_BYTES
        earlier = peak_step is not None and step is not None and step < peak_step and worth
        earlier_pass = None
        if not earlier and worth:
            k = timeline.passes.at(first)
            if k is not None and timeline.passes.later(k, p):
                earlier, earlier_pass = True, k
        items.append(_Live(frames, trace[j]["size"], freed=False, before_trace=False,
                           entry=trace[first], born_event=first, end_event=end, earlier=earlier, reached_peak=j == p,
                           earlier_pass=earlier_pass))
    for i in walk.unmatched[bisect.bisect_right(walk.unmatched, p):]:
        frames, _, _, _, _, end = origins.unmatched(i)
        records.append(trace[i].get(KIND_KEY) if kinds is not None else None)
        items.append(_Live(frames, trace[i]["size"], freed=True, before_trace=True, entry=None,
                           born_event=-1, end_event=end, earlier=False))
    for b in dump_only:
        records.append(b.kind if kinds is not None else None)
        items.append(_Live(b.frames, b.size, freed=False, before_trace=True, entry=None, born_event=-1, end_event=n,
                           earlier=False, guess=b.guess))
    codes = timeline.lifetime_codes(np.array([item.born_event for item in items], dtype=np.int64),
                                    np.array([item.end_event for item in items], dtype=np.int64), n)
    for item, code, record in zip(items, codes.tolist(), records):
        item.lifetime = LIFETIMES[code]
        if record is not None and kinds is not None:
            kind = _kind(path, record, kinds)
            item.frames, item.freed, item.before_trace = kind.frames, kind.freed, kind.before_trace
            item.guess, item.lifetime = kind.guess, LIFETIMES[kind.lifetime]
    return items


class _Kinds:
    """Allocations' (stack, lifetime) kinds: each distinct stack gets a number."""

    def __init__(self, path: str, stacks: StackNormalizer) -> None:
        self.path, self.stacks = path, stacks
        self.kinds: List[Tuple[Stack, int]] = []
        # (id of a frames list, freed, live before the trace) -> stack number: the hot loop's lookup
        self.by_list: Dict[Tuple[int, bool, bool, Optional[str]], int] = {}
        self._numbers: Dict[int, int] = {}  # id of a Stack -> its number
        self._stacks: List[Stack] = []

    def stack_code(self, frames: Any, freed: bool, before_trace: bool, guess: Optional[str] = None) -> int:
        """A number for the stack of `frames` (equal stacks, equal numbers)."""
        key = (id(frames), freed, before_trace, guess)
        code = self.by_list.get(key)
        if code is None:
            try:
                stack = self.stacks.stack(frames, freed=freed, before_trace=before_trace, guess=guess)
            except ValueError as exc:
                raise InputError(self.path, str(exc)) from None
            code = self._numbers.get(id(stack))
            if code is None:
                code = self._numbers[id(stack)] = len(self._stacks)
                self._stacks.append(stack)
            self.by_list[key] = code
        return code

    def numbered(self, stack_codes: np.ndarray, lifetime_codes: np.ndarray) -> np.ndarray:
        """Each allocation's kind, from its stack and lifetime codes."""
        pairs = stack_codes * len(LIFETIMES) + lifetime_codes
        unique, inverse = np.unique(pairs, return_inverse=True)
        base = len(self.kinds)
        self.kinds += [(self._stacks[int(u) // len(LIFETIMES)], int(u) % len(LIFETIMES)) for u in unique]
        return inverse.reshape(-1).astype(np.int64) + base


def _allocations(path: str, walk: _Walk, trace: List[Dict[str, Any]], dump_only: List[_DumpBlock],
                 timeline: Timeline, stacks: StackNormalizer, stand_ins: Dict[int, List[Any]],
                 kept: Optional[Dict[int, Tuple[Any, _Kind]]] = None) -> Allocations:
    """Every allocation of the trace (each version of a re-versioned tensor on its own, with the
    first version's stack and the whole chain's lifetime), then memory from before the trace."""
    n = len(trace)
    opened = np.frombuffer(walk.allocs, dtype=np.int64) if len(walk.allocs) else np.zeros(0, np.int64)
    closed = np.frombuffer(walk.closed, dtype=np.int64)[opened] if len(opened) else np.zeros(0, np.int64)
    unmatched = np.frombuffer(walk.unmatched, dtype=np.int64) if len(walk.unmatched) else np.zeros(0, np.int64)
    born = opened.copy()  # the first version's event, -1 before the trace
    ends = closed.copy()  # the event that frees the last version
    kinds = _Kinds(path, stacks)
    codes = np.empty(len(opened) + len(unmatched) + len(dump_only), dtype=np.int64)
    freed_by = {}  # position -> the unmatched free whose stack stands in
    for k in np.flatnonzero(np.isin(opened, np.fromiter(walk.version_of, np.int64, len(walk.version_of)))).tolist():
        first, free = walk.origin(int(opened[k]))
        born[k] = -1 if first is None else first
        if free is not None:
            freed_by[k] = free
    for k in np.flatnonzero(np.isin(closed, np.fromiter(walk.continued_by, np.int64, len(walk.continued_by)))).tolist():
        ends[k] = walk.end(int(closed[k]))
    stack_code, known = kinds.stack_code, kinds.by_list
    # The hot loop of the history: one dict lookup per allocation whose stack list was seen.
    first_codes: List[int] = []
    add = first_codes.append
    for k, first in enumerate(born.tolist()):
        if first < 0:
            add(stack_code(stand_ins.get(freed_by[k]) or trace[freed_by[k]].get("frames"), True, True))
            continue
        frames = trace[first].get("frames")
        code = known.get((id(frames), False, False, None))
        add(stack_code(frames, False, False) if code is None else code)
    codes[: len(opened)] = first_codes
    m = len(opened)
    for k, i in enumerate(unmatched.tolist()):
        codes[m + k] = stack_code(stand_ins.get(i) or trace[i].get("frames"), True, True)
    m += len(unmatched)
    for k, b in enumerate(dump_only):
        codes[m + k] = stack_code(b.frames, False, True, b.guess)
    unmatched_ends = np.array([walk.end(i) for i in unmatched.tolist()], dtype=np.int64)
    life = timeline.lifetime_codes(
        np.concatenate((born, np.full(len(unmatched) + len(dump_only), -1, np.int64))),
        np.concatenate((ends, unmatched_ends, np.full(len(dump_only), n, np.int64))), n)
    if kept is not None:  # a window: what the full trace makes of memory replaces what the window alone would
        records = [trace[j].get(KIND_KEY) for j in opened.tolist()]
        records += [trace[i].get(KIND_KEY) for i in unmatched.tolist()] + [b.kind for b in dump_only]
        for k, record in enumerate(records):
            if record is not None:
                kind = _kind(path, record, kept)
                if kind.update and kind.frames:
                    stacks.mark_updates([kind.frames])
                codes[k] = stack_code(kind.frames, kind.freed, kind.before_trace, kind.guess)
                life[k] = kind.lifetime
    return Allocations(
        start=np.concatenate((opened, np.zeros(len(unmatched) + len(dump_only), np.int64))),
        end=np.concatenate((closed, unmatched, np.full(len(dump_only), n, np.int64))),
        size=np.concatenate((walk.deltas_at(opened), -walk.deltas_at(unmatched),
                             np.array([b.size for b in dump_only], dtype=np.int64))),
        kind=kinds.numbered(codes, life), kinds=kinds.kinds)


def _absolute_sum(deltas: np.ndarray, chunk: int = 1 << 20) -> float:
    """The sum of |deltas| as a float, a million at a time: two float copies of a whole trace
    would be 16 bytes an event of peak memory."""
    return sum(float(np.abs(deltas[k: k + chunk].astype(np.float64)).sum()) for k in range(0, len(deltas), chunk))


def _device_summary(snapshot: Snapshot, device: int, stacks: StackNormalizer,
                    history_rules: Optional[Sequence[Rule]] = None,
                    keep: Optional[Dict[int, Allocations]] = None) -> DeviceSummary:
    path = snapshot.path
    traces = snapshot.device_traces
    trace = traces[device] if device < len(traces) else []
    segments = [s for s in snapshot.segments if s["device"] == device]
    walk = _Walk(path, device, trace, reversions=snapshot.source.generation == "profiler")

    unmatched_bytes = -int(walk.deltas_at(np.frombuffer(walk.unmatched, dtype=np.int64)).sum()) if walk.unmatched else 0
    static = unmatched_bytes
    dump_only = [_DumpBlock(size, frames, kind=kind)
                 for _, size, frames, kind in dump_only_blocks(segments, walk, trace)]
    static += sum(b.size for b in dump_only)

    # Running totals are int64: sizes that could add up past it are no real trace (and would wrap).
    if static > MAX_BYTES:
        raise InputError(path, f"device {device}: sizes add up to more than {MAX_BYTES:,} bytes: not a real snapshot")
    running = walk.running_totals()
    peak_index: Optional[int] = None
    peak = static
    if len(running):
        k = int(running.argmax())
        if running[k] > 0:
            peak_index, peak = k, static + int(running[k])

    scopes = Scopes(snapshot.external_annotations, device)
    timeline = build_timeline(trace, walk.allocs, running, static, scopes, walk.version_of)
    p = -1 if peak_index is None else peak_index
    n = len(trace)
    stand_ins = _stand_ins(walk, trace, timeline)
    _state_by_sizes(dump_only, walk, trace, timeline)
    stacks.mark_updates(stand_ins.values())
    # A window: what the full trace makes of memory, kept on its entries and blocks (KIND_KEY).
    kinds: Optional[Dict[int, Tuple[Any, _Kind]]] = {} if WINDOW_KEY in snapshot.source.keys else None
    live_items = _live_at(walk, trace, p, dump_only, timeline, stand_ins, kinds, path)
    _mark_kept_updates(stacks, kinds)
    # A re-versioned tensor is not memory from before a truncated trace: no advice to record more.
    reversioned = [i for i in walk.unmatched if i in walk.continued_by]
    unmatched_bytes -= sum(trace[i]["size"] for i in reversioned)
    groups, peak_signature, allocations_of = _group(path, live_items, stacks)
    phase_peaks = []
    for phase in (FORWARD, BACKWARD, OPTIMIZER):
        spans = [span for span in timeline.runs if span.phase == phase]
        if not spans:
            continue
        top = max(spans, key=lambda span: (span.peak_bytes, -span.peak_event_index))
        at = top.peak_event_index
        phase_groups = None
        if at != peak_index:
            phase_items = _live_at(walk, trace, at, dump_only, timeline, stand_ins, kinds, path)
            _mark_kept_updates(stacks, kinds)
            phase_groups = _group(path, phase_items, stacks)[0]
        phase_peaks.append(PhasePeak(phase, timeline.step_at(at), top.peak_bytes, at, phase_groups))
    if sum(g.bytes for g in groups) != peak:
        raise AssertionError(f"{path}: device {device}: groups do not add up to the peak (a memdiff bug)")

    peak_event = trace[peak_index] if peak_index is not None else None
    by_scope: Dict[str, int] = {}
    by_context: Dict[str, int] = {}
    for item in live_items:
        e, size = item.entry, item.size
        if e is None:
            continue
        scope = scopes.innermost(e.get("time_us"))
        if scope is not None:
            by_scope[scope] = by_scope.get(scope, 0) + size
        context = e.get("compile_context")
        if context not in NO_COMPILE_CONTEXT:
            name = context[:200] if isinstance(context, str) else brief(context)
            by_context[name] = by_context.get(name, 0) + size
    by_label = _labels(trace, walk.annotations, live_items, peak_index)
    times = [_time(path, device, trace, 0), _time(path, device, trace, len(trace) - 1)] if trace else [None, None]
    history = None
    # Every allocation, read once for whoever asks (the history draws them, the forecast replays them).
    everything = (_allocations(path, walk, trace, dump_only, timeline, stacks, stand_ins, kinds)
                  if keep is not None or history_rules is not None else None)
    if keep is not None and everything is not None:
        keep[device] = everything
    if history_rules is not None and everything is not None:
        bars = peak_bars([(g.signature, allocations_of[g.signature]) for g in groups])
        history = history_of(everything, running + static, lambda i: _time(path, device, trace, i), history_rules,
                             bars)
    reserved_at_dump = (None if snapshot.source.generation == "profiler" else sum(s["total_size"] for s in segments))
    reserved_peak, fragmentation = _reserved(path, device, trace, walk.segment_events, reserved_at_dump, peak_index,
                                             peak)
    allocated = (sum(s["allocated_size"] for s in segments) if all("allocated_size" in s for s in segments)
                 else sum(b["size"] for s in segments for b in s.get("blocks", [])
                          if b["state"] == "active_allocated"))
    return DeviceSummary(
        device=device,
        trace_events=n,
        static_bytes=static,
        peak_bytes=peak,
        peak_event_index=peak_index,
        peak_time_us=_time(path, device, trace, peak_index) if peak_index is not None else None,
        peak_event_signature=peak_signature,
        trace_start_time_us=times[0],
        trace_end_time_us=times[1],
        allocated_bytes_at_dump=allocated,
        # The profiler route's one segment per device spans the lowest to the highest address it
        # saw (terabytes on CPU): it stands for no memory anyone reserved.
        reserved_bytes_at_dump=reserved_at_dump,
        unmatched_free_count=len(walk.unmatched) - len(reversioned),
        unmatched_free_bytes=unmatched_bytes,
        oom_events=[OomEvent(event_index=i, requested_bytes=_bytes(path, device, trace, i, "size") or 0,
                             device_free_bytes=_bytes(path, device, trace, i, "device_free"),
                             time_us=_time(path, device, trace, i)) for i in walk.ooms],
        timeline=_timeline(static, running),
        groups=groups,
        scope_at_peak=scopes.innermost(peak_event.get("time_us")) if peak_event else None,
        steps=_steps_kept(timeline, peak_index),
        step_at_peak=timeline.step_at(peak_index) if peak_index is not None else None,
        phase_at_peak=timeline.phase_at(peak_index) if peak_index is not None else None,
        phase_peaks=phase_peaks,
        bytes_by_scope=largest_first(by_scope),
        bytes_by_compile_context=largest_first(by_context),
        bytes_by_label=largest_first(by_label),
        history=history,
        reserved_peak_bytes=reserved_peak,
        fragmentation_bytes=fragmentation,
    )


MAX_LABEL = 200  # characters of a user's label kept


def _label(value: Any) -> Optional[str]:
    """A user's label as shown: a non-empty string, clipped; anything else described briefly."""
    if value is None or value == "":
        return None
    return value[:MAX_LABEL] if isinstance(value, str) else brief(value)


def _labels(trace: List[Dict[str, Any]], annotations: Sequence[int], items: Sequence[_Live],
            peak_index: Optional[int]) -> Dict[str, int]:
    """Bytes live at the peak by the user's labels: the allocation's `user_metadata`, then the
    annotations attached to its address between its allocation and the peak. Annotations add to
    what an allocation was made with; they never allocate or free (the counts are unchanged)."""
    attached: Dict[Any, List[Tuple[int, str]]] = {}
    for i in annotations:
        if peak_index is None or i > peak_index:
            break
        label = _label(trace[i].get("user_metadata"))
        if label is not None:
            attached.setdefault(trace[i].get("addr"), []).append((i, label))
    out: Dict[str, int] = {}
    for item in items:
        e = item.entry
        if e is None:
            continue
        labels = [x for x in [_label(e.get("user_metadata"))] if x is not None]
        labels += [label for i, label in attached.get(e.get("addr"), []) if i > item.born_event]
        if labels:
            key = " + ".join(labels)[:MAX_LABEL]
            out[key] = out.get(key, 0) + item.size
    return out


def _time(path: str, device: int, trace: List[Dict[str, Any]], i: int) -> Optional[int]:
    """An entry's `time_us` for the summary: an integer or absent; anything else is bad input."""
    value = trace[i].get("time_us")
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63):
        return value
    raise InputError(path, f"device_traces[{device}][{i}].time_us: expected microseconds as an integer, "
                           f"got {brief(value)}")


def _bytes(path: str, device: int, trace: List[Dict[str, Any]], i: int, key: str) -> Optional[int]:
    """An entry's byte count that the walk does not read (an oom's): a size or absent."""
    value = trace[i].get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_BYTES):
        return value
    shown = number(value) if isinstance(value, int) else brief(value)
    raise InputError(path, f"device_traces[{device}][{i}].{key}: {shown} is not a size in bytes (0 to {MAX_BYTES:,})")


def _steps_kept(timeline: Timeline, peak_index: Optional[int]) -> List[Step]:
    """The steps a summary keeps: all of them up to MAX_STEPS, else the first ones and the peak's."""
    steps = timeline.steps
    if len(steps) <= MAX_STEPS:
        return steps
    at_peak = timeline.step_index_at(peak_index) if peak_index is not None else None
    kept = steps[: MAX_STEPS - 1]
    if at_peak is not None and at_peak >= MAX_STEPS - 1:
        kept.append(steps[at_peak])
    return kept


def _group(path: str, items: List[_Live], stacks: StackNormalizer
           ) -> Tuple[List[Group], Optional[str], Dict[str, List[Tuple[int, int, int]]]]:
    """Groups of the live allocations by stack signature and lifetime, largest first, the
    signature of the group holding the allocation that reached the peak, and per group the
    (first event, end event, bytes) of each of its allocations."""
    by_key: Dict[Tuple[str, Lifetime], _Slot] = {}
    peak_key = None
    for item in items:
        try:
            stack: Stack = stacks.stack(item.frames, freed=item.freed, before_trace=item.before_trace,
                                        guess=item.guess)
        except ValueError as exc:
            raise InputError(path, str(exc)) from None
        key = (stack.signature, item.lifetime)
        slot = by_key.get(key)
        if slot is None:
            slot = by_key[key] = _Slot(stack, item.lifetime)
        slot.allocations.append((item.born_event, item.end_event, item.size))
        slot.count += 1
        slot.bytes += item.size
        slot.earlier_bytes += item.size if item.earlier else 0
        if item.earlier_pass is not None:
            slot.forward_bytes += item.size
            slot.passes.add(item.earlier_pass)
        if item.reached_peak:
            peak_key = key
    slots = sorted(by_key.items(), key=lambda kv: (-kv[1].bytes, kv[1].stack.signature, kv[1].lifetime.key()))
    kept = len(slots)
    frames_left = MAX_GROUP_FRAMES
    for k, (_, slot) in enumerate(slots):
        frames_left -= len(slot.stack.frames)
        if k == MAX_GROUPS or frames_left < 0:
            kept = k
            break
    folded = [slot for key, slot in slots[kept:] if key != peak_key]
    slots = [(key, slot) for k, (key, slot) in enumerate(slots) if k < kept or key == peak_key]
    groups = []
    peak_signature = None
    spans = {}
    for key, slot in slots:
        signature = signature_of([slot.stack.signature, slot.lifetime.key()])
        spans[signature] = slot.allocations
        if key == peak_key:
            peak_signature = signature
        groups.append(Group(signature=signature, site=slot.stack.site, frames=list(slot.stack.frames),
                            count=slot.count, bytes=slot.bytes, lifetime=slot.lifetime.to_dict(),
                            bytes_from_earlier_steps=slot.earlier_bytes,
                            bytes_from_earlier_forwards=slot.forward_bytes, earlier_forwards=len(slot.passes)))
    groups += _folded(folded, spans)
    groups.sort(key=lambda g: (-g.bytes, g.signature))
    return groups, peak_signature, spans


def _folded(slots: List[_Slot], spans: Dict[str, List[Tuple[int, int, int]]]) -> List[Group]:
    """One group per lifetime for the groups past MAX_GROUPS: no frames, so classified by lifetime."""
    by_lifetime: Dict[Lifetime, List[_Slot]] = {}
    for slot in slots:
        by_lifetime.setdefault(slot.lifetime, []).append(slot)
    groups = []
    for lifetime, members in by_lifetime.items():
        signature = signature_of(["folded", lifetime.key()])
        spans[signature] = [a for m in members for a in m.allocations]
        groups.append(Group(signature=signature, site=FOLDED.format(len(members)), frames=[],
                            count=sum(m.count for m in members), bytes=sum(m.bytes for m in members),
                            lifetime=lifetime.to_dict(),
                            bytes_from_earlier_steps=sum(m.earlier_bytes for m in members),
                            bytes_from_earlier_forwards=sum(m.forward_bytes for m in members),
                            earlier_forwards=len(set().union(*(m.passes for m in members)))))
    return groups


def devices_of(snapshot: Snapshot) -> List[int]:
    """Devices with a non-empty trace or at least one segment, ascending."""
    found = {i for i, t in enumerate(snapshot.device_traces) if t}
    found.update(s["device"] for s in snapshot.segments)
    return sorted(found)


def summarize(snapshot: Snapshot, history_rules: Optional[Sequence[Rule]] = None,
              keep: Optional[Dict[int, Allocations]] = None) -> Summary:
    """The Summary of every device in the snapshot; with `history_rules`, each device's history
    too, its allocations classified by those rules (the ones the summary will be classified by);
    with `keep`, every allocation of each device is put there by device (the forecast replays them)."""
    stacks = StackNormalizer(snapshot.decoded_bytes)
    number_compiled_buffers(snapshot.device_traces)
    stacks.learn_generated_from(lambda: frames_lists(snapshot.device_traces, snapshot.segments))
    devices = [_device_summary(snapshot, d, stacks, history_rules, keep) for d in devices_of(snapshot)]
    all_groups = [g for d in devices for g in d.groups]
    all_groups += [g for d in devices for p in d.phase_peaks for g in (p.groups or [])]
    for group, frames in zip(all_groups, relativize([g.frames for g in all_groups])):
        group.frames = frames
    return Summary(source=snapshot.source, devices=devices, tool=f"memdiff {__version__}")
