"""What the training callbacks share, framework aside: each rank records a window of optimizer steps
into a job folder that `memdiff ranks` reads, and reads each logging interval's peak memory.

The frameworks' callbacks only say when an optimizer step has ended (with the count so far), when
a logging interval closes, and when training ends. Nothing here stops a training run: a recording
that cannot start or be written is one warning, and training goes on.
"""

from __future__ import annotations

import atexit
import os
import re
from typing import Any, Callable, Dict, List, Tuple

from memdiff.recording.capture import (
    STACKS,
    StepWindow,
    WindowRecording,
    has_cuda,
    parse_steps,
    torch_module,
    write_status,
)
from memdiff.recording.manifest import FAILED, NOTHING, UNFINISHED, WRITTEN, collect, write_manifest

GIB = float(1 << 30)
# Linux keeps a process's peak resident set (VmHWM) and resets it when "5" is written to
# /proc/self/clear_refs; without CUDA that is the one peak that can be read per interval.
STATUS_FILE, CLEAR_REFS = "/proc/self/status", "/proc/self/clear_refs"
HWM = re.compile(rb"^VmHWM:\s+(\d+)\s+kB", re.MULTILINE)


def checked_options(steps: "str | StepWindow", stacks: str) -> StepWindow:
    """A callback's window, its options checked when the callback is made, before any training:
    a bad window or stacks value is a ValueError then, not a warning steps later."""
    if stacks not in STACKS:
        raise ValueError(f"stacks must be one of {STACKS}, not {stacks!r}")
    return parse_steps(steps)


def gib(n: int) -> float:
    """Bytes as the GiB figure a log shows (binary units, 6 decimals: to the KiB, so that a small
    model's figures are not all 0.0)."""
    return round(n / GIB, 6)


class Monitor:
    """One rank's recording of a window of optimizer steps and its per-interval peaks.

    Writes `folder/rank{rank}.pickle`, a hidden `.rank{rank}.status` and the job's manifest
    (`memdiff-job.json`, rewritten by each rank as it finishes: its world size is what makes a
    missing rank visible to `memdiff ranks`)."""

    def __init__(self, folder: str, steps: "str | StepWindow", *, rank: int, world_size: int,
                 warn: Callable[[str], None], max_entries: int = 1_000_000, stacks: str = "all") -> None:
        rank, world_size = job_rank(rank, world_size)
        self.folder, self.rank, self.world_size, self.warn = folder, rank, world_size, warn
        self.window = WindowRecording(os.path.join(folder, f"rank{rank}.pickle"), parse_steps(steps),
                                      max_entries=max_entries, stacks=stacks, warn=self._warn_once,
                                      on_written=self._written)
        self.warned = False
        self.pending: Dict[str, float] = {}  # figures for the next log (the window's peak on CPU)
        self.ended = False

    def _warn_once(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            self.warn(message)

    def begin(self, steps_done: int) -> None:
        """Training starts (or resumes) with `steps_done` optimizer steps behind it."""
        try:
            os.makedirs(self.folder, exist_ok=True)
            for stale in (f"rank{self.rank}.pickle", f".rank{self.rank}.status"):
                if os.path.isfile(os.path.join(self.folder, stale)):  # an earlier run's must not pass for this one's
                    os.unlink(os.path.join(self.folder, stale))
            self._status(UNFINISHED)
        except OSError as exc:
            self._warn_once(f"memdiff: cannot record into {self.folder}: {exc} (training goes on)")
            self.ended = True
            return
        self.reset_peaks()
        atexit.register(self.end, "exit")  # training that raises never reaches its end callback
        self.window.steps = steps_done
        self.window.begin()

    def step_done(self, steps_done: int) -> None:
        """An optimizer step ended; `steps_done` have run in all."""
        if not self.ended and steps_done != self.window.steps:
            self.window.steps_done(steps_done)

    def end(self, why: str = "training ended") -> None:
        """Training ended (or failed): write a window cut short, and the rank's status."""
        if self.ended:
            return
        self.ended = True
        atexit.unregister(self.end)
        self.window.close(why)
        if self.window.state in ("nothing", "failed"):
            self._status(NOTHING if self.window.state == "nothing" else FAILED, error=self.window.why)

    def _written(self, path: str, why: str) -> None:
        self._status(WRITTEN, at=why, file=os.path.basename(path))
        if not has_cuda(torch_module()):  # the window's peak is the one allocator figure a CPU run has
            try:
                self.pending["memory/window_peak_allocated_gib"] = gib(window_peak(path))
            except Exception as exc:  # a figure lost, never the training
                self._warn_once(f"memdiff: cannot read the window's peak from {path}: {exc}")

    def _status(self, state: str, **facts: Any) -> None:
        try:
            document = {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(), "state": state,
                        **{k: v for k, v in facts.items() if v is not None}}
            write_status(os.path.join(self.folder, f".rank{self.rank}.status"), document)
            if state != UNFINISHED:
                manifest = collect(self.folder, keep=True)
                if manifest is not None:
                    write_manifest(self.folder, manifest)
        except OSError as exc:
            self._warn_once(f"memdiff: cannot write the job manifest in {self.folder}: {exc}")

    def reset_peaks(self) -> None:
        """Start a new interval: forget the peaks read so far."""
        try:
            torch = torch_module()
            if has_cuda(torch) and torch.cuda.is_initialized():
                for device in range(torch.cuda.device_count()):
                    torch.cuda.reset_peak_memory_stats(device)
            elif os.path.exists(CLEAR_REFS):
                with open(CLEAR_REFS, "w") as f:
                    f.write("5")
        except Exception:  # peaks are a courtesy of the callback: a platform without them logs none
            pass

    def peaks(self) -> Dict[str, float]:
        """This interval's peaks as log keys, then a new interval starts (see docs/integrations.md)."""
        figures = dict(self.pending)
        self.pending.clear()
        try:
            figures.update(read_peaks(torch_module()))
        except Exception:
            pass
        self.reset_peaks()
        return figures


def job_rank(rank: int, world_size: int) -> Tuple[int, int]:
    """This process's (rank, world size): torch.distributed's where a process group is up, else the
    framework's. Under torchrun on CPU the Trainer's arguments can say rank 0 of 1 in every
    process (accelerate sees no distributed set-up it runs) while torch.distributed has one, and
    every rank would write rank0.pickle."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return rank, world_size


def read_peaks(torch: Any) -> Dict[str, float]:
    """The peaks since the last reset: per CUDA device this process used, allocated and reserved by
    the caching allocator (the current device's under plain keys, every used device's under
    `memory/cuda{N}/` when there are several); without CUDA, the process's peak resident set."""
    if has_cuda(torch) and torch.cuda.is_initialized():
        used = [d for d in range(torch.cuda.device_count()) if torch.cuda.max_memory_reserved(d)]
        current = torch.cuda.current_device()
        figures = {}
        for device in used:
            allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
            prefixes: List[str] = ["memory/"] if device == current else []
            if len(used) > 1:
                prefixes.append(f"memory/cuda{device}/")
            for prefix in prefixes:
                figures[prefix + "peak_allocated_gib"] = gib(allocated)
                figures[prefix + "peak_reserved_gib"] = gib(reserved)
        return figures
    if os.path.exists(STATUS_FILE):
        with open(STATUS_FILE, "rb") as f:
            found = HWM.search(f.read())
        if found:
            return {"memory/peak_rss_gib": gib(int(found.group(1)) * 1024)}
    return {}


def window_peak(path: str) -> int:
    """The peak of a written window's snapshot as memdiff reads it (its busiest device)."""
    from memdiff.analyse.classify import load_rules
    from memdiff.read.inputs import read_summary

    return max((d.peak_bytes for d in read_summary(path, load_rules()).devices), default=0)

