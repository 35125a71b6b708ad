"""A script's own binary writes under emulation: what holds data read back from the emulated GPU
never reaches the user's files.

files.py stops the saves it knows (torch.save, safetensors, numpy.save). Scripts also write raw
bytes themselves: llm.c exports its weights for its C code with `f.write(t.cpu().numpy().tobytes())`
after a header of its own, and an image of generated samples is a PIL `save` of a read-back tensor
(torchvision's `save_image`, dcgan). Under emulation those bytes are the emulator's stand-ins
(zeros), and written they replace the user's real `gpt2_124M.bin` or samples with nothing. So:

- the bytes are known by where they come from, never by their values: host memory read back from
  the device is marked by address (files.py), a buffer written from it (`f.write(arr)`,
  `memoryview`) is found by its address, and a copy numpy makes of it (`ndarray.tobytes`, which
  loses the address) comes back as `MadeUpBytes`, a `bytes` that says where it came from; its
  copies by `astype`, `copy` and `flatten` are marked as it is. `ndarray.tofile` of it writes
  nothing.
- a file the script opens for binary writing (`open(path, "wb")`) is written into a temporary
  file beside it, and put in place when it is closed (`os.replace`, keeping the mode of the file
  it replaces) only if nothing written into it held read-back data and no skipped save targeted
  it. Otherwise the path is left as it was: an existing file keeps its bytes, a new one is not
  made, and memdiff says so once with the bytes the real run writes there. The read-back bytes
  are left as holes in the temporary file, which opening the path for reading gives back for the
  rest of the run (a script that reads back its header reads it), and which is removed when the
  emulator stops.
- a PIL image made from read-back data (`Image.fromarray`, `frombuffer`, `frombytes`, and every
  image made from one: `convert`, `resize`, `crop`) is not saved to a path or to a file the
  script opened; into an in-memory buffer (a logger's) it is.
- `pickle.dump` of an object holding read-back data or emulated tensors into such a file keeps
  the file from being put in place.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import os
import shutil
import tempfile
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Optional, Tuple

from memdiff.units import format_bytes

if TYPE_CHECKING:
    from memdiff.recording.emulate.files import Files

_files: Optional["Files"] = None  # the running emulator's guard, while one runs
# PIL images made from read-back data, by id (an Image compares by its pixels, so it is no set member)
_images: Dict[int, "weakref.ref[Any]"] = {}
_UMASK = os.umask(0o022)  # the process's umask, read (os.umask sets it) and put back
os.umask(_UMASK)
# What a note calls the writes of a file the script opened itself.
CALL = "the script's binary writes"


class MadeUpBytes(bytes):
    """Bytes copied from host memory that held data read back from the emulated GPU."""


def made_up(data: Any) -> bool:
    """Whether buffer `data` holds, or was copied from, data read back from the emulated GPU."""
    files = _files
    if files is None:
        return False
    if isinstance(data, MadeUpBytes):
        return True
    if type(data) in (bytes, bytearray, str) or not files.marked():
        return False
    address = _address(data)
    return address is not None and files.holds(address)


def _address(data: Any) -> Optional[int]:
    """Where buffer `data` starts in memory; None for an object that is not a buffer."""
    interface = getattr(data, "__array_interface__", None)
    if isinstance(interface, dict):
        return int(interface["data"][0])
    try:
        import numpy as np

        return int(np.asarray(memoryview(data)).__array_interface__["data"][0])
    except Exception:  # not a buffer (or no numpy): nothing copied from the host's marked memory
        return None


def _mark_image(image: Any) -> None:
    key = id(image)
    _images[key] = weakref.ref(image, lambda _: _images.pop(key, None))


def _is_made_up_image(image: Any) -> bool:
    ref = _images.get(id(image))
    return ref is not None and ref() is image


def _nbytes(data: Any) -> int:
    return int(data.nbytes) if hasattr(data, "nbytes") else memoryview(data).nbytes


# -- files the script opens for binary writing ---------------------------------------------------

class Staged:
    """A file the script opened for binary writing, written into a temporary file beside it and put
    in place at close, when nothing it holds came from the emulated GPU."""

    def __init__(self, opened: Any, temp: str, where: Tuple[str, str], name: Any, mode: str, files: "Files") -> None:
        self._file, self._temp = opened, temp
        self._path, self._target = where  # as the script named it (absolute), and through links
        self.name, self.mode = name, mode
        self._files = files
        self._made_up = 0  # bytes of read-back data written (left as holes)
        self._skipped = False  # a save or pickle of data-less tensors targeted it
        self._end = 0  # the furthest byte written: the size the real run's file has
        self._placed = False

    @property
    def named(self) -> str:
        """The path as the script named it."""
        return os.fsdecode(self.name)

    def write(self, data: Any) -> int:
        """Write `data`, or leave its bytes as a hole when it holds read-back data."""
        if made_up(data):
            size = _nbytes(data)
            self._made_up += size
            self._file.seek(size, io.SEEK_CUR)
            self._end = max(self._end, self._file.tell())
            return size
        written = int(self._file.write(data))
        self._end = max(self._end, self._file.tell())
        return written

    def writelines(self, lines: Any) -> None:
        """Write each of `lines`."""
        for line in lines:
            self.write(line)

    def hole(self, size: int) -> None:
        """`size` bytes of read-back data written past the buffer (`ndarray.tofile`): a hole."""
        self._made_up += size
        self._file.seek(size, io.SEEK_CUR)
        self._end = max(self._end, self._file.tell())

    def skip(self) -> None:
        """A save or pickle of data-less tensors was aimed at this file: it is not put in place."""
        self._skipped = True

    @property
    def clean(self) -> bool:
        """Whether everything written into it is what the real run writes."""
        return not self._made_up and not self._skipped and self not in self._files.left_empty

    def close(self) -> None:
        """Close the file; put it in place if clean, else leave the path as it was and say so."""
        if self._file.closed:
            return
        if self._made_up:
            self._file.seek(0, io.SEEK_END)
            if self._file.tell() < self._end:  # a hole at the end is no bytes until the size says so
                self._file.truncate(self._end)
        self._file.close()
        self.settle()

    def settle(self) -> None:
        """Put a clean file in place now (the file object goes on writing there), or keep it aside."""
        if self._placed:
            return
        self._placed = True
        if self.clean:
            # open(path, "wb") keeps the mode of the file it empties, and makes a new one as umask says
            # (mkstemp made the temporary file readable by its owner alone)
            with contextlib.suppress(OSError):
                if os.path.exists(self._target):
                    shutil.copymode(self._target, self._temp)
                else:
                    os.chmod(self._temp, 0o666 & ~_UMASK)
            os.replace(self._temp, self._target)
            self._files.aside.pop(self._path, None)  # written now: what was kept aside is old
            self._files.unwritten.discard(self._path)
            return
        files = self._files
        files.unwritten.add(self._path)
        files.temporaries.add(self._temp)
        if self._made_up:  # what a skipped save left out it said itself
            files.aside[self._path] = self._temp
            files.skipped_read_back(CALL, (self.named, os.path.exists(self._target)),
                                    what=f"a file of {format_bytes(self._end)}, {self._end:,} bytes")

    def __enter__(self) -> "Staged":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._file)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __getattr__(self, name: str) -> Any:  # seek, tell, read, flush, fileno, closed: the file's own
        if "_file" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["_file"], name)


class _EmptiedAtFirstWrite:
    """A binary file the script opened for writing over an existing file where no temporary file can
    be made beside it (a directory it cannot write): emptied at its first write instead of by open(),
    so a skipped save into it leaves the user's file as it was."""

    def __init__(self, opened: Any) -> None:
        self._file, self._emptied = opened, False

    def _empty(self) -> None:
        if not self._emptied:
            self._emptied = True
            self._file.truncate(0)

    def write(self, data: Any) -> int:
        """Empty the file (once), then write as the file does."""
        self._empty()
        return int(self._file.write(data))

    def writelines(self, lines: Any) -> None:
        """Empty the file (once), then write the lines."""
        self._empty()
        self._file.writelines(lines)

    def truncate(self, size: Any = None) -> int:
        """The script's own truncate: the file is as it asks from here on."""
        self._emptied = True
        return int(self._file.truncate(size))

    def __enter__(self) -> "_EmptiedAtFirstWrite":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._file.close()

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._file)

    def __getattr__(self, name: str) -> Any:  # name, mode, seek, tell, flush, close, fileno: the file's own
        return getattr(self._file, name)


def _opener(real: Callable[..., Any], files: "Files", opened: "weakref.WeakSet[Staged]") -> Callable[..., Any]:
    def opening(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if not isinstance(file, (str, os.PathLike)) or not isinstance(mode, str) or "b" not in mode:
            return real(file, mode, *args, **kwargs)
        path = os.path.abspath(os.fsdecode(file))
        if not any(c in mode for c in "wx+a"):
            aside = files.aside.get(path)  # what the script wrote there and memdiff did not put in place
            return real(file if aside is None else aside, mode, *args, **kwargs)
        exists = os.path.exists(path)
        if ("w" not in mode and "x" not in mode) or (exists and ("x" in mode or not os.path.isfile(path))):
            # appending, updating, open()'s own error, or no regular file (/dev/null, a pipe): a
            # temporary file moved over one would replace the device itself
            return real(file, mode, *args, **kwargs)
        target = os.path.realpath(path)  # through a link, as open() writes
        try:
            descriptor, temp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".memdiff",
                                                dir=os.path.dirname(target))
        except OSError:
            if os.path.isfile(path):
                return _EmptiedAtFirstWrite(real(file, mode.replace("w", "r+").replace("++", "+"), *args, **kwargs))
            return real(file, mode, *args, **kwargs)
        os.close(descriptor)
        try:
            inner = real(temp, mode.replace("x", "w"), *args, **kwargs)
        except BaseException:  # open()'s own refusal (a text encoding with "wb"): no temporary file stays
            os.remove(temp)
            raise
        staged = Staged(inner, temp, (path, target), file, mode, files)
        opened.add(staged)
        files.writing[path] = staged
        return staged
    opening.__doc__ = real.__doc__
    return opening


# -- numpy's copies and writes of host memory ----------------------------------------------------

def _set_on_type(cls: Any, name: str, value: Any) -> None:
    """Set `cls.name` on a type defined in C (numpy's ndarray), which refuses setattr: through the
    type's own dict, then telling the interpreter the type changed so no cached lookup is kept."""
    gc.get_referents(cls.__dict__)[0][name] = value
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(cls))


def _tobytes(real: Callable[..., Any]) -> Callable[..., Any]:
    def tobytes(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(self, *args, **kwargs)
        # bytes' own constructor copies them into the subclass: for a moment the array's bytes are
        # held twice (llm.c's padded embedding, 154 MB, adds that to the run's peak host memory)
        return MadeUpBytes(out) if made_up(self) else out
    tobytes.__doc__ = real.__doc__
    return tobytes


def _tofile(real: Callable[..., Any]) -> Callable[..., Any]:
    def tofile(self: Any, fid: Any, *args: Any, **kwargs: Any) -> Any:
        files = _files
        if files is None or not made_up(self):
            return real(self, fid, *args, **kwargs)
        if isinstance(fid, Staged):
            return fid.hole(int(self.nbytes))
        files.skipped_read_back("numpy tofile", fid, nbytes=int(self.nbytes))
        return None
    tofile.__doc__ = real.__doc__
    return tofile


def _copying(real: Callable[..., Any]) -> Callable[..., Any]:
    """ndarray.astype / copy / flatten: a copy of read-back data is read-back data too (llm.c-style
    `.numpy().astype(np.float16).tobytes()`)."""
    def copy(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(self, *args, **kwargs)
        files = _files
        if files is not None and out is not self and made_up(self) and not made_up(out):
            files.mark_memory(out, int(out.__array_interface__["data"][0]), int(out.nbytes))
        return out
    copy.__doc__ = real.__doc__
    return copy


@contextlib.contextmanager
def _numpy() -> Iterator[None]:
    try:
        import numpy as np
    except ImportError:
        yield
        return
    copies = ("astype", "copy", "flatten")
    saved = {name: np.ndarray.__dict__[name] for name in ("tobytes", "tofile", *copies)}
    _set_on_type(np.ndarray, "tobytes", _tobytes(saved["tobytes"]))
    _set_on_type(np.ndarray, "tofile", _tofile(saved["tofile"]))
    for name in copies:
        _set_on_type(np.ndarray, name, _copying(saved[name]))
    try:
        yield
    finally:
        for name, value in saved.items():
            _set_on_type(np.ndarray, name, value)


# -- PIL and pickle (wrapped when imported, by files.WRAPPERS) -----------------------------------

def pil_from(real: Callable[..., Any]) -> Callable[..., Any]:
    """Image.frombuffer / frombytes: an image of read-back data is marked."""
    def make(mode: Any, size: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        image = real(mode, size, data, *args, **kwargs)
        if made_up(data):
            _mark_image(image)
        return image
    return make


def pil_new(real: Callable[..., Any]) -> Callable[..., Any]:
    """Image._new, which every image made from another goes through: a made-up image's are too."""
    def new(self: Any, im: Any) -> Any:
        image = real(self, im)
        if _is_made_up_image(self):
            _mark_image(image)
        return image
    return new


def pil_save(real: Callable[..., Any]) -> Callable[..., Any]:
    """Image.save: an image of read-back data is not written to a path or a file the script opened."""
    def save(self: Any, fp: Any, *args: Any, **kwargs: Any) -> Any:
        files = _files
        if files is None or not _is_made_up_image(self) or not isinstance(fp, (str, os.PathLike, Staged)):
            return real(self, fp, *args, **kwargs)
        pixels = self.width * self.height * len(self.getbands())
        if isinstance(fp, Staged):
            fp.skip()
        files.skipped_read_back("PIL Image.save", fp, what=f"a {self.width}x{self.height} {self.mode} image, "
                                f"{pixels:,} bytes of pixels before encoding")
        return None
    return save


def pickle_dump(real: Callable[..., Any]) -> Callable[..., Any]:
    """pickle.dump into a file the script opened: one holding data-less tensors is not put in place."""
    def dump(obj: Any, file: Any, *args: Any, **kwargs: Any) -> Any:
        files = _files
        if files is not None and isinstance(file, Staged):
            payload = files.scan(obj, whole_storages=False)
            if payload.dataless:
                file.skip()
                files.skipped("pickle.dump", files.target(file), payload)
        return real(obj, file, *args, **kwargs)
    return dump


@contextlib.contextmanager
def guarded(files: "Files") -> Iterator[None]:
    """Binary files the script opens are staged, numpy's copies of read-back data marked; on exit
    open files are settled (a clean one put in place, its object still writing there) and every
    temporary file left aside is removed."""
    import builtins

    global _files
    real = builtins.open
    opened: "weakref.WeakSet[Staged]" = weakref.WeakSet()
    previous, _files = _files, files
    builtins.open = io.open = _opener(real, files, opened)
    try:
        with _numpy():
            yield
    finally:
        builtins.open = io.open = real
        _files = previous
        for staged in list(opened):
            if not staged.closed:
                staged.settle()
        for temp in files.temporaries:
            with contextlib.suppress(OSError):
                os.remove(temp)

