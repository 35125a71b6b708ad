"""calls: which memory an op frees before it returns (PyTorch's `temporary`).

PyTorch's memory profiler calls a tensor `temporary` when one op, a torch op called from Python
(or a backward node), allocates and frees it before returning: scratch, such as the attention
scores of `scaled_dot_product_attention`'s math path. It knows each op's start and end; a snapshot
does not. What a snapshot of the profiler route (CPU captures) does show is the op's call: each
allocation's innermost frame is the Python-level call into native code (`<built-in function
scaled_dot_product_attention>`), and a free carries the stack of the allocation it frees. So a
call is read as a run of consecutive trace entries (allocations and frees) with one such stack:
memory allocated and freed inside one run was made and freed inside one call. A run breaks at any
entry with another stack, so a tensor the op returns and the caller frees later (after other ops
allocated) is not a temporary.

What this cannot tell: the same op called again from the same line with nothing else allocating
between (`for _ in range(k): x = torch.relu(x)` under no_grad, whose outputs are freed by the next
call's caller) reads as one call, so those outputs read as temporaries; in-place ops between an
allocation and its free allocate nothing and leave no mark. CUDA stacks (the caching allocator's
history) end in the allocator's frames, not in a Python call into native code, and their frees
have stacks of their own: nothing is told there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Hashable, List, Tuple

import numpy as np

from memdiff.read.accel import ObjectCodes, identities
from memdiff.read.frames import MAX_STACK_FRAMES

# How the profiler names a Python-level call into native code (a PyCCall event), and how memdiff's
# capture names the backward node an allocation was made in (recording/capture.py).
NATIVE_CALL = "<built-in "
AUTOGRAD_NODE = "autograd::engine::evaluate_function: "
# The call that runs a whole backward (`<built-in method run_backward of torch._C._EngineBase ...>`):
# where a capture does not name the nodes inside it, its stacks end there, and no op's call is known.
ENGINE = "run_backward"


def _call_key(frames: Any) -> Tuple[Tuple[Any, ...], bool]:
    """(the value of the call a stack is in, or (); whether memory it allocates can be the call's
    scratch). In a backward node the call is the node (PyTorch's profiler takes a whole node for one
    op), valued from the outermost node out; only what Python code inside it allocates (checkpointing's
    recomputation, a custom Function's backward) is told, since the outputs of autograd's own nodes
    (`AddmmBackward0 <- mm`) flow on to the next node. Elsewhere the call is the whole stack, when its
    innermost frame is a call into native code."""
    if not isinstance(frames, list) or not frames or len(frames) > MAX_STACK_FRAMES:
        return (), False
    if not all(isinstance(f, dict) and isinstance(f.get("name"), str) for f in frames):
        return (), False
    names: List[str] = [f["name"] for f in frames]
    node = next((k for k in range(len(names) - 1, -1, -1) if names[k].startswith(AUTOGRAD_NODE)), None)
    if node is not None:
        opens = not all(name.startswith(("aten::", AUTOGRAD_NODE)) for name in names[:node])
        frames = frames[node:]
    elif names[0].startswith(NATIVE_CALL) and ENGINE not in names[0]:
        opens = True
    else:
        return (), False
    return tuple((f.get("name"), f.get("filename"), f.get("line")) for f in frames), opens


@dataclass(frozen=True)
class Calls:
    """Per trace entry, the number of the call it falls in (-1: none), and whether what it allocates
    can be that call's scratch. Equal numbers: one run of entries in one call."""

    runs: np.ndarray
    opens: np.ndarray

    def freed_inside(self, born: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Whether each allocation (first event `born`, -1 before the trace; freed at event `end`, the
        trace's length when never) was freed inside the call that allocated it."""
        n = len(self.runs)
        if n == 0:
            return np.zeros(len(born), dtype=bool)
        held = (born >= 0) & (end < n)
        at_born = np.where(held, born, 0)
        run = self.runs[at_born]
        return held & self.opens[at_born] & (run >= 0) & (run == self.runs[np.where(held, end, 0)])


NO_CALLS = Calls(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool))


def call_runs(trace: Any) -> Calls:
    """The calls of a trace's entries (see the module docstring and Calls)."""
    n = len(trace)
    if n == 0:
        return NO_CALLS
    stacks = ObjectCodes(trace, "frames")
    codes = stacks.at(np.arange(n, dtype=np.int64))
    # Equal stacks are often distinct lists (one per allocation), most often of the same frame
    # objects: decided once per list of the same frames (a hostile file repeats one deep list
    # thousands of times), then numbered by value.
    by_value: Dict[Tuple[Any, ...], int] = {}
    by_frames: Dict[Hashable, Tuple[Tuple[Any, ...], bool]] = {}
    value_of = np.full(len(stacks.objects), -1, dtype=np.int64)
    opens_of = np.zeros(len(stacks.objects), dtype=bool)
    for k, o in enumerate(stacks.objects):
        same = identities(o) if isinstance(o, list) else None
        decided = by_frames.get(same) if same is not None else None
        if decided is None:
            decided = _call_key(o)
            if same is not None:
                by_frames[same] = decided
        key, opens = decided
        if key:
            value_of[k] = by_value.setdefault(key, len(by_value))
            opens_of[k] = opens
    keys = value_of[codes]
    starts = np.ones(n, dtype=bool)
    starts[1:] = (keys[1:] != keys[:-1]) | (keys[1:] < 0)
    return Calls(np.where(keys >= 0, np.cumsum(starts) - 1, -1), opens_of[codes])
