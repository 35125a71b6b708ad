"""The emulated GPUs of one process: how many the job has, which one each storage is on, which is current.

A process sees as many GPUs as its node would give it (`device_count()`), the first of: `memdiff
record --gpus N` (MEMDIFF_RECORD_GPUS); the devices CUDA_VISIBLE_DEVICES lists (CUDA's own rule:
ultralytics' `device=0,1` sets it to `0,1`); the launcher's processes per node (torchrun's
LOCAL_WORLD_SIZE, accelerate's `--num_processes`; mpiexec's, MPI_LOCALNRANKS by MPICH's and Intel MPI's,
OMPI_COMM_WORLD_LOCAL_SIZE by Open MPI's; torch.multiprocessing.spawn's nprocs); else as many as the
script asks for (Lightning's `devices=2`:
its device parser asks for GPUs 0 and 1), at least one. As in CUDA, the count is read until the
process first uses a GPU, and fixed from then on (a script sets CUDA_VISIBLE_DEVICES before). Each GPU it
uses has its own caching allocator and its own trace, as on the GPU; every tensor is on the meta
device, so which GPU a storage is on is kept here, beside it, and the current device (per thread,
as CUDA keeps it) is where a bare `cuda` goes.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Set

from memdiff.errors import InputError
from memdiff.numbers import DIGITS
from memdiff.recording.emulate.allocator import AllocatorConfig, CachingAllocator

GPUS = "MEMDIFF_RECORD_GPUS"  # `memdiff record --gpus N`, for the processes of a launched job
# The processes torch.multiprocessing.spawn started with the one that started them (its nprocs), as
# torchrun's LOCAL_WORLD_SIZE tells its own: set by the emulator for spawn's processes only (asked.py).
SPAWNED = "MEMDIFF_RECORD_NPROCS"
# How each launcher tells a process how many of the job's processes share its node, which a node gives
# a GPU each: torchrun's, then mpiexec's (OpenAI's improved-diffusion picks `cuda:{rank % 8}` of an MPI
# rank; with one GPU seen, rank 1's `cuda:1` was no device), then spawn's (SPAWNED).
LOCAL_SIZES = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", SPAWNED)


def gpus_per_node(gpus: Optional[int] = None, asked: int = 1) -> int:
    """The GPUs a process of the job sees now: `gpus` (--gpus) when given, else MEMDIFF_RECORD_GPUS, else
    the devices CUDA_VISIBLE_DEVICES lists, else the launcher's processes per node (LOCAL_SIZES), else `asked` (the
    most the script asked for), at least 1."""
    if gpus is not None:
        if gpus < 1:
            raise InputError("--gpus", f"{gpus} GPUs: give 1 or more")
        return gpus
    value = os.environ.get(GPUS, "")
    if DIGITS.fullmatch(value) and int(value) > 0:
        return int(value)
    visible = _visible(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    if visible:
        return visible
    for name in LOCAL_SIZES:
        value = os.environ.get(name, "")
        if DIGITS.fullmatch(value) and int(value) > 0:
            return int(value)
    return max(asked, 1)


def _visible(listed: str) -> int:
    """How many devices CUDA_VISIBLE_DEVICES lists: its entries up to the first that names none (CUDA
    ignores the rest, `0,-1,2` is one device). Empty or unset: 0, no rule (an emulated run has GPUs)."""
    count = 0
    for entry in listed.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return count


def cuda_index(device: Any, current: Callable[[], int]) -> Optional[int]:
    """The emulated GPU a device argument names (`cuda:1`, torch.device("cuda", 1), a bare index 1;
    `cuda` alone is the current device), or None when it names no GPU (cpu, meta)."""
    if isinstance(device, bool):
        return None
    if isinstance(device, int):
        return device if device >= 0 else current()
    if isinstance(device, str):
        name, _, index = device.partition(":")
        if name != "cuda":
            return None
        return int(index) if index.strip() else current()
    if getattr(device, "type", None) == "cuda" and isinstance(device.index, (int, type(None))):
        return device.index if device.index is not None else current()
    return None


def names_cuda(device: Any) -> bool:
    """Whether a device argument (`cuda`, `cuda:1`, a torch.device, a bare index) names an emulated GPU."""
    return cuda_index(device, lambda: 0) is not None


class EmulatedGpu:
    """One GPU of the process: its caching allocator, its trace, and what it made once (cuBLAS handles)."""

    def __init__(self, index: int, capacity: int, config: AllocatorConfig,
                 on_event: Callable[[int, str, int, int, int, Any], None]) -> None:
        self.index = index
        self.allocator = CachingAllocator(capacity, config)
        self.allocator.trace = lambda *event: on_event(index, *event)
        # The history's ring buffer: a deque bounded by max_entries drops its oldest event in O(1), where
        # trimming a list moved every kept event (150 us an event with 1,000,000 kept: minutes for a run
        # that outlives its ring, as diffusers' sampling loops do)
        self.trace: Deque[Dict[str, Any]] = deque()
        self.dropped = 0  # events the ring dropped since the history was last cleared
        self.fraction = 1.0  # torch.cuda.set_per_process_memory_fraction's
        self.handles: set = set()  # the cuBLAS handles made on this GPU (one per thread)
        self.lt_handles: set = set()  # the handles whose cuBLASLt workspace is made


class Placement:
    """Which GPU each storage is on, and the current GPU of each thread.

    A storage is on the GPU it was made on, for its whole life (keyed by the storage's id, dropped
    when torch frees it). A new storage is made on the GPU its op names (a factory's or a copy's
    `device`: the innermost torch call being run pushed it), else on its first input's GPU, else on
    the current GPU: in CUDA an op runs on its inputs' device, and a bare `cuda` is the current one.
    """

    def __init__(self, gpus: Optional[int] = None) -> None:
        self.gpus = gpus  # --gpus, when given
        self.asked = 1  # the most GPUs the script asked for (ask)
        self.fixed: Optional[int] = None  # the count, once the process used a GPU
        self.of: Dict[int, int] = {}  # id(storage) -> GPU index
        # id(storage) of the script's own meta tensors (a model built under torch.device("meta")):
        # the emulated GPU's tensors are meta too, but these are on no GPU and cost nothing
        self.script_meta: Set[int] = set()
        self.default_meta = False  # the script's torch.set_default_device("meta")
        self._local = threading.local()

    @property
    def count(self) -> int:
        """torch.cuda.device_count(): read from the environment until fixed (gpus_per_node)."""
        return self.fixed if self.fixed is not None else gpus_per_node(self.gpus, self.asked)

    def fix(self) -> None:
        """The process uses a GPU now: its count no longer follows the environment, as CUDA's does not."""
        if self.fixed is None:
            self.fixed = self.count

    def ask(self, count: int) -> None:
        """The script asks for `count` GPUs (a framework's device parser): a node that has no other rule
        for its count has them, until the process has used a GPU."""
        self.asked = max(self.asked, count)

    def check(self, index: int) -> int:
        """`index` when the process has that GPU, else CUDA's error for it."""
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal (GPU {index} of a process that sees "
                               f"{self.count}; memdiff record --gpus N sets how many)")
        return index

    def current(self) -> int:
        """This thread's current GPU (0 until set, as in CUDA)."""
        return int(getattr(self._local, "index", 0))

    def set_current(self, index: int) -> None:
        """torch.cuda.set_device on this thread."""
        self._local.index = self.check(index)

    def stack(self) -> List[Optional[int]]:
        """The GPUs named by the torch calls running now on this thread, innermost last."""
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def naming(self) -> List[bool]:
        """For the torch calls running now on this thread that name a device, innermost last: whether
        it names the meta device (the script's own meta tensors), not a GPU."""
        naming = getattr(self._local, "naming", None)
        if naming is None:
            naming = self._local.naming = []
        return naming

    def on_meta(self, tensor: Any) -> bool:
        """Whether a tensor is one of the script's own meta tensors (a wrapper, as DTensor, by its
        inner tensor), not the emulated GPU's."""
        flatten = getattr(tensor, "__tensor_flatten__", None)
        if flatten is not None:  # a wrapper subclass: its storage, if any, is not its data's
            names = flatten()[0]
            return bool(names) and self.on_meta(getattr(tensor, names[0]))
        try:
            return id(tensor.untyped_storage()) in self.script_meta
        except (RuntimeError, NotImplementedError):
            return False

    def runs_on_meta(self, args: Any) -> bool:
        """Whether an op makes the script's meta tensors: it runs inside a call naming the meta
        device, or (naming none) its first meta input is the script's, or it has none and the
        script's default device is meta."""
        naming = self.naming()
        if naming:
            return naming[-1]
        first = first_meta(args)
        return self.default_meta if first is None else self.on_meta(first)

    def keep_meta(self, out: Any) -> None:
        """The meta storages among an op's outputs (a list or tuple of them too) are the script's own."""
        for leaf in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(leaf, (list, tuple)):
                self.keep_meta(leaf)
            elif getattr(leaf, "is_meta", False) is True:
                storage = leaf.untyped_storage()
                # a storage of a GPU stays there: torch's own code sets a tensor it made on the meta
                # device by name to one (torch.load's `empty(0, device=storage.device).set_(storage)`)
                if id(storage) not in self.script_meta and id(storage) not in self.of:
                    self.script_meta.add(id(storage))
                    weakref.finalize(storage, self.script_meta.discard, id(storage))

    def device_of(self, storage: Any) -> int:
        """The GPU a meta storage is on (the current GPU for one no op made, as a bare `cuda` is)."""
        return self.of.get(id(storage), self.current())

    def tensor_index(self, tensor: Any) -> int:
        """The GPU a meta tensor's storage is on."""
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without a storage (a wrapper subclass)
            return self.current()
        return self.device_of(storage)

    def for_new(self, args: Any, kwargs: Dict[str, Any]) -> int:
        """Where the op with these arguments makes its new storages."""
        stack = self.stack()
        named = stack[-1] if stack else None
        if named is not None and "device" in kwargs:
            return named
        first = first_meta(args)
        if first is not None:
            return self.tensor_index(first)
        return named if named is not None else self.current()


def first_meta(args: Any) -> Any:
    """The first meta tensor among the arguments, looking one level into lists (torch.cat's)."""
    for arg in args:
        if isinstance(arg, (list, tuple)):
            for item in arg:
                if getattr(item, "is_meta", False) is True:
                    return item
        elif getattr(arg, "is_meta", False) is True:
            return arg
    return None
