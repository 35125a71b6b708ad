"""Every file memdiff writes goes through here: the path checked before the work, then an atomic write.

A reader of an output sees the old file or the new one, never half of either; a failed write
leaves no temporary file behind; a failure on the user's path is an InputError (exit 2) saying why.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import tempfile
import time
from typing import BinaryIO, Callable, List, Optional, Sequence

from memdiff.errors import InputError
from memdiff.inert import text

# How long a pipe may go without a reader before writing to it is given up (no input hangs memdiff).
PIPE_READER_WAIT_S = 10.0
# Bytes of the target's name kept in its temporary sibling's, so a name near NAME_MAX still has one.
TEMP_NAME_BYTES = 64

Writer = Callable[[BinaryIO], object]  # what it returns (f.write's count) is ignored
# Told of each path memdiff is about to write, and each folder it makes: an emulated run's overlay
# (memdiff.recording.emulate.overlay_calls) lets them through to the disk as memdiff's own output (a
# snapshot the script dumps, a window it records), while the script's own writes stay in the overlay.
OWN_WRITES: List[Callable[[str], None]] = []


def _own(path: str) -> None:
    for hook in OWN_WRITES:
        hook(path)


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _blocking_ancestor(path: str) -> Optional[str]:
    """The first existing ancestor of `path` (a folder path) that is not a folder, if any: what
    makes `report.md/sub/x` unwritable."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        prefix = os.sep.join(parts[:i]) or os.sep
        if not os.path.lexists(prefix):
            return None
        if not os.path.isdir(prefix):
            return prefix
    return None


def _check_folder_of(path: str, folder: str, make: bool) -> None:
    """InputError unless `folder` is (or, with `make`, can be made) a folder memdiff can write into."""
    try:
        os.stat(folder)
    except OSError as exc:
        if exc.errno == errno.ENOTDIR or (exc.errno == errno.ENOENT and _blocking_ancestor(folder)):
            raise InputError(path, f"{_blocking_ancestor(folder) or folder} is not a folder") from None
        if exc.errno == errno.ELOOP:
            raise InputError(path, f"the folder {folder} is a symbolic link loop") from None
        if exc.errno != errno.ENOENT:
            raise InputError(path, f"cannot reach the folder {folder}: {_reason(exc)}") from None
        if not make:
            raise InputError(path, f"the folder {folder} does not exist: create it, or write elsewhere") from None
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise InputError(path, f"cannot make the folder {folder}: {_reason(exc)}") from None
    if not os.path.isdir(folder):
        raise InputError(path, f"{folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        # access() answers EROFS for root too, so a read-only mount is caught here as well.
        raise InputError(path, f"cannot write into the folder {folder}: "
                               f"{'read-only file system' if _read_only(folder) else 'permission denied'}")
    # access() grants root everything else: a folder of /proc, or an NFS mount that squashes root,
    # refuses the file only when it is made. Making one is the check that holds before the work.
    try:
        fd, probe = tempfile.mkstemp(prefix=".memdiff-probe-", dir=folder)
    except OSError as exc:
        raise InputError(path, f"cannot write into the folder {folder}: {_reason(exc)}") from None
    os.close(fd)
    os.unlink(probe)


def _read_only(folder: str) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a pipe"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


STREAM = re.compile(r"^/(dev|proc/[^/]+)/fd/\d+$|^/dev/std(in|out|err)$")


def _is_stream(path: str) -> bool:
    """Whether `path` names an open descriptor (/dev/stdout, /dev/fd/3, /proc/self/fd/1) through
    its links: what it leads to, even a regular file (`> out.md`), is the shell's to manage."""
    current = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        if STREAM.match(current):
            return True
        if not os.path.islink(current):
            return False
        current = os.path.normpath(os.path.join(os.path.dirname(current), os.readlink(current)))
    return False


def check_output(path: str, *, in_place: bool = True, make_folder: bool = False, inputs: Sequence[str] = ()) -> None:
    """InputError (exit 2) unless `path` can be written; called before the work that produces it.

    `inputs`: the files the command reads; writing over one of them (`memdiff slice run.pickle
    -o run.pickle`) is refused, as a run's snapshot is never lost.

    `in_place`: an existing pipe or character device (/dev/stdout, /dev/null) is written as it is,
    which is what a user naming one asks for; without it (a snapshot) such a target is refused,
    never replaced. A regular file, or one a symbolic link leads to, is replaced atomically and
    the link kept; a dangling link or a link loop is refused rather than followed somewhere else.
    `make_folder` creates a missing folder (a recording must not be lost to one)."""
    if not path:
        raise InputError("''", "empty path: name a file to write")
    _own(path)
    try:
        os.lstat(path)
        linked = os.path.islink(path)
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise InputError(path, "file name too long (over 255 bytes in one part, or the whole path "
                                   "too long)") from None
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            raise InputError(path, f"cannot reach: {_reason(exc)}") from None
        _check_folder_of(path, os.path.dirname(path) or ".", make_folder)
        return
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError(path, "is a symbolic link loop") from None
        if exc.errno == errno.ENOENT and linked:
            # Following it would make the file wherever it points, maybe outside the folder.
            raise InputError(path, f"is a link to {os.readlink(path)}, which does not exist") from None
        raise InputError(path, f"cannot reach: {_reason(exc)}") from None
    if stat.S_ISDIR(mode):
        raise InputError(path, "is a folder: name a file in it")
    if _is_stream(path):
        if not in_place:
            raise InputError(path, "is an open stream, not a file: name a file to write")
        return
    if stat.S_ISREG(mode):
        for read in inputs:
            with contextlib.suppress(OSError):
                if os.path.samefile(path, read):
                    raise InputError(path, f"is the input {text(read)}: writing it would replace what is read; "
                                           f"name another file")
        _check_folder_of(path, os.path.dirname(os.path.realpath(path)), make_folder)
        return
    if not (in_place and (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode))):
        raise InputError(path, f"is {_kind(mode)}, not a regular file: memdiff never replaces one")


def _open_pipe(path: str) -> int:
    """A pipe opened for writing once a reader is there, for at most PIPE_READER_WAIT_S."""
    deadline = time.monotonic() + PIPE_READER_WAIT_S
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise OSError(exc.errno, f"{path} is a pipe with no reader") from None
            time.sleep(0.05)
            continue
        os.set_blocking(fd, True)
        return fd


def _write_in_place(path: str, write: Writer) -> None:
    """A pipe, a character device or a stream written as it is (renaming over it would replace it);
    appended to, after what memdiff already printed to the same stream."""
    fd = _open_pipe(path) if stat.S_ISFIFO(os.stat(path).st_mode) else os.open(path, os.O_WRONLY | os.O_APPEND)
    with os.fdopen(fd, "wb") as f:
        write(f)


def _new_file_mode(target: str) -> int:
    """The replaced file's mode, else what a plain open() gives (0644 under the usual umask 022)."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        pass
    return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read without setting it where Linux shows it: setting it, even for a
    moment, would change the mode of a file another thread makes meanwhile."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temp_prefix(name: str) -> str:
    """Hidden (never read as a run or a rank), and short enough for a name near NAME_MAX."""
    return f".{os.fsdecode(os.fsencode(name)[:TEMP_NAME_BYTES])}."


def _write_atomic(target: str, write: Writer) -> None:
    """Write through a unique temporary sibling, fsync, rename over `target`; the temporary is
    removed on any failure, a full disk or Ctrl-C included."""
    folder, name = os.path.split(target)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(name), suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            # mkstemp makes the file private; the result stays readable by whoever could read it.
            os.fchmod(f.fileno(), _new_file_mode(target))
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _sync_folder(folder)


def _sync_folder(folder: str) -> None:
    """Make the rename durable; a file system that cannot fsync a folder is not an error."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temporary_name(path: str) -> str:
    """An unused hidden name beside `path` (checked with `check_output`), no file made yet: where a
    long-running producer (a recording) writes before `commit`. Nothing is there to clean up if the
    process is killed before it writes."""
    folder, name = os.path.split(os.path.realpath(path))
    return os.path.join(folder, f"{_temp_prefix(name)}{secrets.token_hex(8)}.tmp")


def commit(tmp: str, path: str) -> None:
    """Rename the finished `tmp` (from `temporary_name`) over `path`, durably, with `path`'s mode."""
    target = os.path.realpath(path)
    try:
        os.chmod(tmp, _new_file_mode(target))
        os.replace(tmp, target)
    except OSError as exc:
        raise InputError(path, f"cannot write: {_reason(exc)}") from None
    _sync_folder(os.path.dirname(target))


def write_stream(path: str, write: Writer, *, in_place: bool = True) -> None:
    """Check `path` and write what `write` puts into a binary file there, atomically for a regular
    file; any failure is an InputError for `path` and leaves no partial file."""
    check_output(path, in_place=in_place)
    try:
        if os.path.exists(path) and (_is_stream(path) or not os.path.isfile(path)):
            _write_in_place(path, write)
        else:
            # Through a link, the file it leads to is replaced and the link kept.
            _write_atomic(os.path.realpath(path), write)
    except OSError as exc:
        raise InputError(path, f"cannot write: {_reason(exc)}") from None


def encoded(text: str) -> bytes:
    """UTF-8, a lone surrogate (from a hostile frame name) escaped so JSON reads it back."""
    return text.encode("utf-8", "backslashreplace")


def write_output(path: str, text: str) -> None:
    """`text` written to the user's `path` (a report, a summary, a baseline) as `write_stream` does."""
    data = encoded(text)
    write_stream(path, lambda f: f.write(data))


def check_folder(path: str) -> None:
    """InputError unless `path` is a folder memdiff can write files into, or one it can make:
    checked before the work whose files go there."""
    if not path:
        raise InputError("''", "empty path: name a folder")
    # `runs/` names the link `runs` itself when it is one: a dangling one must be seen as such.
    bare = path.rstrip(os.sep) or os.sep
    try:
        os.lstat(bare)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError(path, "leads through a symbolic link loop") from None
        if exc.errno == errno.ENAMETOOLONG:
            raise InputError(path, "file name too long (over 255 bytes in one part, or the whole path "
                                   "too long)") from None
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise InputError(path, f"cannot reach: {_reason(exc)}") from None
    else:
        try:
            mode = os.stat(bare).st_mode
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise InputError(path, "is a symbolic link loop") from None
            if exc.errno == errno.ENOENT:
                raise InputError(path, f"is a link to {os.readlink(bare)}, which does not exist") from None
            raise InputError(path, f"cannot reach: {_reason(exc)}") from None
        if not stat.S_ISDIR(mode):
            raise InputError(path, f"is {'a file' if stat.S_ISREG(mode) else _kind(mode)}, not a folder")
        _check_folder_of(path, path, make=False)
        return
    blocking = _blocking_ancestor(bare)
    if blocking:
        raise InputError(path, f"{blocking} is not a folder")
    ancestor = os.path.dirname(os.path.abspath(bare))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    _check_folder_of(path, ancestor, make=False)


def make_folder(path: str) -> None:
    """`check_folder`, then the folder made when missing; any failure an InputError."""
    _own(path)
    check_folder(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise InputError(path, f"cannot make the folder: {_reason(exc)}") from None


def append_text(path: str, text: str) -> None:
    """Append `text` to `path` (GitHub's step summary and outputs files); a failure is an InputError."""
    check_output(path)
    data = encoded(text)
    try:
        if os.path.exists(path) and (_is_stream(path) or not os.path.isfile(path)):
            _write_in_place(path, lambda f: f.write(data))
        else:
            with open(path, "ab") as f:
                f.write(data)
    except OSError as exc:
        raise InputError(path, f"cannot write: {_reason(exc)}") from None
