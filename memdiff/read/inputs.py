"""Any input -> Summary: a snapshot is loaded and normalized, a stored summary is validated and read.

This lets CI keep a few KB of summary JSON instead of a 300 MB pickle and still diff or gate it.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, TypeVar

from memdiff import progress
from memdiff.analyse.classify import Rule, classify
from memdiff.analyse.normalize.engine import summarize
from memdiff.errors import InputError, version_shown
from memdiff.inert import shell
from memdiff.model import READABLE_SCHEMA_VERSIONS, Summary
from memdiff.read.load import decode, paused_gc, to_snapshot
from memdiff.read.schema import validate

if TYPE_CHECKING:
    from memdiff.read.window import Window


def is_summary(raw: Any) -> bool:
    """Whether a decoded input is a summary `memdiff summarize` wrote, rather than a snapshot."""
    return isinstance(raw, dict) and "schema_version" in raw and "devices" in raw


def refuse_baseline(path: str, summary: Dict[str, Any]) -> None:
    """InputError saying what to do when a summary read as a run is a baseline (its thresholds)."""
    if "thresholds" in summary and "name" in summary:
        raise InputError(path, f"is a baseline, not a run: hold a run to it with `memdiff gate RUN --baseline "
                               f"{shell(path)}`")


def read_summary(path: str, rules: Sequence[Rule], history: bool = False,
                 window: Optional["Window"] = None) -> Summary:
    """The classified Summary of `path`, a snapshot or a summary written by `memdiff summarize`;
    with `history`, a snapshot's devices carry their history (a stored summary keeps what it has);
    with `window`, of that window of the snapshot only (memdiff.read.window).

    A stored summary is classified again, so `--rules` applies to it as to a snapshot.
    """
    with paused_gc():
        raw, source, decoded = decode(path, columns=True)
        if not is_summary(raw):
            snapshot = to_snapshot(path, raw, source, decoded)
            del raw  # freed by reference counting before the collector resumes
            if window is not None:
                from memdiff.read.window import windowed

                snapshot = windowed(snapshot, window)
            summary = summarize(snapshot, rules if history else None)
            del snapshot
            return classify(summary, rules)
    if window is not None:
        raise InputError(path, f"is a summary, which keeps no trace to cut {window.describe()} from: "
                               "give the snapshot")
    refuse_baseline(path, raw)
    version = raw["schema_version"]
    if version not in READABLE_SCHEMA_VERSIONS:
        raise InputError(path, f"summary schema_version {version_shown(version)} is not one this memdiff reads "
                               f"({' or '.join(map(str, READABLE_SCHEMA_VERSIONS))}); "
                               "re-create it with `memdiff summarize`")
    return classify(Summary.from_dict(validate(path, raw, "summary")), rules)


# Below this much input, starting worker processes (~0.3 s) costs more than it saves.
PARALLEL_MIN_BYTES = 32 * 2**20
# What reading a file costs at most, per byte of file: a plain pickle decodes to about 8 times its
# size in Python objects (the 1M-event benchmark: 48 MB -> 390 MB), plus the interpreter's own.
MEMORY_PER_FILE_BYTE = 10
WORKER_BASE_BYTES = 150 * 2**20


def _available_memory() -> Optional[int]:
    """Memory the system can give without swapping (MemAvailable), when it says."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def worker_count(sizes: Sequence[int]) -> int:
    """Worker processes for reading files of these sizes: one per core, fewer when the largest
    files decoded side by side would not fit in the available memory."""
    workers = min(len(sizes), os.cpu_count() or 1)
    available = _available_memory()
    if available is not None and sizes:
        need = WORKER_BASE_BYTES + MEMORY_PER_FILE_BYTE * max(sizes)
        workers = min(workers, max(1, available // need))
    return workers


T = TypeVar("T")


def read_each(read: Callable[..., T], calls: Sequence[Sequence[Any]]) -> List[T]:
    """`read(*call)` for each call, whose first argument is a file's path; big inputs are read
    in parallel worker processes, as many as the cores and the available memory allow (see
    worker_count).

    Only what `read` returns crosses the process boundary, so two million-event snapshots cost
    about as much as the larger one alone. Workers are spawned rather than forked: forking a
    process that may hold numpy's threads can deadlock.
    """
    sizes = [os.path.getsize(c[0]) if os.path.isfile(c[0]) else 0 for c in calls]
    workers = worker_count(sizes)
    if workers < 2 or sum(sizes) < PARALLEL_MIN_BYTES:
        return [read(*c) for c in calls]
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=progress.in_worker, initargs=(progress.enabled(),)) as pool:
        futures = [pool.submit(read, *c) for c in calls]
        return [f.result() for f in futures]


def read_summaries(paths: Sequence[str], rules: Sequence[Rule], history: bool = False,
                   window: Optional["Window"] = None) -> List[Summary]:
    """`read_summary` of each path, big inputs in parallel (read_each)."""
    return read_each(read_summary, [(p, rules, history, window) for p in paths])
