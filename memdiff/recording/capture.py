"""Capture a memory snapshot of a block of PyTorch code, on CUDA or, without a GPU, on CPU.

This is the one module that imports torch, and only when called: the analysis never needs it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import signal
import sys
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from memdiff.atomic import write_output
from memdiff.errors import InputError
from memdiff.numbers import DIGITS, SPACE
from memdiff.recording.snapshot_file import dump

STACKS = ("python", "all")
# How the profiler names the autograd engine running a node: `...: AddmmBackward0`.
AUTOGRAD_NODE = "autograd::engine::evaluate_function: "
# The name of a frame torch's profiler could no longer read (_name).
UNREADABLE = "<a frame whose name torch's profiler lost>"


class CaptureError(InputError):
    """Capture cannot work here (no torch, or a torch without the API it needs)."""


def torch_module() -> Any:
    """The torch module, or a CaptureError (exit 2) saying how to install it."""
    try:
        import torch
    except ImportError:
        # Not `pip install memdiff[torch]`: an unpinned torch pulls several GB of CUDA wheels on Linux.
        raise CaptureError("torch", "capturing needs PyTorch: pip install torch (without a GPU, its CPU build: "
                                    "pip install torch --index-url https://download.pytorch.org/whl/cpu); "
                                    "the analysis commands do not") from None
    return torch


def write_status(path: str, document: Dict[str, Any]) -> None:
    """Write a rank's small status document (JSON) atomically, for `memdiff record` to read."""
    write_output(path, json.dumps(document))


@contextlib.contextmanager
def sigint_held(signals: Sequence[int] = (signal.SIGINT,)) -> Iterator[List[int]]:
    """Hold Ctrl-C (and any other of `signals`: `memdiff record` holds SIGTERM and SIGHUP too) while a
    snapshot is written: a second Ctrl-C (or the one a launcher passes on after the terminal's own) must
    not cut the write short and lose what was recorded. Yields the list the signals that came are put
    in; off the main thread, where no handler can be set (and where no signal is handled), it holds
    nothing."""
    held: List[int] = []
    previous: Dict[int, Any] = {}
    try:
        for s in signals:
            previous[s] = signal.signal(s, lambda signum, _frame: held.append(signum))
    except ValueError:
        yield held
        return
    try:
        yield held
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def recorded_nothing(snapshot: Dict[str, Any]) -> bool:
    """Whether a fresh snapshot holds no allocation at all (no trace event, no live block)."""
    return not any(snapshot.get("device_traces") or []) and not any(
        b.get("state") == "active_allocated" for s in snapshot.get("segments") or [] for b in s.get("blocks", []))


def _history_options(record_history: Any) -> Dict[str, Any]:
    """Options this torch's `_record_memory_history` takes beyond the basic ones: record_function
    scopes (`global_record_annotations`, torch 2.5+) give memdiff steps and phases from PyTorch
    itself instead of reading them off the stacks."""
    try:
        accepted = inspect.signature(record_history).parameters
    except (TypeError, ValueError):
        return {}
    return {"global_record_annotations": True} if "global_record_annotations" in accepted else {}


def _without_checkpoint_early_stop(torch: Any) -> contextlib.AbstractContextManager:
    """Non-reentrant activation checkpointing with its early stop turned off.

    The early stop ends a recomputation by raising an exception from inside an operator; with the
    allocator's history on, that exception is lost and the training fails with `SystemError: ...
    returned NULL without setting an exception` (torch 2.11, H100, Hugging Face GPT-2 with
    gradient checkpointing, stacks python and all alike). Without the early stop the
    recomputation runs to the end of each checkpointed segment: the same saved tensors, plus the
    segment's last few temporaries. docs/recording.md says so to users.
    """
    from torch.utils import checkpoint

    early_stop = getattr(checkpoint, "set_checkpoint_early_stop", None)
    return early_stop(False) if early_stop is not None else contextlib.nullcontext()


# How torch names the C++ frames of a snapshot, unless the user chose (TORCH_SYMBOLIZE_MODE):
# its own reader of the libraries' symbols, in this process. The default on some versions runs
# `addr2line` children, which a launcher's SIGTERM (torchrun stopping the other ranks when one
# fails) or a Ctrl-C reaches too: the snapshot then fails (`RuntimeError: stoi`, torch 2.11) and
# the rank's snapshot is lost just when it is wanted.
SYMBOLIZE_MODE = ("TORCH_SYMBOLIZE_MODE", "fast")


# How many of memdiff's own recordings of the caching allocator's history are open in this process.
# The history is one per process: a recording opened inside another (a Trainer callback's window in a
# script run under `memdiff record`) reads the trace from where it stood when it opened, and leaves the
# history on for the outer one.
_OPEN_CUDA_RECORDINGS = [0]


def start_cuda(torch: Any, max_entries: int, stacks: str) -> Callable[[], Any]:
    """Start the caching allocator's history; the returned function stops it and gives the snapshot."""
    os.environ.setdefault(*SYMBOLIZE_MODE)  # read by torch when it first names frames: at the snapshot
    inner = _OPEN_CUDA_RECORDINGS[0] > 0
    if inner:
        marks = _trace_marks(torch.cuda.memory._snapshot())
    else:
        record_history = torch.cuda.memory._record_memory_history
        record_history(enabled="all", stacks=stacks, max_entries=max_entries, **_history_options(record_history))
        early_stop = _without_checkpoint_early_stop(torch)  # on only once the history is
        early_stop.__enter__()
    _OPEN_CUDA_RECORDINGS[0] += 1

    def finish() -> Any:
        try:
            snapshot = torch.cuda.memory._snapshot()
            return _since(snapshot, marks) if inner else snapshot
        finally:
            _OPEN_CUDA_RECORDINGS[0] -= 1
            if not inner:
                torch.cuda.memory._record_memory_history(enabled=None)
                early_stop.__exit__(None, None, None)
    return finish


def _trace_marks(snapshot: Dict[str, Any]) -> List[Tuple[int, Optional[int]]]:
    """Per device trace: (its length, the time of its last entry) when an inner recording opens."""
    marks = []
    for trace in snapshot.get("device_traces") or []:
        last = trace[-1].get("time_us") if trace else None
        marks.append((len(trace), last if isinstance(last, int) else None))
    return marks


def _since(snapshot: Dict[str, Any], marks: List[Tuple[int, Optional[int]]]) -> Dict[str, Any]:
    """The snapshot with each device trace cut to the entries after its mark: those past its length
    then, while the entry at the mark is still the one marked; once a full ring buffer has dropped
    its oldest entries (places move), those later than the mark's time."""
    traces = []
    for i, trace in enumerate(snapshot.get("device_traces") or []):
        count, last = marks[i] if i < len(marks) else (0, None)
        if count == 0 or (count <= len(trace) and trace[count - 1].get("time_us") == last):
            traces.append(trace[count:])
        elif last is not None:
            traces.append([e for e in trace if isinstance(e.get("time_us"), int) and e["time_us"] > last])
        else:
            traces.append(trace)
    return {**snapshot, "device_traces": traces}


def has_cuda(torch: Any) -> bool:
    """Whether this process has a CUDA device, asked without initializing CUDA.

    `device_count()` asks NVML where it can; `is_available()` may initialize the driver, after
    which a forked worker (a DataLoader's, say) can no longer use CUDA."""
    return bool(torch.cuda.device_count())


def emulating(torch: Any) -> bool:
    """Whether torch.cuda answers as an emulated GPU (memdiff.recording.emulate): then torch._C's CUDA
    calls (a CUDA build's out-of-memory observer) reach a driver that is not there, and an emulated
    out-of-memory error is a Python exception, written as any other."""
    return str(getattr(torch.cuda.device_count, "__qualname__", "")).startswith("emulated.")


def start_cpu(torch: Any) -> Callable[[], Any]:
    """Start the profiler's memory events; the returned function stops it and gives the snapshot."""
    from torch.cuda import _memory_viz

    to_snapshot = getattr(_memory_viz, "_profile_to_snapshot", None)
    if to_snapshot is None:
        raise CaptureError("torch", f"torch {torch.__version__} lacks torch.cuda._memory_viz._profile_to_snapshot "
                                    f"(a private API, present in torch 2.1 to 2.13 at least), so it cannot "
                                    f"record memory without CUDA")
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                      record_shapes=True, with_stack=True)
    _keep_code_run(True)
    with _without_kineto_lines():
        profiler.__enter__()

    def finish() -> Any:
        with _without_kineto_lines():
            profiler.__exit__(None, None, None)
        try:
            snapshot = _snapshot(torch, profiler, to_snapshot)
        finally:
            _keep_code_run(False)
        snapshot[CPU_HOST] = cpu_host(torch)
        return snapshot
    return finish


# A line Kineto's logger writes to stderr as the profiler starts and stops (`USDT:2026-12-01 09:00:01
# 13573:13573 SyncActivityProfilerHandler.cpp:52] profiler_start`, `STAGE:... Completed Stage: ...`).
_KINETO_LINE = re.compile(rb"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\] ")


@contextlib.contextmanager
def _without_kineto_lines() -> Iterator[None]:
    """Keep Kineto's own log lines off stderr while the profiler starts or stops, and pass on every
    other line written meanwhile.

    Kineto prints `profiler_start` / `profiler_stop` at every KINETO_LOG_LEVEL and torch offers no
    switch, so the lines are taken from the file descriptor itself (they are written by C++, not
    through sys.stderr) for the two calls that make them, never while the user's code runs."""
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = b"".join(line for line in held if not _KINETO_LINE.match(line))
            if kept:
                os.write(2, kept)


# The snapshot key under which a CPU capture says how this host runs half-precision convolutions
# (docs/json.md, "The CPU host"); memdiff.read.host reads it.
CPU_HOST = "memdiff_cpu_host"


def cpu_host(torch: Any) -> Dict[str, Any]:
    """How this host's torch runs bf16 and fp16 convolutions, which the fp32 run cannot show: with
    oneDNN where torch has it, the user left it on and the CPU has the instructions (Convolution.cpp's
    `use_mkldnn`: `mkldnn_bf16_device_check`, AVX-512 for bf16; AVX-512 FP16 or AMX for fp16),
    else with ATen's `_slow_conv2d`, whose bias gradient sums through an fp32 copy of the output's
    gradient. A question this torch cannot answer is left out."""
    out: Dict[str, Any] = {"torch": str(torch.__version__)}
    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    if capability is not None:
        out["cpu_capability"] = str(capability())
    mkldnn = torch.backends.mkldnn
    for precision in ("bf16", "fp16"):
        supported = getattr(torch.ops.mkldnn, f"_is_mkldnn_{precision}_supported", None)
        try:
            answer = bool(supported()) if supported is not None else None
        except RuntimeError:  # an op this build registers without a CPU kernel
            answer = None
        if answer is not None:
            out[f"onednn_{precision}_convolutions"] = bool(mkldnn.is_available() and mkldnn.enabled and answer)
    return out


# The code objects `exec` ran (imports, the script's own module, exec'd code) while the profiler
# records, or None when it does not: see _keep_code_run.
_code_run: Optional[List[Any]] = None
_audit_hooked = False


def _keep_code_run(keep: bool) -> None:
    """From now on hold (or, with False, let go of) every code object `exec` runs.

    torch's Python tracer keeps a frame's file and function names as pointers into its code object,
    without a reference, and reads them once the recording ends. A module's own code is freed when
    its import (or the script's run) ends, and names loaded from cached bytecode are shared with no
    live object, so those frames would read freed memory: another name, or bytes that are not UTF-8.
    Python's audit hook sees each code object `exec` is given. A hook cannot be removed, so one is
    added per process, and it does nothing while no recording runs."""
    global _code_run, _audit_hooked
    if keep and not _audit_hooked:
        sys.addaudithook(_hold_exec_code)
        _audit_hooked = True
    _code_run = [] if keep else None


def _hold_exec_code(event: str, args: Tuple[Any, ...]) -> None:
    """The audit hook of _keep_code_run: called on every audited event, so it does the least it can."""
    if event == "exec" and _code_run is not None:
        _code_run.append(args[0])


def _snapshot(torch: Any, profiler: Any, to_snapshot: Callable[[Any], Any]) -> Any:
    """The snapshot of a stopped profiler: torch's converter's, with backward's stacks named, or, where
    torch's memory profiler refuses the records, one built from the allocation events."""
    try:
        # torch's converter builds the memory profile itself; handing it the one built here
        # lets each allocation be matched to its profiler event (_name_autograd_nodes).
        memory = _TimelineOnce(profiler._memory_profile())
        snapshot = to_snapshot(_Built(memory))
    except Exception as exc:  # a private API: under gloo's threads it fails with AssertionError or KeyError
        print(f"memdiff: torch's memory profiler refused this run's records ({type(exc).__name__}: "
              f"{str(exc)[:120]}...); the snapshot is built from its allocation events instead, without "
              f"PyTorch's own categories", file=sys.stderr)
        return from_allocations(torch, profiler)
    _name_autograd_nodes(torch, snapshot, memory)
    return snapshot


class _Built:
    """A finished profiler as `_profile_to_snapshot` reads it: its memory profile, already built."""

    def __init__(self, memory: Any) -> None:
        self.memory = memory

    def _memory_profile(self) -> Any:
        return self.memory


class _TimelineOnce:
    """A memory profile whose timeline is worked out once. torch's `MemoryProfile.timeline` is a
    property that rebuilds it at each read (a walk of the whole op tree and a snapshot of every
    tensor version's category: about a tenth of the time the profile takes to build), and the
    converter and `_name_autograd_nodes` each read it."""

    def __init__(self, memory: Any) -> None:
        self._memory = memory
        self.timeline = memory.timeline

    def __getattr__(self, name: str) -> Any:
        return getattr(self._memory, name)


def _name_autograd_nodes(torch: Any, snapshot: Dict[str, Any], memory: Any) -> None:
    """Give allocations made in backward the stacks of `_stack`, in place.

    torch's converter keeps only Python frames, so everything the backward allocates reads
    `run_backward`. Its trace follows the memory profile's timeline (an allocation for each
    tensor made and each new version), which maps each allocation to its tensor, and so to the
    profiler event that allocated it. Frames lists are shared with the frees and blocks that
    follow, hence the in-place update. Should the two ever disagree, the trace is left as torch
    wrote it, and the user is told."""
    from torch._C._profiler import _EventType
    from torch.profiler._memory_profiler import Action, TensorKey

    stacks = {}
    for event in memory._op_tree.sorted_nodes:
        if event.tag == _EventType.Allocation and event.extra_fields.alloc_size > 0:
            key = TensorKey.from_allocation(event.extra_fields)
            frames = _stack(event, _EventType)
            if key and any(f["name"].startswith(AUTOGRAD_NODE) for f in frames):
                stacks[key] = frames
    if not stacks:
        return
    device_count = torch.cuda.device_count()
    allocations = [iter([e for e in trace if e["action"] == "alloc"]) for trace in snapshot["device_traces"]]
    updates = []
    for _, action, (key, _version), size in memory.timeline:
        if not isinstance(key, TensorKey) or action not in (Action.CREATE, Action.INCREMENT_VERSION):
            continue
        device = key.device.index if key.device.type == "cuda" else device_count
        entry = next(allocations[device], None)
        if entry is None or (entry["addr"], entry["size"]) != (key.storage.ptr, size):
            print("memdiff: torch's memory trace did not follow its memory profile here; backward "
                  "allocations keep stacks that end at run_backward", file=sys.stderr)
            return
        if key in stacks:
            updates.append((entry["frames"], stacks[key]))
    for frames, named in updates:
        frames[:] = named


def from_allocations(torch: Any, profiler: Any) -> Dict[str, Any]:
    """A snapshot in `_profile_to_snapshot`'s shape from the profiler's allocation events alone.

    The profiler follows the thread that started it, and other threads only while they work for
    it: a gloo worker that drops the last reference to DDP's broadcast bucket after its work has
    ended frees it unseen. When the allocator hands that address out again, torch's memory
    profiler finds two allocations and no free, and its data-flow check fails (`duplicate
    outputs`). The allocations themselves are all there; this reads them in time order, and
    closes an allocation whose address is handed out again at that moment, the latest its
    unseen free can have happened. What it lacks is torch's category per allocation, which
    memdiff never needed: it classifies by stack."""
    from torch._C._profiler import _EventType
    from torch.profiler._memory_profiler import OpTree

    cpu = torch.cuda.device_count()  # as torch's converter numbers them: CUDA devices, then the CPU
    traces: List[List[Dict[str, Any]]] = [[] for _ in range(cpu + 1)]
    live: Dict[Tuple[int, int], Dict[str, Any]] = {}

    def free(device: int, alloc: Dict[str, Any]) -> None:
        for action in ("free_requested", "free_completed"):
            traces[device].append({"action": action, "addr": alloc["addr"], "size": alloc["size"], "stream": 0,
                                   "frames": alloc["frames"]})

    for event in OpTree(profiler.profiler.kineto_results).sorted_nodes:
        if event.tag != _EventType.Allocation or not event.extra_fields.alloc_size:
            continue
        fields = event.extra_fields
        device = fields.device.index if fields.device.type == "cuda" else cpu
        key = (device, fields.ptr)
        if fields.alloc_size > 0:
            if key in live:
                free(device, live.pop(key))
            live[key] = {"action": "alloc", "addr": fields.ptr, "size": fields.alloc_size, "stream": 0,
                         "frames": _stack(event, _EventType)}
            traces[device].append(live[key])
        else:  # a free of an allocation made before recording began is kept: it is static memory
            free(device, live.pop(key) if key in live
                 else {"addr": fields.ptr, "size": -fields.alloc_size, "frames": []})
    segments = []
    for device in range(cpu + 1):
        blocks = sorted((a for (d, _), a in live.items() if d == device), key=lambda a: a["addr"])
        if blocks:
            start = blocks[0]["addr"]
            segments.append({"device": device, "address": start, "stream": 0,
                             "total_size": max(b["addr"] + b["size"] for b in blocks) - start,
                             "blocks": [{"address": b["addr"], "size": b["size"], "requested_size": b["size"],
                                         "state": "active_allocated", "frames": b["frames"]} for b in blocks]})
    return {"device_traces": traces, "segments": segments}


def _stack(event: Any, event_type: Any) -> List[Dict[str, Any]]:
    """The frames of an allocation, innermost first, in torch's converter's form: its Python
    calls and, in backward, the autograd nodes around it, with the ops a node ran itself when it
    allocated (`AddmmBackward0 <- mm`), as CUDA stacks name them. Elsewhere the Python calls
    alone, exactly as torch writes them, so that signatures stay as they were."""
    chain = []
    parent = event.parent
    while parent is not None:
        chain.append(parent)
        parent = parent.parent

    def python(e: Any) -> bool:
        return e.tag in (event_type.PyCall, event_type.PyCCall)

    def node(e: Any) -> bool:
        return e.tag == event_type.TorchOp and _name(e).startswith(AUTOGRAD_NODE)

    first = next((i for i, e in enumerate(chain) if python(e) or node(e)), len(chain))
    own_ops = first < len(chain) and node(chain[first])
    return [{"filename": "none", "line": 0, "name": _name(e)} for i, e in enumerate(chain)
            if python(e) or node(e) or (own_ops and i < first and _name(e).startswith("aten::"))]


def _name(event: Any) -> str:
    """A profiler event's name, or UNREADABLE where torch reads it from freed memory: code that
    ended during the recording without passing through exec, which _keep_code_run cannot hold.
    The allocation keeps its place and its other frames, and the snapshot is still written."""
    try:
        return str(event.name)
    except UnicodeDecodeError:
        return UNREADABLE


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# Where a window of steps that was never reached is told: None (a script's own memdiff.record) says it on
# stderr; `memdiff record` takes the why into its own one line, which names the file it did not write.
_UNREACHED: ContextVar[Optional[List[str]]] = ContextVar("memdiff_unreached", default=None)


@contextlib.contextmanager
def unreached_told() -> Iterator[List[str]]:
    """Inside the block, a window of steps that was never reached is not said on stderr: its why (`the window
    1:3 was not reached: ...`) goes in the list yielded, for the caller's own line."""
    token = _UNREACHED.set([])
    try:
        told = _UNREACHED.get()
        assert told is not None
        yield told
    finally:
        _UNREACHED.reset(token)


@dataclass(frozen=True)
class StepWindow:
    """Optimizer steps `start` to `stop` (Python's half-open range, counted from 0): recording starts
    once `start` optimizer steps have run and stops once `stop` have, so each step recorded is whole
    (its forward, backward and optimizer step)."""

    start: int
    stop: int

    def __str__(self) -> str:
        return f"{self.start}:{self.stop}"

    @property
    def count(self) -> int:
        """How many optimizer steps the window holds."""
        return self.stop - self.start


WINDOW = re.compile(r"^\s*(\d*)\s*:\s*(\d+)\s*$", re.ASCII)  # digits 0-9 (memdiff.numbers)
# The default window of the training callbacks: after two warm-up steps (the first makes the
# optimizer's state, the second is the first steady one), two steps, which is what a diff and a
# gate need to see memory carried from one step to the next.
DEFAULT_WINDOW = StepWindow(2, 4)


def parse_steps(text: "str | StepWindow") -> StepWindow:
    """`"3:5"` (steps 3 and 4), `":2"` (the first two) or `"3"` (step 3 alone) as a StepWindow;
    ValueError naming the text otherwise."""
    if isinstance(text, StepWindow):
        return text
    text = str(text)
    found = WINDOW.match(text)
    if found is None and DIGITS.fullmatch(text.strip(SPACE)):
        return StepWindow(int(text), int(text) + 1)
    if found is None:
        raise ValueError(f"steps must read START:STOP (optimizer steps counted from 0, STOP not included, "
                         f"such as 3:5), not {text[:40]!r}")
    start, stop = int(found.group(1) or 0), int(found.group(2))
    if stop <= start:
        raise ValueError(f"steps {text.strip()} holds no step: STOP must be past START (3:5 records steps 3 and 4)")
    return StepWindow(start, stop)


class WindowRecording:
    """One process's recording of a window of optimizer steps, driven by the count of steps done.

    `steps_done(n)` is called after each optimizer step with how many have run: the recording
    starts when `n` reaches the window's start and is written when it reaches its stop. `close()`
    writes a window cut short (the training ended or failed inside it). It never raises: a
    recording that cannot start or be written is one warning (`warn`), and training goes on.
    """

    def __init__(self, path: str, window: StepWindow, *, max_entries: int = 1_000_000, stacks: str = "all",
                 warn: Optional[Callable[[str], None]] = None,
                 on_written: Optional[Callable[[str, str], None]] = None) -> None:
        self.path, self.window = path, window
        self.max_entries, self.stacks = max_entries, stacks
        self.warn = warn or _say
        self.on_written = on_written  # (path, why) once the snapshot is on disk
        self.finish: Optional[Callable[[], Any]] = None
        self.steps = 0  # optimizer steps seen so far
        self.state = "waiting"  # waiting -> recording -> written | nothing | failed
        self.why: Optional[str] = None  # what ended it (steps 3:5, out of memory, training ended), or what failed

    def steps_done(self, count: int) -> None:
        """After an optimizer step: `count` steps have run in all."""
        self.steps = count
        if self.state == "waiting" and self.window.start <= count < self.window.stop:
            self._start()
        elif self.state == "recording" and count >= self.window.stop:
            self.write(f"steps {self.window}")

    def begin(self) -> None:
        """Before the first step: a window that starts at 0 starts now."""
        self.steps_done(self.steps)

    def _start(self) -> None:
        try:
            torch = torch_module()
            if has_cuda(torch):
                self.finish = start_cuda(torch, self.max_entries, self.stacks)
                observer = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
                if observer is not None and not emulating(torch):  # an OOM ends the job: write what led to it first
                    observer(lambda *_: self.write("out of memory"))
            else:
                self.finish = start_cpu(torch)
        except Exception as exc:
            self._fail(f"could not start recording steps {self.window}: {type(exc).__name__}: {exc}")
            return
        self.state = "recording"

    def write(self, why: str) -> Optional[str]:
        """Stop recording and write the snapshot now (later calls do nothing); its path, or None."""
        if self.state != "recording" or self.finish is None:
            return None
        finish, self.finish = self.finish, None
        self.state = "writing"
        try:
            snapshot = finish()
            if recorded_nothing(snapshot):
                self.state, self.why = "nothing", why
                return None
            dump(snapshot, self.path)
        except Exception as exc:
            self._fail(f"could not write {self.path}: {type(exc).__name__}: {exc}")
            return None
        self.state, self.why = "written", why
        if self.on_written is not None:
            self.on_written(self.path, why)
        return self.path

    def close(self, why: str) -> Optional[str]:
        """At the end of training: write a window cut short, or say that it was never reached."""
        if self.state == "recording":
            self.warn(f"memdiff: training ended after {self.steps} optimizer step(s), inside the window "
                      f"{self.window}: {self.path} holds the steps up to the end")
            return self.write(why)
        if self.state == "waiting":
            self.state, self.why = "nothing", (f"the window {self.window} was not reached: training ran "
                                               f"{self.steps} optimizer step(s)")
            told = _UNREACHED.get()
            if told is not None:
                told.append(self.why)
            else:
                self.warn(f"memdiff: {self.why}; nothing recorded")
        return None

    def _fail(self, message: str) -> None:
        self.state, self.why = "failed", message[:500]
        self.warn(f"memdiff: {self.why} (training goes on)")


@contextlib.contextmanager
def count_optimizer_steps(on_step: Callable[[int], None]) -> Iterator[None]:
    """Call `on_step(n)` after every optimizer step in this process (any `torch.optim.Optimizer`,
    through torch's global step hook: no change to the training code), `n` the steps so far."""
    torch = torch_module()
    import torch.optim.optimizer as optimizers

    register = getattr(optimizers, "register_optimizer_step_post_hook", None)
    if register is None:
        raise CaptureError("torch", f"torch {torch.__version__} has no global optimizer step hook "
                                    f"(torch.optim.optimizer.register_optimizer_step_post_hook, torch 2.0+)")
    count = [0]

    def after_step(*_: Any) -> None:
        count[0] += 1
        on_step(count[0])
    handle = register(after_step)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def record(path: str, *, max_entries: int = 1_000_000, stacks: str = "all",
           steps: "str | StepWindow | None" = None, emulate: Optional[str] = None,
           gpus: Optional[int] = None) -> Iterator[None]:
    """Record every allocation made inside the block and write the snapshot to `path`.

    With CUDA: the caching allocator's history (`max_entries` is its ring buffer), with
    record_function scopes where the torch version records them. `stacks="all"` (PyTorch's own
    default) keeps C++ frames, which name autograd nodes (`AddmmBackward0`, `AccumulateGrad`);
    `stacks="python"` is the fallback when the C++ unwinder crashes. Without CUDA: the
    profiler's memory events, converted to the same format, each carrying PyTorch's own category.

    `steps="3:5"` records only those optimizer steps of the block (StepWindow): recording starts
    once 3 `optimizer.step()` calls have returned and the file is written once 5 have. A block
    that ends inside the window writes what was recorded; one that ends before it writes nothing
    and warns.

    `emulate="h100"` runs the block's CUDA code with no GPU (memdiff.recording.emulate, docs/emulate.md): its
    `cuda` tensors run on the meta device, `torch.cuda` answers as that GPU, and the snapshot is
    the one that GPU's caching allocator would record, marked as emulated. `gpus=N` is how many such GPUs
    the block sees (torch.cuda.device_count(); else LOCAL_WORLD_SIZE, else 1), each with its own allocator
    and its own trace in the snapshot.
    """
    if stacks not in STACKS:
        raise ValueError(f"stacks must be one of {STACKS}, not {stacks!r}")
    torch = torch_module()
    if emulate is not None:
        from memdiff.recording.emulate.gpus import gpu
        from memdiff.recording.emulate.runtime import Emulator
        from memdiff.recording.emulate.session import emulating

        with emulating(Emulator(gpu(emulate), gpus=gpus)):
            with record(path, max_entries=max_entries, stacks=stacks, steps=steps):
                yield
        return
    if steps is not None:
        window = WindowRecording(path, parse_steps(steps), max_entries=max_entries, stacks=stacks)
        with count_optimizer_steps(window.steps_done):
            window.begin()
            try:
                yield
            finally:
                with sigint_held():
                    window.close("the block ended")
        return
    finish = start_cuda(torch, max_entries, stacks) if has_cuda(torch) else start_cpu(torch)
    try:
        yield
    finally:
        # Dump even when the block raised: an OOM is when the file is wanted most.
        with sigint_held():
            dump(finish(), path)
