"""The script's file calls routed through the overlay (overlay.py) while the emulator runs.

Every Python file call reaches the file system through a few functions: `open` (builtins and io),
and `os`'s open, stat, lstat, access, listdir, scandir, readlink, mkdir, rmdir, remove, unlink,
rename, replace, link, symlink, truncate, chmod, utime, chown, chdir, getcwd and the extended attributes' calls
(shutil.copy2 copies them). pathlib, shutil, tempfile, glob,
os.walk and os.makedirs call those by their module's name, and libraries (torch's file objects,
numpy, PIL, datasets, logging) call them in turn: replacing them routes them all. What goes around
them is stopped or named:

- `io.FileIO` is routed too, and so is a class that derives from it while the run goes (blobfile's
  local files);
- a call that would still change a path outside the overlay and memdiff's own files (a module that
  bound `posix.open` itself, a FileIO bound before the run, `_io.FileIO`, a `dir_fd` call) is refused
  by an audit hook (PEP 578):
  it raises PermissionError naming memdiff, rather than touching the user's file;
- a program the run starts (`rm`, `cp`, a shell) runs where the watched folders are kernel overlays
  whose writes are taken into this overlay after it (programs.py); where the kernel refuses that,
  and for a writer outside Python in the process (a C library opening the path itself), TreeCheck
  compares the user's tree before and after the run and names what changed.

Python's imports read the disk around these calls: overlay_imports.py gives them the run's view (a
module the run wrote imports). The run's temporary files, compiler caches (Inductor's, Triton's) and
bytecode go to the overlay's scratch folder or nowhere, so that programs the run starts (a C++
compiler) find what it wrote.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import importlib.util
import io
import os
import shutil
import stat
import sys
import tempfile
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

from memdiff import atomic
from memdiff.errors import InputError
from memdiff.recording.emulate import overlay_imports, programs, swap
from memdiff.recording.emulate.overlay import Change, Overlay, full
from memdiff.units import format_bytes

ROOT = "MEMDIFF_OVERLAY"  # the overlay's folder, for every process of the run
OWNED = "MEMDIFF_OVERLAY_OWNED"  # memdiff's own paths, os.pathsep-separated
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_active: Optional[Overlay] = None
_real_open = io.open
_real = {name: getattr(os, name) for name in ("open", "stat", "lstat", "access", "listdir", "scandir", "readlink",
                                              "mkdir", "rmdir", "remove", "unlink", "rename", "replace", "link",
                                              "symlink", "truncate", "chmod", "utime", "chown", "statvfs",
                                              "chdir", "getcwd", "getcwdb")}
# Extended attributes, where the system has them (Linux): shutil.copy2 copies them after the bytes.
_XATTR_READS = tuple(n for n in ("listxattr", "getxattr") if hasattr(os, n))
_XATTR_WRITES = tuple(n for n in ("setxattr", "removexattr") if hasattr(os, n))
_real.update((name, getattr(os, name)) for name in _XATTR_READS + _XATTR_WRITES)


def active() -> Optional[Overlay]:
    """The overlay the running emulator writes to, if any."""
    return _active


def _path_arg(path: Any) -> bool:
    """Whether `path` names a path (not a file descriptor)."""
    return isinstance(path, (str, bytes, os.PathLike))


def _like(path: Any, names: List[str]) -> List[Any]:
    return [os.fsencode(n) for n in names] if isinstance(os.fspath(path), bytes) else names


class _Entry:
    """os.DirEntry for a name the overlay lists: its stat from the layer that holds it."""

    def __init__(self, folder: Any, name: Any, overlay: Overlay) -> None:
        self.name = name
        self.path = os.path.join(os.fspath(folder), name)
        self._overlay = overlay

    def _real(self, follow: bool) -> str:
        real = self._overlay.where(self.path, follow)
        if real is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fsdecode(self.path))
        return real

    def __fspath__(self) -> Any:
        return self.path

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        return _real["lstat"](self._real(follow_symlinks))  # followed by the overlay, through its layers

    def inode(self) -> int:
        return self.stat(follow_symlinks=False).st_ino

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        try:
            return stat.S_ISDIR(self.stat(follow_symlinks=follow_symlinks).st_mode)
        except OSError:
            return False

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        try:
            return stat.S_ISREG(self.stat(follow_symlinks=follow_symlinks).st_mode)
        except OSError:
            return False

    def is_symlink(self) -> bool:
        try:
            return stat.S_ISLNK(self.stat(follow_symlinks=False).st_mode)
        except OSError:
            return False

    def is_junction(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<DirEntry {self.name!r}>"


class _Scan:
    """os.scandir's iterator over a folder the overlay lists."""

    def __init__(self, entries: List[_Entry]) -> None:
        self._entries = iter(entries)

    def __iter__(self) -> "_Scan":
        return self

    def __next__(self) -> _Entry:
        return next(self._entries)

    def __enter__(self) -> "_Scan":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._entries = iter(())


def _mode_writes(mode: str) -> Tuple[bool, bool, bool, bool]:
    """(writes, keeps what is there, may create, must create) for an open() mode."""
    writes = any(c in mode for c in "wax+")
    return writes, "a" in mode or ("+" in mode and "w" not in mode), "r" not in mode, "x" in mode


def _target(overlay: Overlay, file: Any, mode: str) -> Any:
    """The path that opening `file` in `mode` opens: its overlay copy to write, or the layer that
    holds it to read."""
    writes, keep, create, exclusive = _mode_writes(mode)
    if writes:
        return overlay.writable(file, keep=keep, create=create, exclusive=exclusive)
    where = overlay.where(file)
    if where is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fsdecode(file))
    return where


class _FileIOType(abc.ABCMeta):
    """The metaclass of the routed FileIO: every file object is an instance of `io.FileIO`, as before
    (what open() makes is the real class), while a class of the script's own is still only its own."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _REAL_FILE_IO) if cls.__dict__.get("_routed") else super().__instancecheck__(obj)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return issubclass(sub, _REAL_FILE_IO) if cls.__dict__.get("_routed") else super().__subclasscheck__(sub)


_REAL_FILE_IO = io.FileIO


def _file_io(overlay: Overlay) -> type:
    """`io.FileIO`, routed: a class that derives from it opens its path through the overlay.
    blobfile's local files are `class _ProxyFile(io.FileIO)` (OpenAI's improved-diffusion saves its
    checkpoints through blobfile): FileIO opens its path itself, around the routed open(), and the
    audit hook stopped the first save, where a GPU's run writes it."""

    class FileIO(_REAL_FILE_IO, metaclass=_FileIOType):
        __doc__ = _REAL_FILE_IO.__doc__
        _routed = True  # this class, not one that derives from it (read from its own __dict__)

        def __init__(self, file: Any, mode: str = "r", closefd: bool = True, opener: Any = None) -> None:
            if not _path_arg(file) or opener is not None:  # a descriptor, or its opener's: as it was
                super().__init__(file, mode, closefd, opener)
                return
            target = _target(overlay, file, mode)
            super().__init__(target, mode, closefd)
            if target != full(file):
                _named(self, file)

    FileIO.__module__ = _REAL_FILE_IO.__module__
    FileIO.__qualname__ = _REAL_FILE_IO.__qualname__
    return FileIO


def _routes(overlay: Overlay) -> List[Tuple[Any, str, Any]]:
    """The replacements of builtins', io's and os's file calls that route them through `overlay`."""
    real = _real

    def opening(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if not _path_arg(file):
            return _real_open(file, mode, *args, **kwargs)
        if len(args) > 5 and args[5] is not None or kwargs.get("opener") is not None:
            return _opened_by_opener(file, mode, args, kwargs)
        target = _target(overlay, file, mode)
        opened = _real_open(target, mode, *args, **kwargs)
        # the name the script gave, as a GPU run's file object has it
        return _named(opened, file) if target != full(file) else opened

    def _opened_by_opener(file: Any, mode: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """open() with an opener: the opener makes the descriptor (its os.open is routed) and `file` is
        only what open() hands it, not a path that open() itself opens. tempfile.NamedTemporaryFile
        passes its folder there (datasets' map() writes its cache through one), which the overlay took
        for a file to write: IsADirectoryError. open() is given the overlay's scratch folder instead,
        which its audit event names, and the script's opener still gets `file`."""
        positional, named = list(args), dict(kwargs)
        given = positional[5] if len(positional) > 5 else named["opener"]

        def opener(_name: Any, flags: int) -> int:
            return int(given(file, flags))
        if len(positional) > 5:
            positional[5] = opener
        else:
            named["opener"] = opener
        return _named(_real_open(overlay.scratch, mode, *positional, **named), file)

    def os_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: Optional[int] = None) -> int:
        if dir_fd is not None or not _path_arg(path):
            return real["open"](path, flags, mode, dir_fd=dir_fd)  # the audit hook stops a write
        if flags & _WRITE_FLAGS:
            target = overlay.writable(path, keep=not flags & os.O_TRUNC, create=bool(flags & os.O_CREAT),
                                      exclusive=bool(flags & os.O_CREAT and flags & os.O_EXCL))
        else:  # O_NOFOLLOW: a link at the end is opened as one, and the real open refuses it (ELOOP)
            target = overlay.where(path, follow=not flags & os.O_NOFOLLOW) or _gone(path)
        return real["open"](target, flags, mode)

    def reading(name: str) -> Callable[..., Any]:
        call = real[name]
        ends_at_link = name in ("lstat", "readlink")  # the others follow a link at the end, as asked

        def read(path: Any, *args: Any, **kwargs: Any) -> Any:
            if not _path_arg(path) or kwargs.get("dir_fd") is not None:
                return call(path, *args, **kwargs)
            follow = not ends_at_link and kwargs.get("follow_symlinks", True)
            return call(overlay.where(path, follow) or _gone(path), *args, **kwargs)
        return read

    def changing(name: str, folder_too: bool = True) -> Callable[..., Any]:
        call = real[name]

        def change(path: Any, *args: Any, **kwargs: Any) -> Any:
            if not _path_arg(path) or kwargs.get("dir_fd") is not None:
                return call(path, *args, **kwargs)
            follow = kwargs.get("follow_symlinks", True)
            where = overlay.where(path, follow) or _gone(path)
            kind = real["lstat"](where).st_mode
            if folder_too and stat.S_ISDIR(kind):
                return call(overlay.folder(path), *args, **kwargs)
            if stat.S_ISLNK(kind):  # the link itself (follow_symlinks=False): its upper copy
                return call(overlay.link_copy(path), *args, **kwargs)
            return call(overlay.writable(path, keep=True, create=False), *args, **kwargs)
        return change

    def listdir(path: Any = ".") -> List[Any]:
        if not _path_arg(path):
            return real["listdir"](path)
        return _like(path, overlay.names(path))

    def scandir(path: Any = ".") -> Any:
        if not _path_arg(path):
            return real["scandir"](path)
        return _Scan([_Entry(path, name, overlay) for name in _like(path, overlay.names(path))])

    def mkdir(path: Any, mode: int = 0o777, *, dir_fd: Optional[int] = None) -> None:
        if dir_fd is not None:
            return real["mkdir"](path, mode, dir_fd=dir_fd)
        overlay.make_folder(path, mode)

    def removing(name: str, how: Callable[[Any], None]) -> Callable[..., Any]:
        def remove(path: Any, *, dir_fd: Optional[int] = None) -> None:
            if dir_fd is not None:
                return real[name](path, dir_fd=dir_fd)
            how(path)
        return remove

    def moving(name: str) -> Callable[..., Any]:
        def move(src: Any, dst: Any, *, src_dir_fd: Optional[int] = None, dst_dir_fd: Optional[int] = None) -> None:
            if src_dir_fd is not None or dst_dir_fd is not None:
                return real[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            overlay.move(src, dst)
        return move

    def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if args or kwargs.get("follow_symlinks") or \
                any(v is not None for k, v in kwargs.items() if k.endswith("dir_fd")):
            return real["link"](src, dst, *args, **kwargs)  # the audit hook stops it
        overlay.hard_link(src, dst)

    def symlink(src: Any, dst: Any, target_is_directory: bool = False, *, dir_fd: Optional[int] = None) -> None:
        if dir_fd is not None:
            return real["symlink"](src, dst, target_is_directory, dir_fd=dir_fd)
        overlay.make_link(src, dst)

    def chdir(path: Any) -> None:
        # A folder the run made lives only in the upper layer: the process moves into that copy and
        # getcwd() names it as the script does (a script that makes outputs/run1 and works there,
        # Hydra's run folder). A folder of the user's tree is entered as it is.
        if not _path_arg(path):
            return real["chdir"](path)
        where = overlay.where(path) or _gone(path)
        named = overlay.seen_as(where)
        try:  # the user's folder itself where it has one, so that native code reads what it holds
            on_disk = named != where and stat.S_ISDIR(real["stat"](named).st_mode)
        except OSError:
            on_disk = False
        real["chdir"](named if on_disk else where)

    def getcwd() -> str:
        return overlay.seen_as(real["getcwd"]())

    def getcwdb() -> bytes:
        return os.fsencode(getcwd())

    routes: List[Tuple[Any, str, Any]] = [(__import__("builtins"), "open", opening), (io, "open", opening),
                                          (io, "FileIO", _file_io(overlay)),
                                          (os, "chdir", chdir), (os, "getcwd", getcwd), (os, "getcwdb", getcwdb),
                                          (os, "open", os_open), (os, "listdir", listdir), (os, "scandir", scandir),
                                          (os, "mkdir", mkdir), (os, "link", link), (os, "symlink", symlink),
                                          (os, "remove", removing("remove", overlay.remove)),
                                          (os, "unlink", removing("unlink", overlay.remove)),
                                          (os, "rmdir", removing("rmdir", overlay.remove_folder)),
                                          (os, "rename", moving("rename")), (os, "replace", moving("replace")),
                                          (os, "truncate", changing("truncate", folder_too=False))]
    routes += [(os, name, reading(name)) for name in ("stat", "lstat", "access", "readlink", "statvfs", *_XATTR_READS)]
    routes += [(os, name, changing(name)) for name in ("chmod", "utime", "chown", *_XATTR_WRITES)]
    # what each routed call takes, as os advertises it for the real one (shutil.copystat asks); not
    # dir_fd, whose calls go around the overlay
    for listing in ("supports_follow_symlinks", "supports_fd"):
        owned = getattr(os, listing)
        routes.append((os, listing, owned | {value for owner, name, value in routes
                                             if owner is os and _real.get(name) in owned}))
    # shutil.rmtree's descriptor-based walk (os.open of a folder, then unlink(dir_fd=)) would go around
    # the routes: its path-based walk uses them
    routes.append((shutil, "_use_fd_functions", False))
    return routes + _bound_by_name(routes) + _native_writers(overlay)


def _native_writers(overlay: Overlay) -> List[Tuple[Any, str, Any]]:
    """Writers that open their path in native code, around Python's file calls, given the overlay's
    path: tokenizers' Tokenizer.save (every fast tokenizer's `save_pretrained`, the Trainer's
    checkpoints), in every process of the run, whether it imports torch or not. Imported here when
    installed: a process that imports it later must find it routed already."""
    if importlib.util.find_spec("tokenizers") is None:
        return []
    import tokenizers

    real = tokenizers.Tokenizer.save

    def save(self: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
        return real(self, overlay.writable(path, keep=False) if _path_arg(path) else path, *args, **kwargs)
    return [(tokenizers.Tokenizer, "save", save)]


def _bound_by_name(routes: List[Tuple[Any, str, Any]]) -> List[Tuple[Any, str, Any]]:
    """The same routes for the modules that bound a routed function under a name of their own when
    they were imported (tarfile's `from builtins import open as bltn_open`, a `from os import remove`):
    they call it directly, around the routes, and the audit hook could only stop their writes (a tar
    archive extracted by the script). memdiff's own modules keep the real functions: the overlay's
    own work must never go through its routing."""
    routed = {id(_real_open): next(value for owner, name, value in routes if owner is io and name == "open")}
    routed.update((id(_real[name]), value) for owner, name, value in routes if owner is os and name in _real)
    found: List[Tuple[Any, str, Any]] = []
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.startswith("memdiff") or module in (io, os, shutil) or \
                module_name in ("builtins", "posix", "nt", "_io"):
            continue
        try:
            names = list(vars(module).items())
        except TypeError:  # a module stand-in without a __dict__
            continue
        found += [(module, name, routed[id(value)]) for name, value in names
                  if callable(value) and id(value) in routed and not name.startswith("__")]
    # numpy's readers (genfromtxt, loadtxt of a path) open through a table of openers it filled with
    # io.open when imported: a dataset file the run wrote would be read from the user's tree
    openers = getattr(sys.modules.get("numpy.lib._datasource"), "_file_openers", None)
    table = getattr(openers, "_file_openers", None)
    if isinstance(table, dict) and table.get(None) is _real_open:
        found.append((openers, "_file_openers", {**table, None: routed[id(_real_open)]}))
    return found


def _out_of_the_upper_layer(overlay: Overlay, started_in: str) -> None:
    """After the routes: a process the script moved into a folder only the run made (chdir above) is
    moved back to where it started, before the overlay that holds that folder is removed."""
    try:
        here = _real["getcwd"]()
    except FileNotFoundError:  # the folder is gone already
        here = overlay.upper
    if here == overlay.upper or here.startswith(overlay.upper + os.sep):
        _real["chdir"](started_in)


def _named(opened: Any, file: Any) -> Any:
    """`opened` with the name the script gave open(), where the overlay opened another path."""
    raw = getattr(getattr(opened, "buffer", opened), "raw", getattr(opened, "buffer", opened))
    with contextlib.suppress(AttributeError, TypeError):
        raw.name = file
    return opened


def _gone(path: Any) -> str:
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fsdecode(path))


# -- the audit hook: a write that went around the routes --------------------------------------------

_CHANGING_EVENTS = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.rename": 2, "os.link": 2, "os.symlink": 2,
                    "os.truncate": 1, "os.chmod": 1, "os.utime": 1, "os.chown": 1, "os.setxattr": 1,
                    "os.removexattr": 1}
_hooked = False


def _audit(event: str, args: Tuple[Any, ...]) -> None:
    overlay = _active
    if overlay is None:
        return
    if event == "open":
        path, mode, flags = args
        if not _path_arg(path) or not ((flags or 0) & _WRITE_FLAGS or (mode and any(c in mode for c in "wax+"))):
            return
        paths = [path]
    elif event in _CHANGING_EVENTS:
        paths = [p for p in args[:_CHANGING_EVENTS[event]] if _path_arg(p)]
        if event in ("os.link", "os.symlink"):
            paths = paths[1:]  # only the new name is written
    else:
        return
    for path in paths:
        target = full(path)
        if not overlay.passes(target) and not target.startswith(overlay.upper + os.sep):
            raise PermissionError(errno.EPERM, f"memdiff: emulation: {event} of {os.fsdecode(path)} stopped: it "
                                               f"would change the user's file around memdiff's overlay",
                                  os.fsdecode(path))


# -- the whole run -------------------------------------------------------------------------------------

@contextlib.contextmanager
def overlaid(owned: Tuple[str, ...] = ()) -> Iterator[Overlay]:
    """Route the process's file calls through the run's overlay for the block: the one named by
    MEMDIFF_OVERLAY (made by `memdiff record`, shared by every process of the run), else a new one
    removed after the block. `owned`: memdiff's own paths, read and written as they are."""
    global _active, _hooked
    root = os.environ.get(ROOT)
    made = root is None
    if root is None:
        root = tempfile.mkdtemp(prefix="memdiff-writes-")
    owned = owned + tuple(p for p in os.environ.get(OWNED, "").split(os.pathsep) if p)
    overlay = Overlay(root, owned)
    cache = os.path.join(overlay.scratch, "caches")
    os.makedirs(cache, exist_ok=True)
    # What the run's programs find in the environment: its temporary folder, caches and no bytecode
    # written beside the user's modules (children see the same overlay). Extensions torch builds as the
    # script runs (torch.utils.cpp_extension: DeepSpeed's CPU Adam) build in the scratch folder: ninja
    # and the compiler are no Python, so they neither see the overlay's folders (a build folder made in
    # the overlay is missing to them) nor write through it, and the user's own build cache stays theirs.
    env = {ROOT: overlay.root, OWNED: os.pathsep.join(overlay.owned), "TMPDIR": overlay.scratch,
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
           "TORCH_EXTENSIONS_DIR": os.path.join(cache, "torch_extensions"), "PYTHONDONTWRITEBYTECODE": "1"}
    changes = [*_routes(overlay), *overlay_imports.routes(overlay), *programs.routes(overlay),
               (tempfile, "tempdir", overlay.scratch),
               (sys, "dont_write_bytecode", True)]
    if not _hooked:  # an audit hook cannot be removed: one, idle while no overlay is active
        sys.addaudithook(_audit)
        _hooked = True
    previous, _active = _active, overlay
    atomic.OWN_WRITES.append(overlay.own)
    started_in = os.getcwd()
    try:
        with swap.environment(env), swap.replaced(changes):
            yield overlay
    finally:
        atomic.OWN_WRITES.remove(overlay.own)
        _active = previous
        _out_of_the_upper_layer(overlay, started_in)
        if made:
            overlay.discard()


@contextlib.contextmanager
def for_run(owned: List[str], kept: Optional[str], near: str, folders: List[str],
            say: Callable[[str], None]) -> Iterator[str]:
    """The overlay of one `memdiff record --emulate` run, its folder yielded: `kept` (--keep-writes,
    which must be new or empty), else a hidden folder in `near` removed after the run. Every process
    of the run finds it in the environment; `owned` are memdiff's paths. After the run, `say` is
    given what the run wrote, and what changed in the user's `folders` around the overlay."""
    if kept is not None:
        root = full(kept)
        if os.path.lexists(root) and (not os.path.isdir(root) or os.listdir(root)):
            raise InputError("--keep-writes", f"{kept} is there already: give a new or empty folder for the "
                                              f"run's writes")
        os.makedirs(root, exist_ok=True)
    else:
        root = tempfile.mkdtemp(prefix=OVERLAY_PREFIX, dir=near)
    overlay = Overlay(root)
    check = TreeCheck(folders, skip=(root, overlay.scratch, *owned))
    try:
        with swap.environment({ROOT: root, OWNED: os.pathsep.join(full(p) for p in owned),
                               programs.TREES: os.pathsep.join(check.folders) or None}):
            yield root
    finally:
        outside = check.changed(own=overlay.passed_through())
        for line in summary(overlay.changes(), kept, where=os.getcwd(), unchanged=not outside) + outside:
            say(line)
        overlay.discard(keep=kept is not None)


# -- what the run did, said once -------------------------------------------------------------------------

SHOWN = 20  # changes named one by one; the rest counted


def summary(changes: List[Change], kept: Optional[str] = None, where: Optional[str] = None,
            hint: bool = True, unchanged: Optional[bool] = None) -> List[str]:
    """What the run would have written, created or deleted, in lines a user reads: a headline, then a
    line per path (the first SHOWN). `kept`: the folder the overlay stays in; `where`: the folder the
    paths are shown relative to; `hint`: say how to keep them; `unchanged`: whether the user's files
    were checked and found unchanged (None: not checked, and not said)."""
    if not changes:
        return []
    counts: Dict[str, int] = {}
    for change in changes:
        counts[change.kind] = counts.get(change.kind, 0) + 1
    total = sum(c.size for c in changes)
    said = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
    look = f"; kept in {kept}" if kept else "; give --keep-writes DIR to keep them" if hint else ""
    state = "" if unchanged is None else ", the user's files are unchanged" if unchanged else \
        ", but a writer outside it changed the user's files (below)"
    lines = [f"the run's writes went to its overlay{state}: {said} ({format_bytes(total)} a real run writes{look})"]
    for change in changes[:SHOWN]:
        name = os.path.relpath(change.path, where) if where else change.path
        name = change.path if name.startswith("..") else name
        size = "" if change.kind == "deleted" or change.folder else f" ({format_bytes(change.size)}" + \
            (f", {change.size:,} bytes of tensor data, not written: emulated tensors have none)" if change.emulated
             else ")")
        lines.append(f"  {change.kind} {name}{'/' if change.folder else ''}{size}")
    if len(changes) > SHOWN:
        lines.append(f"  and {len(changes) - SHOWN} more")
    return lines


def note(changes: List[Change]) -> Optional[str]:
    """summary() as one line, for a snapshot's notes (the first few paths named)."""
    lines = summary(changes, where=os.getcwd(), hint=False)
    if not lines:
        return None
    named = [line.strip() for line in lines[1:7]]
    more = len(changes) - len(named)
    return f"{lines[0]}: {'; '.join(named)}" + (f"; and {more} more" if more > 0 else "")


# The hidden folder each run's overlay lives in, beside the script (for_run): memdiff's own, never
# the user's. Another emulated run in the same folder makes and removes one while this one runs.
OVERLAY_PREFIX = ".memdiff-writes-"


class TreeCheck:
    """The user's folders before and after the run (size, mtime, inode and mode of each path, to a
    bound): what changed there went around the overlay (a C library, a program the run started).
    Overlay folders of other emulated runs (OVERLAY_PREFIX) are memdiff's and are not looked at."""

    LIMIT = 100_000  # paths looked at; beyond, the check says it stopped

    def __init__(self, folders: List[str], skip: Tuple[str, ...]) -> None:
        self.folders = sorted({full(f) for f in folders if os.path.isdir(f)})
        self.skip = tuple(full(s) for s in skip)
        self.streams = _streams()
        self.stopped = False
        self.before = self._look()

    def _look(self) -> Dict[str, Tuple[int, int, int, int]]:
        # A stack of folders, not os.walk: a tree deeper than Python's recursion limit (a copy of a
        # folder into itself, left by an earlier run) is walked as any other, to LIMIT.
        seen: Dict[str, Tuple[int, int, int, int]] = {}
        for top in self.folders:
            todo = [top]
            while todo:
                folder = todo.pop()
                with contextlib.suppress(OSError), os.scandir(folder) as entries:
                    for entry in entries:
                        path = entry.path
                        if path.startswith(self.skip) or path in seen or entry.name.startswith(OVERLAY_PREFIX):
                            continue
                        if len(seen) >= self.LIMIT:
                            self.stopped = True
                            return seen
                        with contextlib.suppress(OSError):
                            info = entry.stat(follow_symlinks=False)
                            if (info.st_dev, info.st_ino) not in self.streams:
                                seen[path] = (info.st_size, info.st_mtime_ns, info.st_ino, info.st_mode)
                            if stat.S_ISDIR(info.st_mode):
                                todo.append(path)
        return seen

    def changed(self, own: Tuple[str, ...] = ()) -> List[str]:
        """Lines naming each path changed, made or removed since the check began, but `own`: what memdiff
        itself wrote for the run (a snapshot the script dumped), which passed through on purpose."""
        after = self._look()
        lines = []
        mine = set(own)
        for path in sorted(set(self.before) | set(after)):
            if path in mine:
                continue
            was, now = self.before.get(path), after.get(path)
            if was == now or (was and now and stat.S_ISDIR(was[3]) and stat.S_ISDIR(now[3])):
                continue
            what = "made" if was is None else "removed" if now is None else "changed"
            lines.append(f"{path} was {what} by a writer outside Python's file calls (a C library or a program "
                         f"the run started), which the overlay cannot route")
        if self.stopped:
            lines.append(f"only the first {self.LIMIT:,} paths of {', '.join(self.folders)} were checked")
        return lines


def _streams() -> Set[Tuple[int, int]]:
    """The files memdiff's standard output and error go to (`> train.log 2>&1`): the user's own
    redirection, which every process of the run inherits and writes as a GPU run does."""
    found = set()
    for fd in (1, 2):
        with contextlib.suppress(OSError, ValueError):
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode):
                found.add((info.st_dev, info.st_ino))
    return found
