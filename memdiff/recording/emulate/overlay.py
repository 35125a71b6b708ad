"""The run's own file world under emulation: every write lands in an overlay, the user's files never change.

An emulated run is not the user's run: its tensors have no data, and what it would write (a checkpoint,
a `trainer_state.json` beside old weights, a deletion of last epoch's `last.pth.tar`) must not reach
the files a user keeps. So, as an overlay file system does, the run sees two layers:

- the lower layer is the user's tree as it is, read and never written;
- the upper layer is a folder of memdiff's (`<root>/upper/<absolute path>`), where everything the run
  creates, changes, renames or links lives; a file changed in place is copied up first;
- a deletion is a marker (`<root>/deleted/<absolute path>` + WHITEOUT): the path reads as gone, the
  user's file stays. A folder deleted then made again hides what the lower layer had in it.

Reading a path gives the upper layer's copy where there is one, nothing where the run deleted it,
else the user's file. A link (the run's or the user's) is followed through the two layers, as the
kernel would follow it in the tree the run sees: a link the run made to a file it never changed
reads the user's file, a user's link to a file the run rewrote reads the run's copy, and a write
through any link lands in the upper copy of what it names, never in the user's file. A checkpoint
the run saved loads back in the same run, from any of its processes (the layers are on disk, shared
by every rank and worker). Paths memdiff owns (its snapshot, a job's folder, its scratch space) pass
through to the disk as they are.

This module is the layers' bookkeeping, with the real functions of `os`; overlay_calls.py routes the
script's file calls through it.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
import tempfile
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Tuple

# The real functions, bound before anything is replaced: the overlay's own work must never go
# through its own routing.
_lstat, _stat, _listdir, _mkdir, _unlink, _rmdir, _rename = (os.lstat, os.stat, os.listdir, os.mkdir, os.unlink,
                                                             os.rmdir, os.rename)
_open, _symlink, _readlink, _chmod, _link = os.open, os.symlink, os.readlink, os.chmod, os.link
_builtin_open = open

MAX_LINKS = 40  # links the kernel follows in one lookup before it says ELOOP
SYSTEM = ("/dev/", "/proc/", "/sys/")  # devices and kernel files: passed through, never the user's tree
WHITEOUT = ".~memdiff-deleted"  # a deletion marker's suffix, in the deleted/ tree
PASSED = "passed"  # the file in root listing what memdiff wrote as its own during the run (Overlay.own)
# The first line of a file the run saved holding emulated tensors (files.py): shapes, no data.
SKELETON = b"MEMDIFF-EMULATED-SAVE "


def full(path: Any) -> str:
    """`path` (str, bytes or path-like) as an absolute, normalized str, as the run's file calls see it."""
    return os.path.abspath(os.fsdecode(path))


def _lexists(path: str) -> bool:
    try:
        _lstat(path)
    except (OSError, ValueError):
        return False
    return True


def _isdir(path: str) -> bool:
    try:
        return stat.S_ISDIR(_stat(path).st_mode)
    except (OSError, ValueError):
        return False


def missing(path: Any) -> FileNotFoundError:
    """The error a real call raises for a path that is not there."""
    return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fsdecode(path))


@dataclass(frozen=True)
class Change:
    """One path the run changed, as the overlay holds it."""

    path: str  # absolute
    kind: str  # "created", "changed" or "deleted"
    size: int  # the bytes a real run leaves there (a save of emulated tensors: its tensor data); 0 when deleted
    folder: bool
    emulated: bool  # a save of emulated tensors: shapes kept, no tensor data


class Overlay:
    """The two layers under `root`; `owned`: paths (with everything below them, and the hidden
    temporary siblings memdiff writes them through) that are memdiff's and pass through."""

    def __init__(self, root: str, owned: Iterable[str] = ()) -> None:
        self.root = full(root)
        self.upper = os.path.join(self.root, "upper")
        self.gone = os.path.join(self.root, "deleted")
        for folder in (self.upper, self.gone):
            os.makedirs(folder, exist_ok=True)
        self.scratch = self._scratch()  # temporary files and compiler caches of the run
        self.owned: Tuple[str, ...] = ()
        self._siblings: Tuple[str, ...] = ()
        self._passing: Tuple[str, ...] = ()  # what passes() looks for at a path's start
        self._let_through(full(p) for p in owned if p)

    def _scratch(self) -> str:
        """The run's temporary folder, made by the first process to ask: a short one in the system's
        temporary folder, named by the link `<root>/scratch`. Not in root itself: a Unix socket's path
        holds at most 107 bytes, and multiprocessing binds one in TMPDIR to hand a DataLoader worker's
        batch to the main process; under a root deep in the user's tree the bind fails in the worker
        and the batch never arrives (the run hangs)."""
        link = os.path.join(self.root, "scratch")
        if not _lexists(link):
            base = tempfile.gettempdir()
            while True:  # the real mkdir: this may run while the process's calls are routed
                made = os.path.join(base, "memdiff-" + secrets.token_hex(4))
                try:
                    _mkdir(made, 0o700)
                    break
                except FileExistsError:
                    continue
            try:
                _symlink(made, link)
            except FileExistsError:  # another process of the run made it first
                _rmdir(made)
        return os.path.realpath(link)

    def discard(self, keep: bool = False) -> None:
        """Remove the run's scratch folder, and the layers unless `keep` (--keep-writes)."""
        shutil.rmtree(self.scratch, ignore_errors=True)
        if keep:
            try:
                _unlink(os.path.join(self.root, "scratch"))
            except OSError:
                pass
        else:
            shutil.rmtree(self.root, ignore_errors=True)

    def own(self, path: Any) -> None:
        """Let `path` through as memdiff's own (a snapshot it writes), with the folders above it that
        are not there yet (made for it); said in `<root>/passed` for every process of the run and for
        the check of the user's tree after it (passed_through)."""
        path = full(path)
        added = []
        while not self.passes(path):
            self._let_through([path])
            added.append(path)
            parent = os.path.dirname(path)
            if parent == path or _lexists(parent):
                break
            path = parent
        if added:
            with _builtin_open(os.path.join(self.root, PASSED), "a", encoding="utf-8") as f:
                f.write("".join(p + "\n" for p in added))

    def passed_through(self) -> Tuple[str, ...]:
        """The paths memdiff wrote as its own in any process of the run (own), with their folders."""
        try:
            with _builtin_open(os.path.join(self.root, PASSED), encoding="utf-8") as f:
                return tuple(line.rstrip("\n") for line in f if line.strip())
        except FileNotFoundError:
            return ()

    def _let_through(self, paths: Iterable[str]) -> None:
        """Add absolute `paths` to memdiff's own, and the prefixes passes() looks for (worked out here
        once: passes() runs for every part of every path the run's file calls name)."""
        for path in paths:
            self.owned += (path,)
            # memdiff writes its files through a hidden sibling first (memdiff.atomic): `.NAME.<random>.tmp`
            self._siblings += (os.path.join(os.path.dirname(path), "." + os.path.basename(path)[:16]),)
        self._passing = (self.root + os.sep, self.scratch + os.sep, *SYSTEM, *(o + os.sep for o in self.owned),
                         *self._siblings)

    # -- where a path lies ------------------------------------------------------------------------

    def passes(self, path: str) -> bool:
        """Whether absolute `path` is read and written as it is: memdiff's own, or the system's devices and
        kernel files (/dev/null, /dev/shm, /proc), which are no user's files and which a copy would break."""
        return path.startswith(self._passing) or path == self.root or path == self.scratch or path in self.owned

    def up(self, path: str) -> str:
        """Where absolute `path` lies in the upper layer."""
        return os.path.join(self.upper, path.lstrip(os.sep))

    def _marker(self, path: str) -> str:
        return os.path.join(self.gone, path.lstrip(os.sep) + WHITEOUT)

    def hidden(self, path: str) -> bool:
        """Whether the run deleted `path` or a folder above it (the lower layer's copy is not seen).
        Looked for from the top down: below a folder the deleted/ tree lacks there is no marker, so
        a path with no deletion near it costs a call or two, not one per folder above it (every
        file call of the run asks, for each part of its path)."""
        here = self.gone
        for part in path.strip(os.sep).split(os.sep):
            if _lexists(os.path.join(here, part) + WHITEOUT):
                return True
            here = os.path.join(here, part)
            if not _isdir(here):
                return False
        return False

    def resolve(self, path: Any, follow: bool = True) -> str:
        """The absolute path the run means by `path` (str, bytes or path-like), with every link on
        the way followed through the two layers as the kernel follows it (the last one only where
        `follow`), and "." and ".." taken after the links before them. No part of what it returns
        is a link, but its last where not `follow`. A part that is not there ends the walk: the
        rest is left as given, and a call on it fails as it would (ENOENT, ENOTDIR)."""
        raw = os.fsdecode(path)
        if not os.path.isabs(raw):
            raw = os.path.join(os.getcwd(), raw)
        if self.passes(os.path.normpath(raw)):
            # memdiff's own paths as memdiff named them, and the system's (/dev/stdout, /proc/self/fd/1:
            # links the kernel alone can follow), whatever links lie on the way
            return os.path.normpath(raw)
        todo = raw.split(os.sep)[::-1]  # the parts left to walk, the next one last
        here, links = os.sep, 0
        # What the two layers hold at `here`, kept as the walk goes down a part at a time, so that each
        # part costs a call or two, not _entry's four: whether the upper layer has `here` as a folder
        # (below a path it lacks it has nothing), whether the deleted/ tree has it as a folder (below,
        # no marker), and whether a folder at or above `here` was deleted (then what the upper layer
        # lacks below is hidden).
        up_dir, gone_dir, deleted = True, True, False
        while todo:
            part = todo.pop()
            if part in ("", "."):
                continue
            if part == "..":
                here = os.path.dirname(here)
                up_dir, gone_dir, deleted = self._layers(here)
                continue
            there = here + part if here == os.sep else here + os.sep + part
            if self.passes(there) and ".." not in todo:
                return os.path.join(there, *todo[::-1])
            upper = self.up(there) if up_dir else ""
            in_upper = up_dir and _lexists(upper)
            marked = gone_dir and _lexists(self._marker(there))
            real = upper if in_upper else there if not (deleted or marked) or self.passes(there) else None
            try:
                kind = _lstat(real).st_mode if real is not None else None
            except (OSError, ValueError):
                kind = None
            if real is None or kind is None:
                return os.path.join(there, *todo[::-1])
            if stat.S_ISLNK(kind) and (todo or follow):
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), raw)
                target = _readlink(real)
                todo.extend(target.split(os.sep)[::-1])
                if os.path.isabs(target):
                    here, up_dir, gone_dir, deleted = os.sep, True, True, False
                continue
            if not stat.S_ISDIR(kind) and any(todo):  # a file taken for a folder, as the kernel says
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), raw)
            here = there
            up_dir = in_upper and stat.S_ISDIR(kind)
            deleted = deleted or marked
            gone_dir = gone_dir and _isdir(os.path.join(self.gone, there.lstrip(os.sep)))
        return here

    def _layers(self, path: str) -> Tuple[bool, bool, bool]:
        """resolve()'s view of the layers at absolute `path`, worked out afresh: (the upper layer has it
        as a folder, the deleted/ tree has it as a folder, it or a folder above it was deleted)."""
        gone = os.path.join(self.gone, path.lstrip(os.sep)).rstrip(os.sep)
        return _isdir(self.up(path)), _isdir(gone), path != os.sep and self.hidden(path)

    def _entry(self, path: str) -> Optional[str]:
        """The real path holding what the run sees at `path` (absolute, its folders no links in the
        run's view), itself not followed; None where the run deleted it."""
        if self.passes(path):
            return path
        upper = self.up(path)
        if _lexists(upper):
            return upper
        return None if self.hidden(path) else path

    def seen_as(self, real: str) -> str:
        """The path the script names for `real`, a place on disk: an upper-layer copy's own path."""
        if real.startswith(self.upper + os.sep):
            return real[len(self.upper):]
        return real

    def where(self, path: Any, follow: bool = True) -> Optional[str]:
        """The real path that holds what the run sees at `path` (which may not exist: a call on it
        then fails as it would), or None where the run deleted it; a link at its end followed where
        `follow` (stat, open) and not (lstat, readlink)."""
        return self._entry(self.resolve(path, follow))

    def exists(self, path: Any, follow: bool = True) -> bool:
        """Whether `path` is there, as the run sees it (a link to nothing is, where not `follow`)."""
        return self._found(self.resolve(path, follow)) is not None

    def _found(self, path: str) -> Optional[str]:
        """The real path holding resolved `path` where the run sees something there (a link not
        followed), else None."""
        real = self._entry(path)
        return real if real is not None and _lexists(real) else None

    def _existing(self, path: str) -> str:
        """_found, or the error a real call raises where nothing is there."""
        real = self._found(path)
        if real is None:
            raise missing(path)
        return real

    def _lower(self, path: str) -> bool:
        """Whether the user's tree has `path` and the run still sees it there (not deleted above)."""
        return not self.hidden(path) and _lexists(path)

    # -- writing ----------------------------------------------------------------------------------

    def _parent(self, path: str) -> None:
        """The upper layer's folders down to `path`'s (resolved), where its folder is there as the run sees it."""
        real = self._found(os.path.dirname(path))
        if real is None:
            raise missing(path)
        if not _isdir(real):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        os.makedirs(os.path.dirname(self.up(path)), exist_ok=True)

    def writable(self, path: Any, keep: bool, create: bool = True, exclusive: bool = False) -> str:
        """The real path to write `path` at: its upper copy, copied up first where its content is kept
        (`keep`: appending, read-write). `create`: the call may make the file; `exclusive`: it must
        (and a link there, even to nothing, is in the way). A link is followed: what it names is written."""
        path = self.resolve(path, follow=not exclusive)
        if self.passes(path):
            return path
        upper = self.up(path)
        there = self._found(path) is not None
        if exclusive and there:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
        if not there and not create:
            raise missing(path)
        if not _lexists(upper):
            self._parent(path)
            if there and _isdir(path):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            if there:  # the user's file, copied: its bytes where kept, its mode always (read before the
                # copy is made: the path reads as the copy after)
                mode = stat.S_IMODE(_stat(path).st_mode)
                if keep:
                    shutil.copyfile(path, upper)
                else:
                    os.close(_open(upper, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
                _chmod(upper, mode)
        return upper

    def folder(self, path: Any) -> str:
        """The upper copy of folder `path` (made, empty, where the run sees it in the user's tree), to
        change its mode or times."""
        path = self.resolve(path)
        if self.passes(path):
            return path
        upper = self.up(path)
        if not _lexists(upper):
            if not self._lower(path):
                raise missing(path)
            mode = stat.S_IMODE(_stat(path).st_mode)
            self._parent(path)
            _mkdir(upper)
            _chmod(upper, mode)
        return upper

    def link_copy(self, path: Any) -> str:
        """The upper copy of the link at `path` itself (made where it is the user's), to change its
        mode, owner or times (a call with follow_symlinks=False)."""
        path = self.resolve(path, follow=False)
        if self.passes(path):
            return path
        upper = self.up(path)
        if not _lexists(upper):
            if not self._lower(path):
                raise missing(path)
            self._parent(path)
            _symlink(_readlink(path), upper)
        return upper

    def make_link(self, target: Any, path: Any) -> None:
        """symlink: a link at `path` naming `target` as given (a relative one is followed from the
        link's folder, in the run's view), in the upper layer."""
        path = self.resolve(path, follow=False)
        if self.passes(path):
            _symlink(target, path)
            return
        if self._found(path) is not None:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
        self._parent(path)
        upper = self.up(path)
        if _lexists(upper):  # the upper copy of a path the run deleted since
            _unlink(upper)
        _symlink(target, upper)

    def hard_link(self, source: Any, path: Any) -> None:
        """link: a second name at `path` for what the run sees at `source` (a link itself, not
        followed, as Linux's link does). The second name is of the run's own upper copy, never of
        the user's file: a write through it would reach theirs."""
        source, path = self.resolve(source, follow=False), self.resolve(path, follow=False)
        if self.passes(source) and self.passes(path):
            _link(source, path)
            return
        # link's own checks, in its order: the source, the new name's folder, the new name, a folder
        real = self._existing(source)
        folder = self._found(os.path.dirname(path))
        if folder is None or not _isdir(folder):
            raise missing(path)
        if self._found(path) is not None:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
        kind = _lstat(real).st_mode
        if stat.S_ISDIR(kind):  # no second name for a folder
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), source)
        if stat.S_ISLNK(kind):  # a second name of a link reads as a copy of it
            self.make_link(_readlink(real), path)
            return
        _link(self.writable(source, keep=True, create=False), self.writable(path, keep=False))

    def make_folder(self, path: Any, mode: int = 0o777) -> None:
        """mkdir, in the upper layer (a link there, even to nothing, is in the way)."""
        path = self.resolve(path, follow=False)
        if self.passes(path):
            _mkdir(path, mode)
            return
        if self._found(path) is not None:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
        self._parent(path)
        _mkdir(self.up(path), mode)

    def _bury(self, path: str) -> None:
        """Mark `path` deleted where the user's tree still shows it."""
        if self._lower(path):
            marker = self._marker(path)
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            os.close(_open(marker, os.O_WRONLY | os.O_CREAT, 0o600))

    def remove(self, path: Any) -> None:
        """unlink: the upper copy goes, the user's file is marked deleted (a link itself, not what it names)."""
        path = self.resolve(path, follow=False)
        if self.passes(path):
            _unlink(path)
            return
        real = self._existing(path)
        if stat.S_ISDIR(_lstat(real).st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if real != path:
            _unlink(real)
        self._bury(path)

    def erase(self, path: Any) -> None:
        """`rm -rf`: `path` and everything below it gone as the run sees it, whatever it is (a kernel
        overlay's whiteout, programs.py): its upper copy removed, the user's marked deleted. Nothing
        there is no error; memdiff's own paths are left alone."""
        path = self.resolve(path, follow=False)
        if self.passes(path):
            return
        upper = self.up(path)
        try:
            kind = _lstat(upper).st_mode
        except (OSError, ValueError):
            kind = None
        if kind is not None and stat.S_ISDIR(kind):
            shutil.rmtree(upper)
        elif kind is not None:
            _unlink(upper)
        self._bury(path)

    def remove_folder(self, path: Any) -> None:
        """rmdir: an empty folder, as the run sees it (a link to one is not)."""
        path = self.resolve(path, follow=False)
        if self.passes(path):
            _rmdir(path)
            return
        real = self._existing(path)
        if not stat.S_ISDIR(_lstat(real).st_mode):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        if self.names(path):
            raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), path)
        upper = self.up(path)
        if _lexists(upper):
            _rmdir(upper)
        self._bury(path)

    def move(self, source: Any, target: Any) -> None:
        """rename / replace: what the run sees at `source` is at `target` after, and gone from `source`
        (links at either end are moved or replaced, not followed)."""
        source, target = self.resolve(source, follow=False), self.resolve(target, follow=False)
        if self.passes(source) and self.passes(target):
            _rename(source, target)
            return
        real = self._existing(source)
        there = self._found(target)
        if source == target or (there is not None and os.path.samestat(_lstat(real), _lstat(there))):
            return  # two names of one file: rename leaves both, as POSIX says
        folder = stat.S_ISDIR(_lstat(real).st_mode)
        if folder and target.startswith(source + os.sep):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), source)
        if source.startswith(target + os.sep):  # onto a folder above it, as the kernel says
            raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), target)
        if there is not None:  # rename's own checks, on what the run sees there
            if stat.S_ISDIR(_lstat(there).st_mode):
                if not folder:
                    raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), target)
                if self.names(target):
                    raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), target)
            elif folder:
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), target)
        destination = target if self.passes(target) else self.up(target)
        if not self.passes(target):
            self._parent(target)
        if folder and _lexists(destination) and _isdir(destination):
            _rmdir(destination)  # empty as the run sees it: its upper copy holds nothing either
        elif _lexists(destination) and not _isdir(destination):
            _unlink(destination)  # a new file at that name, not new bytes in the old one (a hard link's)
        if not self.passes(source) and (real == source or (folder and self._lower(source))):
            # the user's own, or a folder holding some of it: what the run sees there copied, never moved
            self.copy(source, destination)
            if real != source:
                shutil.rmtree(real)
        else:
            _rename(real, destination)
        if not self.passes(source):
            self._bury(source)

    def copy(self, source: str, destination: str) -> None:
        """What the run sees at resolved `source` (a file, a link or a whole folder of both layers)
        copied to the real path `destination`."""
        real = self._existing(source)
        mode = _lstat(real).st_mode
        if stat.S_ISLNK(mode):
            if _lexists(destination):
                _unlink(destination)
            _symlink(_readlink(real), destination)
        elif stat.S_ISDIR(mode):
            if not _lexists(destination):
                _mkdir(destination)
            for name in self.names(source):
                self.copy(os.path.join(source, name), os.path.join(destination, name))
            shutil.copymode(real, destination)
        else:
            shutil.copy2(real, destination)

    # -- folders ----------------------------------------------------------------------------------

    def names(self, path: Any) -> List[str]:
        """The names in folder `path` as the run sees it: the user's, less what it deleted, and its own."""
        path = self.resolve(path)
        if self.passes(path):
            return _listdir(path)
        upper = self.up(path)
        lower = self._lower(path) and _isdir(path)
        if not lower and not _isdir(upper):
            if self._found(path) is not None:
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
            raise missing(path)
        found = set(_listdir(upper)) if _isdir(upper) else set()
        if lower:
            for name in _listdir(path):
                if name not in found and not _lexists(self._marker(os.path.join(path, name))):
                    found.add(name)
        if os.path.dirname(self.root) == path:  # the overlay itself, when it lies in the user's tree
            found.discard(os.path.basename(self.root))
        return sorted(found)

    # -- what the run did -------------------------------------------------------------------------

    def changes(self) -> List[Change]:
        """Every path the run created, changed or deleted, by path."""
        found = {}
        for folder, dirs, files in os.walk(self.upper):
            for name in dirs + files:
                upper = os.path.join(folder, name)
                path = os.sep + os.path.relpath(upper, self.upper)
                info = _lstat(upper)
                before = _lexists(path)  # the user has it: the run's copy replaces it
                is_folder = stat.S_ISDIR(info.st_mode)
                if is_folder and before and not self.hidden(path):
                    continue  # a folder the user has, holding what the run wrote
                size, emulated = (0, False) if is_folder else _written(upper, info.st_size)
                found[path] = Change(path, "changed" if before else "created", size, is_folder, emulated)
        for folder, _, files in os.walk(self.gone):
            for name in files:
                path = os.sep + os.path.relpath(os.path.join(folder, name), self.gone)[:-len(WHITEOUT)]
                if path not in found and _lexists(path) and not self.hidden(os.path.dirname(path)):
                    found[path] = Change(path, "deleted", 0, _isdir(path), False)
        # a folder the run made is named by what it holds, where it holds anything the run wrote
        holding = {os.path.dirname(p) for p in found}
        return [found[p] for p in sorted(found) if not (found[p].folder and found[p].kind == "created"
                                                        and p in holding)]


def _written(path: str, size: int) -> Tuple[int, bool]:
    """The bytes a real run leaves in the file at `path`, and whether it is a save of emulated tensors
    (its first line names the tensor data a real run writes)."""
    try:
        with _builtin_open(path, "rb") as f:
            head = f.read(len(SKELETON) + 24)
    except OSError:
        return size, False
    if not head.startswith(SKELETON):
        return size, False
    digits = head[len(SKELETON):].split(b"\n", 1)[0]
    return (int(digits), True) if digits.isdigit() else (size, False)
