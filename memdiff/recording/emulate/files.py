"""The user's files under emulation: no write of data the emulated GPU never had, loads without reading data.

Emulated tensors are shapes on the meta device, and what a script reads back from the device
(`.cpu()`, `.numpy()`, a host tensor filled from it) is zeros standing in. Written to a file, either
would look like a checkpoint and hold nothing: torch.save once replaced a user's real `ckpt.pt` with
meta tensors, and the Hugging Face Trainer wrote gigabytes of zeros. So while the emulator runs:

- every save (torch.save, safetensors' save_file / save_model / save, numpy's save / savez /
  savez_compressed / savetxt, torch.distributed.checkpoint's save and async_save, Lightning's checkpoint
  writer; transformers' save_pretrained and accelerate's save_state end in these) looks at its
  payload first. One that holds an emulated tensor, or data read back from the device, is not
  written: no file is made or replaced, nothing goes into a file object or buffer, and the call
  returns as if it had written. memdiff says so once per file on stderr and in the snapshot's
  notes, with the bytes of tensor data the real run would write there. A payload of host data
  only (a config, a step count, a CPU tensor that never touched the device) is the user's own
  data, written as the real run writes it.
- storages moved to the device (`torch.load(map_location="cuda")`, a checkpoint saved on a GPU,
  `storage.cuda()`) become allocations on the emulated GPU, one per storage as a GPU makes them,
  without reading their bytes: torch.load maps the file and copies out only what stays on the host.
  safetensors opened onto the device (`load_file`, `safe_open`) reads only the header.
- the script's own binary writes (`f.write(t.cpu().numpy().tobytes())`, PIL images of read-back
  pixels) are writes.py's.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
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

from memdiff.recording.emulate import swap, writes
from memdiff.recording.emulate.devices import names_cuda
from memdiff.recording.emulate.runtime import Emulator, python_frames
from memdiff.recording.emulate.tensorfiles import OnDevice
from memdiff.units import format_bytes

_active: Optional["Files"] = None  # the running emulator's, while one runs
# Files named one by one in the notes (two of the Trainer's checkpoints); a script that saves
# every few steps would name hundreds.
SAID = 6


def from_device(tensor: Any) -> None:
    """Mark a host tensor as holding data read back from the emulated device (stand-in values)."""
    if _active is not None and isinstance(tensor, torch.Tensor):
        _active.mark(tensor)


def follow(args: Any, kwargs: Any, out: Any) -> None:
    """After a torch op: what it made on the host from read-back data is read-back data too
    (`.cpu().float()`, a `torch.cat` of read-back predictions)."""
    if _active is not None and _active.marked():
        _active.follow(args, kwargs, out)


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


class _Payload:
    """What a save would write: whether it holds data the device never had, and the tensors' bytes."""

    def __init__(self) -> None:
        self.skeleton: Optional[bytes] = None  # the object pickled with its tensors as shapes only
        self.emulated = False  # an emulated (meta) tensor
        self.read_back = False  # host data read back from the device
        self.nbytes = 0
        self._seen: Set[Any] = set()
        self._keep: List[Any] = []  # holds what was counted, so no id is reused during the scan

    @property
    def dataless(self) -> bool:
        """Whether writing this would put data the real run has and this one does not into a file."""
        return self.emulated or self.read_back


class Files:
    """The emulator's guard over files: which host memory holds read-back data, and the saves it skipped."""

    def __init__(self, emulator: Emulator) -> None:
        self.emulator = emulator
        self._starts: List[int] = []  # host ranges holding read-back data: sorted starts
        self._ends: Dict[int, int] = {}
        self.left_empty: "weakref.WeakSet[Any]" = weakref.WeakSet()  # file objects a skipped save did not fill
        self.targets: Set[str] = set()  # the files skipped saves named, each said once
        # Paths a skipped save would have written (absolute): moving, copying or removing one is the
        # real run's own file moving, not the user's (_moves).
        self.unwritten: Set[str] = set()
        # What each skipped torch.save held, by the path it named, as a skeleton with shapes and no
        # data: a load of that path in the same run gives it back, as a GPU run loads what it saved.
        self.saved: Dict[str, bytes] = {}
        # Files the script wrote itself holding read-back data (writes.py), by the path they name: the
        # temporary file that holds what it wrote, which reading the path gives back in this run.
        self.aside: Dict[str, str] = {}
        self.temporaries: Set[str] = set()  # every such temporary file, removed when the emulator stops
        self.writing: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()  # open ones, by path
        # Folders the script made in this run (absolute, in the order made), and every folder a
        # skipped save's path lies in: one left empty only because its saves were skipped is
        # removed when the emulator stops (_folders).
        self.made: List[str] = []
        self.around_unwritten: Set[str] = set()

    # -- host memory read back from the device --------------------------------------------------

    def mark(self, tensor: torch.Tensor) -> None:
        """Remember the host storage of `tensor` as read-back data until torch frees it."""
        with torch._C.DisableTorchFunction():
            if tensor.device.type != "cpu":
                return
            storage = tensor.untyped_storage()
            start, size = storage.data_ptr(), storage.nbytes()
        self.mark_memory(storage, start, size)

    def mark_memory(self, owner: Any, start: int, size: int) -> None:
        """Remember `size` bytes at `start`, which `owner` holds, as read-back data until it is freed."""
        if not size or start in self._ends:
            return
        bisect.insort(self._starts, start)
        self._ends[start] = start + size
        weakref.finalize(owner, self._forget, start)

    def marked(self) -> bool:
        """Whether any host memory now holds read-back data."""
        return bool(self._starts)

    def follow(self, args: Any, kwargs: Any, out: Any) -> None:
        """Mark the host outputs of an op that read read-back data. Runs after every op while any
        read-back data lives (checkpointing keeps an rng state through the backward): tensors and
        lists of them one level deep are all an op's inputs and outputs hold."""
        if any(self._is_read_back(t) for t in _tensors(args)) or \
                any(self._is_read_back(t) for t in _tensors(kwargs.values())):
            for t in _tensors(out if isinstance(out, (list, tuple)) else (out,)):
                if t.device.type == "cpu":
                    self.mark(t)

    def _is_read_back(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and bool(t.numel()) and self._read_back(t.untyped_storage().data_ptr())

    def holds(self, address: int) -> bool:
        """Whether host memory at `address` holds data read back from the device."""
        return self._read_back(address)

    def _forget(self, start: int) -> None:
        if self._ends.pop(start, None) is not None:
            self._starts.remove(start)

    def _read_back(self, address: int) -> bool:
        i = bisect.bisect_right(self._starts, address) - 1
        return i >= 0 and address < self._ends[self._starts[i]]

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
                elif type(value).__module__ == "numpy" and type(value).__name__ in ("ndarray", "memmap"):
                    files._array(value, payload)
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
        elif type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray":
            self._array(obj, payload)
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
        elif t.device.type == "cpu" and t.numel() and self._read_back(storage.data_ptr()):
            payload.read_back = True
        key: Any = id(storage) if whole else (id(storage), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in payload._seen:
            payload._seen.add(key)
            payload.nbytes += storage.nbytes() if whole else t.numel() * t.element_size()

    def _storage(self, s: Any, payload: _Payload) -> None:
        untyped = s._untyped_storage if isinstance(s, torch.TypedStorage) else s
        payload._keep.append(untyped)
        if untyped.device.type == "meta":
            payload.emulated = True
        elif untyped.device.type == "cpu" and untyped.nbytes() and self._read_back(untyped.data_ptr()):
            payload.read_back = True
        if id(untyped) not in payload._seen:
            payload._seen.add(id(untyped))
            payload.nbytes += untyped.nbytes()

    def _array(self, a: Any, payload: _Payload) -> None:
        address = a.__array_interface__["data"][0]
        if a.size and self._read_back(address):
            payload.read_back = True
        key = (address, a.shape, a.dtype.str)
        if key not in payload._seen:
            payload._seen.add(key)
            payload.nbytes += int(a.nbytes)

    def skipped_read_back(self, call: str, target: Any, nbytes: int = 0, what: Optional[str] = None) -> None:
        """A write of host data read back from the device (writes.py) left out: said as a skipped save.
        `target`: the path or file it named, or (how it reads, whether it existed) already worked out."""
        payload = _Payload()
        payload.read_back, payload.nbytes = True, nbytes
        self.skipped(call, target if isinstance(target, tuple) else _target(target), payload, what)

    def target(self, f: Any) -> Tuple[str, Optional[bool]]:
        """How the file `f` (a path or a file object) reads in a note, and whether it existed."""
        return _target(f)

    def skipped(self, call: str, where: Tuple[str, Optional[bool]], payload: _Payload,
                written: Optional[str] = None) -> None:
        """Say once per file that a save was not written, and what the real run writes there. `where`:
        the target as a note names it, and whether that file existed (None: not a path); `written`:
        what the real run writes, where it is not the payload's bytes of tensor data."""
        target, existed = where
        if existed is not None:
            full = os.path.abspath(target)
            self.unwritten.add(full)
            folder = os.path.dirname(full)
            while folder not in self.around_unwritten and folder != os.path.dirname(folder):
                self.around_unwritten.add(folder)
                folder = os.path.dirname(folder)
        if target in self.targets:
            return
        self.targets.add(target)
        if len(self.targets) > SAID:
            if len(self.targets) == SAID + 1:
                self.emulator.note(f"{call} to {target} and every later save of emulated data not written either; "
                                   f"memdiff names only the first {SAID} files")
            return
        what = "tensors on the emulated GPU, which have no data" if payload.emulated else \
            "data read back from the emulated GPU, which has no values to give"
        state = "nothing was written into it" if existed is None else \
            f"{target} is unchanged" if existed else "no file was made"
        if written is None:
            written = f"{format_bytes(payload.nbytes)}, {payload.nbytes:,} bytes of tensor data"
        self.emulator.note(f"{call} to {target} not written: it holds {what} (a real run writes {written}); {state}")

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


class _Discard(io.RawIOBase):
    """Where the scan's pickling goes: nowhere."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return len(data)


# -- the target of a save -----------------------------------------------------------------------

def _target(f: Any, suffix: str = "") -> Tuple[str, Optional[bool]]:
    """How a save's target reads in a note, and whether that file existed (None: not a path)."""
    if isinstance(f, (str, os.PathLike)):
        path = os.fspath(f)
        if isinstance(path, bytes):
            path = path.decode(errors="replace")
        if suffix and not path.endswith(suffix):
            path += suffix
        return path, os.path.exists(path)
    if isinstance(f, writes.Staged):  # a file the script opened to write: it stays as it was
        return f.named, os.path.exists(f.named)
    name = getattr(f, "name", None)
    if isinstance(name, str):
        return f"the open file {name}", None
    return f"an in-memory {type(f).__name__}", None


# -- the wrappers ---------------------------------------------------------------------------------

def _path_of(f: Any) -> Optional[str]:
    """The absolute path a save or load names, itself or through an open file's name; None for a buffer."""
    name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
    if isinstance(name, (str, os.PathLike)):
        return os.path.abspath(os.fsdecode(name))
    return None


def _empty_like_saved(shape: Tuple[int, ...], dtype: Any, requires_grad: bool, parameter: bool,
                      on_device: bool) -> torch.Tensor:
    """A tensor of a skipped save, loaded back: on the emulated GPU where it was there, else the host."""
    t = torch.empty(shape, dtype=dtype, device="cuda") if on_device else torch.zeros(shape, dtype=dtype)
    return torch.nn.Parameter(t, requires_grad=requires_grad) if parameter else t.requires_grad_(requires_grad)


def _torch_save(real: Callable[..., Any]) -> Callable[..., Any]:
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        files = _active
        if files is None:
            return real(obj, f, *args, **kwargs)
        payload = files.scan(obj, whole_storages=True)
        if not payload.dataless:
            return real(obj, f, *args, **kwargs)
        files.skipped("torch.save", _target(f), payload)
        path = _path_of(f)
        if path is not None and payload.skeleton is not None:
            files.saved[path] = payload.skeleton
        if not isinstance(f, (str, os.PathLike)):
            with contextlib.suppress(TypeError):  # not every file object takes a weak reference
                files.left_empty.add(f)
        return None
    return save


def _torch_load(real: Callable[..., Any]) -> Callable[..., Any]:
    def load(f: Any, map_location: Any = None, pickle_module: Any = None, *, weights_only: Any = None,
             mmap: Any = None, **kwargs: Any) -> Any:
        call = dict(pickle_module=pickle_module, weights_only=weights_only, **kwargs)
        path = _path_of(f)
        if _active is not None and path is not None and path in _active.saved:
            # What this run saved there and memdiff did not write: its tensors made anew on the
            # emulated GPU (a load to the device allocates them), with their shapes and no data.
            return pickle.loads(_active.saved[path])  # noqa: S301 (our own bytes, made from the script's save)
        if _active is not None and not isinstance(f, (str, os.PathLike)) and f in _active.left_empty:
            # torch.load's own error for it is a bare EOFError
            raise EOFError("memdiff: emulation: torch.load of a file object that torch.save did not fill: what "
                           "was saved into it were tensors on the emulated GPU, which have no data")
        if _active is None or _is_meta(map_location) or not _is_zip(f):
            return real(f, map_location, mmap=mmap, **call)
        # Map a path's file rather than read it: storages bound for the device are never read, and
        # those that stay on the host are copied out of the mapping (below), as a plain load gives them.
        mapped = mmap is None and isinstance(f, (str, os.PathLike))
        restore = torch.serialization._get_restore_location(map_location)

        def place(storage: Any, location: str) -> Any:
            out = restore(storage, location)
            if mapped and out.device.type == "cpu" and out.nbytes() and out.data_ptr() == storage.data_ptr():
                own = torch.UntypedStorage(out.nbytes())
                own.copy_(out)
                return own
            return out
        return real(f, place, mmap=True if mapped else mmap, **call)
    return load


def _is_meta(location: Any) -> bool:
    return (isinstance(location, str) and location == "meta") or \
        (isinstance(location, torch.device) and location.type == "meta")


def _is_zip(f: Any) -> bool:
    """Whether torch.load would read `f` as a zip archive of torch.save's (its format since 1.6),
    not a TorchScript archive (which it hands to torch.jit.load)."""
    if not isinstance(f, (str, os.PathLike)):
        return False
    try:
        with open(f, "rb") as opened:
            if opened.read(4) != b"PK\x03\x04":
                return False
        with zipfile.ZipFile(f) as archive:
            return not any(name.endswith("/constants.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False  # torch.load says why, in its own words


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
        if _active is None or not names_cuda(device):
            return real(filename, framework, device, *args, **kwargs)
        return OnDevice(real(filename, framework, "cpu", *args, **kwargs))
    return safe_open


def _saver(call: str, payload_of: Callable[..., Any], target_of: Callable[..., Any],
           whole: bool = False, returns: Callable[[], Any] = lambda: None) -> Callable[..., Callable[..., Any]]:
    """A wrapper factory for a save: `payload_of(*args, **kwargs)` is what it writes, `target_of` where."""
    def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
        def save(*args: Any, **kwargs: Any) -> Any:
            files = _active
            if files is None:
                return real(*args, **kwargs)
            payload = files.scan(payload_of(*args, **kwargs), whole_storages=whole)
            if not payload.dataless:
                return real(*args, **kwargs)
            files.skipped(call, target_of(*args, **kwargs), payload)
            for value in (*args, *kwargs.values()):
                if isinstance(value, writes.Staged):  # numpy.save(f, ...) into a file the script opened
                    value.skip()
            return returns()
        return save
    return wrap


def _arg(index: int, name: str) -> Callable[..., Any]:
    return lambda *args, **kwargs: args[index] if len(args) > index else kwargs.get(name)


def _numpy_target(suffix: str) -> Callable[..., Any]:
    return lambda *args, **kwargs: _target(args[0] if args else kwargs.get("file"), suffix)


def _done_future() -> Any:
    future: Any = concurrent.futures.Future()
    future.set_result(None)
    return future


def _dcp_target(*args: Any, **kwargs: Any) -> Tuple[str, Optional[bool]]:
    where = kwargs.get("checkpoint_id")
    if where is None:
        where = getattr(kwargs.get("storage_writer"), "path", None)
    return (_target(where) if where is not None else ("the storage writer's checkpoint", None))


# module -> [(attribute, wrapper factory)]: patched when the emulator starts, or when the module is
# imported later, and put back when it stops (with every module's reference to them).
WRAPPERS: Dict[str, List[Tuple[str, Callable[..., Any]]]] = {
    "torch.serialization": [("save", _torch_save), ("load", _torch_load)],
    "torch._utils": [("_to", _storage_to)],
    "numpy": [
        ("save", _saver("numpy.save", _arg(1, "arr"), _numpy_target(".npy"))),
        ("savez", _saver("numpy.savez", lambda *a, **k: (a[1:], k), _numpy_target(".npz"))),
        ("savez_compressed", _saver("numpy.savez_compressed", lambda *a, **k: (a[1:], k), _numpy_target(".npz"))),
        ("savetxt", _saver("numpy.savetxt", _arg(1, "X"), _numpy_target(""))),
    ],
    "safetensors": [("safe_open", _safe_open)],
    "safetensors.torch": [
        ("save_file", _saver("safetensors save_file", _arg(0, "tensors"),
                             lambda *a, **k: _target(a[1] if len(a) > 1 else k.get("filename")))),
        # bytes for the script to keep or write: empty, so nothing it writes from them looks like weights
        ("save", _saver("safetensors save", _arg(0, "tensors"), lambda *a, **k: ("the bytes it returns", None),
                        returns=lambda: b"")),
    ],
    "torch.distributed.checkpoint.state_dict_saver": [
        ("save", _saver("torch.distributed.checkpoint.save", _arg(0, "state_dict"), _dcp_target)),
        ("async_save", _saver("torch.distributed.checkpoint.async_save", _arg(0, "state_dict"), _dcp_target,
                              returns=_done_future)),
    ],
}
# A script's own writes (writes.py): images of read-back data, and pickles into the files it opened.
# A dotted attribute is a class's, put back by the patches' own record.
WRAPPERS["PIL.Image"] = [("frombuffer", writes.pil_from), ("frombytes", writes.pil_from),
                         ("Image._new", writes.pil_new), ("Image.save", writes.pil_save)]
WRAPPERS["pickle"] = [("dump", writes.pickle_dump)]
for _package in ("lightning.fabric", "lightning_fabric"):
    WRAPPERS[f"{_package}.utilities.cloud_io"] = [
        ("_atomic_save", _saver("Lightning's checkpoint save", _arg(0, "checkpoint"),
                                lambda *a, **k: _target(a[1] if len(a) > 1 else k.get("filepath")), whole=True))]


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
def _moves(files: Files) -> Iterator[None]:
    """os.replace, os.rename, shutil.move, shutil.copyfile, os.link, os.remove of a file a skipped save
    would have written: the move or copy names its destination as unwritten too and leaves whatever
    is there alone, a removal forgets it (a file the user had at that path stays). Savers write to a
    temporary name and rename it into place (timm's, atomic saves), or delete old checkpoints: the
    real run moves and deletes its own files, never the user's."""
    import shutil

    def unwritten(path: Any) -> Optional[str]:
        if not isinstance(path, (str, os.PathLike)):
            return None
        full = os.path.abspath(os.fsdecode(path))
        writing = files.writing.get(full)
        if writing is not None:  # still open (write, flush, rename, close): settled where it stands now
            writing.flush()
            writing.settle()
        return full if full in files.unwritten else None

    def moving(real: Callable[..., Any], keep_source: bool) -> Callable[..., Any]:
        def move(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            source = unwritten(src)
            if source is None:
                return real(src, dst, *args, **kwargs)
            if not keep_source:
                files.unwritten.discard(source)
            target = os.fsdecode(dst)
            if os.path.isdir(target):
                target = os.path.join(target, os.path.basename(source))
            target = os.path.abspath(target)
            files.unwritten.add(target)
            aside = files.aside.get(source) if keep_source else files.aside.pop(source, None)
            if aside is not None:
                files.aside[target] = aside
            return dst
        return move

    def removing(real: Callable[..., Any]) -> Callable[..., Any]:
        def remove(path: Any, *args: Any, **kwargs: Any) -> None:
            found = unwritten(path)
            if found is None:
                return real(path, *args, **kwargs)
            files.unwritten.discard(found)
            files.aside.pop(found, None)
        return remove
    wrapped = [(os, "replace", moving(os.replace, False)), (os, "rename", moving(os.rename, False)),
               (os, "link", moving(os.link, True)), (shutil, "move", moving(shutil.move, False)),
               (shutil, "copyfile", moving(shutil.copyfile, True)), (shutil, "copy", moving(shutil.copy, True)),
               (shutil, "copy2", moving(shutil.copy2, True)), (os, "remove", removing(os.remove)),
               (os, "unlink", removing(os.unlink))]
    with swap.replaced(wrapped):
        yield


@contextlib.contextmanager
def _folders(files: Files) -> Iterator[None]:
    """Folders made for checkpoints that were not written: removed when the emulator stops if they
    are empty. A script makes `checkpoints/<time>/` and saves into it; left there empty, the next
    run took it for its latest checkpoint and failed to load a file that was never written (the
    FSDP2 example's second run). A folder the user had, or one holding anything, stays. A launched
    rank's emulator never stops (it runs until the process ends), so this also runs at exit."""
    import atexit

    real = os.mkdir  # os.makedirs and pathlib's mkdir call it
    owner = os.getpid()

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        real(path, *args, **kwargs)
        if isinstance(path, (str, os.PathLike)):
            files.made.append(os.path.abspath(os.fsdecode(path)))

    def tidy() -> None:
        if os.getpid() != owner:  # a forked worker's exit: the folders are the parent's
            return
        for folder in reversed(files.made):
            if folder in files.around_unwritten:
                with contextlib.suppress(OSError):  # not empty, or gone: left as it is
                    os.rmdir(folder)
        files.made.clear()
    os.mkdir = mkdir
    atexit.register(tidy)
    try:
        yield
    finally:
        os.mkdir = real
        tidy()
        atexit.unregister(tidy)


@contextlib.contextmanager
def guarded(emulator: Emulator) -> Iterator[Files]:
    """Guard the user's files while the emulator runs; everything is put back on exit."""
    global _active
    files = Files(emulator)
    patches = _Patches()
    for name in WRAPPERS:
        module = sys.modules.get(name)
        if module is not None:
            patches.patch(name, module)
    # torch.save and torch.load are torch.serialization's, bound on torch when it was imported
    patches.rebind(patches.real)
    finder = _Finder(patches)
    sys.meta_path.insert(0, finder)
    rng = _mark_rng_states()
    previous, _active = _active, files
    try:
        with _folders(files), _moves(files), writes.guarded(files):
            yield files
    finally:
        _active = previous
        rng()
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
        patches.restore()


def _mark_rng_states() -> Callable[[], None]:
    """torch.cuda.get_rng_state(_all) under emulation gives the state of the CPU generator standing
    in for the GPU's, which a real GPU cannot take back: a checkpoint holding it is not written.
    torch.cuda.random's own names (the Trainer's) answer as torch.cuda's emulated ones."""
    import torch.cuda.random as cuda_random

    cuda = torch.cuda
    names = ("get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all")
    saved = [(module, name, getattr(module, name)) for module in (cuda, cuda_random) for name in names
             if hasattr(module, name)]
    emulated = {name: getattr(cuda, name) for name in names if hasattr(cuda, name)}

    def marked(real: Callable[..., Any]) -> Callable[..., Any]:
        def get(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            for state in (out if isinstance(out, (list, tuple)) else [out]):
                from_device(state)
            return out
        return get
    answers = {name: marked(real) if name.startswith("get") else real for name, real in emulated.items()}
    for module, name, _ in saved:
        if name in answers:
            setattr(module, name, answers[name])

    def restore() -> None:
        for module, name, real in saved:
            setattr(module, name, real)
    return restore
