"""Host memory the run may never need: weights made and initialised on the CPU, then moved to the
emulated GPU.

A script that builds its model on the CPU and then calls `.cuda()` (fine-tuning scripts, diffusion
training, `run_clm.py` without a checkpoint) would make and initialise every weight for real: 5 GiB
of host memory and seconds of arithmetic for a 1B model, only for `.cuda()` to copy them to a device
that holds no data. So a large CPU tensor made while emulating starts *lazy*: its storage is
allocated but never written (pages the process does not touch are not resident), and the in-place
initialisation the script runs on it (`uniform_`, `normal_`, `zero_`, `fill_`, the arithmetic of
`trunc_normal_` and the like) is recorded, not run. Moving it to the device needs no data, so the
record is dropped with the tensor. Any other use of it replays the record first, on the tensor's
own storage, so what the CPU reads is initialised: an op that reads it, `.numpy()`, `.tolist()`,
`data_ptr()`, its storage, pickling and `torch.save`. A model that stays on the CPU is real.

Random draws: each recorded draw takes one seed from the generator it would have drawn from and
replays from a generator of its own seeded with it. So the weights are draws from the distribution
the script asked for, the same script and seed give the same weights, reseeding before building
again gives the same weights again, and a clone (`deepcopy`) equals its source; but they are not
the numbers a run without emulation draws, and the generator has advanced by one draw per
initialisation, not by one per element, so the CPU's later draws differ from such a run's too.

State is kept per storage (views, `.data`, tied weights and `Parameter.data = ...` swaps share it),
dropped when torch frees the storage.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves, tree_map

from memdiff.recording.emulate.values import MAX_ELEMENTS

# Storages under this many bytes are made for real: their memory does not matter, and the values
# of small tensors (masks, ids, counts) are what the emulator keeps.
LAZY_BYTES = 1 << 20
META = torch.device("meta")
CPU = torch.device("cpu")
_storage_of = torch._C.TensorBase.untyped_storage  # the accessor itself, not the one patched below

# In-place ops recorded on a lazy tensor instead of run (their other tensor arguments small).
DEFERRED = {
    "uniform_", "normal_", "zero_", "fill_", "random_", "bernoulli_", "exponential_", "geometric_", "log_normal_",
    "cauchy_", "copy_", "mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_", "clamp_max_", "erfinv_", "neg_",
    "abs_", "sqrt_", "rsqrt_", "exp_", "log_", "tanh_", "sigmoid_", "pow_", "reciprocal_", "fmod_", "remainder_",
    "floor_", "ceil_", "round_", "trunc_", "sign_", "masked_fill_", "addcmul_", "addcdiv_", "lerp_",
}
# Ops that read a tensor's sizes, never its data (`set_` makes another tensor share the lazy storage).
SHAPE_ONLY = {"empty_like", "new_empty", "new_empty_strided", "zeros_like", "ones_like", "full_like", "new_zeros",
              "new_ones", "new_full", "rand_like", "randn_like", "is_same_size", "sym_size", "sym_stride",
              "sym_numel", "sym_storage_offset", "_has_same_storage_numel", "is_set_to", "is_pinned", "set_"}
# Factories whose large CPU outputs are made lazy: the in-place op that fills them (None: nothing
# to fill) and where the fill value is among the factory's positional arguments.
FACTORIES: Dict[str, Tuple[Optional[Any], Optional[int]]] = {
    "empty": (None, None), "empty_strided": (None, None), "empty_like": (None, None), "new_empty": (None, None),
    "new_empty_strided": (None, None),
    "zeros": (torch.ops.aten.zero_.default, None), "zeros_like": (torch.ops.aten.zero_.default, None),
    "new_zeros": (torch.ops.aten.zero_.default, None),
    "ones": (torch.ops.aten.fill_.Scalar, None), "ones_like": (torch.ops.aten.fill_.Scalar, None),
    "new_ones": (torch.ops.aten.fill_.Scalar, None),
    "full": (torch.ops.aten.fill_.Scalar, 1), "full_like": (torch.ops.aten.fill_.Scalar, 1),
    "new_full": (torch.ops.aten.fill_.Scalar, 2),
    "rand": (torch.ops.aten.uniform_.default, None), "rand_like": (torch.ops.aten.uniform_.default, None),
    "randn": (torch.ops.aten.normal_.default, None), "randn_like": (torch.ops.aten.normal_.default, None),
}
_LIKE = ("_like", "new_")  # factories that take a tensor: its device unless one is named

Where = Tuple[torch.dtype, Tuple[int, ...], Tuple[int, ...], int]  # a view of a storage: dtype, size, stride, offset


def _where(t: torch.Tensor) -> Where:
    return t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset())


def _view(storage: Any, where: Where) -> torch.Tensor:
    dtype, size, stride, offset = where
    return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)


def _whole(t: torch.Tensor) -> bool:
    """Whether `t` covers every byte of its storage (writing it leaves nothing of what was there)."""
    return t.storage_offset() == 0 and t.is_contiguous() and \
        t.numel() * t.element_size() == _storage_of(t).nbytes()


@dataclass(frozen=True)
class Step:
    """One recorded in-place op on a view of a lazy storage; a draw carries its own seed."""

    func: Any
    where: Where
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    seed: Optional[int]

    def run(self, storage: Any) -> None:
        """Apply the op to `storage`."""
        kwargs = dict(self.kwargs)
        if self.seed is not None:
            kwargs["generator"] = torch.Generator().manual_seed(self.seed)
        self.func(_view(storage, self.where), *self.args, **kwargs)


@dataclass(frozen=True)
class Copied:
    """A lazy tensor made by copying a view of another (`.to(dtype)`, `clone`, a deepcopy): the
    source's steps as they were then, replayed on a scratch storage and copied in."""

    nbytes: int
    steps: Tuple[Any, ...]
    source: Where
    where: Where

    def run(self, storage: Any) -> None:
        """Rebuild the source's data and copy it into `storage`."""
        scratch = torch.empty(self.nbytes, dtype=torch.uint8).untyped_storage()
        for step in self.steps:
            step.run(scratch)
        _view(storage, self.where).copy_(_view(scratch, self.source))


class Host:
    """The lazy CPU storages of one emulated run and the ops recorded on each."""

    def __init__(self) -> None:
        self.lazy: Dict[int, List[Any]] = {}  # id(storage) -> its steps, in order
        self.storages: Dict[int, Any] = {}  # id(storage) -> a weak reference to it

    # -- the dispatch side: AllocMode asks before it runs each op ------------------------------

    def intercept(self, func: Any, base: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[Any]]:
        """Run `func` here when it touches host memory lazily (a factory, a recorded in-place op, a
        copy) and return `(result,)`; otherwise make the lazy tensors it reads real and return None."""
        if base in FACTORIES:
            made = self.factory(func, base, args, kwargs)
            return (made,) if made is not None else None
        if not self.lazy:
            return None
        lazy = [t for t in tree_leaves((args, kwargs)) if self.is_lazy(t)]
        if not lazy or func.is_view or base in SHAPE_ONLY:
            return None
        first = args[0] if args else None
        if base in ("_to_copy", "copy_"):
            target = kwargs.get("device") if base == "_to_copy" else getattr(first, "device", None)
            if target is not None and torch.device(target) == META:
                # a move to the emulated device needs no data, unless the emulator keeps the values
                # of something that small
                if lazy[0].numel() <= MAX_ELEMENTS:
                    self.replay(lazy)
                return None
        if lazy[0] is first and len(lazy) == 1:
            if base in DEFERRED and func._schema.arguments[0].alias_info is not None:
                recorded = self.record(func, first, args[1:], kwargs)
                if recorded:
                    return (first,)
            if base in ("_to_copy", "clone") and torch.device(kwargs.get("device") or CPU) == CPU and \
                    kwargs.get("layout") in (None, torch.strided):
                return (self.copied(func, first, kwargs),)
        if base == "copy_" and isinstance(first, torch.Tensor) and self.is_lazy(first) and _whole(first) \
                and all(t is first for t in lazy):
            self.forget(first)  # overwritten whole: what was recorded no longer matters
            return None
        self.replay(lazy)
        return None

    def is_lazy(self, t: Any) -> bool:
        """Whether `t` is a CPU tensor whose storage is lazy."""
        return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided \
            and not is_traceable_wrapper_subclass(t) and id(_storage_of(t)) in self.lazy

    def factory(self, func: Any, base: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
        """A large CPU tensor from a factory: allocated, never written, its fill recorded."""
        device = kwargs.get("device")
        if device is not None and device == META:  # the emulated GPU's (most factories a script runs)
            return None
        like = base.endswith(_LIKE[0]) or base.startswith(_LIKE[1])
        if device is None:
            device = args[0].device if like and isinstance(args[0], torch.Tensor) else CPU
        if torch.device(device) != CPU or kwargs.get("layout") not in (None, torch.strided) or \
                kwargs.get("pin_memory") or "out" in kwargs or func._schema.overload_name.endswith("out"):
            return None
        shape = func(*args, **{**kwargs, "device": META})
        if not isinstance(shape, torch.Tensor) or shape.untyped_storage().nbytes() < LAZY_BYTES:
            return None
        out = torch.empty_strided(shape.shape, shape.stride(), dtype=shape.dtype, device=CPU)
        self.start(out, [])
        fill, at = FACTORIES[base]
        if fill is not None:
            value = (args[at],) if at is not None else (1,) if fill is torch.ops.aten.fill_.Scalar else ()
            draw = {"generator": kwargs["generator"]} if kwargs.get("generator") is not None else {}
            self.record(fill, out, value, draw)
        return out

    def record(self, func: Any, t: torch.Tensor, rest: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        """Record in-place op `func` on lazy `t`; False when it takes a tensor that cannot be kept
        (a large one, a lazy one, one on another device)."""
        kept: List[Any] = []

        def keep(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                if x.device.type != "cpu" or x.numel() > MAX_ELEMENTS or self.is_lazy(x):
                    kept.append(None)
                    return x
                return x.clone()
            return x
        args, kwargs = tree_map(keep, rest), tree_map(keep, kwargs)
        if kept:
            return False
        seed = None
        if torch.Tag.nondeterministic_seeded in func.tags:
            generator = kwargs.pop("generator", None) or torch.default_generator
            seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
        steps = self.lazy[id(_storage_of(t))]
        overwrites = seed is not None or func._schema.name.split("::")[-1] in ("zero_", "fill_", "copy_")
        if overwrites and _whole(t):
            steps.clear()  # nothing recorded before a whole overwrite can be read again
        steps.append(Step(func, _where(t), args, kwargs, seed))
        return True

    def copied(self, func: Any, source: torch.Tensor, kwargs: Dict[str, Any]) -> torch.Tensor:
        """A lazy copy of lazy `source` (`.to(dtype)`, `clone`): no data is read until it is used."""
        meta = torch.empty_strided(source.shape, source.stride(), dtype=source.dtype, device=META)
        shape = func(meta, **{k: v for k, v in kwargs.items() if k not in ("device", "pin_memory", "non_blocking")})
        out = torch.empty_strided(shape.shape, shape.stride(), dtype=shape.dtype, device=CPU)
        storage = _storage_of(source)
        steps = tuple(self.lazy[id(storage)])
        self.start(out, [Copied(storage.nbytes(), steps, _where(source), _where(out))] if steps else [])
        return out

    def start(self, t: torch.Tensor, steps: List[Any]) -> None:
        """`t`'s storage is lazy from now on, until torch frees it or something reads it."""
        storage = _storage_of(t)
        key = id(storage)
        self.lazy[key], self.storages[key] = steps, weakref.ref(storage)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.lazy.pop(key, None)
        self.storages.pop(key, None)

    def forget(self, t: torch.Tensor) -> None:
        """`t`'s storage is real from now on, with nothing to replay."""
        self._freed(id(_storage_of(t)))

    def replay(self, tensors: List[Any]) -> None:
        """Make the lazy storages of `tensors` (or storages) real: run what was recorded on them, in order."""
        for t in tensors:
            storage = t if isinstance(t, torch.UntypedStorage) else _storage_of(t)
            steps = self.lazy.pop(id(storage), None)
            self.storages.pop(id(storage), None)
            if steps is None:
                continue
            with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
                for step in steps:
                    step.run(storage)

    # -- the Python side: reads of a tensor's data that never reach the dispatcher -----------------

    @contextlib.contextmanager
    def readable(self) -> Iterator[None]:
        """While the emulator runs, Tensor methods that hand out a CPU tensor's data or storage
        (`numpy`, `tolist`, `data_ptr`, the storage, pickling, `torch.save`, DLPack, shared memory)
        make it real first. On leaving, every lazy tensor still alive is made real: the program
        goes on without the emulator to catch its reads (`memdiff.record(emulate=...)`, pytest)."""
        names = ("numpy", "tolist", "data_ptr", "untyped_storage", "_typed_storage", "storage", "__reduce_ex__",
                 "__dlpack__", "share_memory_")
        saved = {name: torch.Tensor.__dict__.get(name) for name in names}
        for name in names:
            setattr(torch.Tensor, name, self._reading(getattr(torch.Tensor, name)))
        try:
            yield
        finally:
            if self.storages:
                gc.collect()  # tensors the script dropped but a cycle still holds need no data
            self.replay([s for s in (ref() for ref in list(self.storages.values())) if s is not None])
            for name, value in saved.items():
                if value is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, value)

    def _reading(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def read(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if self.lazy and self.is_lazy(tensor):
                self.replay([tensor])
            return method(tensor, *args, **kwargs)
        read.__name__ = read.__qualname__ = getattr(method, "__name__", "read")
        read.__doc__ = method.__doc__
        return read
