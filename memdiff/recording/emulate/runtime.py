"""Run a CUDA script with no GPU: its ops run on the meta device while `torch.cuda` answers as the GPU.

The script is not changed. Two of torch's own hooks do the work:

- a TorchFunctionMode (`_DeviceMode`) sends every `cuda` device the script names (factories,
  `.to()`, `.cuda()`) to the meta device and reports meta tensors back as on the GPU each is on
  (devices.py: a process sees its job's GPUs per node, each with its own allocator); it picks the
  attention kernel the GPU would run, and applies CUDA's autocast op lists;
- a TorchDispatchMode (`_AllocMode`) sees every op after autograd, as the GPU's allocator does:
  each new storage is a request to the caching allocator's model (allocator.py) with the
  script's Python frames and the op's name, and is freed when torch frees the storage. Kernel
  workspaces and temporaries come from kernels.json.

Nothing of the model is computed: values read back from the device that the emulator does not keep
(`loss.item()`, `bool(t)`, `.cpu()`) follow values.py's policy (a float falls with every read, an
integer is 0, a bool false), and ops whose output size depends on values (`nonzero`) take every
element. The snapshot
is PyTorch's own format, marked `emulated` with the GPU named.
"""

from __future__ import annotations

import ast
import gc
import os
import sys
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Dict, List, Optional, Tuple

from memdiff.errors import InputError
from memdiff.recording.emulate.allocator import AllocatorConfig, Block, OutOfMemory
from memdiff.recording.emulate.devices import EmulatedGpu, Placement, gpus_per_node
from memdiff.recording.emulate.gpus import Gpu, kernels
from memdiff.recording.snapshot_file import dump
from memdiff.units import format_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
# Frames that are the emulator's machinery, never the program's: ours, and torch's mode plumbing.
OWN_FILES = ("torch/utils/_python_dispatch.py", "torch/overrides.py", "torch/_ops.py")
# ...and the wrappers torch puts around a mode's handler, seen innermost (a real GPU's stack has none there).
MODE_WRAPPERS = ("torch/_dynamo/eval_frame.py", "torch/_compile.py")
# Where a backward starts running autograd's engine: frames beyond it are the caller's, which a
# real GPU's backward thread does not have.
ENGINE_FRAME = ("torch/autograd/graph.py", "_engine_run_backward")
# Ops whose output size depends on values the emulator does not have: they take every element.
ALL_ELEMENTS_OPS = {"nonzero", "masked_select", "argwhere"}
WORKSPACE_FRAME = "at::cuda::setWorkspaceForHandle(cublasContext*, c10::cuda::CUDAStream)"
LT_WORKSPACE_FRAME = "at::cuda::getCUDABlasLtWorkspace()"


class EmulationError(InputError):
    """The script did something the emulator cannot reproduce (exit 2, one line naming the op and the script line)."""


# Every frame the trace names, one dict per distinct (file, line, function), shared by every stack
# that holds it, as the frames of a GPU's own snapshot are (its pickle holds a few hundred frame
# dicts behind hundreds of thousands of references). A dict per reference cost a 70B rank 170 MB
# (806k references to 230 distinct frames); a program has as many keys as it has code locations.
_FRAMES: Dict[Tuple[str, int, str], Dict[str, Any]] = {}


def frame_dict(filename: str, line: int, name: str) -> Dict[str, Any]:
    """The snapshot's frame `{"filename", "line", "name"}`, shared by every stack naming it: never mutate it."""
    key = (filename, line, name)
    found = _FRAMES.get(key)
    if found is None:
        found = _FRAMES[key] = {"filename": filename, "line": line, "name": name}
    return found


def python_frames(skip: int = 2) -> List[Dict[str, Any]]:
    """The calling Python stack, innermost first, as a CUDA snapshot holds it, without the
    emulator's own frames; inside a backward, only the frames the engine runs (a GPU's backward
    thread has no caller)."""
    out: List[Dict[str, Any]] = []
    frame: Any = sys._getframe(skip)
    while frame is not None:
        code = frame.f_code
        filename = code.co_filename
        if code.co_name == ENGINE_FRAME[1] and filename.endswith(ENGINE_FRAME[0]):
            # The script's frames below the engine are not on a backward thread's stack.
            return out if _in_backward() else out + _rest(frame)
        if not filename.startswith(HERE) and not filename.endswith(OWN_FILES) and \
                not (not out and filename.endswith(MODE_WRAPPERS)):
            out.append(frame_dict(filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return out


def _rest(frame: Any) -> List[Dict[str, Any]]:
    out = []
    while frame is not None:
        out.append(frame_dict(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return out


_torch: Any = None


def use_torch(torch: Any) -> None:
    """The torch the emulator runs on, set by session.start: this module imports none of its own."""
    global _torch
    _torch = torch


def _in_backward() -> bool:
    return _torch._C._current_autograd_node() is not None


def op_name(func: Any) -> str:
    """`add_Tensor`, `mm`: an aten op as a CUDA snapshot's `at::_ops::NAME::call` frame names it."""
    schema = func._schema
    name = schema.name.split("::", 1)[-1]
    overload = schema.overload_name
    return f"{name}_{overload}" if overload else name


def _op_frames(name: str, inner: Any = (), outer: Any = ()) -> List[Dict[str, Any]]:
    """The native frames a real trace shows for an allocation by op `name`, innermost first: the
    kernel's own ops (`inner`), the op, the composite ops that called it (`outer`, innermost
    first), and in a backward the autograd node running it."""
    frames = [frame_dict("", 0, f"at::_ops::{op}::call") for op in inner]
    frames.append(frame_dict("", 0, f"at::_ops::{name}::call"))
    base = name.split("_")[0] if name[:1] != "_" else name
    for op in outer:
        if op != name and op != base and op not in inner:
            frames.append(frame_dict("", 0, f"at::_ops::{op}::call"))
    node = _torch._C._current_autograd_node()
    if node is not None:
        frames.append(frame_dict("", 0, f"torch::autograd::generated::{node.name()}::apply"))
        frames.append(frame_dict("", 0, "torch::autograd::Engine::evaluate_function"))
    return frames


class _Expr:
    """A size from kernels.json: arithmetic over named shape values (no calls but up(x, m))."""

    ALLOWED = (ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Constant, ast.Name,
               ast.Call, ast.Load)

    def __init__(self, text: str) -> None:
        self.tree = ast.parse(text, mode="eval")
        for node in ast.walk(self.tree):
            call = isinstance(node, ast.Call) and getattr(node.func, "id", "") != "up"
            if not isinstance(node, self.ALLOWED) or call:
                raise ValueError(f"kernels.json: {text!r} is not a size expression")
        self.code = compile(self.tree, "<kernels.json>", "eval")

    def __call__(self, values: Dict[str, int]) -> int:
        return int(eval(self.code, {"__builtins__": {}, "up": lambda x, m: -(-x // m) * m}, dict(values)))


def _segment(index: int, segment: Any, blocks: List[Block]) -> Dict[str, Any]:
    """A segment of GPU `index` as torch.cuda.memory._snapshot() gives it."""
    out = []
    allocated = requested = 0
    for block in blocks:
        out.append({"address": block.address, "size": block.size, "requested_size": block.requested,
                    "state": "active_allocated" if block.allocated else "inactive",
                    "frames": block.context if block.allocated and isinstance(block.context, list) else []})
        if block.allocated:
            allocated += block.size
            requested += block.requested
    return {"device": index, "address": segment.address, "total_size": segment.size,
            "allocated_size": allocated, "active_size": allocated, "requested_size": requested,
            "stream": segment.stream, "segment_type": "small" if segment.small else "large",
            "segment_pool_id": (0, 0), "is_expandable": segment.expandable,
            "frames": segment.context if isinstance(segment.context, list) else [], "blocks": out}


class Emulator:
    """The emulated GPUs of one process (`gpus`, else the job's GPUs per node: devices.py), each with
    its allocator's model; the recording PyTorch's history API keeps, and the modes and patches that
    make the script's `cuda` run on them. Use as a context manager."""

    def __init__(self, gpu: Gpu, alloc_conf: Optional[str] = None, gpus: Optional[int] = None) -> None:
        self.gpu = gpu
        text = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if alloc_conf is None else alloc_conf
        try:
            self.config = AllocatorConfig.parse(text)
        except ValueError as exc:
            raise InputError("PYTORCH_CUDA_ALLOC_CONF", str(exc)) from None
        if gpus is not None:
            gpus_per_node(gpus)  # a bad --gpus is one line now, not at the first device_count()
        self.placement = Placement(gpus)
        self.gpus: Dict[int, EmulatedGpu] = {}  # the GPUs this process used, each made at its first use
        self.initialized = False  # torch.cuda.is_initialized(): the process used a GPU
        self.recording: Optional[Dict[str, Any]] = None  # _record_memory_history's settings while on
        self.annotations: List[Dict[str, Any]] = []
        self.notes: List[str] = []
        # Notes worked out when a snapshot is taken (what the run wrote so far: files.py), each None
        # when it has nothing to say
        self.reports: List[Callable[[], Optional[str]]] = []
        # The out-of-memory errors raised to the script, as PyTorch words them: a script may catch one
        # (accelerate's find_executable_batch_size), and `memdiff fit` must know it happened all the same.
        self.out_of_memory: List[str] = []
        self.blocks: Dict[int, Block] = {}  # id(storage) -> its block
        self.rules = {name: self._compile(rule) for name, rule in kernels()["ops"].items()}
        self._threads = threading.local()  # what each thread of the script runs now (context)
        # Every thread of the script runs on the emulated GPU (threads.py): one op at a time changes
        # the allocator, the trace and the known values, as a GPU's allocator takes its own lock.
        self.lock = threading.RLock()
        # torch's C++ code running now that a GPU's stack names (DDP's Reducer, c10d's helpers),
        # outermost first: each a NativeScope (distributed.py)
        self.native: List[Any] = []
        self.blas = set(kernels()["blas"]["ops"])
        self.blas_lt = set(kernels()["blas"]["lt"])
        self.autocast: Any = None  # autocast.Autocast, made by session.start (it imports torch)
        self.device_mode: Any = None  # modes.DeviceMode, made by session.start
        # The side stream the script made current (patches.Stream), whose pool allocations come from;
        # None for the default stream.
        self.stream: Any = None
        self.values: Any = None  # values.Values: the known values of small device tensors, made by modes.AllocMode
        # The emulated device's default generator (patches.Generator, a CPU generator standing in), made by
        # patches: what torch.cuda seeds and whose state it saves, and what values.Values draws small outputs from
        self.generator: Any = None
        self.host: Any = None  # host.Host: the CPU tensors whose data may never be needed, made by session.start
        self.modes_off = False  # torch.compile is tracing with the modes taken off (compiled.py)

    @property
    def context(self) -> List[str]:
        """The builtin torch functions this thread is running now, outermost first (a thread's own
        stack: a worker's `to` is not inside the main thread's forward)."""
        found = getattr(self._threads, "context", None)
        if found is None:
            found = self._threads.context = []
        return found

    @staticmethod
    def _compile(rule: Dict[str, Any]) -> Dict[str, Any]:
        steps = [(s[0], s[1], _Expr(s[2]) if s[0] == "alloc" else None) for s in rule["steps"]]
        return {"q": rule["q"], "host_outputs": set(rule["host_outputs"]), "steps": steps,
                "frames": tuple(rule.get("frames", ()))}

    # -- the GPUs -----------------------------------------------------------------------------------

    @property
    def count(self) -> int:
        """torch.cuda.device_count(): the GPUs the process sees."""
        return self.placement.count

    def device(self, index: Optional[int] = None) -> EmulatedGpu:
        """GPU `index` (the current one when None), made at its first use."""
        index = self.placement.current() if index is None else self.placement.check(index)
        self.initialized = True
        self.placement.fix()
        found = self.gpus.get(index)
        if found is None:
            found = self.gpus[index] = EmulatedGpu(index, self.gpu.capacity, self.config, self._on_event)
        return found

    # -- the allocator's events, as the history records them ------------------------------------

    def _on_event(self, index: int, action: str, address: int, size: int, stream: int, context: Any) -> None:
        if self.recording is None or action in self.recording["skip"]:
            return
        frames = context if isinstance(context, list) else []
        event = {"action": action, "addr": address, "size": size, "stream": stream,
                 "time_us": int(time.time() * 1e6), "compile_context": "N/A", "user_metadata": "",
                 "frames": frames}
        if action == "oom":
            event.update(addr=0, device_free=context if isinstance(context, int) else 0, frames=[])
        gpu = self.gpus[index]
        limit = self.recording["max_entries"]
        if gpu.trace.maxlen != limit:  # a history turned on again with another max_entries
            gpu.trace = deque(gpu.trace, maxlen=limit)
        if len(gpu.trace) == limit:
            gpu.dropped += 1
        gpu.trace.append(event)

    def limit(self, fraction: float, index: Optional[int] = None) -> None:
        """torch.cuda.set_per_process_memory_fraction: the allocator may reserve this share of the device."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"invalid fraction: {fraction}, must be between 0 and 1")
        device = self.device(index)
        device.fraction = fraction
        # setMemoryFraction: a share of the device's whole memory (cudaMemGetInfo's total), as bytes
        device.allocator.set_memory_fraction(int(fraction * self.gpu.total_memory))

    def allocate(self, nbytes: int, frames: List[Dict[str, Any]], index: Optional[int] = None) -> Block:
        """A device allocation of `nbytes` on GPU `index` (the current one when None) made at `frames`;
        torch's OutOfMemoryError when it does not fit."""
        with self.lock:
            return self._allocate(nbytes, frames, self.device(index))

    def _allocate(self, nbytes: int, frames: List[Dict[str, Any]], device: EmulatedGpu) -> Block:
        try:
            side = self.stream  # a side stream the script made current: its pool, on its own GPU only
            stream = side.cuda_stream if side is not None and side.device_index == device.index else 0
            return device.allocator.malloc(nbytes, stream, frames if self.recording is not None else None)
        except OutOfMemory as exc:
            message = (
                f"CUDA out of memory (emulated {self.gpu.name}). Tried to allocate {format_bytes(exc.requested)}. "
                f"GPU {device.index} has a total capacity of {format_bytes(self.gpu.total_memory)} of which "
                f"{format_bytes(exc.free)} is free. Including non-PyTorch memory, this process has "
                f"{format_bytes(exc.reserved + self.gpu.context_bytes)} memory in use. Of the allocated memory "
                f"{format_bytes(exc.allocated)} is "
                f"allocated by PyTorch, and {format_bytes(exc.reserved - exc.allocated)} is reserved by PyTorch "
                f"but unallocated.")
            self.out_of_memory.append(message)
            raise _torch.OutOfMemoryError(message) from None

    def release(self, block: Block, index: int) -> None:
        """Free a block of GPU `index` (a storage torch let go of)."""
        with self.lock:  # a storage dies on whichever thread lets go of it last
            if block.allocated:
                self.gpus[index].allocator.free(block, python_frames(3) if self.recording is not None else None)

    def _frames(self, name: str, inner: Any = ()) -> List[Dict[str, Any]]:
        if self.recording is None:
            return []
        outer = self.context
        if "backward" in outer and _in_backward():
            # A GPU runs the backward on its own thread: only the ops the engine calls are on its stack.
            outer = outer[len(outer) - outer[::-1].index("backward"):]
        native = [frame for scope in reversed(self.native) for frame in scope.frames()]
        return _op_frames(name, inner, reversed(outer)) + native + python_frames(4)

    def frames(self, name: str, inner: Any = ()) -> List[Dict[str, Any]]:
        """The stack a GPU's snapshot gives an allocation made now by op `name` inside ops `inner`
        (empty while the history is off)."""
        return self._frames(name, inner)

    def track(self, storage: Any, name: str, inner: Any = (), index: Optional[int] = None) -> None:
        """A new meta storage made on GPU `index` (the current one when None): allocated there, freed
        when torch frees it. A storage stays on the GPU it was made on."""
        key = id(storage)
        placed = self.placement.of
        if key not in placed:
            placed[key] = self.placement.current() if index is None else index
            weakref.finalize(storage, self._storage_freed, key)
        index = placed[key]
        nbytes = storage.nbytes()
        known = self.blocks.get(key)
        if known is not None:
            if known.requested == nbytes or not known.allocated:
                return
            self.release(known, index)  # resized in place: the GPU frees the old block and takes a new one
            del self.blocks[key]
        if nbytes:
            self.blocks[key] = self.allocate(nbytes, self._frames(name, inner), index)

    def resized(self, storage: Any) -> None:
        """UntypedStorage.resize_ of a storage on an emulated GPU, as CUDA's resize_bytes_cuda runs it: a
        block of the new size from the current GPU's allocator (the old bytes copied in), then the old
        block freed; resized to 0 bytes, only the free (FSDP2 frees each all-gathered weight so)."""
        key = id(storage)
        old, index = self.blocks.get(key), self.placement.of[key]
        nbytes = storage.nbytes()
        if nbytes:
            current = self.placement.current()
            self.blocks[key] = self.allocate(nbytes, python_frames(2) if self.recording is not None else [], current)
            self.placement.of[key] = current
        else:
            self.blocks.pop(key, None)
        if old is not None:
            self.release(old, index)

    def address(self, storage: Any) -> int:
        """Where the emulated GPU holds a storage: its block's address (code that tells tensors apart by
        data_ptr(), as tied-weight and shared-storage checks do, needs them distinct), 0 if it has none."""
        block = self.blocks.get(id(storage))
        return block.address if block is not None and block.allocated else 0

    def _storage_freed(self, key: int) -> None:
        index = self.placement.of.pop(key, 0)
        block = self.blocks.pop(key, None)
        if block is not None:
            self.release(block, index)

    def temporaries(self, base: str, name: str, values: Dict[str, int], index: Optional[int] = None) -> None:
        """A kernel's own buffers (kernels.json) on GPU `index`: allocated and freed inside the op."""
        rule = self.rules.get(base)
        if rule is None or not rule["steps"]:
            return
        index = self.device(index).index
        live: Dict[str, Block] = {}
        for action, label, size in rule["steps"]:
            if action == "alloc":
                live[label] = self.allocate(size(values), self._frames(name, rule["frames"]), index)
            else:
                self.release(live.pop(label), index)

    def workspace(self, name: str, index: Optional[int] = None) -> None:
        """A cuBLAS handle's workspace at its first product on GPU `index` (the script's thread,
        autograd's backward thread), and its cuBLASLt workspace at the first product that runs there (a
        checkpointed forward recomputed in the backward makes the backward's): made once, kept for the
        process's life."""
        device = self.device(index)
        handle = "backward" if _in_backward() else "forward"
        base = name.split("_")[0] if not name.startswith("_") else name
        lt = base in self.blas_lt and handle not in device.lt_handles
        if handle not in device.handles:
            device.handles.add(handle)
            # cuBLASLt asks for the handle first, so the handle's workspace is made under it.
            under = [frame_dict("", 0, LT_WORKSPACE_FRAME)] if lt else []
            frames = [frame_dict("", 0, WORKSPACE_FRAME)] + under + self._frames(name) if self.recording else []
            self.allocate(self.gpu.cublas_workspace, frames, device.index)
        if lt:
            device.lt_handles.add(handle)
            frames = [frame_dict("", 0, LT_WORKSPACE_FRAME)] + self._frames(name) if self.recording else []
            self.allocate(self.gpu.cublaslt_workspace, frames, device.index)

    # -- the history API (torch.cuda.memory._record_memory_history, _snapshot) -------------------

    def record_history(self, enabled: Any = "all", context: Any = "all", stacks: str = "all",
                       max_entries: int = sys.maxsize, device: Any = None, clear_history: bool = False,
                       compile_context: bool = False, global_record_annotations: bool = False,
                       skip_actions: Optional[List[str]] = None) -> None:
        """torch.cuda.memory._record_memory_history, on the emulated device."""
        off = enabled in (None, False)
        # CUDA's allocator empties its trace when the history is turned off, not only on clear_history
        # (recordHistory: `if (!enabled || clearHistory)`): a script that records, dumps, stops and
        # records again writes files that each start clean, never the frees it made while off.
        if off or clear_history:
            for gpu in self.gpus.values():
                gpu.trace.clear()
                gpu.dropped = 0
        if off:
            self.recording = None
            return
        # CUDA keeps at least one entry (setMaxEntries: max(1, size))
        self.recording = {"max_entries": max(1, max_entries), "annotations": bool(global_record_annotations),
                          "skip": frozenset(skip_actions or ())}

    def snapshot(self) -> Dict[str, Any]:
        """torch.cuda.memory._snapshot(): segments, the trace, settings; marked as emulated. As CUDA's,
        one trace per GPU the process sees (empty for those it never used), each segment naming its GPU.
        Taken whole, as CUDA's allocator takes it under its lock: Python's cyclic collector is held off
        while it is composed. A collection there freed the tensors of garbage cycles (a training loop
        object that refers to itself, with its optimizer's state) into the trace after the segments
        were read, and the dump held blocks its own trace had freed."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._composed()
        finally:
            if collecting:
                gc.enable()

    def _composed(self) -> Dict[str, Any]:
        segments = []
        for index, device in sorted(self.gpus.items()):
            # in address order, as the allocator's snapshot() sorts them
            for segment in sorted(device.allocator.segments, key=lambda s: s.address):
                segments.append(_segment(index, segment, device.allocator.blocks(segment)))
        traces: List[List[Dict[str, Any]]] = [[] for _ in range(max([self.count, *[i + 1 for i in self.gpus]]))]
        for index, device in self.gpus.items():
            traces[index] = list(device.trace)
        return {"segments": segments, "device_traces": traces,
                "allocator_settings": self.config.settings(),
                "external_annotations": list(self.annotations),
                "emulated": {"gpu": self.gpu.name, "key": self.gpu.key, "torch": str(_torch.__version__),
                             "notes": self.notes + [n for n in (report() for report in self.reports) if n]
                             + self._ring_notes()}}

    def _ring_notes(self) -> List[str]:
        """What each GPU's ring buffer dropped: CUDA's snapshot does not say (torch 2.13 writes no
        `trace_alloc_overflowed`), but the emulator counted every event, so it can name the max_entries
        that keeps them all."""
        out = []
        for index, gpu in sorted(self.gpus.items()):
            if gpu.dropped:
                made = gpu.dropped + len(gpu.trace)
                out.append(f"GPU {index}'s trace keeps its last {len(gpu.trace):,} events: its ring buffer "
                           f"(max_entries {gpu.trace.maxlen:,}) dropped the first {gpu.dropped:,} of {made:,}; "
                           f"a max_entries of {made:,} or more keeps them all (`memdiff record --max-entries {made}`)")
        return out

    def dump_snapshot(self, filename: str = "dump_snapshot.pickle") -> None:
        """torch.cuda.memory._dump_snapshot(filename)."""
        dump(self.snapshot(), filename)

    def annotate(self, stage: str, name: str) -> None:
        """A record_function scope starting or ending, as global_record_annotations keeps it."""
        if self.recording is not None and self.recording["annotations"]:
            self.annotations.append({"stage": stage, "name": name, "device": self.placement.current(),
                                     "time_us": int(time.time() * 1e6)})

    def note(self, text: str) -> None:
        """An approximation this run made, carried in the snapshot and shown by every report."""
        if text not in self.notes:
            self.notes.append(text)
            print(f"memdiff: emulation: {text}", file=sys.stderr)
