"""Triton kernels a script or library launches itself: `kernel[grid](...)` of a `@triton.jit` function
(trl's chunked log-probability loss folds each logits tile so, where Triton is installed).

On the GPU such a launch allocates no device memory: the kernel reads and writes the tensors it is
given, which the caller made (and the emulator allocated) before. So under emulation a launch runs
nothing and allocates nothing, as Inductor's own kernels do (compiled.py); what it writes has no value
known any more, and what it only reads keeps its values (a batch's labels). Which parameters it writes
is read from the kernel's source: those whose pointers reach `tl.store` or an atomic, directly or
through the arithmetic that offsets them, and any passed on to another function the kernel calls.
Without this the launch reached Triton's CUDA driver, which a machine without a GPU lacks
(`libcuda.so cannot found`), and the run stopped.

A kernel tuned by `triton.autotune` picks its config without benchmarks (triton_autotune.py) and
is launched through this path.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Set

from memdiff.recording.emulate.on_import import patched_on_import
from memdiff.recording.emulate.values import forget_written

_JIT = "triton.runtime.jit"
# Roots of the calls that are Triton's language, not a function that may store through its arguments.
_LANGUAGE = frozenset({"tl", "triton", "libdevice", "math"})
_BUILTINS = frozenset(dir(builtins))


def written_parameters(source: str, parameters: List[str]) -> Optional[FrozenSet[str]]:
    """The names of `parameters` a kernel of `source` may write through; None when the source does
    not parse as one function (then every tensor it is given counts as written)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    if not tree.body or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    derived: Dict[str, Set[str]] = {}  # a name, and the names its assignments were computed from
    roots: Set[str] = set()  # names a store writes through
    for node in ast.walk(tree.body[0]):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.iter if isinstance(node, ast.For) else node.value
            used = _names(value) if value is not None else set()
            for target in targets:
                for name in _names(target):
                    derived.setdefault(name, set()).update(used)
        elif isinstance(node, ast.Call):
            roots |= _stored_through(node)
    reached, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(derived.get(name, ()))
    return frozenset(p for p in parameters if p in reached)


def _names(node: ast.AST) -> Set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _stored_through(call: ast.Call) -> Set[str]:
    """The names a call may write through: `tl.store(ptr, ...)`'s and atomics' pointer, a descriptor's
    or block pointer's own `.store(...)`, and every argument of a function that is not the language's."""
    func = call.func
    if isinstance(func, ast.Attribute):
        root = func.value
        while isinstance(root, ast.Attribute):
            root = root.value
        in_language = isinstance(root, ast.Name) and root.id in _LANGUAGE
        writes = func.attr == "store" or func.attr.startswith("atomic_")
        if in_language and writes:
            pointer = call.args[0] if call.args else next(
                (k.value for k in call.keywords if k.arg == "pointer"), None)
            return _names(pointer) if pointer is not None else set()
        if in_language:
            return set()
        if writes:  # desc.store(offsets, value): the descriptor is written through
            return _names(func.value)
    elif isinstance(func, ast.Name) and func.id in _BUILTINS:
        return set()
    # another function: it may store through whatever it is given
    return set().union(*(_names(a) for a in call.args), *(_names(k.value) for k in call.keywords))


def _launch(cache: Dict[int, Any]) -> Callable[..., None]:
    def run(self: Any, *args: Any, grid: Any = None, warmup: bool = False, **kwargs: Any) -> None:
        """A launch (or a warm-up, which only compiles): nothing runs or is allocated, and what the
        kernel writes has no value known any more."""
        if warmup:
            return None
        if id(self) not in cache:  # the kernel is held beside its answer, so its id stays its own
            cache[id(self)] = (self, written_parameters(getattr(self, "src", ""), list(self.arg_names)))
        written = cache[id(self)][1]
        given = dict(zip(self.arg_names, args))
        given.update(kwargs)
        forget_written([value for name, value in given.items() if written is None or name in written])
        return None
    return run


@contextlib.contextmanager
def launches_allocate_nothing() -> Iterator[None]:
    """For the block: every `@triton.jit` kernel's launch runs as above, whether Triton was imported
    before the emulator started or is imported while it runs."""
    cache: Dict[int, Any] = {}
    with patched_on_import((_JIT,), lambda name, module: (module.JITFunction, "run", _launch(cache))):
        yield
