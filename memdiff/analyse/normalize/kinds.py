"""Each allocation's kind: its lifetime (lifetimes.py) and, for what the trace never saw made,
the guess of what it is (parameter, optimizer state, workspace), per origin.
"""


from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from memdiff.analyse.history import Allocations
from memdiff.analyse.lifetimes import (
    LIFETIMES,
    Scopes,
    Timeline,
    build_timeline,
)
from memdiff.analyse.normalize.standins import dump_only_blocks, stand_ins_of, state_by_sizes
from memdiff.analyse.normalize.walk import DumpBlock, Walk
from memdiff.errors import InputError, brief
from memdiff.model import KIND_KEY, WINDOW_KEY
from memdiff.read.frames import (
    GUESS_PARAMETER,
    GUESS_STATE,
    GUESS_WORKSPACE,
    Stack,
    StackNormalizer,
)
from memdiff.read.load import Snapshot


@dataclass(frozen=True)
class Kind:
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


class Origins:
    """Where the stack, guess and lifetime of each live allocation come from in one device's trace:
    one code path for the peak, the phase peaks and the kinds a window keeps of the full trace."""

    def __init__(self, walk: Walk, trace: List[Dict[str, Any]], timeline: Timeline,
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

    def kinds(self, allocs: Sequence[int], unmatched: Sequence[int], dump_only: Sequence[DumpBlock]
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
                # Frames the stack reads as none (None, [], 0, ...) are written as None, the one
                # form kind_of takes back.
                kind = shared[key] = {"frames": frames or None, "freed": freed, "before_trace": before, "guess": guess,
                                      "update": update, "lifetime": LIFETIMES[code].key()}
            out.append(kind)
        return out


def kind_of(path: str, value: Any, known: Dict[int, Tuple[Any, Kind]]) -> Kind:
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
    kind = Kind(value.get("frames"), value["freed"], value["before_trace"], value["guess"], value["update"],
                 LIFETIME_CODES[value["lifetime"]])
    known[id(value)] = (value, kind)  # the value kept alive: its id stays its own
    return kind


def mark_kept_updates(stacks: StackNormalizer, kinds: Optional[Dict[int, Tuple[Any, Kind]]]) -> None:
    """A window's kept kinds whose frames stand in for an in-place update read as one, as in the full trace."""
    if kinds:
        stacks.mark_updates(k.frames for _, k in kinds.values() if k.update and k.frames)


def window_kinds(snapshot: Snapshot, device: int, walk: Walk, allocs: Sequence[int], unmatched: Sequence[int]
                 ) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """What the full trace of `device` makes of memory a window of it holds, in KIND_KEY's form: of the
    allocations open at `allocs` and of memory freed at the unmatched frees `unmatched` (one list, in
    that order), and of the dump's blocks the trace never opened (in dump_blocks' order). Memory a
    window carries in keeps its stack, lifetime and so category: a window alone would see weights
    updated in place as memory freed, and a whole run's memory as made before its start. Kinds the
    snapshot already carries (a window of a window) are kept as they are."""
    path = snapshot.path
    trace = snapshot.device_traces[device] if device < len(snapshot.device_traces) else []
    segments = [seg for seg in snapshot.segments if seg["device"] == device]
    dump_only = [DumpBlock(size, frames, kind=kind)
                 for _, size, frames, kind in dump_only_blocks(segments, walk, trace)]
    running = walk.running_totals()
    timeline = build_timeline(trace, walk.allocs, running, 0, Scopes(snapshot.external_annotations, device),
                              walk.version_of)
    stand_ins = stand_ins_of(walk, trace, timeline)
    state_by_sizes(dump_only, walk, trace, timeline)
    found = Origins(walk, trace, timeline, stand_ins).kinds(allocs, unmatched, dump_only)
    records = [trace[j].get(KIND_KEY) for j in allocs] + [trace[i].get(KIND_KEY) for i in unmatched]
    records += [b.kind for b in dump_only]
    if WINDOW_KEY in snapshot.source.keys:
        known: Dict[int, Tuple[Any, Kind]] = {}
        for record in records:
            if record is not None:
                kind_of(path, record, known)  # checked before it is copied on
        found = [found[k] if record is None else record for k, record in enumerate(records)]
    m = len(allocs) + len(unmatched)
    return found[:m], found[m:]


class Kinds:
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


def read_allocations(path: str, walk: Walk, trace: List[Dict[str, Any]], dump_only: List[DumpBlock],
                 timeline: Timeline, stacks: StackNormalizer, stand_ins: Dict[int, List[Any]],
                 kept: Optional[Dict[int, Tuple[Any, Kind]]] = None) -> Allocations:
    """Every allocation of the trace (each version of a re-versioned tensor on its own, with the
    first version's stack and the whole chain's lifetime), then memory from before the trace."""
    n = len(trace)
    opened = np.frombuffer(walk.allocs, dtype=np.int64) if len(walk.allocs) else np.zeros(0, np.int64)
    closed = np.frombuffer(walk.closed, dtype=np.int64)[opened] if len(opened) else np.zeros(0, np.int64)
    unmatched = np.frombuffer(walk.unmatched, dtype=np.int64) if len(walk.unmatched) else np.zeros(0, np.int64)
    born = opened.copy()  # the first version's event, -1 before the trace
    ends = closed.copy()  # the event that frees the last version
    kinds = Kinds(path, stacks)
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
                kind = kind_of(path, record, kept)
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
