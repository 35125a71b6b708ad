"""What the trace never saw made (its allocations fell out of the ring buffer, or came before
recording): the dump's blocks kept as stand-ins for gradients, optimizer state and workspaces,
by their sizes and the stacks near them.
"""


from __future__ import annotations

import bisect
import itertools
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from memdiff.analyse.lifetimes import (
    BACKWARD,
    OPTIMIZER,
    Timeline,
    frame_phase,
)
from memdiff.analyse.normalize.walk import DumpBlock, Walk
from memdiff.analyse.normalize.workspaces import workspaces_by_handles
from memdiff.model import KIND_KEY
from memdiff.read.frames import (
    GUESS_PARAMETER,
    GUESS_STATE,
)

# A re-versioned tensor of at most this many bytes is a step counter (`state["step"]`, one float32),
# not a weight (a one-element weight is rare): in a single-tensor update each weight's turn begins with one.
SCALAR_BYTES = 4


def gradient_sizes(walk: Walk, trace: List[Dict[str, Any]], held: List[int], backwards: Sequence[Any],
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


def _keeps_what_it_makes(walk: Walk, run: Any) -> bool:
    """Whether an allocation made in the run outlives it (an optimizer step making its state)."""
    k = bisect.bisect_left(walk.allocs, run.start_event)
    while k < len(walk.allocs) and walk.allocs[k] <= run.end_event:
        if walk.end(walk.closed[walk.allocs[k]]) > run.end_event:
            return True
        k += 1
    return False


def state_by_sizes(blocks: List[DumpBlock], walk: Walk, trace: List[Dict[str, Any]], timeline: Timeline) -> None:
    """Guess the category of the frameless blocks older than the trace (CUDA captures): parameter,
    optimizer state where their sizes hold further copies of the gradients', or a BLAS workspace.

    An optimizer keeps each state tensor the shape of its weight, so state made before recording
    (in a constructor, as Adagrad's; in a warm-up step) leaves, of every gradient's size, 1 + k
    blocks per gradient (k state tensors per weight) where the weights alone leave one. The first
    optimizer step after a backward shows the gradients (when it keeps what it makes, the state
    is in the trace with its stacks, and nothing is guessed: frozen weights of the trainable
    ones' sizes are no state); the largest k (at most MAX_STATE_PER_WEIGHT) whose copies are
    there for nearly all their bytes is taken, and k blocks per gradient of each size are marked
    state. Which block of a size is a weight and which state cannot be told: the bytes can, and
    the site says they are a guess. A workspace is what a workspace's size holds beyond the
    weights and their state (a 512 x 512 float32 weight is a cuBLASLt workspace's 1 MiB).
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
            grads = gradient_sizes(walk, trace, [], backwards, run)
            break
    # A first step that keeps what it makes has its state in the trace, with its stack: frozen
    # weights of the trainable ones' sizes are older than the trace too, and no state.
    per_weight = {} if keeps else _state_per_weight(frameless, grads)
    # The state is counted before the workspaces: a workspace missing from the trace may never
    # have been made (no biases, no cuBLASLt), and must not take a block of the state's.
    workspaces_by_handles(frameless, walk, trace, timeline,
                          {size: count * (1 + per_weight.get(size, 0)) for size, count in grads.items()})
    for size, k in per_weight.items():
        of_size = [b for b in frameless if b.size == size and b.guess == GUESS_PARAMETER]
        for b in of_size[max(0, len(of_size) - k * grads[size]):]:
            b.guess = GUESS_STATE


def _state_per_weight(frameless: List[DumpBlock], grads: Dict[int, int]) -> Dict[int, int]:
    """size -> state tensors per weight of that size, for the gradients' sizes whose frameless blocks
    hold further copies of them (state_by_sizes); {} where they do not."""
    by_size: Dict[int, int] = {}
    for b in frameless:
        by_size[b.size] = by_size.get(b.size, 0) + 1
    # A weight older than the trace has a block of its gradient's size there: what else the
    # backward kept (a BLAS workspace, a buffer a hook holds) does not. Weights made in the trace
    # (most of the gradients' bytes without such blocks) leave nothing to guess.
    weights_older = {size: count for size, count in grads.items() if by_size.get(size, 0) >= count}
    total = sum(size * count for size, count in weights_older.items())
    if not total or total < sum(size * count for size, count in grads.items()) / 2:
        return {}
    for k in range(MAX_STATE_PER_WEIGHT, 0, -1):
        covered = [size for size, count in weights_older.items() if by_size.get(size, 0) >= (1 + k) * count]
        if sum(size * weights_older[size] for size in covered) >= STATE_COVERAGE * total:
            return {size: k for size in covered}
    return {}


def optimizer_state_stand_ins(walk: Walk, trace: List[Dict[str, Any]], timeline: Timeline
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
        grads = gradient_sizes(walk, trace, held, backwards, run)
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


def stand_ins_of(walk: Walk, trace: List[Dict[str, Any]], timeline: Timeline) -> Dict[int, List[Any]]:
    """Stacks standing in for tensors live before the trace, from their in-place updates: optimizer
    state by the step's update order, gradients by the backward's accumulation (which wins: no
    optimizer updates a gradient as its state)."""
    return {**optimizer_state_stand_ins(walk, trace, timeline), **_gradient_stand_ins(walk, trace, timeline)}


# How far from a gradient's in-place accumulation its incoming gradient's events are looked for.
ACCUMULATE_NEAR = 16


def _gradient_stand_ins(walk: Walk, trace: List[Dict[str, Any]], timeline: Timeline) -> Dict[int, List[Any]]:
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


def _optimizer_stack_near(walk: Walk, trace: List[Dict[str, Any]], event: int, start: int, end: int
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


def _runs_fused_step(walk: Walk, trace: List[Dict[str, Any]], run: Any) -> bool:
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


def _loop_after_step(walk: Walk, trace: List[Dict[str, Any]], run: Any, at: List[int]) -> int:
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


def _stack_before(walk: Walk, trace: List[Dict[str, Any]], event: int, since: int) -> Optional[List[Any]]:
    """The stack of the last allocation with one at or after `since` and before `event`: the loop's
    call that wrote the frameless new version at `event`."""
    k = bisect.bisect_left(walk.allocs, event) - 1
    while k >= 0 and walk.allocs[k] >= since:
        frames = trace[walk.allocs[k]].get("frames")
        if frames:
            return frames
        k -= 1
    return None


def dump_blocks(segments: List[Dict[str, Any]]) -> Iterator[Tuple[int, int, Optional[List[Any]], Any, bool]]:
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


def dump_only_blocks(segments: List[Dict[str, Any]], walk: "Walk", trace: Any
                     ) -> List[Tuple[int, int, Optional[List[Any]], Any]]:
    """(address, bytes, frames, KIND_KEY) of the dump's blocks that the trace does not hold open at
    its end: memory older than the trace.

    A placed block (no address of its own) that finds no open allocation at its place is matched
    by size to an open allocation no block claimed: where the profiler missed a free on another
    thread (gloo's), the trace holds two open allocations whose ranges overlap, torch's converter
    lays the blocks out past that point at other addresses than the trace's, and each of them
    would otherwise be counted twice, once in the trace and once as older than it."""
    open_at_end = walk.open_at_end
    blocks = list(dump_blocks(segments))
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
