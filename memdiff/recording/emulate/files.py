"""Saves and loads under emulation: what the run saves it can load back, and nothing reaches the user's files.

Every file the run writes lands in its overlay (overlay.py), so no save can replace a user's real
checkpoint. What remains is what a save of emulated tensors holds, and what loading it gives:

- a save whose payload holds an emulated tensor (shapes on the meta device, no data) writes a
  stand-in: torch.save writes the payload pickled with its tensors as shapes (SKELETON, then the
  bytes of tensor data a real run writes there), safetensors' save_file a real safetensors file
  whose data is a hole (sparse: it costs no disk). Loading either in the same run, from any of its
  processes, gives tensors of the same shapes and dtypes on the emulated GPU, as a GPU run loads
  what it saved. torch.distributed.checkpoint's save of emulated tensors writes nothing, and says so.
- storages moved to the device (`torch.load(map_location="cuda")`, a checkpoint saved on a GPU,
  `storage.cuda()`) become allocations on the emulated GPU, one per storage as a GPU makes them,
  without reading their bytes: torch.load maps the file and copies out only what stays on the host.
  safetensors opened onto the device (`load_file`, `safe_open`) reads only the header.
- the savers and loaders that open a path in native code (torch's zip writer and mapped loads,
  safetensors) are given the overlay's path for it, as Python's own file calls are.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import importlib.abc
import importlib.util
import io
import os
import pickle
import sys
import types
import weakref
import zipfile
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch.utils._pytree import tree_leaves

from memdiff.recording.emulate import exchange, overlay_calls
from memdiff.recording.emulate.devices import names_cuda
from memdiff.recording.emulate.overlay import SKELETON, Overlay, missing
from memdiff.recording.emulate.runtime import Emulator, python_frames
from memdiff.recording.emulate.tensorfiles import OnDevice, write_shapes
from memdiff.recording.emulate.values import MAX_ELEMENTS
from memdiff.units import format_bytes

_active: Optional["Files"] = None  # the running emulator's, while one runs
# Saves not written (torch.distributed.checkpoint's) named in full in the run's notes, which every
# report shows; a script that saves every few steps would name hundreds there. Each later file still
# gets its line on stderr as it is saved, after whatever the library prints, and a count in the notes.
SAID = 6


class _Payload:
    """What a save would write: whether it holds emulated tensors, and the tensors' bytes."""

    def __init__(self) -> None:
        self.skeleton: Optional[bytes] = None  # the object pickled with its tensors as shapes only
        self.emulated = False  # an emulated (meta) tensor
        self.nbytes = 0
        self._seen: Set[Any] = set()
        self._keep: List[Any] = []  # holds what was counted, so no id is reused during the scan


class Files:
    """The emulator's saves and loads: the stand-ins it wrote, and the saves it did not write."""

    def __init__(self, emulator: Emulator, overlay: Overlay) -> None:
        self.emulator = emulator
        self.overlay = overlay
        self.targets: Set[str] = set()  # the files skipped saves named, each said once
        # sha256 of each stand-in this process wrote: one read back from an in-memory buffer is
        # unpickled only if it is the run's own (a buffer's bytes may come from anywhere)
        self.stand_ins: Set[bytes] = set()
        self.coverage_said = False  # DCP's coverage check left out for ranks not run: said once

    # -- what a save would write ----------------------------------------------------------------

    def scan(self, obj: Any, whole_storages: bool) -> _Payload:
        """The tensors and arrays in `obj`, found as torch.save's pickling finds them (any object a
        save takes), without pickling any data. `whole_storages`: count each storage's bytes once
        (torch.save writes storages), else each distinct tensor's (safetensors and numpy write tensors)."""
        payload = _Payload()
        files = self

        class Scanner(pickle.Pickler):
            def reducer_override(self, value: Any) -> Any:
                if isinstance(value, torch.Tensor):
                    files._tensor(value, payload, whole_storages)
                    if type(value) in (torch.Tensor, torch.nn.Parameter):  # the skeleton's: its shape
                        return (_empty_like_saved, (tuple(value.shape), value.dtype, value.requires_grad,
                                                    isinstance(value, torch.nn.Parameter), value.is_meta))
                elif isinstance(value, (torch.UntypedStorage, torch.TypedStorage)):
                    files._storage(value, payload)
                else:
                    return NotImplemented
                return (int, ())  # counted: nothing of it is pickled

        skeleton = io.BytesIO()
        with torch._C.DisableTorchFunction():
            try:
                Scanner(skeleton, protocol=2).dump(obj)
                payload.skeleton = skeleton.getvalue()
            except Exception:  # something plain pickling cannot take (the save's own pickler may)
                self._walk(obj, payload, whole_storages, set())
        return payload

    def _walk(self, obj: Any, payload: _Payload, whole: bool, seen: Set[int]) -> None:
        """The containers and attributes of `obj`, where pickling it failed."""
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            self._tensor(obj, payload, whole)
        elif isinstance(obj, dict):
            for value in list(obj.values()):
                self._walk(value, payload, whole, seen)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for value in list(obj):
                self._walk(value, payload, whole, seen)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            self._walk(vars(obj), payload, whole, seen)

    def _tensor(self, t: torch.Tensor, payload: _Payload, whole: bool) -> None:
        flatten = getattr(type(t), "__tensor_flatten__", None)
        if flatten is not None:  # DTensor and other wrappers: what a rank writes is its local tensors
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                # torch 2.13's DTensor names its `device_mesh` there too, which holds no data a
                # rank writes (FSDP2's sharded parameters in a checkpoint's state dict)
                if isinstance(inner, torch.Tensor):
                    self._tensor(inner, payload, whole)
            return
        if t.layout != torch.strided:
            if t.is_meta:
                payload.emulated = True
            return
        storage = t.untyped_storage()
        payload._keep.append(storage)
        if t.is_meta:
            payload.emulated = True
        key: Any = id(storage) if whole else (id(storage), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in payload._seen:
            payload._seen.add(key)
            payload.nbytes += storage.nbytes() if whole else t.numel() * t.element_size()

    def _storage(self, s: Any, payload: _Payload) -> None:
        untyped = s._untyped_storage if isinstance(s, torch.TypedStorage) else s
        payload._keep.append(untyped)
        if untyped.device.type == "meta":
            payload.emulated = True
        if id(untyped) not in payload._seen:
            payload._seen.add(id(untyped))
            payload.nbytes += untyped.nbytes()

    def unsaid(self) -> Optional[str]:
        """The run's note of the saves not written past the first SAID, which the notes do not name."""
        more = len(self.targets) - SAID
        if more <= 0:
            return None
        return (f"and {more:,} more file{'s' if more > 1 else ''} of emulated tensors not written, named on stderr "
                f"as each was saved")

    def skipped(self, call: str, where: Tuple[str, Optional[bool]], payload: _Payload) -> None:
        """Say once per file that a save was not written, and what the real run writes there. `where`:
        the target as a note names it, and whether that file existed (None: not a path)."""
        target, existed = where
        if target in self.targets:
            return
        self.targets.add(target)
        if len(self.targets) > SAID:
            print(f"memdiff: emulation: {call} to {target} not written either (a real run writes "
                  f"{format_bytes(payload.nbytes)} of tensor data)", file=sys.stderr)
            return
        state = "nothing was written into it" if existed is None else \
            f"{target} is unchanged" if existed else "no file was made"
        self.emulator.note(f"{call} to {target} not written: it holds tensors on the emulated GPU, which have no "
                           f"data (a real run writes {format_bytes(payload.nbytes)}, {payload.nbytes:,} bytes of "
                           f"tensor data); {state}")

    # -- stand-ins ------------------------------------------------------------------------------

    def stand_in(self, payload: _Payload) -> bytes:
        """The bytes a save of emulated tensors writes: SKELETON, the tensor data a real run writes,
        then the payload pickled with its tensors as shapes."""
        data = SKELETON + f"{payload.nbytes}\n".encode() + (payload.skeleton or b"")
        self.stand_ins.add(hashlib.sha256(data).digest())
        return data

    def read_stand_in(self, f: Any) -> Optional[bytes]:
        """The skeleton of a stand-in this run wrote, read from path or file `f`; None for any other file
        (it loads as torch.load loads it). A path's is the run's own where the overlay holds it."""
        if isinstance(f, (str, os.PathLike)):
            real = self.overlay.where(f)
            if real is None:
                return None
            try:
                with open(real, "rb") as opened:
                    data = opened.read(len(SKELETON))
                    if data != SKELETON:
                        return None
                    data += opened.read()
            except OSError:
                return None
            trusted = real.startswith(self.overlay.upper + os.sep)
        else:
            try:
                start = f.tell()
                data = f.read(len(SKELETON))
                if data != SKELETON:
                    f.seek(start)
                    return None
                data += f.read()
            except (AttributeError, OSError, io.UnsupportedOperation):
                return None
            # a file the run opened on a path whose copy the overlay holds (written by any of its processes)
            name = getattr(f, "name", None)
            real = self.overlay.where(name) if isinstance(name, (str, os.PathLike)) else None
            trusted = real is not None and real.startswith(self.overlay.upper + os.sep)
        if not trusted and hashlib.sha256(data).digest() not in self.stand_ins:
            return None
        return data.split(b"\n", 1)[1]

    # -- storages to the device ----------------------------------------------------------------

    def device_storage(self, nbytes: int) -> Any:
        """A storage of `nbytes` on the emulated GPU, allocated where a GPU allocates it (freed with it)."""
        storage = torch.UntypedStorage(nbytes, device="meta")
        if nbytes:
            emulator = self.emulator
            key, index = id(storage), emulator.placement.current()
            emulator.placement.of[key] = index  # on the current GPU, as torch.load's "cuda" is
            weakref.finalize(storage, emulator._storage_freed, key)
            emulator.blocks[key] = emulator.allocate(nbytes, python_frames(2) if emulator.recording is not None
                                                     else [], index)
        return storage


# -- the target of a save -----------------------------------------------------------------------

def _target(f: Any) -> Tuple[str, Optional[bool]]:
    """How a save's target reads in a note, and whether that file existed (None: not a path)."""
    if isinstance(f, (str, os.PathLike)):
        path = os.fsdecode(f)
        return path, os.path.exists(path)
    name = getattr(f, "name", None)
    if isinstance(name, str):
        return f"the open file {name}", None
    return f"an in-memory {type(f).__name__}", None


def _for_writing(f: Any) -> Any:
    """The path a native writer opens for path `f`: the overlay's; a file object as it is."""
    if _active is None or not isinstance(f, (str, os.PathLike)):
        return f
    return _active.overlay.writable(f, keep=False)


def _for_reading(f: Any) -> Any:
    """The path a native reader opens for path `f`: where the run sees it (FileNotFoundError where the
    run deleted it); a file object as it is."""
    if _active is None or not isinstance(f, (str, os.PathLike)):
        return f
    real = _active.overlay.where(f)
    if real is None:
        raise missing(f)
    return real


# -- the wrappers ---------------------------------------------------------------------------------

def _empty_like_saved(shape: Tuple[int, ...], dtype: Any, requires_grad: bool, parameter: bool,
                      on_device: bool) -> torch.Tensor:
    """A tensor of a stand-in save, loaded back: on the emulated GPU where it was there, else the host."""
    t = torch.empty(shape, dtype=dtype, device="cuda") if on_device else torch.zeros(shape, dtype=dtype)
    return torch.nn.Parameter(t, requires_grad=requires_grad) if parameter else t.requires_grad_(requires_grad)


def _torch_save(real: Callable[..., Any]) -> Callable[..., Any]:
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        files = _active
        if files is None:
            return real(obj, f, *args, **kwargs)
        payload = files.scan(obj, whole_storages=True)
        if not payload.emulated or payload.skeleton is None:
            return real(obj, _for_writing(f), *args, **kwargs)
        data = files.stand_in(payload)
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as out:  # through the overlay
                out.write(data)
        else:
            f.write(data)
        return None
    return save


def _torch_load(real: Callable[..., Any]) -> Callable[..., Any]:
    def load(f: Any, map_location: Any = None, pickle_module: Any = None, *, weights_only: Any = None,
             mmap: Any = None, **kwargs: Any) -> Any:
        call = dict(pickle_module=pickle_module, weights_only=weights_only, **kwargs)
        if _active is None:
            return real(f, map_location, mmap=mmap, **call)
        skeleton = _active.read_stand_in(f)
        if skeleton is not None:
            # What this run saved there: its tensors made anew on the emulated GPU (a load to the
            # device allocates them), with their shapes and no data.
            return pickle.loads(skeleton)  # noqa: S301 (the run's own stand-in, made from its save)
        f = _for_reading(f)
        if _is_meta(map_location) or not _is_zip(f):
            return real(f, map_location, mmap=mmap, **call)
        # Map a path's file rather than read it: storages bound for the device are never read, and
        # those that stay on the host are copied out of the mapping (below), as a plain load gives them.
        mapped = mmap is None and isinstance(f, (str, os.PathLike))
        restore = torch.serialization._get_restore_location(map_location)
        small: Dict[int, Tuple[Any, Any]] = {}  # a small storage sent to the device: it, and its bytes

        def place(storage: Any, location: str) -> Any:
            out = restore(storage, location)
            if mapped and out.device.type == "cpu" and out.nbytes() and out.data_ptr() == storage.data_ptr():
                own = torch.UntypedStorage(out.nbytes())
                own.copy_(out)
                return own
            if out.device.type == "meta" and 0 < storage.nbytes() <= _SMALL_BYTES and storage.device.type == "cpu":
                small[int(out._cdata)] = (out, torch.UntypedStorage(storage.nbytes()).copy_(storage))
            return out
        loaded = real(f, place, mmap=True if mapped else mmap, **call)
        if small:
            _keep_values(loaded, small)
        return loaded
    return load


# A storage of at most this many bytes loaded onto the device keeps its bytes until its tensors are
# rebuilt: MAX_ELEMENTS elements of the widest dtype (8 B). Which dtype it holds is known only then.
_SMALL_BYTES = MAX_ELEMENTS * 8


def _keep_values(loaded: Any, small: Dict[int, Tuple[Any, Any]]) -> None:
    """The values of the small tensors `torch.load` put on the emulated GPU, read from the file, as a
    load to the host and a `.to("cuda")` keep them (values.py): a tokenizer's table of token lengths,
    ids, counts. nanochat's validation divides by a sum of its `token_bytes`, loaded onto the device:
    without its values the sum read back 0 and its guard for 0 gave `bpb: inf`. Only the tensors a
    load returns in plain containers (a tensor, a dict, a list: a state dict) are reached."""
    values = getattr(_active.emulator, "values", None) if _active is not None else None
    if values is None:
        return
    for t in tree_leaves(loaded):
        if not isinstance(t, torch.Tensor):
            continue
        with torch._C.DisableTorchFunction():  # the tensor as it is (meta), not as the script sees it
            if not t.is_meta or t.numel() > MAX_ELEMENTS or t.layout != torch.strided:
                continue
            held = small.get(int(t.untyped_storage()._cdata))
            if held is None:
                continue
            try:
                host = torch.empty(0, dtype=t.dtype).set_(held[1], t.storage_offset(), t.shape, t.stride())
            except RuntimeError:  # a view past the bytes kept: no values, as before
                continue
            values.known[t] = host.clone()


def _is_meta(location: Any) -> bool:
    return (isinstance(location, str) and location == "meta") or \
        (isinstance(location, torch.device) and location.type == "meta")


def _is_zip(f: Any) -> bool:
    """Whether torch.load would read `f` as a zip archive of torch.save's (its format since 1.6),
    not a TorchScript archive (which it hands to torch.jit.load)."""
    if not isinstance(f, (str, os.PathLike)):
        return _is_zip_file(f)
    try:
        with open(f, "rb") as opened:
            if opened.read(4) != b"PK\x03\x04":
                return False
        with zipfile.ZipFile(f) as archive:
            return not any(name.endswith("/constants.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False  # torch.load says why, in its own words


def _is_zip_file(f: Any) -> bool:
    """_is_zip of an open file (nanochat's `with open(path, "rb") as f: torch.load(f, ...)`), read where
    it stands and put back there; False for one that cannot be read so (a stream)."""
    try:
        start = f.tell()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return False
    try:
        if f.read(4) != b"PK\x03\x04":
            return False
        f.seek(start)
        with zipfile.ZipFile(f) as archive:
            return not any(name.endswith("/constants.pkl") for name in archive.namelist())
    except (AttributeError, OSError, io.UnsupportedOperation, zipfile.BadZipFile):
        return False
    finally:
        f.seek(start)


def _storage_to(real: Callable[..., Any]) -> Callable[..., Any]:
    def _to(self: Any, device: Any, non_blocking: bool = False) -> Any:
        files = _active
        if files is None or not names_cuda(device) or isinstance(self, torch.TypedStorage):
            return real(self, device, non_blocking)
        if self.device.type == "meta":
            return self  # on the emulated GPU already
        return files.device_storage(self.nbytes())
    return _to


def _safe_open(real: Callable[..., Any]) -> Callable[..., Any]:
    def safe_open(filename: Any, framework: str, device: Any = "cpu", *args: Any, **kwargs: Any) -> Any:
        if _active is None:
            return real(filename, framework, device, *args, **kwargs)
        filename = _for_reading(filename)
        if not names_cuda(device):
            return real(filename, framework, device, *args, **kwargs)
        return OnDevice(real(filename, framework, "cpu", *args, **kwargs))
    return safe_open


def _safetensors_save_file(real: Callable[..., Any]) -> Callable[..., Any]:
    def save_file(tensors: Dict[str, torch.Tensor], filename: Any, metadata: Optional[Dict[str, str]] = None,
                  *args: Any, **kwargs: Any) -> None:
        files = _active
        if files is None:
            return real(tensors, filename, metadata, *args, **kwargs)
        target = _for_writing(filename)
        if not files.scan(tensors, whole_storages=False).emulated:
            return real(tensors, target, metadata, *args, **kwargs)
        write_shapes(tensors, metadata, target)
        return None
    return save_file


def _native_opener(real: Callable[..., Any]) -> Callable[..., Any]:
    """A reader that opens its path in native code (pyarrow's memory_map, which datasets reads its
    cache through): given the path the run sees there, in the overlay or the user's tree."""
    def opener(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if _active is None or not isinstance(path, (str, os.PathLike)):
            return real(path, mode, *args, **kwargs)
        if mode == "r":
            return real(_for_reading(path), mode, *args, **kwargs)
        return real(_active.overlay.writable(path, keep="+" in mode), mode, *args, **kwargs)
    return opener


def _saver(call: str, payload_of: Callable[..., Any], target_of: Callable[..., Any],
           returns: Callable[[], Any] = lambda: None) -> Callable[..., Callable[..., Any]]:
    """A wrapper factory for a save that cannot write emulated tensors: `payload_of(*args, **kwargs)`
    is what it writes, `target_of` where. One that holds them is not written, and said."""
    def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
        def save(*args: Any, **kwargs: Any) -> Any:
            files = _active
            if files is None:
                return real(*args, **kwargs)
            payload = files.scan(payload_of(*args, **kwargs), whole_storages=False)
            if not payload.emulated:
                return real(*args, **kwargs)
            files.skipped(call, target_of(*args, **kwargs), payload)
            return returns()
        return save
    return wrap


def _arg(index: int, name: str) -> Callable[..., Any]:
    return lambda *args, **kwargs: args[index] if len(args) > index else kwargs.get(name)


def _done_future() -> Any:
    future: Any = concurrent.futures.Future()
    future.set_result(None)
    return future


def _dcp_save(call: str, returns: Callable[[], Any] = lambda: None) -> Callable[..., Callable[..., Any]]:
    """torch.distributed.checkpoint's save or async_save: not written when it holds emulated tensors
    (_saver), yet its folder is made, as every rank's writer makes it before writing
    (`FileSystemWriter.prepare_local_plan`), so a script that looks into it finds it."""
    not_written = _saver(call, _arg(0, "state_dict"), _dcp_target, returns=lambda: _SKIPPED)

    def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
        save = not_written(real)

        def dcp_save(*args: Any, **kwargs: Any) -> Any:
            done = save(*args, **kwargs)
            if done is not _SKIPPED:
                return done
            where = _dcp_path(**kwargs)
            if isinstance(where, (str, os.PathLike)):
                os.makedirs(where, exist_ok=True)  # into the overlay, as every write of the run
            return returns()
        return dcp_save
    return wrap


_SKIPPED = object()  # what _saver's save returns, inside _dcp_save, for a save it did not write


def _peers_plans(real: Callable[..., Any]) -> Callable[..., Any]:
    """DCP's dedup of the ranks' save plans, on the coordinator, where ranks of the job are not run
    here: their plans reach it as copies of this rank's own (an object collective gives every slot
    this rank's: distributed.py). A copy is what a peer sends for a tensor every rank holds whole (a
    replicated weight, DDP's), and dedup shares those out as in a real job; but a peer's shard of a
    sharded tensor (FSDP's, TP's) is another part of it, never this rank's part: those items are
    dropped from the copies, so this rank writes all of its own shards, as on the GPU (dedup had
    handed half of them to the copies, and rank 0 of 2 wrote 6.03 MiB of its 12.01 MiB)."""
    def dedup(all_plans: Any, *args: Any, **kwargs: Any) -> Any:
        import dataclasses

        import torch.distributed as dist

        absent = _ranks_not_run()
        if absent and isinstance(all_plans, list) and len(all_plans) == dist.get_world_size():
            all_plans = [dataclasses.replace(plan, items=[i for i in plan.items if _whole(i)]) if r in absent
                         else plan for r, plan in enumerate(all_plans)]
        return real(all_plans, *args, **kwargs)
    return dedup


def _whole(item: Any) -> bool:
    """Whether a DCP write item is a whole tensor or an object (what every rank holds alike), not a
    shard of a larger tensor."""
    data = getattr(item, "tensor_data", None)
    if data is None:
        return True
    return list(data.chunk.sizes) == list(data.size) and not any(data.chunk.offsets)


def _plans_of_ranks_run(real: Callable[..., Any]) -> Callable[..., Any]:
    """DCP's check, on a save's coordinator, that the ranks' plans together cover every tensor: where
    ranks of the job are not run here (`--ranks`, a rank alone), no plan holds their shards
    (_peers_plans), so each sharded tensor is covered only by the shards of the ranks that ran, and
    the check failed the save ("invalid fill
    tensor-volume: 16777216 chunks-volume: 4194304") where a real job's passes. Its other checks
    (chunks out of bounds or overlapping) still stand. torch 2.13 returns the errors, older ones a bool."""
    def validate(global_plan: Any, metadata: Any) -> Any:
        result = real(global_plan, metadata)
        valid = result if isinstance(result, bool) else not result
        absent = _ranks_not_run()
        if valid or not absent:
            return result
        left = True if isinstance(result, bool) else [e for e in result if "invalid fill" not in str(e)]
        if _active is not None and left in (True, []) and not _active.coverage_said:
            _active.coverage_said = True
            import torch.distributed as dist

            world = dist.get_world_size()
            _active.emulator.note(f"torch.distributed.checkpoint: the save's plan holds only the shards of the ranks "
                                  f"run here ({len(absent):,} of the job's {world:,} ranks not run), so its check "
                                  f"that the ranks' shards cover every tensor was not made, and the checkpoint "
                                  f"written holds those ranks' shards alone; a real job's coordinator has every "
                                  f"rank's plan")
        return left
    return validate


def _ranks_not_run() -> List[int]:
    """The ranks of the default group this process hears nothing from (not run here)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return []
    me = dist.get_rank()
    return [r for r in range(dist.get_world_size()) if r != me and not exchange.hears_from(r)]


def _dcp_path(**kwargs: Any) -> Any:
    """Where a DCP save writes: its `checkpoint_id`, else its storage writer's path; None when neither says."""
    where = kwargs.get("checkpoint_id")
    return where if where is not None else getattr(kwargs.get("storage_writer"), "path", None)


def _dcp_target(*args: Any, **kwargs: Any) -> Tuple[str, Optional[bool]]:
    where = _dcp_path(**kwargs)
    return (_target(where) if where is not None else ("the storage writer's checkpoint", None))


# module -> [(attribute, wrapper factory)]: patched when the emulator starts, or when the module is
# imported later, and put back when it stops (with every module's reference to them).
WRAPPERS: Dict[str, List[Tuple[str, Callable[..., Any]]]] = {
    "torch.serialization": [("save", _torch_save), ("load", _torch_load)],
    "torch._utils": [("_to", _storage_to)],
    "safetensors": [("safe_open", _safe_open)],
    "pyarrow": [("memory_map", _native_opener)],
    "safetensors.torch": [
        ("save_file", _safetensors_save_file),
        # bytes for the script to keep or write: empty, so nothing it writes from them looks like weights
        ("save", _saver("safetensors save", _arg(0, "tensors"), lambda *a, **k: ("the bytes it returns", None),
                        returns=lambda: b"")),
    ],
    "torch.distributed.checkpoint.state_dict_saver": [
        ("save", _dcp_save("torch.distributed.checkpoint.save")),
        ("async_save", _dcp_save("torch.distributed.checkpoint.async_save", returns=_done_future)),
    ],
    "torch.distributed.checkpoint.default_planner": [("_validate_global_plan", _plans_of_ranks_run),
                                                     ("dedup_save_plans", _peers_plans)],
}


class _Patches:
    """The wrapped functions: on modules now, on modules imported while the emulator runs, and on
    every module's own reference to them (`from safetensors.torch import save_file`)."""

    def __init__(self) -> None:
        self.real: Dict[int, Any] = {}  # id(original) -> wrapper
        self.originals: Dict[int, Any] = {}  # id(wrapper) -> original
        self.keep: List[Any] = []
        self.on_classes: List[Tuple[Any, str, Any]] = []  # (class, attribute, its own value)

    def patch(self, name: str, module: Any) -> None:
        for dotted, factory in WRAPPERS.get(name, ()):
            *owners, attribute = dotted.split(".")
            holder = module
            for owner in owners:
                holder = getattr(holder, owner, None)
            if holder is None:
                continue
            real = vars(holder).get(attribute) if owners else getattr(holder, attribute, None)
            if real is None or id(real) in self.originals:
                continue
            wrapper = self.real.get(id(real))
            if wrapper is None:
                wrapper = factory(real)
                wrapper.__wrapped__ = real
                wrapper.__name__ = getattr(real, "__name__", attribute)
                wrapper.__doc__ = getattr(real, "__doc__", None)
                self.real[id(real)] = wrapper
                self.originals[id(wrapper)] = real
                self.keep += [real, wrapper]
            if owners:
                self.on_classes.append((holder, attribute, real))
            setattr(holder, attribute, wrapper)

    def restore(self) -> None:
        """Put every wrapped function back, on the modules that hold it and on the classes."""
        self.rebind(self.originals)
        for owner, attribute, value in reversed(self.on_classes):
            setattr(owner, attribute, value)

    def rebind(self, table: Dict[int, Any]) -> None:
        """Every loaded module's globals that hold a key of `table` (by identity) take its value."""
        for module in list(sys.modules.values()):
            names = getattr(module, "__dict__", None)
            if not isinstance(names, dict):
                continue
            for attribute, value in list(names.items()):
                if callable(value) and id(value) in table and table[id(value)] is not value:
                    names[attribute] = table[id(value)]


class _Finder(importlib.abc.MetaPathFinder):
    """Patches a module of WRAPPERS as soon as it is imported, before any importer binds its names."""

    def __init__(self, patches: _Patches) -> None:
        self.patches = patches
        self.busy: Set[str] = set()

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in WRAPPERS or name in self.busy:
            return None
        self.busy.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy.discard(name)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, self.patches, name)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patches: _Patches, name: str) -> None:
        self.loader, self.patches, self.name = loader, patches, name

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.patches.patch(self.name, module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package: the module's own loader's
        return getattr(self.loader, name)


@contextlib.contextmanager
def guarded(emulator: Emulator) -> Iterator[Files]:
    """The run's files in its overlay, and its saves and loads as above, while the emulator runs;
    everything is put back on exit."""
    global _active
    with overlay_calls.overlaid() as overlay:
        files = Files(emulator, overlay)
        patches = _Patches()
        for name in WRAPPERS:
            module = sys.modules.get(name)
            if module is not None:
                patches.patch(name, module)
        # torch.save and torch.load are torch.serialization's, bound on torch when it was imported
        patches.rebind(patches.real)
        finder = _Finder(patches)
        sys.meta_path.insert(0, finder)
        rng = _cuda_random_names()
        previous, _active = _active, files
        emulator.reports += [files.unsaid, lambda: overlay_calls.note(overlay.changes())]
        try:
            yield files
        finally:
            _active = previous
            rng()
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(finder)
            patches.restore()


def _cuda_random_names() -> Callable[[], None]:
    """torch.cuda.random's own names (the Trainer's get_rng_state_all) answer as torch.cuda's emulated
    ones; the returned function puts them back."""
    import torch.cuda.random as cuda_random

    names = ("get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all")
    saved = [(name, getattr(cuda_random, name)) for name in names if hasattr(cuda_random, name)]
    for name, _ in saved:
        if hasattr(torch.cuda, name):
            setattr(cuda_random, name, getattr(torch.cuda, name))

    def restore() -> None:
        for name, real in saved:
            setattr(cuda_random, name, real)
    return restore
