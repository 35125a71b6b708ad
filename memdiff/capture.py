"""Capture a memory snapshot of a block of PyTorch code, on CUDA or, without a GPU, on CPU.

This is the one module that imports torch, and only when called: the analysis never needs it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import pickle
from typing import Any, Callable, Dict, Iterator

from memdiff.atomic import write_output, write_stream
from memdiff.errors import InputError

# Protocol 4 keeps the file readable by pytorch.org/memory_viz and by Python 3.4+.
PICKLE_PROTOCOL = 4
STACKS = ("python", "all")


class CaptureError(InputError):
    """Capture cannot work here (no torch, or a torch without the API it needs)."""


def torch_module() -> Any:
    """The torch module, or a CaptureError (exit 2) saying how to install it."""
    try:
        import torch
    except ImportError:
        raise CaptureError("torch", "capturing needs PyTorch: pip install 'memdiff[torch]' "
                                    "(the analysis commands do not)") from None
    return torch


def dump(snapshot: Any, path: str) -> None:
    """Write `snapshot` to `path` atomically (memdiff.atomic); a pipe or device there is refused, never replaced."""
    write_stream(path, lambda f: pickle.dump(snapshot, f, protocol=PICKLE_PROTOCOL), in_place=False)


def write_status(path: str, document: Dict[str, Any]) -> None:
    """Write a rank's small status document (JSON) atomically, for `memdiff record` to read."""
    write_output(path, json.dumps(document))


def recorded_nothing(snapshot: Dict[str, Any]) -> bool:
    """Whether a fresh snapshot holds no allocation at all (no trace event, no live block)."""
    return not any(snapshot.get("device_traces") or []) and not any(
        b.get("state") == "active_allocated" for s in snapshot.get("segments") or [] for b in s.get("blocks", []))


def _history_options(record_history: Any) -> Dict[str, Any]:
    """Options this torch's `_record_memory_history` takes beyond the basic ones: record_function
    scopes (`global_record_annotations`, torch 2.5+) give memdiff steps and phases from PyTorch
    itself instead of reading them off the stacks."""
    try:
        accepted = inspect.signature(record_history).parameters
    except (TypeError, ValueError):
        return {}
    return {"global_record_annotations": True} if "global_record_annotations" in accepted else {}


def start_cuda(torch: Any, max_entries: int, stacks: str) -> Callable[[], Any]:
    """Start the caching allocator's history; the returned function stops it and gives the snapshot."""
    record_history = torch.cuda.memory._record_memory_history
    record_history(enabled="all", stacks=stacks, max_entries=max_entries, **_history_options(record_history))

    def finish() -> Any:
        try:
            return torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    return finish


def has_cuda(torch: Any) -> bool:
    """Whether this process has a CUDA device, asked without initializing CUDA.

    `device_count()` asks NVML where it can; `is_available()` may initialize the driver, after
    which a forked worker (a DataLoader's, say) can no longer use CUDA."""
    return bool(torch.cuda.device_count())


def start_cpu(torch: Any) -> Callable[[], Any]:
    """Start the profiler's memory events; the returned function stops it and gives the snapshot."""
    from torch.cuda import _memory_viz

    to_snapshot = getattr(_memory_viz, "_profile_to_snapshot", None)
    if to_snapshot is None:
        raise CaptureError("torch", f"torch {torch.__version__} lacks torch.cuda._memory_viz._profile_to_snapshot "
                                    f"(a private API, present in torch 2.1 to 2.13 at least), so it cannot "
                                    f"record memory without CUDA")
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                      record_shapes=True, with_stack=True)
    profiler.__enter__()

    def finish() -> Any:
        profiler.__exit__(None, None, None)
        return to_snapshot(profiler)
    return finish


@contextlib.contextmanager
def record(path: str, *, max_entries: int = 1_000_000, stacks: str = "all") -> Iterator[None]:
    """Record every allocation made inside the block and write the snapshot to `path`.

    With CUDA: the caching allocator's history (`max_entries` is its ring buffer), with
    record_function scopes where the torch version records them. `stacks="all"` (PyTorch's own
    default) keeps C++ frames, which name autograd nodes (`AddmmBackward0`, `AccumulateGrad`);
    `stacks="python"` is the fallback when the C++ unwinder crashes. Without CUDA: the
    profiler's memory events, converted to the same format, each carrying PyTorch's own category.
    """
    if stacks not in STACKS:
        raise ValueError(f"stacks must be one of {STACKS}, not {stacks!r}")
    torch = torch_module()
    finish = start_cuda(torch, max_entries, stacks) if has_cuda(torch) else start_cpu(torch)
    try:
        yield
    finally:
        # Dump even when the block raised: an OOM is when the file is wanted most.
        dump(finish(), path)
