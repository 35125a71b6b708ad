"""cuBLAS and cuBLASLt workspaces among the blocks a dump holds that the trace never saw made:
found by their sizes and the handles' native stacks.
"""


from __future__ import annotations

import re
from typing import Any, Dict, List, Set, Tuple

import numpy as np

from memdiff.analyse.lifetimes import (
    BACKWARD,
    Timeline,
)
from memdiff.analyse.normalize.walk import DumpBlock, Walk
from memdiff.read.frames import (
    GUESS_PARAMETER,
    GUESS_WORKSPACE,
)

# A cuBLAS handle's workspace (PyTorch's default: 32 MiB on sm90 and newer, 4096 KiB x 2 + 16 KiB
# x 8 before) and its cuBLASLt workspace (1 MiB), as CUDA stacks name the functions that make them.
WORKSPACE_SIZES = (33_554_432, 8_519_680)


LT_WORKSPACE_SIZES = (1_048_576,)


MAX_WORKSPACE_READS = 100_000


WORKSPACE_NATIVE = re.compile(r"^at::cuda::setWorkspaceForHandle\b")


LT_NATIVE = re.compile(r"^at::cuda::getCUDABlasLtWorkspace\b")


def _handles(walk: Walk, trace: List[Dict[str, Any]], timeline: Timeline
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


def _native_stacks(walk: Walk, trace: List[Dict[str, Any]], looked: int = 64) -> bool:
    """Whether the trace's stacks carry C++ frames (CUDA's stacks="all"), read off its first allocations."""
    for j in walk.allocs[:looked]:
        frames = trace[j].get("frames") if isinstance(trace[j], dict) else None
        if isinstance(frames, list) and any(isinstance(f, dict) and isinstance(f.get("name"), str)
                                            and f["name"].startswith(("at::", "c10::", "torch::")) for f in frames):
            return True
    return False


def workspaces_by_handles(blocks: List[DumpBlock], walk: Walk, trace: List[Dict[str, Any]], timeline: Timeline,
                           claimed: Dict[int, int]) -> None:
    """Frameless blocks older than the trace that are a BLAS handle's workspaces, not weights.

    A handle belongs to a thread (the script's, autograd's backward one) and makes its workspace,
    of a size fixed per GPU generation, at its first product: a trace that runs a thread's phase
    without showing that thread's workspace being made had it made before recording started (a
    warm-up step, torch.compile's compilation). Of each such size, the blocks beyond those
    `claimed` (size -> the weights of that size and their optimizer state older than the trace)
    are marked, one per handle missing: a missing handle is a thread that may run products
    without one (a model without biases never runs cuBLASLt), so only what the weights leave over
    is a workspace.
    """
    if not any(b.size in WORKSPACE_SIZES + LT_WORKSPACE_SIZES for b in blocks):
        return  # no block of a workspace's size: nothing to read the trace for
    used, made = _handles(walk, trace, timeline)
    for kind, sizes in (("blas", WORKSPACE_SIZES), ("lt", LT_WORKSPACE_SIZES)):
        missing = len(used[kind]) - made[kind]
        for size in sizes:
            if missing <= 0:
                break
            spare = [b for b in blocks if b.size == size and b.guess == GUESS_PARAMETER][claimed.get(size, 0):]
            for b in spare[:missing]:
                b.guess = GUESS_WORKSPACE
            missing -= len(spare[:missing])
