"""Capture a memory snapshot of a block of PyTorch code, on CUDA or, without a GPU, on CPU.

This is the one module that imports torch, and only when called: the analysis never needs it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import pickle
import sys
from typing import Any, Callable, Dict, Iterator, List, Tuple

from memdiff.atomic import write_output, write_stream
from memdiff.errors import InputError

# Protocol 4 keeps the file readable by pytorch.org/memory_viz and by Python 3.4+.
PICKLE_PROTOCOL = 4
STACKS = ("python", "all")
# How the profiler names the autograd engine running a node: `...: AddmmBackward0`.
AUTOGRAD_NODE = "autograd::engine::evaluate_function: "


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


def _without_checkpoint_early_stop(torch: Any) -> contextlib.AbstractContextManager:
    """Non-reentrant activation checkpointing with its early stop turned off.

    The early stop ends a recomputation by raising an exception from inside an operator; with the
    allocator's history on, that exception is lost and the training fails with `SystemError: ...
    returned NULL without setting an exception` (torch 2.11, H100, Hugging Face GPT-2 with
    gradient checkpointing, stacks python and all alike). Without the early stop the
    recomputation runs to the end of each checkpointed segment: the same saved tensors, plus the
    segment's last few temporaries. docs/recording.md says so to users.
    """
    from torch.utils import checkpoint

    early_stop = getattr(checkpoint, "set_checkpoint_early_stop", None)
    return early_stop(False) if early_stop is not None else contextlib.nullcontext()


# How torch names the C++ frames of a snapshot, unless the user chose (TORCH_SYMBOLIZE_MODE):
# its own reader of the libraries' symbols, in this process. The default on some versions runs
# `addr2line` children, which a launcher's SIGTERM (torchrun stopping the other ranks when one
# fails) or a Ctrl-C reaches too: the snapshot then fails (`RuntimeError: stoi`, torch 2.11) and
# the rank's snapshot is lost just when it is wanted.
SYMBOLIZE_MODE = ("TORCH_SYMBOLIZE_MODE", "fast")


def start_cuda(torch: Any, max_entries: int, stacks: str) -> Callable[[], Any]:
    """Start the caching allocator's history; the returned function stops it and gives the snapshot."""
    os.environ.setdefault(*SYMBOLIZE_MODE)  # read by torch when it first names frames: at the snapshot
    record_history = torch.cuda.memory._record_memory_history
    record_history(enabled="all", stacks=stacks, max_entries=max_entries, **_history_options(record_history))
    early_stop = _without_checkpoint_early_stop(torch)  # on only once the history is
    early_stop.__enter__()

    def finish() -> Any:
        try:
            return torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
            early_stop.__exit__(None, None, None)
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
        try:
            # torch's converter builds the memory profile itself; handing it the one built here
            # lets each allocation be matched to its profiler event (_name_autograd_nodes).
            memory = profiler._memory_profile()
            snapshot = to_snapshot(_Built(memory))
        except AssertionError as exc:
            print(f"memdiff: torch's memory profiler refused this run's records ({str(exc)[:120]}...); the snapshot "
                  f"is built from its allocation events instead, without PyTorch's own categories", file=sys.stderr)
            return from_allocations(torch, profiler)
        _name_autograd_nodes(torch, snapshot, memory)
        return snapshot
    return finish


class _Built:
    """A finished profiler as `_profile_to_snapshot` reads it: its memory profile, already built."""

    def __init__(self, memory: Any) -> None:
        self.memory = memory

    def _memory_profile(self) -> Any:
        return self.memory


def _name_autograd_nodes(torch: Any, snapshot: Dict[str, Any], memory: Any) -> None:
    """Give allocations made in backward the stacks of `_stack`, in place.

    torch's converter keeps only Python frames, so everything the backward allocates reads
    `run_backward`. Its trace follows the memory profile's timeline (an allocation for each
    tensor made and each new version), which maps each allocation to its tensor, and so to the
    profiler event that allocated it. Frames lists are shared with the frees and blocks that
    follow, hence the in-place update. Should the two ever disagree, the trace is left as torch
    wrote it, and the user is told."""
    from torch._C._profiler import _EventType
    from torch.profiler._memory_profiler import Action, TensorKey

    stacks = {}
    for event in memory._op_tree.sorted_nodes:
        if event.tag == _EventType.Allocation and event.extra_fields.alloc_size > 0:
            key = TensorKey.from_allocation(event.extra_fields)
            frames = _stack(event, _EventType)
            if key and any(f["name"].startswith(AUTOGRAD_NODE) for f in frames):
                stacks[key] = frames
    if not stacks:
        return
    device_count = torch.cuda.device_count()
    allocations = [iter([e for e in trace if e["action"] == "alloc"]) for trace in snapshot["device_traces"]]
    updates = []
    for _, action, (key, _version), size in memory.timeline:
        if not isinstance(key, TensorKey) or action not in (Action.CREATE, Action.INCREMENT_VERSION):
            continue
        device = key.device.index if key.device.type == "cuda" else device_count
        entry = next(allocations[device], None)
        if entry is None or (entry["addr"], entry["size"]) != (key.storage.ptr, size):
            print("memdiff: torch's memory trace did not follow its memory profile here; backward "
                  "allocations keep stacks that end at run_backward", file=sys.stderr)
            return
        if key in stacks:
            updates.append((entry["frames"], stacks[key]))
    for frames, named in updates:
        frames[:] = named


def from_allocations(torch: Any, profiler: Any) -> Dict[str, Any]:
    """A snapshot in `_profile_to_snapshot`'s shape from the profiler's allocation events alone.

    The profiler follows the thread that started it, and other threads only while they work for
    it: a gloo worker that drops the last reference to DDP's broadcast bucket after its work has
    ended frees it unseen. When the allocator hands that address out again, torch's memory
    profiler finds two allocations and no free, and its data-flow check fails (`duplicate
    outputs`). The allocations themselves are all there; this reads them in time order, and
    closes an allocation whose address is handed out again at that moment, the latest its
    unseen free can have happened. What it lacks is torch's category per allocation, which
    memdiff never needed: it classifies by stack."""
    from torch._C._profiler import _EventType
    from torch.profiler._memory_profiler import OpTree

    cpu = torch.cuda.device_count()  # as torch's converter numbers them: CUDA devices, then the CPU
    traces: List[List[Dict[str, Any]]] = [[] for _ in range(cpu + 1)]
    live: Dict[Tuple[int, int], Dict[str, Any]] = {}

    def free(device: int, alloc: Dict[str, Any]) -> None:
        for action in ("free_requested", "free_completed"):
            traces[device].append({"action": action, "addr": alloc["addr"], "size": alloc["size"], "stream": 0,
                                   "frames": alloc["frames"]})

    for event in OpTree(profiler.profiler.kineto_results).sorted_nodes:
        if event.tag != _EventType.Allocation or not event.extra_fields.alloc_size:
            continue
        fields = event.extra_fields
        device = fields.device.index if fields.device.type == "cuda" else cpu
        key = (device, fields.ptr)
        if fields.alloc_size > 0:
            if key in live:
                free(device, live.pop(key))
            live[key] = {"action": "alloc", "addr": fields.ptr, "size": fields.alloc_size, "stream": 0,
                         "frames": _stack(event, _EventType)}
            traces[device].append(live[key])
        else:  # a free of an allocation made before recording began is kept: it is static memory
            free(device, live.pop(key) if key in live
                 else {"addr": fields.ptr, "size": -fields.alloc_size, "frames": []})
    segments = []
    for device in range(cpu + 1):
        blocks = sorted((a for (d, _), a in live.items() if d == device), key=lambda a: a["addr"])
        if blocks:
            start = blocks[0]["addr"]
            segments.append({"device": device, "address": start, "stream": 0,
                             "total_size": max(b["addr"] + b["size"] for b in blocks) - start,
                             "blocks": [{"address": b["addr"], "size": b["size"], "requested_size": b["size"],
                                         "state": "active_allocated", "frames": b["frames"]} for b in blocks]})
    return {"device_traces": traces, "segments": segments}


def _stack(event: Any, event_type: Any) -> List[Dict[str, Any]]:
    """The frames of an allocation, innermost first, in torch's converter's form: its Python
    calls and, in backward, the autograd nodes around it, with the ops a node ran itself when it
    allocated (`AddmmBackward0 <- mm`), as CUDA stacks name them. Elsewhere the Python calls
    alone, exactly as torch writes them, so that signatures stay as they were."""
    chain = []
    parent = event.parent
    while parent is not None:
        chain.append(parent)
        parent = parent.parent

    def python(e: Any) -> bool:
        return e.tag in (event_type.PyCall, event_type.PyCCall)

    def node(e: Any) -> bool:
        return e.tag == event_type.TorchOp and e.name.startswith(AUTOGRAD_NODE)

    first = next((i for i, e in enumerate(chain) if python(e) or node(e)), len(chain))
    own_ops = first < len(chain) and node(chain[first])
    return [{"filename": "none", "line": 0, "name": e.name} for i, e in enumerate(chain)
            if python(e) or node(e) or (own_ops and i < first and e.name.startswith("aten::"))]


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
