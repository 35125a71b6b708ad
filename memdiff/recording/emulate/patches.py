"""`torch.cuda` answering as the emulated GPU: the functions a script and torch itself ask about the
device, its memory and its history, replaced while the emulator runs and put back after."""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch

from memdiff.recording.emulate.runtime import Emulator


class _Properties:
    """What torch.cuda.get_device_properties() gives, for the emulated GPU."""

    def __init__(self, emulator: Emulator) -> None:
        gpu = emulator.gpu
        self.name, self.major, self.minor = gpu.name, gpu.major, gpu.minor
        self.total_memory, self.multi_processor_count = gpu.total_memory, gpu.multi_processor_count
        self.L2_cache_size, self.warp_size = gpu.l2_cache_size, gpu.warp_size
        self.is_integrated, self.is_multi_gpu_board = False, False
        self.max_threads_per_multi_processor, self.regs_per_multiprocessor = 2048, 65536
        self.gcnArchName, self.uuid = "", "emulated"

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // (1 << 20)}MB, multi_processor_count={self.multi_processor_count}, "
                f"emulated=True)")


class Stream:
    """A CUDA stream on the emulated device: work is ordered and instant, so waiting is nothing."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device, self.priority, self.cuda_stream = torch.device("cuda", 0), priority, 0

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for."""

    def record_event(self, event: Any = None) -> "Event":
        """An event, already complete."""
        return event or Event()

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always done."""
        return True

    def is_capturing(self) -> bool:
        """No CUDA graph is being captured (an optimizer's step asks, through torch.accelerator)."""
        return False

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Stream)

    def __hash__(self) -> int:
        return 0


class Event:
    """A CUDA event on the emulated device: complete as soon as recorded."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None:
        """Recorded."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always done."""
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def elapsed_time(self, end: Any) -> float:
        """No time passes on the emulated device."""
        return 0.0


class _Device:
    """torch.cuda.device(i) / device_of(t): there is one device, so entering changes nothing."""

    def __init__(self, *_: Any, **__: Any) -> None:
        self.idx = 0

    def __enter__(self) -> "_Device":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_RealGenerator: Any = torch._C.Generator
_GeneratorMeta: Any = type(_RealGenerator)  # torch's metaclass for its C types


def _names_cuda(device: Any) -> bool:
    """Whether a Generator's device argument is the (emulated) GPU: `cuda`, `cuda:0`, a torch.device, an index."""
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


class _GeneratorType(_GeneratorMeta):
    """Every torch generator is a torch.Generator still (isinstance checks in torch and in scripts)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _RealGenerator)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return issubclass(sub, _RealGenerator)


class Generator(_RealGenerator, metaclass=_GeneratorType):
    """torch.Generator while the emulator runs: a `cuda` generator is a CPU generator standing in (the
    emulated device draws no values, and ops on it take a CPU generator), reported as on `cuda:0`;
    seeding it, reading and setting its state work as on any generator."""

    def __new__(cls, device: Any = "cpu") -> "Generator":
        emulated = _names_cuda(device)
        made = super().__new__(cls, "cpu" if emulated else device)
        made.emulated = emulated
        return made

    def __init__(self, device: Any = "cpu") -> None:
        """Made whole by __new__ (torch's generator takes its device there)."""

    @property
    def device(self) -> Any:
        return torch.device("cuda", 0) if self.emulated else _RealGenerator.device.__get__(self)


Generator.__module__, Generator.__qualname__ = "torch._C", "Generator"  # as torch's own reads in a repr


def _answers(emulator: Emulator, saved: Dict[Tuple[Any, str], Any]) -> Dict[str, Callable[..., Any]]:
    allocator = emulator.allocator
    properties = _Properties(emulator)
    stream = Stream()
    original_clear = saved.get((torch, "clear_autocast_cache"))

    def stat(name: str) -> Callable[..., int]:
        return lambda device=None: allocator.memory_stats()[name]

    def reset_peaks(device: Any = None) -> None:
        allocator.reset_peaks()

    def clear_autocast_cache() -> None:
        emulator.autocast.clear()
        if original_clear is not None:
            original_clear()

    def compile(model: Any = None, **kwargs: Any) -> Any:
        emulator.note("torch.compile runs eagerly: Inductor's fused kernels and buffers are not emulated, so "
                      "activations read as the uncompiled model's")
        if model is None:
            return lambda m: m
        return model

    def summary(device: Any = None, abbreviated: bool = False) -> str:
        s = allocator.memory_stats()
        return (f"emulated {emulator.gpu.name}: allocated {s['allocated_bytes.all.current']} B "
                f"(peak {s['allocated_bytes.all.peak']} B), reserved {s['reserved_bytes.all.current']} B "
                f"(peak {s['reserved_bytes.all.peak']} B)")

    generator = Generator("cuda")  # the device's default generator, standing in

    def rng_state(device: Any = None) -> torch.Tensor:
        return generator.get_state()

    def set_rng_state(state: Any, device: Any = None) -> None:
        # A state saved on a real GPU (Philox's 16 bytes) has no meaning for the stand-in: no values are drawn.
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
        "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
        "is_initialized": lambda: True, "init": nothing, "_lazy_init": nothing, "set_device": nothing,
        "get_device_name": lambda device=None: emulator.gpu.name,
        "get_device_capability": lambda device=None: (emulator.gpu.major, emulator.gpu.minor),
        "get_device_properties": lambda device=None: properties,
        "get_arch_list": lambda: [f"sm_{emulator.gpu.major}{emulator.gpu.minor}"],
        "is_bf16_supported": lambda including_emulation=True: emulator.gpu.major >= 8,
        "synchronize": nothing, "empty_cache": lambda: allocator.empty_cache(), "ipc_collect": nothing,
        "memory_allocated": stat("allocated_bytes.all.current"),
        "max_memory_allocated": stat("allocated_bytes.all.peak"),
        "memory_reserved": stat("reserved_bytes.all.current"),
        "max_memory_reserved": stat("reserved_bytes.all.peak"),
        "memory_cached": stat("reserved_bytes.all.current"),
        "max_memory_cached": stat("reserved_bytes.all.peak"),
        "memory_stats": lambda device=None: allocator.memory_stats(),
        "memory_summary": summary,
        "reset_peak_memory_stats": reset_peaks, "reset_max_memory_allocated": reset_peaks,
        "reset_max_memory_cached": reset_peaks, "reset_accumulated_memory_stats": nothing,
        "mem_get_info": lambda device=None: (emulator.capacity - allocator.reserved, emulator.gpu.total_memory),
        "manual_seed": manual_seed, "manual_seed_all": manual_seed, "seed": seed, "seed_all": seed,
        "initial_seed": lambda: generator.initial_seed(), "default_generators": (generator,),
        "get_rng_state": rng_state, "set_rng_state": set_rng_state,
        "get_rng_state_all": lambda: [rng_state()], "set_rng_state_all": set_rng_state_all,
        "Stream": Stream, "Event": Event, "current_stream": lambda device=None: stream,
        "default_stream": lambda device=None: stream, "stream": lambda s=None: contextlib.nullcontext(),
        "set_stream": nothing, "device": _Device, "device_of": _Device,
        "_record_memory_history": emulator.record_history,
        "_snapshot": lambda device=None, augment_with_fx_traces=False: emulator.snapshot(),
        "is_current_stream_capturing": lambda: False,
        "set_per_process_memory_fraction": lambda fraction, device=None: emulator.limit(fraction),
        "get_per_process_memory_fraction": lambda device=None: emulator.fraction,
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
    allocator = emulator.allocator
    same = ("is_available", "device_count", "synchronize", "empty_cache", "memory_stats", "memory_allocated",
            "max_memory_allocated", "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats",
            "reset_accumulated_memory_stats", "current_stream", "set_stream", "_snapshot")
    answers: Dict[str, Any] = {name: _wrap(cuda[name]) for name in same}
    answers.update({
        "current_accelerator": lambda check_available=False: torch.device("cuda"),
        "current_device_index": lambda: 0, "current_device_idx": lambda: 0,
        "set_device_index": nothing, "set_device_idx": nothing, "device_index": _Device,
        "get_device_capability": lambda device=None: {"major": emulator.gpu.major, "minor": emulator.gpu.minor},
        "get_memory_info": lambda device=None: (emulator.capacity - allocator.reserved, emulator.gpu.total_memory),
        "empty_host_cache": nothing,
    })
    return {name: _own(f"accelerator.{name}", value) for name, value in answers.items()}


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

    cuda_names = [n for n in dir(torch.cuda) if not n.startswith("__")]
    return [(torch.cuda, cuda_names), (memory, [n for n in dir(memory) if not n.startswith("__")]),
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
    if isinstance(nvtx, types.ModuleType):
        for name in ("range_push", "range_pop", "mark"):
            replaced.append((nvtx, name, getattr(nvtx, name, _MISSING)))
            setattr(nvtx, name, lambda *a, **k: 0)
        replaced.append((nvtx, "range", getattr(nvtx, "range", _MISSING)))
        setattr(nvtx, "range", lambda *a, **k: contextlib.nullcontext())  # noqa: B010 (mypy: torch is Any-typed)
    replaced.append((torch, "Generator", torch.Generator))
    torch.Generator = Generator
    for name, value in _default_device_answers().items():
        replaced.append((torch, name, getattr(torch, name)))
        setattr(torch, name, value)
    storage_pointer = torch.UntypedStorage.data_ptr
    replaced.append((torch.UntypedStorage, "data_ptr", storage_pointer))

    def data_ptr(self: Any) -> int:
        return emulator.address(self) if self.device.type == "meta" else storage_pointer(self)
    setattr(torch.UntypedStorage, "data_ptr", data_ptr)  # noqa: B010
    engine = torch.autograd._engine_run_backward
    replaced.append((torch.autograd, "_engine_run_backward", engine))
    setattr(torch.autograd, "_engine_run_backward", _with_mode_on(engine, emulator))  # noqa: B010
    import torch.utils.checkpoint as checkpoint

    checks = getattr(checkpoint, "_allowed_determinism_checks_to_fns", None)
    extractor = getattr(checkpoint, "_DEFAULT_DETERMINISM_MODE", None)
    if isinstance(checks, dict) and extractor in checks:
        replaced.append((checks, extractor, checks[extractor]))
        checks[extractor] = _cuda_metadata
    apply = torch.nn.Module._apply
    replaced.append((torch.nn.Module, "_apply", apply))
    torch.nn.Module._apply = _keeping_ties(apply)
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


def _default_device_answers() -> Dict[str, Callable[..., Any]]:
    """torch.set_default_device / get_default_device with the emulated GPU: torch keeps a default
    device in a function mode below every other, which fills in `device=` after the emulator's
    device mode has looked, so a `cuda` default would reach the CUDA backend (the driver on the
    CUDA build, nothing on the CPU build): the default is the meta device, reported as `cuda:0`."""
    set_default, get_default = torch.set_default_device, torch.get_default_device

    def set_default_device(device: Any) -> None:
        set_default("meta" if device is not None and _names_cuda(device) else device)

    def get_default_device() -> Any:
        device = get_default()
        return torch.device("cuda", 0) if device.type == "meta" else device
    return {"set_default_device": set_default_device, "get_default_device": get_default_device}


def _cuda_metadata(x: Any) -> Dict[str, Any]:
    """Checkpointing's check that the recomputation saved what the forward saved: shape, dtype and
    device, with the emulated device named `cuda` whether the mode was on when it was read or not."""
    device = x.device
    return {"shape": x.shape, "dtype": x.dtype, "device": torch.device("cuda", 0) if device.type == "meta" else device}


def _with_mode_on(engine: Callable[..., Any], emulator: Emulator) -> Callable[..., Any]:
    """autograd's engine with the device mode on: `loss.backward()` reaches the engine from inside the
    mode's handler, where torch has taken the mode off, and the backward may run Python that needs it
    (checkpointing's recomputation of the forward must save what the forward saved)."""
    from torch.overrides import _get_current_function_mode_stack

    def run(*args: Any, **kwargs: Any) -> Any:
        mode = emulator.device_mode
        if any(m is mode for m in _get_current_function_mode_stack()):
            return engine(*args, **kwargs)
        with mode:
            return engine(*args, **kwargs)
    return run


def _keeping_ties(apply: Callable[..., Any]) -> Callable[..., Any]:
    """Module._apply that keeps a weight shared by two modules shared (GPT-2's tied embedding and head).

    Moving to `cuda` here is moving to meta, which torch does by making new Parameters (a CPU tensor
    cannot take a meta tensor as its .data), so each module holding the weight would get its own
    copy: twice the memory, twice the optimizer state. The GPU keeps one. Nor does the GPU copy the
    shared weight twice (its second holder finds it moved already): `fn` runs once per tensor, so
    the second holder's copy is the first's, and no second storage is allocated and freed.
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
                first[id(before)] = table[name]
        return out
    return _apply
