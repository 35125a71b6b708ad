"""`torch.cuda` answering as the emulated GPU: the functions a script and torch itself ask about the
device, its memory and its history, replaced while the emulator runs and put back after."""

from __future__ import annotations

import contextlib
import time
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from memdiff.recording.emulate.compiled import Planner
from memdiff.recording.emulate.devices import cuda_index, names_cuda
from memdiff.recording.emulate.escapes import refusing
from memdiff.recording.emulate.failed_backward import dropping_queued_nodes
from memdiff.recording.emulate.moved import kept
from memdiff.recording.emulate.nvtx import Markers
from memdiff.recording.emulate.runtime import Emulator


class _Properties:
    """What torch.cuda.get_device_properties() gives, for the emulated GPU."""

    def __init__(self, emulator: Emulator) -> None:
        gpu = emulator.gpu
        self.name, self.major, self.minor = gpu.name, gpu.major, gpu.minor
        self.total_memory, self.multi_processor_count = gpu.total_memory, gpu.multi_processor_count
        self.L2_cache_size, self.warp_size = gpu.l2_cache_size, gpu.warp_size
        self.is_integrated, self.is_multi_gpu_board = False, False
        self.max_threads_per_multi_processor, self.regs_per_multiprocessor = gpu.max_threads_per_multi_processor, 65536
        self.gcnArchName, self.uuid = "", "emulated"

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // (1 << 20)}MB, multi_processor_count={self.multi_processor_count}, "
                f"emulated=True)")


# Where the handles of the streams a script makes start (a cudaStream_t is a host pointer; the
# default stream's is 0, as a snapshot records it).
STREAM_HANDLES = 0x560000000000


class Stream(torch._C.Stream):
    """A CUDA stream on the emulated device: work is ordered and instant, so waiting is nothing. A
    torch.Stream on its GPU, so that torch's own calls taking one (record_stream) accept it. What a
    side stream changes is where memory comes from: while it is current (`with torch.cuda.stream(s)`,
    `set_stream`), allocations on its GPU come from its own pool of blocks and segments, as the
    caching allocator keeps one per stream."""

    made = 0
    emulator: Any = None  # the running emulator, whose current stream `with stream:` sets

    def __new__(cls, device: Any = None, priority: int = 0, stream_id: Any = None, **_: Any) -> "Stream":
        if device is None or isinstance(device, int):
            index = torch.cuda.current_device() if device is None else device
        else:
            index = torch.device(device).index
            index = torch.cuda.current_device() if index is None else index
        if stream_id is None:
            Stream.made += 1
            stream_id = STREAM_HANDLES + 16 * Stream.made
        return super().__new__(cls, stream_id=int(stream_id), device_index=index, device_type=CUDA_TYPE)

    def __init__(self, device: Any = None, priority: int = 0, stream_id: Any = None, **_: Any) -> None:
        self.priority, self.cuda_stream = priority, int(self.stream_id)
        self.prior: List[Any] = []

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for."""

    def record_event(self, event: Any = None) -> "Event":
        """An event recorded on this stream, already complete."""
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always done."""
        return True

    def is_capturing(self) -> bool:
        """No CUDA graph is being captured (an optimizer's step asks, through torch.accelerator)."""
        return False

    def __enter__(self) -> "Stream":
        emulator = Stream.emulator
        if emulator is not None:
            self.prior.append(emulator.stream)
            emulator.stream = self
        return self

    def __exit__(self, *exc: Any) -> None:
        if Stream.emulator is not None and self.prior:
            Stream.emulator.stream = self.prior.pop()

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Stream) and (other.cuda_stream, other.device_index) == \
            (self.cuda_stream, self.device_index)

    def __hash__(self) -> int:
        return hash((self.cuda_stream, self.device_index))

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device=cuda:{self.device_index} cuda_stream={self.cuda_stream:#x}>"


CUDA_TYPE = 1  # c10::DeviceType::CUDA


class Event:
    """A CUDA event on the emulated device: complete as soon as recorded. Its time is the host's when
    it was recorded, the only clock the emulated device has (its work takes none)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.recorded_at: Optional[float] = None

    def record(self, stream: Any = None) -> None:
        """Recorded now."""
        self.recorded_at = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always done."""
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def elapsed_time(self, end: "Event") -> float:
        """Milliseconds from this event to `end`, both recorded with timing on (as CUDA requires): the
        host's time between the two records."""
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.recorded_at is None or end.recorded_at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end.recorded_at - self.recorded_at) * 1000.0


def _device_context(emulator: Emulator) -> Tuple[type, type]:
    """torch.cuda.device(i) (and torch.accelerator.device_index(i)): the current GPU is `i` inside the
    block, put back after; device_of(t) is the context of `t`'s GPU. None or a negative index changes nothing."""
    placement = emulator.placement

    class device:
        def __init__(self, device: Any) -> None:
            index = cuda_index(device, placement.current) if device is not None else -1
            self.idx = -1 if index is None else index
            self.prev_idx = -1

        def __enter__(self) -> "device":
            if self.idx >= 0:
                self.prev_idx = placement.current()
                placement.set_current(self.idx)
                emulator.initialized = True
            return self

        def __exit__(self, *exc: Any) -> None:
            if self.prev_idx >= 0:
                placement.set_current(self.prev_idx)

    class device_of(device):
        def __init__(self, obj: Any) -> None:
            super().__init__(obj.get_device() if isinstance(obj, torch.Tensor) and obj.is_cuda else -1)

    return device, device_of


def _tensor_methods() -> Dict[str, Callable[..., Any]]:
    """Tensor.pin_memory, is_pinned and record_stream while the emulator runs, on every thread
    (record_stream's binding takes only torch's own streams).

    The DataLoader pins batches on a thread of its own, where the emulator's modes (thread-local)
    are off: torch's own pin_memory would ask the CUDA driver for page-locked memory (a CUDA build)
    or find no accelerator (a CPU build). Pinned memory is host memory the driver can copy from
    without staging, not device memory: a GPU's snapshot does not show it, so the copy here is an
    ordinary host tensor, remembered as pinned."""
    pinned = WeakTensorKeyDictionary()

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        if self.device.type != "cpu":
            raise RuntimeError(f"cannot pin a tensor on {self.device}: only dense CPU tensors can be pinned")
        if self in pinned:
            return self
        copy = self.clone()
        pinned[copy] = True
        return copy

    def is_pinned(self: torch.Tensor, device: Any = None) -> bool:
        return self in pinned

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        """On a GPU the block of a tensor used on another stream waits, once freed, for that stream's
        work before it is reused; the emulated device's work is done at once, so it waits for nothing."""
    return {"pin_memory": pin_memory, "is_pinned": is_pinned, "record_stream": record_stream}


_RealGenerator: Any = torch._C.Generator
_GeneratorMeta: Any = type(_RealGenerator)  # torch's metaclass for its C types



class _GeneratorType(_GeneratorMeta):
    """Every torch generator is a torch.Generator still (isinstance checks in torch and in scripts)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _RealGenerator)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return issubclass(sub, _RealGenerator)


class Generator(_RealGenerator, metaclass=_GeneratorType):
    """torch.Generator while the emulator runs: a `cuda` generator is a CPU generator standing in (ops
    on the emulated device take a CPU generator, and small draws there are drawn from it: values.py),
    reported as on `cuda:0`; seeding it, reading and setting its state work as on any generator."""

    def __new__(cls, device: Any = "cpu") -> "Generator":
        emulated = names_cuda(device)
        made = super().__new__(cls, "cpu" if emulated else device)
        made.emulated = emulated
        return made

    def __init__(self, device: Any = "cpu") -> None:
        """Made whole by __new__ (torch's generator takes its device there)."""

    @property
    def device(self) -> Any:
        return torch.device("cuda", 0) if self.emulated else _RealGenerator.device.__get__(self)


Generator.__module__, Generator.__qualname__ = "torch._C", "Generator"  # as torch's own reads in a repr


def _allocator(emulator: Emulator, device: Any) -> Any:
    """The caching allocator of the GPU a memory function names (`device=None`: the current one)."""
    placement = emulator.placement
    index = placement.current() if device is None else cuda_index(device, placement.current)
    if index is None:
        raise ValueError(f"Expected a cuda device, but got: {device}")
    return emulator.device(index).allocator


def _answers(emulator: Emulator, saved: Dict[Tuple[Any, str], Any]) -> Dict[str, Callable[..., Any]]:
    properties = _Properties(emulator)
    placement = emulator.placement
    default_streams: Dict[int, Stream] = {}  # each GPU's, made at its first use: the count may grow until then

    def default_stream_of(index: int) -> Stream:
        if index not in default_streams:
            default_streams[index] = Stream(index, stream_id=0)
        return default_streams[index]

    def current_stream(device: Any = None) -> Stream:
        index = placement.current() if device is None else cuda_index(device, placement.current)
        side = emulator.stream
        if side is not None and side.device_index == index:
            return side
        return default_stream_of(index if index is not None else placement.current())

    @contextlib.contextmanager
    def stream(stream: Any = None) -> Iterator[None]:
        if stream is None:  # torch.cuda.stream(None) changes nothing
            yield
            return
        with stream:
            yield

    def set_stream(stream: Any) -> None:
        emulator.stream = None if stream is None or stream.cuda_stream == 0 else stream
    original_clear = saved.get((torch, "clear_autocast_cache"))
    device_class, device_of_class = _device_context(emulator)

    # torch 2.13 counts allocations a memory fraction refused up front (throw_on_cudamalloc_oom, not
    # emulated: always 0); torch 2.11 has no such key. What the running torch documents decides.
    rejections = "num_oom_rejections" in (getattr(saved.get((torch.cuda.memory, "memory_stats")), "__doc__", "") or "")

    def memory_stats(device: Any = None) -> Dict[str, int]:
        if not emulator.initialized:  # torch's answer before the process used the GPU
            return {}
        stats = _allocator(emulator, device).memory_stats()
        if rejections:
            stats["num_oom_rejections"] = 0
        return dict(sorted(stats.items()))

    def stat(name: str) -> Callable[..., int]:
        return lambda device=None: memory_stats(device).get(name, 0)

    def reset_peaks(device: Any = None) -> None:
        _allocator(emulator, device).reset_peaks()

    def reset_accumulated(device: Any = None) -> None:
        _allocator(emulator, device).reset_accumulated()

    own_summary = saved.get((torch.cuda.memory, "memory_summary"))

    def empty_cache() -> None:  # every GPU's cached segments, as CUDA's emptyCache
        for gpu in emulator.gpus.values():
            gpu.allocator.empty_cache()

    def mem_get_info(device: Any = None) -> Tuple[int, int]:
        # cudaMemGetInfo: the device's memory less the CUDA context's and what the allocator holds (a
        # memory fraction limits the allocator, not what the device has free)
        allocator = _allocator(emulator, device)
        return emulator.gpu.capacity - allocator.reserved, emulator.gpu.total_memory

    def set_device(device: Any) -> None:
        index = cuda_index(device, placement.current)
        if index is not None and index >= 0:
            placement.set_current(index)
            init()

    def init() -> None:
        emulator.initialized = True

    def current_device() -> int:
        init()  # as torch.cuda.current_device() initializes CUDA
        return placement.current()

    def clear_autocast_cache() -> None:
        emulator.autocast.clear()
        if original_clear is not None:
            original_clear()

    planner = Planner(emulator, saved[(torch, "compile")])

    def compile(model: Any = None, **kwargs: Any) -> Any:
        return planner.compile(model, **kwargs)  # Inductor's memory plan, else eagerly (compiled.py)

    def summary(device: Any = None, abbreviated: bool = False) -> str:
        # torch's own table, made from the emulated memory_stats (torch.cuda.memory's, replaced here)
        if own_summary is None:
            raise RuntimeError("this torch has no torch.cuda.memory_summary")
        return str(own_summary(device=device, abbreviated=abbreviated))

    generator = emulator.generator = Generator("cuda")  # the device's default generator, standing in

    def rng_state(device: Any = None) -> torch.Tensor:
        return generator.get_state()

    def set_rng_state(state: Any, device: Any = None) -> None:
        # A state saved on a real GPU (Philox's 16 bytes) has no meaning for the stand-in, whose draws
        # differ from the GPU's anyway (values.py): it keeps its own state.
        if isinstance(state, torch.Tensor) and state.shape == generator.get_state().shape:
            generator.set_state(state)

    def set_rng_state_all(states: Any) -> None:
        for state in list(states)[:1]:
            set_rng_state(state)

    def manual_seed(seed: int) -> None:
        generator.manual_seed(int(seed))

    def seed() -> None:
        generator.seed()

    answers = {
        "is_available": lambda: True, "device_count": lambda: emulator.count,
        # NVML's readings, which a GPU-less runner has none of: an idle GPU (scripts log them)
        "utilization": lambda device=None: 0, "memory_usage": lambda device=None: 0,
        "temperature": lambda device=None: 0, "power_draw": lambda device=None: 0,
        "clock_rate": lambda device=None: 0,
        "CUDAGraph": refusing("torch/cuda/graphs.py"), "graph": refusing("torch/cuda/graphs.py"),
        "make_graphed_callables": refusing("torch/cuda/graphs.py"),
        # a graph's memory pool, which wrappers of CUDA graphs (torchtitan's) make before capturing
        "graph_pool_handle": refusing("torch/cuda/graphs.py"),
        "device_memory_used": lambda device=None: _allocator(emulator, device).reserved,
        "current_device": current_device,
        # CUDA starts at the process's first use of the GPU (torch's own code, such as DeviceMesh, picks
        # the rank's GPU only before it); what torch defers to then runs now, as the emulator is up
        "is_initialized": lambda: emulator.initialized, "init": init, "_lazy_init": init,
        "_lazy_call": lambda callable, **kwargs: callable(), "set_device": set_device,
        "get_device_name": lambda device=None: emulator.gpu.name,
        "get_device_capability": lambda device=None: (emulator.gpu.major, emulator.gpu.minor),
        "get_device_properties": lambda device=None: properties,
        "get_arch_list": lambda: [f"sm_{emulator.gpu.major}{emulator.gpu.minor}"],
        "is_bf16_supported": lambda including_emulation=True: emulator.gpu.major >= 8,
        "synchronize": nothing, "empty_cache": empty_cache, "ipc_collect": nothing,
        "memory_allocated": stat("allocated_bytes.all.current"),
        "max_memory_allocated": stat("allocated_bytes.all.peak"),
        "memory_reserved": stat("reserved_bytes.all.current"),
        "max_memory_reserved": stat("reserved_bytes.all.peak"),
        "memory_cached": stat("reserved_bytes.all.current"),
        "max_memory_cached": stat("reserved_bytes.all.peak"),
        "memory_stats": memory_stats,
        "memory_stats_as_nested_dict": lambda device=None: _nested(memory_stats(device)),
        "memory_summary": summary,
        "reset_peak_memory_stats": reset_peaks, "reset_max_memory_allocated": reset_peaks,
        "reset_max_memory_cached": reset_peaks, "reset_accumulated_memory_stats": reset_accumulated,
        "mem_get_info": mem_get_info,
        "manual_seed": manual_seed, "manual_seed_all": manual_seed, "seed": seed, "seed_all": seed,
        "initial_seed": lambda: generator.initial_seed(), "default_generators": (generator,) * emulator.count,
        "get_rng_state": rng_state, "set_rng_state": set_rng_state,
        "get_rng_state_all": lambda: [rng_state() for _ in range(emulator.count)],
        "set_rng_state_all": set_rng_state_all,
        "Stream": Stream, "Event": Event, "current_stream": current_stream,
        "default_stream": lambda device=None: default_stream_of(placement.current() if device is None else
                                                                cuda_index(device, placement.current) or 0),
        "stream": stream, "set_stream": set_stream, "device": device_class, "device_of": device_of_class,
        "_record_memory_history": emulator.record_history,
        "_snapshot": lambda device=None, augment_with_fx_traces=False: emulator.snapshot(),
        "is_current_stream_capturing": lambda: False,
        "set_per_process_memory_fraction": lambda fraction, device=None: emulator.limit(
            fraction, None if device is None else cuda_index(device, placement.current)),
        "get_per_process_memory_fraction": lambda device=None: emulator.device(
            None if device is None else cuda_index(device, placement.current)).fraction,
        "_dump_snapshot": emulator.dump_snapshot,
        "clear_autocast_cache": clear_autocast_cache, "compile": compile,
        # the CUDA build would answer from its own (empty) allocator, the CPU build has none
        "memory_snapshot": lambda mempool_id=None: emulator.snapshot()["segments"],
    }
    # One function object per name: torch._dynamo maps torch's functions to rules by identity, and
    # refuses one object under two names.
    return {name: _own(name, value) for name, value in answers.items()}


def _accelerator_answers(emulator: Emulator, cuda: Dict[str, Any]) -> Dict[str, Callable[..., Any]]:
    """torch.accelerator's answers (and torch.accelerator.memory's), as the emulated GPU. On a CUDA
    build of torch they reach the CUDA runtime through torch._C, which fails without a driver (every
    Adam-family step asks `torch.accelerator.current_stream().is_capturing()`); on a CPU build they
    would say there is no accelerator."""
    same = ("is_available", "device_count", "synchronize", "empty_cache", "memory_stats", "memory_allocated",
            "max_memory_allocated", "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats",
            "reset_accumulated_memory_stats", "current_stream", "set_stream", "_snapshot")
    answers: Dict[str, Any] = {name: _wrap(cuda[name]) for name in same}
    answers.update({
        "current_accelerator": lambda check_available=False: torch.device("cuda"),
        "current_device_index": _wrap(cuda["current_device"]), "current_device_idx": _wrap(cuda["current_device"]),
        "set_device_index": _wrap(cuda["set_device"]), "set_device_idx": _wrap(cuda["set_device"]),
        "device_index": cuda["device"],
        "get_device_capability": lambda device=None: {"major": emulator.gpu.major, "minor": emulator.gpu.minor},
        "get_memory_info": _wrap(cuda["mem_get_info"]),
        "empty_host_cache": nothing,
    })
    return {name: _own(f"accelerator.{name}", value) for name, value in answers.items()}


def _nested(flat: Dict[str, int]) -> Dict[str, Any]:
    """memory_stats' dotted keys as torch's nested dictionary (`allocated_bytes` -> `all` -> `peak`)."""
    out: Dict[str, Any] = {}
    for key, value in flat.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def _wrap(answer: Any) -> Any:
    """A fresh function calling `answer` (torch._dynamo refuses one function object under two names)."""
    if not isinstance(answer, types.FunctionType):
        return answer
    return lambda *args, **kwargs: answer(*args, **kwargs)


def nothing(*args: Any, **kwargs: Any) -> None:
    """An answer that does nothing on the emulated device (synchronize, seeds, set_device)."""


def _own(name: str, value: Any) -> Any:
    if not isinstance(value, types.FunctionType):
        return value
    fresh = types.FunctionType(value.__code__, value.__globals__, name, value.__defaults__, value.__closure__)
    fresh.__kwdefaults__ = value.__kwdefaults__
    fresh.__qualname__ = f"emulated.{name}"
    return fresh


def _targets() -> List[Tuple[Any, List[str]]]:
    """Which module each answer replaces: torch.cuda and torch.cuda.memory, a few of torch's own."""
    import torch.cuda.memory as memory
    import torch.cuda.random as random  # bound torch.cuda's functions at its import: the Trainer's rng state

    cuda_names = [n for n in dir(torch.cuda) if not n.startswith("__")]
    return [(torch.cuda, cuda_names), (memory, [n for n in dir(memory) if not n.startswith("__")]),
            (random, [n for n in dir(random) if not n.startswith("__")]),
            (torch, ["clear_autocast_cache", "compile"])]


@contextlib.contextmanager
def cuda_answers_as(emulator: Emulator) -> Iterator[None]:
    """Replace torch.cuda's answers (and torch.compile, torch.clear_autocast_cache) for the block."""
    saved: Dict[Tuple[Any, str], Any] = {}
    for module, present in _targets():
        for name in present:
            saved[(module, name)] = getattr(module, name, None)
    answers = _answers(emulator, saved)
    replaced: List[Tuple[Any, Any, Any]] = []  # (module or dict, name or key, what was there)
    for module, present in _targets():
        for name, value in answers.items():
            if module is torch and name not in ("clear_autocast_cache", "compile"):
                continue
            if module is not torch.cuda and module is not torch and name not in present:
                continue
            replaced.append((module, name, getattr(module, name, _MISSING)))
            setattr(module, name, value)
    if hasattr(torch._C, "_get_accelerator"):  # what torch's own code asks (FSDP2's default mesh): the GPU
        replaced.append((torch._C, "_get_accelerator", torch._C._get_accelerator))
        setattr(torch._C, "_get_accelerator", lambda check=False: torch.device("cuda"))  # noqa: B010
    accelerator = getattr(torch, "accelerator", None)  # torch 2.6+
    if isinstance(accelerator, types.ModuleType):
        accelerated = _accelerator_answers(emulator, answers)
        for module in (accelerator, getattr(accelerator, "memory", None)):
            if not isinstance(module, types.ModuleType):
                continue
            for name, value in accelerated.items():
                if hasattr(module, name):  # only what this torch has
                    replaced.append((module, name, getattr(module, name)))
                    setattr(module, name, value)
    nvtx = getattr(torch.cuda, "nvtx", None)
    if isinstance(nvtx, types.ModuleType):  # its own functions stay: `range` is a decorator too
        replaced.append((nvtx, "_nvtx", getattr(nvtx, "_nvtx", _MISSING)))
        setattr(nvtx, "_nvtx", Markers())  # noqa: B010 (mypy: torch is Any-typed)
    replaced.append((Stream, "emulator", None))
    Stream.emulator = emulator
    for name, value in _tensor_methods().items():
        replaced.append((torch.Tensor, name, torch.Tensor.__dict__.get(name, _MISSING)))
        setattr(torch.Tensor, name, value)
    # torch.Stream(i), as torch.nn.parallel asks for a side stream of GPU i: on a CPU build there is
    # no accelerator to make one on
    replaced.append((torch, "Stream", torch.Stream))
    torch.Stream = Stream
    replaced.append((torch, "Generator", torch.Generator))
    torch.Generator = Generator
    for name, value in _default_device_answers(emulator).items():
        replaced.append((torch, name, getattr(torch, name)))
        setattr(torch, name, value)
    import torch.utils._foreach_utils as foreach_utils

    # The emulated GPU's tensors are meta, and torch's grouping by device names them so:
    # clip_grad_norm_ would take the per-tensor norms a GPU does not run, for want of foreach kernels.
    foreach_devices = foreach_utils._get_foreach_kernels_supported_devices
    replaced.append((foreach_utils, "_get_foreach_kernels_supported_devices", foreach_devices))
    setattr(foreach_utils, "_get_foreach_kernels_supported_devices",  # noqa: B010
            lambda: [*foreach_devices(), "meta"])
    engine = torch.autograd._engine_run_backward
    replaced.append((torch.autograd, "_engine_run_backward", engine))
    # a failed backward drops what it left queued, as a GPU's autograd thread does (failed_backward.py)
    setattr(torch.autograd, "_engine_run_backward",  # noqa: B010
            dropping_queued_nodes(_with_mode_on(engine, emulator)))
    import torch.utils.checkpoint as checkpoint

    checks = getattr(checkpoint, "_allowed_determinism_checks_to_fns", None)
    extractor = getattr(checkpoint, "_DEFAULT_DETERMINISM_MODE", None)
    if isinstance(checks, dict) and extractor in checks:
        replaced.append((checks, extractor, checks[extractor]))
        checks[extractor] = _cuda_metadata(emulator)
    apply = torch.nn.Module._apply
    replaced.append((torch.nn.Module, "_apply", apply))
    torch.nn.Module._apply = _keeping_ties(apply)
    module_to = torch.nn.Module.to
    replaced.append((torch.nn.Module, "to", module_to))
    torch.nn.Module.to = _bare_index_is_cuda(module_to)
    try:
        yield
    finally:
        for module, name, value in reversed(replaced):
            if isinstance(module, dict):
                module[name] = value
            elif value is _MISSING:
                delattr(module, name)
            else:
                setattr(module, name, value)


_MISSING = object()


def _default_device_answers(emulator: Emulator) -> Dict[str, Callable[..., Any]]:
    """torch.set_default_device / get_default_device with the emulated GPU: torch keeps a default
    device in a function mode below every other, which fills in `device=` after the emulator's
    device mode has looked, so a `cuda` default would reach the CUDA backend (the driver on the
    CUDA build, nothing on the CPU build): the default is the meta device, reported as `cuda:0`.
    A `meta` default of the script's own is kept apart: what it makes is on no GPU (devices.py)."""
    set_default, get_default = torch.set_default_device, torch.get_default_device
    placement = emulator.placement

    def set_default_device(device: Any) -> None:
        placement.default_meta = isinstance(device, (str, torch.device)) and torch.device(device).type == "meta"
        set_default("meta" if device is not None and names_cuda(device) else device)

    def get_default_device() -> Any:
        device = get_default()
        return torch.device("cuda", 0) if device.type == "meta" and not placement.default_meta else device
    return {"set_default_device": set_default_device, "get_default_device": get_default_device}


def _cuda_metadata(emulator: Emulator) -> Callable[[Any], Dict[str, Any]]:
    """Checkpointing's check that the recomputation saved what the forward saved: shape, dtype and
    device, with the emulated GPU named as the tensor's whether the mode was on when it was read or not."""
    def metadata(x: Any) -> Dict[str, Any]:
        device = x.device
        if device.type == "meta":
            device = torch.device("cuda", emulator.placement.tensor_index(x))
        return {"shape": x.shape, "dtype": x.dtype, "device": device}
    return metadata


def _with_mode_on(engine: Callable[..., Any], emulator: Emulator) -> Callable[..., Any]:
    """autograd's engine with the device mode on: `loss.backward()` reaches the engine from inside the
    mode's handler, where torch has taken the mode off, and the backward may run Python that needs it
    (checkpointing's recomputation of the forward must save what the forward saved)."""
    from torch.overrides import _get_current_function_mode_stack

    def run(*args: Any, **kwargs: Any) -> Any:
        mode = emulator.device_mode
        # torch.compile's tracing runs with the modes off (compiled.py): its joint graph's backward too
        if emulator.modes_off or any(m is mode for m in _get_current_function_mode_stack()):
            return engine(*args, **kwargs)
        with mode:
            return engine(*args, **kwargs)
    return run


def _bare_index_is_cuda(to: Callable[..., Any]) -> Callable[..., Any]:
    """Module.to(0) / to(device=0): a bare index names the accelerator's device, the emulated GPU
    (Module.to parses its arguments in C++, where the device mode never sees them, and a CPU build
    of torch has no accelerator to resolve the index to)."""
    def module_to(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], int) and not isinstance(args[0], bool):
            args = (torch.device("cuda", args[0]), *args[1:])
        device = kwargs.get("device")
        if isinstance(device, int) and not isinstance(device, bool):
            kwargs["device"] = torch.device("cuda", device)
        return to(self, *args, **kwargs)
    module_to.__doc__, module_to.__wrapped__ = to.__doc__, to  # type: ignore[attr-defined]
    return module_to


def _keeping_ties(apply: Callable[..., Any]) -> Callable[..., Any]:
    """Module._apply that keeps a weight shared by two modules shared (GPT-2's tied embedding and head).

    Moving to `cuda` here is moving to meta, which torch does by making new Parameters (a CPU tensor
    cannot take a meta tensor as its .data), so each module holding the weight would get its own
    copy: twice the memory, twice the optimizer state. The GPU keeps one. Nor does the GPU copy the
    shared weight twice (its second holder finds it moved already): `fn` runs once per tensor, so
    the second holder's copy is the first's, and no second storage is allocated and freed.

    The GPU also keeps each Parameter object (`param.data = moved`): an optimizer built before
    `model.to("cuda")` steps the moved weights. Here the new Parameter's tensor is swapped into the
    old object, which keeps its attributes.
    """
    depth = [0]

    def _apply(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if depth[0]:
            return apply(self, fn, *args, **kwargs)
        slots = [(m, kind, n, t) for m in self.modules() for kind in ("_parameters", "_buffers")
                 for n, t in getattr(m, kind).items() if t is not None]
        done: Dict[int, Any] = {}  # id(tensor) -> (tensor, what fn made of it); the tensor keeps the id

        def once(t: Any) -> Any:
            if id(t) not in done:
                done[id(t)] = (t, fn(t))
            return done[id(t)][1]
        depth[0] += 1
        try:
            out = apply(self, once, *args, **kwargs)
        finally:
            depth[0] -= 1
            done.clear()
        first: Dict[int, Any] = {}
        for module, kind, name, before in slots:
            table = getattr(module, kind)
            if id(before) in first:
                table[name] = first[id(before)]
            else:
                first[id(before)] = table[name] = kept(before, table[name])
        return out
    return _apply
