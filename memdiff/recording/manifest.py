"""The manifest of a recorded job: how many ranks it had, and what became of each rank's recording.

`memdiff record -o DIR/` starts a launcher whose ranks each leave a hidden `.rank{R}.status`
file (memdiff/recording/rank_hook); after the launcher exits, those are gathered into DIR/memdiff-job.json.
Reading the job later, the manifest's world size is what makes a missing *last* rank visible:
from the rank files alone, a 2-rank job that lost rank 1 reads as a complete 1-rank job.
The manifest has a visible name so that it travels with the rank files (artifact uploads skip
hidden files).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from memdiff.atomic import write_output
from memdiff.errors import InputError, brief, version_shown
from memdiff.numbers import DIGITS
from memdiff.read.load import read_json

MANIFEST = "memdiff-job.json"
MANIFEST_VERSION = 1
STATUS = re.compile(r"^\.rank(\d+)\.status$")
# Any other process of the job (the launcher, a process without RANK, a rank's child): what it did.
PROCESS_STATUS = re.compile(r"^\.pid(\d+)\.status$")
# A rank's claim on a job folder (the rank hook's _claim), and a later job's folder of the same command.
CLAIM = re.compile(r"^\.rank(\d+)\.claim$")
# A rank's task's claim on its rank under --dask (dask_ranks.py): a task Dask runs again starts no rank.
TASK_CLAIM = re.compile(r"^\.rank(\d+)\.task$")
JOB_FOLDER = re.compile(r"^job([2-9]|[1-9]\d+)$")
# A status being written (by the rank hook) when its process was killed.
PARTIAL_STATUS = re.compile(r"^\.(rank|pid)\d+\.status\.\d+\.\d+\.tmp$")
# Under --emulate, the values the ranks' collectives carry to each other (emulate/exchange.py), one
# file per collective: removed when the job ends.
COLLECTIVES = ".collectives"
MAX_WORLD_SIZE = 1 << 20  # as many ranks as a job folder may hold (memdiff.read.job.MAX_RANKS)

# A rank's recording, as the status it left says (or the absence of one).
WRITTEN, FAILED, NOTHING, UNFINISHED, NOT_STARTED = ("written", "failed", "nothing recorded", "recording",
                                                     "not started")
# The process ran memdiff's hook and had not imported torch (yet); it ended without importing torch.
BEFORE_TORCH, NO_TORCH = "before torch", "no torch"
# A rank of the job that memdiff record did not run: only some were (--ranks, launch.py).
NOT_EMULATED = "not emulated"
# A rank run on Dask whose end memdiff record could not wait for (its scheduler or worker was lost).
NOT_FINISHED = "not finished"


@dataclass(frozen=True)
class RankRecording:
    """What became of one rank's recording."""

    rank: int
    state: str
    file: Optional[str] = None
    error: Optional[str] = None
    at: Optional[str] = None  # what stopped it: exit, SIGTERM, SIGHUP, destroy_process_group, out of memory
    refused: Optional[str] = None  # under --emulate: the op the emulator could not run, which ended the rank
    out_of_memory: Optional[str] = None  # under --emulate: the first out-of-memory error raised, caught or not
    died: Optional[str] = None  # the exception (or failing exit status) that ended the rank's process

    def why_missing(self) -> str:
        """Why this rank has no snapshot, in a reader's words."""
        if self.state == FAILED:
            return f"its snapshot could not be written: {self.error}"
        if self.state == NOTHING:
            return self.error or "it recorded no allocation"  # a window of steps it never reached
        if self.state == UNFINISHED:
            return ("it ended without writing its snapshot (SIGKILL, os._exit(), or a crash in native code "
                    "end a process before it can)")
        if self.state == NO_TORCH:
            return "it never imported torch" + (f" ({self.error})" if self.error else "")
        if self.state == BEFORE_TORCH:
            return ("it ended before it imported torch, without running its exit handlers (a signal, "
                    "os._exit(), or a crash in native code)")
        if self.state == NOT_FINISHED:
            return self.error or "it did not finish"
        if self.state == NOT_STARTED:
            return ("its process never ran memdiff's hook: it did not start, or started without memdiff's "
                    "sitecustomize (an environment without its PYTHONPATH, python -I, -E or -S)")
        return f"its file {self.file} is gone"


@dataclass(frozen=True)
class JobManifest:
    """How many ranks a recorded job had and each one's recording."""

    world_size: int
    ranks: List[RankRecording]
    exit_status: Optional[int] = None  # the launched command's; 130 / 143 when interrupted
    emulated: Optional[List[int]] = None  # the ranks run when only some were (--ranks); None: all
    picked: Optional[List[Tuple[int, str]]] = None  # --ranks auto: each rank it ran and why (pick.py)
    first_node: bool = False  # the ranks that ran are its first node's, as a script's Lightning launcher starts them

    def only(self, emulated: List[int], picked: Optional[List[Tuple[int, str]]] = None) -> "JobManifest":
        """The manifest of a job of which only the ranks `emulated` ran (those `picked` by --ranks auto,
        with why): the others are `not emulated`, never missing."""
        ranks = [replace(r, state=NOT_EMULATED) if r.rank not in emulated and r.state == NOT_STARTED else r
                 for r in self.ranks]
        return replace(self, ranks=ranks, emulated=sorted(emulated), picked=picked)

    def unfinished(self, lost: Dict[int, str], folder: str) -> "JobManifest":
        """The manifest with each rank of `lost` (its end not waited for, and why) `not finished`, unless
        it wrote its snapshot before: a rank that finished is read whatever became of its task."""
        written = {r.rank for r in self.ranks if r not in self.missing(folder)}
        ranks = [replace(r, state=NOT_FINISHED, error=lost[r.rank], file=None, at=None)
                 if r.rank in lost and r.rank not in written else r for r in self.ranks]
        return replace(self, ranks=ranks)

    def missing(self, folder: str) -> List[RankRecording]:
        """The ranks that left no snapshot in `folder`."""
        return [r for r in self.ranks if r.state != NOT_EMULATED and (
            r.state != WRITTEN or not r.file or not os.path.isfile(os.path.join(folder, r.file)))]

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form written to memdiff-job.json."""
        return {"memdiff_job_version": MANIFEST_VERSION, "world_size": self.world_size,
                "exit_status": self.exit_status,
                **({"emulated_ranks": self.emulated} if self.emulated is not None else {}),
                **({"picked_ranks": [{"rank": rank, "why": why} for rank, why in self.picked]}
                   if self.picked is not None else {}),
                **({"first_node": True} if self.first_node else {}),
                "ranks": [{k: v for k, v in asdict(r).items() if v is not None} for r in self.ranks]}


def job_folders(folder: str) -> List[str]:
    """The job's folder, then the folders of the later jobs a command ran with the same ranks
    (DIR/job2, DIR/job3, ...: the rank hook's claims put them there), in order."""
    numbered = sorted((int(found.group(1)), name) for name in os.listdir(folder)
                      if (found := JOB_FOLDER.match(name)) and os.path.isdir(os.path.join(folder, name)))
    return [folder] + [os.path.join(folder, name) for _, name in numbered]


def claimed(folder: str) -> bool:
    """Whether a rank of this run claimed `folder` (the rank hook's `.rank{R}.claim`)."""
    return any(CLAIM.match(name) for name in os.listdir(folder))


def clear_claims(folder: str) -> None:
    """Remove the ranks' (and their tasks') claims once the command has ended: the next run claims afresh."""
    for name in os.listdir(folder):
        if CLAIM.match(name) or TASK_CLAIM.match(name):
            os.unlink(os.path.join(folder, name))


def clear_statuses(folder: str) -> None:
    """Remove an earlier run's status files, claims and manifest (in the job's folder and its later
    jobs' folders), so that they never speak for this run."""
    for here in job_folders(folder):
        for name in os.listdir(here):
            if STATUS.match(name) or PROCESS_STATUS.match(name) or PARTIAL_STATUS.match(name) \
                    or CLAIM.match(name) or TASK_CLAIM.match(name) or name == MANIFEST:
                os.unlink(os.path.join(here, name))


def _read_status(path: str) -> Optional[Dict[str, Any]]:
    try:
        document = read_json(path, "a rank's status")
    except InputError:
        return None
    return document if isinstance(document, dict) else None


def _count(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_WORLD_SIZE else None


def collect(folder: str, keep: bool = False) -> Optional[JobManifest]:
    """Gather the ranks' status files into a manifest (and remove them, unless `keep`: the training
    callbacks, where each rank rewrites the manifest as it finishes); None when no rank left one (a
    process without RANK, or a launcher that never started Python)."""
    statuses: Dict[int, Dict[str, Any]] = {}
    for name in os.listdir(folder):
        found = STATUS.match(name)
        if found:
            path = os.path.join(folder, name)
            statuses[int(found.group(1))] = (_read_status(path)
                                             or {"state": FAILED, "error": "its status file was unreadable"})
            if not keep:
                os.unlink(path)
    if not statuses:
        return None
    sizes = [s for s in (_count(d.get("world_size")) for d in statuses.values()) if s is not None]
    world_size = max(sizes + [max(statuses) + 1])
    ranks = []
    for rank in range(world_size):
        document = statuses.get(rank)
        if document is None:
            ranks.append(RankRecording(rank, NOT_STARTED))
            continue
        text = {k: str(document[k])[:500] for k in ("file", "error", "at", "refused", "out_of_memory", "died")
                if isinstance(document.get(k), str)}
        state = document.get("state")
        if state not in (WRITTEN, FAILED, NOTHING, UNFINISHED, BEFORE_TORCH, NO_TORCH):
            state, text["error"] = FAILED, text.get("error", "its status file says no state memdiff writes")
        ranks.append(RankRecording(rank, state, **text))
    manifest = JobManifest(world_size, ranks)
    # The ranks said to run (launch.RANKS), when only some do: the others are `not emulated`, never missing
    # (a job of several nodes whose Lightning launcher starts its first node's ranks here).
    running = {r for d in statuses.values() if isinstance(d.get("running"), str)
               for r in d["running"].split(",") if DIGITS.fullmatch(r) and int(r) < world_size}
    if not running:
        return manifest
    first_node = any(d.get("first_node") is True for d in statuses.values())
    return replace(manifest.only(sorted(int(r) for r in running)), first_node=first_node)


@dataclass(frozen=True)
class ProcessRecord:
    """What one process of a job that is no rank (or a rank's status, read the same way) said of itself."""

    pid: int
    command: str
    state: str
    error: Optional[str] = None
    started_without_hook: Tuple[str, ...] = ()  # processes it started that memdiff's hook cannot reach
    died: Optional[str] = None  # the exception (or failing exit status) that ended it

    def why_nothing(self) -> str:
        """Why this process wrote no snapshot, in a reader's words."""
        if self.state == NO_TORCH:
            return "never imported torch" + (f" ({self.error})" if self.error else "")
        if self.state == BEFORE_TORCH:
            return "ended before it imported torch, without running its exit handlers"
        if self.state == FAILED:
            return f"could not record: {self.error}"
        if self.state == UNFINISHED:
            return "ended without writing its snapshot (SIGKILL, os._exit(), or a crash in native code)"
        if self.state == NOTHING and self.error:
            return self.error
        return "imported torch and allocated nothing"


def collect_processes(folder: str) -> List[ProcessRecord]:
    """Gather (and remove) the status files of the job's processes that are no rank, in pid order."""
    found = []
    for name in os.listdir(folder):
        match = PROCESS_STATUS.match(name)
        if not match:
            continue
        path = os.path.join(folder, name)
        document = _read_status(path) or {"state": FAILED, "error": "its status file was unreadable"}
        os.unlink(path)
        started = document.get("started_without_hook")
        found.append(ProcessRecord(
            int(match.group(1)), str(document.get("command", ""))[:300], str(document.get("state", "")),
            str(document["error"])[:500] if isinstance(document.get("error"), str) else None,
            tuple(str(c)[:300] for c in started[:5]) if isinstance(started, list) else (),
            str(document["died"])[:500] if isinstance(document.get("died"), str) else None))
    return sorted(found, key=lambda p: p.pid)


def write_manifest(folder: str, manifest: JobManifest) -> None:
    """Write the manifest beside the rank files, atomically."""
    write_output(os.path.join(folder, MANIFEST), json.dumps(manifest.to_dict(), indent=1) + "\n")


@dataclass(frozen=True)
class RecordedJob:
    """What a job folder's manifest says of the job as a whole."""

    world_size: int
    exit_status: Optional[int]  # None: a manifest that does not say (or the command's own 0)
    emulated: Optional[List[int]] = None  # the ranks that ran, when only some did (--ranks); None: all
    picked: bool = False  # whether --ranks auto picked them (the manifest's picked_ranks say why)
    first_node: bool = False  # whether they are its first node's, as a script's own Lightning launcher starts them


def read_manifest(folder: str) -> Optional[RecordedJob]:
    """What a job folder's manifest records; None without a manifest. A manifest that is there
    but unreadable is bad input: it must never silently stop a missing rank being seen."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    document = read_json(path, "a job manifest")
    version = document.get("memdiff_job_version", MANIFEST_VERSION) if isinstance(document, dict) else MANIFEST_VERSION
    if type(version) is not int or version != MANIFEST_VERSION:
        # A manifest of another version may say what this memdiff would misread (which ranks ran).
        raise InputError(path, f"memdiff_job_version {version_shown(version)} is not one this memdiff reads "
                               f"({MANIFEST_VERSION}): read the job with the memdiff that wrote it")
    size = _count(document.get("world_size")) if isinstance(document, dict) else None
    if size is None:
        value = document.get("world_size") if isinstance(document, dict) else document
        raise InputError(path, f"world_size must be a rank count (1-{MAX_WORLD_SIZE:,}), not {brief(value)}")
    status = document.get("exit_status")
    if status is not None and not (isinstance(status, int) and not isinstance(status, bool) and 0 <= status < 256):
        raise InputError(path, f"exit_status must be an exit status (0-255), not {brief(status)}")
    emulated = document.get("emulated_ranks")
    if emulated is not None and not (isinstance(emulated, list) and emulated and all(
            isinstance(r, int) and not isinstance(r, bool) and 0 <= r < size for r in emulated)):
        raise InputError(path, f"emulated_ranks must list ranks below world_size {size}, not {brief(emulated)}")
    return RecordedJob(size, status, emulated, emulated is not None and isinstance(document.get("picked_ranks"), list),
                       emulated is not None and document.get("first_node") is True)
