"""Stack normalization: raw snapshot frames -> display frames, a stable signature and a site label.

A signature must survive what changes between two runs of the same code: line numbers,
install prefixes (`/home/a/.venv/.../site-packages/torch` vs `D:\\x\\Lib\\site-packages\\torch`),
Python versions (interpreter C frames), how the script was launched (runpy, threading) and
object addresses embedded in names. So it is computed from the frames that say *where in the
program* memory was allocated: Python frames (file key + function) and a few C++ landmarks
(aten ops, autograd nodes, collective communication), and nothing else.

The rules are the tables below; adding a rule is one line and a test.
"""

from __future__ import annotations

import bisect
import hashlib
import posixpath
import re
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Callable, Dict, Generic, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar

from memdiff.errors import brief, clip, number
from memdiff.inert import text
from memdiff.model import Frame
from memdiff.read.accel import TRACES, identities, is_columns
from memdiff.read.installed import InstalledLibraries

# Python's recursion limit is 1,000 frames and C++ adds a few dozen per Python call; a stack far
# deeper than this is pickle memo references repeating one frame.
MAX_STACK_FRAMES = 20_000
# ...and its names add up to far less than this (C++ template names run to a few KB each).
MAX_STACK_CHARS = 16 << 20
# Distinct stacks each cost their frames in full, but a frame costs a file as little as a 5-byte
# memo reference: 4,000 stacks of one new frame plus the same 500 shared ones are 9 MB of pickle
# and 2 million frames to normalize, classify and write out. Real snapshots take at least 24
# decoded bytes per frame normalized (the legacy OPT-13B one; the others 80 to 800), so fewer
# than this many is pickle references multiplying frames.
MIN_FRAME_BYTES = 8

# CPython numbers lines with a C int.
MIN_LINE, MAX_LINE = -(2**31), 2**31 - 1

# Frames PyTorch's own viewers drop (torch/cuda/_memory_viz.py), then interpreter and libc
# frames whose names change with the Python build.
NOISE_NAME_PARTS = (
    "unwind::unwind", "CapturedTraceback::gather", "gather_with_cpp", "_start",
    "__libc_start_main", "PyEval_", "PyObject_", "PyFunction_",
)
NOISE_FILE_PARTS = (
    "core/boxing", "/Register", "/Redispatch", "pythonrun.c", "Modules/main.c",
    "Objects/call.c", "Objects/methodobject.c", "pycore_ceval.h", "ceval.c", "cpython/abstract.h",
)
INTERPRETER_NAME = re.compile(r"^(_?_?Py|_?_?libc|__clone|pthread_|start_thread$|method_vectorcall|cfunction_)")

# Python frames that are plumbing: how a module was called or a script launched, never where
# memory was asked for. Matched against (display file, function).
PLUMBING_PY = (
    (re.compile(r"^stdlib/"), re.compile(r".")),
    (re.compile(r"(^|/)torch/nn/modules/module\.py$"), re.compile(r"^_(wrapped_)?call_impl$")),
    # memdiff's own launcher (`memdiff record`, `memdiff demo`, the console script): how the
    # workload was started, which must not change its signatures.
    (re.compile(r"(^|/)memdiff/(__main__|cli|capture)\.py$|(^|/)memdiff/commands/\w+\.py$|(^|/)bin/memdiff$"),
     re.compile(r".")),
)

# A test runner's own frames (pytest's, and pluggy's hooks under it): the body of a test runs inside
# them, and everything outside the first one is how the session was launched (`pytest`, `python -m
# pytest`, pytest-xdist's worker and execnet's `<string>` frames). A stack is cut there, so that a
# test's groups sign alike whichever way the suite ran: a baseline written by `pytest -n 2` rewrote
# every signature of one written by `pytest`.
TEST_RUNNER = re.compile(r"(^|/)(_pytest|pluggy)/")

# Native frames worth keeping: the op Python called, autograd nodes, communication, a BLAS
# handle's workspace (made by a thread's first matrix product, kept for the handle's life).
NODE_NATIVE = re.compile(r"^torch::autograd::(?:generated::)?(\w+)::apply\b")
LANDMARKS = (
    ("workspace", re.compile(r"^at::cuda::(setWorkspaceForHandle|getCUDABlasLtWorkspace)\b")),
    ("op", re.compile(r"^at::_ops::(\w+)::call\b")),
    ("node", NODE_NATIVE),
    ("engine", re.compile(r"^torch::autograd::Engine::(evaluate_function)\b")),
    ("comm", re.compile(r"(c10d|nccl|ProcessGroup)", re.IGNORECASE)),
)

SHARED_LIBRARY = re.compile(r"\.so(\.[\d.]+)?$")

# Ops that only allocate (what `zeros_like` or `addmm` calls underneath): never the telling op.
FACTORY_OP = re.compile(r"^(new_)?empty(_|$)")

# How generated code asks for its buffers (`empty_strided_cpu`, `empty_strided_cuda` and the ops under them).
COMPILED_FACTORY_OP = re.compile(r"^_?(new_)?empty(_strided)?(_\w+)?$")

# Profiler-derived frames (CPU route): {"filename": "none", "name": "torch/nn/modules/linear.py(130): forward"}.
PROFILER_PY = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\): (?P<name>.+)$")


def profiler_frame(name: str) -> Optional["re.Match[str]"]:
    """PROFILER_PY's match of a frame name. A name with a line break never matches: there `.+$`
    fails after every `(N): ` the lazy file part tries, which is quadratic in a hostile name."""
    return PROFILER_PY.match(name) if "\n" not in name else None
PROFILER_OP = re.compile(r"^<built-in (?:method|function) (\w+)|^aten::(\w+)$")
# The autograd node a backward allocation was made in (memdiff's CPU route, capture._stack).
PROFILER_NODE = re.compile(r"^autograd::engine::evaluate_function: (?:torch::autograd::)?(\w+)$")

PROFILER_MODULE = re.compile(r"^nn\.Module: ")
MODULE_NUMBER = re.compile(r"_\d+$")

HEX = re.compile(r"0x[0-9a-fA-F]+")
NVCC_TMP = re.compile(r"tmpxft_[0-9a-f]+_[0-9a-f]+-\d+_")
LIBRARY_PATH = re.compile(r"/(?:site|dist)-packages/(.+)$")
STDLIB_PATH = re.compile(r"/(?:lib/python\d+(?:\.\d+)?t?|Lib)/(.+)$")
FROZEN = re.compile(r"^<frozen (.+)>$")

# Code torch.compile writes and runs: its file names are hashes or counters that change with
# every shape, layer or torch version, so a generated frame never enters a signature or a site.
# Inductor's output code (`/tmp/torchinductor_root/zc/czcop...u.py`, a `c` and a 51-letter hash,
# under the cache folder or TORCHINDUCTOR_CACHE_DIR), FX GraphModule code (`<eval_with_key>.7`,
# or `<eval_with_key>.7 from model.py:12 in forward`; aot_eager and other FX backends) and FX code
# written for the profiler (`fx_generated__<hash>.py`, whose frames `augment_with_fx_traces`
# gives the original source as `fx_original_trace`).
GENERATED_FILE = re.compile(r"(^|/)(c[a-z0-9]{40,}|fx_generated_\w+)\.py$|(^|/)torchinductor_[^/]*/.*\.py$"
                            r"|^<eval_with_key>")
# What runs a compiled graph between the user's code and the generated code: in a stack that
# holds a generated frame these are plumbing (they differ with the backend and torch version).
COMPILE_PLUMBING = re.compile(r"^torch/(_dynamo|_inductor|_functorch|_higher_order_ops|fx)/"
                              r"|^torch/(autograd/function|_ops|_compile)\.py$")
# One frame of a Python traceback, as `fx_original_trace` holds it.
TRACEBACK_LINE = re.compile(
    # [ \t], never \s: a run of line breaks must not be rescanned from each of them
    r'^[ \t]*File "(?P<file>[^"\n]{1,4096})", line (?P<line>\d{1,10}), in (?P<name>\S{1,256})[ \t]*$', re.MULTILINE)
MAX_ORIGINAL_FRAMES = 64
COMPILED_FILE = "<torch.compile>"
# The module FX generates for a graph (its instance number changes with the graphs compiled before it).
FX_MODULE = re.compile(r"^nn\.Module: GraphModule(_\d+)?$")
# Functions that make several buffers with one op at different lines and keep them for the run,
# which only their lines tell apart (a signature leaves lines out, so they would be one group):
# such a frame is named by its line's place among the lines the function allocates at in the
# snapshot, counted from the last, which is the buffer always made. Megatron-core's
# _ParamAndGradBuffer.__init__ makes its flat parameter buffer (param_data, with the distributed
# optimizer only) and then its flat gradient buffer (grad_data, every weight's main_grad is a view
# of it), both with torch.zeros (0.16.1 and its main branch, read). Matched as (display file, function).
TOLD_BY_LINE = (
    (re.compile(r"(^|/)megatron/core/distributed/param_and_grad_buffer\.py$"), re.compile(r"^__init__$")),
)
# A cheap test before normalizing a raw frame's file: could it be one of TOLD_BY_LINE's?
TOLD_BY_LINE_HINT = re.compile(r"param_and_grad_buffer\.py$")
LAST_LINE = "last allocating line"

# A cheap test before parsing a frame: could it be generated code?
GENERATED_HINT = re.compile(r"torchinductor_|eval_with_key|fx_generated_|c[a-z0-9]{40,}\.py")

FREED_PREFIX = "freed at "
# Memory live before the trace known by the stack of an optimizer's in-place update of it (CPU
# captures: normalize.standins.optimizer_state_stand_ins); rules read it as they read a freeing stack.
UPDATED_PREFIX = "updated in place at "
NO_STACK = "<no stack>"
NO_STACK_BEFORE_TRACE = "<no stack: live before the trace>"
# ...never freed and never updated in a way that tells what it is: its category is a guess
# (parameter, by the built-in rules; docs/categories.md).
NO_STACK_GUESSED = "<no stack: live before the trace, category guessed>"
# ...of which, on CUDA captures, further copies of the sizes of the weights the backward makes
# gradients for: optimizer state made before recording, by guess (normalize.standins.state_by_sizes).
NO_STACK_STATE_GUESSED = "<no stack: live before the trace, optimizer state by its sizes, guessed>"
# ...or a BLAS handle's workspace: of a workspace's size, one per handle the trace uses and makes
# no workspace for (normalize.workspaces.workspaces_by_handles).
NO_STACK_WORKSPACE_GUESSED = "<no stack: live before the trace, a BLAS workspace by its size, guessed>"
GUESS_PARAMETER, GUESS_STATE, GUESS_WORKSPACE = "parameter", "optimizer_state", "workspace"
GUESSED_LABELS = {GUESS_PARAMETER: NO_STACK_GUESSED, GUESS_STATE: NO_STACK_STATE_GUESSED,
                  GUESS_WORKSPACE: NO_STACK_WORKSPACE_GUESSED}


def names_autograd_node(frame_name: str) -> bool:
    """Whether a display frame is an autograd node's, as CUDA stacks with C++ frames or memdiff's
    CPU route name them; a run whose stacks lack them shows its backward by `run_backward`."""
    return bool(PROFILER_NODE.match(frame_name) or NODE_NATIVE.match(frame_name))


@dataclass(frozen=True)
class Stack:
    """What the normalizer keeps of one raw frames list."""

    signature: str
    site: str
    frames: Tuple[Frame, ...]


@dataclass(frozen=True)
class _Kept:
    kind: str  # "py", "module" (profiler nn.Module marker), or a LANDMARKS kind
    file: str
    line: int
    name: str
    label: str  # op or node name for site labels, function for Python frames
    key: str = ""  # the file as the signature sees it
    # A generated frame's original source frames (innermost first) and FX node target, when
    # the snapshot carries them (augment_with_fx_traces)
    original: Tuple["_Kept", ...] = ()
    by_line: bool = False  # a TOLD_BY_LINE function's frame, with the line its code ran at

    @cached_property
    def frame(self) -> Frame:
        """The display frame, one object however many stacks hold this kept frame: a frame
        object per stack would cost memory per frame normalized, not per distinct frame."""
        return Frame(self.file, self.line, self.name)


_NOISE_NAME = re.compile("|".join(re.escape(p) for p in NOISE_NAME_PARTS))
_NOISE_FILE = re.compile("|".join(re.escape(p) for p in NOISE_FILE_PARTS))


def _is_noise(name: str, filename: str) -> bool:
    return bool(_NOISE_NAME.search(name) or _NOISE_FILE.search(filename) or INTERPRETER_NAME.match(name))


def normalize_path(filename: str) -> str:
    """Library files relative to site-packages, the stdlib under `stdlib/`, user code as given.

    User code keeps its absolute path (with `/` separators and no drive letter) until
    `relativize` cuts the project root shared by all of a summary's user files.
    """
    frozen = FROZEN.match(filename)
    if frozen:
        return "stdlib/" + frozen.group(1).replace(".", "/") + ".py"
    p = filename.replace("\\", "/")
    if re.match(r"^[A-Za-z]:/", p):
        p = p[2:]
    if p:
        p = posixpath.normpath(p)
    if "\n" in p:
        return p  # no real path has a line break; the searches below would be quadratic on one
    m = LIBRARY_PATH.search(p)
    if m:
        return m.group(1)
    m = STDLIB_PATH.search(p)
    if m:
        return "stdlib/" + m.group(1)
    return p


def _short_native(name: str) -> str:
    """A C++ symbol without its argument list: `at::_ops::mm::call(...)` -> `at::_ops::mm::call`."""
    name = name.replace("(anonymous namespace)", "{anonymous}")
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif ch == "(" and depth == 0:
            return name[:i]
    return name


def _path_key(path: str) -> str:
    # Library and stdlib paths are already machine-independent; where a project is checked out
    # is not (/home/me/repo vs /home/runner/work/repo/repo), so user files count by name.
    return posixpath.basename(path) if path.startswith("/") else path


def _keep(raw: Any) -> Optional[_Kept]:
    """The kept form of one raw frame, or None when it is noise or uninteresting native code."""
    if not isinstance(raw, dict):
        raise ValueError(f"a frame is {brief(raw)}, not a dict")
    name = raw.get("name", "")
    filename = raw.get("filename", "")
    line = raw.get("line", 0)
    # the profiler names a Python frame by its function's first line: no line tells statements apart
    profiler = filename == "none"
    if not isinstance(name, str) or not isinstance(filename, str) or not isinstance(line, int) or \
            isinstance(line, bool):  # True is an int to Python, not a line number
        raise ValueError(f"a frame has wrong types: name {brief(name)}, filename {brief(filename)}, line {brief(line)}")
    if filename == "none":  # profiler route
        m = profiler_frame(name)
        if m:
            digits = m.group("line").lstrip("0")
            if len(digits) > len(str(MAX_LINE)):  # before int(), which refuses 4,300 digits and more
                raise ValueError(f"a frame's line: a number of {len(digits):,} digits is not a line number")
            numbered = line  # number_compiled_buffers's place of a compiled buffer, else 0
            filename, line, name = m.group("file"), int(digits or "0"), m.group("name")
            if numbered and isinstance(numbered, int) and GENERATED_FILE.search(normalize_path(filename)):
                line = numbered
        elif PROFILER_MODULE.match(name):
            return _Kept("module", "", 0, name, name)
        else:
            node = PROFILER_NODE.match(name)
            if node:
                return _Kept("node", "", 0, name, node.group(1))
            op = PROFILER_OP.match(name)
            clean = HEX.sub("0x…", name)
            return _Kept("op", "", 0, clean, (op.group(1) or op.group(2)) if op else clean)
    if not MIN_LINE <= line <= MAX_LINE:
        raise ValueError(f"a frame's line: {number(line)} is not a line number ({MIN_LINE:,} to {MAX_LINE:,})")
    if filename.endswith(".py") or filename.startswith("<"):
        path = normalize_path(filename)
        if "\n" not in path and GENERATED_FILE.search(path):
            return _Kept("generated", path, line, HEX.sub("0x…", name), name, path, _original(raw))
        by_line = not profiler and any(f.search(path) and n.search(name) for f, n in TOLD_BY_LINE)
        return _Kept("py", path, line, HEX.sub("0x…", name), name, _path_key(path), by_line=by_line)
    if _is_noise(name, filename):
        return None
    for kind, pattern in LANDMARKS:
        m = pattern.search(name) if kind == "comm" else pattern.match(name)
        if m or (kind == "comm" and pattern.search(filename)):
            label = m.group(1) if m and kind != "comm" else _short_native(name)
            shown = "" if filename == "??" else NVCC_TMP.sub("tmpxft_", filename)
            if SHARED_LIBRARY.search(shown):  # torch's own symbolizer names the library by its path
                shown = posixpath.basename(shown)
            return _Kept(kind, shown, 0, _short_native(name), label)
    return None


def _original(raw: Dict[str, Any]) -> Tuple[_Kept, ...]:
    """The source frames `fx_original_trace` names for a generated frame (innermost first), then the
    FX node's target as a marker; () when the snapshot has none (it is written only in the process
    that compiled, with augment_with_fx_traces)."""
    trace = raw.get("fx_original_trace")
    target = raw.get("fx_node_target") or raw.get("fx_node_name")
    if not isinstance(trace, str):
        return ()
    frames = []
    for m in TRACEBACK_LINE.finditer(trace[: 1 << 16]):
        path = normalize_path(m.group("file"))
        if GENERATED_FILE.search(path):
            continue
        frames.append(_Kept("py", path, int(m.group("line")), m.group("name"), m.group("name"), _path_key(path)))
    frames = frames[-MAX_ORIGINAL_FRAMES:]
    if not frames:
        return ()
    marker = [_compiled_marker(f"compiled {clip(text(target), 120)}")] if isinstance(target, str) and target else []
    return (*marker, *reversed(frames))


def _compiled_marker(label: str) -> _Kept:
    return _Kept("compiled", COMPILED_FILE, 0, label, label, COMPILED_FILE)


def _inside_test_runner(kept: List[_Kept]) -> List[_Kept]:
    """The frames inside a test runner's first frame (innermost first): a test's own stack. As it was
    when no runner called it."""
    for i, k in enumerate(kept):
        if k.kind == "py" and TEST_RUNNER.search(k.file):
            return kept[:i]
    return kept


def _is_plumbing(k: _Kept) -> bool:
    return k.kind == "py" and any(f.search(k.file) and n.search(k.name) for f, n in PLUMBING_PY)


def _file_shown(path: str) -> str:
    """A site's file: its name, with its folder where the name alone says nothing (a package's
    `__init__.py`: `autograd/__init__.py`, not one of hundreds of `__init__.py`)."""
    name = posixpath.basename(path)
    if name == "__init__.py":
        folder = posixpath.basename(posixpath.dirname(path))
        return f"{folder}/{name}" if folder else name
    return name


def _site(kept: Sequence[_Kept]) -> str:
    """A short label, caller first: the innermost Python function or autograd node, the op it
    called, and the innermost op doing the work when that is another (`<- linear <- addmm`)."""
    ops: List[str] = []
    where = None
    workspace = []  # a BLAS workspace is named last: the op only asked for it
    compiled: List[str] = []
    for k in kept:
        if k.kind == "op":
            ops.append(k.label)
        elif k.kind == "workspace":
            workspace = [k.label]
        elif k.kind == "compiled":
            compiled = [k.label]
            ops = [op for op in ops if not COMPILED_FACTORY_OP.match(op)]  # what every buffer calls
        elif k.kind in ("py", "node"):
            where = f"{_file_shown(k.file)}:{k.label}" if k.kind == "py" else k.label
            break
    if not ops:
        return " <- ".join(([where] if where else []) + compiled + workspace) or (kept[0].label if kept else NO_STACK)
    chain = compiled + [ops[-1]]  # the outermost op: the one the caller asked for
    working = next((op for op in ops if not FACTORY_OP.match(op)), None)
    if working and working != ops[-1]:
        chain.append(working)
    return " <- ".join(([where] if where else []) + chain + workspace)


def signature_of(parts: Iterable[str]) -> str:
    """A 16-hex-digit id for a sequence of frame keys (blake2b; never Python's salted hash())."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\n")
    return h.hexdigest()


_UNSEEN = object()
T = TypeVar("T")


class PerFrames(Generic[T]):
    """A value computed once per distinct sequence of frame objects, whatever list holds them.

    In a real snapshot each event has a frames list of its own, but pickle memo references share
    the frame dicts themselves (the ctx128 training run: 6,526 lists, 295k frame references, 561
    frame dicts). So a list is looked up by its identity first, then by the identities of the
    frames it holds: a hostile file repeating one 20,000-frame list costs one scan, not one per
    event. The snapshot keeps every list and frame alive while this runs.
    """

    def __init__(self, compute: Callable[[List[Any], Any], T]) -> None:
        self._compute = compute
        self._by_list: Dict[Tuple[int, Any], T] = {}
        self._by_frames: Dict[Tuple[Any, ...], T] = {}

    def get(self, raw_frames: List[Any], extra: Any = None) -> T:
        """compute(raw_frames, extra), or the value already computed for the same frames and extra."""
        key = (id(raw_frames), extra)
        hit: Any = self._by_list.get(key, _UNSEEN)  # a T, or the sentinel
        if hit is _UNSEEN:
            same = (extra, identities(raw_frames))
            hit = self._by_frames.get(same, _UNSEEN)
            if hit is _UNSEEN:
                hit = self._by_frames[same] = self._compute(raw_frames, extra)
            self._by_list[key] = hit
        return hit


class StackNormalizer:
    """Normalizes raw frames lists, once per distinct sequence of frame objects (see PerFrames).

    Given `decoded_bytes`, the size of the stream the frames were decoded from, it normalizes at
    most one frame per MIN_FRAME_BYTES of it in all, and raises ValueError past that."""

    def __init__(self, decoded_bytes: Optional[int] = None) -> None:
        self._stacks: PerFrames[Stack] = PerFrames(self._normalized)
        self._frames: Dict[Tuple[Any, Any, Any], Optional[_Kept]] = {}
        self.computed = 0
        self._decoded_bytes = decoded_bytes or 0
        self._frame_budget = None if decoded_bytes is None else max(1, decoded_bytes) // MIN_FRAME_BYTES
        self._frames_left = self._frame_budget
        self._updates: Dict[int, Any] = {}  # id -> frames list standing in as an in-place update's
        # generated file -> the lines of it the snapshot's stacks hold, ascending: a line's rank is
        # its buffer's place in the compiled graph, the same for the graph compiled for other shapes
        self._generated: Dict[str, List[int]] = {}
        self._generated_source: Optional[Callable[[], Iterable[Any]]] = None
        # (file, function) of TOLD_BY_LINE -> the lines it allocates at in the snapshot, ascending
        self._lines: Dict[Tuple[str, str], List[int]] = {}
        self._lines_source: Optional[Callable[[], Iterable[Any]]] = None
        # user-looking files that are a library installed outside site-packages (installed.py)
        self._installed = InstalledLibraries()

    def learn_generated_from(self, source: Callable[[], Iterable[Any]]) -> None:
        """learn_generated(source()), once, when the first generated frame is met: a snapshot
        without compiled code pays nothing for it."""
        self._generated_source = source

    def learn_generated(self, frames_lists: Iterable[Any]) -> None:
        """Read the lines of generated code (GENERATED_FILE) the snapshot's stacks hold, before any
        stack is normalized, so that each compiled buffer is numbered by its place in its graph.
        Stops quietly past the frame budget and skips what is not a frame: normalizing says why."""
        lines: Dict[str, set] = {}
        for raw in self._distinct_frames(frames_lists):
            text = raw.get("name") if raw.get("filename") == "none" else raw.get("filename")
            if not isinstance(text, str) or not GENERATED_HINT.search(text):
                continue
            kept = self._kept_or_none(raw)
            if kept is not None and kept.kind == "generated":
                lines.setdefault(kept.file, set()).add(kept.line)
        self._generated = {f: sorted(ls) for f, ls in lines.items()}

    def _distinct_frames(self, frames_lists: Iterable[Any]) -> Iterator[Dict[str, Any]]:
        """Each distinct raw frame (by identity) of the lists, read before normalizing; stops quietly
        past the frame budget and passes over what is not a frame: normalizing says why."""
        seen_lists: set = set()
        seen_frames: set = set()
        left = self._frame_budget
        for frames in frames_lists:
            if not isinstance(frames, list) or id(frames) in seen_lists:
                continue
            seen_lists.add(id(frames))
            if left is not None:
                left -= len(frames)
                if left < 0:
                    return
            for raw in frames:
                if id(raw) not in seen_frames and isinstance(raw, dict):
                    seen_frames.add(id(raw))
                    yield raw

    def _kept_or_none(self, raw: Dict[str, Any]) -> Optional[_Kept]:
        try:
            return self._keep(raw)
        except ValueError:
            return None

    def learn_lines_from(self, source: Callable[[], Iterable[Any]]) -> None:
        """Read, once, when the first frame of a TOLD_BY_LINE function is met, the lines such
        functions allocate at in the frames lists `source()` gives (the allocations' and the dump
        blocks', not the frees'): a snapshot without them pays nothing."""
        self._lines_source = source

    def _learn_lines(self, frames_lists: Iterable[Any]) -> None:
        lines: Dict[Tuple[str, str], set] = {}
        for raw in self._distinct_frames(frames_lists):
            filename = raw.get("filename")
            if not isinstance(filename, str) or not TOLD_BY_LINE_HINT.search(filename):
                continue
            kept = self._kept_or_none(raw)
            if kept is not None and kept.by_line:
                lines.setdefault((kept.file, kept.name), set()).add(kept.line)
        self._lines = {k: sorted(ls) for k, ls in lines.items()}

    def _told_by_line(self, k: _Kept) -> _Kept:
        """A TOLD_BY_LINE frame named by its line's place, counted from the last line its function
        allocates at (`__init__ (last allocating line)`), in its site and its signature alike; as it
        was when its line is not among those learnt (a stack normalized on its own)."""
        if self._lines_source is not None:
            source, self._lines_source = self._lines_source, None
            self._learn_lines(source())
        lines = self._lines.get((k.file, k.name), [])
        i = bisect.bisect_left(lines, k.line)
        if i == len(lines) or lines[i] != k.line:
            return k
        back = len(lines) - i
        place = LAST_LINE if back == 1 else f"allocating line {back} from last"
        return replace(k, label=f"{k.label} ({place})", key=f"{k.key}[-{back}]")

    def mark_updates(self, frames_lists: Iterable[Any]) -> None:
        """Frames lists memdiff made from an optimizer's in-place update, standing in for the stack
        of memory live before the trace: as freed stacks their sites read `updated in place at`,
        everywhere they are shown. Kept alive here, as stacks are cached by the identity of lists."""
        self._updates.update((id(frames), frames) for frames in frames_lists)

    def stack(self, raw_frames: Optional[List[Any]], freed: bool = False, before_trace: bool = False,
              guess: Optional[str] = None) -> Stack:
        """The Stack for one raw frames list; `freed` marks a free's stack standing in for an allocation's,
        `guess` (GUESS_PARAMETER or GUESS_STATE) the category guessed for memory without one."""
        if not raw_frames:
            label = (GUESSED_LABELS[guess] if guess else NO_STACK_BEFORE_TRACE) if before_trace else NO_STACK
            return Stack(signature_of([label]), label, ())
        if not isinstance(raw_frames, list):
            raise ValueError(f"'frames' is {brief(raw_frames)}, not a list")
        if len(raw_frames) > MAX_STACK_FRAMES:
            raise ValueError(f"a stack of {len(raw_frames):,} frames, deeper than any program's "
                             f"(at most {MAX_STACK_FRAMES:,} are read): not a real snapshot")
        prefix = (UPDATED_PREFIX if id(raw_frames) in self._updates else FREED_PREFIX) if freed else ""
        return self._stacks.get(raw_frames, prefix)

    def _normalized(self, raw_frames: List[Any], prefix: str) -> Stack:
        self.computed += 1
        if self._frames_left is not None:
            self._frames_left -= len(raw_frames)
            if self._frames_left < 0:
                raise ValueError(f"not a memory snapshot: its stacks hold more than {self._frame_budget:,} frames in "
                                 f"{self._decoded_bytes:,} bytes (pickle references sharing frame lists; real "
                                 f"snapshots take dozens of bytes a frame)")
        kept = _inside_test_runner([k for k in map(self._keep, raw_frames) if k is not None])
        if any(k.kind == "generated" for k in kept):
            kept = self._compiled(kept)
        if any(k.by_line for k in kept):
            kept = [self._told_by_line(k) if k.by_line else k for k in kept]
        chars = sum(len(k.name) + len(k.key) for k in kept)
        if chars > MAX_STACK_CHARS:
            raise ValueError(f"a stack of {chars:,} characters (pickle references repeating a long frame?): "
                             f"not a real snapshot")
        # A profiler module scope counts by its class (`nn.Module: BertIntermediate`), not its
        # instance number, which changes when a layer is added before it.
        parts = [f"{k.key}:{k.name}" if k.kind == "py" else MODULE_NUMBER.sub("", k.name) if k.kind == "module"
                 else k.name for k in kept]
        site = _site(kept)
        if prefix:  # a stack standing in for the allocation's: signed as every freed stack is
            parts.insert(0, "freed")
            site = prefix + site
        frames = tuple(k.frame for k in kept)
        return Stack(signature_of(parts), site, frames)

    def _compiled(self, kept: List[_Kept]) -> List[_Kept]:
        """A stack through compiled code, named by the model code that ran it: the innermost
        generated frame becomes its original source frames where the snapshot carries them, else
        a marker with the buffer's place in its graph; the other generated frames and the torch
        frames that run a compiled graph go."""
        out: List[_Kept] = []
        placed = running = False
        for k in kept:
            if k.kind == "generated":
                if not placed:
                    placed = running = True
                    out.extend(k.original or (_compiled_marker(f"compiled buffer {self._buffer(k)}"),))
                continue
            if k.kind == "py" and COMPILE_PLUMBING.search(k.file) or k.kind == "module" and FX_MODULE.match(k.name):
                continue
            if k.kind == "op" and (running or k.label.startswith("<")):
                # what the compiled graph's runtime called (autograd.Function.apply), or an FX node's
                # OpOverload, which the profiler names `<built-in method  of pybind11...>`: no op of the model's
                continue
            running = running and k.kind not in ("py", "node", "module")
            out.append(k)
        return out

    def _buffer(self, k: _Kept) -> str:
        if self._generated_source is not None:
            source, self._generated_source = self._generated_source, None
            self.learn_generated(source())
        lines = self._generated.get(k.file)
        if lines:
            i = bisect.bisect_left(lines, k.line)
            if i < len(lines) and lines[i] == k.line:
                return str(i + 1)
        return f"at line {k.line}"  # not learnt (a stack normalized on its own): still no file name

    def _keep(self, raw: Any) -> Optional[_Kept]:
        # Distinct lists still repeat the same frames (every CUDA stack starts with the same
        # allocator frames), so each distinct frame is classified once.
        try:
            key = (raw["name"], raw["filename"], raw["line"])
            hit: Any = self._frames.get(key, _UNSEEN)  # an Optional[_Kept], or the sentinel
        except (KeyError, TypeError, IndexError):
            return _keep(raw)  # not a well-formed frame: _keep reads what it can or says why not
        if hit is not _UNSEEN:
            return hit
        kept = _keep(raw)
        if kept is not None and kept.kind in ("py", "generated"):
            kept = self._as_installed(kept)
        if kept is not None and _is_plumbing(kept):
            kept = None
        self._frames[key] = kept
        return kept

    def _as_installed(self, k: _Kept) -> _Kept:
        """A Python frame of a library installed outside site-packages (`pip install --target`, a
        PYTHONPATH folder) by its package path, as a site-packages frame is; as it was otherwise."""
        if k.kind == "generated":
            original = tuple(self._as_installed(o) for o in k.original)
            return k if original == k.original else replace(k, original=original)
        if not k.file.startswith("/"):
            return k
        package = self._installed.package_path(k.file)
        return k if package is None else replace(k, file=package, key=_path_key(package))


def _generated_at(frames: Any) -> Optional[Tuple[int, str]]:
    """(index, file) of the innermost generated frame of a profiler-route frames list, else None."""
    if not isinstance(frames, list):
        return None
    for i, raw in enumerate(frames[:MAX_STACK_FRAMES]):
        if not isinstance(raw, dict) or raw.get("filename") != "none":
            continue
        name = raw.get("name")
        if not isinstance(name, str) or not GENERATED_HINT.search(name):
            continue
        m = profiler_frame(name)
        if m and GENERATED_FILE.search(normalize_path(m.group("file"))):
            return i, m.group("file")
    return None


def _profiler_route(trace: List[Any]) -> bool:
    """Whether a trace's frames are the profiler route's (`filename` "none"), by its first stack."""
    for e in trace:
        frames = e.get("frames") if isinstance(e, dict) else None
        if isinstance(frames, list) and frames:
            return isinstance(frames[0], dict) and frames[0].get("filename") == "none"
    return False


def number_compiled_buffers(device_traces: Any) -> None:
    """Number, on memdiff's CPU route, each buffer a compiled graph allocates by its place in one
    run of the graph, in place: the profiler names a Python frame by its function's first line,
    so every buffer of Inductor's `call` has the same frame. An allocation's generated frame is
    replaced (in a new frames list, shared with the frees of the same address) by one whose `line`
    is the buffer's place: 1 for the first allocation after any allocation outside that graph,
    then 2, 3... A graph run twice with nothing allocated between counts on. CUDA frames carry
    their own lines and are left as they are."""
    for d, trace in enumerate(device_traces if isinstance(device_traces, list) else ()):
        if not isinstance(trace, TRACES) or not _profiler_route(trace):
            continue
        if not isinstance(trace, list):  # columns are read-only: this route's traces are small
            trace = device_traces[d] = list(trace)
        found: Dict[int, Optional[Tuple[int, str]]] = {}
        numbered: Dict[Tuple[int, Any], List[Any]] = {}  # (id of the old list, address) -> new list
        current, count = None, 0
        for e in trace:
            if not isinstance(e, dict):
                continue
            frames = e.get("frames")
            if e.get("action") != "alloc":
                new = numbered.get((id(frames), e.get("addr")))
                if new is not None:
                    e["frames"] = new
                continue
            key = id(frames)
            if key not in found:
                found[key] = _generated_at(frames)
            at = found[key]
            if at is None or not isinstance(frames, list):
                current = None
                continue
            index, file = at
            count = count + 1 if file == current else 1
            current = file
            new = list(frames)
            new[index] = {"filename": "none", "name": frames[index]["name"], "line": count}
            numbered[(key, e.get("addr"))] = new
            e["frames"] = new


def frames_lists(device_traces: Any, segments: Any) -> Iterator[Any]:
    """Every frames list of a snapshot, trace entries first, then the dump's blocks (what is not
    a list or a dict is passed over: the reader says why elsewhere)."""
    for trace in device_traces if isinstance(device_traces, list) else ():
        if is_columns(trace):
            yield from trace.values("frames")
            continue
        for e in trace if isinstance(trace, list) else ():
            if isinstance(e, dict):
                yield e.get("frames")
    for segment in segments if isinstance(segments, list) else ():
        for block in segment.get("blocks", ()) if isinstance(segment, dict) else ():
            if isinstance(block, dict):
                yield block.get("frames")


def allocation_frames_lists(device_traces: Any, segments: Any) -> Iterator[Any]:
    """The frames lists of a snapshot's allocations (trace entries whose action is `alloc`), then
    of the dump's blocks: where memory was asked for, never where it was freed."""
    for trace in device_traces if isinstance(device_traces, list) else ():
        if is_columns(trace):
            yield from (f for a, f in zip(trace.values("action"), trace.values("frames")) if a == "alloc")
            continue
        for e in trace if isinstance(trace, list) else ():
            if isinstance(e, dict) and e.get("action") == "alloc":
                yield e.get("frames")
    for segment in segments if isinstance(segments, list) else ():
        for block in segment.get("blocks", ()) if isinstance(segment, dict) else ():
            if isinstance(block, dict):
                yield block.get("frames")


def relativize(frame_lists: Sequence[Sequence[Frame]]) -> List[List[Frame]]:
    """Display paths of user code relative to its common root (the project), libraries untouched."""
    user_dirs = {posixpath.dirname(f.file) for frames in frame_lists for f in frames if f.file.startswith("/")}
    if not user_dirs:
        return [list(frames) for frames in frame_lists]
    root = posixpath.commonpath(sorted(user_dirs))
    cut = len(root.rstrip("/")) + 1
    return [
        [Frame(f.file[cut:], f.line, f.name) if f.file.startswith("/") else f for f in frames]
        for frames in frame_lists
    ]
