"""Where a Python file outside any `site-packages` folder is an installed library's, read from pip's own mark.

A snapshot names each frame's file by its absolute path; `frames.normalize_path` knows a library by
the folder it was installed into (`site-packages`, Debian's `dist-packages`). pip writes the same mark
wherever it installs, `site-packages` or not: a `<name>-<version>.dist-info` folder beside the
package (`pip install --target DIR`, a folder put on PYTHONPATH, a pex's unpacked wheels), or a
`<name>-<version>-pyX.Y.egg-info` of an older install. So where the machine reading the snapshot has
the frame's file, the folders above it are looked at for a distribution that provides the top-level
package the file is in (`DIR/diffusers/training_utils.py` with `DIR/diffusers-0.36.0.dist-info`): the
file is that library's, shown by its package path (`diffusers/training_utils.py`) as a
`site-packages` file is.

Not a mark: the `<name>.egg-info` setuptools writes into a project's own source tree (`pip install -e .`,
`setup.py develop`), which has no version in its name: the code being edited is the project's, and its
frames stay the user's. A file that is not on this machine (a snapshot read elsewhere) is left as it
was: nothing here guesses from a path's shape.

Why this mark, read here: most snapshots are written by a user's own `_dump_snapshot` with no memdiff
in the run, so a note `memdiff record` could write beside the file (the sys.path folders holding
dist-info) would cover only some of them; and a path's shape (`lib/`, `vendor/`, `third_party/`)
cannot tell a folder on PYTHONPATH from a project's own source.

The snapshot names the paths, so it may name any number of them: each file and each folder is looked
at once per snapshot read (cached), and within budgets: MAX_FILES files, MAX_FOLDERS folders listed,
MAX_ENTRIES names of one folder and MAX_ENTRIES_IN_ALL of all, MAX_METADATA_FILES metadata files
(`top_level.txt`, `RECORD`; nothing else is opened), each read in part, MAX_METADATA_BYTES_IN_ALL
in all. Past them a frame reads as it did before.
"""

from __future__ import annotations

import os
import re
from typing import Dict, FrozenSet, List, Optional, Set, Tuple

# At most this many distinct files are asked about and folders listed per snapshot read: a real
# snapshot's stacks run through a few hundred files in some dozens of folders.
MAX_FILES = 100_000
MAX_FOLDERS = 4_096
# Names read from one folder (a site-packages of 1,000 distributions holds about 3,000), and from
# all of them together (some 1 s of listing on a slow disk)
MAX_ENTRIES = 65_536
MAX_ENTRIES_IN_ALL = 1 << 20
# metadata files (top_level.txt, RECORD) read in all
MAX_METADATA_FILES = 4_096
# Folders above a file looked at: deeper than any install's package.
MAX_DEPTH = 32
MAX_TOP_LEVEL_BYTES = 64 << 10
# A RECORD's first bytes (a wheel's own files come first; torch 2.13's whole RECORD is 1.40 MiB), and all
# metadata read together
MAX_RECORD_BYTES = 1 << 20
MAX_METADATA_BYTES_IN_ALL = 64 << 20

# The folders found to hold a library some frame was in, newest last, at most MAX_ROOTS: where
# source.py looks a library's display path up beside sys.path (such a folder need not be on it).
MAX_ROOTS = 64
_roots: Dict[str, None] = {}

# `diffusers-0.36.0.dist-info`; `torch-2.1.0-py3.11.egg-info` (an install's; a source tree's has no version)
_DIST_INFO = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._]*)-[^-/]+\.dist-info$")
_EGG_INFO = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._]*)-\d[^-/]*(-py\d[^/]*)?\.egg-info$")


def library_roots() -> Tuple[str, ...]:
    """The folders outside site-packages found to hold an installed library a snapshot's frame was
    in, in this process (the newest MAX_ROOTS)."""
    return tuple(_roots)


def _found_root(folder: str) -> None:
    _roots.pop(folder, None)
    _roots[folder] = None
    while len(_roots) > MAX_ROOTS:
        del _roots[next(iter(_roots))]


def canonical(name: str) -> str:
    """A distribution's or package's name as both compare (PEP 503, with `_`): `PyYAML` -> `pyyaml`."""
    return re.sub(r"[-_.]+", "_", name).lower()


class _Folder:
    """What the distributions installed in one folder provide: their names, and the top-level names
    their metadata lists, read on demand."""

    def __init__(self, path: str, marks: List[str], owner: "InstalledLibraries") -> None:
        self.path = path
        self._owner = owner
        self.marks = marks  # the dist-info / egg-info folder names
        self.names: FrozenSet[str] = frozenset(canonical(_name_of(m)) for m in marks)
        self._top_level: Optional[FrozenSet[str]] = None

    def provides(self, package: str) -> bool:
        """Whether a distribution installed here provides the top-level `package`: by its name, else
        by the top-level names its metadata lists (`scikit_learn` provides `sklearn`, `protobuf`
        `google`, `absl_py` `absl`), read once per folder and only when a name does not match."""
        name = canonical(package)
        if name in self.names:
            return True
        if self._top_level is None:
            self._top_level = frozenset(n for mark in self.marks for n in self._top_level_of(mark))
        return name in self._top_level

    def _top_level_of(self, mark: str) -> Set[str]:
        """The top-level names one distribution installs: its top_level.txt (setuptools writes one),
        else the first part of each path its RECORD lists (every wheel pip installs has one)."""
        for file, limit in (("top_level.txt", MAX_TOP_LEVEL_BYTES), ("RECORD", MAX_RECORD_BYTES)):
            text = self._owner.read_metadata(os.path.join(self.path, mark, file), limit)
            if text is None:
                continue
            names = set()
            for line in text.splitlines():
                top = line.split(",", 1)[0].strip().split("/", 1)[0]
                if top.endswith(".py"):
                    top = top[:-3]  # a one-module distribution (six.py)
                if top.isidentifier():  # never `..` (bin/), `__pycache__` is one but harmless
                    names.add(canonical(top))
            return names
        return set()


def _name_of(mark: str) -> str:
    m = _DIST_INFO.match(mark) or _EGG_INFO.match(mark)
    assert m is not None  # only matching names are kept
    return m.group(1)


class InstalledLibraries:
    """Asks, once per file and per folder, whether a file is an installed library's (module docstring)."""

    def __init__(self) -> None:
        self._files: Dict[str, Optional[str]] = {}
        self._folders: Dict[str, _Folder] = {}
        self._entries_left = MAX_ENTRIES_IN_ALL
        self._metadata_files_left = MAX_METADATA_FILES
        self._metadata_bytes_left = MAX_METADATA_BYTES_IN_ALL

    def package_path(self, path: str) -> Optional[str]:
        """The package path (`diffusers/training_utils.py`) of an absolute `/`-separated `path` whose file
        is here and whose top-level package a distribution installed in a folder above it provides
        (the outermost such folder, as the first `site-packages` in a path counts); None otherwise."""
        if path in self._files:
            return self._files[path]
        found = None
        if len(self._files) < MAX_FILES:
            found = self._files[path] = self._look_up(path)
        return found

    def _look_up(self, path: str) -> Optional[str]:
        if not path.startswith("/") or not path.endswith(".py") or "\x00" in path:
            return None
        try:
            if not os.path.isfile(path):  # not on this machine: read as it always was
                return None
        except (OSError, ValueError):
            return None
        parts = path.split("/")  # ["", "t", "diffusers", "training_utils.py"]
        for i in range(max(1, len(parts) - MAX_DEPTH), len(parts)):
            package = parts[i][:-3] if i == len(parts) - 1 else parts[i]
            if not package.isidentifier():
                continue
            folder = self._folder("/".join(parts[:i]) or "/")
            if folder is not None and folder.marks and folder.provides(package):
                _found_root(folder.path)
                return "/".join(parts[i:])
        return None

    def read_metadata(self, path: str, limit: int) -> Optional[str]:
        """The text of a distribution's metadata file, its first `limit` bytes; None where it is not a
        regular file (never a FIFO a read would wait on) or past the budgets."""
        if self._metadata_files_left <= 0 or self._metadata_bytes_left <= 0:
            return None
        try:
            if not os.path.isfile(path):
                return None
            self._metadata_files_left -= 1
            with open(path, "rb") as f:
                data = f.read(min(limit, self._metadata_bytes_left))
        except OSError:
            return None
        self._metadata_bytes_left -= len(data)
        return data.decode("utf-8", "replace")

    def _folder(self, path: str) -> Optional[_Folder]:
        """What `path` holds, listed once; None past the budgets (MAX_FOLDERS, MAX_ENTRIES_IN_ALL)."""
        folder = self._folders.get(path)
        if folder is None:
            if len(self._folders) >= MAX_FOLDERS or self._entries_left <= 0:
                return None
            folder = self._folders[path] = _Folder(path, self._marks_in(path), self)
        return folder

    def _marks_in(self, path: str) -> List[str]:
        """The dist-info and versioned egg-info folder names in `path`, of its first MAX_ENTRIES names."""
        marks = []
        try:
            with os.scandir(path) as entries:
                for n, entry in enumerate(entries):
                    if n >= MAX_ENTRIES or self._entries_left <= 0:
                        break
                    self._entries_left -= 1
                    if entry.name.endswith("-info") and (_DIST_INFO.match(entry.name) or _EGG_INFO.match(entry.name)):
                        marks.append(entry.name)
        except OSError:
            return []
        return sorted(marks)
