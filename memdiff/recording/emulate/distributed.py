"""torch.distributed under emulation: process groups that do no communication.

A rank of a job runs alone on the emulated GPU: there is no NCCL on a CPU build of torch, and
gloo cannot move tensors that have no data. So `init_process_group` (any backend: nccl, gloo, the
default) makes torch's own `fake` process group, with an in-memory store instead of a
rendezvous: every collective returns at once, as complete, without moving data. DDP and FSDP
then build and run as on the GPU, with the buckets and flat buffers they allocate through torch
ops (which the emulator's allocator sees like any other storage).

In a launched job (`-o DIR/`) a broadcast, an all-gather, a gather, a scatter and an all-to-all carry
the values their senders know to the ranks that receive them (exchange.py): a receiving rank of
`broadcast_object_list` gets rank 0's object; a `send` reaches its `recv` (p2p.py: a pipeline's
stages). The object collectives put their tensors on the device
the script's backend would (NCCL's: the GPU). Elsewhere values follow the fake group's rule, that every
rank holds what this rank holds: a broadcast
leaves each tensor as this rank has it, an all-gather fills every slot with this rank's input,
an all-reduce of known small values (a count, a flag) sums as `world_size` equal ranks would,
an all-to-all gives each rank back what it sends that rank (a router's token counts: as many tokens
received as sent), and anything else is a tensor of unknown values (values.py). DDP's check that every rank has the
same parameters reads its own shapes back, and so passes.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
from importlib import resources
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from memdiff.numbers import DIGITS
from memdiff.recording.emulate import exchange, layout, p2p, swap
from memdiff.recording.emulate.devices import first_meta
from memdiff.recording.emulate.runtime import EmulationError, frame_dict

# Whatever backend the script asked for, per group: `dist.get_backend()` answers with it.
_asked: Dict[Any, str] = {}


# The GPU `init_process_group(device_id=...)` named, which torch binds the groups to. The fake group is
# not bound to it: a bound group makes DeviceMesh split its groups (`split_group`), which the fake
# backend cannot; what the binding changes for a script is kept by `barrier` below.
_bound: Dict[Any, Optional[int]] = {}


def _gpu_index(device_id: Any) -> Optional[int]:
    """The GPU index of an `init_process_group` `device_id` (an int or a `cuda:N` device), else None."""
    if isinstance(device_id, int):
        return device_id
    if isinstance(device_id, torch.device) and device_id.type == "cuda":
        return device_id.index
    return None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if DIGITS.fullmatch(value) else default


def _backend_name(backend: Any) -> str:
    """The backend a script named (`nccl`, `cpu:gloo,cuda:nccl`), or what a CUDA job gets by default."""
    return str(backend).lower() if backend else "nccl"


def _init(real: Callable[..., Any]) -> Callable[..., Any]:
    def init_process_group(backend: Any = None, init_method: Optional[str] = None, timeout: Any = None,
                           world_size: int = -1, rank: int = -1, store: Any = None, group_name: str = "",
                           pg_options: Any = None, device_id: Any = None, **_: Any) -> Any:
        import torch.distributed as dist

        # No rendezvous: the other ranks are not waited for, nor needed (nothing is communicated).
        world_size = world_size if world_size is not None and world_size > 0 else _env_int("WORLD_SIZE", 1)
        rank = rank if rank is not None and rank >= 0 else _env_int("RANK", 0)
        options: Dict[str, Any] = {"group_name": group_name} if group_name else {}
        if timeout is not None:
            options["timeout"] = timeout
        out = real(backend="fake", store=dist.HashStore(), world_size=world_size, rank=rank, **options)
        _asked[None] = _backend_name(backend)
        _bound[None] = _gpu_index(device_id)
        exchange.start(timeout)
        return out
    init_process_group.__wrapped__ = real  # type: ignore[attr-defined]
    return init_process_group


def _new_group(real: Callable[..., Any]) -> Callable[..., Any]:
    def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None, pg_options: Any = None,
                  *args: Any, **kwargs: Any) -> Any:
        # The default group's backend (fake): `nccl` or `gloo` named here would look for the real one.
        kwargs.pop("device_id", None)
        group = real(ranks, timeout, None, None, *args, **kwargs)
        if group is not None:
            _asked[group] = _backend_name(backend) if backend else _asked.get(None, "nccl")
        recording = layout.current()
        if recording is not None:  # the job's layout, for --ranks auto
            recording.group_made(group, None if ranks is None else list(ranks), kwargs.get("group_desc"))
        return group
    new_group.__wrapped__ = real  # type: ignore[attr-defined]
    return new_group


def _barrier(real: Callable[..., Any]) -> Callable[..., Any]:
    def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
        # On a group bound to its GPU a barrier without device_ids syncs that GPU; unbound, torch warns
        # on rank 0 ("barrier(): using the device under current context"), as the GPU run does not.
        bound = _bound.get(None)
        if device_ids is None and bound is not None:
            device_ids = [bound]
        if group is None:
            return real(async_op=async_op, device_ids=device_ids)
        return real(group, async_op, device_ids)
    barrier.__wrapped__ = real  # type: ignore[attr-defined]
    return barrier


def _get_backend(real: Callable[..., Any]) -> Callable[..., Any]:
    def get_backend(group: Any = None) -> Any:
        name = real(group)
        if str(name) != "fake":
            return name
        import torch.distributed as dist

        world = dist.GroupMember.WORLD
        return _asked.get(None if group is None or group is world else group, _asked.get(None, "nccl"))
    get_backend.__wrapped__ = real  # type: ignore[attr-defined]
    return get_backend


def _object_device(real: Callable[..., Any]) -> Callable[..., Any]:
    def _get_object_coll_device(group: Any = None) -> str:
        import torch.distributed as dist

        world = dist.GroupMember.WORLD
        asked = _asked.get(None if group is None or group is world else group, _asked.get(None))
        return real(group) if asked is None else object_device(asked)
    _get_object_coll_device.__wrapped__ = real  # type: ignore[attr-defined]
    return _get_object_coll_device


def object_device(backend: str) -> str:
    """Where the object collectives of a group of `backend` put their tensors, by torch's rule for the
    devices a backend registers: NCCL's only device is the GPU; gloo and the others have the CPU, which
    torch prefers; `cpu:gloo,cuda:nccl` names its devices. The fake group has every device, which sent
    a receiving rank's sizes to the host (`torch.empty` there holds the host's leftover bytes)."""
    devices = [pair.split(":", 1)[0].strip() for pair in backend.split(",") if ":" in pair]
    if not devices:
        return "cuda" if backend.strip() == "nccl" else "cpu"
    return "cpu" if "cpu" in devices else devices[0]


def _object_tensors(emulator: Any, real: Callable[..., Any]) -> Callable[..., Any]:
    """c10d's `_object_to_tensor`: the pickled object made on the host, then copied to the device as
    torch does, its bytes kept as the device copy's values whatever their number (values.py keeps those
    of small tensors only), so that the ranks it is sent to can unpickle it."""
    def _object_to_tensor(obj: Any, device: Any, *rest: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        host, size = real(obj, torch.device("cpu"), *rest)
        if torch.device(device).type == "cpu":
            return host, size
        on_device, size_on_device = host.to(device), size.to(device)
        with torch._C.DisableTorchFunction():
            if on_device.is_meta and emulator.values is not None:
                emulator.values.known[on_device] = host
        return on_device, size_on_device
    _object_to_tensor.__wrapped__ = real  # type: ignore[attr-defined]
    return _object_to_tensor


class NativeScope:
    """torch's C++ code running now, as a GPU's stack names it (c10d.json): its frames under the op's
    own, innermost first. A scope in stages moves to its next stage after each collective it runs
    (DDP's rebuild of its buckets syncs the bucket order, a broadcast, then makes the buckets)."""

    def __init__(self, rule: Dict[str, Any]) -> None:
        self.stages: List[Dict[str, Any]] = rule["stages"]
        self.outer: List[str] = rule["outer"]
        self.stage = 0
        self.collectives = 0  # run in this stage so far

    def frames(self) -> List[Dict[str, Any]]:
        """This scope's native frames now, innermost first."""
        names = self.stages[self.stage]["frames"] + self.outer
        return [frame_dict("", 0, name) for name in names]

    def collective(self) -> None:
        """A collective ran inside this scope: the stage ends after its last one."""
        self.collectives += 1
        if self.stage + 1 < len(self.stages) and self.collectives >= self.stages[self.stage].get("collectives", 1):
            self.stage, self.collectives = self.stage + 1, 0


def scopes() -> Dict[str, Any]:
    """The native frames of torch.distributed's C++ entry points (c10d.json)."""
    text = resources.files("memdiff.recording.emulate").joinpath("c10d.json").read_text(encoding="utf-8")
    return dict(json.loads(text)["scopes"])


def _in_scope(emulator: Any, rule: Dict[str, Any], call: Callable[..., Any],
              where: Optional[Callable[..., Optional[int]]] = None) -> Callable[..., Any]:
    """`call` with its native frames on the stack, and its buffers on the GPU of its tensors (`where`
    tells which when its arguments hold none): the C++ code sets its device from its tensors."""
    placement = emulator.placement

    def run(*args: Any, **kwargs: Any) -> Any:
        if where is not None:
            index = where(*args)
        else:
            index = _gpu_of(placement, args)
        emulator.native.append(NativeScope(rule))
        stack = placement.stack()
        stack.append(index)
        try:
            return call(*args, **kwargs)
        finally:
            stack.pop()
            emulator.native.pop()
    run.__wrapped__ = call  # type: ignore[attr-defined]
    return run


def _gpu_of(placement: Any, args: Any) -> Optional[int]:
    """The GPU of the first device tensor among `args`, None if none is. Read with the device mode off:
    under it a meta tensor says it is not meta."""
    with torch._C.DisableTorchFunction():
        first = first_meta(args)
        return placement.tensor_index(first) if first is not None else None


def _reducer(emulator: Any, real: Any, rules: Dict[str, Any]) -> Any:
    """DDP's Reducer, whose construction and bucket rebuild allocate its gradient buckets on the device
    of its parameters."""
    made = _in_scope(emulator, rules["Reducer"], lambda self, *a, **k: real.__init__(self, *a, **k))
    rebuild = _in_scope(emulator, rules["rebuild_buckets"], lambda self: real._rebuild_buckets(self),
                        where=lambda self: getattr(self, "_emulated_gpu", None))

    class Reducer(real):
        __doc__ = real.__doc__

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made(self, *args, **kwargs)
            self._emulated_gpu = _gpu_of(emulator.placement, args[:1] + tuple(kwargs.get("params", ())))

        def _rebuild_buckets(self) -> bool:
            return bool(rebuild(self))
    Reducer.__name__ = Reducer.__qualname__ = real.__name__
    Reducer.__module__ = real.__module__
    return Reducer


def _logger(real: Any) -> Any:
    """DDP's Logger, without the runtime statistics it samples at the 10th, 20th, ... forward: it
    times the forward and backward with the device's timer, the meta device has none, and C++ said
    so on every rank's stderr ("Time stats are currently only collected for CPU and CUDA devices"),
    a line a GPU run never prints. The emulated device takes no time to time; the construction's
    logging data (`_get_ddp_logging_data()`) is the real Logger's."""

    class Logger(real):
        __doc__ = real.__doc__

        def set_runtime_stats_and_log(self) -> None:
            """Nothing to sample on the emulated device."""
    Logger.__name__ = Logger.__qualname__ = real.__name__
    Logger.__module__ = real.__module__
    return Logger


@contextlib.contextmanager
def fake_process_groups(emulator: Any) -> Iterator[None]:
    """For the block: every process group torch.distributed makes is the fake one (no communication),
    and the device allocations of its C++ code carry the native frames a GPU's stack has."""
    import torch.distributed as dist

    if not dist.is_available():
        yield
        return
    import torch.distributed.distributed_c10d as c10d

    try:  # registers the `fake` backend where torch does not have it built in (before 2.9 or so)
        import torch.testing._internal.distributed.fake_pg  # noqa: F401
    except ImportError:
        pass
    wrappers = {"init_process_group": _init, "new_group": _new_group, "get_backend": _get_backend, "barrier": _barrier,
                "broadcast_object_list": _from_source, "scatter_object_list": _from_source,
                "recv_object_list": p2p.objects_from_sender}
    answers: Dict[str, Any] = {"is_nccl_available": lambda: True}
    replaced: List[Tuple[Any, str, Any]] = []
    for name, wrap in wrappers.items():
        real = getattr(c10d, name)
        answers[name] = wrap(real)
        # Every torch.distributed module that imported the function by name (device_mesh, ...).
        for module_name, module in list(sys.modules.items()):
            if module_name.startswith("torch.distributed") and getattr(module, name, None) is real:
                replaced.append((module, name, answers[name]))
    for module in (dist, c10d):
        replaced.append((module, "is_nccl_available", answers["is_nccl_available"]))
        if not hasattr(module, "ProcessGroupNCCL"):  # a CPU build never defined it
            replaced.append((module, "ProcessGroupNCCL", ProcessGroupNCCL))
    for name, wrap_object in (("_get_object_coll_device", _object_device), ("_process_group_name", p2p.naming),
                              ("_object_to_tensor", lambda real: _object_tensors(emulator, real))):
        if hasattr(c10d, name):
            replaced.append((c10d, name, wrap_object(getattr(c10d, name))))
    rules = scopes()
    for name in ("_verify_params_across_processes", "_broadcast_coalesced", "Reducer", "Logger"):
        real = getattr(dist, name, None)
        if real is None:
            continue
        if name == "Reducer":
            value = _reducer(emulator, real, rules)
        elif name == "Logger":
            value = _logger(real)
        else:
            value = _in_scope(emulator, rules[name.strip("_")], real)
        replaced.append((dist, name, value))
    with swap.replaced(replaced), coalesced_collectives():
        yield


# The coalesced collectives torch no longer gives a Meta kernel (torch 2.13's
# torch/distributed/_meta_registrations.py keeps the four commented out), which libraries still call:
# Megatron-core's distributed optimizer gathers its buckets' weights with all_gather_into_tensor under
# `_coalescing_manager` (allgather_into_tensor_coalesced_), and DDP-style bucketing reduce-scatters
# or all-reduces several tensors at once.
COALESCED = ("allgather_into_tensor_coalesced_", "reduce_scatter_tensor_coalesced_", "allgather_coalesced_",
             "allreduce_coalesced_")


def _done_work(*_: Any) -> Any:
    """What the fake group's coalesced collective returns: a Work, complete (nothing moves)."""
    from torch._C._distributed_c10d import FakeWork

    return FakeWork().boxed()


@contextlib.contextmanager
def coalesced_collectives() -> Iterator[None]:
    """For the block: the coalesced collectives run on the emulated GPU's (meta) tensors as the others
    do, complete at once; after it, torch's own table again."""
    missing = [name for name in COALESCED if hasattr(torch.ops.c10d, name)
               and not torch._C._dispatch_has_kernel_for_dispatch_key(f"c10d::{name}", "Meta")]
    if not missing:
        yield
        return
    library = torch.library.Library("c10d", "IMPL")
    try:
        for name in missing:
            library.impl(name, _done_work, "Meta")
        yield
    finally:
        library._destroy()


def _from_source(real: Callable[..., Any]) -> Callable[..., Any]:
    """broadcast_object_list and scatter_object_list on a rank that cannot hear from their source (a
    rank run alone, or one whose source `--ranks` did not run): the list stays as this rank has it, as
    a broadcast leaves a tensor. (Through the collectives, the size it received would read as 0, and
    unpickling an object of 0 bytes fails inside torch.)"""
    signature = inspect.signature(real)

    def call(*args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        try:
            given = signature.bind(*args, **kwargs).arguments
        except TypeError:  # torch's own error for the call
            return real(*args, **kwargs)
        group, src, group_src = given.get("group"), given.get("src"), given.get("group_src")
        if src is None:
            src = dist.get_global_rank(group or dist.group.WORLD, group_src) if group_src is not None else 0
        if not dist.is_initialized() or dist.get_rank() == src or exchange.hears_from(src):
            return real(*args, **kwargs)
        return None
    return call


class ProcessGroupNCCL:
    """NCCL's backend class, for a CPU build of torch that has none, while `is_nccl_available()` answers
    True: torch's own code reads it behind that answer (`_set_pg_timeout`, `_get_process_group_uid`:
    `is_nccl_available() and isinstance(backend, ProcessGroupNCCL)`). No group is one: every group of
    the emulated job is torch's fake backend, so torch takes its other branch, as for a gloo group."""

    class Options:
        """ProcessGroupNCCL.Options, as a script or library builds them before naming the backend."""

        def __init__(self, is_high_priority_stream: bool = False) -> None:
            self.is_high_priority_stream = is_high_priority_stream

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise EmulationError("ProcessGroupNCCL", "made directly: under emulation a process group is made by "
                                                 "init_process_group or new_group (there is no NCCL to connect)")


def completed(out: Any, args: Tuple[Any, ...], received: Optional[torch.futures.Future] = None) -> Any:
    """A collective's result with its Work done and its future holding the tensors, as NCCL's and
    gloo's futures do: the fake group's future holds nothing, and DDP's reducer reads its buckets back
    from the future of their all-reduce. A receive that waits on its sender (p2p.py) has that future,
    done when the values are in."""
    from torch._C import _distributed_c10d as c10d

    make = getattr(c10d, "_create_work_from_future", None)
    if make is None or not hasattr(c10d.Work, "boxed"):
        return out

    def done(value: Any) -> Any:
        future: Any = torch.futures.Future()
        future.set_result(value)
        return make(future).boxed()
    if isinstance(out, tuple) and len(out) == 2 and _is_work(out[1]):
        return out[0], done(out[0])
    if _is_work(out):
        if received is not None:
            return make(received).boxed()
        first = args[0] if args else None
        return done(first if isinstance(first, list) else [first] if isinstance(first, torch.Tensor) else None)
    return out


def _is_work(x: Any) -> bool:
    if not isinstance(x, torch.ScriptObject):
        return False
    try:
        return str(x._type().qualified_name()).endswith(".Work")
    except Exception:  # not a TorchScript class torch can name
        return False


# c10d ops only gloo runs, which the fake backend refuses ("Backend fake does not support
# monitoredBarrier"): on the GPU a script makes a gloo group for them beside NCCL's (Lightning's
# `rank_zero_first` barrier is `new_group(backend="gloo").monitored_barrier`). They return nothing.
GLOO_ONLY = {"monitored_barrier_"}

# -- the values collectives leave, as the fake group's every-rank-holds-mine rule gives them -------

ALLGATHER_LISTS = {"allgather_", "allgather_coalesced_"}
ALLGATHER_FLAT = {"_allgather_base_", "allgather_into_tensor_coalesced_"}
SAME_VALUE_OPS = {"MIN", "MAX", "AVG", "BAND", "BOR"}


def follow(base: str, args: Tuple[Any, ...], values: Any) -> None:
    """After c10d op `base` ran on meta tensors: the values its written tensors hold now (what the other
    ranks sent, in a launched job: exchange.py; else the rule of the module's docstring)."""
    if base == "send" or exchange.carry(base, args, values):
        return  # a send writes nothing; a carried collective has set what it received
    known = values.known
    if base == "broadcast_" or base.startswith("barrier"):
        return  # this rank's tensors are the source's
    if base in ALLGATHER_LISTS:  # allgather_: [[one per rank]] of [input]; coalesced: [per rank] of inputs
        outputs, inputs = args[0], args[1]
        for slots in outputs:
            for i, slot in enumerate(slots):
                _give(known, slot, values.of(inputs[0] if base == "allgather_" else inputs[i]))
        return
    if base in ALLGATHER_FLAT:  # one flat output per input, this rank's input once per rank
        pairs = [(args[0], args[1])] if base == "_allgather_base_" else list(zip(args[0], args[1]))
        for out, source in pairs:
            value = values.of(source)
            if value is None or out.numel() % max(value.numel(), 1):
                known.pop(out, None)
                continue
            _give(known, out, value.reshape(-1).repeat(out.numel() // max(value.numel(), 1)).reshape(out.shape))
        return
    if base in ("allreduce_", "allreduce_coalesced_"):
        tensors, group, op = args[0], args[1], args[2]
        kind = _reduce_kind(op)
        for t in tensors:
            value = values.of(t)
            if value is None:
                continue
            if kind == "SUM":
                known[t] = value * _size(group)
            elif kind in SAME_VALUE_OPS:
                continue
            else:
                known.pop(t, None)
        return
    if base in exchange.ALL_TO_ALL:
        pg = exchange.process_group(args[2])
        if pg is not None:  # no peer heard from: each sends this rank what this rank sends it
            exchange.all_to_all(values, base, args, pg.rank(), pg.size(),
                                lambda tensors: [exchange.known_value(values, t) for t in tensors], lambda r: None)
            return
    for t in _written(args):  # reduce-scatter, scatter, gather, recv: values unknown
        known.pop(t, None)


# Functional collectives (torch.distributed._functional_collectives, torchtitan's token dispatch) whose
# values are carried: the c10d collective each runs inside is below this mode, which does not see it.
FUNCTIONAL = {"all_to_all_single"}
# Functional collectives' ops that give back their input on a GPU: `wait_tensor` returns the tensor it
# waited for, and `_wrap_tensor_autograd` wraps it (an AsyncCollectiveTensor, whose wait is instant
# here). Their meta kernels make a copy: each collective's output would be held twice.
RETURN_INPUT = {"wait_tensor", "_wrap_tensor_autograd"}


def follow_functional(base: str, args: Tuple[Any, ...], out: Any, values: Any) -> None:
    """After functional collective `base` (FUNCTIONAL) ran on meta tensors: its output's values, as the
    collective it runs inside leaves them (follow). `_c10d_functional::all_to_all_single(input, output
    splits, input splits, group name)` is all_to_all_single into its new output."""
    import torch.distributed.distributed_c10d as c10d

    group = c10d._resolve_process_group(args[3])
    follow("alltoall_base_", (out, args[0], group, list(args[1]), list(args[2])), values)


def _reduce_kind(op: Any) -> str:
    """`SUM`, `MAX`, ...: the reduction a dispatched collective was given (a boxed ReduceOp whose `op()`
    is RedOpType's number), or "" when it cannot be told."""
    import torch.distributed as dist

    try:
        code = op.op() if callable(getattr(op, "op", None)) else getattr(op, "op", op)
        return str(dist.ReduceOp.RedOpType(int(code)).name)
    except Exception:  # a ReduceOp this torch boxes otherwise: its values are dropped
        return ""


def _give(known: Any, tensor: Any, value: Optional[torch.Tensor]) -> None:
    if value is None or tuple(value.shape) != tuple(tensor.shape):
        known.pop(tensor, None)
    else:
        known[tensor] = value.to(tensor.dtype).clone()


def _size(group: Any) -> int:
    try:
        return int(group.size())
    except Exception:  # not a process group torch can ask: the job's size
        return _env_int("WORLD_SIZE", 1)


def _written(args: Tuple[Any, ...]) -> List[Any]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(list(args)) if isinstance(t, torch.Tensor)]
