"""The repeated blocks of a run's forward (a model's layers): from the profiler's module frames
(`nn.Module: GPT2Block_3`), or without them (CUDA stacks) the call the forward repeats with the
same allocations.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from memdiff.predict.forecast.course import DeviceCourse
from memdiff.predict.whatif.run import Run, forward_in_order

MODULE_FRAME = re.compile(r"^nn\.Module: (\w+?)_(\d+)$")


# A block named by the call that repeats, where the stacks name no module (`call 3 at modeling_layers.py:109`).
CALL = re.compile(r"call (\d+) at (.+)")


def called_at(blocks: Sequence[str]) -> Optional[str]:
    """The one line `blocks` are calls of (`modeling_layers.py:109`), or None when they are modules."""
    calls = [CALL.fullmatch(b) for b in blocks]
    lines = {m.group(2) for m in calls if m is not None}
    return lines.pop() if blocks and all(calls) and len(lines) == 1 else None


def blocks_listed(blocks: Sequence[str]) -> str:
    """Some of the blocks, named once: `calls 1 to 12 at modeling_layers.py:109`, `calls 2, 4 and 6 at
    train.py:9`, or the modules' names (`GPT2Block_1, GPT2Block_3`)."""
    line = called_at(blocks)
    if line is None:
        return ", ".join(blocks)
    numbers = [int(m.group(1)) for m in (CALL.fullmatch(b) for b in blocks) if m is not None]
    if len(numbers) == 1:
        return f"call {numbers[0]} at {line}"
    if numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"calls {numbers[0]} to {numbers[-1]} at {line}"
    return f"calls {', '.join(map(str, numbers[:-1]))} and {numbers[-1]} at {line}"


# Module classes too small to be "the repeated block" when a larger repeated one exists.
GENERIC = frozenset(("Linear", "Conv1D", "Conv1d", "Conv2d", "Conv3d", "Embedding", "LayerNorm", "RMSNorm",
                     "GroupNorm", "BatchNorm1d", "BatchNorm2d", "Dropout", "GELU", "ReLU", "SiLU", "Tanh",
                     "Softmax", "Identity", "NewGELUActivation", "GELUActivation", "Sequential", "ModuleList"))


# The share of a repeated module's bytes that a class nested in it, with more instances, must
# hold to be the block instead (T5's blocks hold about 90% of what its two stacks make).
NESTED_SHARE = 0.75


def repeated_blocks(course: DeviceCourse) -> Tuple[List[str], np.ndarray]:
    """(the repeated blocks' instance names in order, each allocation's index into them or -1).

    The repeated block is the module class with at least two instances under one parent on the
    stacks (the profiler's `nn.Module: GPT2Block_0` frames) whose instances made the most bytes;
    a generic one (Linear, Embedding) only when no other repeats. When a class nested inside it
    has more instances holding most of those bytes (an encoder-decoder's layers inside its two
    stacks), that class is the block."""
    if not course.origins or not len(course.origin):
        return [], np.full(len(course.size), -1, dtype=np.int64)
    paths: List[List[Tuple[str, int]]] = []
    for frames in course.origins:
        mods = [(m.group(1), int(m.group(2))) for m in (MODULE_FRAME.match(f.name) for f in frames) if m]
        paths.append(mods[::-1])  # outermost first
    by_origin = np.bincount(course.origin, weights=course.size.astype(np.float64), minlength=len(paths))
    instances: Dict[Tuple[Tuple[str, ...], str], Dict[int, float]] = {}
    for o, path in enumerate(paths):
        for depth, (cls, number) in enumerate(path):
            parent = tuple(c for c, _ in path[:depth])
            slot = instances.setdefault((parent, cls), {})
            slot[number] = slot.get(number, 0.0) + float(by_origin[o])
    candidates = [(cls not in GENERIC, sum(v.values()), len(parent), cls, parent)
                  for (parent, cls), v in instances.items() if len(v) >= 2]
    if not candidates:
        return [], np.full(len(course.size), -1, dtype=np.int64)
    _, held, _, cls, parent = max(candidates)
    # An encoder-decoder repeats its stacks (T5Stack_0, T5Stack_1), which are not alike (only the
    # decoder's layers attend to the encoder), and, inside them, its layers: the layers are the
    # blocks (what gradient checkpointing wraps) when they are more and hold most of what the stacks
    # made. Alike instances (a Mixtral layer's experts inside its decoder layers) keep the outer one.
    while not _alike(paths, parent, cls):
        count = len(instances[(parent, cls)])
        inner = [(b, p, c) for specific, b, _, c, p in candidates
                 if specific and p[:len(parent) + 1] == (*parent, cls) and len(instances[(p, c)]) > count
                 and b >= NESTED_SHARE * held]
        if not inner:
            break
        held, parent, cls = max(inner)
    numbers = sorted(instances[(parent, cls)])
    index = {n: k for k, n in enumerate(numbers)}
    of_origin = np.full(len(paths), -1, dtype=np.int64)
    for o, path in enumerate(paths):
        inside = len(path) > len(parent) and tuple(c for c, _ in path[:len(parent)]) == parent
        if inside and path[len(parent)][0] == cls:
            of_origin[o] = index[path[len(parent)][1]]
    return [f"{cls}_{n}" for n in numbers], of_origin[course.origin]


def _alike(paths: List[List[Tuple[str, int]]], parent: Tuple[str, ...], cls: str) -> bool:
    """Whether every instance of `cls` under `parent` runs the same module classes inside it."""
    inside: Dict[int, Set[str]] = {}
    depth = len(parent)
    for path in paths:
        if len(path) > depth and path[depth][0] == cls and tuple(c for c, _ in path[:depth]) == parent:
            inside.setdefault(path[depth][1], set()).update(c for c, _ in path[depth + 1:])
    return len({frozenset(s) for s in inside.values()}) <= 1


# Calls tried as the repeated block, those holding the most forward bytes first.
MAX_CALLS = 64


def repeated_calls(run: Run) -> Tuple[List[str], np.ndarray]:
    """repeated_blocks for stacks without module frames (the caching allocator's, on CUDA): the
    block is the call, one Python call path, under which every forward makes one sequence of
    allocations k >= 2 times over (the same stacks, in the same order: the loop over a model's
    layers), workspaces apart, each time more than one. Of such calls, the one whose allocations
    hold the most bytes; on a tie, the innermost (the tightest call around the block). Each
    allocation's block is its repeat's place in its forward."""
    c = run.course
    none = np.full(len(c.size), -1, dtype=np.int64)
    # A workspace (cuBLAS's, made by the first matrix product) is made once, not per block.
    fwd = forward_in_order(run, ~run.of("workspace"))
    if not c.origins or not len(c.origin) or not len(fwd):
        return [], none
    # Origins are kinds, told apart by their lifetimes too: a block's allocations are the same by their frames.
    numbered: Dict[Tuple[Any, ...], int] = {}
    same_frames = np.array([numbered.setdefault(tuple(frames), len(numbered)) for frames in c.origins], dtype=np.int64)
    # Each origin's call paths: its stack from the outermost frame down to each Python frame, each
    # path a node numbered from its parent's, so a deep stack costs its depth, not its depth squared.
    # Nested calls around the same allocations are one candidate: the innermost stands for them.
    node_of: Dict[Tuple[Any, int], int] = {}
    members: Dict[int, List[int]] = {}
    place: Dict[int, Tuple[int, int]] = {}  # node -> (an origin, the index of the path's innermost frame)
    for o, frames in enumerate(c.origins):
        parent = -1
        for i in range(len(frames) - 1, -1, -1):
            parent = node_of.setdefault((frames[i], parent), len(node_of))
            if frames[i].file:
                members.setdefault(parent, []).append(o)
                place[parent] = (o, i)
    candidates: Dict[Tuple[int, ...], Tuple[int, int]] = {}  # origins -> (depth, node)
    for node, origins in members.items():
        key = tuple(origins)
        o, i = place[node]
        depth = len(c.origins[o]) - i
        if depth > candidates.get(key, (0, -1))[0]:
            candidates[key] = (depth, node)
    origin = c.origin[fwd]
    # The bytes under a call are those of its origins' forward allocations: the most first (on a tie,
    # the innermost), and the first that repeats is the block. Only the first MAX_CALLS are tried,
    # so that a file of thousands of distinct deep stacks costs a bounded number of passes.
    held_by = np.bincount(origin, weights=c.size[fwd].astype(np.float64), minlength=len(c.origins))
    ranked = sorted(((float(held_by[list(key)].sum()), depth, key, node) for key, (depth, node) in candidates.items()),
                    key=lambda r: (r[0], r[1]), reverse=True)
    cuts = np.flatnonzero(np.diff(run.born_run[fwd])) + 1
    parts = np.split(np.arange(len(fwd)), cuts)
    chosen: List[Tuple[np.ndarray, Repeat]] = []  # (under the call, how it repeats), one per way it is reached
    site = None  # the innermost frame of the block's call
    taken = np.zeros(len(fwd), dtype=bool)  # the forward allocations under a call chosen
    for rank, (_, _, key, node) in enumerate(ranked):
        o, i = place[node]
        if site is None and rank >= MAX_CALLS:
            break
        if site is not None and c.origins[o][i] != site:
            continue
        mask = np.zeros(len(c.origins), dtype=bool)
        mask[list(key)] = True
        under = mask[origin]
        if (under & taken).any():
            continue
        repeat = _repeat_in_every_forward(parts, under, same_frames[origin])
        if repeat is None:
            continue
        chosen.append((under, repeat))
        taken |= under
        # The same call reached another way (an encoder-decoder's two stacks loop over their
        # layers on one line): its repeats are blocks too, in the order the forward runs them.
        site = c.origins[o][i]
    if site is None:
        return [], none
    block = none.copy()
    count = 0
    for part in parts:
        firsts: List[Tuple[int, np.ndarray]] = []  # (first event, its allocations), per instance of the call
        for under, repeat in chosen:
            mine = part[under[part]]
            instance = repeat.instance(len(mine))
            for k in range(int(instance.max()) + 1 if len(mine) else 0):
                made = fwd[mine[instance == k]]
                firsts.append((int(c.start[made].min()), made))
        for k, (_, made) in enumerate(sorted(firsts, key=lambda f: f[0])):
            block[made] = k
        count = max(count, len(firsts))
    where = f"{site.file.rpartition('/')[2]}:{site.line}"  # the innermost line the block runs under
    return [f"call {k + 1} at {where}" for k in range(count)], block


@dataclass(frozen=True)
class Repeat:
    """How a call's allocations in one forward split into its instances: the first `first` of them
    are its first instance, then one every `period`. The first may make more or less than the others
    (T5's first layer makes the relative position bias every later layer reuses)."""

    first: int
    period: int

    def instance(self, count: int) -> np.ndarray:
        """Each of `count` allocations' instance, in order."""
        k = np.arange(count)
        return np.where(k < self.first, 0, 1 + (k - self.first) // self.period)


def _repeat_in_every_forward(parts: List[np.ndarray], under: np.ndarray, kinds: np.ndarray) -> Optional[Repeat]:
    """How the allocations `under` a call repeat in each forward run (`parts`), the same in every
    one that has any; None where one does not repeat, or one makes a single allocation each time
    (a dropout is no block to checkpoint)."""
    found: Optional[Repeat] = None
    for part in parts:
        mine = part[under[part]]
        if not len(mine):
            continue
        repeat = _repeat(kinds[mine])
        if repeat is None or repeat.period < 2 or (found is not None and repeat != found):
            return None
        found = repeat
    return found


def _repeat(seq: np.ndarray) -> Optional[Repeat]:
    """How `seq` is one sequence made again and again: the shortest p that repeats to make it whole;
    else a first instance unlike the others (T5's first layer makes the relative position bias the
    later ones reuse; ResNet's first bottleneck of a stage makes its downsample, and no copy of its
    input) but mostly what each of them makes (LIKE), then at least two alike; None for neither."""
    n = len(seq)
    for p in range(1, n // 2 + 1):
        if n % p == 0 and np.array_equal(seq, np.tile(seq[:p], n // p)):
            return Repeat(p, p)
    # A period p repeats the last allocation p before it: only those are tried (a few, not n / 2).
    periods = sorted({p for p in (n - 1 - np.flatnonzero(seq[:-1] == seq[-1])).tolist() if 2 <= p <= 2 * n // 5})
    for p in periods:
        same = seq[:-p] == seq[p:]  # where each element is the one a period later
        alike = len(same) - (int(np.flatnonzero(~same)[-1]) + 1 if not same.all() else 0)
        reps = (alike + p) // p  # the instances the tail is made of
        first = n - reps * p
        # The tail may have taken the first instance's last p allocations for one more instance:
        # then the first is those too.
        tries = ([(first, reps)] if 2 * first >= p else []) + ([(first + p, reps - 1)] if first < p else [])
        for length, count in tries:
            if count >= 2 and length < 2 * p and _like(seq[:length], seq[n - p:]):
                return Repeat(length, p)
    return None


# How alike a first instance and the others must be: matching allocations over all of both, as
# difflib counts them (T5's first layers: 0.79 and 0.86; ResNet-50's first bottlenecks: 0.82 to 1).
LIKE = 2 / 3


def _like(first: np.ndarray, unit: np.ndarray) -> bool:
    """Whether `first` makes mostly what `unit` makes, in the same order."""
    return SequenceMatcher(None, first.tolist(), unit.tolist(), autojunk=False).ratio() >= LIKE


def blocks_of(run: Run) -> Tuple[List[str], np.ndarray]:
    """The repeated blocks: by the profiler's module frames, else by the calls that repeat."""
    blocks, block = repeated_blocks(run.course)
    return (blocks, block) if blocks else repeated_calls(run)
