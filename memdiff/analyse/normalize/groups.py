"""What is live at the peak, grouped by stack signature; past MAX_GROUPS (or MAX_GROUP_FRAMES)
the smallest are folded into one group per lifetime, so the groups always add up to the peak.
"""


from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from memdiff.analyse.lifetimes import (
    LIFETIMES,
    Lifetime,
    Timeline,
)
from memdiff.analyse.normalize.kinds import Kind, Origins, kind_of
from memdiff.analyse.normalize.standins import SCALAR_BYTES
from memdiff.analyse.normalize.walk import DumpBlock, Walk
from memdiff.errors import InputError, brief
from memdiff.model import KIND_KEY, Group
from memdiff.read.frames import (
    Stack,
    StackNormalizer,
    signature_of,
)

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
class Live:
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
class Slot:
    """The live allocations of one stack and lifetime, gathered into a group."""

    stack: Stack
    lifetime: Lifetime
    count: int = 0
    bytes: int = 0
    earlier_bytes: int = 0  # allocated in a step before the peak's, or kept from an earlier forward
    forward_bytes: int = 0  # of which kept from an earlier forward of the same code in the peak's step
    passes: Set[int] = field(default_factory=set)  # the earlier forwards those come from
    allocations: List[Tuple[int, int, int]] = field(default_factory=list)  # (first event, end event, bytes)


MAX_LABEL = 200  # characters of a user's label kept


def _label(value: Any) -> Optional[str]:
    """A user's label as shown: a non-empty string, clipped; anything else described briefly."""
    if value is None or value == "":
        return None
    return value[:MAX_LABEL] if isinstance(value, str) else brief(value)


def labels_of(trace: List[Dict[str, Any]], annotations: Sequence[int], items: Sequence[Live],
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


def group_live(path: str, items: List[Live], stacks: StackNormalizer,
               where: Callable[[Live], str] = lambda item: ""
               ) -> Tuple[List[Group], Optional[str], Dict[str, List[Tuple[int, int, int]]]]:
    """Groups of the live allocations by stack signature and lifetime, largest first, the
    signature of the group holding the allocation that reached the peak, and per group the
    (first event, end event, bytes) of each of its allocations. `where` names, for an error, the
    place in the file of an item's stack that cannot be read (`device_traces[0][7]: `)."""
    by_key: Dict[Tuple[str, Lifetime], Slot] = {}
    peak_key = None
    for item in items:
        try:
            stack: Stack = stacks.stack(item.frames, freed=item.freed, before_trace=item.before_trace,
                                        guess=item.guess)
        except ValueError as exc:
            raise InputError(path, where(item) + str(exc)) from None
        key = (stack.signature, item.lifetime)
        slot = by_key.get(key)
        if slot is None:
            slot = by_key[key] = Slot(stack, item.lifetime)
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


def _folded(slots: List[Slot], spans: Dict[str, List[Tuple[int, int, int]]]) -> List[Group]:
    """One group per lifetime for the groups past MAX_GROUPS: no frames, so classified by lifetime."""
    by_lifetime: Dict[Lifetime, List[Slot]] = {}
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


def live_at(walk: Walk, trace: List[Dict[str, Any]], p: int, dump_only: List[DumpBlock],
             timeline: Timeline, stand_ins: Dict[int, List[Any]],
             kinds: Optional[Dict[int, Tuple[Any, Kind]]] = None, path: str = "") -> List[Live]:
    """Every allocation live after event `p` with its lifetime: open allocations, memory live
    before the trace and freed after `p`, and dump blocks the trace never opened. Memory live
    before the trace is known by the stack that freed it, or by its stand-in (see
    optimizer_state_stand_ins). With `kinds` (a window), what the full trace makes of memory
    (KIND_KEY on its entry or block) replaces what the window alone would."""
    n = len(trace)
    origins = Origins(walk, trace, timeline, stand_ins)
    peak_step = timeline.step_index_at(p) if p >= 0 else None
    items: List[Live] = []
    records: List[Any] = []  # per item, its KIND_KEY value, if any
    for j in walk.live_allocs(p).tolist():
        frames, before, guess, _, first, end = origins.alloc(j)
        records.append(trace[j].get(KIND_KEY) if kinds is not None else None)
        if before:
            items.append(Live(frames, trace[j]["size"], freed=True, before_trace=True, entry=None, born_event=-1,
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
        items.append(Live(frames, trace[j]["size"], freed=False, before_trace=False,
                           entry=trace[first], born_event=first, end_event=end, earlier=earlier, reached_peak=j == p,
                           earlier_pass=earlier_pass))
    for i in walk.unmatched[bisect.bisect_right(walk.unmatched, p):]:
        frames, _, _, _, _, end = origins.unmatched(i)
        records.append(trace[i].get(KIND_KEY) if kinds is not None else None)
        items.append(Live(frames, trace[i]["size"], freed=True, before_trace=True, entry=None,
                           born_event=-1, end_event=end, earlier=False))
    for b in dump_only:
        records.append(b.kind if kinds is not None else None)
        items.append(Live(b.frames, b.size, freed=False, before_trace=True, entry=None, born_event=-1, end_event=n,
                           earlier=False, guess=b.guess))
    codes = timeline.lifetime_codes(np.array([item.born_event for item in items], dtype=np.int64),
                                    np.array([item.end_event for item in items], dtype=np.int64), n)
    for item, code, record in zip(items, codes.tolist(), records):
        item.lifetime = LIFETIMES[code]
        if record is not None and kinds is not None:
            kind = kind_of(path, record, kinds)
            item.frames, item.freed, item.before_trace = kind.frames, kind.freed, kind.before_trace
            item.guess, item.lifetime = kind.guess, LIFETIMES[kind.lifetime]
    return items
