"""`checkpoint`, `checkpoint=F`: non-reentrant activation checkpointing of the repeated blocks
(all, or the fraction F: 0.5 is every other one). A block's activations saved for the backward
are dropped but its output (the next block's input); before the block's backward they come back
(the recomputation), the block's forward run again: at its height, its forward peak. The block's
input is kept for that recomputation until the block's backward is done, whether or not the run
kept it (a layer that reads its input through a copy does not). The recomputation runs on autograd's
backward thread, whose cuBLAS handle makes its own workspaces: a cuBLASLt workspace (1 MiB) at the
first recomputed product with a bias, where the backward itself only ran products without one.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

from memdiff.analyse.lifetimes import BACKWARD, FORWARD
from memdiff.analyse.normalize.workspaces import LT_NATIVE, WORKSPACE_NATIVE
from memdiff.errors import InputError
from memdiff.numbers import decimal
from memdiff.predict.whatif.blocks import GENERIC, blocks_listed
from memdiff.predict.whatif.edit import CannotApply, ChangeRule, Edit
from memdiff.predict.whatif.run import Run, peak_of_set, step_index
from memdiff.recording.emulate.changes.checkpoint import spread
from memdiff.recording.emulate.gpus import kernels
from memdiff.units import format_bytes


def apply_checkpoint(run: Run, edit: Edit, value: Optional[str]) -> None:
    """Checkpoint the fraction `value` (None: all) of the run's repeated blocks."""
    blocks, block = run.blocks, run.block
    if not blocks:
        raise CannotApply("no repeated blocks on the stacks (no nn.Module frames, and no call that each "
                          "forward makes again with the same allocations)")
    if blocks[0].rpartition("_")[0] in GENERIC:
        block = _by_position(run, block, len(blocks))
    chosen = spread(len(blocks), value if value is not None else 1)
    c = run.course
    spans = run.spans
    fwd = (run.phase == FORWARD) & run.of("activation", "temporary", "autograd", "other") & ~c.before
    outlives = run.end_run != run.born_run  # kept past the forward run it was made in: saved for the backward
    transient = fwd & ~outlives
    saved = fwd & outlives
    step_of = step_index(run, c.start)
    dropped = 0
    first_again: Optional[int] = None
    recomputed_ops: Set[str] = set()
    picked = np.zeros(len(blocks) + 1, dtype=bool)
    picked[chosen] = True
    in_chosen = picked[block]  # block -1 reads the last entry, False
    saved_groups = _groups(np.flatnonzero(in_chosen & saved), block, step_of)
    transient_groups = _groups(np.flatnonzero(in_chosen & transient), block, step_of)
    handed = _handed_over(run, block, in_chosen, step_of)
    backward_runs = [k for k, span in enumerate(spans) if span.phase == BACKWARD]
    for key, members in saved_groups.items():
        if len(members) < 2:
            continue
        given, output = handed.get(key, (-1, -1))
        # Its output (the next block's input), if something after it saved it, stays as the run kept it.
        rest = members[members != output]
        in_backward = rest[c.end[rest] < c.events]
        by_backward = in_backward[np.isin(run.end_run[in_backward], backward_runs)]
        if given >= 0 and len(by_backward):
            # The checkpoint holds the block's input until the block's backward is done: the run's
            # own may have freed it in the forward, once the block had read it.
            edit.end[given] = max(int(edit.end[given]), int(c.end[by_backward].max()))
        # The recomputation runs when the backward first needs what the block saved: just
        # before the first of those tensors is freed.
        again = int(c.end[in_backward].min()) - 1 if len(in_backward) else None
        temps = transient_groups.get(key, np.zeros(0, dtype=np.int64))
        # The recomputation runs the block's forward again: at its height, what it saves so far and
        # its temporaries then (the block's forward peak, its output made again included), not all
        # it saves with its temporaries' own peak on top.
        height = peak_of_set(c, np.concatenate([members, temps]), edit.size)
        remade = 0
        for k in rest.tolist():
            dropped += int(c.size[k])
            freed_in_backward = run.end_run[k] < len(spans) and spans[run.end_run[k]].phase == BACKWARD
            if again is not None and c.end[k] > again and freed_in_backward:
                edit.start[k] = max(int(c.start[k]), again)
                remade += int(edit.size[k])
            else:
                edit.size[k] = 0
        if again is not None:
            edit.add(again, again + 1, max(0, height - remade), "autograd")
            first_again = again if first_again is None else min(first_again, again)
            recomputed_ops.update(_ops_called(run, np.concatenate([members, temps])))
    named = blocks_listed([blocks[k] for k in chosen])
    edit.assumptions.append(
        f"checkpointing {len(chosen)} of the {len(blocks)} repeated blocks ({named}): "
        "each keeps its output (the next block's input); what else it saved for the backward is remade just "
        "before the backward first needs it, the block's forward run again (its forward peak)"
        + ("; a generic module repeats, so each block is what the forward makes from one instance to the next"
           if blocks[0].rpartition("_")[0] in GENERIC else ""))
    if not dropped:
        edit.assumptions.append("the chosen blocks save nothing for the backward in this run")
    if first_again is not None:
        made = _backward_workspaces(run, edit, first_again, recomputed_ops)
        if made:
            edit.assumptions.append(
                f"the recomputation runs on autograd's backward thread, whose cuBLAS handle makes {made} "
                "at the first recomputed product, kept to the end as the GPU keeps it")


ATEN_CALL = re.compile(r"^at::_ops::(\w+?)::call\b")


def _ops_called(run: Run, members: np.ndarray) -> Set[str]:
    """Every ATen op on the C++ stacks of `members` (`linear` and the `addmm` it runs)."""
    c = run.course
    if not c.origins or not len(c.origin):
        return set()
    out: Set[str] = set()
    for o in np.unique(c.origin[members]).tolist():
        for f in c.origins[o]:
            m = ATEN_CALL.match(str(getattr(f, "name", "")))
            if m:
                out.add(m.group(1))
    return out


def _backward_workspaces(run: Run, edit: Edit, at: int, ops: Set[str]) -> str:
    """The workspaces the recomputation makes on autograd's backward thread (its own cuBLAS handle),
    made at event `at` and never freed; what is said of them, "" for none. A workspace the
    backward's own products made before `at` is reused; one they made after is made at `at` instead.
    Only stacks with C++ frames show a workspace being made, and the op of each allocation."""
    c = run.course
    if not c.origins or not len(c.origin):
        return ""
    blas = kernels()["blas"]
    said = []
    for kind, native, uses in (("cuBLAS workspace", WORKSPACE_NATIVE, set(blas["ops"])),
                               ("cuBLASLt workspace", LT_NATIVE, set(blas["lt"]))):
        if not ops & uses:
            continue
        natives = np.array([bool(frames) and bool(native.match(str(getattr(frames[0], "name", ""))))
                            for frames in c.origins], dtype=bool)
        made = np.flatnonzero(natives[c.origin] & (run.category == "workspace"))
        if not len(made):
            continue
        in_backward = made[run.phase[made] == BACKWARD]
        if len(in_backward) and int(c.start[in_backward].min()) <= at:
            continue  # the backward thread's handle has one already
        if len(in_backward):
            k = int(in_backward[np.argmin(c.start[in_backward])])
            edit.start[k] = at
        else:
            # The script's thread's own (the forward's): the backward thread's is the same size.
            edit.add(at, c.events, int(c.size[made[np.argmin(c.start[made])]]), "workspace")
        said.append(f"a {kind} ({format_bytes(int(c.size[made[0]]))})")
    return " and ".join(said)


def _handed_over(run: Run, block: np.ndarray, in_chosen: np.ndarray,
                 step_of: np.ndarray) -> Dict[Tuple[int, int], Tuple[int, int]]:
    """(block, step) -> (the allocation the chosen block reads as its input, the one it hands on as
    its output; -1 for none). What one stage hands the next is the result of the last op the forward
    ran before the next began that is still live then: of that op's allocations (a layer norm's
    output, mean and rstd; dropout's mask and output), the largest, the last made on a tie."""
    c = run.course
    fwd = run.forward
    out: Dict[Tuple[int, int], Tuple[int, int]] = {}
    if not len(fwd):
        return out
    chosen = in_chosen[fwd] & (block[fwd] >= 0)
    block = block[fwd]
    frames = [tuple(f) for f in c.origins] if c.origins and len(c.origin) else None
    # Where each stage of the forward starts: a change of block, or of forward run.
    cuts = np.flatnonzero((np.diff(block) != 0) | (np.diff(run.born_run[fwd]) != 0)) + 1
    starts = np.concatenate([[0], cuts]).astype(np.int64)
    ends = np.append(cuts, len(fwd))
    for a, b in zip(starts.tolist(), ends.tolist()):
        if not chosen[a]:
            continue
        key = (int(block[a]), int(step_of[fwd[a]]))
        here = int(run.born_run[fwd[a]])
        out[key] = (_last_result(run, fwd, a, here, frames), _last_result(run, fwd, b, here, frames))
    return out


def _last_result(run: Run, fwd: np.ndarray, at: int, here: int, frames: Optional[List[Tuple[object, ...]]]) -> int:
    """The result the forward run `here` hands on at position `at` of `fwd` (the forward's allocations
    in order): of the last op before it in that run still live then, the largest allocation; -1 for none."""
    c = run.course
    when = int(c.start[fwd[at]]) if at < len(fwd) and run.born_run[fwd[at]] == here else run.spans[here].end_event
    j = at - 1
    while j >= 0 and run.born_run[fwd[j]] == here and c.end[fwd[j]] <= when:
        j -= 1
    if j < 0 or run.born_run[fwd[j]] != here:
        return -1
    op = int(fwd[j])
    best = op
    same = (lambda x: frames[c.origin[x]] == frames[c.origin[op]]) if frames is not None \
        else (lambda x: c.stack[x] == c.stack[op])
    i = j - 1
    # The op's allocations are made one after another, its scratch (dropout's generator state) among them.
    while i >= 0 and run.born_run[fwd[i]] == here and same(int(fwd[i])):
        if c.end[fwd[i]] > when and c.size[fwd[i]] > c.size[best]:
            best = int(fwd[i])
        i -= 1
    return best


def _groups(members: np.ndarray, block: np.ndarray, step_of: np.ndarray) -> Dict[Tuple[int, int], np.ndarray]:
    """`members` grouped by (block, step), in one sort rather than a scan per block and step."""
    if not len(members):
        return {}
    keys = np.stack([block[members], step_of[members]], axis=1)
    order = np.lexsort((keys[:, 1], keys[:, 0]))
    members, keys = members[order], keys[order]
    cuts = np.flatnonzero(np.any(np.diff(keys, axis=0) != 0, axis=1)) + 1
    return {(int(keys[i, 0]), int(keys[i, 1])): part
            for i, part in zip(np.concatenate([[0], cuts]).tolist(), np.split(members, cuts))}


def _by_position(run: Run, block: np.ndarray, count: int) -> np.ndarray:
    """Block membership by position in each forward: a generic repeated module (a Linear, a
    Conv2d) is usually checkpointed with what follows it outside any module (its activation
    function, pooling, dropout), so everything the forward makes from one instance's first
    allocation to the next's belongs to the first; the last instance spans as many events as the
    others do (their median)."""
    c = run.course
    out = block.copy()
    fwd = np.flatnonzero(run.phase == FORWARD)
    step_of = step_index(run, c.start)
    firsts: Dict[int, List[Tuple[int, int]]] = {}  # step -> (first event, block), in event order
    for (b, step), members in _groups(fwd[block[fwd] >= 0], block, step_of).items():
        firsts.setdefault(step, []).append((int(c.start[members].min()), b))
    by_step = fwd[np.argsort(step_of[fwd], kind="stable")]
    cuts = np.flatnonzero(np.diff(step_of[by_step])) + 1
    for part in np.split(by_step, cuts) if len(by_step) else []:
        known = sorted(firsts.get(int(step_of[part[0]]), []))
        if len(known) < 2:
            continue
        starts = np.array([f for f, _ in known], dtype=np.int64)
        length = int(np.median(np.diff(starts)))
        ends = np.append(starts[1:], starts[-1] + length)
        slot = np.searchsorted(starts, c.start[part], side="right") - 1
        inside = (slot >= 0) & (c.start[part] < ends[np.maximum(slot, 0)])
        owners = np.array([b for _, b in known], dtype=np.int64)
        out[part[inside]] = owners[slot[inside]]
    return out


def check(value: Optional[str]) -> None:
    """No value (every block), or the fraction of the blocks in (0, 1]."""
    if value is None:
        return
    try:
        f = decimal(value)  # ASCII digits only: float() reads `٠.٥` as 0.5
    except ValueError:
        raise InputError("--change", f"checkpoint={value}: give a fraction of the blocks in (0, 1]") from None
    if not 0 < f <= 1:
        raise InputError("--change", f"checkpoint={value}: give a fraction of the blocks in (0, 1]")


RULE = ChangeRule("checkpoint", check, lambda run, edit, value: apply_checkpoint(run, edit, value))
