"""A module of torch's or a library's patched right after it runs, the first time it is imported: for
modules the emulator must change but which a script may import before or after the emulator starts."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Collection, Iterator, List, Optional, Tuple

# What a patch sets on a module it is given: (owner, attribute, replacement).
Setting = Tuple[Any, str, Any]


class AfterImport:
    """A meta-path finder: each module of `names` is found by the finders after this one, and its
    loader runs `patch(name, module)` once the module's code has run."""

    def __init__(self, names: Collection[str], patch: Callable[[str, Any], None]) -> None:
        self.names = names
        self.patch = patch

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        """The spec the other finders give `name`, its loader patching the module it runs."""
        if name not in self.names or self not in sys.meta_path:
            return None
        spec = None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1:]:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec
        run, patch = loader.exec_module, self.patch

        def exec_module(module: Any) -> None:
            run(module)
            patch(name, module)
        loader.exec_module = exec_module
        return spec


@contextlib.contextmanager
def patched_on_import(names: Collection[str], patch: Callable[[str, Any], Optional[Setting]]) -> Iterator[None]:
    """For the block: `patch(name, module)` of each module of `names` imported before the block or in
    it, the attribute it returns set to its replacement (None: nothing to set); each restored after."""
    done: List[Tuple[Any, str, Any]] = []

    def apply(name: str, module: Any) -> None:
        setting = patch(name, module)
        if setting is not None:
            owner, attribute, replacement = setting
            done.append((owner, attribute, owner.__dict__[attribute]))
            setattr(owner, attribute, replacement)
    for name in names:
        if name in sys.modules:
            apply(name, sys.modules[name])
    finder = AfterImport(names, apply)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
        for owner, attribute, real in reversed(done):
            setattr(owner, attribute, real)
