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

The snapshot names the paths, so it may name any number of them: each file and each folder is looked
at once per snapshot read (cached), and within budgets: MAX_FILES files, MAX_FOLDERS folders listed,
MAX_ENTRIES names of one folder and MAX_ENTRIES_IN_ALL of all, MAX_TOP_LEVEL_FILES small
`top_level.txt` files (nothing else is opened). Past them a frame reads as it did before.
"""

from __future__ import annotations

import os
import re
from typing import Dict, FrozenSet, List, Optional, Set

# At most this many distinct files are asked about and folders listed per snapshot read: a real
# snapshot's stacks run through a few hundred files in some dozens of folders.
MAX_FILES = 100_000
MAX_FOLDERS = 4_096
# Names read from one folder (a site-packages of 1,000 distributions holds about 3,000), and from
# all of them together (some 1 s of listing on a slow disk)
MAX_ENTRIES = 65_536
MAX_ENTRIES_IN_ALL = 1 << 20
# top_level.txt files read in all (each at most MAX_TOP_LEVEL_BYTES)
MAX_TOP_LEVEL_FILES = 4_096
# Folders above a file looked at: deeper than any install's package.
MAX_DEPTH = 32
MAX_TOP_LEVEL_BYTES = 64 << 10

# `diffusers-0.36.0.dist-info`; `torch-2.1.0-py3.11.egg-info` (an install's; a source tree's has no version)
_DIST_INFO = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._]*)-[^-/]+\.dist-info$")
_EGG_INFO = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._]*)-\d[^-/]*(-py\d[^/]*)?\.egg-info$")


def canonical(name: str) -> str:
    """A distribution's or package's name as both compare (PEP 503, with `_`): `PyYAML` -> `pyyaml`."""
    return re.sub(r"[-_.]+", "_", name).lower()


class _Folder:
    """What one folder's distribution marks provide: their names, and their top_level.txt read on demand."""

    def __init__(self, path: str, marks: List[str], owner: "InstalledLibraries") -> None:
        self.path = path
        self._owner = owner
        self.marks = marks  # the dist-info / egg-info folder names
        self.names: FrozenSet[str] = frozenset(canonical(_name_of(m)) for m in marks)
        self._top_level: Optional[FrozenSet[str]] = None

    def provides(self, package: str) -> bool:
        """Whether a distribution installed here provides the top-level `package` (by its name, else
        by its top_level.txt: `scikit_learn` provides `sklearn`, `protobuf` provides `google`)."""
        name = canonical(package)
        if name in self.names:
            return True
        if self._top_level is None:
            self._top_level = frozenset(self._read_top_level())
        return name in self._top_level

    def _read_top_level(self) -> Set[str]:
        names: Set[str] = set()
        for mark in self.marks:
            if self._owner.top_level_left <= 0:
                break
            self._owner.top_level_left -= 1
            try:
                with open(os.path.join(self.path, mark, "top_level.txt"), "rb") as f:
                    text = f.read(MAX_TOP_LEVEL_BYTES).decode("utf-8", "replace")
            except OSError:
                continue
            names.update(canonical(line.strip().split("/")[0]) for line in text.splitlines() if line.strip())
        return names


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
        self.top_level_left = MAX_TOP_LEVEL_FILES

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
                return "/".join(parts[i:])
        return None

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
