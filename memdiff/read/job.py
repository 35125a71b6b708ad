"""Jobs: a folder or glob of per-rank snapshots (or summaries), each file's rank read from its name.

Distributed launchers write one snapshot per rank, and each trainer names them its own way:
torchtitan `iteration_N/rank{R}_memory_snapshot.pickle`, Megatron `memory_trace_{R}.pickle`,
Composer `rank{R}.{batch}.memory_snapshot`, and `memdiff record -o runs/` `rank{R}.pickle`.
RANK_PATTERNS are tried in order on the file name; `--rank-pattern` replaces them with a
regex whose first group is the rank.

Reading a job is a map (each file to its few-KB summary) and a reduce over summaries only; the
map runs in local worker processes or, for jobs that outgrow one machine, on a Dask cluster.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from memdiff.analyse.classify import Rule
from memdiff.analyse.patterns import Pattern
from memdiff.cluster import connect, failed
from memdiff.errors import InputError
from memdiff.model import Summary
from memdiff.numbers import whole_number
from memdiff.read.inputs import read_summaries, read_summary
from memdiff.recording.manifest import MANIFEST, RecordedJob, read_manifest
from memdiff.units import count_of

if TYPE_CHECKING:
    from memdiff.read.window import Window

# `rank3`, `rank-3`, `rank_3`, `rank3_memory_snapshot`, `rank3.0.memory_snapshot`; then a
# trailing number (`memory_trace_3.pickle`, `snapshot-3.json.gz`).
# [0-9], not \d: `rank١` is no rank 1 (memdiff.numbers).
RANK_PATTERNS = (r"(?i)(?:^|[^a-z])rank[-_]?([0-9]+)(?![0-9])", r"[-_.]([0-9]+)(?:\.[a-z]+)*$")
# What `memdiff record -o DIR/` writes for a process that is no rank: a launcher's, or a child
# that inherited its rank's RANK (a DataLoader worker).
PER_PROCESS = re.compile(r"^pid\d+\.pickle$")
HIDDEN = (".", "_")  # recording leftovers (`.rank0.pickle.recording`) and editor files
MAX_RANKS = 1 << 20


@dataclass(frozen=True)
class RankFile:
    """One rank's file in a job."""

    rank: int
    path: str


def is_job(arg: str) -> bool:
    """Whether a command-line input names a job (a folder, or a quoted glob that matches files)
    rather than one file. A glob that matches nothing is no job: it stays a missing file, so a
    gate on it is bad input rather than nothing gated."""
    return os.path.isdir(arg) or (not os.path.exists(arg) and glob.has_magic(arg) and bool(glob.glob(arg)))


def rank_of(name: str, patterns: Sequence[Pattern]) -> Optional[int]:
    """The rank a file name says, by the first pattern that matches it; None when none does."""
    for pattern in patterns:
        found = pattern.search(name)
        if found is not None:
            try:
                return whole_number(found.group(1))
            except (IndexError, ValueError, TypeError):
                raise InputError(f"--rank-pattern {pattern.pattern}",
                                 "needs one group that captures the rank's digits, e.g. 'gpu(\\d+)'") from None
    return None


def rank_patterns(user: Optional[str]) -> List[Pattern]:
    """The documented patterns, or the user's `--rank-pattern` alone."""
    if user is None:
        return [Pattern(p, "memdiff.read.job.RANK_PATTERNS", timeout=None) for p in RANK_PATTERNS]
    try:
        return [Pattern(user, "--rank-pattern")]
    except ValueError as exc:
        raise InputError("--rank-pattern", str(exc)) from None


@dataclass(frozen=True)
class Job:
    """A job's rank files, the ranks it lacks, and the files in it that are no rank."""

    files: List[RankFile]
    missing: List[int]  # below the highest rank, or below the world size its manifest records
    extra: List[str]  # per-process files (pid{PID}.pickle): a DataLoader worker's, a launcher's
    beyond: List[str] = field(default_factory=list)  # ranks past the manifest's world size: an earlier run's
    world_size: Optional[int] = None
    exit_status: Optional[int] = None  # how the recorded job's command ended, as its manifest says
    emulated: Optional[List[int]] = None  # the ranks that ran, when only some did (record --ranks); None: all
    picked: bool = False  # whether record --ranks auto picked them, one per role
    first_node: bool = False  # whether they are its first node's, as a script's own Lightning launcher starts them

    def unfinished(self) -> Optional[str]:
        """Why the job's memory is no finished run's, when its manifest says its command failed."""
        if not self.exit_status:
            return None
        how = {130: "Ctrl-C", 143: "SIGTERM", 129: "SIGHUP"}.get(self.exit_status, f"exit status {self.exit_status}")
        return f"the recorded job ended with {how} (its {MANIFEST}): its ranks may have stopped early"

    def note(self) -> Optional[str]:
        """What reading the job left out, for stderr; None when nothing was."""
        parts = []
        if self.extra:
            parts.append(f"{count_of(len(self.extra), 'per-process file')} "
                         f"({_shown(self.extra)}) {'are' if len(self.extra) != 1 else 'is'} no rank: not read "
                         f"(memdiff peak reads one)")
        if self.beyond:
            parts.append(f"{_shown(self.beyond)}: not of this job, whose {MANIFEST} says "
                         f"{count_of(self.world_size or 0, 'rank')} (an earlier run's?): not read")
        if self.emulated is not None and self.first_node:
            parts.append(f"{count_of(len(self.emulated), 'rank')} of {count_of(self.world_size or 0, 'rank')} "
                         f"emulated, its first node's, as its Lightning launcher starts them here: the other "
                         f"nodes' were not run")
        elif self.emulated is not None:
            parts.append(f"{count_of(len(self.emulated), 'rank')} of {count_of(self.world_size or 0, 'rank')} "
                         f"emulated, each alone (record --ranks {self._asked()})"
                         + (": the others were not run" if len(self.emulated) < (self.world_size or 0) else ""))
        unfinished = self.unfinished()
        if unfinished:
            parts.append(unfinished)
        return "; ".join(parts) or None

    def _asked(self) -> str:
        """The ranks as record's --ranks named them, or as --ranks auto picked them."""
        listed = ranges(self.emulated or []).replace(", ", ",")
        return f"auto picked {listed}, one per role, each with why in its {MANIFEST}" if self.picked else listed


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _recorded(arg: str, paths: Sequence[str]) -> Optional[RecordedJob]:
    """What memdiff record's manifest beside the job's files says of the job, if there is one."""
    folders = {os.path.dirname(p) for p in paths} if not os.path.isdir(arg) else {arg}
    return read_manifest(folders.pop()) if len(folders) == 1 else None


def discover(arg: str, rank_pattern: Optional[str] = None, allow_missing: bool = False) -> Job:
    """The rank files of a job, by rank; InputError when the job is empty, a name says no rank,
    two files claim one rank, or ranks are missing (unless `allow_missing`): gaps, and the last
    ranks of a recorded job whose manifest says how many it had."""
    if os.path.isdir(arg):
        paths = [os.path.join(arg, n) for n in sorted(os.listdir(arg))]
    else:
        paths = sorted(glob.glob(arg))
    paths = [p for p in paths if not os.path.basename(p).startswith(HIDDEN) and os.path.basename(p) != MANIFEST]
    # A folder beside the ranks is another job's (record's job2/); anything else that is no regular file (a
    # dangling link, a FIFO, a device) may be a rank's file that is gone, and was dropped without a word: the
    # job then read as one rank smaller.
    odd = next((p for p in paths if not os.path.isfile(p) and not os.path.isdir(p)), None)
    if odd is not None:
        raise InputError(odd, "is no regular file (a dangling link, a FIFO, a device): a job's files must be "
                              "snapshots; remove it or point at the ranks' files with a glob")
    paths = [p for p in paths if os.path.isfile(p)]
    extra = [os.path.basename(p) for p in paths if PER_PROCESS.match(os.path.basename(p))]
    ranked = [p for p in paths if not PER_PROCESS.match(os.path.basename(p))]
    if not ranked:
        what = ("no rank files here" if os.path.isdir(arg)
                else "the pattern matches no rank file" if extra else "the pattern matches no file")
        raise InputError(arg, what + (f": {len(extra):,} per-process file(s) (pid{{PID}}.pickle, from a run without "
                                      f"RANK) are no rank; read one with `memdiff peak`" if extra else ""))
    patterns = rank_patterns(rank_pattern)
    by_rank: Dict[int, str] = {}
    for path in ranked:
        rank = rank_of(os.path.basename(path), patterns)
        if rank is None or rank >= MAX_RANKS:
            raise InputError(path, "no rank in the file name (rank3, rank-3, rank3_..., name_3.pickle); "
                                   "give --rank-pattern REGEX with one group for the rank")
        if rank in by_rank:
            raise InputError(arg, f"rank {rank} has two files: {os.path.basename(by_rank[rank])} and "
                                  f"{os.path.basename(path)} (pick one step's files with a glob)")
        by_rank[rank] = path
    recorded = _recorded(arg, ranked)
    world_size = recorded.world_size if recorded else None
    # The manifest of the run that wrote the folder says which ranks are its: files of higher
    # ranks are an earlier, larger run's, left in the folder, and never read as this job's.
    # So are files of ranks its manifest says were not run (record --ranks).
    emulated = recorded.emulated if recorded else None
    beyond = sorted((r for r in by_rank if (world_size is not None and r >= world_size)
                     or (emulated is not None and r not in emulated)))
    beyond_names = [os.path.basename(by_rank.pop(r)) for r in beyond]
    if not by_rank:
        raise InputError(arg, f"no rank file of the job its {MANIFEST} describes "
                              f"({count_of(world_size or 0, 'rank')}): {_shown(beyond_names)} are of an earlier run")
    expected = max(max(by_rank) + 1, world_size or 0)
    # A job of which only some ranks were emulated (--ranks) misses none of the others.
    missing = [r for r in range(expected) if r not in by_rank and (emulated is None or r in emulated)]
    if missing and not allow_missing:
        said = f" (its {MANIFEST} says {world_size})" if world_size and world_size > max(by_rank) + 1 else ""
        raise InputError(arg, f"{count_of(len(missing), 'rank')} missing of 0-{expected - 1}{said}: {ranges(missing)} "
                              f"(--allow-missing-ranks to read the job anyway)")
    return Job([RankFile(rank, by_rank[rank]) for rank in sorted(by_rank)], missing, extra, beyond_names, world_size,
               recorded.exit_status if recorded else None, emulated, bool(recorded and recorded.picked),
               bool(recorded and recorded.first_node))


def ranges(numbers: Sequence[int]) -> str:
    """`1, 4-7, 9`: ascending numbers as runs, the way a user lists ranks."""
    parts: List[str] = []
    start = prev = None
    for n in list(numbers) + [None]:
        if n is not None and prev is not None and n == prev + 1:
            prev = n
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = n
    return ", ".join(parts)


def ranks_text(ranks: Sequence[int]) -> str:
    """`rank 3` or `ranks 0-2, 5`."""
    return f"rank{'s' if len(ranks) != 1 else ''} {ranges(ranks)}"


def summarize_ranks(files: Sequence[RankFile], rules: Sequence[Rule], dask: Optional[str] = None,
                    history: bool = False, window: Optional["Window"] = None) -> List[Summary]:
    """Each rank's classified Summary, in the order of `files` (of `window` only, when given): in
    local worker processes, or on the Dask scheduler at `dask` (each worker reads its files from
    the shared path)."""
    paths = [f.path for f in files]
    if dask is None:
        return read_summaries(paths, rules, history, window)
    return _on_dask(dask, paths, rules, history, window)


def _summary_document(path: str, rules: Sequence[Rule], history: bool,
                      window: Optional["Window"] = None) -> Dict[str, Any]:
    # Workers send back the JSON form: plain data crosses any Dask serializer unchanged.
    return read_summary(path, rules, history, window).to_dict()


def _on_dask(address: str, paths: Sequence[str], rules: Sequence[Rule], history: bool,
             window: Optional["Window"] = None) -> List[Summary]:
    with connect(address) as client:
        # pure=False: a file may change between two runs under the same path.
        futures = client.map(_summary_document, list(paths), rules=list(rules), history=history, window=window,
                             pure=False)
        try:
            documents = client.gather(futures)  # a worker's InputError is raised here as it is
        except (OSError, TimeoutError) as exc:
            raise failed(address, exc) from None
    return [Summary.from_dict(d) for d in documents]
