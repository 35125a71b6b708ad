"""The run's imports see the tree as its file calls do (overlay.py): a module the run wrote imports.

Python's import system reads the disk in native code (`posix.stat`, `posix.listdir`, `io.open_code`),
around the file calls overlay_calls.py routes, so a module the run wrote lay in the overlay's upper
layer where no import found it. Libraries do write modules and import them: evaluate.load and datasets
copy a metric's or loader's script into HF_HOME/modules and import it from there, transformers its
remote code. A path hook in front of the standard ones gives each folder on sys.path (and each
package's folder) a finder that looks where the run looks: a folder the run never wrote into is read
by the standard finder, as it is; in one it did, each name is looked for in the run's view, the run's
copy first, a file it deleted not found. Modules found so are named by the paths the run sees
(`__file__` in the user's tree, a package's folders there), so what they import in turn is looked for
the same way.
"""

from __future__ import annotations

import importlib.machinery as machinery
import importlib.util
import inspect
import os
import stat
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from memdiff.recording.emulate.overlay import Overlay, _builtin_open, _isdir, _stat, missing

# The standard finder's loaders and the suffixes each loads, in the order it tries them.
_DETAILS: List[Tuple[Any, List[str]]] = [(machinery.ExtensionFileLoader, machinery.EXTENSION_SUFFIXES),
                                         (machinery.SourceFileLoader, machinery.SOURCE_SUFFIXES),
                                         (machinery.SourcelessFileLoader, machinery.BYTECODE_SUFFIXES)]


def _real(overlay: Overlay, path: str) -> str:
    """The real file holding what the run sees at `path`; FileNotFoundError where nothing is."""
    real = overlay.where(path)
    if real is None:
        raise missing(path)
    return real


class _RunsView:
    """A file loader that reads the run's copy of a module, never the user's old one."""

    def __init__(self, fullname: str, path: str, overlay: Overlay) -> None:
        super().__init__(fullname, path)  # type: ignore[call-arg]  # the file loader's, next in the MRO
        self.overlay = overlay

    def get_data(self, path: str) -> bytes:
        with _builtin_open(_real(self.overlay, path), "rb") as f:
            return f.read()


# typeshed's SourceLoader and InspectLoader disagree on source_to_code's signature; the mixin adds neither
class _Source(_RunsView, machinery.SourceFileLoader):  # type: ignore[misc]
    """A source module as the run sees it, its timestamps the run's copy's."""

    def path_stats(self, path: str) -> Dict[str, Any]:
        found = _stat(_real(self.overlay, path))
        return {"mtime": found.st_mtime, "size": found.st_size}


class _Sourceless(_RunsView, machinery.SourcelessFileLoader):
    """A bytecode-only module as the run sees it."""


class _Finder:
    """The path-entry finder of folder `entry` (absolute, as the run names it) for the run's imports."""

    def __init__(self, entry: str, overlay: Overlay) -> None:
        self.entry = entry
        self.overlay = overlay
        self.real = overlay.resolve(entry)  # the folder with the links on its way followed in the run's view
        self._standard: Optional[machinery.FileFinder] = None

    def _touched(self) -> bool:
        """Whether the run wrote or deleted anything in this folder (or deleted a folder above it)."""
        overlay = self.overlay
        return (_isdir(overlay.up(self.real)) or _isdir(os.path.join(overlay.gone, self.real.lstrip(os.sep)))
                or overlay.hidden(self.real))

    def _kind(self, path: str) -> Optional[int]:
        """The mode of what the run sees at `path`, None where nothing is there."""
        real = self.overlay.where(path)
        if real is None:
            return None
        try:
            return _stat(real).st_mode
        except (OSError, ValueError):
            return None

    def find_spec(self, fullname: str, target: Any = None) -> Optional[machinery.ModuleSpec]:
        """The spec of module `fullname` in this folder as the run sees it, else None."""
        if not self._touched():
            if self._standard is None:
                self._standard = machinery.FileFinder(self.entry, *_DETAILS)
            return self._standard.find_spec(fullname, target)
        tail = fullname.rpartition(".")[2]
        folder = os.path.join(self.entry, tail)
        kind = self._kind(folder)
        if kind is not None and stat.S_ISDIR(kind):
            for loader, suffixes in _DETAILS:
                for suffix in suffixes:
                    init = os.path.join(folder, "__init__" + suffix)
                    found = self._spec(fullname, init, loader, [folder])
                    if found is not None:
                        return found
        for loader, suffixes in _DETAILS:
            for suffix in suffixes:
                found = self._spec(fullname, folder + suffix, loader, None)
                if found is not None:
                    return found
        if kind is not None and stat.S_ISDIR(kind):  # a namespace package's portion, as the standard finder says
            spec = machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [folder]
            return spec
        return None

    def _spec(self, fullname: str, path: str, loader: Any,
              package: Optional[List[str]]) -> Optional[machinery.ModuleSpec]:
        kind = self._kind(path)
        if kind is None or not stat.S_ISREG(kind):
            return None
        made: Any
        if loader is machinery.ExtensionFileLoader:  # loaded by the dynamic linker: the real file's path
            path = self.overlay.where(path) or path
            made = loader(fullname, path)
        elif loader is machinery.SourceFileLoader:
            made = _Source(fullname, path, self.overlay)
        else:
            made = _Sourceless(fullname, path, self.overlay)
        return importlib.util.spec_from_file_location(fullname, path, loader=made,
                                                      submodule_search_locations=package)

    def iter_modules(self, prefix: str = "") -> Iterator[Tuple[str, bool]]:
        """pkgutil.iter_modules(): the folder's modules and packages as the run sees them, by the
        standard finder's rules (plugin discovery; pkgutil lists nothing for a finder without this)."""
        try:
            names = self.overlay.names(self.entry)
        except OSError:  # unreadable, or gone: nothing, as import says
            return
        seen = set()
        for name in names:  # sorted: a package before a module of the same name
            module = inspect.getmodulename(name)
            package = False
            if not module and "." not in name:
                kind = self._kind(os.path.join(self.entry, name))
                inside = self.overlay.names(os.path.join(self.entry, name)) if kind and stat.S_ISDIR(kind) else []
                package = any(inspect.getmodulename(n) == "__init__" for n in inside)
                module = name if package else None
            if module and module != "__init__" and "." not in module and module not in seen:
                seen.add(module)
                yield prefix + module, package

    def invalidate_caches(self) -> None:
        """importlib.invalidate_caches(): the standard finder reads its folder afresh."""
        if self._standard is not None:
            self._standard.invalidate_caches()


def path_hook(overlay: Overlay) -> Callable[[str], _Finder]:
    """The hook that gives each folder of sys.path, as the run sees it, a finder that looks there as
    the run looks; anything else (a zip archive, a path that is not there) is left to the next hook."""

    def hook(entry: str) -> _Finder:
        path = os.path.abspath(os.fsdecode(entry) or os.getcwd())
        if overlay.passes(path):
            raise ImportError("memdiff's own path: the standard finder reads it", path=entry)
        real = overlay.where(path)
        try:
            is_folder = real is not None and stat.S_ISDIR(_stat(real).st_mode)
        except (OSError, ValueError):
            is_folder = False
        if not is_folder:
            raise ImportError("not a folder in the run's view", path=entry)
        return _Finder(path, overlay)

    return hook


def routes(overlay: Overlay) -> List[Tuple[Any, str, Any]]:
    """What the run's imports use for the overlay's block: its path hook first, and a fresh cache of
    finders (those made before it would keep reading around the overlay)."""
    return [(sys, "path_hooks", [path_hook(overlay), *sys.path_hooks]), (sys, "path_importer_cache", {})]
